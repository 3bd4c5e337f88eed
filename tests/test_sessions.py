"""PrefillSession and DecodeSession together, sans-IO: an in-memory network, backend and clock.

No sockets, no NIXL, no threads: ``kvlend.testing.World`` executes the
sessions' actions, copies real bytes between numpy pools and checks the
contract on every step (nothing lands in a finished fetch, a fetch finishes
only once its reads are terminal, ``Done``/``Abort`` release a lease only
once nothing can still read it, the bound always names bytes that are
really there).  Each test drives one scenario with the clock in its hands.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvlend.protocol.fetch as fetch_mod
from kvlend.core.layout import RowSelection
from kvlend.core.prompt import prompt_digest
from kvlend.errors import (
    AuthError,
    BackendError,
    ConfigError,
    IncompleteFetch,
    KvlendError,
    LayoutMismatch,
    LeaseDenied,
    LeaseError,
    LeaseExpired,
    LeaseUnknown,
    PageRangeError,
    PeerLost,
    PromptMismatch,
    ProtocolError,
    TransferCancelled,
    TransferTimeout,
)
from kvlend.protocol.actions import ClaimWaits, Close, LeaseEnded, Offered, RemovePeer, Send
from kvlend.protocol.codes import Code
from kvlend.protocol.config import NodeConfig
from kvlend.protocol.connection import AUTH_TIMEOUT
from kvlend.protocol.decode import DecodeSession, FetchState
from kvlend.protocol.ticket import Ticket
from kvlend.protocol.wire import Abort, Bye, Claim, Handshake, Renewed, encode_frame
from kvlend.testing import KIND, SCRIBBLE, ContractError, World, finish_all, rig
from kvlend.testing.kvcache import group_layers, slots
from tests.support.wire import decode_all

pytestmark = pytest.mark.unit

CFG = NodeConfig(ttl=5.0, heartbeat=1.0, handshake_timeout=3.0, transfer_timeout=20.0, cancel_grace=2.0,
                 chunk_pages=4)
EPS_T = 0.01  # just past a deadline
LONG = NodeConfig(ttl=5.0, heartbeat=1.0, handshake_timeout=3.0, transfer_timeout=1e6, cancel_grace=2.0,
                  chunk_pages=4)


def locked(prefill) -> int:
    return prefill.lender.locks.locked_pages()


def live(prefill, lease) -> bool:
    """Whether ``lease`` (a Lease, or a Ticket's) is live on the prefill."""
    try:
        prefill.lender.get(lease.lease if isinstance(lease, Ticket) else lease.id, prefill.now)
        return True
    except KvlendError:
        return False


def confirm(world) -> None:
    """One tick with no time passing: the heartbeat a pushed offer asked for goes out and its renewal comes back.

    Only then do a pushed fetch's reads count for the bound before the done ack.
    """
    world.tick()


# ----------------------------------------------------------------- happy paths
@pytest.mark.parametrize("shuffle", [False, True])
def test_many_fetches_at_once_over_one_link(shuffle):
    world, p, d, conn = rig(CFG, seed=3, shuffle=shuffle, fragment=shuffle)
    sizes = [1, 3, 4, 17, 40, 63, 64, 65, 100]
    tickets = [p.ticket(n, seed=i) for i, n in enumerate(sizes)]
    records = [d.fetch_ticket(t, seed=i) for i, t in enumerate(tickets)]
    assert d.session.in_flight == len(sizes)
    assert d.session.links == [conn]  # one link shared by every fetch
    assert all(r.fetch.state is FetchState.READING for r in records)
    assert locked(p) > 0
    finish_all(world, d)
    for r, n in zip(records, sizes):
        assert r.fetch.state is FetchState.DONE, r.fetch.error
        assert r.fetch.bound == n and r.fetch.quiet and r.finished
    assert sorted(reason for _, reason in p.ended) == ["done"] * len(sizes)
    assert locked(p) == 0 and p.lender.active_leases == 0
    assert d.session.in_flight == 0 and d.session.tracker.stats.requests == 0
    world.check_locks()


def test_many_fetches_from_two_prefills_with_their_own_clocks():
    world = World(11, shuffle=True, fragment=True)
    p1 = world.add_prefill("p1", port=7001, config=CFG, offset=-500.0)
    p2 = world.add_prefill("p2", port=7002, config=CFG, offset=12345.0)
    d = world.add_decode(config=CFG)
    records = []
    for i in range(12):
        p = (p1, p2)[i % 2]
        records.append(d.fetch_ticket(p.ticket(5 + 9 * i, seed=i), seed=i))  # connects on first use
    assert len(d.session.links) == 2
    for _ in range(3):  # time passes in between: heartbeats on both links
        world.advance(1.5)
        reads = d.backend.in_flight()
        for read in reads[: len(reads) // 2]:
            d.backend.finish(read.tag)
        world.pump()
    finish_all(world, d)
    assert all(r.fetch.state is FetchState.DONE for r in records)
    assert locked(p1) == locked(p2) == 0
    world.check_locks()


def test_pushed_offers_are_read_and_declined():
    world, p, d, conn = rig(CFG)
    leases = [p.offer("decode", 10 + i, seed=i) for i in range(3)]
    offered = [e for e in d.events if isinstance(e, Offered)]
    assert [e.offer.id for e in offered] == [lease.id for lease in leases]
    a = d.fetch_offer(conn, offered[0].offer)
    b = d.fetch_offer(conn, offered[1].offer)
    d.session.decline(conn, offered[2].offer, "no room")
    world.pump()
    assert (leases[2].id, "aborted") in p.ended
    finish_all(world, d)
    assert a.fetch.state is b.fetch.state is FetchState.DONE
    assert sorted(r for _, r in p.ended) == ["aborted", "done", "done"]
    assert locked(p) == 0


def test_offer_to_an_unknown_peer_takes_no_locks():
    world, p, d, conn = rig(CFG)
    with pytest.raises(PeerLost):
        p.offer("nobody", 8, seed=1)
    assert locked(p) == 0 and p.lender.active_leases == 0


def test_resume_from_skips_what_an_earlier_fetch_read():
    world, p, d, conn = rig(CFG)
    t = p.ticket(40, seed=9)
    r = d.fetch_ticket(t, resume_from=16, seed=9)  # pages 0..3 were read by an earlier lease
    assert r.fetch.bound == 16
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == 40
    written = {(tag, addr) for tag, addr, _, _ in d.backend.writes}
    assert written  # and none into pages 0..3: the transport's write check enforces it


# --------------------------------------------------------------------- tickets
def test_unknown_ticket_fails_lease_unknown():
    world, p, d, conn = rig(CFG)
    t = p.ticket(8, seed=1)
    p.session.release(t.lease)
    world.pump()
    r = d.fetch_ticket(t)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LeaseUnknown)
    assert r.fetch.error.bound == 0 and not d.backend.reads


def test_expired_ticket_fails_lease_expired_before_the_prefill_ticks():
    world, p, d, conn = rig(CFG)
    t = p.ticket(8, seed=1)
    world.now += CFG.ttl + 1  # past expiry, the prefill has not ticked yet
    r = d.fetch_ticket(t)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LeaseExpired), r.fetch.error


def test_expired_ticket_fails_lease_expired_after_the_prefill_ticked():
    """The lender remembers expired ids so a late claim hears LeaseExpired, not LeaseUnknown."""
    world, p, d, conn = rig(CFG)
    t = p.ticket(8, seed=1)
    world.advance(CFG.ttl + 1)
    assert (t.lease, "expired") in p.ended and locked(p) == 0
    r = d.fetch_ticket(t)
    assert r.fetch.state is FetchState.FAILED
    assert isinstance(r.fetch.error, LeaseExpired), f"{type(r.fetch.error).__name__}: {r.fetch.error}"


def test_ticket_is_bound_to_its_first_claimer():
    world = World(2)
    p = world.add_prefill(config=CFG)
    d1 = world.add_decode("d1", config=CFG)
    d2 = world.add_decode("d2", config=CFG)
    t = p.ticket(20, seed=4)
    first = d1.fetch_ticket(t, seed=4)
    assert first.fetch.state is FetchState.READING
    second = d2.fetch_ticket(t, seed=4)
    assert second.fetch.state is FetchState.FAILED and isinstance(second.fetch.error, LeaseDenied)
    assert not d2.backend.reads  # nothing was read by the refused claimer
    finish_all(world, d1)
    assert first.fetch.state is FetchState.DONE


def test_same_ticket_twice_on_one_decode_is_refused_while_running():
    world, p, d, conn = rig(CFG)
    t = p.ticket(20, seed=4)
    d.fetch_ticket(t, seed=4)
    with pytest.raises(ProtocolError):
        d.fetch_ticket(t, seed=4)
    finish_all(world, d)
    assert [r for _, r in p.ended] == ["done"]


def test_ticket_claims_wait_for_the_handshake():
    world = World(0)
    p = world.add_prefill(config=CFG)
    d = world.add_decode(config=CFG)
    t = p.ticket(12, seed=2)
    r = d.fetch_ticket(t, seed=2)  # opens the link; the claim goes once it is ready
    assert r.fetch.state is FetchState.READING
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE


def minted(p, num_tokens: int, lease_id: bytes = b"\x07" * 16) -> Ticket:
    """A ticket minted before its lease is lent (what a vLLM scheduler hands out)."""
    return Ticket(lease_id, *p.endpoint, p.name, num_tokens, p.layout.layout_id)


