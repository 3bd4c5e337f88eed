"""Prefill and decode nodes end to end over real NIXL agents (UCX on DRAM), no mocks.

In one process the prefill serves from its background thread while the test
thread drives the decode; in two processes a child prefill lends pages it
filled from per-request seeds and this process checks every byte it read.
Each request's pages are scattered on both sides; a windowed group lends
only its sink and window pages, and the destination of its stale pages must
stay untouched.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import time
from collections import deque

import numpy as np
import pytest

from kvlend.errors import (
    AuthError,
    BackendError,
    ConfigError,
    LayoutMismatch,
    LeaseExpired,
    PeerLost,
    ProtocolError,
    TransferTimeout,
)
from kvlend.protocol.wire import Done, Heartbeat
from kvlend.runtime import DecodeNode, Link, NodeConfig, PrefillNode
from kvlend.runtime.clock import lease_clock
from kvlend.security.certs import Authority, save_rank
from kvlend.testing.kvcache import TPP, make_layout, make_pools, prefill_request, slots
from tests.support.agents import nixl
from tests.support.certs import creds
from tests.support.children import child_env
from tests.support.nodes import (
    DEADLINE,
    DECODE_CONFIG,
    DST_PAGES,
    MAX_TOKENS,
    SRC_PAGES,
    assert_locked,
    fetch_and_verify,
    free_lists,
    intercept,
    rig,
    unlocked,
    wait_until,
)


# ------------------------------------------------------------ one process
@pytest.mark.nixl
def test_a_thousand_leases_arrive_byte_exact():
    """Random lengths, scattered pages on both sides, four leases outstanding at a time."""
    n_leases, window = 1000, 4
    rng = np.random.default_rng(7)
    with rig() as r:
        src_free = free_lists(r.layout, SRC_PAGES, 1)
        dst_free = free_lists(r.decode.layout, DST_PAGES, 2)
        queued: deque = deque()
        bytes_moved = 0

        def consume() -> None:
            nonlocal bytes_moved
            lease, tables = queued.popleft()
            assert_locked(r.prefill, tables, True)
            link, offer = r.decode.next_offer(DEADLINE)
            assert link == r.link
            assert (offer.id, offer.request, offer.num_tokens) == (lease.id, lease.request, lease.num_tokens)
            result = fetch_and_verify(r.decode, link, offer, r.dst, dst_free)
            assert result.bound == offer.num_tokens
            assert result.descriptors >= 1
            bytes_moved += result.bytes
            # read in the lease's window: done without the ack; its Done, unanswered, releases the pages
            wait_until(lambda: unlocked(r.prefill, tables), "the pages released")
            for name, table in tables.items():
                src_free[name].release(table)

        for i in range(n_leases):
            num_tokens = int(rng.integers(1, MAX_TOKENS + 1))
            tables = prefill_request(r.layout, r.src, src_free, num_tokens, seed=i)
            lease = r.prefill.offer(r.peer, f"req-{i}", num_tokens, tables, r.layout.full_selection(),
                                    meta={"seed": i})
            queued.append((lease, tables))
            if len(queued) == window:
                consume()
        while queued:
            consume()

        with r.prefill._lock:
            assert r.prefill.lender.locks.locked_pages() == 0
            assert r.prefill.lender.active_leases == 0
        assert sorted(r.released) == sorted((f"req-{i}", "done") for i in range(n_leases))
        assert r.decode.tracker.stats.requests == 0 and r.decode.tracker.stats.failed == 0
        assert bytes_moved > 0
        assert all(len(f) == SRC_PAGES for f in src_free.values())


@pytest.mark.nixl
def test_fetches_started_in_one_batch_claim_in_one_write():
    """A node without a loop thread sends the claims of the fetches an engine step starts together:
    one socket write to the prefill, made when the batch ends, and every fetch still lands whole."""
    with rig() as r:
        src_free, dst_free = free_lists(r.layout, SRC_PAGES, 3), free_lists(r.decode.layout, DST_PAGES, 4)
        lent = [(prefill_request(r.layout, r.src, src_free, 40 + i, seed=i), 40 + i) for i in range(3)]
        tickets = [r.prefill.lend(f"batch-{i}", n, tables, r.layout.full_selection())
                   for i, (tables, n) in enumerate(lent)]
        writes: list[int] = []
        send = r.decode._sockets.send
        r.decode._sockets.send = lambda conn, data: (writes.append(conn), send(conn, data))
        with r.decode.batch():
            handles = [r.decode.start_fetch(t, {g: dst_free[g].alloc(-(-n // TPP)) for g in r.decode.layout.groups})
                       for t, (_, n) in zip(tickets, lent)]
            assert writes == []  # nothing goes out inside the block
        assert writes == [r.link.id]  # three claims, one write
        r.decode.wait(handles, DEADLINE)
        assert [(h.ok, h.bound) for h in handles] == [(True, n) for _, n in lent]


@pytest.mark.nixl
def test_windowed_group_lends_only_sinks_and_window():
    num_tokens = 150  # 38 token pages; the window needs pages 21..37, plus sink page 0
    with rig() as r:
        tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 3), num_tokens, seed=42)
        assert (tables["swa"] < 0).sum() == 38 - 18  # the stale pages are gone on the prefill
        lease = r.prefill.offer(r.peer, "long", num_tokens, tables, r.layout.full_selection(), meta={"seed": 42})
        np.testing.assert_array_equal(lease.pages["swa"].token_pages, [0, *range(21, 38)])
        np.testing.assert_array_equal(lease.pages["full"].token_pages, np.arange(38))
        with r.prefill._lock:
            assert r.prefill.lender.locks.locked_pages("L2.kv") == 18
            assert r.prefill.lender.locks.locked_pages("L0.kv") == 38
        link, offer = r.decode.next_offer(DEADLINE)
        result = fetch_and_verify(r.decode, link, offer, r.dst, free_lists(r.decode.layout, DST_PAGES, 4))
        assert result.bound == num_tokens
        # Every slot byte of 38 full pages and 18 window pages, both layers of each group.
        slot = slots(r.src[0]).shape[1]
        assert result.bytes == 2 * (38 + 18) * slot


@pytest.mark.nixl
@pytest.mark.parametrize("field_name, mismatch", [
    ("dtype", dict(dtype=np.uint8, head_dim=16)),  # same bytes per head, other element type
    ("bytes_per_head", dict(head_dim=16)),
])
def test_handshake_refuses_a_mismatched_layout(field_name, mismatch):
    with rig() as r:
        other = DecodeNode(make_layout(make_pools(DST_PAGES, **mismatch)), nixl("odd-decode"),
                           creds("odd-decode", "decode"), config=DECODE_CONFIG)
        try:
            with pytest.raises(LayoutMismatch, match=field_name):
                other.connect(*r.prefill.address)
            assert other.links == []
        finally:
            other.backend.close()
        assert "odd-decode" not in r.prefill.ready_peers()
        assert r.prefill.ready_peers() == [r.peer]
        tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 5), 8, seed=1)
        with pytest.raises(PeerLost):
            r.prefill.offer("odd-decode", "never", 8, tables, r.layout.full_selection())
        assert r.prefill.lender.active_leases == 0
        # The refusal cost the good peer nothing.
        r.prefill.offer(r.peer, "after", 8, tables, r.layout.full_selection(), meta={"seed": 1})
        link, offer = r.decode.next_offer(DEADLINE)
        assert fetch_and_verify(r.decode, link, offer, r.dst, free_lists(r.decode.layout, DST_PAGES, 6)).bound == 8


@pytest.mark.nixl
def test_a_certificate_from_another_ca_gets_no_channel():
    prefill = PrefillNode(make_layout(make_pools(32)), nixl("prefill"), creds("prefill", "prefill"))
    decode = DecodeNode(make_layout(make_pools(32)), nixl("decode"), Authority.create().issue("decode", "decode"),
                        config=NodeConfig(handshake_timeout=2.0))
    try:
        prefill.start()
        with pytest.raises(AuthError, match="CERTIFICATE_VERIFY_FAILED"):
            decode.connect(*prefill.address)
        assert decode.links == []
        assert prefill.ready_peers() == []
        with pytest.raises(TransferTimeout):
            prefill.wait_for_peer(0.2)
    finally:
        decode.backend.close()
        prefill.close()
        prefill.backend.close()





@pytest.mark.nixl
def test_lease_time_runs_through_a_suspend_on_both_nodes():
    """``time.monotonic`` stops while a Linux host is suspended, so a lease outlived by a suspend would
    stay alive on a resumed prefill, and a resumed decode would count reads past its lease (issue 22,
    finding 5): both nodes read lease time from ``CLOCK_BOOTTIME`` unless told otherwise."""
    with rig() as r:
        assert r.prefill.clock is lease_clock and r.decode.clock is lease_clock
    if hasattr(time, "CLOCK_BOOTTIME"):
        assert lease_clock.func is time.clock_gettime and lease_clock.args == (time.CLOCK_BOOTTIME,)
        before = time.clock_gettime(time.CLOCK_BOOTTIME)
        now = lease_clock()
        assert before <= now <= time.clock_gettime(time.CLOCK_BOOTTIME)


@pytest.mark.nixl
@pytest.mark.parametrize("when", ["before_fetch", "after_reads"])
def test_fetch_of_an_expired_lease_raises_lease_expired(when):
    """The reads may well land, but the prefill may have reused the pages: decode must not use them."""
    offset = [0.0]
    expired = threading.Event()

    def on_release(lease, reason):
        if reason == "expired":
            expired.set()

    def expire(message=None) -> None:
        if message is None or isinstance(message, Done):
            offset[0] += 60.0  # past the 5 s ttl on the prefill's clock
            assert expired.wait(DEADLINE), "the prefill did not expire the lease"

    with rig(NodeConfig(ttl=5.0), clock=lambda: time.monotonic() + offset[0], on_release=on_release) as r:
        tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 8), 40, seed=3)
        r.prefill.offer(r.peer, "late", 40, tables, r.layout.full_selection(), meta={"seed": 3})
        link, offer = r.decode.next_offer(DEADLINE)
        # The prefill's clock jumps a minute ahead of the decode's, which the lease's sure window assumes never
        # happens (both read CLOCK_BOOTTIME): only the ack catches it, so every read must land outside that
        # window, with no renewal known (protocol 6 finishes a fetch read inside it without the ack).
        with r.decode._lock:
            known = r.decode.session._links[link.id]
            known.leases[offer.id].sure = None  # no renewal known, and none will be: the answers to the
            known.blind += len(known.beats)  # heartbeats sent so far confirm nothing, later ones are dropped
            known.beats.clear()
            conn = known.conn
            send = conn.send

            def no_renewals(message):
                if when == "after_reads":
                    expire(message)  # every read has landed; the lease lapses before the prefill sees Done
                if not isinstance(message, Heartbeat):
                    send(message)

            conn.send = no_renewals
        if when == "before_fetch":
            expire()
        with pytest.raises(LeaseExpired, match="discard"):
            r.decode.fetch(link, offer, {name: np.arange(10) for name in r.decode.layout.groups})
        assert r.released == [("late", "expired")]
        with r.prefill._lock:
            assert r.prefill.lender.locks.locked_pages() == 0
            assert r.prefill.lender.active_leases == 0
        assert r.decode.tracker.stats.requests == 0
        assert r.prefill.ready_peers() == [r.peer]  # a refused done is no reason to drop the peer


@pytest.mark.nixl
def test_done_ack_survives_the_prefill_closing_right_after_it():
    """The prefill's last ack and its close can land together; the ack must still count.

    This is the example pair's shutdown: the prefill exits once its last lease
    ends, which is just after it sent that lease's done ack.
    """
    released, closed = threading.Event(), threading.Event()
    with rig(on_release=lambda lease, reason: released.set()) as r:
        tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 9), 77, seed=9)
        r.prefill.offer(r.peer, "last", 77, tables, r.layout.full_selection(), meta={"seed": 9})
        link, offer = r.decode.next_offer(DEADLINE)

        def shut_down() -> None:
            if released.wait(DEADLINE):
                r.prefill.close()  # joins its thread, which sends the ack first
                closed.set()

        closer = threading.Thread(target=shut_down, daemon=True)
        closer.start()
        done_sent = threading.Event()
        intercept(
            r.decode, link,
            before_send=lambda m: done_sent.set() if isinstance(m, Done) else None,
            before_poll=lambda: done_sent.is_set() and closed.wait(DEADLINE),
        )
        result = fetch_and_verify(r.decode, link, offer, r.dst, free_lists(r.decode.layout, DST_PAGES, 10))
        closer.join(DEADLINE)
        assert closed.is_set()
        assert result.bound == 77
        with pytest.raises(PeerLost):  # and the loss still shows on the next read
            r.decode.next_offer(1.0)


# ----------------------------------------------------------- two processes
CHILD = r"""
import json, queue, sys, time
import numpy as np
from kvlend.runtime import PrefillNode
from kvlend.security.credentials import Credentials
from tests.support.agents import nixl
from kvlend.testing.kvcache import FreeList, make_layout, make_pools, prefill_request

