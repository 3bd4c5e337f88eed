"""Authenticated decodes that misbehave, against an in-memory ``PrefillSession`` (issue 22, 2, 3 and 9).

A peer by hand: the prefill's session is fed its frames and the replies meant
for it are decoded back, on a fake clock.  A peer that authenticates and never
sends its layout is dropped after ``handshake_timeout`` and frees its identity;
a heartbeat naming leases its peer never claimed nor was offered drops it; what
a heartbeat could not renew is one rate-limited line, not one per id; only a
lease's holder renews or ends it (a ticket's lease, once claimed).
"""

from __future__ import annotations

import logging
import secrets
import struct

import msgpack
import pytest

from kvlend.core.lease import LendOptions
from kvlend.protocol.actions import Close, Send
from kvlend.protocol.codes import Code
from kvlend.protocol.config import NodeConfig, Quotas
from kvlend.protocol.connection import FrameReader
from kvlend.protocol.prefill_peer import LOG_EVERY
from kvlend.protocol.wire import (
    PROTOCOL_VERSION,
    Abort,
    Bye,
    Claim,
    Done,
    DoneAck,
    Handshake,
    Heartbeat,
    Offer,
    Renewed,
    encode_frame,
)
from kvlend.testing import KIND, World

pytestmark = pytest.mark.unit

CFG = NodeConfig(ttl=5.0, heartbeat=1.0, handshake_timeout=3.0, claim_wait=1.0)


class Peer:
    """An authenticated decode on ``p``'s session as connection ``conn``, sending what a test says."""

    def __init__(self, p, conn: int, identity: str, *, layout: bool = True) -> None:
        self.p, self.conn, self.identity = p, conn, identity
        self.reader = FrameReader()
        self.inbox: list = []
        self.closed: str | None = None
        p.session.accept(conn, p.now)
        p.session.authenticated(conn, identity, p.now)
        if layout:
            self.send(Handshake(p.layout.encode(), KIND, b"metadata"))
            assert isinstance(self.next(), Handshake)

    def send(self, *messages) -> None:
        self.p.session.receive(self.conn, b"".join(map(encode_frame, messages)), self.p.now)

    def next(self):
        """The next message for this peer (what the session queued since is read first)."""
        if not self.inbox:
            collect(self.p, self)
        return self.inbox.pop(0)


def collect(p, *peers: Peer) -> None:
    """Hand the session's queued actions to the peers they are for."""
    by_conn = {peer.conn: peer for peer in peers}
    for action in p.session.take_actions():
        peer = by_conn.get(action.conn)
        if peer is None:
            continue
        if isinstance(action, Send):
            messages, error = peer.reader.read(action.data)
            assert error is None, error
            peer.inbox.extend(messages)
        elif isinstance(action, Close):
            peer.closed = action.reason


def prefill(config: NodeConfig = CFG):
    world = World(0)
    return world, world.add_prefill(config=config)


def at(world, p, now: float) -> None:
    """Move the fake clock to ``now`` and tick the prefill (without the world's pump: the peers read)."""
    world.now = now
    p.session.tick(p.now)