WAIT = NodeConfig(ttl=5.0, heartbeat=1.0, handshake_timeout=3.0, transfer_timeout=20.0, cancel_grace=2.0,
                  chunk_pages=4, claim_wait=2.0)


def test_a_claim_before_the_lend_waits_for_it_and_reads_the_lent_bytes():
    world, p, d, conn = rig(WAIT)
    t = minted(p, 20)
    r = d.fetch_ticket(t, seed=6)
    assert r.fetch.state is FetchState.CLAIMING and p.session.next_deadline() is not None
    assert [e for e in p.events if isinstance(e, ClaimWaits)] == [ClaimWaits(t.lease)]  # the engine may lend now
    world.advance(WAIT.claim_wait / 2)
    assert r.fetch.state is FetchState.CLAIMING and locked(p) == 0
    p.lend(20, seed=6, lease_id=t.lease)
    world.pump()
    assert r.fetch.state is FetchState.READING
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and [r for _, r in p.ended] == ["done"]


def test_a_claim_of_a_lease_never_lent_fails_after_claim_wait():
    world, p, d, conn = rig(WAIT)
    r = d.fetch_ticket(minted(p, 20), seed=6)
    world.advance(WAIT.claim_wait - EPS_T)
    assert r.fetch.state is FetchState.CLAIMING
    world.advance(2 * EPS_T)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LeaseUnknown)
    assert "claim_wait" in str(r.fetch.error) and p.session.next_deadline() is None


def test_without_claim_wait_an_unlent_ticket_is_refused_at_once():
    world, p, d, conn = rig(CFG)
    r = d.fetch_ticket(minted(p, 20), seed=6)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LeaseUnknown)


def test_a_waiting_claim_is_forgotten_with_its_connection():
    world, p, d, conn = rig(WAIT)
    t = minted(p, 20)
    d.fetch_ticket(t, seed=6)
    world.kill_decode(d)
    assert p.session.next_deadline() is None
    p.lend(20, seed=6, lease_id=t.lease)  # lent to nobody yet: a later decode may still claim it
    world.advance(WAIT.claim_wait + EPS_T)
    assert live(p, t)


def test_a_lease_id_already_used_is_refused_before_anything_is_locked():
    world, p, d, conn = rig(WAIT)
    lease = p.lend(20, seed=6, lease_id=b"\x01" * 16)
    before = locked(p)
    with pytest.raises(KvlendError, match="repeated lease id"):
        p.lend(12, seed=7, lease_id=lease.id)
    with pytest.raises(KvlendError, match="lease_id: must be 16 bytes"):
        p.lend(12, seed=7, lease_id=b"short")
    assert locked(p) == before


def test_claim_wait_must_be_shorter_than_the_ttl():
    for bad in (-1, 5.0, float("nan"), True):
        with pytest.raises(ConfigError, match="claim_wait"):
            NodeConfig(ttl=5.0, claim_wait=bad)


def test_a_ticket_claimed_ahead_outlives_its_ttl_on_heartbeats_and_is_read_later():
    world, p, d, conn = rig(LONG)
    t = p.ticket(20, seed=8)
    d.claim(t)
    for _ in range(int(4 * LONG.ttl / LONG.heartbeat)):  # the engine's queue: four TTLs without a fetch
        world.advance(LONG.heartbeat)
        assert live(p, t)
    r = d.fetch_ticket(t, seed=8)
    assert r.fetch.state is not FetchState.CLAIMING  # the offer was already here: no claim round trip
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and [why for _, why in p.ended] == ["done"]


def test_a_fetch_started_before_the_early_claims_answer_waits_for_that_answer():
    world = World(0)
    p = world.add_prefill(config=CFG)
    d = world.add_decode(config=CFG)
    t = p.ticket(12, seed=2)
    d.session.claim_ticket(t, d.now)  # the link is not even open yet
    r = d.fetch_ticket(t, seed=2)
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE


def test_an_early_claim_refused_fails_the_later_fetch_at_once():
    world, p, d, conn = rig(CFG)
    t = minted(p, 20)  # never lent, and no claim_wait: refused
    d.claim(t)
    r = d.fetch_ticket(t, seed=6)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LeaseUnknown)


def test_an_unclaimed_lease_is_released_by_the_prefill_at_once():
    world, p, d, conn = rig(LONG)
    answered, pending = p.ticket(20, seed=8), p.ticket(12, seed=9)
    d.claim(answered)
    d.unclaim(answered)
    assert not live(p, answered)
    d.session.claim_ticket(pending, d.now)  # its answer is still on the wire when we give it back
    d.unclaim(pending)
    world.pump()
    assert not live(p, pending) and locked(p) == 0
    assert d.session.next_deadline() is None  # nothing left to heartbeat: the late offer was dropped


def test_a_lease_given_back_before_its_link_was_up_is_released_once_it_is():
    world = World(0)
    p = world.add_prefill(config=LONG)
    d = world.add_decode(config=LONG)
    t = p.ticket(20, seed=8)
    d.session.claim_ticket(t, d.now)  # the link is not even open yet: the claim is queued
    d.unclaim(t)  # the engine aborted the request before the link came up
    world.pump()
    assert not live(p, t) and locked(p) == 0 and [why for _, why in p.ended] == ["aborted"]
    assert d.session.next_deadline() is None  # the claim's late answer was dropped: nothing to heartbeat


def test_claiming_ahead_twice_or_after_the_fetch_started_changes_nothing():
    world, p, d, conn = rig(LONG)
    t = p.ticket(20, seed=8)
    d.claim(t)
    d.claim(t)
    r = d.fetch_ticket(t, seed=8)
    d.claim(t)
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and [why for _, why in p.ended] == ["done"]


# ------------------------------------------------------------- prompt digests
PROMPT_A, PROMPT_B = prompt_digest(range(20)), prompt_digest([7] * 20)  # same length: the count check passes


@pytest.mark.parametrize("claimed_with, read_ahead", [(PROMPT_B, False), (PROMPT_B, True), (None, False)],
                         ids=["another-prompt", "another-prompt-read-ahead", "no-digest"])
def test_a_ticket_for_one_prompt_is_refused_to_a_claim_for_another_before_any_read(read_ahead, claimed_with):
    """Finding 4 of issue 22: a stolen ticket put on another prompt reads nothing, even with read-ahead
    (whose reads would otherwise go out with the claim), and the lease stays its owner's."""
    config = dataclasses.replace(CFG, read_ahead=read_ahead)
    world, p, d, conn = rig(config)
    t = p.ticket(20, seed=4, prompt_digest=PROMPT_A)
    assert t.pages is None  # small and final, but bound to its prompt: no table to read ahead from ...
    forged = t.with_pages(p.lent[t.lease].lease.pages)  # ... and a decode bound to its prompt ignores a forged one
    thief = d.fetch_ticket(forged if claimed_with else t, seed=5, prompt_digest=claimed_with)
    assert thief.fetch.state is FetchState.FAILED and isinstance(thief.fetch.error, PromptMismatch)
    assert thief.fetch.bound == 0 and not d.backend.reads and not d.backend.writes  # no byte moved
    assert live(p, t) and p.lender.get(t.lease, p.now).peer is None  # still anyone's who has the prompt
    owner = d.fetch_ticket(t, seed=4, prompt_digest=PROMPT_A)
    finish_all(world, d)
    assert owner.fetch.state is FetchState.DONE, owner.fetch.error
    d.check_done(owner)
    assert [why for _, why in p.ended] == ["done"] and locked(p) == 0


def test_a_claim_waiting_for_its_lend_is_refused_if_the_lend_is_for_another_prompt():
    world, p, d, conn = rig(WAIT)
    t = minted(p, 20)
    r = d.fetch_ticket(t, seed=6, prompt_digest=PROMPT_B)
    assert r.fetch.state is FetchState.CLAIMING
    p.lend(20, seed=6, lease_id=t.lease, prompt_digest=PROMPT_A)
    world.pump()
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, PromptMismatch)
    assert not d.backend.reads and live(p, t)


def test_a_lease_claimed_ahead_for_one_prompt_is_not_fetched_for_another():
    world, p, d, conn = rig(LONG)
    t = p.ticket(20, seed=8, prompt_digest=PROMPT_A)
    d.claim(t, prompt_digest=PROMPT_A)
    with pytest.raises(PromptMismatch):
        d.fetch_ticket(t, seed=8, prompt_digest=PROMPT_B)
    with pytest.raises(PromptMismatch):
        d.fetch_ticket(t, seed=8)
    assert not d.backend.reads
    r = d.fetch_ticket(t, seed=8, prompt_digest=PROMPT_A)
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE


def test_an_early_claim_for_another_prompt_fails_the_later_fetch():
    world, p, d, conn = rig(LONG)
    t = p.ticket(20, seed=8, prompt_digest=PROMPT_A)
    d.claim(t, prompt_digest=PROMPT_B)
    r = d.fetch_ticket(t, seed=8, prompt_digest=PROMPT_B)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, PromptMismatch)
    assert not d.backend.reads and live(p, t)


def test_a_lease_lent_without_a_digest_is_read_by_any_claim():
    """The raw API's engines (the toy engine, tickets that stay in trusted hands) lend without one."""
    world, p, d, conn = rig(CFG)
    records = [d.fetch_ticket(p.ticket(20, seed=i), seed=i, prompt_digest=digest)
               for i, digest in enumerate([None, PROMPT_A])]
    finish_all(world, d)
    assert all(r.fetch.state is FetchState.DONE for r in records)