n_leases, max_tokens, window, deadline_s = map(int, sys.argv[1:5])
pools = make_pools(256)
layout = make_layout(pools)
released = queue.SimpleQueue()
node = PrefillNode(layout, nixl("child-prefill"), Credentials.from_env(),
                   on_release=lambda lease, why: released.put((lease.request, why)))
print("LISTENING", *node.address, flush=True)
node.start()
rng = np.random.default_rng(11)
free = {name: FreeList(256, rng) for name in layout.groups}
tables, ended = {}, []

def reclaim():
    request, why = released.get(timeout=deadline_s)
    ended.append(why)
    for name, table in tables.pop(request).items():
        free[name].release(table)

try:
    peer = node.wait_for_peer(deadline_s)
    for i in range(n_leases):
        while len(tables) >= window:
            reclaim()
        num_tokens = int(rng.integers(1, max_tokens + 1))
        request, seed = f"req-{i}", 5000 + i
        tables[request] = prefill_request(layout, pools, free, num_tokens, seed)
        node.offer(peer, request, num_tokens, tables[request], layout.full_selection(), meta={"seed": seed})
    while tables:
        reclaim()
    end = time.monotonic() + deadline_s
    while node.ready_peers() and time.monotonic() < end:  # until the decode says bye
        time.sleep(0.005)
    print(json.dumps({"ended": ended, "locked": node.lender.locks.locked_pages()}), flush=True)
