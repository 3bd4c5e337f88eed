"""The integration guide's examples run and verify (real NIXL agents; the in-memory world); the guide names only
real API."""

from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "engine_integration.py"
GUIDE = (ROOT / "docs" / "integration.md").read_text()


@pytest.mark.system
def test_engine_integration_example_verifies():
    run = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "verified: yes (4/4 requests)", run.stdout
    requests = [line for line in lines if line.startswith("req-")]
    assert len(requests) == 4 and all("tokens match" in line for line in requests), run.stdout
    for line in requests:  # the full layer is locked while lent and free after; the window layer is partly free
        lent, total, after = map(int, re.search(r"full layer (\d+)/(\d+) while lent, (\d+)/", line).groups())
        window = int(re.search(r"window layer (\d+)/", line).group(1))
        assert lent == 0 and after == total and 0 < window < total, line
        tokens, pages = map(int, re.search(r"(\d+) tokens into (\d+) decode pages", line).groups())
        assert pages == -(-tokens // 16) * 2, line  # 16-token prefill pages land whole as two 8-token pages
    # One fetch was cancelled on purpose, reported failed only once quiet, then lent and read again.
    assert "cancelled req-1 on purpose: state failed, quiet True, TransferCancelled at bound 0" in lines, run.stdout
    assert "prefill: lease of req-1 ended: aborted" in lines, run.stdout


# ---------------------------------------------------------------- the guide's identifiers


def _classes() -> dict[str, object]:
    from kvlend.core.layout import PageLayout
    from kvlend.core.lender import Lease
    from kvlend.demo import toy_engine
    from kvlend.metrics import METRICS
    from kvlend.protocol.wire import LeaseOffer
    from kvlend.runtime import DecodeNode, FetchHandle, FetchResult, Link, NodeConfig, PrefillNode, Ticket

    return {
        "prefill": PrefillNode, "decode": DecodeNode, "handle": FetchHandle, "victim": FetchHandle,
        "result": FetchResult, "link": Link, "ticket": Ticket, "Ticket": Ticket, "lease": Lease,
        "offer": LeaseOffer, "layout": PageLayout, "p_layout": PageLayout, "d_layout": PageLayout,
        "p_cache": toy_engine.PagedKVCache, "d_cache": toy_engine.PagedKVCache, "METRICS": METRICS,
        "NodeConfig": NodeConfig,
    }


def _has(owner, name: str) -> bool:
    if hasattr(owner, name):
        return True
    if dataclasses.is_dataclass(owner):
        return name in {f.name for f in dataclasses.fields(owner)}
    return False


def _code() -> list[str]:
    """The guide's python blocks and inline code spans (not shell command lines)."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE, re.S)
    prose = re.sub(r"```.*?```", "", GUIDE, flags=re.S)
    spans = [s for s in re.findall(r"`([^`\n]+)`", prose) if not s.startswith("kvlend ")]
    return blocks + spans


@pytest.mark.unit
def test_every_attribute_the_guide_uses_exists():
    classes = _classes()
    pattern = re.compile(r"\b(" + "|".join(classes) + r")\.([A-Za-z_]\w*)")
    used = {(var, attr) for text in _code() for var, attr in pattern.findall(text)}
    assert len(used) > 30, sorted(used)  # the scan finds what the guide uses
    missing = sorted(f"{var}.{attr}" for var, attr in used if not _has(classes[var], attr))
    assert not missing, f"docs/integration.md uses names that do not exist: {missing}"


@pytest.mark.unit
def test_every_import_in_the_guide_resolves():
    imports = re.findall(r"^from ([\w.]+) import ([\w, ]+)$", "\n".join(_code()), re.M)
    assert imports
    for module, names in imports:
        mod = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(mod, name), f"docs/integration.md: {module} has no {name}"


@pytest.mark.unit
def test_the_guide_names_every_fetch_state_and_real_errors():
    import kvlend.errors
    from kvlend.runtime import FetchState

    table = {m.group(1) for m in re.finditer(r"^\| `(\w+)` \|", GUIDE, re.M)}
    assert {s.value for s in FetchState} <= table, "the states table misses a FetchState"
    errors = r"`([A-Z]\w+(?:Error|Lost|Timeout|Cancelled|Expired|Unknown|Denied|Mismatch|Fetch))`"
    for name in re.findall(errors, GUIDE):
        assert hasattr(kvlend.errors, name), f"docs/integration.md names {name}, which kvlend.errors lacks"


@pytest.mark.unit
@pytest.mark.parametrize("field", sorted(set(re.findall(r"NodeConfig\.(\w+)", GUIDE))))
def test_the_config_fields_the_guide_names_exist(field):
    from kvlend.runtime import NodeConfig

    assert field in {f.name for f in dataclasses.fields(NodeConfig)}


@pytest.mark.unit
def test_the_guides_in_memory_example_runs_as_written():
    """The block under "Testing your integration without NIXL" is this test's code: the two cannot drift."""
    section = GUIDE.split("## 10. Testing your integration without NIXL", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(block, "docs/integration.md", "exec"), {})  # its asserts are the checks
