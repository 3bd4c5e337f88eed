"""Sessions over ``kvlend.testing.World`` when a fetch cannot start cleanly: bad arguments and bugs in
the planner or tracker leave nothing behind, a retry works; offers fetched or declined twice; links that
never come up, shut down or drop mid-fetch.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvlend.protocol.fetch as fetch_mod
from kvlend.errors import (
    KvlendError,
    PageRangeError,
    PeerLost,
    ProtocolError,
    TransferTimeout,
)
from kvlend.protocol.actions import Offered
from kvlend.protocol.decode import FetchState
from kvlend.testing import World, finish_all, rig
from tests.support.sessions import CFG, EPS_T, LONG, assert_clean, confirm, live, locked

pytestmark = pytest.mark.unit


# ----------------------------------------------------- exceptions at fetch start
def _bad_dsts(d, n):
    good = d.alloc(n)
    yield {k: v for k, v in good.items() if k != "swa"}  # a group missing
    yield {**good, "swa": good["swa"][:-1]}  # too short
    yield {**good, "full": np.full_like(good["full"], 10_000)}  # outside the pool
    yield {**good, "full": good["full"].astype(float)}  # not integers
    yield "not a mapping"
    d._free_tables(good)


def test_bad_fetch_offer_arguments_change_nothing_and_a_retry_works():
    world, p, d, conn = rig(CFG)
    lease = p.offer("decode", 30, seed=1)
    offer = d.offers[0][1]
    confirm(world)
    sure = d.now + CFG.ttl - CFG.heartbeat
    for bad in _bad_dsts(d, 30):
        with pytest.raises(KvlendError):
            d.session.fetch_offer(conn, offer, bad, d.now)
        assert_clean(d)
    for resume in (-1, 31, 2.5, True, "0", None):
        with pytest.raises(PageRangeError):
            d.session.fetch_offer(conn, offer, d.alloc(30), d.now, resume)
        assert_clean(d)
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
        assert_clean(d)
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
    assert_clean(d)
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
    assert_clean(d)
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
        assert_clean(d)
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
    assert_clean(d)
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
    assert_clean(d)  # the first chunk's post was withdrawn: nothing reached the backend
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
