"""The fetch timeline: each step of a fetch stamped with the session's ``now``, in order, and its phases."""

from __future__ import annotations

import pytest

from kvlend.protocol.config import NodeConfig
from kvlend.protocol.decode import FetchState
from kvlend.protocol.fetch import PHASES, phases
from kvlend.testing import World, finish_all

pytestmark = pytest.mark.unit


def _rig(**config):
    world = World(seed=0)
    prefill = world.add_prefill(config=NodeConfig(**config))
    decode = world.add_decode(config=NodeConfig(**config))
    conn = world.connect(decode, prefill)
    return world, prefill, decode, world.wire(decode, conn)


def test_a_ticket_fetch_stamps_claim_grant_landings_and_usable_in_order():
    world, prefill, decode, wire = _rig(chunk_pages=1, read_ahead=False)  # one read per page: first and last
    t0 = world.now
    wire.hold_to_decode = True  # the claim's answer waits on the wire until delivered
    record = decode.fetch_ticket(prefill.ticket(64, seed=3), seed=3)
    fetch = record.fetch
    assert (fetch.claimed_at, fetch.granted_at) == (t0, None)
    world.now = t0 + 1.0
    world.deliver(wire)  # the offer: granted, reads posted
    assert fetch.granted_at == fetch.posted == t0 + 1.0 and fetch.first_landed_at is None
    reads = decode.backend.in_flight()
    assert len(reads) > 1
    world.now = t0 + 2.0
    decode.backend.finish(reads[0].tag)
    world.pump()
    assert fetch.first_landed_at == t0 + 2.0 and fetch.landed is None
    world.now = t0 + 3.0
    finish_all(world, decode)  # the rest land inside the lease's window: usable, its Done not answered
    assert fetch.state is FetchState.DONE
    assert fetch.landed == fetch.usable_at == fetch.finished == t0 + 3.0 and fetch.acked_at is None
    assert phases(fetch) == {"claim->grant": 1.0, "grant->landed": 2.0, "landed->usable": 0.0,
                             "usable->acked": None}


def test_a_fetch_landing_after_its_window_is_usable_when_acked():
    config = NodeConfig(read_ahead=False)
    world, prefill, decode, wire = _rig(read_ahead=False)
    t0 = world.now
    record = decode.fetch_ticket(prefill.ticket(32, seed=6), seed=6)
    fetch = record.fetch
    world.pump()  # the claim answered at once: granted, reads posted
    wire.hold_to_prefill = True  # no heartbeat renews the lease
    world.advance(config.ttl - config.beat_for(config.ttl) + 1e-3)
    finish_all(world, decode)
    assert fetch.state is FetchState.ACKING and fetch.usable_at is None
    landed = world.now
    world.advance(1e-3)
    wire.hold_to_prefill = False
    world.pump()  # the Done reaches the prefill; its ack makes the reads count
    assert fetch.state is FetchState.DONE and fetch.acked_at == fetch.usable_at == world.now
    assert fetch.landed == landed and phases(fetch)["usable->acked"] == 0.0
    assert phases(fetch)["claim->grant"] == 0.0 and fetch.granted_at == t0


def test_reads_landed_before_the_grant_count_no_read_time_after_it():
    world, prefill, decode, wire = _rig(read_ahead=True)
    t0 = world.now
    wire.hold_to_decode = True
    record = decode.fetch_ticket(prefill.ticket(32, seed=4), seed=4)
    fetch = record.fetch
    assert fetch.posted == t0 and fetch.granted_at is None  # posted from the ticket with the claim
    world.now = t0 + 1.0
    finish_all(world, decode)
    assert fetch.first_landed_at == fetch.landed == t0 + 1.0  # every read landed, none counts yet
    assert fetch.usable_at is None
    world.now = t0 + 2.0
    world.deliver(wire)  # the claim's answer confirms what was read: usable at once
    assert fetch.state is FetchState.DONE and fetch.granted_at == fetch.usable_at == t0 + 2.0
    assert phases(fetch) == {"claim->grant": 2.0, "grant->landed": 0.0, "landed->usable": 0.0,
                             "usable->acked": None}


def test_a_pushed_offer_has_no_claim_and_a_failed_fetch_is_never_usable():
    world, prefill, decode, wire = _rig()
    prefill.offer(decode.name, 16, seed=5)
    (conn, offer), = decode.offers
    record = decode.fetch_offer(conn, offer)
    fetch = record.fetch
    assert fetch.claimed_at is None and fetch.granted_at == world.now
    decode.cancel(record)
    for read in decode.backend.in_flight():
        decode.backend.fail(read.tag)
    world.pump()
    assert fetch.state is FetchState.FAILED and fetch.usable_at is None
    assert list(phases(fetch)) == list(PHASES) and phases(fetch)["claim->grant"] is None
