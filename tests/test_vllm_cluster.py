"""vLLM engines in kvlend's etcd registry: each worker's node publishes its record, ``kvlend cluster
status`` lists them, a SIGKILLed prefill drops out within the record TTL, and the decode then
refuses that prefill's tickets at once (the request is computed locally, right) instead of dialling
a dead endpoint.  A real etcd member, real ``vllm serve`` engines.  About two minutes on 2 cores.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from kvlend_vllm import launch
from tests.support.vllm_rig import (
    Rig,
    cluster_ranks,
    decode_with,
    ensure_model,
    generate,
    prefill_only,
    wait_for_stats,
)

pytestmark = pytest.mark.system

LENGTHS = [5, 128, 129, 300, 700]
MAX_TOKENS = 6
PREFIX = "/kvlend/vllm-test"
RECORD_TTL = 5.0  # the Registry's default: a dead rank's record outlives it by at most this (and a pass)


def test_vllm_ranks_publish_themselves_and_a_killed_prefill_drops_out_within_its_ttl(tmp_path):
    assert os.path.exists(launch.VLLM_VENV_PYTHON), "no .venv-vllm: scripts/test runs scripts/vllm-setup first"
    model = ensure_model("tiny")
    rng = random.Random(21)
    prompts = [[rng.randrange(4, 1000) for _ in range(n)] for n in LENGTHS]
    stats = str(tmp_path / "decode-stats.jsonl")
    rig = Rig(model, str(tmp_path))
    with rig.etcd() as members:
        etcd = members.endpoints[0]
        cluster = {"etcd": etcd, "cluster_prefix": PREFIX}
        try:
            plain = rig.engine("plain")
            prefill = rig.engine("prefill", launch.kvlend_transfer_config("kv_producer", cluster))
            consumer = launch.kvlend_transfer_config("kv_consumer", {**cluster, "stats_path": stats})
            decode = rig.engine("decode", consumer, prefix_caching=False)
            router = rig.router("router", prefill, decode)
            rig.wait(plain, prefill, decode, router)
            expected = generate(plain, model, prompts, MAX_TOKENS)
            got = generate(router, model, prompts, MAX_TOKENS)
            assert got == expected and all("tokens" in e for e in expected), (got, expected)
            assert all(s["ok"] for s in wait_for_stats(stats, len(LENGTHS)))

            # Both workers' nodes are listed, with their roles, layouts and load, while they serve.
            ranks = {r["identity"]: r for r in cluster_ranks(rig, etcd, PREFIX, {"prefill", "decode"}, 30.0)}
            assert set(ranks) == {"prefill", "decode"}, ranks
            assert ranks["prefill"]["role"] == "prefill" and ranks["decode"]["role"] == "decode", ranks
            assert ranks["prefill"]["endpoint"].startswith("127.0.0.1:") and ranks["prefill"]["layout_id"], ranks
            assert all(r["healthy"] for r in ranks.values()), ranks

            # SIGKILL the prefill engine: no goodbye; its record goes with its etcd lease.
            ticket = prefill_only(prefill, model, prompts[1])
            rig.kill(prefill)
            killed = time.monotonic()
            ranks = cluster_ranks(rig, etcd, PREFIX, {"decode"}, RECORD_TTL + 15.0)
            assert {r["identity"] for r in ranks} == {"decode"}, ranks
            gone_after = time.monotonic() - killed

            # The decode's registry saw it leave: the dead prefill's ticket fails at once, computed locally.
            before = len(wait_for_stats(stats, len(LENGTHS)))
            started = time.monotonic()
            assert decode_with(decode, model, prompts[1], ticket, MAX_TOKENS) == expected[1]
            line = wait_for_stats(stats, before + 1)[before]
            assert not line["ok"] and line["error"] == "PeerLost", line
            assert time.monotonic() - started < 10.0
        finally:
            rig.close()
    assert gone_after < RECORD_TTL + 15.0
