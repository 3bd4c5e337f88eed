"""Faults with real processes and real NIXL: SIGKILLed ranks, resume from the safe bound, refusals.

The killed rank is always a child process (``tests.support.fault_ranks``); the
test process holds the other side and watches what the survivor does: a
prefill whose decode died drops the page locks once the lease TTL passes and
serves a new decode; a decode whose prefill died gets ``PeerLost`` with the
safe-resume bound and finishes the request from a replacement prefill,
reading only the pages at or above the bound, and the toy model then
generates exactly the single-process reference.  Each child gets its own
certificate from the tests' cluster CA, as files in a private directory.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque

import numpy as np
import pytest

from kvlend.demo import toy_engine
from kvlend.errors import AuthError, KvlendError, PeerLost, TransferTimeout
from kvlend.protocol.codes import Code
from kvlend.protocol.wire import Done, DoneAck, Heartbeat
from kvlend.runtime import DecodeNode, NodeConfig
from kvlend.security.certs import Authority
from kvlend.testing.kvcache import prefill_request
from tests.support.agents import nixl
from tests.support.certs import creds
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
    wait_until,
)
from tests.support.ranks import Rank
from tests.support.raw_peer import RawDecode

TTL, BEAT = 1.5, 0.3
FAULT_CONFIG = NodeConfig(ttl=TTL, heartbeat=BEAT, chunk_pages=1, handshake_timeout=DEADLINE,
                          transfer_timeout=DEADLINE)


# ------------------------------------------------- connections not yet authenticated
@pytest.mark.nixl
def test_a_silent_client_does_not_stall_the_prefill():
    """A connection that never starts its TLS handshake stays half-open while an honest decode is served."""
    with rig() as r:
        silent = socket.create_connection(r.prefill.address, timeout=DEADLINE)
        try:
            end = time.monotonic() + DEADLINE
            while r.prefill.unauthenticated == 0:  # the prefill took it in, and waits on it
                assert time.monotonic() < end, "the silent connection was never accepted"
                time.sleep(0.005)
            other = DecodeNode(r.decode.layout, nixl("second"), creds("second", "decode"), config=DECODE_CONFIG)
            try:
                link = other.connect(*r.prefill.address)  # completes while the silent one is still pending
                peer = "second"
                end = time.monotonic() + DEADLINE
                while peer not in r.prefill.ready_peers():
                    assert time.monotonic() < end
                    time.sleep(0.005)
                assert r.prefill.unauthenticated == 1
                tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 21), 60, seed=21)
                r.prefill.offer(peer, "while-silent", 60, tables, r.layout.full_selection(), meta={"seed": 21})
                got, offer = other.next_offer(DEADLINE)
                assert got == link
                dst = free_lists(other.layout, DST_PAGES, 22)
                assert fetch_and_verify(other, got, offer, r.dst, dst).bound == 60
                assert r.prefill.unauthenticated == 1
            finally:
                other.close()
                other.backend.close()
        finally:
            silent.close()


# -------------------------------------------------------- decode dies
@pytest.mark.system
def test_sigkill_decode_mid_transfer_frees_locks_within_ttl_and_a_new_decode_serves_100():
    released: deque = deque()
    with rig(FAULT_CONFIG, on_release=lambda lease, reason: released.append((lease.request, reason))) as r:
        child = Rank("decode7", "decode", "--connect", "%s:%d" % r.prefill.address, "--gen", "7",
                     "--ttl", str(TTL), "--heartbeat", str(BEAT), "--chunk-pages", "1", "--slow", "0.1")
        try:
            child.event("connected", 30.0)
            end = time.monotonic() + DEADLINE
            while "decode7" not in r.prefill.ready_peers():
                assert time.monotonic() < end
                time.sleep(0.005)
            src_free = free_lists(r.layout, SRC_PAGES, 31)
            tables = prefill_request(r.layout, r.src, src_free, MAX_TOKENS, seed=31)
            lease = r.prefill.offer("decode7", "doomed", MAX_TOKENS, tables, r.layout.full_selection(),
                                    meta={"seed": 31})
            child.event("mid_transfer")  # 40 chunks paced 0.1 s apart: the kill lands mid-transfer
            time.sleep(2 * BEAT)  # long enough that only heartbeats can have kept the lease
            assert_locked(r.prefill, tables, True)
            assert r.prefill.lender.get(lease.id, r.prefill.clock()).id == lease.id
            child.kill()
            killed = time.monotonic()
            while True:
                with r.prefill._lock:
                    locked = r.prefill.lender.locks.locked_pages()
                if locked == 0:
                    break
                assert time.monotonic() - killed <= TTL + BEAT, f"{locked} pages still locked after TTL + heartbeat"
                time.sleep(0.005)
            freed_after = time.monotonic() - killed
            end = time.monotonic() + DEADLINE  # the engine hears of it just after the unlock, outside the lock
            while not released and time.monotonic() < end:
                time.sleep(0.005)
            assert list(released) == [("doomed", "expired")]
            assert "decode7" not in r.prefill.ready_peers()
            print(f"\nlocks of the killed decode dropped {freed_after:.2f} s after SIGKILL "
                  f"(ttl {TTL}, heartbeat {BEAT})")
            for name, table in tables.items():
                src_free[name].release(table)

            # A new decode, connected after the kill: the next 100 requests verify byte for byte.
            fresh = DecodeNode(r.decode.layout, nixl("fresh"), creds("fresh", "decode"), config=DECODE_CONFIG)
            try:
                fresh.connect(*r.prefill.address)
                end = time.monotonic() + DEADLINE
                while "fresh" not in r.prefill.ready_peers():
                    assert time.monotonic() < end
                    time.sleep(0.005)
                dst_free = free_lists(fresh.layout, DST_PAGES, 32)
                rng = np.random.default_rng(33)
                for i in range(100):
                    n = int(rng.integers(1, MAX_TOKENS + 1))
                    tables = prefill_request(r.layout, r.src, src_free, n, seed=100 + i)
                    r.prefill.offer("fresh", f"after-{i}", n, tables, r.layout.full_selection(),
                                    meta={"seed": 100 + i})
                    link, offer = fresh.next_offer(DEADLINE)
                    assert offer.request == f"after-{i}"
                    assert fetch_and_verify(fresh, link, offer, r.dst, dst_free).bound == n
                    for name, table in tables.items():
                        src_free[name].release(table)
            finally:
                fresh.close()
                fresh.backend.close()
            with r.prefill._lock:
                assert r.prefill.lender.locks.locked_pages() == 0
            assert sum(reason == "done" for _, reason in released) == 100
        finally:
            child.kill()


# -------------------------------------------------------- prefill dies
def wait_trusted(node: DecodeNode, link, offer) -> None:
    """Until a heartbeat renewal confirmed the pushed offer: only then do reads count without a done ack."""
    end = time.monotonic() + DEADLINE
    while offer.id not in node.session._links[link.id].sure:
        assert time.monotonic() < end, "the offer was never renewed"
        node.step(0.01)


class KillAfterFirstChunk:
    """Wraps the decode's real NIXL backend: once the first read has landed, SIGKILL the prefill.

    The first chunk's completion is kept for the node's next ``poll``, so the
    tracker counts it; every later read then goes to a dead process.  Records
    every posted local descriptor.
    """

    def __init__(self, backend, victim: Rank | None) -> None:
        self.backend = backend
        self.victim = victim
        self.local_rows: list[np.ndarray] = []
        self._stash: list = []

    def post_read(self, peer, batches, tag):
        self.backend.post_read(peer, batches, tag)
        self.local_rows.extend(b.local for b in batches)
        if self.victim is not None and self.victim.proc.poll() is None:
            end = time.monotonic() + DEADLINE
            while not any(c.tag == tag for c in self._stash):
                assert time.monotonic() < end, "the first chunk never landed"
                self._stash.extend(self.backend.poll())
            assert all(c.error is None for c in self._stash)
            self.victim.kill()

    def poll(self):
        out, self._stash = self._stash + self.backend.poll(), []
        return out

    def __getattr__(self, name):
        return getattr(self.backend, name)


@pytest.mark.system
def test_sigkill_prefill_mid_transfer_resumes_from_the_bound_and_matches_the_reference():
    cfg = toy_engine.preset("tiny", seed=0)
    model = toy_engine.ToyModel(cfg)
    tpp, prompt_len, new_tokens = cfg.tokens_per_page, 200, 8
    prompt = toy_engine.make_prompts(1, 0, prompt_len, prompt_len, cfg.vocab)[0]
    cache = toy_engine.PagedKVCache(cfg, 2 * -(-(prompt_len + new_tokens) // tpp), seed=9)
    args = ("--ttl", str(TTL), "--heartbeat", str(BEAT), "--prompt-len", str(prompt_len))
    first = Rank("toy-prefill", "toy-prefill", "--gen", "1", *args)
    second = None
    node = DecodeNode(cache.layout(), nixl("decode"), creds("decode", "decode"), config=FAULT_CONFIG)
    try:
        old_agent = node._agents[node.connect(*first.listening()).id]
        peer, offer = node.next_offer(DEADLINE)
        wait_trusted(node, peer, offer)
        table = cache.alloc(-(-prompt_len // tpp))
        hook = KillAfterFirstChunk(node.backend, first)
        node.backend = hook
        start = time.monotonic()
        with pytest.raises((PeerLost, TransferTimeout)) as info:
            node.fetch(peer, offer, {"full": table})
        assert time.monotonic() - start <= FAULT_CONFIG.transfer_timeout
        bound = info.value.bound
        assert info.value.request == "toy-0"
        assert 0 < bound < prompt_len and bound % tpp == 0, bound  # the first chunk, maybe more
        assert node.links == []  # the dead link and its NIXL peer are gone
        assert node.tracker.stats.requests == 0

        # A replacement prefill (its pages elsewhere in its pool) lends the request again.
        second = Rank("toy-prefill", "toy-prefill", "--gen", "2", *args)
        link = node.connect(*second.listening())
        assert node._agents[link.id] != old_agent  # a new NIXL remote agent, same decode process
        peer, offer = node.next_offer(DEADLINE)
        hook.victim, hook.local_rows = None, []
        result = node.fetch(peer, offer, {"full": table}, resume_from=bound)
        pages_left = -(-prompt_len // tpp) - bound // tpp
        slot = 2 * cfg.kv_heads * tpp * cfg.head_dim * 4  # K and V, float32
        assert result.resumed_from == bound and result.bound == prompt_len
        assert result.bytes == pages_left * cfg.layers * slot
        below = set()
        for layer in range(cfg.layers):
            view = cache.page_view(layer)
            below |= {view[p].ctypes.data for p in table[: bound // tpp]}
        read = np.concatenate(hook.local_rows)
        assert int(read[:, 1].sum()) == result.bytes
        starts = read[:, 0]
        for addr in below:  # no descriptor touches a page below the bound
            assert not ((starts <= addr) & (addr < starts + read[:, 1])).any()
        print(f"\nprefill killed at bound {bound}/{prompt_len} tokens; resume read {pages_left} of "
              f"{-(-prompt_len // tpp)} pages ({result.bytes} bytes)")

        out = toy_engine.decode(model, cache, table, prompt_len, offer.meta["first"], new_tokens)
        assert out == toy_engine.generate_reference(model, prompt, new_tokens)
    finally:
        node.close()
        node.backend.close()
        first.kill()
        if second is not None:
            second.finish(DEADLINE)


# ------------------------------------------------------------- refusals
def record_session(r, identity: str) -> bytes:
    """The bytes a decode ``identity`` sends to ``r``'s prefill in a whole session (connect, then close)."""
    node = DecodeNode(r.decode.layout, nixl(identity), creds(identity, "decode"), config=DECODE_CONFIG)
    sent = bytearray()
    send = node._sockets.send

    def record(conn: int, data: bytes) -> None:
        sent.extend(data)
        send(conn, data)

    node._sockets.send = record
    try:
        node.connect(*r.prefill.address)
        r.prefill.wait_for_peers(2, DEADLINE)
    finally:
        node.close()
        node.backend.close()
    end = time.monotonic() + DEADLINE
    while identity in r.prefill.ready_peers():
        assert time.monotonic() < end, f"the prefill still holds {identity} after it closed"
        time.sleep(0.005)
    return bytes(sent)


