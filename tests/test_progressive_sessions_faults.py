"""Progressive lending (issue 17), sans-IO, when things go wrong: faults mid-stream and the short ttl.

A prefill lost mid-stream fails the fetch at the delivered prefix and a resume from another reads only
the rest; a lost link's refetch hears later extensions on the new link; the engine releasing a lease
mid-stream voids what was read; a quota or deadline hit mid-stream; malformed extensions and offers
naming uncomputed pages are refused; a progressive lease's short ttl (``progressive_ttl``) is kept by its
reader's heartbeats and ends within that ttl under a reader that ignores the end.  The rest of issue 17's
tests: ``test_progressive_sessions.py``.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from kvlend.core.pages import GroupPages
from kvlend.errors import LeaseExpired, LeaseUnknown, PeerLost, QuotaExceeded, TransferTimeout
from kvlend.protocol.config import Quotas
from kvlend.protocol.decode import FetchState
from kvlend.protocol.wire import Extend, Offer
from kvlend.testing import ContractError, World, finish_all
from tests.support.progressive import (
    CFG,
    EPS_T,
    TPP,
    add_decode,
    add_prefill,
    both_groups,
    complete,
    inject,
    locked,
    new_reads,
    posted_pages,
    rig,
)

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------- faults
@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("second_ready", [None, 10, 30])
def test_prefill_lost_mid_stream_fails_at_the_delivered_prefix_and_a_resume_reads_only_the_rest(
        second_ready, hybrid):
    world = World(5)
    p1 = add_prefill(world, "p1", port=7001, hybrid=hybrid)
    p2 = add_prefill(world, "p2", port=7002, hybrid=hybrid)
    d = add_decode(world, hybrid=hybrid)
    n, seed = 60, 11
    bound = 0 if hybrid else 20  # recurrent state is valid only whole at the end: no prefix counts before it
    t = p1.ticket(n, seed, ready=0)
    r = d.fetch_ticket(t, seed=seed)
    for ready in (10, 23):
        p1.extend(t, ready)
        finish_all(world, d)
    p1.extend(t, 37)  # its reads are in flight when the prefill dies
    assert d.backend.in_flight() and r.fetch.bound == bound
    world.kill_prefill(p1)
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, PeerLost) and r.fetch.quiet
    assert r.fetch.bound == r.fetch.error.bound == bound
    # Another prefill recomputes the request (same bytes) and lends it, progressively or not.
    t2 = p2.ticket(n, seed, ready=second_ready)
    again = d.fetch_ticket(t2, dst=r.dst, resume_from=r.fetch.bound, seed=seed)
    assert again.fetch.bound == bound
    posted: dict[str, set] = {name: set() for name in again.dst}
    for ready in [None] + [s for s in (45, n) if second_ready is not None and s > second_ready]:
        if ready is not None:
            p2.extend(t2, ready)
        for name, pages in posted_pages(d, again, d.backend.in_flight()).items():
            posted[name].update(pages)
        finish_all(world, d)
    rest = set(range(bound // TPP, 15))
    assert posted == {"full": rest, "swa": rest, **({"ssm": {0}} if hybrid else {})}  # the rest, only the rest
    assert again.fetch.state is FetchState.DONE and again.fetch.bound == n  # verified, prefix included
    assert locked(p2) == 0


def test_link_lost_mid_stream_the_refetch_resumes_and_hears_the_later_extensions_on_the_new_link():
    world, p, d, conn = rig()
    n, seed = 60, 12
    t = p.ticket(n, seed, ready=10)
    r = d.fetch_ticket(t, seed=seed)
    p.extend(t, 23)
    finish_all(world, d)
    world.cut(world.wire(d, conn))
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, PeerLost) and r.fetch.bound == 20
    p.extend(t, 37)  # its reader is gone: nobody to tell, the lease stays until it expires
    again = d.fetch_ticket(t, dst=r.dst, resume_from=r.fetch.bound, seed=seed)  # a new link, the same lease
    assert again.fetch.link != conn and again.fetch.offer.ready == 37
    assert posted_pages(d, again, d.backend.in_flight()) == both_groups([5, 6, 7, 8])
    before = set(d.backend.reads)
    p.extend(t, n)  # told on the new link
    assert posted_pages(d, again, new_reads(d, before)) == both_groups(list(range(9, 15)))
    finish_all(world, d)
    assert again.fetch.state is FetchState.DONE and p.ended == [(t.lease, "done")] and locked(p) == 0


def test_the_prefill_engine_releasing_a_lease_mid_stream_voids_what_was_read():
    """The request is cancelled while prefill still computes: its pages are reused at once (scribbled),
    the reader hears it, nothing it read counts, and later extensions are refused to the engine."""
    world, p, d, conn = rig()
    t = p.ticket(60, 3, ready=10)
    r = d.fetch_ticket(t, seed=3)
    p.extend(t, 23)
    finish_all(world, d)
    assert r.fetch.bound == 20
    p.extend(t, 37)  # in flight when the engine releases
    p.session.release(t.lease)
    world.pump()
    assert r.fetch.state is FetchState.CANCELLING and r.fetch.bound == 0
    for read in d.backend.in_flight():
        d.backend.late(read.tag)  # lands the reused pages' bytes: they must not count
    world.pump()
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, LeaseUnknown)
    assert r.fetch.bound == r.fetch.error.bound == 0
    assert locked(p) == 0
    with pytest.raises(LeaseUnknown):
        p.extend(t, 60)


def test_an_extension_over_the_peers_page_quota_changes_nothing():
    config = dataclasses.replace(CFG, quotas=Quotas(max_locked_pages_per_peer=20))
    world, p, d, conn = rig(config)
    t = p.ticket(60, 3, ready=10)
    r = d.fetch_ticket(t, seed=3)
    p.extend(t, 37)  # 9 + 9 rows
    finish_all(world, d)
    held, sent = locked(p), len(d.backend.reads)
    with pytest.raises(QuotaExceeded):
        p.extend(t, 60)  # 15 + 15 rows: over 20
    world.pump()
    assert locked(p) == held and len(d.backend.reads) == sent and r.fetch.offer.ready == 37
    assert p.lender.get(t.lease, p.now).ready == 37
    world.check_locks()
    assert r.fetch.state is FetchState.READING and conn in d.session.links


@pytest.mark.parametrize("silent", [False, True])
def test_decode_lost_mid_stream_the_locks_of_every_extension_drop_at_expiry(silent):
    world, p, d, conn = rig()
    t = p.ticket(60, 3, ready=10)
    d.fetch_ticket(t, seed=3)
    p.extend(t, 23)
    world.kill_decode(d, silent=silent)
    p.extend(t, 37)  # the engine keeps computing: the lease is still live
    lease = p.extend(t, 50)
    assert lease.ready == 50 and locked(p) > 0
    world.check_locks()
    world.advance(CFG.ttl - 1)
    assert locked(p) > 0
    world.advance(2)
    assert locked(p) == 0 and p.lender.active_leases == 0 and p.ended == [(t.lease, "expired")]
    world.check_locks()
    with pytest.raises((LeaseExpired, LeaseUnknown)):
        p.extend(t, 60)


@pytest.mark.parametrize("in_flight", [False, True])
def test_the_fetch_deadline_passing_while_waiting_for_extensions_is_a_timeout(in_flight):
    world, p, d, conn = rig()
    t = p.ticket(60, 3, ready=10)
    r = d.fetch_ticket(t, seed=3)
    finish_all(world, d)
    if in_flight:
        p.extend(t, 23)  # its reads never finish
    world.advance(CFG.transfer_timeout - 1)  # heartbeats flow: the lease stays alive, the fetch waits
    assert r.fetch.state is FetchState.READING and locked(p) > 0
    world.advance(1 + EPS_T)
    if in_flight:
        assert r.fetch.state is FetchState.CANCELLING and all(read.cancelled for read in d.backend.in_flight())
        for read in d.backend.in_flight():
            d.backend.fail(read.tag)
        world.pump()
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, TransferTimeout)
    assert r.fetch.bound == r.fetch.error.bound == 8
    assert p.ended == [(t.lease, "aborted")] and locked(p) == 0
    with pytest.raises(LeaseUnknown):
        p.extend(t, 37)  # the engine hears its reader gave up


BAD = ["stale ready", "backwards", "past the end", "unknown group", "repeated row", "row twice"]


def _bad_extend(kind: str, lease, ready: int, n: int, slot: int) -> Extend:
    if kind == "stale ready":
        return Extend(lease, ready, {})
    if kind == "backwards":
        return Extend(lease, ready - 1, {})
    if kind == "past the end":
        return Extend(lease, n + 1, {})
    if kind == "unknown group":
        return Extend(lease, ready + 8, {"nope": GroupPages(np.array([ready // TPP]), np.array([slot]))})
    if kind == "repeated row":  # page 1 was lent already
        return Extend(lease, ready + 8, {"full": GroupPages(np.array([1]), np.array([slot]))})
    # one row given twice in the same message (no honest GroupPages holds that: the decode's parser checks)
    page = ready // TPP
    return Extend(lease, ready + 8, {"full": GroupPages._checked(np.array([page, page]), np.array([slot, slot]))})


@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("where", ["reading", "offered"])
def test_a_malformed_extend_fails_the_link_and_never_corrupts_pages(kind, where):
    world, p, d, conn = rig()
    n, seed = 40, 6
    t = p.ticket(n, seed, ready=12)
    if where == "reading":
        r = d.fetch_ticket(t, seed=seed)
        finish_all(world, d)
        assert r.fetch.bound == 12
    else:
        d.claim(t)
        assert t.lease in d.session._links[conn].offers
    lease = p.lender.get(t.lease, p.now)
    slot = int(p.lent[t.lease].tables["full"][0])
    writes = len(d.backend.writes)
    inject(world, p, d, conn, _bad_extend(kind, t.lease, lease.ready, n, slot))
    assert conn not in d.session.links
    error = d.session.link_error(conn)
    assert isinstance(error, PeerLost) and ("extend" in str(error).lower() or "rows" in str(error)), error
    assert len(d.backend.writes) == writes and not d.backend.in_flight()
    if where == "reading":
        assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, PeerLost)
        assert r.fetch.bound == 12  # what landed before stays verified (the transport checks it)
    else:
        r = d.fetch_ticket(t, seed=seed)  # a new link: the claim is answered with the lease as it is
        p.extend(t, n)
        finish_all(world, d)
        assert r.fetch.state is FetchState.DONE
    world.advance(CFG.ttl + 1)
    assert locked(p) == 0
    world.check_locks()


def test_an_extend_after_the_lease_was_final_fails_the_link():
    world, p, d, conn = rig()
    t = p.ticket(20, 6, ready=8)
    r = d.fetch_ticket(t, seed=6)
    p.extend(t, 20)
    wire = world.wire(d, conn)
    wire.hold_to_prefill = True  # the Done waits: the fetch stays ACKING
    world.advance(CFG.ttl - CFG.heartbeat + EPS_T)  # its reads land after the window: the ack is awaited
    finish_all(world, d)
    assert r.fetch.state is FetchState.ACKING
    inject(world, p, d, conn, Extend(t.lease, 20, {}))
    assert conn not in d.session.links and "final" in str(d.session.link_error(conn))
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, PeerLost)


def test_an_extend_naming_pages_past_its_ready_is_refused():
    """A buggy prefill names a page its ``ready`` does not cover (not computed yet): reading it would count
    bytes that are not there for the bound.  The decode must refuse such an extension like a repeated row."""
    world, p, d, conn = rig()
    t = p.ticket(40, 6, ready=8)
    r = d.fetch_ticket(t, seed=6)
    finish_all(world, d)
    table = p.lent[t.lease].tables
    p._compute(table, 40, 13, 6)  # prefill committed 13 tokens: page 2 is complete
    rows = np.array([2, 3, 4])  # pages 3 and 4 hold tokens 12..19: not below ready 13
    bad = {g: GroupPages(rows, np.asarray(table[g])[rows]) for g in ("full", "swa")}
    try:
        inject(world, p, d, conn, Extend(t.lease, 13, bad))
        finish_all(world, d)
    except ContractError as exc:  # the bound named uncomputed bytes
        pytest.fail(f"the decode read pages past the extension's ready and counted them: {exc}")
    assert conn not in d.session.links, "the decode posted reads of pages its prefill had not committed"
    assert r.fetch.bound == 8


def test_an_offer_naming_pages_past_its_ready_is_refused():
    """The same for the offer that starts a progressive lease."""
    world, p, d, conn = rig()
    lease = p.lend(40, 6, peer="decode", ready=8)
    table = p.lent[lease.id].tables
    rows = np.arange(5)
    offer = dataclasses.replace(p.session._offer_of(lease), pages={
        g: GroupPages(rows, np.asarray(table[g])[rows]) for g in ("full", "swa")})
    inject(world, p, d, conn, Offer(offer))
    if conn in d.session.links and d.offers:
        c, got = d.offers[0]
        world.tick()
        try:
            r = d.fetch_offer(c, got)
            finish_all(world, d)
        except ContractError as exc:
            pytest.fail(f"the decode read pages past the offer's ready and counted them: {exc}")
        assert r.fetch.bound <= 8, "the bound counts pages its prefill had not committed"


# ------------------------------------------------- a short ttl against a reader that ignores the end
SHORT = dataclasses.replace(CFG, progressive_ttl=1.0)  # the decode's heartbeat (1 s) is no shorter


def test_a_progressive_lease_has_its_short_ttl_and_the_decode_heartbeats_it_at_its_pace():
    """Lent with ``ready``, a lease lives ``progressive_ttl`` from its claim, a ticket's waits ``ttl`` for it;
    a reader whose own heartbeat is as long as that ttl still keeps it alive, counting its reads all along."""
    world, p, d, conn = rig(SHORT)
    t = p.ticket(60, 3, ready=10)
    assert p.lender.get(t.lease, p.now).expires_at == p.now + SHORT.ttl  # unclaimed: waits for its reader
    world.advance(2.0)  # past a progressive ttl, unclaimed
    r = d.fetch_ticket(t, seed=3)
    lease = p.lender.get(t.lease, p.now)
    assert lease.ttl == r.fetch.offer.ttl == SHORT.progressive_ttl and lease.expires_at == p.now + 1.0
    assert d.session._links[conn].beat == SHORT.beat_for(1.0) == 0.25
    finish_all(world, d)
    for ready in (23, 37):
        world.advance(3.0)  # three of its ttls
        p.extend(t, ready)  # live: the extension is lent (an expired lease would raise)
        finish_all(world, d)
        assert r.fetch.state is FetchState.READING and r.fetch.bound == complete(ready, 60) * TPP
        assert r.fetch.sure_until > world.now  # the heartbeats' answers keep its reads counting
    assert p.lender.get(p.ticket(8, 5).lease, p.now).ttl == SHORT.ttl  # a lease lent whole keeps ttl


def test_a_reader_ignoring_the_end_of_a_short_lease_loses_it_within_its_ttl_and_counts_no_later_read(caplog):
    """The engine ends a progressive lease under a reader that never answers (vLLM's preemption): the pages
    are the engine's again at most ``progressive_ttl`` later and the reader is dropped; what it reads from
    then on (the engine's new bytes) never enters its bound."""
    world, p, d, conn = rig(SHORT)
    t = p.ticket(60, 3, ready=10)
    r = d.fetch_ticket(t, seed=3)
    finish_all(world, d)
    world.advance(2.0)
    p.extend(t, 37)  # these reads are in flight when the engine takes the pages back
    assert d.backend.in_flight()
    wire = world.wire(d, conn)
    wire.hold_to_decode = True  # the reader hears nothing more: not the Abort, not a renewal
    released = p.now
    p.session.release(t.lease)
    world.pump()
    assert not p.ended and locked(p) > 0  # held for its reader
    caplog.set_level(logging.WARNING, logger="kvlend.session")
    world.advance(SHORT.progressive_ttl, step=0.05)
    assert p.ended == [(t.lease, "released")] and locked(p) == 0  # the pages went (and were scribbled)
    assert p.now - released <= SHORT.progressive_ttl + 0.05
    assert not wire.prefill_open and p.session.peers == []  # dropped
    assert any("never said it was quiet" in rec.getMessage() for rec in caplog.records)
    assert r.fetch.sure_until < world.now
    for read in d.backend.in_flight():
        d.backend.late(read.tag)  # lands the reused pages' bytes
    world.pump()  # the transport checks that the bound names only the lent bytes
    assert r.fetch.bound == complete(10, 60) * TPP  # what landed before the release, nothing after
    wire.hold_to_decode = False
    world.pump()
    assert r.fetch.state is FetchState.FAILED and r.fetch.error.bound <= complete(10, 60) * TPP
