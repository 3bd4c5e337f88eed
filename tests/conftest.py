"""Test tiers and hypothesis profiles; the shared rigs and helpers live in ``tests.support``.

Every test carries exactly one tier marker (registered in pyproject.toml): ``unit`` (one process, nothing
but memory: pure code and in-memory fakes), ``nixl`` (real NIXL agents in this process) or ``system``
(child processes, etcd, network namespaces, vLLM servers). A module marks itself with ``pytestmark``; a
module that mixes tiers marks each test instead.
"""

from __future__ import annotations

import pytest

import tests.support.profiles  # noqa: F401  (registers the "quick" hypothesis profile before it is loaded)

TIERS = ("unit", "nixl", "system")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = [f"  {item.nodeid}: {tiers or 'none'}" for item in items
             if len(tiers := [m.name for m in item.iter_markers() if m.name in TIERS]) != 1]
    if wrong:
        raise pytest.UsageError(f"every test carries exactly one of the tiers {', '.join(TIERS)}:\n" + "\n".join(wrong))
