"""Mismatched layouts: page sizes and tensor-parallel degrees that map, and differences that are refused.

Supported differences run in the two-process pair and must give the
single-process reference's tokens.  Unsupported ones (dtype, head dim, NHD
head order across TP degrees) are refused at the handshake, naming the
field, before the prefill accepts the decode rank or lends anything.  A
decode refused so gives back the tickets' leases it came for, so the prefill
frees them well before their TTL.
"""

from __future__ import annotations

import dataclasses
import queue
import time

import numpy as np
import pytest

from kvlend.core.layout import HeadOrder, PageLayout, ReplicaRank
from kvlend.core.negotiate import negotiate
from kvlend.demo import toy_engine as te
from kvlend.errors import LayoutMismatch, PeerLost
from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode
from tests.support.agents import nixl
from tests.support.certs import creds
from tests.support.example_pair import expected_bytes, pair

TINY = te.preset("tiny")
FAST = NodeConfig(handshake_timeout=5.0)


@pytest.mark.system
@pytest.mark.parametrize("model, prefill_tpp, decode_tpp", [("llama", 16, 32), ("hybrid", 32, 16)])
def test_pair_maps_tokens_per_page(model, prefill_tpp, decode_tpp):
    report = pair("--model", model, "--requests", "8", "--max-len", "300",
                  "--tokens-per-page", str(prefill_tpp), "--decode-tokens-per-page", str(decode_tpp))
    assert report["plan"] == "mapped" and report["tokens_per_page"] == [prefill_tpp, decode_tpp]
    if model == "hybrid":
        config = dataclasses.replace(te.preset("hybrid"), tokens_per_page=prefill_tpp)
        assert report["bytes"] == expected_bytes(config, 8, 300)[0]


@pytest.mark.unit
def test_bigger_decode_pages_need_a_longer_prefill_window():
    """16-token prefill pages lend a 64-token window; 32-token decode pages can start 16 tokens earlier."""
    hybrid = te.preset("hybrid")
    remote = te.PagedKVCache(hybrid, 8).layout()
    local = te.PagedKVCache(dataclasses.replace(hybrid, tokens_per_page=32), 8).layout()
    with pytest.raises(LayoutMismatch) as info:
        negotiate(local, remote)
    assert {f for f, *_ in info.value.fields} == {"groups['swa'].read_window", "groups['swa'].sinks"}


@pytest.mark.system
@pytest.mark.parametrize("model", ["llama", "hybrid"])
def test_pair_prefill_tp1_decode_tp2(model):
    report = pair("--model", model, "--decode-tp", "2", "--requests", "8", "--max-len", "300")
    assert report["plan"] == "mapped" and report["decode_tp"] == 2
    # The two ranks' head slices add up to one lease; the replicated state is read by both.
    config = te.preset(model) if model == "hybrid" else TINY
    lent = expected_bytes(config, 8, 300)[0]
    state = 8 * 4 * sum(config.state_floats) * len(config.ssm_layers)
    assert report["bytes"] == lent + state


@pytest.mark.unit
def test_tp_shards_read_their_head_slices():
    whole = te.PagedKVCache(TINY, 4)
    shards = [te.PagedKVCache(TINY, 4, replica=ReplicaRank(2, r)) for r in range(2)]
    plans = [negotiate(s.layout(), whole.layout()) for s in shards]
    assert [p.kind for p in plans] == ["mapped", "mapped"]
    for shard, plan in zip(shards, plans):
        (piece, *_) = plan.pairs[0].pieces
        head_bytes = TINY.tokens_per_page * TINY.head_dim * 4
        assert piece.src_offset == shard.replica.tp_rank * 2 * head_bytes and piece.length == 2 * head_bytes
    table = whole.alloc(4)
    for s in shards:
        for t in s.tensors:
            t.fill_(s.replica.tp_rank + 1)
    te.merge_shards(whole, shards, table)
    assert (whole.tensors[0][table][:, :, :2] == 1).all() and (whole.tensors[0][table][:, :, 2:] == 2).all()


def _nhd(layout: PageLayout) -> PageLayout:
    return dataclasses.replace(layout, buffers=tuple(
        dataclasses.replace(b, geometry=dataclasses.replace(b.geometry, order=HeadOrder.NHD)) for b in layout.buffers))


