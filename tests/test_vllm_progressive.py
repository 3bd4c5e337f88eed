"""Progressive lending inside real vLLM servers: chunked prefill, the decode reading while the prefill
computes, and a prefill short of KV blocks preempting requests whose blocks were being read.

kvlend's router sends each request to the prefill and the decode at once (``--progressive``); the
prefill computes 128 tokens a step (``--max-num-batched-tokens``) and lends each step's blocks.
Answers are compared token for token with a plain server's, float32.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from kvlend_vllm import launch
from tests.support.vllm_rig import Rig, ensure_model, generate, preemptions, wait_for_stats

pytestmark = pytest.mark.system

MAX_TOKENS = 6
PREFILL = {"claim_wait": 25}  # a claim may come before the prefill's scheduler saw the request
DECODE = {"transfer_timeout": 120}  # a fetch spans the prefill's compute


SIDE_BY_SIDE = ("--max-num-batched-tokens", "1024", "--long-prefill-token-threshold", "256",
                "--num-gpu-blocks-override", "17")


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1000) for _ in range(n)] for n in lengths]


def pair(rig: Rig, stats: str, limits=("--max-num-batched-tokens", "128")) -> tuple:
    """A plain server, and a prefill (its scheduler's ``limits``: 128 tokens a step) and a decode behind
    kvlend's router in progressive mode."""
    plain = rig.engine("plain", dtype="float32")
    prefill = rig.engine("prefill", launch.kvlend_transfer_config("kv_producer", PREFILL), dtype="float32",
                         extra=["--max-num-seqs", "4", *limits])
    decode = rig.engine("decode", launch.kvlend_transfer_config("kv_consumer", {**DECODE, "stats_path": stats}),
                        dtype="float32")
    router = rig.router("router", prefill, decode, progressive=True)
    rig.wait(plain, prefill, decode, router)
    return plain, prefill, router


def test_the_decode_reads_a_chunked_prefill_while_it_computes(tmp_path):
    assert os.path.exists(launch.VLLM_VENV_PYTHON), "no .venv-vllm: scripts/test runs scripts/vllm-setup first"
    model = ensure_model("tiny")
    lengths = [5, 300, 1100, 1500, 1900]
    asked = prompts(25, lengths)
    stats = str(tmp_path / "decode-stats.jsonl")
    rig = Rig(model, str(tmp_path))
    try:
        plain, _, router = pair(rig, stats)
        expected = generate(plain, model, asked, MAX_TOKENS)
        got = generate(router, model, asked, MAX_TOKENS, concurrency=1)
        lines = wait_for_stats(stats, len(lengths))
    finally:
        rig.close()
    assert all("tokens" in e and len(e["tokens"]) == MAX_TOKENS for e in expected), expected
    assert [n for n, g, e in zip(lengths, got, expected) if g != e] == []
    assert len(lines) == len(lengths) and all(s["ok"] for s in lines), lines  # every prompt's KV came over kvlend
    long = [s for s in lines if s["blocks"] >= 9]  # 1,100 tokens and more: 9 or more chunks of 128
    assert len(long) == 3 and all(s["final_s"] is not None for s in long), lines
    # A fetch that began before the lease's last extend read while the prefill still computed: bytes went
    # before it, not all of them. On a loaded host the decode may begin one only after the prefill is done
    # (then nothing is early, rightly), but not all three.
    began_early = [s for s in long if s["posted_s"] < s["final_s"]]
    assert began_early and all(0 < s["early_bytes"] < s["bytes"] for s in began_early), long
    assert all(s["early_bytes"] == 0 for s in long if s not in began_early), long


def test_a_prefill_that_preempts_requests_being_read_never_gives_a_wrong_answer(tmp_path):
    """Four prompts of 10 to 12 blocks prefill side by side, 256 tokens a step each, in 16 blocks of 128
    tokens (and vLLM's null block): vLLM preempts requests mid-prefill, taking back blocks a decode is
    reading.  kvlend ends those leases and waits for their reader to be quiet before the step that reuses
    them, and the decode recomputes what it could not verify."""
    model = ensure_model("tiny")
    lengths = [1200, 1300, 1400, 1500]
    stats = str(tmp_path / "decode-stats.jsonl")
    rig = Rig(model, str(tmp_path))
    wrong, preempted, rounds = [], 0, 0
    try:
        plain, prefill, router = pair(rig, stats, SIDE_BY_SIDE)
        first = prompts(25, lengths[:1])
        assert generate(router, model, first, MAX_TOKENS) == generate(plain, model, first, MAX_TOKENS)  # link up
        # vLLM preempts only when the four arrive close enough to prefill side by side: new prompts (the
        # prefill caches prefixes) until it did, every answer checked.
        while preempted == 0 and rounds < PREEMPT_ROUNDS:
            asked = prompts(26 + rounds, lengths)
            rounds += 1
            expected = generate(plain, model, asked, MAX_TOKENS)
            got = generate(router, model, asked, MAX_TOKENS, concurrency=4)
            wrong += [(rounds, n) for n, g, e in zip(lengths, got, expected) if g != e]
            preempted = preemptions_within(prefill, 5.0)
        lines = wait_for_stats(stats, rounds * len(lengths) + 1)
    finally:
        rig.close()
    assert wrong == []
    assert preempted > 0, f"the prefill preempted nothing in {rounds} rounds: this test did not test preemption"
    assert len(lines) == rounds * len(lengths) + 1, lines


PREEMPT_ROUNDS = 3


def preemptions_within(server, timeout: float) -> int:
    """vLLM's preemption count once above 0, or at the deadline (its stats come with its steps' output)."""
    end = time.monotonic() + timeout
    while (count := preemptions(server)) == 0 and time.monotonic() < end:
        time.sleep(0.2)
    return count