def hung_up(sock: socket.socket) -> bool:
    """Read (and drop) what the peer sends until it hangs up; False if it did not within the socket's timeout."""
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        return False
    return True


def logged(caplog, text: str) -> bool:
    """Whether a complete log record holds ``text`` (records are appended whole; the text is not)."""
    return any(text in record.getMessage() for record in list(caplog.records))


@pytest.mark.nixl
def test_a_foreign_certificate_a_replayed_session_and_another_decodes_lease_are_refused(caplog):
    caplog.set_level(logging.INFO)
    with rig(NodeConfig(ttl=30.0)) as r:
        # A certificate from another CA: no channel, no metadata, no peer.
        intruder = DecodeNode(r.decode.layout, nixl("intruder"), Authority.create().issue("intruder", "decode"),
                              config=NodeConfig(handshake_timeout=2.0))
        try:
            with pytest.raises(AuthError, match="CERTIFICATE_VERIFY_FAILED"):
                intruder.connect(*r.prefill.address)
            assert intruder.links == [] and "intruder" not in r.prefill.ready_peers()
        finally:
            intruder.backend.close()

        tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 41), 50, seed=41)
        lease = r.prefill.offer(r.peer, "a-only", 50, tables, r.layout.full_selection(), meta={"seed": 41})
        link_a, offer = r.decode.next_offer(DEADLINE)

        # Everything an honest decode sent, from its ClientHello to its goodbye, replayed on a new
        # connection once it left: the prefill's fresh handshake keys make the rest garbage.
        recorded = record_session(r, "recorded")
        caplog.clear()
        with socket.create_connection(r.prefill.address, timeout=DEADLINE) as replay:
            replay.sendall(recorded)
            assert hung_up(replay), "the prefill never hung up on the replayed session"
        # the loop thread logs the failure after it hung up: wait for the record, not the text being written
        deadline = time.monotonic() + DEADLINE
        while not logged(caplog, "TLS handshake failed") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "recorded" not in r.prefill.ready_peers() and logged(caplog, "TLS handshake failed")

        # Decode B, properly connected, sends Heartbeat and Done for A's lease.
        with RawDecode(r.prefill.address, creds("decode-b", "decode")) as b:
            b.handshake(r.decode.layout)
            before = r.prefill.lender.get(lease.id, r.prefill.clock()).expires_at
            time.sleep(0.05)  # so a renewal would move the expiry
            b.send(Done(lease.id, 50))
            ack = b.recv(DEADLINE)
            assert isinstance(ack, DoneAck) and ack.lease == lease.id
            assert ack.code is Code.LEASE_DENIED and ack.detail.startswith("LeaseDenied")
            assert "decode-b" in r.prefill.ready_peers()  # a done refused, not dropped
            b.send(Heartbeat((lease.id,)))  # a lease it was never given: dropped (issue 22, 3)
            with pytest.raises(PeerLost):
                b.recv(DEADLINE)
            with r.prefill._lock:
                assert r.prefill.lender.get(lease.id, r.prefill.clock()).expires_at == before  # not renewed
            assert_locked(r.prefill, tables, True)
            assert "decode-b" not in r.prefill.ready_peers()

        # A's lease survived all three and reads fine.
        result = fetch_and_verify(r.decode, link_a, offer, r.dst, free_lists(r.decode.layout, DST_PAGES, 42))
        assert result.bound == 50
        wait_until(lambda: r.released == [("a-only", "done")], "its Done, unanswered, released the lease")
        assert_locked(r.prefill, tables, False)