CASES = {
    "dtype": (dataclasses.replace(TINY, dtype="bfloat16"), ReplicaRank(), False, ["dtype"]),
    "head_dim": (dataclasses.replace(TINY, head_dim=64), ReplicaRank(), False, ["geometry.bytes_per_head"]),
    "nhd_across_tp": (TINY, ReplicaRank(2, 0), True, ["geometry.order"]),
}


@pytest.mark.nixl
@pytest.mark.parametrize("case", sorted(CASES))
def test_handshake_refuses_unsupported_difference(case):
    config, replica, nhd, fields = CASES[case]
    prefill_cache = te.PagedKVCache(TINY, 8)
    decode_cache = te.PagedKVCache(config, 8, replica=replica)
    remote, local = prefill_cache.layout(), decode_cache.layout()
    if nhd:
        remote, local = _nhd(remote), _nhd(local)
    with pytest.raises(LayoutMismatch) as info:
        negotiate(local, remote)
    named = [f for f, *_ in info.value.fields]
    for field in fields:
        assert any(n.endswith(field) for n in named), (field, named)
    prefill = PrefillNode(remote, nixl("prefill"), creds("prefill", "prefill"), config=FAST)
    prefill.start()
    decode = DecodeNode(local, nixl("decode"), creds("decode", "decode"), config=FAST)
    try:
        with pytest.raises(LayoutMismatch, match="|".join(fields)) as refused:
            decode.connect(*prefill.address)
        assert {f for f, *_ in refused.value.fields} == set(named)  # the decode names every field too
        assert decode.links == [] and prefill.ready_peers() == []
        slot_table = {g: np.arange(1) for g in prefill_cache.layout_groups}
        with pytest.raises(PeerLost):
            prefill.offer("decode", "never", 8, slot_table, remote.full_selection())
        assert prefill.lender.active_leases == 0
    finally:
        decode.close()
        decode.backend.close()
        prefill.close()
        prefill.backend.close()


@pytest.mark.nixl
def test_a_refused_decode_gives_its_tickets_leases_back_well_before_their_ttl():
    """Issue 22, finding 9: the decode's pools hold another dtype and twice the tokens per page.  Each
    ticket's lease used to stay pinned for its TTL (30 s): the decode connected, was refused, and left."""
    decode_config = dataclasses.replace(TINY, dtype="bfloat16", tokens_per_page=2 * TINY.tokens_per_page)
    prefill_cache, decode_cache = te.PagedKVCache(TINY, 8), te.PagedKVCache(decode_config, 8)
    released: queue.SimpleQueue = queue.SimpleQueue()
    config = NodeConfig(ttl=30.0, handshake_timeout=5.0)
    prefill = PrefillNode(prefill_cache.layout(), nixl("prefill"), creds("prefill", "prefill"), config=config,
                          on_release=lambda lease, reason: released.put((lease.request, reason)))
    prefill.start()
    decode = DecodeNode(decode_cache.layout(), nixl("decode"), creds("decode", "decode"), config=config)
    decode.start()
    layout = prefill.layout
    try:
        for request in ("first", "second"):
            ticket = prefill.lend(request, 40, {g: np.arange(3) for g in prefill_cache.layout_groups},
                                  layout.full_selection())
            started = time.monotonic()
            handle = decode.start_fetch(ticket, {g: np.arange(3) for g in decode_cache.layout_groups})
            if request == "second":  # the layout id is known now: refused before any handshake
                assert handle.done
            decode.wait([handle], 10.0)
            assert isinstance(handle.error, LayoutMismatch) and handle.bound == 0
            text = str(handle.error)
            assert "dtype: local='bfloat16' remote='float32' (element types differ)" in text
            assert "head dimension" not in text and "model" not in text and "tokens_per_page" not in text
            assert released.get(timeout=10.0) == (request, "aborted")  # 10 s: a third of the TTL
            print(f"\n{request} ticket: lease freed {time.monotonic() - started:.3f} s after the fetch started")
            assert prefill.lender.active_leases == 0 and prefill.lender.locks.locked_pages() == 0
        assert prefill.ready_peers() == [] and decode.links == []
    finally:
        decode.close()
        decode.backend.close()
        prefill.close()
        prefill.backend.close()
