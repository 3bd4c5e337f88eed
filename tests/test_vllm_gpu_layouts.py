"""vLLM's GPU attention backends' KV caches, built on CPU by vLLM's own allocation code, are described by kvlend
exactly or refused: never wrongly.

Run in .venv-vllm, in a child interpreter (``tests/support/vllm_gpu_layouts.py`` says what it checks).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvlend_vllm import launch
from tests.support.children import child_env

pytestmark = pytest.mark.system

MHA = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
MLA = ("TRITON_MLA", "FLASHMLA", "FLASHINFER_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA")


@pytest.fixture(scope="module")
def probe() -> dict:
    assert os.path.exists(launch.VLLM_VENV_PYTHON), "no .venv-vllm: scripts/test runs scripts/vllm-setup first"
    out = subprocess.run([launch.VLLM_VENV_PYTHON, "-m", "tests.support.vllm_gpu_layouts"], capture_output=True,
                         text=True, timeout=300, env=child_env())
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_backend_layout_is_described_exactly_or_refused(probe):
    assert probe["problems"] == []
    for backend, got in probe["checked"].items():
        for case, result in got["results"].items():
            assert result.startswith(("exact", "refused: ", "vllm refuses: ")), (backend, case, result)


def test_the_important_backends_were_checked_wherever_they_import(probe):
    for name in MHA + MLA:
        assert name in probe["checked"] or name in probe["import_failed"], name
    assert "FLASH_ATTN" in probe["checked"] and "TRITON_ATTN" in probe["checked"]  # they import on CPU torch
    assert any(name in probe["checked"] for name in MLA)


def test_head_and_token_major_blocks_move_whole_and_heads_outside_blocks_are_refused(probe):
    for backend in ("FLASH_ATTN", "TRITON_ATTN"):
        results = probe["checked"][backend]["results"]
        for layout in ("LBHNC", "LBNHC", "BLHNC", "BLNHC"):  # HND and NHD pages, per layer or packed per block
            assert results[f"{layout}/bs16"] == "exact", (backend, layout)
        for layout in ("LHBNC", "BHLNC"):
            assert "which a kvlend page cannot say" in results[f"{layout}/bs16"], (backend, layout)


def test_an_mla_latent_block_and_kernel_blocks_move_whole(probe):
    results = probe["checked"]["TRITON_MLA"]["results"]
    assert all(r == "exact" for r in results.values()), results
    assert "exact, 2 kernel blocks per block" in probe["checked"]["FLASHMLA"]["results"].values()
