"""``scripts/multinode-loopback``: real ranks on separate network namespaces, bytes over veth links.

Needs root and ``ip`` (the script exits 77 otherwise, which becomes a skip
naming the reason).  Each run must leave no namespace behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "multinode-loopback"
SKIP = 77

pytestmark = pytest.mark.slow


def run(*args: str, env: dict | None = None, timeout: float = 240) -> tuple[int, list[dict], str, int]:
    """Run the script; return its status, JSON report lines, stderr and pid."""
    environ = {**os.environ, "KVLEND_PYTHON": sys.executable, **(env or {})}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=environ)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the script's own handler cleans up on SIGTERM
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"multinode-loopback ran past {timeout} s:\n{err[-3000:]}")
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, reports, err, proc.pid


def leftover_namespaces(pid: int) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(f"kvl{pid}-")]


def run_or_skip(*args: str) -> tuple[list[dict], str]:
    rc, reports, err, pid = run(*args)
    if rc == SKIP:
        pytest.skip(err.strip().splitlines()[-1] if err.strip() else "multinode-loopback cannot run here")
    assert leftover_namespaces(pid) == [], "the script left network namespaces behind"
    assert rc == 0, err[-6000:]
    return reports, err


def test_pairs_verify_and_bytes_cross_the_links():
    reports, err = run_or_skip("--requests", "8")
    by_pair = {r["pair"]: r for r in reports}
    assert set(by_pair) == {"A", "B"}, reports
    # Pair A: each TP2 decode rank read half of the TP1 prefill's heads, so A and B move the same bytes.
    assert by_pair["A"]["bytes"] == by_pair["B"]["bytes"] == 8 * 2 * 2**20
    for r in reports:
        assert r["verified"] is True and r["passed"] is True, r
        assert r["rx_bytes"] >= r["bytes"] > 0, r
        assert r["gbps"] > 0
    assert "PASS" in err


def test_broken_link_fails_typed_within_deadline_and_other_pair_completes():
    reports, err = run_or_skip("--break-link", "--requests", "8")
    by_pair = {r["pair"]: r for r in reports}
    assert by_pair["A"]["verified"] is True and by_pair["A"]["rx_bytes"] >= by_pair["A"]["bytes"] > 0
    broken = by_pair["B"]
    assert broken["verified"] is False and broken["link_down_at_s"] is not None
    failure = broken["failure"]
    assert failure["error"] in ("PeerLost", "TransferTimeout"), failure
    assert failure["seconds"] <= failure["deadline"] + 2.0, failure
    assert broken["leases_not_released"] == 0  # the prefill's leases expired: no page stays locked


def test_missing_python_is_a_distinct_status_and_creates_nothing():
    rc, reports, err, pid = run(env={"KVLEND_PYTHON": "/nonexistent/python"}, timeout=60)
    assert rc == SKIP and reports == []
    assert "SKIP" in err
    if os.geteuid() == 0:
        assert leftover_namespaces(pid) == []
