"""Sessions over ``kvlend.testing.World``: fetches that work, tickets and the claims behind them, prompt digests.

No sockets, no NIXL, no threads: the world executes the sessions' actions,
copies real bytes between numpy pools and checks the contract on every step
(nothing lands in a finished fetch, a fetch finishes only once its reads are
terminal, ``Done``/``Abort`` release a lease only once nothing can still read
it, the bound always names bytes that are really there).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvlend.core.prompt import prompt_digest
from kvlend.errors import (
    ConfigError,
    KvlendError,
    LayoutMismatch,
    LeaseDenied,
    LeaseError,
    LeaseExpired,
    LeaseUnknown,
    PeerLost,
    PromptMismatch,
    ProtocolError,
)
from kvlend.protocol.actions import ClaimWaits, Close, LeaseEnded, Offered, Send
from kvlend.protocol.codes import Code
from kvlend.protocol.config import NodeConfig
from kvlend.protocol.connection import AUTH_TIMEOUT
from kvlend.protocol.decode import DecodeSession, FetchState
from kvlend.protocol.ticket import Ticket
from kvlend.protocol.wire import Abort, Bye, Claim, Handshake, encode_frame
from kvlend.testing import KIND, World, finish_all, rig
from tests.support.sessions import CFG, EPS_T, LONG, live, locked
from tests.support.wire import decode_all

pytestmark = pytest.mark.unit


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