@pytest.mark.parametrize("bad", [b"short", "a" * 32, bytes(33)])
def test_a_malformed_digest_is_refused_before_anything_changes(bad):
    world, p, d, conn = rig(CFG)
    with pytest.raises(LeaseError, match="prompt_digest"):
        p.ticket(20, seed=1, prompt_digest=bad)
    assert locked(p) == 0
    t = p.ticket(20, seed=1, prompt_digest=PROMPT_A)
    with pytest.raises(LeaseError, match="prompt_digest"):
        d.fetch_ticket(t, seed=1, prompt_digest=bad)
    with pytest.raises(LeaseError, match="prompt_digest"):
        d.claim(t, prompt_digest=bad)
    assert d.session.in_flight == 0 and not d.backend.reads


def test_a_ticket_of_a_layout_this_rank_cannot_read_is_given_back_at_once():
    """Negotiation refuses the pair (issue 22, finding 9): the decode gives the lease back over the refused
    link, so its prefill frees the pages now rather than at their TTL; a later ticket of that layout fails
    before any handshake, and its lease is given back too."""
    world = World(0)
    p = world.add_prefill(config=LONG)
    d = world.add_decode(config=LONG)
    d.layout = dataclasses.replace(d.layout, dtype="bfloat16")
    d.session = DecodeSession(d.layout, KIND, name=d.name, config=LONG)
    first, second = p.ticket(20, seed=1), p.ticket(12, seed=2)
    r = d.fetch_ticket(first, seed=1)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LayoutMismatch)
    assert [f for f, *_ in r.fetch.error.fields] == ["dtype"]
    assert p.ended == [(first.lease, "aborted")]  # no time passed: not its TTL
    assert p.session.peers == [] and d.session.links == [] and not world.wires
    fetch = d.session.fetch_ticket(second, d.alloc(12), d.now)
    assert fetch.state is FetchState.FAILED and isinstance(fetch.error, LayoutMismatch)  # before any handshake
    assert str(fetch.error) == str(r.fetch.error)
    world.pump()  # a link opened to say so: refused, our Abort, our Bye
    assert p.ended == [(first.lease, "aborted"), (second.lease, "aborted")] and locked(p) == 0
    assert p.session.peers == [] and d.session.links == [] and not world.wires


def test_a_refused_decode_may_only_decline_its_leases_and_leave_within_the_auth_timeout():
    """What a decode whose layout was refused may still do: give back (claim) leases it may claim, say bye;
    its identity is free for another connection meanwhile, and it cannot linger."""
    world = World(0)
    p = world.add_prefill(config=NodeConfig(ttl=30.0))
    s, now = p.session, p.now
    theirs, others = p.ticket(20, seed=1), p.lend(8, seed=2, peer="someone-else")
    hello = encode_frame(Handshake(dataclasses.replace(p.layout, dtype="bfloat16").encode(), KIND, b"meta"))
    for conn in (1, 2, 3):
        s.accept(conn, now)
        s.authenticated(conn, "odd", now)  # one identity each time: a refused connection does not hold it
        s.receive(conn, hello, now)
    sent = [a for a in s.take_actions() if isinstance(a, Send)]
    assert [a.conn for a in sent] == [1, 2, 3] and s.peers == []
    (reply,) = decode_all(sent[0].data)
    assert isinstance(reply, Handshake) and reply.metadata == b""  # ours, to name every difference by
    s.receive(1, b"".join(encode_frame(m) for m in (Claim(others.id), Claim(theirs.lease), Bye(Code.OK, "refused"))),
              now)
    ended = [(e.lease.id, e.reason) for e in s.take_events() if isinstance(e, LeaseEnded)]
    assert ended == [(theirs.lease, "aborted")]  # a claim gives it back; another peer's lease stays
    s.receive(2, encode_frame(Abort(others.id, Code.CANCELLED, "x")), now)
    s.tick(now + AUTH_TIMEOUT + 1)
    closed = {a.conn: a.reason for a in s.take_actions() if isinstance(a, Close)}
    assert "said bye" in closed[1] and "unexpected abort" in closed[2] and "did not leave" in closed[3]
    assert not live(p, theirs) and live(p, others)


def test_no_prefill_at_the_ticket_endpoint():
    world = World(0)
    p = world.add_prefill(config=CFG)
    d = world.add_decode(config=CFG)
    t = p.ticket(12, seed=2)
    world.kill_prefill(p)
    r = d.fetch_ticket(t)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, PeerLost)