@pytest.mark.nixl
def test_a_lease_expired_under_a_reader_reports_bound_zero_for_what_it_read():
    """Nothing read under an expired lease may be used: the error's bound says so."""
    offset = [0.0]
    with rig(NodeConfig(ttl=5.0), clock=lambda: time.monotonic() + offset[0]) as r:
        tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 51), 40, seed=51)
        r.prefill.offer(r.peer, "late", 40, tables, r.layout.full_selection(), meta={"seed": 51})
        link, offer = r.decode.next_offer(DEADLINE)
        offset[0] += 60.0
        end = time.monotonic() + DEADLINE
        while r.prefill.lender.active_leases:
            assert time.monotonic() < end
            time.sleep(0.005)
        with pytest.raises(KvlendError) as info:
            r.decode.fetch(link, offer, {name: np.arange(10) for name in r.decode.layout.groups})
        assert type(info.value).__name__ == "LeaseExpired" and info.value.bound == 0
        assert r.decode.links  # the prefill is fine: the link stays


@pytest.mark.nixl
def test_resume_from_is_validated_before_anything_moves():
    with rig() as r:
        tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 61), 20, seed=61)
        r.prefill.offer(r.peer, "bad-resume", 20, tables, r.layout.full_selection(), meta={"seed": 61})
        link, offer = r.decode.next_offer(DEADLINE)
        for bad in (-1, 21, 1.5, True):
            with pytest.raises(KvlendError, match="resume_from"):
                r.decode.fetch(link, offer, {name: np.arange(5) for name in r.decode.layout.groups}, resume_from=bad)
        assert r.decode.tracker.stats.requests == 0
        result = fetch_and_verify(r.decode, link, offer, r.dst, free_lists(r.decode.layout, DST_PAGES, 62))
        assert result.bound == 20 and result.resumed_from == 0


