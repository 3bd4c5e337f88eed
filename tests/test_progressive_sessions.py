"""Progressive lending (issue 17) end to end, sans-IO: a lease read while prefill still computes it.

A prefill lends a request's pages while its chunked prefill still runs
(``PrefillSession.lend(..., ready=)``) and grows the lease chunk by chunk
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
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvlend.core.layout import BufferDesc, HeadGeometry, LayerIdentity, LayerKind, MemoryRegion, Role
from kvlend.core.lease import LendOptions
from kvlend.core.pages import GroupPages
from kvlend.errors import KvlendError, LeaseExpired, LeaseUnknown, PeerLost, QuotaExceeded, TransferTimeout
from kvlend.protocol.config import NodeConfig, Quotas
from kvlend.protocol.decode import DecodeSession, FetchState
from kvlend.protocol.prefill import PrefillSession
from kvlend.protocol.wire import Extend, Offer
from kvlend.testing import (
    KIND,
    ContractError,
    DecodeEnd,
    Lent,
    Memory,
    MemoryBackend,
    PrefillEnd,
    World,
    connected,
    finish_all,
    rig as memory_rig,
)
from kvlend.testing.kvcache import SENTINEL, FreeList, group_layers, make_layout, make_pools, pattern, slots
from tests.support.profiles import examples

pytestmark = pytest.mark.unit

CFG = NodeConfig(ttl=5.0, heartbeat=1.0, handshake_timeout=3.0, transfer_timeout=20.0, cancel_grace=2.0,
                 chunk_pages=4)
TPP = 4
EPS_T = 0.01
STATE_LAYER = 4  # the hybrid layout's recurrent layer: one state row per request, group "ssm"
STATE_ROW = 64  # bytes


# ------------------------------------------------------------------ hybrid ends
def hybrid_pools_and_layout(pages: int):
    """The tests' layout (layers 0-1 "full", 2-3 "swa": 64-token window, 1 sink page) plus a recurrent
    layer 4 in group "ssm" whose state row lives in a pool of its own (named like the others)."""
    pools = make_pools(pages)
    base = make_layout(pools)
    state = np.zeros((pages, STATE_ROW), dtype=np.uint8)
    kind = base.regions[0].kind
    region = MemoryRegion(f"L{STATE_LAYER}.kv", kind, base.regions[0].device_id, state.nbytes, STATE_ROW, pages,
                          state.ctypes.data)
    buf = BufferDesc(f"L{STATE_LAYER}.K", region.name, 0, STATE_ROW,
                     LayerIdentity(STATE_LAYER, LayerKind.RECURRENT, Role.STATE), "ssm", HeadGeometry(4, 16))
    layout = dataclasses.replace(base, regions=base.regions + (region,), buffers=base.buffers + (buf,))
    return [*pools, state], layout


class HybridPrefill(PrefillEnd):
    """A prefill whose layout has a recurrent group: its table is one state slot per request."""

    def __init__(self, world, name, host, port, pages, config, offset, certified):
        super().__init__(world, name, host, port, pages, config, offset, certified)
        self.pools, self.layout = hybrid_pools_and_layout(pages)
        self.memory = Memory(self.pools)
        self.session = PrefillSession(self.layout, KIND, self.metadata, name=name, config=config)
        self.free = {g: FreeList(pages, world.np_rng) for g in self.layout.groups}

    def _tables(self, num_tokens: int, seed: int) -> dict:
        tables = {}
        n_pages = -(-num_tokens // TPP)
        for name, group in self.layout.groups.items():
            rows = group.pages_read(num_tokens, TPP)
            table = np.full(1 if group.recurrent else n_pages, -1, dtype=np.int64)
            table[rows] = self.free[name].alloc(rows.size)
            for layer in group_layers(self.layout, name):
                view = slots(self.pools[layer])
                view[table[rows]] = pattern(seed, layer, n_pages, view.shape[1])[rows]
            tables[name] = table
        return tables


class HybridDecode(DecodeEnd):
    def __init__(self, world, name, pages, config, certified):
        super().__init__(world, name, pages, config, certified)
        self.pools, self.layout = hybrid_pools_and_layout(pages)
        for pool in self.pools:
            slots(pool)[:] = SENTINEL
        self.memory = Memory(self.pools)
        self.session = DecodeSession(self.layout, KIND, name=name, config=config)
        self.backend = MemoryBackend(world, self)
        self.free = {g: FreeList(pages, world.np_rng) for g in self.layout.groups}

    def alloc(self, num_tokens: int, resume_from: int = 0, seed: int | None = None) -> dict:
        n_pages = -(-num_tokens // TPP)
        dst = {}
        for name, group in self.layout.groups.items():
            table = dst[name] = self.free[name].alloc(1 if group.recurrent else n_pages)
            kept = np.zeros(0, dtype=np.int64) if group.recurrent else self.kept_pages(resume_from)
            for layer in group_layers(self.layout, name):
                view = slots(self.pools[layer])
                view[table] = SENTINEL
                if kept.size:
                    view[table[kept]] = pattern(seed, layer, n_pages, view.shape[1])[kept]
        return dst

    def expected(self, record, layer: int, n_pages: int) -> np.ndarray:
        if layer != STATE_LAYER:
            return super().expected(record, layer, n_pages)
        return pattern(record.seed, layer, n_pages, STATE_ROW)[:1]


def add_prefill(world: World, name: str = "prefill", *, port: int = 7000, config: NodeConfig = CFG,
                hybrid: bool = False):
    if not hybrid:
        return world.add_prefill(name, port=port, config=config)
    p = HybridPrefill(world, name, "10.0.0.1", port, 256, config, 0.0, True)
    world.prefills.append(p)
    world.by_metadata[p.metadata] = p
    return p


def add_decode(world: World, name: str = "decode", *, config: NodeConfig = CFG, hybrid: bool = False):
    if not hybrid:
        return world.add_decode(name, config=config)
    d = HybridDecode(world, name, 256, config, True)
    world.decodes.append(d)
    return d


def add_hybrid(world: World, *, config: NodeConfig = CFG):
    return add_prefill(world, config=config, hybrid=True), add_decode(world, config=config, hybrid=True)


# ------------------------------------------------------------------ helpers
def rig(config: NodeConfig = CFG, *, seed: int = 0, hybrid: bool = False, **world_kw):
    """``kvlend.testing.rig``, or the same with a hybrid model's ends (``hybrid``)."""
    if not hybrid:
        return memory_rig(config, seed=seed, **world_kw)
    world = World(seed, **world_kw)
    p, d = add_hybrid(world, config=config)
    return world, p, d, connected(world, p, d)