finally:
    node.close()
    node.backend.close()
"""


def _listening(proc: subprocess.Popen, deadline_s: float) -> tuple[str, int]:
    end = time.monotonic() + deadline_s
    while True:
        remaining = end - time.monotonic()
        if remaining <= 0 or not select.select([proc.stdout], [], [], remaining)[0]:
            raise AssertionError(f"prefill child did not listen within {deadline_s} s")
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"prefill child exited early (rc {proc.wait(DEADLINE)})")
        if line.startswith("LISTENING "):
            _, host, port = line.split()
            return host, int(port)


@pytest.mark.system
def test_two_processes_byte_exact(tmp_path):
    n_leases = 100
    script = tmp_path / "prefill_child.py"
    script.write_text(CHILD)
    errors = (tmp_path / "stderr").open("w+")
    env = child_env(**save_rank(creds("child-prefill", "prefill"), str(tmp_path / "certs")))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(n_leases), str(MAX_TOKENS), "4", str(int(DEADLINE))],
        stdout=subprocess.PIPE, stderr=errors, text=True, env=env,
    )
    try:
        dst = make_pools(DST_PAGES)
        # while the child starts
        decode = DecodeNode(make_layout(dst), nixl("decode"), creds("decode", "decode"), config=DECODE_CONFIG)
        try:
            decode.connect(*_listening(proc, 30.0))
            free = free_lists(decode.layout, DST_PAGES, 12)
            requests = []
            for _ in range(n_leases):
                link, offer = decode.next_offer(DEADLINE)
                result = fetch_and_verify(decode, link, offer, dst, free)
                assert result.bound == offer.num_tokens
                requests.append(offer.request)
            assert requests == [f"req-{i}" for i in range(n_leases)]
        finally:
            decode.close()
            decode.backend.close()
        out, _ = proc.communicate(timeout=30)
        errors.seek(0)
        assert proc.returncode == 0, errors.read()
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary == {"ended": ["done"] * n_leases, "locked": 0}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        errors.close()


@pytest.mark.nixl
@pytest.mark.parametrize("request_id, meta, why", [
    ("r" * 5000, {}, "offer.request"),
    ("numpy-meta", {"seed": np.int64(3)}, "offer.meta"),
    ("nested-meta", {"seed": {"deep": 1}}, "offer.meta"),
])
def test_an_offer_the_decode_would_refuse_takes_no_locks(request_id, meta, why):
    """Checked before lending: no lease, no lock, and the channel to the decode stays usable."""
    with rig() as r:
        tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 9), 8, seed=1)
        with pytest.raises(ProtocolError, match=why):
            r.prefill.offer(r.peer, request_id, 8, tables, r.layout.full_selection(), meta=meta)
        with r.prefill._lock:
            assert r.prefill.lender.active_leases == 0
            assert r.prefill.lender.locks.locked_pages() == 0
        r.prefill.offer(r.peer, "fine", 8, tables, r.layout.full_selection(), meta={"seed": 1})
        link, offer = r.decode.next_offer(DEADLINE)
        assert fetch_and_verify(r.decode, link, offer, r.dst, free_lists(r.decode.layout, DST_PAGES, 10)).bound == 8


@pytest.mark.nixl
def test_bad_arguments_are_kvlend_errors_before_anything_happens():
    with pytest.raises(ConfigError, match="chunk_pages"):
        NodeConfig(chunk_pages=1.5)
    with pytest.raises(ConfigError, match="ttl"):
        NodeConfig(ttl="30")
    with rig() as r:
        busy_port = r.prefill.address[1]
        backend = nixl("second-prefill")
        try:
            with pytest.raises(ConfigError, match="cannot listen"):
                PrefillNode(r.layout, backend, creds("prefill", "prefill"), port=busy_port)
        finally:
            backend.close()
        gone = Link(999, "127.0.0.1", 1, "nobody", r.link.plan, 0.0)
        with pytest.raises(PeerLost, match="999"):
            r.decode.fetch(gone, None, {})
        r.decode.disconnect(gone)  # an unknown link: nothing to do


@pytest.mark.nixl
def test_reads_posted_to_a_backend_closed_under_the_node_end_with_an_error():
    """A backend that holds no read any more can never report the ones posted to it: their fetch
    ends with ``BackendError`` instead of waiting forever (issue 22, finding 6)."""
    with rig() as r:
        tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 5), 40, seed=5)
        r.prefill.offer(r.peer, "orphaned", 40, tables, r.layout.full_selection(), meta={"seed": 5})
        link, offer = r.decode.next_offer(DEADLINE)
        free = free_lists(r.decode.layout, DST_PAGES, 6)
        handle = r.decode.start_fetch(offer, {name: free[name].alloc(10) for name in r.layout.groups}, link=link)
        r.decode.backend.close()  # its reads (copied at once over cma, not yet reported) are gone with it
        r.decode.wait([handle], DEADLINE)
        assert isinstance(handle.error, BackendError) and "transfer backend failed" in str(handle.error)
