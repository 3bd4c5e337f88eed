"""The UCX crash a tcp read window prevents: real NIXL agents over ``UCX_TLS=tcp`` in child processes.

``tests.support.ucx_purge`` stops the target, has the reader post reads and stop progressing,
resumes the target (its answers fill the sockets and the rest wait inside UCX) and SIGKILLs the
reader; UCX then purges the waiting answers and crashes the target (docs/faults.md).  Without
the window the target died in 9 of 9 runs here at 32-64 MiB (1 of 5 without ``_litter``: the
crash depends on stale bytes); with the window's 4 MiB it never did.
"""

from __future__ import annotations

import pytest

from tests.support.ucx_purge import run_once

pytestmark = pytest.mark.system

SIZE, PIECE = 64 << 20, 64 << 10


def test_queued_answers_crash_the_target_without_the_window():
    # the bug, reproduced: it depends on stale memory, so one retry is allowed
    runs = [run_once(SIZE, PIECE, window=False)]
    if not runs[0]["crashed"]:
        runs.append(run_once(SIZE, PIECE, window=False))
    assert any(r["crashed"] for r in runs), runs


def test_the_window_keeps_the_target_alive():
    for _ in range(2):
        out = run_once(SIZE, PIECE, window=True)
        assert 0 < out["posted"] <= 4 << 20, out
        assert out["rc"] is None, out  # still serving after the reader died