# ------------------------------------------------------------- time and leases
def test_heartbeats_keep_a_lease_alive_for_many_ttls():
    world, p, d, conn = rig(LONG)
    lease = p.offer("decode", 40, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    before = locked(p)
    for _ in range(int(50 * LONG.ttl / LONG.heartbeat)):
        world.advance(LONG.heartbeat)
        assert live(p, lease) and locked(p) == before
    assert r.fetch.state is FetchState.READING
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and locked(p) == 0


def test_unread_offer_is_kept_alive_too():
    world, p, d, conn = rig(CFG)
    lease = p.offer("decode", 8, seed=1)
    world.advance(10 * CFG.ttl, step=CFG.heartbeat)
    assert live(p, lease)


def test_a_silent_reader_loses_its_lease_after_ttl():
    world, p, d, conn = rig(LONG)
    lease = p.offer("decode", 40, seed=1)
    d.fetch_offer(conn, d.offers[0][1])
    wire = world.wire(d, conn)
    wire.hold_to_prefill = True  # heartbeats stop reaching the prefill
    world.advance(LONG.ttl - LONG.heartbeat)
    assert live(p, lease)
    world.advance(2 * LONG.heartbeat)
    assert (lease.id, "expired") in p.ended
    assert locked(p) == 0 and p.lender.active_leases == 0


def test_clock_jump_past_ttl_discards_reads_that_land_after_it():
    """Reads that land after the lease may have expired are not counted until the prefill confirms."""
    world, p, d, conn = rig(LONG)
    p.offer("decode", 40, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    world.advance(0.01)  # the heartbeat the offer asked for, and its renewal, make its reads count
    first, *rest = d.backend.in_flight()
    d.backend.finish(first.tag)
    world.pump()
    good = r.fetch.bound
    assert good > 0
    world.jump(3 * LONG.ttl)  # both ends suspended; the lease expired; its pages were reused
    assert p.ended and p.ended[0][1] == "expired"
    for read in rest:
        d.backend.finish(read.tag)  # copies the prefill's new (scribbled) contents
    world.pump()
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LeaseExpired)
    assert r.fetch.bound == 0  # nothing read under an expired lease may be used


def test_pushed_offer_is_trusted_only_once_a_renewal_confirms_it():
    """Reads of a pushed offer count for the bound only after a heartbeat, sent once it arrived, came back renewed."""
    world, p, d, conn = rig(LONG)
    p.offer("decode", 48, seed=1)  # three chunks of 4 pages
    assert d.session.next_deadline() == d.now  # the offer asked for a heartbeat at once
    r = d.fetch_offer(conn, d.offers[0][1])
    a, b, c = d.backend.in_flight()
    d.backend.finish(a.tag)
    world.pump()
    assert r.fetch.bound == 0 and r.fetch.sure_until == -np.inf  # well inside the TTL, but not confirmed
    wire = world.wire(d, conn)
    wire.hold_to_decode = True
    sent = d.now
    confirm(world)  # the heartbeat reaches the prefill; its renewal waits on the wire
    assert wire.to_decode and r.fetch.sure_until == -np.inf
    world.now += 0.5
    wire.hold_to_decode = False
    world.pump()
    assert r.fetch.sure_until == sent + LONG.ttl - LONG.heartbeat  # anchored on when the heartbeat was sent
    assert r.fetch.bound == 0  # counted on the next completion
    d.backend.finish(b.tag)
    world.pump()
    assert r.fetch.bound == 32  # both landed inside the confirmed window
    d.backend.finish(c.tag)
    world.pump()
    assert r.fetch.state is FetchState.DONE and r.bounds == sorted(r.bounds)


def test_a_renewal_before_the_fetch_starts_is_kept_for_it():
    world, p, d, conn = rig(LONG)
    p.offer("decode", 40, seed=1)
    sent = d.now
    confirm(world)
    world.now += 0.5  # the engine takes its time; no tick
    r = d.fetch_offer(conn, d.offers[0][1])
    assert r.fetch.sure_until == sent + LONG.ttl - LONG.heartbeat
    first = d.backend.in_flight()[0]
    d.backend.finish(first.tag)
    world.pump()
    assert r.fetch.bound == 16
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE


def test_trust_runs_out_without_renewals_and_comes_back_with_them():
    """Heartbeats held past ``ttl - heartbeat`` stop reads counting; held ones that arrive in time renew again."""
    world, p, d, conn = rig(LONG)
    lease = p.offer("decode", 48, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    confirm(world)
    cutoff = r.fetch.sure_until
    a, b, c = d.backend.in_flight()
    wire = world.wire(d, conn)
    wire.hold_to_prefill = True  # the heartbeats stall
    world.advance(LONG.ttl - LONG.heartbeat + 0.1)
    assert d.now > cutoff and live(p, lease)  # the lease itself still holds: the cutoff is conservative
    d.backend.finish(a.tag)
    world.pump()
    assert r.fetch.bound == 0  # landed past the cutoff
    wire.hold_to_prefill = False  # the held heartbeats arrive before the expiry: each renews, from when it was sent
    world.pump()
    assert r.fetch.sure_until > d.now and live(p, lease)
    d.backend.finish(b.tag)
    world.pump()
    assert r.fetch.bound == 32
    d.backend.finish(c.tag)
    world.pump()
    assert r.fetch.state is FetchState.DONE


@pytest.mark.parametrize("how", ["unsolicited", "unnamed lease"])
def test_a_renewal_the_decode_did_not_ask_for_drops_the_link(how):
    """A prefill cannot make a pushed offer trusted by sending ``Renewed`` on its own."""
    world, p, d, conn = rig(LONG)
    p.offer("decode", 40, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    wire = world.wire(d, conn)
    lease = r.fetch.lease
    if how == "unnamed lease":
        wire.hold_to_prefill = True
        confirm(world)  # a heartbeat naming ``lease`` is on its way; its answer names another one
        lease = bytes(16)
    p.session._peers[wire.pconn].conn.send(Renewed((lease,)))  # a buggy prefill
    world.pump()
    assert conn not in d.session.links and isinstance(d.session.link_error(conn), PeerLost)
    assert "heartbeat" in str(d.session.link_error(conn))
    assert r.fetch.state is FetchState.FAILED and r.fetch.bound == 0 and r.fetch.sure_until == -np.inf


def test_a_renewal_the_lease_missed_does_not_confirm_it():
    """A heartbeat the prefill could not honour (the lease expired meanwhile) confirms nothing."""
    world, p, d, conn = rig(LONG)
    lease = p.offer("decode", 8, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    wire = world.wire(d, conn)
    wire.hold_to_prefill = True
    confirm(world)  # sent now, held
    world.advance(LONG.ttl + 0.5)  # the prefill expires the lease before the heartbeat gets there
    assert (lease.id, "expired") in p.ended
    wire.hold_to_prefill = False
    world.pump()
    assert r.fetch.sure_until == -np.inf
    finish_all(world, d)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LeaseExpired)
    assert r.fetch.bound == 0


def test_transfer_timeout_fails_typed_with_the_bound():
    world, p, d, conn = rig(CFG)
    p.offer("decode", 40, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    confirm(world)
    first, *rest = d.backend.in_flight()
    d.backend.finish(first.tag)
    world.pump()
    bound = r.fetch.bound
    assert 0 < bound < 40
    world.advance(CFG.transfer_timeout + EPS_T)
    assert r.fetch.state is FetchState.CANCELLING and not r.fetch.quiet
    assert all(read.cancelled for read in rest)
    for read in rest:
        d.backend.fail(read.tag)
    world.pump()
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, TransferTimeout)
    assert r.fetch.bound == r.fetch.error.bound == bound
    world.pump()
    assert p.ended[-1][1] == "aborted" and locked(p) == 0



def test_no_done_ack_is_a_timeout():
    world, p, d, conn = rig(CFG)
    p.offer("decode", 8, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    world.wire(d, conn).hold_to_decode = True  # the done ack never comes back
    finish_all(world, d)
    assert r.fetch.state is FetchState.ACKING
    world.advance(CFG.transfer_timeout + EPS_T)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, TransferTimeout)


@pytest.mark.parametrize("path", ["offer", "ticket"])
def test_a_per_fetch_timeout_overrides_the_config(path):
    world, p, d, conn = rig(CFG)
    if path == "offer":
        p.offer("decode", 40, seed=1)
        r = d.fetch_offer(conn, d.offers[0][1], timeout=2.0)
    else:
        r = d.fetch_ticket(p.ticket(40, seed=1), seed=1, timeout=2.0)
    assert r.fetch.deadline == r.fetch.started + 2.0
    world.advance(2.0 - EPS_T)
    assert r.fetch.state is FetchState.READING
    world.advance(2 * EPS_T)
    assert r.fetch.state is FetchState.CANCELLING
    for read in d.backend.in_flight():
        d.backend.fail(read.tag)
    world.pump()
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, TransferTimeout)
    assert "within 2 s" in str(r.fetch.error)
    assert p.ended[-1][1] == "aborted" and locked(p) == 0
    default = d.fetch_ticket(p.ticket(8, seed=2), seed=2)
    assert default.fetch.deadline == default.fetch.started + CFG.transfer_timeout


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan"), True, "5"])
def test_a_bad_timeout_is_refused_before_anything_changes(timeout):
    world, p, d, conn = rig(CFG)
    p.offer("decode", 30, seed=1)
    offer = d.offers[0][1]
    t = p.ticket(30, seed=2)
    dst = d.alloc(30)
    with pytest.raises(ConfigError):
        d.session.fetch_offer(conn, offer, dst, d.now, timeout=timeout)
    with pytest.raises(ConfigError):
        d.session.fetch_ticket(t, dst, d.now, timeout=timeout)
    _assert_clean(d)
    assert not p.ended and p.lender.get(t.lease, p.now).peer is None  # nothing was claimed
    d._free_tables(dst)
    a, b = d.fetch_offer(conn, offer, timeout=30), d.fetch_ticket(t, seed=2, timeout=30)
    finish_all(world, d)
    assert a.fetch.state is b.fetch.state is FetchState.DONE


# ----------------------------------------------------------------------- kills
def test_link_closed_mid_fetch_is_peer_lost_with_the_bound():
    world, p, d, conn = rig(CFG)
    p.offer("decode", 40, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    confirm(world)
    first = d.backend.in_flight()[0]
    d.backend.finish(first.tag)
    world.pump()
    bound = r.fetch.bound
    world.cut(world.wire(d, conn))
    assert conn in d.backend.removed  # the endpoint is torn down: its reads are terminal
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, PeerLost)
    assert r.fetch.bound == bound > 0
    assert not d.backend.in_flight()
    # The prefill keeps the lease until it expires (a read may still land there).
    assert locked(p) > 0
    world.advance(CFG.ttl + 1)
    assert locked(p) == 0 and p.ended[-1][1] == "expired"


def test_prefill_dies_mid_fetch():
    world, p, d, conn = rig(CFG)
    p.offer("decode", 40, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    world.kill_prefill(p)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, PeerLost)
    assert r.fetch.quiet and d.session.in_flight == 0


def test_decode_dies_and_the_prefill_drops_its_locks_after_expiry():
    world, p, d, conn = rig(CFG)
    p.offer("decode", 40, seed=1)
    d.fetch_offer(conn, d.offers[0][1])
    world.kill_decode(d)
    assert p.session.peers == [] and locked(p) > 0
    world.advance(CFG.ttl - 1)
    assert locked(p) > 0
    world.advance(2)
    assert locked(p) == 0 and p.ended == [(p.ended[0][0], "expired")]


def test_restarted_decode_reconnects_after_the_old_link_dropped():
    world, p, d, conn = rig(CFG)
    world.kill_decode(d)
    d2 = world.add_decode("decode", config=CFG)
    c2 = world.connect(d2, p)
    assert d2.session.ready(c2) and p.session.peers == ["decode"]
    r = d2.fetch_ticket(p.ticket(9, seed=3), seed=3)
    finish_all(world, d2)
    assert r.fetch.state is FetchState.DONE


def test_second_decode_with_a_live_identity_is_refused_and_the_first_keeps_working():
    world, p, d, conn = rig(CFG)
    impostor = world.add_decode("decode", config=CFG)
    c2 = impostor.session.link_to(*p.endpoint, impostor.now)
    world.pump()
    assert c2 not in impostor.session.links
    error = impostor.session.link_error(c2)
    assert isinstance(error, ProtocolError) and "already connected" in str(error), error
    assert p.session.peers == ["decode"] and d.session.ready(conn)
    r = d.fetch_ticket(p.ticket(9, seed=3), seed=3)
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE


@pytest.mark.parametrize("uncertified", ["decode", "prefill"])
def test_a_refused_certificate_fails_the_link_with_auth_error_and_waiting_fetches_with_it(uncertified):
    """TLS refused (the shell's ``closed(..., refused=True)``): an ``AuthError``, not a ``PeerLost``."""
    world = World(0)
    p = world.add_prefill(config=CFG, certified=uncertified != "prefill")
    d = world.add_decode(config=CFG, certified=uncertified != "decode")
    t = p.ticket(8, seed=2)
    r = d.fetch_ticket(t, seed=2)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, AuthError), r.fetch.error
    assert "CERTIFICATE_VERIFY_FAILED" in str(r.fetch.error)
    assert d.session.links == [] and p.session.peers == [] and p.session.pending == 0
    assert not d.backend.reads and live(p, t)  # nothing read, and the lease still waits for its reader


def test_half_open_old_link_refuses_the_restarted_decode():
    """A decode that died without its connection closing blocks its name until the prefill notices."""
    world, p, d, conn = rig(CFG)
    world.kill_decode(d, silent=True)
    d2 = world.add_decode("decode", config=CFG)
    c2 = d2.session.link_to(*p.endpoint, d2.now)
    world.pump()
    assert not d2.session.ready(c2)


# -------------------------------------------------------- cancel and quiescence
def test_late_completions_after_cancel_are_awaited_but_not_counted():
    world, p, d, conn = rig(CFG)
    lease = p.offer("decode", 60, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    reads = d.backend.in_flight()
    assert len(reads) >= 3
    d.backend.finish(reads[0].tag)
    world.pump()
    bound = r.fetch.bound
    d.cancel(r)
    assert r.fetch.state is FetchState.CANCELLING and not r.fetch.quiet
    assert all(read.cancelled for read in reads[1:])
    d.backend.late(reads[1].tag)  # lands anyway, then reported cancelled
    world.pump()
    assert r.fetch.state is FetchState.CANCELLING and not r.fetch.quiet
    assert r.fetch.bound == bound
    d.backend.finish(reads[2].tag)  # even a success after the cancel does not count
    world.pump()
    assert r.fetch.bound == bound
    # The prefill still holds the lease: nothing was aborted while reads could land.
    assert live(p, lease) and locked(p) > 0 and not p.ended
    for read in reads[3:]:
        d.backend.fail(read.tag)
    world.pump()
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, TransferCancelled)
    assert r.fetch.quiet and r.fetch.bound == bound
    assert p.ended == [(lease.id, "aborted")] and locked(p) == 0


def test_done_reaches_the_prefill_only_after_the_last_read():
    world, p, d, conn = rig(CFG)
    lease = p.offer("decode", 60, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    *most, last = d.backend.in_flight()
    for read in most:
        d.backend.finish(read.tag)
    world.pump()
    assert r.fetch.state is FetchState.READING and live(p, lease) and locked(p) > 0
    d.backend.finish(last.tag)
    world.pump()
    assert r.fetch.state is FetchState.DONE and p.ended == [(lease.id, "done")] and locked(p) == 0


def test_cancelled_lease_stays_renewed_while_reads_are_in_flight():
    world, p, d, conn = rig(LONG)
    lease = p.offer("decode", 40, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    d.cancel(r)
    world.advance(LONG.cancel_grace * 0.9, step=LONG.heartbeat / 2)
    assert r.fetch.state is FetchState.CANCELLING and live(p, lease)
    for read in d.backend.in_flight():
        d.backend.late(read.tag)
    world.pump()
    assert r.fetch.state is FetchState.FAILED and p.ended == [(lease.id, "aborted")]


def test_a_read_that_never_goes_quiet_tears_the_link_down():
    world, p, d, conn = rig(CFG)
    p.offer("decode", 40, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    d.cancel(r)
    world.advance(CFG.cancel_grace * 0.9)
    assert r.fetch.state is FetchState.CANCELLING and conn in d.session.links
    world.advance(CFG.cancel_grace * 0.2)
    assert conn in d.backend.removed and conn not in d.session.links
    assert not d.backend.in_flight()
    assert r.fetch.state is FetchState.FAILED and r.fetch.quiet
    assert isinstance(r.fetch.error, TransferCancelled)


def test_escalation_emits_remove_peer_then_close():
    world, p, d, conn = rig(CFG)
    p.offer("decode", 40, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    d.cancel(r)
    world.now += CFG.cancel_grace + 1
    d.session.tick(world.now)
    actions = d.session.take_actions()
    kinds = [type(a) for a in actions if getattr(a, "conn", None) == conn]
    assert RemovePeer in kinds and Close in kinds
    assert kinds.index(RemovePeer) < kinds.index(Close)
    for a in actions:
        world._perform_decode(d, a)
    world.pump()
    assert r.fetch.state is FetchState.FAILED


def test_a_failed_read_cancels_the_rest_and_aborts_once_quiet():
    world, p, d, conn = rig(CFG)
    lease = p.offer("decode", 60, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    reads = d.backend.in_flight()
    d.backend.fail(reads[1].tag, BackendError("NIC on fire"))
    world.pump()
    assert r.fetch.state is FetchState.CANCELLING and all(x.cancelled for x in (reads[0], *reads[2:]))
    assert live(p, lease)
    for read in (reads[0], *reads[2:]):
        d.backend.late(read.tag)
    world.pump()
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, BackendError)
    assert p.ended == [(lease.id, "aborted")]


def test_post_refused_by_the_backend_fails_the_fetch_cleanly():
    world, p, d, conn = rig(CFG)
    p.offer("decode", 20, seed=1)
    d.backend.peers.clear()  # the shell lost its backend peer: posts are refused before anything moves
    r = d.fetch_offer(conn, d.offers[0][1])
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, BackendError)
    assert r.fetch.quiet and p.ended[-1][1] == "aborted"


# --------------------------------------------------------------------- bound
def test_bound_advances_only_over_a_delivered_prefix():
    world, p, d, conn = rig(CFG)
    p.offer("decode", 48, seed=1)  # 12 pages: three chunks of 4
    r = d.fetch_offer(conn, d.offers[0][1])
    reads = d.backend.in_flight()
    assert len(reads) == 3
    d.backend.finish(reads[2].tag)
    d.backend.finish(reads[1].tag)
    world.pump()
    assert r.fetch.bound == 0
    d.backend.finish(reads[0].tag)
    world.pump()
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == 48
    assert r.bounds == sorted(r.bounds)


def test_lease_missing_a_local_group_is_incomplete_not_a_smaller_success():
    world, p, d, conn = rig(CFG)
    full_only = RowSelection.named(*[b.name for b in p.layout.groups["full"].buffers])
    t = p.ticket(40, seed=1, selection=full_only)
    r = d.fetch_ticket(t, seed=1)
    finish_all(world, d)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, IncompleteFetch)
    assert r.fetch.error.bound == r.fetch.bound < 40


# ----------------------------------------------------- exceptions at fetch start
def _bad_dsts(d, n):
    good = d.alloc(n)
    yield {k: v for k, v in good.items() if k != "swa"}  # a group missing
    yield {**good, "swa": good["swa"][:-1]}  # too short
    yield {**good, "full": np.full_like(good["full"], 10_000)}  # outside the pool
    yield {**good, "full": good["full"].astype(float)}  # not integers
    yield "not a mapping"
    d._free_tables(good)


def _assert_clean(d, reads: int = 0):
    """No fetch, no tracked request and (once the pending actions ran) no read posted: the start left nothing."""
    d.world.pump()
    assert d.session.in_flight == 0
    assert d.session.tracker.stats.requests == 0 and d.session.tracker.stats.pending == 0
    assert len(d.backend.reads) == reads


def test_bad_fetch_offer_arguments_change_nothing_and_a_retry_works():
    world, p, d, conn = rig(CFG)
    lease = p.offer("decode", 30, seed=1)
    offer = d.offers[0][1]
    confirm(world)
    sure = d.now + CFG.ttl - CFG.heartbeat
    for bad in _bad_dsts(d, 30):
        with pytest.raises(KvlendError):
            d.session.fetch_offer(conn, offer, bad, d.now)
        _assert_clean(d)
    for resume in (-1, 31, 2.5, True, "0", None):
        with pytest.raises(PageRangeError):
            d.session.fetch_offer(conn, offer, d.alloc(30), d.now, resume)
        _assert_clean(d)
    r = d.fetch_offer(conn, offer)
    assert r.fetch.sure_until == sure  # the refused starts did not use up the offer's confirmation
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and p.ended == [(lease.id, "done")]


def test_bad_fetch_ticket_arguments_change_nothing_and_a_retry_works():
    world, p, d, conn = rig(CFG)
    t = p.ticket(30, seed=1)
    for resume in (-1, 31, 2.5, True):
        with pytest.raises(PageRangeError):
            d.session.fetch_ticket(t, d.alloc(30), d.now, resume)
        _assert_clean(d)
    with pytest.raises(KvlendError):
        d.session.fetch_ticket(t, "not a mapping", d.now)
    with pytest.raises(ProtocolError):
        d.session.fetch_ticket(t.encode(), d.alloc(30), d.now)
    world.pump()
    assert not p.ended  # nothing was claimed
    r = d.fetch_ticket(t, seed=1)
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE


class Boom(Exception):
    """Not a KvlendError: a bug inside the planner."""


def _planner_failing_on(monkeypatch, call: int):
    real, calls = fetch_mod.plan_reads, []

    def plan_reads(*args, **kw):
        calls.append(1)
        if len(calls) == call:
            raise Boom(f"planner bug on call {call}")
        return real(*args, **kw)

    monkeypatch.setattr(fetch_mod, "plan_reads", plan_reads)
    return calls


@pytest.mark.parametrize("call", [1, 2, 3])
def test_planner_bug_in_fetch_offer_leaves_nothing_behind(monkeypatch, call):
    world, p, d, conn = rig(CFG)
    p.offer("decode", 48, seed=1)  # three chunks: the planner runs three times
    offer = d.offers[0][1]
    confirm(world)
    sure = d.now + CFG.ttl - CFG.heartbeat
    _planner_failing_on(monkeypatch, call)
    dst = d.alloc(48)
    with pytest.raises(Boom):  # fetch_offer is the engine's own call: a bug there is the engine's to see
        d.session.fetch_offer(conn, offer, dst, d.now)
    _assert_clean(d)
    d._free_tables(dst)
    monkeypatch.undo()
    r = d.fetch_offer(conn, offer)
    assert r.fetch.sure_until == sure  # the failed start kept the pending offer and its confirmation
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE


def test_tracker_bug_while_posting_leaves_nothing_behind(monkeypatch):
    world, p, d, conn = rig(CFG)
    p.offer("decode", 48, seed=1)
    offer = d.offers[0][1]
    tracker = d.session.tracker
    real, calls = tracker.post, []

    def post(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise Boom("tracker bug on the second chunk")
        return real(*args, **kw)

    monkeypatch.setattr(tracker, "post", post)
    dst = d.alloc(48)
    with pytest.raises(Boom):
        d.session.fetch_offer(conn, offer, dst, d.now)
    _assert_clean(d)
    d._free_tables(dst)
    monkeypatch.undo()
    r = d.fetch_offer(conn, offer)
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE


def test_bad_dst_for_a_ticket_on_a_ready_link_raises_before_anything_is_sent():
    """With the link ready, ``fetch_ticket`` checks the table itself: no claim goes out, the ticket stays unbound."""
    world, p, d, conn = rig(CFG)
    t = p.ticket(30, seed=1)
    good = d.alloc(30)
    bad_tables = [
        {k: v for k, v in good.items() if k != "swa"},  # a group missing
        {**good, "swa": good["swa"][:-1]},  # too short for 30 tokens
        {**good, "full": good["full"].astype(float)},  # not integers
        {**good, "extra": good["full"]},  # a group the layout does not have
        "not a mapping",
    ]
    for bad in bad_tables:
        with pytest.raises(PageRangeError):
            d.session.fetch_ticket(t, bad, d.now)
        _assert_clean(d)
    assert p.lender.get(t.lease, p.now).peer is None  # never claimed: any decode may still redeem it
    assert not p.ended
    r = d.fetch_ticket(t, good, seed=1)
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and p.ended == [(t.lease, "done")]


@pytest.mark.parametrize("ready", [False, True])
@pytest.mark.parametrize("bad", ["missing", "short", "outside"])
def test_bad_dst_for_a_ticket_fails_typed_when_the_offer_arrives_and_a_retry_works_at_once(bad, ready):
    """A table only the offer can judge fails that fetch, without an Abort: the same ticket is redeemable at once.

    Before the link is ready no table can be checked; on a ready link a slot
    outside the pool passes ``fetch_ticket`` and fails when the reads are planned.
    """
    if ready:
        world, p, d, conn = rig(CFG)
    else:
        world = World(0)
        p = world.add_prefill(config=CFG)
        d = world.add_decode(config=CFG)
    t = p.ticket(30, seed=1)
    good = d.alloc(30)
    dst = {"missing": {k: v for k, v in good.items() if k != "swa"},
           "short": {**good, "swa": good["swa"][:-1]},
           "outside": {**good, "full": np.full_like(good["full"], 10_000)}}[bad]
    if ready and bad != "outside":
        with pytest.raises(PageRangeError):
            d.session.fetch_ticket(t, dst, d.now)
        assert p.lender.get(t.lease, p.now).peer is None  # nothing was sent
    else:
        fetch = d.session.fetch_ticket(t, dst, d.now)
        world.pump()  # (the link comes up,) the claim goes, its offer comes back and fails to plan
        assert fetch.state is FetchState.FAILED and isinstance(fetch.error, KvlendError), fetch.error
        if bad == "missing":
            assert "swa" in str(fetch.error)  # the planner names it (a LayoutError)
        else:
            assert isinstance(fetch.error, PageRangeError), fetch.error
        assert fetch.error.request == "req-1" and fetch.error.bound == 0 and fetch.quiet
        assert d.session.get(fetch.id) is fetch  # the engine's handle finishes (it is not forgotten)
        assert p.lender.get(t.lease, p.now).peer == "decode"  # claimed, and not aborted
    _assert_clean(d)
    assert not d.backend.reads and not p.ended and d.session.links == [1]
    r = d.fetch_ticket(t, good, seed=1)  # at once: no time passes
    assert r.fetch.state is FetchState.READING, r.fetch.error
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE, f"{type(r.fetch.error).__name__}: {r.fetch.error}"
    assert p.ended == [(t.lease, "done")] and locked(p) == 0


def _assert_wrapped(fetch, what: str = "Boom"):
    """A non-KvlendError raised while starting the reads fails the fetch as a KvlendError naming it."""
    assert fetch.state is FetchState.FAILED and fetch.quiet
    assert type(fetch.error) is KvlendError and what in str(fetch.error), repr(fetch.error)
    assert fetch.error.bound == fetch.bound == fetch.resume_from


def test_planner_bug_while_a_claimed_offer_arrives_fails_the_fetch_not_the_link(monkeypatch):
    """A ticket's plan is made inside ``receive()`` when its offer arrives; a bug there stays in that fetch."""
    world, p, d, conn = rig(CFG)
    t1 = p.ticket(30, seed=1)
    _planner_failing_on(monkeypatch, 1)
    r1 = d.fetch_ticket(t1, seed=1)  # nothing escapes: the shell's loop never sees the Boom
    monkeypatch.undo()
    _assert_wrapped(r1.fetch)
    assert "planner bug" in str(r1.fetch.error) and r1.fetch.error.request == "req-1"
    assert r1.finished and d.session.ready(conn) and d.session.links == [conn]
    assert d.session.tracker.stats.requests == 0 and not d.backend.reads
    assert not p.ended and live(p, t1)  # no Abort: the lease stays claimable
    r2 = d.fetch_ticket(p.ticket(12, seed=2), seed=2)
    finish_all(world, d)
    assert r2.fetch.state is FetchState.DONE


def test_planner_bug_on_a_claimed_offer_does_not_wedge_the_lease(monkeypatch):
    """After the bug above, a retry of the same ticket works at once (not after the transfer timeout)."""
    world, p, d, conn = rig(CFG)
    t1 = p.ticket(30, seed=1)
    _planner_failing_on(monkeypatch, 1)
    first = d.fetch_ticket(t1, seed=1)
    monkeypatch.undo()
    _assert_wrapped(first.fetch)
    r = d.fetch_ticket(t1, seed=1)  # no time passes
    assert r.fetch.state is FetchState.READING, r.fetch.error
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE
    assert p.ended == [(t1.lease, "done")] and locked(p) == 0


def test_planner_bug_inside_receive_keeps_the_other_messages_of_that_receive(monkeypatch):
    """Messages decoded in the same ``receive()`` after the failing offer are still handled."""
    world, p, d, conn = rig(CFG)
    t1 = p.ticket(30, seed=1)
    wire = world.wire(d, conn)
    wire.hold_to_decode = True
    r1 = d.fetch_ticket(t1, seed=1)  # the claim goes out; the offer waits on the wire
    lease2 = p.offer("decode", 8, seed=2)  # a pushed offer behind it, on the same wire
    data = b"".join(wire.to_decode)
    wire.to_decode.clear()
    _planner_failing_on(monkeypatch, 1)
    d.session.receive(conn, data, d.now)  # both offers in one read, as a socket may return them
    monkeypatch.undo()
    wire.hold_to_decode = False
    world.pump()
    _assert_wrapped(r1.fetch)
    assert d.session.ready(conn)
    (c2, offer2), = [(c, o) for c, o in d.offers if o.id == lease2.id]  # the pushed offer after it was kept
    r2 = d.fetch_offer(c2, offer2)
    r3 = d.fetch_ticket(t1, seed=1)  # and the failed ticket is redeemable at once
    finish_all(world, d)
    assert r2.fetch.state is r3.fetch.state is FetchState.DONE
    assert sorted(r for _, r in p.ended) == ["done", "done"] and locked(p) == 0


@pytest.mark.parametrize("error", [Boom, PageRangeError])
def test_failure_while_posting_a_claimed_offer_fails_the_fetch_and_keeps_the_lease(monkeypatch, error):
    """A start that fails half-way (the first chunk already staged) is undone; the engine's fetch finishes failed."""
    world, p, d, conn = rig(CFG)
    t = p.ticket(48, seed=1)
    tracker = d.session.tracker
    real, calls = tracker.post, []

    def post(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise error("injected on the second chunk")
        return real(*args, **kw)

    monkeypatch.setattr(tracker, "post", post)
    r = d.fetch_ticket(t, seed=1)  # nothing escapes receive()
    monkeypatch.undo()
    assert len(calls) == 2
    assert r.finished and d.session.get(r.fetch.id) is r.fetch  # finished, not vanished
    if error is Boom:
        _assert_wrapped(r.fetch)
    else:
        assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, PageRangeError)
    assert r.fetch.bytes == r.fetch.descriptors == 0 and not r.fetch.tags
    _assert_clean(d)  # the first chunk's post was withdrawn: nothing reached the backend
    assert not p.ended and live(p, t)
    again = d.fetch_ticket(t, seed=1)  # at once
    finish_all(world, d)
    assert again.fetch.state is FetchState.DONE and p.ended == [(t.lease, "done")]


def test_one_offer_cannot_be_fetched_twice_at_once():
    """Two fetches of one lease: the first Done would release pages the second still reads."""
    world, p, d, conn = rig(CFG)
    p.offer("decode", 30, seed=1)
    offer = d.offers[0][1]
    d.fetch_offer(conn, offer)
    with pytest.raises(ProtocolError):
        d.session.fetch_offer(conn, offer, d.alloc(30), d.now)


def test_refetching_a_failed_offer_is_refused_or_fails():
    """A refetch after a failure either is refused or reads safely (never a silent success on reused pages)."""
    world, p, d, conn = rig(CFG)
    p.offer("decode", 30, seed=1)
    offer = d.offers[0][1]
    r = d.fetch_offer(conn, offer)
    d.cancel(r)
    for read in d.backend.in_flight():
        d.backend.fail(read.tag)
    world.pump()
    assert r.fetch.state is FetchState.FAILED
    try:
        again = d.fetch_offer(conn, offer)
    except KvlendError:
        return
    finish_all(world, d)
    assert again.fetch.state is FetchState.FAILED  # the lease was aborted: the ack refuses it


def test_tracker_bug_while_posting_keeps_the_offer_trusted_for_the_retry(monkeypatch):
    """The failed start must not consume the offer's timing: the retry's bound advances as reads land."""
    world, p, d, conn = rig(CFG)
    p.offer("decode", 48, seed=1)
    offer = d.offers[0][1]
    tracker = d.session.tracker
    real, calls = tracker.post, []

    def post(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise Boom("tracker bug on the second chunk")
        return real(*args, **kw)

    confirm(world)  # the offer's renewal came back: it is trusted until then + ttl - heartbeat
    sure = d.now + CFG.ttl - CFG.heartbeat
    monkeypatch.setattr(tracker, "post", post)
    dst = d.alloc(48)
    with pytest.raises(Boom):
        d.session.fetch_offer(conn, offer, dst, d.now)
    d._free_tables(dst)
    monkeypatch.undo()
    r = d.fetch_offer(conn, offer)  # no tick in between: only the kept confirmation can make it trusted
    assert r.fetch.sure_until == sure
    first = d.backend.in_flight()[0]
    d.backend.finish(first.tag)
    world.pump()
    assert r.fetch.bound > 0, "the retry no longer trusts reads that land well inside the lease's TTL"
    assert d.session.next_deadline() is not None
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE


def test_decline_of_an_offer_being_read_is_refused():
    """Declining sends Abort: while reads are in flight that would free pages they still copy."""
    world, p, d, conn = rig(CFG)
    lease = p.offer("decode", 30, seed=1)
    offer = d.offers[0][1]
    r = d.fetch_offer(conn, offer)
    with pytest.raises(ProtocolError, match="cancel the fetch"):
        d.session.decline(conn, offer, "changed my mind")
    world.pump()
    assert live(p, lease) and r.fetch.state is FetchState.READING and not p.ended
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and p.ended == [(lease.id, "done")]


def test_decline_while_a_cancel_is_waiting_for_quiet_is_refused_too():
    world, p, d, conn = rig(CFG)
    lease = p.offer("decode", 30, seed=1)
    offer = d.offers[0][1]
    r = d.fetch_offer(conn, offer)
    d.cancel(r)
    assert r.fetch.state is FetchState.CANCELLING
    with pytest.raises(ProtocolError):
        d.session.decline(conn, offer, "and now decline")
    world.pump()
    assert live(p, lease)  # reads may still land
    for read in d.backend.in_flight():
        d.backend.late(read.tag)
    world.pump()
    assert r.fetch.state is FetchState.FAILED and p.ended == [(lease.id, "aborted")]


@pytest.mark.parametrize("how", ["cancel", "timeout"])
def test_a_claim_given_up_on_leaves_no_stale_offer(how):
    """The prefill's answer to an abandoned claim must not surface as a fresh pushed offer."""
    world, p, d, conn = rig(CFG)
    t = p.ticket(20, seed=1)
    wire = world.wire(d, conn)
    wire.hold_to_decode = True  # the offer answering the claim is on its way
    r = d.fetch_ticket(t, seed=1)
    assert r.fetch.state is FetchState.CLAIMING
    if how == "cancel":
        d.cancel(r)
    else:
        world.advance(CFG.transfer_timeout + EPS_T)
    assert r.fetch.state is FetchState.FAILED
    wire.hold_to_decode = False
    world.pump()
    world.advance(3 * CFG.heartbeat)
    assert not [e for e in d.events if isinstance(e, Offered)] and not d.offers
    assert (t.lease, "aborted") in p.ended and locked(p) == 0


def test_handshake_timeout_fails_waiting_fetches():
    world = World(0)
    p = world.add_prefill(config=CFG)
    d = world.add_decode(config=CFG)
    t = p.ticket(8, seed=2)
    conn = d.session.link_to(*p.endpoint, d.now)
    world._flush()  # connected and authenticated; the prefill's answer to the handshake will be held
    world.wire(d, conn).hold_to_decode = True
    r = d.fetch_ticket(t)
    assert r.fetch.state is FetchState.CLAIMING
    world.advance(CFG.handshake_timeout + EPS_T)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, TransferTimeout)
    assert conn not in d.session.links and not p.ended  # never claimed


def test_prefill_drops_a_connection_that_never_completes_tls():
    world, p, d, conn = rig(CFG)
    p.session.accept(99, p.now)
    assert p.session.pending == 1
    world.advance(10.0)
    assert p.session.pending == 0
    assert p.session.peers == ["decode"]


def test_prefill_shutdown_mid_fetch():
    world, p, d, conn = rig(CFG)
    lease = p.offer("decode", 40, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    p.session.shutdown("maintenance")
    world.pump()
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, PeerLost)
    assert "maintenance" in str(r.fetch.error)
    assert live(p, lease)  # kept until it expires: a read may still be landing
    world.advance(CFG.ttl + 1)
    assert locked(p) == 0


def test_decode_disconnect_mid_fetch():
    world, p, d, conn = rig(CFG)
    p.offer("decode", 40, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    d.session.disconnect(conn, d.now)
    world.pump()
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, PeerLost)
    assert p.session.peers == []
    world.advance(CFG.ttl + 1)
    assert locked(p) == 0


def test_resume_after_a_lost_link_reads_only_the_rest():
    world, p, d, conn = rig(CFG)
    t = p.ticket(48, seed=5)
    r = d.fetch_ticket(t, seed=5)
    first = d.backend.in_flight()[0]
    d.backend.finish(first.tag)
    world.pump()
    bound = r.fetch.bound
    assert bound == 16
    world.cut(world.wire(d, conn))
    assert r.fetch.state is FetchState.FAILED and r.fetch.bound == bound
    again = d.fetch_ticket(t, dst=r.dst, resume_from=bound, seed=5)  # same pages: the prefix is there
    finish_all(world, d)
    assert again.fetch.state is FetchState.DONE and again.fetch.bound == 48
    assert len(d.session.links) == 1


def test_many_fetches_time_out_each_at_its_own_deadline():
    """The session keeps deadlines in a heap: each fetch still fails when its own deadline passes, one
    that finished first never does, and ``next_deadline`` is never later than the earliest one left."""
    world, p, d, conn = rig(LONG)
    fetches = [d.fetch_ticket(p.ticket(8, seed=i), seed=i, timeout=1.0 + (i * 7) % 10 / 4) for i in range(10)]
    world.pump()
    for r in fetches[::3]:  # these finish at once: their deadlines must never fire
        for read in d.backend.in_flight():
            if read.tag in r.fetch.tags:
                d.backend.finish(read.tag)
    world.pump()
    assert all(r.fetch.state is FetchState.DONE for r in fetches[::3])
    for _ in range(60):  # 6 s: past the last deadline (3.25 s) and its cancel grace
        running = [r.fetch.deadline for r in fetches if r.fetch.state is FetchState.READING]
        assert not running or d.session.next_deadline() <= min(running)
        world.advance(0.1)
        for r in fetches:
            if r.fetch.state is FetchState.CANCELLING:
                for read in d.backend.in_flight():
                    if read.tag in r.fetch.tags:
                        d.backend.fail(read.tag)
        world.pump()
        for r in fetches:
            assert (r.fetch.state is FetchState.READING) == (d.now <= r.fetch.deadline and not r.fetch.done)
    assert all(r.fetch.done for r in fetches)
    assert all(r.fetch.state is FetchState.DONE for r in fetches[::3])
    timed_out = [r for i, r in enumerate(fetches) if i % 3]
    assert all(isinstance(r.fetch.error, TransferTimeout) for r in timed_out)


def test_deadlines_are_never_in_the_past_after_a_tick():
    world, p, d, conn = rig(CFG)
    p.offer("decode", 40, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    d.cancel(r)
    for _ in range(40):
        world.advance(0.25)
        for end in (p, d):
            t = end.session.next_deadline()
            assert t is None or t >= end.now - 1e-9, (end.name, t, end.now)


# ------------------------------------------------------------------ latency
def test_pushed_offer_bound_is_sound_when_the_control_channel_stalls():
    """A pushed offer is trusted only once a heartbeat renewal confirms it, however long the control path stalls.

    The prefill lends A then B at t0; the control channel stalls 3 s each way
    (ttl 5, heartbeat 1) while RDMA still works.  A arrives at t0+3 in one
    read, B in the next; the decode reads B at once.  Its heartbeats are held
    too, so the prefill expires both at t0+5 and reuses their pages: reads
    landing then copy scribbled bytes, and the bound must never count them
    (the transport checks every bound against the lent bytes on each step).
    """
    world, p, d, conn = rig(LONG)
    wire = world.wire(d, conn)
    wire.hold_to_decode = wire.hold_to_prefill = True
    p.offer("decode", 8, seed=1)
    p.offer("decode", 8, seed=2)
    assert len(wire.to_decode) == 2
    world.advance(3.0)
    world.deliver(wire)  # A
    world.deliver(wire)  # B, in a later read
    (conn_b, offer_b), = [(c, o) for c, o in d.offers if o.meta["seed"] == 2]
    r = d.fetch_offer(conn_b, offer_b)
    world.advance(2.5)  # t0 + 5.5: the prefill expired both leases (heartbeats still held)
    assert {reason for _, reason in p.ended} == {"expired"}
    assert r.fetch.bound == 0 and r.fetch.sure_until == -np.inf  # no renewal came back: nothing is trusted
    finish_all(world, d)  # reads land the prefill's reused pages: the bound must not count them
    assert r.fetch.state is FetchState.ACKING and r.fetch.bound == 0  # its done waits behind the stall
    wire.hold_to_decode = wire.hold_to_prefill = False
    world.pump()  # the held heartbeats renew nothing (the leases are gone); the done is refused
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LeaseExpired)
    assert r.fetch.bound == r.fetch.error.bound == 0
    assert r.fetch.sure_until == -np.inf
    world.check_locks()


def test_release_by_the_prefill_engine_tells_the_reader():
    """``PrefillSession.release`` frees pages the engine may reuse at once; its reader hears of it."""
    world, p, d, conn = rig(LONG)
    lease = p.offer("decode", 40, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    confirm(world)
    first, *rest = d.backend.in_flight()
    d.backend.finish(first.tag)
    world.pump()
    assert r.fetch.bound > 0
    world.lease_checks = False  # the engine's own release, not a Done/Abort from the reader
    p.session.release(lease.id)
    world.pump()
    assert r.fetch.state is FetchState.CANCELLING, (
        f"fetch still {r.fetch.state.value}: reads landing now copy reused pages and count for the bound")
    assert r.fetch.bound == 0  # what it read before may have been overwritten meanwhile
    for read in rest:
        d.backend.late(read.tag)
    world.pump()
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LeaseUnknown)
    assert r.fetch.error.bound == 0


@pytest.mark.parametrize("landed", ["before_the_abort", "after_the_abort"])
def test_a_release_under_a_read_keeps_its_pages_until_the_reader_is_quiet(landed):
    """The engine releases a lease whose reads are in flight and reuses its pages as soon as it hears
    ``LeaseEnded`` (the world scribbles them then).  Reads landing before the reader hears of it count
    for the bound, so the pages must still hold the lent bytes until the reader is quiet: its done, or
    its abort once its reads are terminal.  Before, they were reused at once and the bound covered
    scribbled pages (the world's bound check fails on every step)."""
    world, p, d, conn = rig(LONG)
    t = p.ticket(40, seed=1)
    r = d.fetch_ticket(t, seed=1)
    assert r.fetch.state is FetchState.READING
    wire = world.wire(d, conn)
    wire.hold_to_decode = True  # the prefill's Abort is on its way
    p.session.release(t.lease)
    world.pump()
    assert not p.ended and locked(p) > 0  # the engine may not reuse them yet
    first, *rest = d.backend.in_flight()
    if landed == "before_the_abort":
        finish_all(world, d)  # the bound covers the lease, and the bytes under it are the lent ones
        assert r.fetch.state is FetchState.ACKING and r.fetch.bound == 40
        assert p.ended == [(t.lease, "released")] and locked(p) == 0  # its done said it is quiet
        wire.hold_to_decode = False
        world.pump()
    else:
        d.backend.finish(first.tag)
        world.pump()
        assert 0 < r.fetch.bound < 40
        wire.hold_to_decode = False
        world.pump()
        assert r.fetch.state is FetchState.CANCELLING and r.fetch.bound == 0
        assert not p.ended and locked(p) > 0  # reads still in flight
        for read in rest:
            d.backend.late(read.tag)  # land after the abort: they count for nothing
        world.pump()
        assert p.ended == [(t.lease, "released")] and locked(p) == 0  # its abort, once quiet
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LeaseUnknown)
    assert r.fetch.bound == r.fetch.error.bound == 0
    world.check_locks()


@pytest.mark.parametrize("gone", ["dropped", "said_bye"])
def test_a_release_under_a_reader_whose_link_went_waits_unless_it_said_goodbye(gone):
    """A reader whose link dropped may still count reads it has in flight: the pages wait for the lease's
    expiry.  One that said goodbye failed its fetches first: they go at once."""
    world, p, d, conn = rig(LONG)
    t = p.ticket(40, seed=1)
    r = d.fetch_ticket(t, seed=1)
    wire = world.wire(d, conn)
    if gone == "dropped":  # the prefill sees the connection reset; the decode does not know yet
        wire.hold_to_decode = True
        wire.prefill_open = False
        p.session.closed(wire.pconn, p.now, "connection reset")
    else:
        d.session.disconnect(conn, d.now)
    world.pump()
    p.session.release(t.lease)
    world.pump()
    if gone == "said_bye":
        assert p.ended == [(t.lease, "released")] and locked(p) == 0
        finish_all(world, d)
        assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, PeerLost)
        return
    assert not p.ended and locked(p) > 0
    finish_all(world, d)  # lands before the decode hears anything: the bound counts it, so the bytes are there
    assert r.fetch.state is FetchState.ACKING and r.fetch.bound == 40
    world.advance(LONG.ttl - LONG.heartbeat)
    assert not p.ended and locked(p) > 0
    world.advance(2 * LONG.heartbeat)  # past the lease's expiry on the prefill's clock
    assert p.ended == [(t.lease, "released")] and locked(p) == 0
    world.check_locks()


def test_a_release_of_an_offer_nobody_reads_is_acknowledged_at_once():
    world, p, d, conn = rig(LONG)
    lease = p.offer("decode", 20, seed=1)
    p.session.release(lease.id)
    world.pump()
    assert p.ended == [(lease.id, "released")] and locked(p) == 0
    assert d.session.next_deadline() is None  # nothing left to heartbeat


# --------------------------------------------------------- the transport itself
def test_transport_catches_a_write_after_finish():
    world, p, d, conn = rig(CFG)
    p.offer("decode", 8, seed=1)
    r = d.fetch_offer(conn, d.offers[0][1])
    read = d.backend.in_flight()[0]
    d.backend.finish(read.tag)
    world.pump()
    assert r.finished
    read.terminal = False  # pretend the backend broke the contract
    read.landed = False
    with pytest.raises(ContractError):
        d.backend.land(read.tag)


def test_scribbled_pages_after_release():
    world, p, d, conn = rig(CFG)
    lease = p.offer("decode", 8, seed=1)
    tables = p.lent[lease.id].tables
    d.session.decline(conn, d.offers[0][1], "no")
    world.pump()
    layer = group_layers(p.layout, "full")[0]
    assert (slots(p.pools[layer])[tables["full"]] == SCRIBBLE).all()


# ------------------------------------------------- stale renewals, resumed bounds
@pytest.mark.parametrize("end", ["cancel", "decline"])
def test_an_offer_the_decode_ended_cannot_be_fetched_again(end):
    """A renewal answering a heartbeat sent before the Abort must never vouch for a second read of
    the same offer: the prefill may have reused its pages.  So the offer is gone once ended."""
    world, p, d, conn = rig(LONG)
    lease = p.offer("decode", 30, seed=1)
    offer = d.offers[0][1]
    wire = world.wire(d, conn)
    wire.hold_to_decode = True  # the prefill's answers are slow
    world.tick()  # the heartbeat the offer asked for goes out, naming the lease
    if end == "cancel":
        r1 = d.fetch_offer(conn, offer)
        d.cancel(r1)
        for read in d.backend.in_flight():
            d.backend.fail(read.tag)
    else:
        d.session.decline(conn, offer, "no")
    world.pump()
    assert not live(p, lease)
    with pytest.raises(ProtocolError, match="no longer offered"):
        d.session.fetch_offer(conn, offer, d.alloc(30), d.now)
    wire.hold_to_decode = False
    world.pump()  # the stale renewal arrives and confirms nothing
    _assert_clean(d, reads=len(d.backend.reads))  # the cancelled reads were reported; nothing new posted
    assert all(read.reported for read in d.backend.reads.values())


@pytest.mark.parametrize("path", ["offer", "ticket"])
def test_a_resumed_fetch_never_reports_less_than_it_resumed_from(path):
    """With a windowed group the lease only holds what a decoder at num_tokens reads, so the tracker
    alone cannot vouch for resume_from; the bound still never drops below it."""
    world, p, d, conn = rig(LONG)
    if path == "offer":
        p.offer("decode", 72, seed=1)
        r = d.fetch_offer(conn, d.offers[0][1], resume_from=36)
        confirm(world)
    else:
        r = d.fetch_ticket(p.ticket(72, seed=1), resume_from=36, seed=1)
    assert r.fetch.bound == 36
    d.backend.finish(d.backend.in_flight()[0].tag)
    world.pump()
    assert r.fetch.bound >= 36
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == 72


def test_heartbeats_past_the_remembered_ones_confirm_nothing():
    """A prefill that stops answering costs a bounded memory; answers beyond it give no trust."""
    from kvlend.protocol import decode as decode_module

    world, p, d, conn = rig(LONG)
    p.offer("decode", 30, seed=1)
    wire = world.wire(d, conn)
    wire.hold_to_decode = True
    world.advance(LONG.heartbeat * (decode_module._BEATS_KEPT + 8), step=LONG.heartbeat)
    link = d.session._links[conn]
    assert len(link.beats) == decode_module._BEATS_KEPT and link.blind >= 1
    wire.hold_to_decode = False
    world.pump()  # every answer arrives: the remembered ones first, then the blind ones
    assert not link.beats and link.blind == 0 and conn in d.session.links