@pytest.mark.nixl
@pytest.mark.parametrize("late", [False, True])
def test_without_a_done_ack_only_reads_made_while_the_lease_was_surely_valid_count(late):
    """The prefill vanishes between the last read and the done ack: nobody confirms the lease.

    Read promptly, every page counts: the fetch is done without the ack (protocol 6), and the prefill
    vanishing on its Done changes nothing.  Read after sitting on the offer past its TTL with no
    heartbeat getting through (the prefill may have expired it and reused the pages), the fetch waits
    for the ack, fails when the link goes, and no page counts.
    """
    offset = [0.0]
    with rig() as r:
        decode = DecodeNode(r.decode.layout, nixl("slow"), creds("slow", "decode"),
                            config=NodeConfig(ttl=5.0, heartbeat=1.0, transfer_timeout=DEADLINE),
                            clock=lambda: time.monotonic() + offset[0])
        try:
            decode.connect(*r.prefill.address)
            end = time.monotonic() + DEADLINE
            while "slow" not in r.prefill.ready_peers():
                assert time.monotonic() < end
                time.sleep(0.005)
            tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 71), 48, seed=71)
            r.prefill.offer("slow", "unconfirmed", 48, tables, r.layout.full_selection(), meta={"seed": 71})
            link, offer = decode.next_offer(DEADLINE)
            if late:  # no heartbeat gets through any more, and on the decode's clock the TTL runs out
                decode.session._renewable = lambda link: []
                offset[0] += 2 * offer.ttl

            def vanish(message):
                if isinstance(message, Done) or isinstance(message, Heartbeat) and message.done:
                    r.prefill.close()

            intercept(decode, link, before_send=vanish)
            dst = {name: np.arange(12) for name in decode.layout.groups}
            if not late:
                assert decode.fetch(link, offer, dst).bound == 48
                return
            with pytest.raises(PeerLost) as info:
                decode.fetch(link, offer, dst)
            assert info.value.bound == 0
            assert decode.links == []
        finally:
            decode.close()
            decode.backend.close()
