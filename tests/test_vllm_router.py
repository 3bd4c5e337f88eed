"""kvlend behind vLLM's own P/D router (``vllm-router``, as production teams run it): two kvlend
prefills and one decode, token for token against a plain server, then one prefill SIGKILLed; the
engines are in kvlend's etcd registry all along (``kvlend cluster status`` lists them, and the
killed prefill drops out).

vllm-router (its default and ``--kv-connector nixl`` modes) sends the decode the prefill's
``kv_transfer_params`` unchanged, so kvlend's tickets ride it with no change to either.  It also
forwards a client's own ``kv_transfer_params`` when the prefill returns none; kvlend's tickets are
bound to their prompt, so such a ticket reads nothing (``test_vllm.py`` shows the binding).
Then the demo's other shape behind it: one prefill, two decodes.  About three minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time

import pytest

from kvlend_vllm import launch
from tests.support.children import child_env
from tests.support.vllm_rig import Rig, cluster_ranks, ensure_model, generate, served, wait_for_stats

pytestmark = pytest.mark.system

LENGTHS = [5, 100, 127, 128, 129, 200, 300, 400, 500, 640, 700, 900]
MAX_TOKENS = 6
TCP = {"UCX_TLS": "tcp"}  # reads really in flight when a prefill dies
KILLED_WITHIN = 90.0  # seconds: every request caught by the kill is answered or failed by then
PREFIX = "/kvlend/vllm-router-test"
RECORD_TTL = 5.0  # the Registry's default: a dead rank's record outlives it by at most this (and a pass)


def test_vllm_router_carries_kvlend_tickets_from_two_prefills_and_survives_one_killed(tmp_path):
    assert os.path.exists(launch.VLLM_VENV_PYTHON), "no .venv-vllm: scripts/test runs scripts/vllm-setup first"
    model = ensure_model("tiny")
    rng = random.Random(25)
    batches = [[[rng.randrange(4, 1000) for _ in range(n)] for n in LENGTHS] for _ in range(3)]
    stats = str(tmp_path / "decode-stats.jsonl")
    rig = Rig(model, str(tmp_path))
    etcd = rig.etcd()
    cluster = {"etcd": etcd.endpoints[0], "cluster_prefix": PREFIX}
    try:
        plain = rig.engine("plain")
        rig.wait(plain)
        expected = [generate(plain, model, batch, MAX_TOKENS) for batch in batches]
        rig.stop(plain)
        assert all("tokens" in e for batch in expected for e in batch), expected
        producer = launch.kvlend_transfer_config("kv_producer", cluster)
        prefills = [rig.engine(f"prefill-{i}", producer, env=TCP) for i in range(2)]
        decode = rig.engine("decode", launch.kvlend_transfer_config("kv_consumer", {**cluster, "stats_path": stats}),
                            env=TCP, prefix_caching=False)
        rig.wait(*prefills, decode)
        router = rig.vllm_router("vllm-router", prefills, [decode])
        rig.wait(router)

        # 1. Both prefills serve, every answer's KV crossed kvlend, every answer is the plain server's.
        got = generate(router, model, batches[0], MAX_TOKENS)
        assert [n for n, g, e in zip(LENGTHS, got, expected[0]) if g != e] == [], got
        lines = wait_for_stats(stats, len(LENGTHS))  # a fetch's line comes with its done ack
        assert len(lines) == len(LENGTHS) and all(s["ok"] for s in lines), lines
        deadline = time.monotonic() + 30  # vLLM's metrics may trail its answers
        while sum(counts := [served(p) for p in prefills]) < len(LENGTHS) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sum(counts) == len(LENGTHS) and min(counts) > 0, counts  # spread over both
        ranks = cluster_ranks(rig, etcd.endpoints[0], PREFIX, {"prefill-0", "prefill-1", "decode"}, 30.0)
        assert {r["identity"]: r["role"] for r in ranks} == {"prefill-0": "prefill", "prefill-1": "prefill",
                                                             "decode": "decode"}, ranks

        # 2. One prefill SIGKILLed with requests in flight: each is answered right or fails, never wrong.
        results: dict[int, dict] = {}

        def one(i: int) -> None:
            results[i] = generate(router, model, [batches[1][i]], MAX_TOKENS, timeout=KILLED_WITHIN)[0]

        flying = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(LENGTHS))]
        for t in flying:
            t.start()
        deadline = time.monotonic() + KILLED_WITHIN  # the first answer back: the others are still on their way
        while not results and time.monotonic() < deadline:
            time.sleep(0.01)
        killed_at = time.monotonic()
        rig.kill(prefills[1])
        for t in flying:
            t.join(max(0.0, killed_at + KILLED_WITHIN + 10 - time.monotonic()))
        assert not any(t.is_alive() for t in flying), "a request caught by the kill is still waiting"
        wrong = [LENGTHS[i] for i, r in results.items() if "error" not in r and r != expected[1][i]]
        assert wrong == [], results
        ranks = cluster_ranks(rig, etcd.endpoints[0], PREFIX, {"prefill-0", "decode"}, RECORD_TTL + 15.0)
        assert {r["identity"] for r in ranks} == {"prefill-0", "decode"}, ranks  # the dead one left

        # 3. The survivor serves everything after it.
        got = generate(router, model, batches[2], MAX_TOKENS)
        assert [n for n, g, e in zip(LENGTHS, got, expected[2]) if g != e] == [], got
    finally:
        rig.close()


def test_the_demo_runs_one_prefill_and_two_decodes_behind_vllm_router_with_a_load_aware_policy(tmp_path):
    """``scripts/vllm-demo --router vllm-router``: the other shape (1 prefill, 2 decodes), power-of-two
    choices, tokens checked against a plain server."""
    report = tmp_path / "demo.json"
    out = subprocess.run([launch.VLLM_VENV_PYTHON, "-m", "kvlend_vllm.demo", "--router", "vllm-router",
                          "--prefills", "1", "--decodes", "2", "--policy", "power_of_two", "--check", "--prompts", "8",
                          "--log-dir", str(tmp_path / "logs"), "--json", str(report)],
                         capture_output=True, text=True, timeout=900, env=child_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["check_vs_single_server"] == "match" and rep["errors"] == 0, rep
    # KV came over kvlend, none failed.  Not "all 8": vLLM ships a step's connector stats with a later step,
    # so an engine gone idle may never show its last transfer (seen: 7 of 8 after the demo's 10 s wait).
    assert 0 < rep["kv_transfers"] <= 8 and rep["kv_failed"] == 0, rep
    # Where power-of-two choices sends each request is its business (one decode may take all 8).
    assert rep["served"]["prefill"] == 8 and rep["served"]["decode-0"] + rep["served"]["decode-1"] == 8, rep