def session_lines(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvlend.session" and needle in r.getMessage()]


# ------------------------------------------------------------------- layout
def test_a_peer_that_never_sends_its_layout_is_dropped_and_frees_its_identity():
    world, p = prefill()
    silent = Peer(p, 1, "decode-a", layout=False)
    assert p.session.next_deadline() == pytest.approx(p.now + CFG.handshake_timeout)
    at(world, p, world.now + CFG.handshake_timeout - 0.01)
    assert silent.closed is None
    at(world, p, world.now + 0.02)
    bye = silent.next()
    assert isinstance(bye, Bye) and bye.code is Code.PROTOCOL
    assert "no handshake within handshake_timeout 3 s" in bye.detail
    assert silent.closed is not None
    again = Peer(p, 2, "decode-a")  # the identity's slot is free again
    assert p.session.peers == ["decode-a"] and again.closed is None


# --------------------------------------------------------------- heartbeats
def test_a_heartbeat_naming_ids_never_granted_drops_the_peer_in_one_line(caplog):
    """Issue 22: 16,384 unknown ids held the lock 631 ms and wrote 16,384 lines."""
    caplog.set_level(logging.INFO, logger="kvlend.session")
    world, p = prefill()
    evil = Peer(p, 1, "decode-evil")
    honest = p.lend(16, seed=1)
    caplog.clear()
    evil.send(Heartbeat(tuple(secrets.token_bytes(16) for _ in range(16383)) + (honest.id,)))
    collect(p, evil)
    assert evil.closed.startswith("LeaseDenied: a heartbeat named lease "), evil.closed
    assert "never claimed nor was offered" in evil.closed and not evil.inbox and p.session.peers == []
    assert len(session_lines(caplog, "decode-evil")) == 1  # the drop
    assert p.lender.get(honest.id, p.now).expires_at == honest.expires_at  # renewed nothing


def test_what_a_heartbeat_cannot_renew_is_one_line_per_log_every(caplog):
    """A decode heartbeating 100 leases the engine released: each heartbeat is answered, one line says so."""
    caplog.set_level(logging.INFO, logger="kvlend.session")
    world, p = prefill()
    peer = Peer(p, 1, "decode-a")
    leases = [p.lend(4, seed=i) for i in range(100)]
    peer.send(*(Claim(lease.id) for lease in leases))
    assert all(isinstance(peer.next(), Offer) for _ in leases)
    for lease in leases:
        p.session.release(lease.id)
    collect(p, peer)
    assert all(isinstance(m, Abort) for m in peer.inbox)
    peer.inbox.clear()
    peer.send(*(Abort(lease.id, Code.CANCELLED, "quiet") for lease in leases))  # one ignoring them is dropped
    beats = 5
    for _ in range(beats):
        peer.send(Heartbeat(tuple(lease.id for lease in leases)))
        assert peer.next() == Renewed(())
    assert peer.closed is None and p.session.peers == ["decode-a"]
    lines = session_lines(caplog, "heartbeat from decode-a")
    assert lines == [f"heartbeat from decode-a: 100 of 100 leases not renewed, the first: lease {leases[0].hex} "
                     "was released"]
    at(world, p, world.now + LOG_EVERY)
    peer.send(Heartbeat((leases[0].id,)))
    assert peer.next() == Renewed(())
    assert session_lines(caplog, "heartbeat from decode-a")[1].endswith(
        f"({beats - 1} more heartbeats with something to say since the last line)")


def test_a_heartbeat_racing_the_refusal_of_a_claim_keeps_the_peer():
    """A decode heartbeats a claim until its answer comes: a refused (bogus) ticket must not cost it its link."""
    world, p = prefill(NodeConfig(ttl=5.0, heartbeat=1.0))
    peer = Peer(p, 1, "decode-a")
    bogus = secrets.token_bytes(16)
    peer.send(Claim(bogus), Heartbeat((bogus,)))
    assert isinstance(peer.next(), Abort) and peer.next() == Renewed(())
    assert peer.closed is None and p.session.peers == ["decode-a"]


# ----------------------------------------------------------- ticket leases
def test_only_the_holder_of_a_tickets_lease_renews_or_ends_it():
    """Issue 22, 9: another decode could renew or end a ticket's lease before its holder claimed it."""
    world, p = prefill()
    holder, other = Peer(p, 1, "decode-a"), Peer(p, 2, "decode-b")
    lease = p.lend(16, seed=1)
    other.send(Done(lease.id, 16))
    ack = other.next()
    assert isinstance(ack, DoneAck) and ack.code is Code.LEASE_DENIED and ack.detail.startswith("LeaseDenied: "), ack
    other.send(Abort(lease.id, Code.CANCELLED, "not mine"))
    world.now += 1.0
    other.send(Heartbeat((lease.id,)))
    collect(p, holder, other)
    assert other.closed is not None  # it named a lease it never claimed
    assert p.lender.get(lease.id, p.now).expires_at == lease.expires_at  # neither ended nor renewed
    holder.send(Claim(lease.id))
    assert isinstance(holder.next(), Offer)
    holder.send(Done(lease.id, 16))
    assert holder.next() == DoneAck(lease.id, Code.OK, "")
    assert p.lender.active_leases == 0


def test_claims_waiting_for_their_lend_are_capped_per_connection_and_expire_in_order():
    world, p = prefill(NodeConfig(ttl=5.0, heartbeat=1.0, claim_wait=1.0,
                                  quotas=Quotas(max_leases_per_peer=3)))
    a, b = Peer(p, 1, "decode-a"), Peer(p, 2, "decode-b")
    ids = [bytes([i]) * 16 for i in range(5)]
    a.send(*(Claim(i) for i in ids[:4]))  # three wait, the fourth is refused at once
    refused = a.next()
    assert isinstance(refused, Abort) and refused.lease == ids[3] and not a.inbox
    world.now += 0.5
    b.send(Claim(ids[4]))
    p.session.lend("late", 16, p._tables(16, 9), p.layout.full_selection(), p.now, LendOptions(ids[1]))
    assert isinstance(a.next(), Offer)
    at(world, p, world.now + 0.51 + 1e-6)  # a's other two expire, b's has 0.5 s left
    assert [m.lease for m in (a.next(), a.next())] == [ids[0], ids[2]] and not b.inbox
    b.send(Bye(Code.OK, "leaving"))
    collect(p, a, b)
    at(world, p, world.now + 1.0)  # its claim left with it: nothing to answer
    assert not b.inbox


# ---------------------------------------------------------------- versions
def test_a_decode_of_an_older_release_is_refused_naming_both_versions():
    """Its first frame is refused before its fields are read; the bye (which it cannot read either, and
    refuses naming both versions in turn) and the drop say which versions differ."""
    world, p = prefill()
    old = Peer(p, 1, "decode-old", layout=False)
    payload = msgpack.packb([PROTOCOL_VERSION - 1, {"t": "bye", "reason": "hello"}], use_bin_type=True)
    p.session.receive(1, struct.pack(">I", len(payload)) + payload, p.now)
    bye = old.next()
    why = f"peer speaks kvlend protocol version {PROTOCOL_VERSION - 1}, this rank speaks {PROTOCOL_VERSION}"
    assert isinstance(bye, Bye) and bye.code is Code.PROTOCOL and why in bye.detail, bye
    assert why in old.closed and p.session.peers == []
