"""The tcp read window (``kvlend.core.tcpwindow``): sizes from the host's limits, and what may be posted now."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvlend.core.layout import MemoryKind
from kvlend.core.reads import ReadBatch
from kvlend.core.tcpwindow import DEFAULT_BUFFER, ReadWindow, parse_size, pieces, pinned_buffers, window_bytes
from kvlend.errors import ConfigError

pytestmark = pytest.mark.unit

MiB = 1 << 20


def test_sizes_parse_like_ucx():
    assert parse_size("X", "4194304") == 4 * MiB
    assert parse_size("X", "4m") == parse_size("X", "4MB") == 4 * MiB
    assert parse_size("X", "512K") == 512 << 10
    for bad in ("auto", "inf", "-1", "4q", ""):
        if bad:
            with pytest.raises(ConfigError, match="pinned"):
                parse_size("UCX_TCP_RCVBUF", bad)


def test_default_buffers_capped_at_the_host_limits():
    assert pinned_buffers({}, 32 * MiB, 32 * MiB) == (DEFAULT_BUFFER, DEFAULT_BUFFER)
    assert pinned_buffers({}, MiB, 2 * MiB) == (2 * MiB, MiB)
    assert window_bytes(4 * MiB, 4 * MiB) == 4 * MiB
    assert window_bytes(4 * MiB, 1 * MiB) == 1 * MiB


def test_a_size_the_host_cannot_give_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"net.core.rmem_max.*sysctl -w net.core.rmem_max=16777216"):
        pinned_buffers({"UCX_TCP_RCVBUF": "16m"}, 4 * MiB, 4 * MiB)
    with pytest.raises(ConfigError, match="net.core.wmem_max"):
        pinned_buffers({}, 4 * MiB, 64 << 10)  # the default cannot be met usefully either
    with pytest.raises(ConfigError, match="autotuning"):
        pinned_buffers({"UCX_TCP_SNDBUF": "auto"}, 4 * MiB, 4 * MiB)


def test_no_limit_posts_everything():
    w = ReadWindow(None)
    assert all(w.submit("a", bytes([i]), 10 << 30) for i in range(5))


def test_reads_over_the_window_wait_in_order_and_are_admitted_as_room_frees():
    w = ReadWindow(100)
    assert w.submit("p", b"1", 60)
    assert not w.submit("p", b"2", 60)
    assert not w.submit("p", b"3", 10)  # would fit, but waits behind 2: order kept
    assert w.submit("q", b"4", 100)  # another prefill has its own window
    assert w.admit() == []
    w.end(b"1")
    assert w.admit() == [b"2", b"3"] and w.in_flight("p") == 70


def test_an_oversize_read_goes_alone_and_a_withdrawn_one_frees_its_place():
    w = ReadWindow(100)
    assert w.submit("p", b"big", 500)  # nothing in flight: posted alone
    assert not w.submit("p", b"a", 10)
    assert not w.submit("p", b"b", 10)
    w.end(b"a")  # its fetch failed before it was posted
    assert not w.waiting(b"a") and w.waiting(b"b")
    w.end(b"big")
    assert w.admit() == [b"b"]


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(1, 100), ops=st.lists(st.tuples(st.sampled_from("sew"), st.integers(0, 2),
                                                         st.integers(1, 150)), max_size=60))
def test_the_window_holds_never_loses_and_keeps_order(limit, ops):
    w = ReadWindow(limit)
    posted: dict[bytes, tuple[int, int]] = {}
    waiting: dict[int, list[bytes]] = {0: [], 1: [], 2: []}
    sizes: dict[bytes, int] = {}
    n = 0
    for op, key, size in ops:
        if op == "s":
            n += 1
            tag = str(n).encode()
            sizes[tag] = size
            if w.submit(key, tag, size):
                assert not waiting[key]
                posted[tag] = (key, size)
            else:
                waiting[key].append(tag)
        elif op == "e" and posted:
            w.end(sorted(posted)[size % len(posted)])
            del posted[sorted(posted)[size % len(posted)]]
        elif op == "w" and waiting[key]:
            w.end(waiting[key].pop(size % len(waiting[key])))
        for tag in w.admit():
            k = next(k for k, q in waiting.items() if tag in q)
            assert waiting[k][0] == tag  # in order
            waiting[k].pop(0)
            posted[tag] = (k, sizes[tag])
        for k in range(3):
            flying = [s for kk, s in posted.values() if kk == k]
            assert w.in_flight(k) == sum(flying)
            assert sum(flying) <= limit or len(flying) == 1  # over the window only alone
            if waiting[k]:  # whatever waits could not fit
                assert flying and sum(flying) + sizes[waiting[k][0]] > limit
    while posted:  # every read ends in turn: everything waiting gets posted, each once
        w.end(posted.popitem()[0])
        for tag in w.admit():
            assert tag not in posted
            posted[tag] = (0, sizes[tag])
            next(q for q in waiting.values() if tag in q).remove(tag)
    assert not any(waiting.values())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(1, 500), min_size=1, max_size=6), min_size=1, max_size=4),
       st.integers(1, 700))
def test_pieces_cover_every_byte_once_in_order_and_none_exceeds_the_limit(batches_rows, limit):
    batches, cursor = [], 0
    for rows in batches_rows:
        remote = np.array([(cursor + 10_000 * i, n, 0) for i, n in enumerate(rows)], dtype=np.uint64)
        local = np.array([(7 + 20_000 * i, n, 1) for i, n in enumerate(rows)], dtype=np.uint64)
        cursor += 1_000_000
        batches.append(ReadBatch(MemoryKind.HOST, MemoryKind.HOST, remote, local))
    cut = pieces(batches, limit)
    assert all(sum(b.nbytes for b in piece) <= limit for piece in cut)
    assert all(sum(b.nbytes for b in piece) == limit for piece in cut[:-1])  # only the last one is short

    def spans(rows_of):
        out = []
        for b in rows_of:
            for (ra, n, rd), (la, _, ld) in zip(b.remote.tolist(), b.local.tolist()):
                out.extend((ra + k, la + k, rd, ld) for k in range(n))
        return out

    assert spans([b for piece in cut for b in piece]) == spans(batches)


@pytest.mark.parametrize(("tls", "local"), [("", False), ("all", False), ("^ib", False), ("tcp", True),
                                              ("tcp,cma", False), ("sm,tcp", False), ("rc,tcp", True)])
def test_peers_on_this_host_read_over_tcp_only_where_ucx_tls_leaves_no_shared_memory(tls, local):
    from kvlend_nixl.tcp import local_reads_over_tcp

    assert local_reads_over_tcp({"UCX_TLS": tls} if tls else {}) is local
