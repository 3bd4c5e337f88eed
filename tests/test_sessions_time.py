"""Sessions over ``kvlend.testing.World`` on its fake clock: leases kept alive and lost, renewals that
confirm a pushed offer or do not, timeouts, a stalled control channel, a prefill that releases under a reader.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvlend.errors import (
    ConfigError,
    LeaseExpired,
    LeaseUnknown,
    PeerLost,
    ProtocolError,
    TransferTimeout,
)
from kvlend.protocol.decode import FetchState
from kvlend.protocol.wire import Renewed
from kvlend.testing import finish_all, rig
from tests.support.sessions import CFG, EPS_T, LONG, assert_clean, confirm, live, locked

pytestmark = pytest.mark.unit


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
    assert_clean(d)
    assert not p.ended and p.lender.get(t.lease, p.now).peer is None  # nothing was claimed
    d._free_tables(dst)
    a, b = d.fetch_offer(conn, offer, timeout=30), d.fetch_ticket(t, seed=2, timeout=30)
    finish_all(world, d)
    assert a.fetch.state is b.fetch.state is FetchState.DONE


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
    scribbled pages (the world's bound check fails on every step).  Reads that all landed before the
    reader heard of the release finished the fetch (protocol 6): the withdrawal that comes after is late."""
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
        assert r.fetch.state is FetchState.DONE and r.fetch.bound == 40 and r.fetch.error is None
        assert p.ended == [(t.lease, "released")] and locked(p) == 0  # its done said it is quiet
        wire.hold_to_decode = False
        world.pump()  # the withdrawal, after the fetch finished: nothing changes
        assert r.fetch.state is FetchState.DONE and r.fetch.bound == 40
        world.check_locks()
        return
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
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == 40  # in the lease's life: its Done is lost
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
    assert_clean(d, reads=len(d.backend.reads))  # the cancelled reads were reported; nothing new posted
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
