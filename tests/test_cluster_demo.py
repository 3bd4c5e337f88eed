"""``scripts/cluster-demo``: one etcd member, two prefills and a decode on loopback, found through etcd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cluster-demo"

pytestmark = pytest.mark.slow


def etcd_pids() -> set[str]:
    out = subprocess.run(["pgrep", "-f", "kvlend-etcd-"], capture_output=True, text=True).stdout
    return set(out.split())


def test_the_decode_finds_both_prefills_through_etcd_and_verifies_every_request():
    before = etcd_pids()
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
    assert etcd_pids() <= before  # its etcd member was stopped
