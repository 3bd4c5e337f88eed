"""kvlend inside real vLLM servers with tensor parallel on one side: prefill TP 1 -> decode TP 2, and
prefill TP 2 -> decode TP 1, token for token against one plain server.  No prefill is told its
decodes' TP: one TP 1 prefill serves a TP 2 and a TP 1 decode in the same run.

The tiny model has 2 KV heads, so at TP 2 each worker holds one: every decode worker must read
exactly its head of every block (TP 1 -> 2: half a block each, from the one prefill worker), or
both heads from the two prefill workers (TP 2 -> 1: two fetches per request into the same
blocks).  The decode answers nothing from its own prefix cache, so each answer's KV crossed
kvlend; the per-worker stats lines say how.  float32: tensor parallel changes the order of
vLLM's reductions, and in bf16 one prompt of eight came out different through a TP 2 decode
whose every fetch was whole and verified.  UCX over tcp, as test_vllm.py.  About two and a
half minutes on 2 cores.
"""

from __future__ import annotations

import os
import random

import pytest

from kvlend_vllm import launch
from tests.support.vllm_rig import Rig, ensure_model, generate, plain_answers, wait_for_stats

pytestmark = pytest.mark.system

LENGTHS = [5, 127, 128, 129, 300, 700, 1000, 1500]
MAX_TOKENS = 6
# The tiny model's KV per 128-token block: 2 layers x K and V x 2 KV heads x 64 x 128 tokens x 4 bytes.
BLOCK_BYTES = 2 * 2 * 2 * 64 * 128 * 4
TCP = {"UCX_TLS": "tcp"}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The prompts and a plain TP 1 server's greedy answers to them."""
    assert os.path.exists(launch.VLLM_VENV_PYTHON), "no .venv-vllm: scripts/test runs scripts/vllm-setup first"
    model = ensure_model("tiny")
    rng = random.Random(24)
    prompts = [[rng.randrange(4, 1000) for _ in range(n)] for n in LENGTHS]
    return model, prompts, plain_answers(model, prompts, MAX_TOKENS, str(tmp_path_factory.mktemp("vllm-tp-plain")),
                                         dtype="float32")


def run(tmp_path, model, prompts, prefill_tp: int, decode_tps: tuple[int, ...], max_tokens: int = MAX_TOKENS,
        prefix_caching: bool = True) -> list[tuple[list, list]]:
    """One prefill (TP prefill_tp, told nothing of its decodes; ``prefix_caching`` on it) and a decode of
    each TP in ``decode_tps``, each behind a router of its own: per decode, the answers through it and its
    workers' stats lines (one per load and worker)."""
    rig = Rig(model, str(tmp_path))
    try:
        prefill = rig.engine("prefill", launch.kvlend_transfer_config("kv_producer"), tp=prefill_tp,
                             dtype="float32", env=TCP, prefix_caching=prefix_caching)
        decodes, routers, stats = [], [], []
        for i, tp in enumerate(decode_tps):
            stats.append(str(tmp_path / f"decode-{i}-stats.jsonl"))
            decodes.append(rig.engine(f"decode-{i}", launch.kvlend_transfer_config("kv_consumer",
                                                                                  {"stats_path": stats[-1]}),
                                      tp=tp, prefix_caching=False, dtype="float32", env=TCP))
            routers.append(rig.router(f"router-{i}", prefill, decodes[-1]))
        rig.wait(prefill, *decodes, *routers)
        out = []
        for router, path, tp in zip(routers, stats, decode_tps):
            got = generate(router, model, prompts, max_tokens)
            out.append((got, wait_for_stats(path, tp * len(prompts))))  # a load's line comes with its acks
    finally:
        rig.close()
    return out


def test_one_prefill_told_no_decode_tp_serves_a_tp2_and_a_tp1_decode(tmp_path, plain):
    """TP 1 -> 2: each decode worker reads its head, under its share of the prefill worker's lease; the
    same prefill then serves a TP 1 decode, which reads the lease itself."""
    model, prompts, expected = plain
    (got, lines), (got_tp1, lines_tp1) = run(tmp_path, model, prompts, 1, (2, 1))
    assert [n for n, g, e in zip(LENGTHS, got, expected) if g != e] == []
    assert all(s["fetches"] == 1 and s["ok"] for s in lines) and len(lines) == 2 * len(LENGTHS), lines
    for rank in (0, 1):
        mine = [s for s in lines if s["tp_rank"] == rank]
        # One of the two KV heads of every block: exactly half the block's bytes.
        assert all(s["bytes"] == s["blocks"] * BLOCK_BYTES // 2 > 0 for s in mine), mine
        assert sorted(s["bound"] for s in mine) == sorted(LENGTHS), mine
    assert [n for n, g, e in zip(LENGTHS, got_tp1, expected) if g != e] == []
    assert len(lines_tp1) == len(LENGTHS) and all(s["ok"] and s["fetches"] == 1 for s in lines_tp1), lines_tp1
    assert all(s["bytes"] == s["blocks"] * BLOCK_BYTES > 0 for s in lines_tp1), lines_tp1


def test_prefill_tp2_to_decode_tp1_the_decode_reads_both_prefill_workers_heads(tmp_path, plain):
    model, prompts, expected = plain
    ((got, lines),) = run(tmp_path, model, prompts, 2, (1,))
    assert [n for n, g, e in zip(LENGTHS, got, expected) if g != e] == []
    assert len(lines) == len(LENGTHS), lines
    # Two fetches per request (one per prefill worker, one head each) make up whole blocks.
    assert all(s["ok"] and s["fetches"] == 2 and s["bytes"] == s["blocks"] * BLOCK_BYTES > 0
               for s in lines), lines
    assert sorted(s["bound"] for s in lines) == sorted(LENGTHS)
