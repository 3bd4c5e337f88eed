"""``scripts/gpu-check`` on a host without a GPU: it says so and exits 77; ``--host-only`` runs its cases DRAM->DRAM.

The VRAM cases themselves need a GPU host (see BENCHMARKS.md); this keeps the
script's planning, posting, raw baseline and byte check working between such runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_without_a_gpu_it_says_so_and_exits_77():
    import torch  # the NIXL plugin brings it

    if torch.cuda.is_available():  # CI hosts have none; on a GPU host the script runs the VRAM cases instead
        pytest.skip("this host has a GPU: the real check runs instead (scripts/gpu-check)")
    out = run("--quick")
    assert out.returncode == 77, out.stderr
    assert "skipped: no CUDA device here" in out.stdout


def test_host_only_moves_every_case_and_verifies_every_byte(tmp_path):
    report = tmp_path / "gpu-check.json"
    out = run("--host-only", "--quick", "--json", str(report))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(report.read_text())["rows"]
    assert [(r["case"], r["bytes"]) for r in rows] == [("DRAM->DRAM", 1 << 20), ("DRAM->DRAM", 16 << 20)]
    assert all(r["verified"] and r["kvlend_gbps"] > 0 and r["raw_gbps"] > 0 and r["descriptors"] > 0 for r in rows)
    assert "every byte verified" in out.stdout