def locked(prefill) -> int:
    return prefill.lender.locks.locked_pages()


def complete(ready: int, n: int) -> int:
    """Token pages wholly committed at ``ready`` tokens of ``n`` (all of them once final)."""
    return -(-n // TPP) if ready >= n else ready // TPP


def posted_pages(d, record, reads) -> dict[str, list[int]]:
    """Per local group, the token pages of ``record``'s destination that ``reads`` write."""
    inverse = {}
    for name, table in record.dst.items():
        for layer in group_layers(d.layout, name):
            for page, slot in enumerate(np.asarray(table).tolist()):
                inverse[(layer, slot)] = (name, page)
    out: dict[str, set] = {name: set() for name in record.dst}
    for read in reads:
        for _, _, laddr, length in read.copies:
            layer, off = d.memory.locate(laddr, length)
            stride = slots(d.pools[layer]).shape[1]
            for slot in range(off // stride, (off + length - 1) // stride + 1):
                name, page = inverse[(layer, slot)]
                out[name].add(page)
    return {name: sorted(v) for name, v in out.items()}


def new_reads(d, before: set) -> list:
    return [read for tag, read in d.backend.reads.items() if tag not in before]


def push_progressive(p, peer: str, n: int, seed: int, ready: int):
    """A progressive lease pushed to ``peer`` (``PrefillSession.offer(..., ready=)``)."""
    return p.offer(peer, n, seed, ready=ready)


def inject(world, p, d, conn, message) -> None:
    """A buggy prefill sends ``message`` on the decode's link ``conn``."""
    wire = world.wire(d, conn)
    p.session._peers[wire.pconn].conn.send(message)
    world.pump()


def both_groups(pages: list[int]) -> dict[str, list[int]]:
    return {"full": pages, "swa": pages}


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
    # Every read landed and the lease is final: Done went out, held on the wire with the ack behind it.
    assert r.fetch.state is FetchState.ACKING and not p.ended and wire.to_prefill
    wire.hold_to_prefill = False
    world.pump()
    assert r.fetch.state is FetchState.DONE and r.fetch.bound == n  # the transport verified the bytes
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


# ------------------------------------------------------------------ stateful
SCFG = NodeConfig(ttl=4.0, heartbeat=1.0, handshake_timeout=3.0, transfer_timeout=12.0, cancel_grace=3.0,
                  chunk_pages=4)
_ACTIVE = (FetchState.READING, FetchState.ACKING, FetchState.CANCELLING)


class Progressive(RuleBasedStateMachine):
    """Random interleavings of extensions, read completions in any order, heartbeats and clock steps."""

    @initialize(seed=st.integers(0, 2**16), shuffle=st.booleans(), fragment=st.booleans(), hybrid=st.booleans(),
                eager=st.sampled_from(["hold", "hold", "mixed"]))
    def setup(self, seed, shuffle, fragment, hybrid, eager):
        self.world = World(seed, shuffle=shuffle, fragment=fragment)
        rng = self.world.rng
        if eager == "mixed":  # a backend that completes some reads inside post
            self.world.post_policy = lambda b, r: b.finish(r.tag) if rng.random() < 0.5 else None
        if hybrid:
            self.p, self.d = add_hybrid(self.world, config=SCFG)
        else:
            self.p = self.world.add_prefill(config=SCFG)
            self.d = self.world.add_decode(config=SCFG)
        self.world.connect(self.d, self.p)
        self.seed = 0
        self.growing: list = []  # (lease id, num_tokens) still being extended
        self.ahead: list = []  # (ticket, seed) claimed ahead
        self.clean = True  # no fault, no clock step that could outlast a deadline: every fetch must end DONE
        self.elapsed = 0.0

    def _room(self, n: int) -> bool:
        need = 2 * -(-n // TPP)
        return all(len(f) >= need for f in self.p.free.values()) and all(len(f) >= need for f in self.d.free.values())

    def _new_seed(self) -> int:
        self.seed += 1
        return self.seed

    @rule(n=st.integers(1, 90), first=st.integers(0, 100), ahead=st.booleans())
    def lend_ticket(self, n, first, ahead):
        if not self._room(n) or not self.p.alive:
            return
        ready = min(n, first * n // 100)
        seed = self._new_seed()
        t = self.p.ticket(n, seed, ready=ready)
        if ready < n:
            self.growing.append((t.lease, n))
        if ahead:
            self.d.claim(t)
            self.ahead.append((t, seed))
        else:
            self.d.fetch_ticket(t, seed=seed)

    @rule(n=st.integers(1, 90), first=st.integers(0, 100))
    def push(self, n, first):
        if not self._room(n) or self.d.name not in self.p.session.peers:
            return
        ready = min(n, first * n // 100)
        lease = push_progressive(self.p, self.d.name, n, self._new_seed(), ready)
        if ready < n:
            self.growing.append((lease.id, n))

    @rule(k=st.integers(0, 7))
    def start_fetch(self, k):
        """The engine starts a fetch of a pushed offer or of a ticket claimed ahead."""
        d = self.d
        if d.offers and k % 2:
            conn, offer = d.offers.pop(k % len(d.offers))
            if d.session.ready(conn):
                d.fetch_offer(conn, offer)
        elif self.ahead:
            t, seed = self.ahead.pop(k % len(self.ahead))
            d.fetch_ticket(t, seed=seed)

    @rule(k=st.integers(0, 15), step=st.integers(1, 40), final=st.integers(0, 3))
    def extend(self, k, step, final):
        if not self.growing:
            return
        lease_id, n = self.growing[k % len(self.growing)]
        try:
            lease = self.p.lender.get(lease_id, self.p.now)
        except KvlendError:
            self.growing.remove((lease_id, n))
            return
        ready = n if final == 0 else min(n, lease.ready + step)
        try:
            grown = self.p.extend(lease_id, ready, meta={"chunk": ready} if step % 3 == 0 else None)
        except KvlendError as exc:  # ended meanwhile (expired, aborted by its reader)
            event(f"extend refused: {type(exc).__name__}")
            self.growing.remove((lease_id, n))
            return
        if grown.final:
            self.growing.remove((lease_id, n))
            event("lease extended to final")

    @rule(picks=st.lists(st.tuples(st.integers(0, 63), st.sampled_from(["ok"] * 8 + ["error", "late", "land"])),
                         min_size=1, max_size=8))
    def end_reads(self, picks):
        backend = self.d.backend
        for k, how in picks:
            reads = backend.in_flight()
            if not reads:
                break
            read = reads[k % len(reads)]
            if how == "ok":
                backend.finish(read.tag)
            elif how == "error":
                self.clean = False
                backend.fail(read.tag)
            elif how == "late":
                self.clean = False
                backend.late(read.tag)
            else:
                backend.land(read.tag)
            if k % 2:
                self.world.pump()
        self.world.pump()

    @rule()
    def tick(self):
        self.world.tick()

    @rule(dt=st.floats(0.05, 2.0))
    def advance(self, dt):
        self.elapsed += dt
        if self.elapsed > SCFG.transfer_timeout / 2:
            self.clean = False
        self.world.advance(dt)

    @rule(k=st.integers(0, 3))
    def toggle_hold(self, k):
        """Hold (or let through) one direction of the link: claims, heartbeats, dones or offers, extensions."""
        wires = [w for w in self.world.wires if w.open]
        if not wires:
            return
        wire = wires[0]
        self.clean = False  # a held claim or heartbeat may let a lease expire
        if k % 2:
            wire.hold_to_prefill = not wire.hold_to_prefill
        else:
            wire.hold_to_decode = not wire.hold_to_decode
        self.world.pump()

    @rule(really=st.integers(0, 5))
    def cut(self, really):
        wires = [w for w in self.world.wires if w.open]
        if wires and really == 0:
            self.clean = False
            self.world.cut(wires[0])
            self.world.connect(self.d, self.p)

    @rule(k=st.integers(0, 15), really=st.integers(0, 3))
    def cancel(self, k, really):
        running = self.d.running()
        if running and really == 0:
            self.clean = False
            self.d.cancel(running[k % len(running)])

    @rule()
    def collect(self):
        for record in list(self.d.records.values()):
            if record.finished:
                self.d.session.forget(record.fetch.id)
                self.d.release_dst(record)
                del self.d.records[record.fetch.id]

    @invariant()
    def locks_match_live_leases(self):
        self.world.check_locks()

    @invariant()
    def each_page_is_read_once(self):
        """A grown lease's reader posts only what it has not read yet: no destination page is read twice."""
        d = self.d
        for record in d.records.values():
            seen: dict[str, set] = {}
            for tag in sorted(record.tags):
                for name, pages in posted_pages(d, record, [d.backend.reads[tag]]).items():
                    again = seen.setdefault(name, set()).intersection(pages)
                    assert not again, f"fetch {record.fetch.id} reads {name} pages {sorted(again)} twice"
                    seen[name].update(pages)

    @invariant()
    def bookkeeping_agrees(self):
        d, s = self.d, self.d.session
        running = d.running()
        assert s.in_flight == len(running)
        assert s.tracker.stats.requests == sum(r.fetch.state in _ACTIVE for r in d.records.values())
        for record in d.records.values():
            f = record.fetch
            assert f.tags == {t for t in record.tags if not d.backend.reads[t].reported}
            if f.state is FetchState.ACKING:
                assert f.offer.final  # Done only once final
            if f.offer is not None and not f.done:  # never ahead of what the prefill lent
                try:
                    lease = self.p.lender.get(f.lease, self.p.now)
                except KvlendError:
                    continue
                assert f.offer.ready <= lease.ready

    def teardown(self):
        if not hasattr(self, "world"):
            return
        world, d, p = self.world, self.d, self.p
        for wire in world.wires:
            wire.hold_to_prefill = wire.hold_to_decode = False
        world.pump()
        for t, _seed in self.ahead:
            d.unclaim(t)
        for conn, offer in d.offers:
            if d.session.ready(conn):
                d.session.decline(conn, offer, "teardown")
        d.offers.clear()
        # Prefill finishes every prompt; the decode's reads all land.
        for lease_id, n in list(self.growing):
            try:
                p.extend(lease_id, n)
            except KvlendError:
                pass
        for _ in range(20):
            if not finish_all(world, d):
                break
        world.pump()
        if self.clean:
            stuck = [(r.fetch.id, r.fetch.state.value, r.fetch.error) for r in d.records.values()
                     if r.fetch.state is not FetchState.DONE]
            if stuck:
                raise ContractError(f"with no fault every fetch must end done: {stuck}")
            event("clean run: every fetch done")
        world.settle()
        if d.running() or d.backend.in_flight():
            raise ContractError(f"fetches still running past their deadline: {[r.fetch.id for r in d.running()]}")
        world.advance(SCFG.ttl + 2 * SCFG.heartbeat)
        world.check_locks()
        if p.lender.active_leases:
            raise ContractError(f"prefill still holds {p.lender.active_leases} leases with nothing reading them")


Progressive.TestCase.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_progressive_stateful = Progressive.TestCase


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
