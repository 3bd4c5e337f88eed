"""kvlend inside real vLLM servers with a float32 KV cache (the suite's other vLLM tests run bf16).

A plain float32 server's greedy answers against router -> prefill -> kvlend -> decode at float32,
token for token, and every block moved at float32's size.  About a minute and a half on 2 cores.
"""

from __future__ import annotations

import os
import random

import pytest

from kvlend_vllm import launch
from tests.support.vllm_rig import Rig, ensure_model, generate, wait_for_stats

pytestmark = pytest.mark.system

LENGTHS = [5, 127, 128, 129, 300, 700]
MAX_TOKENS = 6
# The tiny model's KV per 128-token block: 2 layers x K and V x 2 KV heads x 64 x 128 tokens x 4 bytes.
FLOAT32_BLOCK_BYTES = 2 * 2 * 2 * 64 * 128 * 4


def test_float32_outputs_through_kvlend_equal_a_single_float32_server(tmp_path):
    assert os.path.exists(launch.VLLM_VENV_PYTHON), "no .venv-vllm: scripts/test runs scripts/vllm-setup first"
    model = ensure_model("tiny")
    rng = random.Random(32)
    prompts = [[rng.randrange(4, 1000) for _ in range(n)] for n in LENGTHS]
    stats = str(tmp_path / "decode-stats.jsonl")
    rig = Rig(model, str(tmp_path))
    try:
        plain = rig.engine("plain", dtype="float32")
        prefill = rig.engine("prefill", launch.kvlend_transfer_config("kv_producer"), dtype="float32")
        decode = rig.engine("decode", launch.kvlend_transfer_config("kv_consumer", {"stats_path": stats}),
                            dtype="float32")
        router = rig.router("router", prefill, decode)
        rig.wait(plain, prefill, decode, router)
        expected = generate(plain, model, prompts, MAX_TOKENS)
        got = generate(router, model, prompts, MAX_TOKENS)
        lines = wait_for_stats(stats, len(LENGTHS))  # a fetch's line comes with its done ack
    finally:
        rig.close()
    assert all("tokens" in e and len(e["tokens"]) == MAX_TOKENS for e in expected), expected
    assert [n for n, g, e in zip(LENGTHS, got, expected) if g != e] == []
    fetched = [s for s in lines if s["ok"]]
    assert len(fetched) == len(LENGTHS), fetched  # every prompt's KV came over kvlend, not a local recompute
    assert all(s["bytes"] == s["blocks"] * FLOAT32_BLOCK_BYTES > 0 for s in fetched), fetched
    # Runs of blocks contiguous on both sides are one descriptor: never more than a block per layer's K and V.
    assert all(0 < s["descriptors"] <= s["blocks"] * 2 * 2 for s in fetched), fetched
