"""kvlend inside real vLLM servers with a hybrid Mamba2 + attention model: recurrent state lent in place.

The ``mamba`` test model is a tiny GraniteMoeHybrid (granite-4.0-h): Mamba2, attention, Mamba2.  vLLM's
hybrid allocator gives it two recurrent KV cache groups (one state block per request each, padded to
the attention page) and one full-attention group.  A recurrent state must not see the last prompt
token twice, so the prefill computes N - 1 tokens and lends their attention blocks with h(N - 1); the
decode loads them and computes token N itself (a one-token prompt is computed by the decode).

Greedy answers must equal a plain server's token for token, with and without chunked prefill on the
prefill, in progressive mode, and when the prefill is killed with leases out (the decode recomputes: a state
has no partial bound).  Each fetch must move exactly the attention blocks of N - 1 tokens and both
state blocks, and vLLM's decode must count N - 1 prompt tokens per request as taken from the transfer.
A prefill on other weights (same architecture, so the same layout) must change the answers.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from kvlend_vllm import launch
from kvlend_vllm.demo import EXTERNAL_TOKENS, scrape
from tests.support.nodes import wait_until
from tests.support.vllm_rig import (
    Rig,
    decode_with,
    ensure_model,
    fetch_stats,
    generate,
    kv_usage,
    prefill_only,
    wait_for_stats,
    worker_metrics,
)

pytestmark = pytest.mark.system

BLOCK = 128  # tokens per attention block (vLLM CPU's default)
PAGE = 2 * BLOCK * 2 * 64 * 4  # one attention layer's block: 2 KV heads x 128 tokens x K and V x 64 x float32
STATE = (544 * 3 + 8 * 64 * 16) * 4  # one Mamba2 layer's state: conv 544 channels x 3, SSM 8 heads x 64 x 16
STATE_LAYERS = 2
LENGTHS = [1, 2, 3, 17, 127, 128, 129, 130, 256, 257, 600, 1100, 1500]
MAX_TOKENS = 6
TCP = {"UCX_TLS": "tcp"}  # reads really in flight when the prefill is killed
PREFILL = {"claim_wait": 25.0}  # a progressive claim may come before the prefill's scheduler saw the request
DECODE_TIMEOUT = 20.0  # the decode's transfer_timeout: a fetch from a dead prefill fails within it


def moved(length: int) -> int:
    """Bytes one fetch moves for a prompt of ``length``: the attention blocks of length - 1 tokens and
    each Mamba layer's state block (its padding to the page not)."""
    return -(-(length - 1) // BLOCK) * PAGE + STATE_LAYERS * STATE


def prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """A plain server, a prefill that computes whole prompts and one that computes 256 tokens a step,
    a decode (float32, prefix caching off: vLLM's Mamba prefix caching is not ready on CPU), and routers."""
    logs = str(tmp_path_factory.mktemp("vllm-recurrent"))
    assert os.path.exists(launch.VLLM_VENV_PYTHON), "no .venv-vllm: scripts/test runs scripts/vllm-setup first"
    model = ensure_model("mamba")
    rig = Rig(model, logs)
    stats = os.path.join(logs, "decode-stats.jsonl")
    try:
        engine = dict(dtype="float32", prefix_caching=False)
        plain = rig.engine("plain", **engine)
        whole = rig.engine("prefill", launch.kvlend_transfer_config("kv_producer", PREFILL), env=TCP,
                           extra=["--max-num-batched-tokens", "2048"], **engine)
        chunked = rig.engine("prefill-chunked", launch.kvlend_transfer_config("kv_producer", PREFILL), env=TCP,
                             extra=["--max-num-batched-tokens", "256"], **engine)
        decode = rig.engine("decode", launch.kvlend_transfer_config(
            "kv_consumer", {"stats_path": stats, "transfer_timeout": DECODE_TIMEOUT}), env=TCP, **engine)
        routers = {"whole": rig.router("router", whole, decode),
                   "chunked": rig.router("router-chunked", chunked, decode),
                   "progressive": rig.router("router-progressive", chunked, decode, progressive=True)}
        rig.wait(plain, whole, chunked, decode, *routers.values())
        yield dict(rig=rig, model=model, plain=plain, prefill=whole, decode=decode, routers=routers, stats=stats)
    finally:
        rig.close()


def external_tokens(env) -> float:
    return scrape(env["decode"].url, EXTERNAL_TOKENS).get("external_tokens", 0.0)


def served_through(env, router: str, asked: list[list[int]]) -> tuple[list[dict], list[dict], float]:
    """Answers through ``router`` (8 at a time), the decode's fetch lines for them, and the prompt tokens
    vLLM's decode counted as taken from the transfer."""
    before_lines, before = len(fetch_stats(env["stats"])), external_tokens(env)
    got = generate(env["routers"][router], env["model"], asked, MAX_TOKENS, concurrency=8)
    lent = [p for p in asked if len(p) > 1]
    lines = wait_for_stats(env["stats"], before_lines + len(lent))[before_lines:]
    want = before + sum(len(p) - 1 for p in lent)
    after = worker_metrics(env["decode"], env["model"], EXTERNAL_TOKENS,
                           lambda m: m.get("external_tokens", 0.0) >= want)
    return got, lines, after.get("external_tokens", 0.0) - before


@pytest.mark.parametrize("router", ["whole", "chunked"])
def test_answers_equal_a_plain_servers_and_each_fetch_moves_n_minus_1_tokens_and_the_state(rig, router):
    asked = prompts(33)
    expected = generate(rig["plain"], rig["model"], asked, MAX_TOKENS, concurrency=8)
    got, lines, external = served_through(rig, router, asked)
    assert all("tokens" in e and len(e["tokens"]) == MAX_TOKENS for e in expected), expected
    assert [n for n, g, e in zip(LENGTHS, got, expected) if g != e] == []
    assert len(lines) == len(LENGTHS) - 1 and all(line["ok"] for line in lines), lines  # the 1-token prompt: local
    assert sorted(line["bytes"] for line in lines) == sorted(moved(n) for n in LENGTHS if n > 1), lines
    assert external == sum(n - 1 for n in LENGTHS if n > 1)  # vLLM's own count: N - 1 tokens per request


def test_negative_control_a_prefill_on_other_weights_changes_the_answers(rig):
    """Same architecture, so the same layout and scope, other weights: the state and the KV it lends are
    wrong for this model, every fetch still verifies, and the answers change."""
    asked = prompts(34, [300, 400, 500, 600, 700, 800, 900, 1000])
    expected = generate(rig["plain"], rig["model"], asked, MAX_TOKENS, concurrency=8)
    other = rig["rig"].engine("prefill-dummy", launch.kvlend_transfer_config("kv_producer"), env=TCP,
                              dtype="float32", prefix_caching=False, extra=["--load-format", "dummy"])
    router = rig["rig"].router("router-dummy", other, rig["decode"])
    rig["rig"].wait(other, router)
    before = len(fetch_stats(rig["stats"]))
    got = generate(router, rig["model"], asked, MAX_TOKENS, concurrency=8)
    lines = wait_for_stats(rig["stats"], before + len(asked))[before:]
    rig["rig"].stop(router)
    rig["rig"].stop(other)
    assert all("tokens" in g for g in got), got
    assert len(lines) == len(asked) and all(line["ok"] for line in lines), lines  # moved, and it mattered
    differ = sum(g != e for g, e in zip(got, expected))
    assert differ >= 6, f"only {differ} of {len(asked)} answers changed with the state of other weights"


def test_progressive_lending_reads_the_state_only_after_the_final_extend(rig):
    """The prefill lends each 256-token chunk's blocks as it computes; the state block, overwritten by
    every chunk, is lent only in the final extend, so whatever a fetch read before that was attention."""
    asked = prompts(35, [2, 300, 1100, 1500, 1900])
    expected = generate(rig["plain"], rig["model"], asked, MAX_TOKENS)
    before_lines = len(fetch_stats(rig["stats"]))
    got = generate(rig["routers"]["progressive"], rig["model"], asked, MAX_TOKENS, concurrency=1)
    lines = wait_for_stats(rig["stats"], before_lines + len(asked))[before_lines:]
    assert [len(p) for p, g, e in zip(asked, got, expected) if g != e] == []
    assert len(lines) == len(asked) and all(line["ok"] for line in lines), lines
    assert sorted(line["bytes"] for line in lines) == sorted(moved(len(p)) for p in asked)
    assert all(line["bytes"] - line["early_bytes"] >= STATE_LAYERS * STATE for line in lines), lines
    # A fetch begun before the last extend read attention early; on a loaded host the decode may begin
    # each only once the prefill is done (then nothing is early, rightly), but not every long one.
    long = [line for line in lines if line["blocks"] >= 9]
    assert any(0 < line["early_bytes"] for line in long), long


def test_a_prefill_killed_with_leases_out_leaves_every_answer_right_and_nothing_pinned(rig):
    """SIGKILL the prefill while four tickets are held and eight requests are in flight over tcp, some of
    them being read: each affected request is recomputed by the decode (a failed fetch's bound covers no
    state, so all of it) within the transfer timeout, its answer right, and the decode holds no block
    afterwards."""
    env, model = rig, rig["model"]
    asked = prompts(36, [700, 800, 900, 1000, 1100, 1200, 1300, 1400, 1500, 1600, 1700, 1800])
    expected = generate(env["plain"], model, asked, MAX_TOKENS, concurrency=8)
    held = [(p, prefill_only(env["prefill"], model, p)) for p in asked[:4]]
    assert all("kvlend_ticket" in params for _, params in held), held
    results: dict[int, dict] = {}
    before = len(fetch_stats(env["stats"]))

    def through_router(i: int) -> None:
        results[i] = generate(env["routers"]["whole"], model, [asked[i]], MAX_TOKENS)[0]
    flying = [threading.Thread(target=through_router, args=(i,), daemon=True) for i in range(4, len(asked))]
    for t in flying:
        t.start()
    wait_until(lambda: len(fetch_stats(env["stats"])) > before, "a first fetch ended", 60)  # reads under way
    env["rig"].kill(env["prefill"])
    killed = time.monotonic()
    late = [decode_with(env["decode"], model, p, params, MAX_TOKENS, timeout=60) for p, params in held]
    for t in flying:
        t.join(60)
    assert time.monotonic() - killed < 2 * DECODE_TIMEOUT + 30
    # Tickets whose prefill is gone: the fetch fails, vLLM recomputes, the answer is still right.
    assert [r.get("tokens") for r in late] == [e["tokens"] for e in expected[:4]]
    failed = [line for line in fetch_stats(env["stats"])[before:] if not line["ok"]]
    assert len(failed) >= len(held) and all(line["bound"] == 0 for line in failed), failed
    # Requests caught in flight: right, or an error from the router; never other tokens.
    assert len(results) == len(flying)
    for i, r in results.items():
        assert r == expected[i] or "error" in r, (len(asked[i]), r)
    wait_until(lambda: kv_usage(env["decode"]) == 0, "the decode's blocks all freed", 30)
