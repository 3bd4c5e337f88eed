"""Progressive lending (issue 17) end to end, sans-IO: a lease read while prefill still computes it.

A prefill lends a request's pages while its chunked prefill still runs
(``LendOptions.ready``) and grows the lease chunk by chunk
(``PrefillSession.extend``); the decode it is bound to hears each ``Extend`` and
posts the new pages' reads at once, sends ``Done`` only once the lease is final
and every read landed.  Over ``kvlend.testing`` (in-memory network, backend
and fake clock, with the contract checked on every step) pages a prefill has
not computed yet hold ``UNCOMPUTED`` bytes until their extension commits them,
so a read posted too early, or a bound counting one, breaks the transport's
checks (the bound always names bytes that are there, a done fetch holds
exactly the lent bytes).

Covered: tickets lent at ``ready=0`` or a first chunk and extended on page
boundaries and off them; the reads of each extension posted with no round
trip; the bound advancing chunk by chunk; extensions merged into a pushed
offer or a ticket claimed ahead before its fetch starts; sliding-window and
recurrent groups (stale window pages never read, state only at the end); a
prefill lost mid-stream and the resume from another; a decode lost mid-stream
(locks of every extension dropped at expiry); the fetch deadline passing while
waiting; malformed extensions; and random interleavings (hypothesis stateful).

This file: streaming, pushed offers and claims ahead, hybrid groups.  Faults and the short
progressive ttl: ``test_progressive_sessions_faults.py``; random interleavings:
``test_progressive_sessions_stateful.py``; shared ends and helpers: ``tests/support/progressive.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvlend.core.lease import LendOptions
from kvlend.protocol.decode import FetchState
from kvlend.protocol.wire import Extend
from kvlend.testing import Lent, finish_all
from kvlend.testing.kvcache import SENTINEL, group_layers, slots
from tests.support.progressive import (
    TPP,
    both_groups,
    complete,
    inject,
    locked,
    new_reads,
    posted_pages,
    push_progressive,
    rig,
)

pytestmark = pytest.mark.unit


# ----------------------------------------------------------------- streaming
@pytest.mark.parametrize("first", [0, 10, 16])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_ticket_lent_while_prefill_computes_is_read_chunk_by_chunk(first, shuffle):
    """Each extension's reads are posted the moment its ``Extend`` arrives (what the decode sends is held:
    no round trip), the bound follows the delivered chunks, ``Done`` waits for the final one."""
    world, p, d, conn = rig(seed=first, shuffle=shuffle, fragment=shuffle)
    n, seed = 61, 7
    t = p.ticket(n, seed, ready=first)
    r = d.fetch_ticket(t, seed=seed)
    assert r.fetch.state is FetchState.READING and r.fetch.offer.ready == first and not r.fetch.offer.final
    assert posted_pages(d, r, d.backend.in_flight()) == both_groups(list(range(complete(first, n))))
    finish_all(world, d)
    assert r.fetch.state is FetchState.READING and r.fetch.quiet and not p.ended
    assert r.fetch.bound == complete(first, n) * TPP
    wire = world.wire(d, conn)
    wire.hold_to_prefill = True  # nothing the decode sends reaches the prefill from here on
    prev, bounds = first, [r.fetch.bound]
    for ready in [s for s in (10, 16, 23, 37, 40, 50, 61) if s > first]:
        before = set(d.backend.reads)
        p.extend(t, ready)
        world.check_locks()
        reads = new_reads(d, before)
        assert all(not read.terminal for read in reads)  # posted at once, in flight
        want = list(range(complete(prev, n), complete(ready, n)))
        assert posted_pages(d, r, reads) == both_groups(want), (prev, ready)
        assert r.fetch.offer.ready == ready
        finish_all(world, d)
        if ready < n:
            assert r.fetch.state is FetchState.READING and r.fetch.quiet, r.fetch.error
            assert r.fetch.bound == complete(ready, n) * TPP
            assert not p.ended  # no Done before the lease is final
        bounds.append(r.fetch.bound)
        prev = ready
    # Every read landed in the lease's life and it is final: done at once; its Done, bookkeeping, is held on the wire.
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == n  # the transport verified the bytes
    assert not p.ended and wire.to_prefill and locked(p) > 0
    wire.hold_to_prefill = False
    world.pump()
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)  # one step per chunk
    assert set(r.bounds) | {n} == set(bounds) | {0}
    assert p.ended == [(t.lease, "done")] and locked(p) == 0
    world.check_locks()


def test_extensions_read_before_earlier_ones_land_count_only_over_the_delivered_prefix():
    """Several extensions in flight at once, landing newest first: the tracker needs each, the bound waits."""
    world, p, d, conn = rig()
    t = p.ticket(64, 3, ready=0)
    r = d.fetch_ticket(t, seed=3)
    groups = []
    for ready in (8, 20, 33, 50):
        before = set(d.backend.reads)
        p.extend(t, ready)
        groups.append(new_reads(d, before))
    assert [len(g) > 0 for g in groups] == [True] * 4
    for group in reversed(groups[1:]):
        for read in group:
            d.backend.finish(read.tag)
        world.pump()
        assert r.fetch.bound == 0  # pages 0-1 are not there yet
    for read in groups[0]:
        d.backend.finish(read.tag)
    world.pump()
    assert r.fetch.bound == 48 and r.fetch.state is FetchState.READING
    p.extend(t, 64)
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and p.ended == [(t.lease, "done")] and locked(p) == 0


def test_a_final_extension_of_one_page_reads_it_then_sends_done():
    """The last chunk only completes the last page: it is read, then Done goes out."""
    world, p, d, conn = rig()
    t = p.ticket(60, 3, ready=59)
    r = d.fetch_ticket(t, seed=3)
    finish_all(world, d)
    assert r.fetch.state is FetchState.READING and r.fetch.bound == 56
    before = set(d.backend.reads)
    p.extend(t, 60)
    assert posted_pages(d, r, new_reads(d, before)) == both_groups([14])
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and locked(p) == 0


def test_an_extension_with_no_new_page_posts_nothing_and_done_follows_the_final_one():
    world, p, d, conn = rig()
    t = p.ticket(30, 3, ready=9)
    r = d.fetch_ticket(t, seed=3)
    finish_all(world, d)
    before = set(d.backend.reads)
    p.extend(t, 11)  # still inside page 2: nothing new to read
    assert not new_reads(d, before) and r.fetch.state is FetchState.READING and r.fetch.offer.ready == 11
    p.extend(t, 30)
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == 30 and locked(p) == 0


@pytest.mark.parametrize("hybrid", [False, True])
def test_an_engine_allocating_pages_chunk_by_chunk_lends_tables_with_holes(hybrid):
    """A chunked prefill has slots only for what it computed: rows past ``ready`` (and the state slot until
    the end) are -1 in the tables it lends and extends with; each extension reveals the rows it commits."""
    world, p, d, conn = rig(hybrid=hybrid)
    n, seed = 70, 8
    tables = p._tables(n, seed)
    p._uncompute(tables, n, 6)

    def upto(ready: int) -> dict:
        out = {}
        for name, table in tables.items():
            rows, done = p._committed(name, n, ready)
            part = np.full_like(table, -1)
            part[rows[done]] = table[rows[done]]
            out[name] = part
        return out

    lease = p.session.lend("chunked", n, upto(6), p.layout.full_selection(), p.now,
                           LendOptions(ready=6, meta={"seed": seed}))
    p.lent[lease.id] = Lent(lease, tables, seed)
    t = p.session.ticket(lease, *p.endpoint)
    r = d.fetch_ticket(t, seed=seed)
    for ready in (6, 19, 44, 64, n):
        if ready > 6:
            p._compute(tables, n, ready, seed)
            p.lent[lease.id].lease = p.session.extend(lease.id, ready, upto(ready), p.now)
            world.pump()
        world.check_locks()
        finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == n and locked(p) == 0


@pytest.mark.parametrize("how", ["reading", "claimed ahead", "claimed after"])
def test_meta_given_with_an_extension_reaches_the_reader(how):
    """The engine learns the first generated token only once prefill is done: the final Extend carries it."""
    world, p, d, conn = rig()
    t = p.ticket(30, 2, ready=8)
    if how == "reading":
        r = d.fetch_ticket(t, seed=2)
    elif how == "claimed ahead":
        d.claim(t)
    p.extend(t, 17, meta={"chunk": 2})
    p.extend(t, 30, meta={"first_token": 1234})
    if how != "reading":
        r = d.fetch_ticket(t, seed=2)
    assert dict(r.fetch.offer.meta) == {"seed": 2, "chunk": 2, "first_token": 1234}
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and locked(p) == 0


def test_meta_grown_by_extensions_is_capped_like_an_offers():
    """An offer's meta holds at most 64 entries (``LeaseOffer.from_wire``); extensions merging theirs into it
    must not let a prefill grow it past that (the honest prefill checks the merged meta before sending)."""
    world, p, d, conn = rig()
    t = p.ticket(40, 2, ready=4)
    d.claim(t)
    for i in range(4):
        if conn not in d.session._links:  # refused: the link is gone
            break
        inject(world, p, d, conn, Extend(t.lease, 8 + i, {}, {f"k{i}-{j}": j for j in range(64)}))
    link = d.session._links.get(conn)
    grown = link.offers.get(t.lease) if link is not None else None
    assert grown is None or len(grown.meta) <= 64, f"the decode holds an offer with {len(grown.meta)} meta entries"
    assert link is None and "meta past 64 entries" in str(d.session.link_error(conn))


# -------------------------------------------------- pushed offers, claims ahead
def test_prefill_session_offer_lends_progressively():
    """``PrefillSession.offer`` must take ``ready=`` like ``lend``: a prefill pushes its leases to a decode
    it already knows, and a progressive lease is the one worth pushing early (issue 17)."""
    world, p, d, conn = rig()
    lease = p.offer("decode", 40, 1, ready=10)
    assert lease.ready == 10 and not lease.final
    (c, offer), = d.offers
    assert offer.ready == 10
    r = d.fetch_offer(c, offer)
    p.extend(lease, 40)
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and locked(p) == 0


@pytest.mark.parametrize("trusted", [False, True])
def test_extensions_of_a_pushed_offer_before_its_fetch_are_merged_and_read_when_it_starts(trusted):
    world, p, d, conn = rig()
    lease = push_progressive(p, "decode", 61, 5, ready=10)
    (c, offer), = d.offers
    assert offer.ready == 10 and not d.backend.reads
    p.extend(lease, 23)
    p.extend(lease, 37)
    assert not d.backend.reads  # nothing is read before the engine starts the fetch
    if trusted:
        world.tick()  # the heartbeat the offer asked for; its renewal makes the reads count before the ack
    r = d.fetch_offer(c, offer)  # the engine's copy of the offer is the first one: the session's has grown
    assert r.fetch.offer.ready == 37
    assert posted_pages(d, r, d.backend.in_flight()) == both_groups(list(range(9)))
    finish_all(world, d)
    assert r.fetch.state is FetchState.READING and r.fetch.bound == (36 if trusted else 0)
    before = set(d.backend.reads)
    p.extend(lease, 61)
    assert posted_pages(d, r, new_reads(d, before)) == both_groups(list(range(9, 16)))
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and p.ended == [(lease.id, "done")] and locked(p) == 0


def test_a_pushed_offer_final_before_its_fetch_reads_everything_and_acks():
    world, p, d, conn = rig()
    lease = push_progressive(p, "decode", 33, 5, ready=0)
    p.extend(lease, 20)
    p.extend(lease, 33)
    (c, offer), = d.offers
    r = d.fetch_offer(c, offer)
    assert r.fetch.offer.final
    assert posted_pages(d, r, d.backend.in_flight()) == both_groups(list(range(9)))
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and locked(p) == 0


@pytest.mark.parametrize("first", [0, 10])
def test_extensions_of_a_ticket_claimed_ahead_are_merged_and_read_when_its_fetch_starts(first):
    world, p, d, conn = rig()
    t = p.ticket(61, 9, ready=first)
    d.claim(t)
    p.extend(t, 23)
    world.advance(3.0)  # heartbeats keep the claimed lease alive meanwhile
    p.extend(t, 40)
    assert not d.backend.reads
    r = d.fetch_ticket(t, seed=9)
    assert r.fetch.state is FetchState.READING and r.fetch.offer.ready == 40
    assert posted_pages(d, r, d.backend.in_flight()) == both_groups(list(range(10)))
    finish_all(world, d)
    assert r.fetch.bound == 40 and r.fetch.state is FetchState.READING
    before = set(d.backend.reads)
    p.extend(t, 61)
    assert posted_pages(d, r, new_reads(d, before)) == both_groups(list(range(10, 16)))
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and locked(p) == 0


def test_a_claim_ahead_answered_after_extensions_carries_them():
    """Extensions made before the claim arrives are in the offer that answers it (nothing is lost)."""
    world, p, d, conn = rig()
    t = p.ticket(40, 9, ready=4)
    wire = world.wire(d, conn)
    wire.hold_to_prefill = True
    d.claim(t)  # the claim waits on the wire
    p.extend(t, 17)  # not bound yet: nothing to tell anyone
    p.extend(t, 29)
    wire.hold_to_prefill = False
    world.pump()
    r = d.fetch_ticket(t, seed=9)
    assert r.fetch.offer.ready == 29
    assert posted_pages(d, r, d.backend.in_flight()) == both_groups(list(range(7)))
    p.extend(t, 40)
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and locked(p) == 0


def test_a_lease_lent_to_a_peer_is_extended_before_any_offer_and_read_whole_on_its_claim():
    """A lease lent to a named peer but never offered: ``Extend`` must not reach a decode that knows nothing
    of it (the wire doc: only after its Offer); the decode copes either way and reads the grown lease."""
    world, p, d, conn = rig()
    lease = p.lend(40, 2, peer="decode", ready=8)
    wire = world.wire(d, conn)
    sent_before = len(wire.to_decode)
    wire.hold_to_decode = True
    p.extend(lease, 30, pump=False)
    world.pump()
    extends_without_offer = len(wire.to_decode) - sent_before
    wire.hold_to_decode = False
    world.pump()
    assert conn in d.session.links  # ignored, not a protocol error
    r = d.fetch_ticket(p.session.ticket(lease, *p.endpoint), seed=2)
    assert r.fetch.offer.ready == 30
    p.extend(lease, 40)
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and locked(p) == 0
    assert extends_without_offer == 0, "the prefill sent an Extend for a lease it never offered on that link"


# ------------------------------------------------------------------- hybrid
@pytest.mark.parametrize("hybrid", [False, True])
def test_windowed_pages_outside_the_final_window_are_never_read_and_state_comes_last(hybrid):
    world, p, d, conn = rig(hybrid=hybrid)
    n, seed = 200, 4
    t = p.ticket(n, seed, ready=0)
    r = d.fetch_ticket(t, seed=seed)
    window = [0, *range((n - 64) // TPP, n // TPP)]  # the sink page and the final window
    seen: dict[str, set] = {name: set() for name in r.dst}
    prev = 0
    for ready in (30, 101, 150, 170, 199, n):
        before = set(d.backend.reads)
        lease = p.extend(t, ready)
        pages = posted_pages(d, r, new_reads(d, before))
        want_full = list(range(complete(prev, n), complete(ready, n)))
        assert pages["full"] == want_full
        assert pages["swa"] == [q for q in window if q in want_full]
        if hybrid:
            assert pages["ssm"] == ([0] if ready == n else [])  # the state row only with the final extension
            assert len(lease.pages["ssm"]) == (1 if ready == n else 0)
        for name, got in pages.items():
            seen[name].update(got)
        world.check_locks()
        finish_all(world, d)
        if ready < n:
            # Recurrent state is valid only whole at the end; a window needs its in-window pages, lent last.
            assert r.fetch.bound == (0 if hybrid else 4), (ready, r.fetch.bound)
        prev = ready
    assert sorted(seen["swa"]) == window and sorted(seen["full"]) == list(range(n // TPP))
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == n and locked(p) == 0
    for layer in group_layers(d.layout, "swa"):  # stale pages of the window were never written
        stale = np.asarray(r.dst["swa"])[1:(n - 64) // TPP]
        assert (slots(d.pools[layer])[stale] == SENTINEL).all()


def test_hybrid_ticket_lent_final_reads_in_one_go_like_before():
    world, p, d, conn = rig(hybrid=True)
    t = p.ticket(90, 1)
    r = d.fetch_ticket(t, seed=1)
    assert r.fetch.offer.final
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and locked(p) == 0
