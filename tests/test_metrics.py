"""Metrics move with real transfers, and Prometheus can scrape them over HTTP on loopback."""

from __future__ import annotations

import re
import urllib.request

import numpy as np
import pytest

from kvlend.errors import KvlendError
from kvlend.metrics import METRICS, SPECS, Metrics
from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode
from kvlend.testing.kvcache import FreeList, make_layout, make_pools, prefill_request
from tests.support.agents import nixl
from tests.support.certs import creds

pytestmark = pytest.mark.nixl

DEADLINE = 10.0


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=DEADLINE) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(kvlend_[a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


def test_metrics_move_and_are_scraped_over_http():
    port = METRICS.serve(0)
    before = scrape(port)
    src, dst = make_pools(128), make_pools(64)
    prefill = PrefillNode(make_layout(src), nixl("prefill"), creds("metrics-prefill", "prefill"))
    decode = DecodeNode(make_layout(dst), nixl("decode"), creds("decode", "decode"),
                        config=NodeConfig(transfer_timeout=DEADLINE))
    try:
        prefill.start()
        link = decode.connect(*prefill.address)
        peer = prefill.wait_for_peer(DEADLINE)
        free = {name: FreeList(128, np.random.default_rng(1)) for name in prefill.layout.groups}
        dst_free = {name: FreeList(64, np.random.default_rng(2)) for name in decode.layout.groups}
        for i in range(3):
            tables = prefill_request(prefill.layout, src, free, 40, seed=i)
            prefill.offer(peer, f"m{i}", 40, tables, prefill.layout.full_selection())
        during = scrape(port)
        assert during['kvlend_active_leases{node="metrics-prefill"}'] == 3
        assert during['kvlend_locked_pages{node="metrics-prefill"}'] > 0
        for _ in range(3):
            _, offer = decode.next_offer(DEADLINE)
            decode.fetch(link, offer, {g: f.alloc(10) for g, f in dst_free.items()})
        after = scrape(port)
    finally:
        decode.close()
        decode.backend.close()
        prefill.close()
        prefill.backend.close()

    def grew(name: str, by: float) -> bool:
        return after.get(name, 0.0) - before.get(name, 0.0) >= by

    assert grew("kvlend_leases_total", 3)
    assert grew("kvlend_transfer_seconds_count", 3) and grew("kvlend_transfer_bytes_sum", 1)
    assert grew("kvlend_transfer_descriptors_count", 3) and grew("kvlend_post_seconds_count", 3)
    assert grew("kvlend_handshake_seconds_count", 1)
    assert after['kvlend_active_leases{node="metrics-prefill"}'] == 0
    assert after['kvlend_locked_pages{node="metrics-prefill"}'] == 0
    snapshot = METRICS.snapshot()
    assert snapshot["kvlend_transfer_seconds"][()]["count"] >= 3  # readable without Prometheus too


def test_metrics_without_prometheus_are_readable_from_python():
    metrics = Metrics()
    metrics.inc("kvlend_failed_transfers_total", "PeerLost")
    metrics.inc("kvlend_failed_transfers_total", "PeerLost")
    metrics.observe("kvlend_transfer_bytes", 4096)
    metrics.gauge("kvlend_locked_pages", lambda: 7, "n")
    snap = metrics.snapshot()
    assert snap["kvlend_failed_transfers_total"][("PeerLost",)] == 2
    hist = snap["kvlend_transfer_bytes"][()]
    assert hist["count"] == 1 and hist["sum"] == 4096 and hist["buckets"][4096.0] == 1
    assert snap["kvlend_locked_pages"][("n",)] == 7
    assert set(snap) == set(SPECS)


@pytest.mark.parametrize("call", [
    lambda m: m.inc("kvlend_no_such_metric"),
    lambda m: m.inc("kvlend_failed_transfers_total"),  # needs its error label
    lambda m: m.observe("kvlend_transfer_bytes", 1, "extra-label"),
])
def test_metrics_refuse_unknown_names_and_wrong_labels(call):
    with pytest.raises(KvlendError):
        call(Metrics())
