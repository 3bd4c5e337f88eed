"""Protocol 6: a fetch whose reads all land in its lease's sure window is done without the ack.

Its ``Done`` is bookkeeping: batched per link and turn into one ``Heartbeat.done`` that the prefill
does not answer, and the locks drop when it arrives.  A fetch whose reads land after the window
keeps protocol 5's path: ``Done`` alone, the ack awaited, a refused ack counting nothing.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvlend.errors import LeaseExpired
from kvlend.protocol.decode import FetchState
from kvlend.protocol.wire import Claim, Done, FrameDecoder, Heartbeat
from kvlend.testing import finish_all, rig
from tests.support.sessions import CFG, EPS_T, locked

pytestmark = pytest.mark.unit

AHEAD = dataclasses.replace(CFG, read_ahead=True)  # the default: reads go with the claim
WINDOW = CFG.ttl - CFG.heartbeat  # from the claim: how long a read counts without the ack


def held_messages(wire) -> list:
    """The messages waiting on ``wire`` towards the prefill."""
    decoder = FrameDecoder()
    decoder.feed(b"".join(chunk for chunk in wire.to_prefill if isinstance(chunk, bytes)))
    out = []
    while (message := decoder.next_message()) is not None:
        out.append(message)
    return out


@pytest.mark.parametrize("config", [AHEAD, CFG], ids=["read_ahead", "claim_first"])
def test_a_fetch_read_in_its_window_is_done_before_its_done_reaches_the_prefill(config):
    world, p, d, conn = rig(config)
    t = p.ticket(40, seed=1)
    r = d.fetch_ticket(t, seed=1)
    wire = world.wire(d, conn)
    wire.hold_to_prefill = True
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == 40 and r.fetch.error is None
    assert locked(p) > 0 and not p.ended  # the prefill has not heard yet: its pages stay locked
    assert [m for m in held_messages(wire) if not isinstance(m, Claim)] == [Heartbeat((), (t.lease,))]
    wire.hold_to_prefill = False
    world.pump()
    assert p.ended == [(t.lease, "done")] and locked(p) == 0
    assert not any(isinstance(m, Done) for m in held_messages(wire))
    world.check_locks()


def test_the_dones_of_one_turn_go_in_one_heartbeat_the_prefill_does_not_answer():
    world, p, d, conn = rig(AHEAD)
    tickets = [p.ticket(8 * (i + 1), seed=i + 1) for i in range(3)]
    records = [d.fetch_ticket(t, seed=i + 1) for i, t in enumerate(tickets)]
    world.pump()  # the claims are answered: every read confirmed
    wire = world.wire(d, conn)
    wire.hold_to_prefill = True
    for read in d.backend.in_flight():
        d.backend.finish(read.tag)
    while d.backend.deliver():  # every completion in one loop turn, as a node's poll reports them
        pass
    world.pump()
    assert all(r.fetch.state is FetchState.DONE for r in records)
    (beat,) = held_messages(wire)
    assert beat == Heartbeat((), tuple(t.lease for t in tickets))
    answers = len(world.wire(d, conn).to_decode)
    wire.hold_to_prefill = False
    world.pump()
    assert sorted(p.ended) == sorted((t.lease, "done") for t in tickets) and locked(p) == 0
    assert len(wire.to_decode) == answers  # no Renewed, no DoneAck


def test_a_fetch_whose_reads_land_after_its_window_waits_for_the_ack():
    world, p, d, conn = rig(CFG)
    t = p.ticket(40, seed=2)
    r = d.fetch_ticket(t, seed=2)
    wire = world.wire(d, conn)
    wire.hold_to_prefill = True  # no heartbeat renews it
    world.advance(WINDOW + EPS_T)
    finish_all(world, d)
    assert r.fetch.state is FetchState.ACKING and r.fetch.bound == 0
    assert isinstance(held_messages(wire)[-1], Done)
    wire.hold_to_prefill = False
    world.pump()  # the lease is still live on the prefill: the ack makes it all usable
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == 40
    assert p.ended == [(t.lease, "done")] and locked(p) == 0


def test_a_lease_expiring_between_land_and_ack_counts_nothing():
    world, p, d, conn = rig(CFG)
    t = p.ticket(40, seed=3)
    r = d.fetch_ticket(t, seed=3)
    wire = world.wire(d, conn)
    wire.hold_to_prefill = True
    world.advance(WINDOW + EPS_T)
    finish_all(world, d)
    assert r.fetch.state is FetchState.ACKING
    world.advance(CFG.heartbeat + EPS_T)  # past its TTL on the prefill: it expires, its pages may go
    assert (t.lease, "expired") in p.ended
    wire.hold_to_prefill = False
    world.pump()
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LeaseExpired)
    assert r.fetch.bound == r.fetch.error.bound == 0


def test_a_done_in_a_heartbeat_for_a_lease_the_peer_does_not_hold_releases_nothing():
    world, p, d, conn = rig(CFG)
    t = p.ticket(40, seed=4)
    other = p.ticket(8, seed=5)
    r = d.fetch_ticket(t, seed=4)
    world.pump()
    held = locked(p)
    wire = world.wire(d, conn)
    d.session._links[conn].conn.send(Heartbeat((), (other.lease,)))  # never claimed: nothing to release
    world.pump()  # the world flushes the session's bytes
    assert locked(p) == held and not p.ended and wire.open
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and p.ended == [(t.lease, "done")]
