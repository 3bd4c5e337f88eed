"""``scripts/cluster-demo``: one etcd member, two prefills and a decode on loopback, found through etcd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cluster-demo"

pytestmark = pytest.mark.system


def running_etcd(pid: int) -> bool:
    """Whether ``pid`` is still a kvlend etcd member (other tests on the host may run their own)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"kvlend-etcd-" in f.read()
    except FileNotFoundError:
        return False


def test_the_decode_finds_both_prefills_through_etcd_and_verifies_every_request():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--requests", "16", "--timeout", "90"],
                          capture_output=True, text=True, timeout=150, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    decode = report["decode"]
    assert report["verified"] is True and decode["requests"] == 16 and not decode["mismatched"]
    assert set(decode["per_prefill"]) == {"prefill-0", "prefill-1"}  # routed over both, found in etcd alone
    assert sum(r["requests"] for r in decode["per_prefill"].values()) == 16
    for name in ("prefill-0", "prefill-1"):
        assert report[name]["leases_left"] == 0 and report[name]["released"] == {"done": report[name]["lent"]}
    assert "live ranks" in proc.stderr and "prefill-0" in proc.stderr  # kvlend cluster status, midway
    assert report["etcd_pids"] and not any(map(running_etcd, report["etcd_pids"]))  # its etcd member was stopped
