"""kvlend inside real vLLM servers with prefix caching on in both engines (vLLM's default).

Prompts share long prefixes (four 512-token prefixes, each with short distinct suffixes).  A first
wave puts each prefix in the decode's own prefix cache; then 24 more prompts go through
router -> prefill -> kvlend -> decode.  Their greedy answers must equal a plain server's token for
token, and the decode must read only the blocks its cache lacks: each fetch moves exactly
(blocks - blocks held) x the block's bytes.  A negative control in the same test: the answers
compared against the plain server's for other prompts differ.
"""

from __future__ import annotations

import os
import random

import pytest

from kvlend_vllm import launch
from tests.support.vllm_rig import Rig, ensure_model, generate, wait_for_stats, worker_metrics

pytestmark = pytest.mark.system

BLOCK = 128  # tokens per block (vLLM CPU's default)
PREFIX = 4 * BLOCK
# The tiny model's KV per block: 2 layers x K and V x 2 KV heads x 64 x 128 tokens x 2 bytes (bf16).
BLOCK_BYTES = 2 * 2 * 2 * 64 * BLOCK * 2
MAX_TOKENS = 6


def test_prefix_cached_prompts_read_only_their_missing_blocks_and_answer_as_a_plain_server(tmp_path):
    assert os.path.exists(launch.VLLM_VENV_PYTHON), "no .venv-vllm: scripts/test runs scripts/vllm-setup first"
    model = ensure_model("tiny")
    rng = random.Random(512)
    prefixes = [[rng.randrange(4, 1000) for _ in range(PREFIX)] for _ in range(4)]

    def prompt(prefix: list[int]) -> list[int]:
        return prefix + [rng.randrange(4, 1000) for _ in range(rng.randrange(40, 300))]

    first = [prompt(p) for p in prefixes]
    shared = [prompt(prefixes[i % 4]) for i in range(24)]
    stats = str(tmp_path / "decode-stats.jsonl")
    rig = Rig(model, str(tmp_path))
    try:
        plain = rig.engine("plain")
        prefill = rig.engine("prefill", launch.kvlend_transfer_config("kv_producer"))
        decode = rig.engine("decode", launch.kvlend_transfer_config("kv_consumer", {"stats_path": stats}))
        router = rig.router("router", prefill, decode)
        rig.wait(plain, prefill, decode, router)
        expected = generate(plain, model, first + shared, MAX_TOKENS)
        got_first = generate(router, model, first, MAX_TOKENS, concurrency=1)
        cold = len(wait_for_stats(stats, len(first)))  # a fetch's line comes with its done ack: after the answer
        got = generate(router, model, shared, MAX_TOKENS)
        lines = wait_for_stats(stats, len(first) + len(shared))
        held = sum(line["resume_from"] // BLOCK for line in lines)
        local = worker_metrics(decode, model, {"blocks": "vllm:kvlend_local_blocks_total"},
                               lambda got: got.get("blocks", -1) >= held)
    finally:
        rig.close()
    assert all("tokens" in e and len(e["tokens"]) == MAX_TOKENS for e in expected), expected
    assert got_first + got == expected
    assert got != expected[len(first) + 1:] + expected[len(first):len(first) + 1]  # negative control
    assert cold == len(first), lines[:cold]
    fetched = [s for s in lines if s["ok"]]
    assert len(fetched) == len(lines) == len(first) + len(shared), lines  # every prompt's missing KV came over kvlend
    for line in fetched:  # exactly the blocks the decode lacked, at bf16's size
        assert line["resume_from"] % BLOCK == 0 and line["bytes"] == \
            (line["blocks"] - line["resume_from"] // BLOCK) * BLOCK_BYTES > 0, line
    warm = lines[cold:]
    assert all(line["resume_from"] >= PREFIX for line in warm), warm  # the shared prefix was never read again
    saved = sum(line["resume_from"] // BLOCK for line in warm) * BLOCK_BYTES
    moved = sum(line["bytes"] for line in warm)
    assert held > 0 and local.get("blocks") == held, (local, held)  # what the decode reports as not moved
    print(f"\nprefix caching on: {len(warm)} requests moved {moved} bytes, {saved} bytes held locally not moved")
