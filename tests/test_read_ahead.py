"""Reads that start with the claim: a small lease's ticket carries its page table (sans-IO, in memory).

The decode posts the reads when it sends the claim; they count for the bound only once the claim's
answer confirms the lease and the very pages the ticket named.  ``kvlend.testing.World`` checks on
every step that a bound never names bytes that are not there and nothing lands in a finished fetch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvlend.core.pages import GroupPages
from kvlend.errors import LeaseUnknown, ProtocolError
from kvlend.protocol.config import NodeConfig
from kvlend.protocol.decode import FetchState
from kvlend.protocol.ticket import MAX_TICKET_ROWS, Ticket
from kvlend.testing import World, finish_all, rig
from tests.support.profiles import examples

pytestmark = pytest.mark.unit

CFG = NodeConfig(ttl=5.0, heartbeat=1.0, handshake_timeout=3.0, transfer_timeout=20.0, cancel_grace=2.0,
                 chunk_pages=4, read_ahead=True)


def test_a_small_final_lease_s_ticket_carries_its_pages_and_a_large_one_does_not():
    world, p, d, conn = rig(CFG)
    small = p.ticket(40, seed=1)
    assert small.pages is not None and {g: len(gp) for g, gp in small.pages.items()} == \
        {g: len(gp) for g, gp in p.lent[small.lease].lease.pages.items()}
    assert Ticket.from_text(small.to_text()).pages.keys() == small.pages.keys()
    tpp = p.layout.tokens_per_page
    large = p.ticket(tpp * (MAX_TICKET_ROWS + 1), seed=2)
    assert large.pages is None  # the claim's answer brings them
    progressive = p.ticket(40, seed=3, ready=16)
    assert progressive.pages is None  # not final: its pages come with the offer and its extensions


def test_reads_start_with_the_claim_and_count_only_once_it_is_answered():
    world, p, d, conn = rig(CFG)
    ticket = p.ticket(40, seed=4)
    wire = world.wire(d, conn)
    wire.hold_to_prefill = True  # the claim waits on the wire: no answer can come yet
    r = d.fetch_ticket(ticket, seed=4)
    assert r.fetch.state is FetchState.READING and not r.fetch.confirmed
    assert d.backend.in_flight(), "the reads were not posted with the claim"
    for read in d.backend.in_flight():
        d.backend.finish(read.tag)
    world.pump()
    assert r.fetch.bound == 0  # landed, but nothing counts before the lease is confirmed
    wire.hold_to_prefill = False
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == 40 and r.fetch.confirmed
    assert r.fetch.request == "req-4"  # known from the claim's answer
    d.check_done(r)
    assert p.lender.locks.locked_pages() == 0


def test_a_refused_claim_voids_what_was_read_ahead():
    world, p, d, conn = rig(CFG)
    ticket = p.ticket(40, seed=5)
    p.session.release(ticket.lease)  # the engine cancelled it: the claim will be refused
    world.pump()
    r = d.fetch_ticket(ticket, seed=5)
    finish_all(world, d)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LeaseUnknown)
    assert r.fetch.bound == 0 and r.fetch.quiet
    assert d.offers == []  # a late answer is never taken for a pushed offer
    assert d.session._links[conn].abandoned == set()  # the refusal was the answer: nothing is waited for


def test_a_fetch_timing_out_while_its_landed_reads_wait_for_the_answer_never_takes_it_for_an_offer():
    world, p, d, conn = rig(CFG)
    ticket = p.ticket(8, seed=9)
    wire = world.wire(d, conn)
    wire.hold_to_prefill = True  # the claim, and then the abort, wait on the wire
    r = d.fetch_ticket(ticket, seed=9)
    finish_all(world, d)  # every read lands: nothing goes until the claim's answer says whether they count
    assert r.fetch.state is FetchState.READING and not r.fetch.confirmed and r.fetch.landed is not None
    assert r.fetch.bound == 0
    world.advance(CFG.transfer_timeout + 1)
    assert r.fetch.state is FetchState.FAILED and r.fetch.bound == 0
    wire.hold_to_prefill = False
    world.pump()  # the claim is answered, then the abort: neither looks like a pushed offer
    assert d.offers == [] and d.session._links[conn].offers == {}
    assert p.lender.active_leases == 0


def test_a_ticket_naming_other_pages_than_the_lease_fails_and_counts_nothing():
    world, p, d, conn = rig(CFG)
    ticket = p.ticket(40, seed=6)
    group, gp = next(iter(ticket.pages.items()))
    forged = dataclasses.replace(ticket, pages={**ticket.pages, group: GroupPages(gp.token_pages, gp.ordinals[::-1])})
    r = d.fetch_ticket(forged, seed=6)
    finish_all(world, d)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, ProtocolError)
    assert "other pages than its ticket" in str(r.fetch.error) and r.fetch.bound == 0
    assert p.lender.active_leases == 0  # the decode aborted it once its reads were quiet


def test_without_a_link_the_claim_waits_for_the_handshake_and_reads_go_with_it():
    world = World(7)
    p = world.add_prefill(config=CFG)
    d = world.add_decode(config=CFG)
    ticket = p.ticket(24, seed=7)
    r = d.fetch_ticket(ticket, seed=7)  # connects on first use; the claim (and its reads) wait for the handshake
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == 24 and r.fetch.confirmed
    d.check_done(r)


def test_without_read_ahead_the_reads_wait_for_the_claim_s_answer():
    world = World(8)
    p = world.add_prefill(config=CFG)
    d = world.add_decode(config=dataclasses.replace(CFG, read_ahead=False))
    conn = world.connect(d, p)
    ticket = p.ticket(40, seed=8)
    world.wire(d, conn).hold_to_prefill = True
    r = d.fetch_ticket(ticket, seed=8)
    assert r.fetch.state is FetchState.CLAIMING and not d.backend.in_flight()
    world.wire(d, conn).hold_to_prefill = False
    world.pump()  # the claim goes, its answer comes back: only now are the reads posted
    assert r.fetch.state is FetchState.READING and d.backend.in_flight()
    finish_all(world, d)
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == 40


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.tuples(st.integers(1, 120), st.booleans()), min_size=1, max_size=8), st.integers(0, 10**6))
def test_many_tickets_read_ahead_in_any_completion_order(specs, seed):
    world = World(seed, shuffle=True, fragment=True)
    p = world.add_prefill(config=CFG)
    d = world.add_decode(config=CFG)
    world.connect(d, p)
    records = []
    for i, (n, released) in enumerate(specs):
        ticket = p.ticket(n, seed=i)
        if released:
            p.session.release(ticket.lease)
            world.pump()
        records.append((d.fetch_ticket(ticket, seed=i), released))
    finish_all(world, d)
    for r, released in records:
        assert r.fetch.done and r.fetch.quiet
        if released:
            assert r.fetch.state is FetchState.FAILED and r.fetch.bound == 0
        else:
            assert r.fetch.state is FetchState.DONE, r.fetch.error
            d.check_done(r)
    assert p.lender.active_leases == 0 and d.offers == []
    world.check_locks()


def test_ticket_pages_are_checked_when_decoded():
    lease = bytes(16)
    good = Ticket(lease, "h", 1, "p", 40, "x" * 64, pages={"full": GroupPages(np.arange(3), np.array([7, 8, 9]))})
    back = Ticket.decode(good.encode())
    assert back == good and np.array_equal(back.pages["full"].ordinals, [7, 8, 9])
    with pytest.raises(ProtocolError, match="rows at most"):
        Ticket(lease, "h", 1, "p", 40, "x" * 64,
               pages={"full": GroupPages(np.arange(MAX_TICKET_ROWS + 1), np.arange(MAX_TICKET_ROWS + 1))})
    with pytest.raises(ProtocolError, match="below 2"):
        Ticket(lease, "h", 1, "p", 40, "x" * 64, pages={"full": GroupPages(np.array([0]), np.array([1 << 31]))})
    bad = good.encode().replace(np.array([7], "<i4").tobytes(), np.array([-7], "<i4").tobytes())
    with pytest.raises(ProtocolError, match="pages"):
        Ticket.decode(bad)
    assert good.with_pages({"full": GroupPages(np.arange(500), np.arange(500))}).pages is good.pages
