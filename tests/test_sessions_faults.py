"""Sessions over ``kvlend.testing.World`` when something dies or is cancelled: links cut, ends killed,
certificates refused, cancels that wait for quiet, a bound that only names delivered bytes, and the
in-memory transport's own checks.
"""

from __future__ import annotations

import pytest

from kvlend.core.layout import RowSelection
from kvlend.errors import (
    AuthError,
    BackendError,
    IncompleteFetch,
    PeerLost,
    ProtocolError,
    TransferCancelled,
)
from kvlend.protocol.actions import Close, RemovePeer
from kvlend.protocol.decode import FetchState
from kvlend.testing import SCRIBBLE, ContractError, World, finish_all, rig
from kvlend.testing.kvcache import group_layers, slots
from tests.support.sessions import CFG, LONG, confirm, live, locked

pytestmark = pytest.mark.unit


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
