"""An in-memory world for the sans-IO sessions: a byte network, a transfer backend and a fake clock.

Tests only.  Nothing here decides anything for the sessions; it executes
their actions the way ``kvlend.runtime.shell.Shell._perform`` does, and
checks, on every step, the contract both sides rely on:

- **Network** (``World``): each ``Connect`` of a ``DecodeSession`` becomes a
  ``Wire`` to the ``PrefillSession`` listening at that endpoint
  (``accept`` + ``connected``, then ``authenticated`` on both sides with the
  other's name, as the shell does once TLS verified both certificates; an end
  added with ``certified=False`` holds a certificate of another CA, so both
  sides see ``closed(..., refused=True)`` instead); ``Send`` queues bytes on the wire, in order
  (optionally split into fragments, and, across *different* wires only,
  delivered in a random order); ``Close`` queues an end-of-stream after the
  bytes sent before it, which the other side sees as ``closed``.  A wire can
  be held (its bytes wait) or cut (both ends see ``closed`` at once).
- **Backend** (``MemoryBackend``): ``Post`` turns descriptors into copies
  between real numpy pools (addresses are checked to fall inside the peer's
  and our own registered pools, then mapped back to the arrays).  A read
  stays in flight until the test ends it: ``finish(tag)`` (lands, then
  reported ok), ``fail(tag)`` (reported with an error, nothing written) or
  ``late(tag)`` (lands *after* its fetch decided to fail, then reported with
  an error).  ``Cancel`` only marks a read; ``RemovePeer`` makes that peer's
  reads terminal (``PeerLost``, nothing more written).  Each read is reported
  to ``session.completed`` exactly once, and never writes after it is
  terminal.
- **Checks** raised as ``ContractError`` the moment they break: a write
  into a fetch that already finished, or outside its destination's pages;
  a ``FetchFinished`` while one of its reads is not yet reported terminal; a
  ``Done`` or ``Abort`` releasing a lease on the prefill while a read under
  it is still in flight; a tag posted twice; a session that never settles.

Time is ``World.now`` (a float the test advances); a prefill may run on a
clock offset from the decode's, since the two ends share no clock.  Nothing
ticks by itself: heartbeats (and the prefill's ``Renewed`` answers, bytes like
any other) flow only when the test ticks (``tick``, ``advance``, ``jump``).  A
pushed offer asks for a heartbeat at once, and its reads count for the bound
only once that renewal came back, so a test that wants a pushed fetch's bound
to advance before the done ack ticks once after the offer arrived.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kvlend.core.layout import RowSelection
from kvlend.errors import BackendError, KvlendError, PeerLost, TransferCancelled
from kvlend.protocol.actions import (
    AddPeer,
    Cancel,
    Close,
    Connect,
    FetchFinished,
    LeaseEnded,
    Offered,
    Post,
    RemovePeer,
    Send,
)
from kvlend.protocol.config import NodeConfig
from kvlend.protocol.decode import DecodeSession, Fetch, FetchState
from kvlend.protocol.prefill import PrefillSession

from .kvcache import SENTINEL, FreeList, group_layers, make_layout, make_pools, pattern, prefill_request, slots

KIND = "memory"
SCRIBBLE = 0xEE  # what a prefill engine writes into pages it got back (reused by another request)
UNCOMPUTED = 0x3C  # what a progressive lease's pages hold until prefill computed them (``extend``)
EPS = 1e-6  # a tick just past a deadline (sessions compare strictly)
_uid = itertools.count(1)


class ContractError(AssertionError):
    """A session, or this test transport, broke the contract between sessions and their shell."""


# ------------------------------------------------------------------ memory
class Memory:
    """A node's registered pools, found by address."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = list(arrays)
        spans = sorted((a.ctypes.data, a.nbytes, i) for i, a in enumerate(self.arrays))
        self._starts = [s[0] for s in spans]
        self._spans = spans
        self._flat = [a.view(np.uint8).reshape(-1) for a in self.arrays]

    def locate(self, addr: int, length: int) -> tuple[int, int]:
        """(pool index, byte offset) of ``[addr, addr + length)``, which must lie inside one pool."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or length <= 0:
            raise ContractError(f"descriptor {addr:#x}+{length} is not inside a registered pool")
        start, size, index = self._spans[i]
        if addr + length > start + size:
            raise ContractError(f"descriptor {addr:#x}+{length} runs past the pool at {start:#x} ({size} bytes)")
        return index, addr - start

    def view(self, addr: int, length: int) -> np.ndarray:
        index, off = self.locate(addr, length)
        return self._flat[index][off:off + length]


# ------------------------------------------------------------------ backend
@dataclass(eq=False)
class Read:
    tag: bytes
    conn: int
    copies: list  # (source Memory, src addr, dst addr, length)
    posted: float
    cancelled: bool = False  # Cancel was asked for
    landed: bool = False  # its bytes were written into the destination
    terminal: bool = False  # the backend is done with it (reported, or queued to be)
    reported: bool = False  # session.completed was called for it
    error: KvlendError | None = None


class MemoryBackend:
    """The decode's transfer backend: copies between numpy pools, ended by the test."""

    kind = KIND

    def __init__(self, world: World, owner: DecodeEnd) -> None:
        self.world = world
        self.owner = owner
        self.memory = owner.memory
        self.peers: dict[int, PrefillEnd] = {}
        self.reads: dict[bytes, Read] = {}  # every read posted, by tag
        self.queue: deque[Read] = deque()  # terminal, not yet reported
        self.writes: list[tuple[bytes, int, int, float]] = []  # (tag, dst addr, length, when)
        self.removed: list[int] = []  # RemovePeer, in order

    # ------------------------------------------------------ driven by actions
    def add_peer(self, conn: int, metadata: bytes) -> bool:
        peer = self.world.by_metadata.get(metadata)
        if peer is None or not peer.alive:
            return False
        self.peers[conn] = peer
        return True

    def remove_peer(self, conn: int) -> None:
        self.removed.append(conn)
        self.peers.pop(conn, None)
        for read in self.in_flight():
            if read.conn == conn:
                self._terminal(read, PeerLost(f"backend peer of link {conn} removed"))

    def post(self, conn: int, batches, tag: bytes) -> None:
        if tag in self.reads:
            raise ContractError(f"tag {tag!r} posted twice")
        self.world.on_post(self.owner, tag)
        peer = self.peers.get(conn)
        read = Read(tag, conn, [], self.world.now)
        self.reads[tag] = read
        if peer is None or not peer.alive:  # refused before anything moved (the shell's BackendError)
            self._terminal(read, BackendError(f"link {conn} has no backend peer"))
            return
        for batch in batches:
            for (raddr, rlen, _), (laddr, llen, _) in zip(batch.remote.tolist(), batch.local.tolist()):
                if rlen != llen:
                    raise ContractError(f"descriptor lengths differ: {rlen} != {llen}")
                peer.memory.locate(raddr, rlen)  # inside the prefill's pools
                self.memory.locate(laddr, llen)  # inside ours
                read.copies.append((peer.memory, raddr, laddr, rlen))
        if not read.copies:
            raise ContractError(f"read {tag!r} posted with no descriptors")
        self.world.post_policy(self, read)

    def cancel(self, tag: bytes) -> None:
        read = self.reads.get(tag)
        if read is not None and not read.terminal:
            read.cancelled = True
            self.world.cancel_policy(self, read)

    # ------------------------------------------------------ driven by tests
    def in_flight(self, conn: int | None = None) -> list[Read]:
        return [r for r in self.reads.values() if not r.terminal and (conn is None or r.conn == conn)]

    def land(self, tag: bytes) -> None:
        """Write the read's bytes now (it stays in flight until reported)."""
        read = self.reads[tag]
        if read.terminal:
            raise ContractError(f"read {tag!r} would write after it went terminal")
        if read.landed:
            return
        for _, _, laddr, length in read.copies:
            self.world.on_write(self.owner, read, laddr, length)
        for source, raddr, laddr, length in read.copies:
            self.memory.view(laddr, length)[:] = source.view(raddr, length)
            self.writes.append((tag, laddr, length, self.world.now))
        read.landed = True

    def finish(self, tag: bytes) -> None:
        """The read completes: its bytes land, then it is reported ok."""
        self.land(tag)
        self._terminal(self.reads[tag], None)

    def fail(self, tag: bytes, error: KvlendError | None = None) -> None:
        """The read fails without writing (or after ``land``): reported with ``error``."""
        read = self.reads[tag]
        if error is None:
            error = TransferCancelled(f"read {tag!r} cancelled") if read.cancelled else \
                BackendError(f"read {tag!r} failed")
        self._terminal(read, error)

    def late(self, tag: bytes, error: KvlendError | None = None) -> None:
        """The read writes its bytes anyway, then is reported failed (a cancelled read in UCX)."""
        self.land(tag)
        self.fail(tag, error)

    def _terminal(self, read: Read, error: KvlendError | None) -> None:
        if read.terminal:
            raise ContractError(f"read {read.tag!r} went terminal twice")
        read.terminal, read.error = True, error
        self.queue.append(read)

    def deliver(self) -> bool:
        """Report one terminal read to the session (exactly once)."""
        if not self.queue:
            return False
        read = self.queue.popleft()
        if read.reported:
            raise ContractError(f"read {read.tag!r} reported twice")
        read.reported = True
        self.owner.session.completed(read.tag, read.error, self.world.now)
        return True

    def die(self) -> None:
        """The decode process is gone: nothing it posted writes or reports again."""
        for read in self.in_flight():
            read.terminal = read.reported = True
        self.queue.clear()


# ------------------------------------------------------------------ ends
@dataclass(eq=False)
class Lent:
    """A lease as its prefill engine knows it."""

    lease: Any
    tables: dict
    seed: int


@dataclass(eq=False)
class Record:
    """A fetch as the decode engine (and the checks) know it."""

    fetch: Fetch
    dst: dict
    resume_from: int
    allowed: set = field(default_factory=set)  # (pool index, slot) the fetch may write, once known
    tags: set = field(default_factory=set)  # every read ever posted for it
    bounds: list = field(default_factory=list)  # bound after each step
    finished: bool = False
    freed: bool = False
    known_seed: int | None = None  # the request's seed, once the offer (or the test) said it

    @property
    def seed(self) -> int | None:
        return self.remember_seed()

    def remember_seed(self) -> int | None:
        """The request's seed, taken from the offer (and kept) the first time the offer is known."""
        offer = self.fetch.offer
        if self.known_seed is None and offer is not None:
            self.known_seed = offer.meta.get("seed")
        return self.known_seed


class PrefillEnd:
    def __init__(self, world: World, name: str, host: str, port: int, pages: int, config: NodeConfig,
                 offset: float, certified: bool) -> None:
        self.world = world
        self.name = name
        self.certified = certified  # its certificate is from the cluster CA
        self.endpoint = (host, port)
        self.offset = offset
        self.pools = make_pools(pages)
        self.layout = make_layout(self.pools)
        self.memory = Memory(self.pools)
        self.metadata = f"memory:{name}:{next(_uid)}".encode()
        self.session = PrefillSession(self.layout, KIND, self.metadata, name=name, config=config)
        self.free = {g: FreeList(pages, world.np_rng) for g in self.layout.groups}
        self.lent: dict[bytes, Lent] = {}  # live leases
        self.ended: list[tuple[bytes, str]] = []
        self.events: list = []
        self.wires: dict[int, Wire] = {}  # by prefill conn
        self.alive = True
        self._next_conn = 0

    @property
    def now(self) -> float:
        return self.world.now + self.offset

    @property
    def lender(self):
        return self.session.lender

    def new_conn(self) -> int:
        self._next_conn += 1
        return self._next_conn

    def _tables(self, num_tokens: int, seed: int) -> dict:
        return prefill_request(self.layout, self.pools, self.free, num_tokens, seed)

    def lend(self, num_tokens: int, seed: int, *, request: str | None = None, peer: str | None = None,
             selection: RowSelection | None = None, lease_id: bytes | None = None, ready: int | None = None,
             prompt_digest: bytes | None = None):
        """Fill and lend a request's pages (to a ticket: ``peer`` None); the lease.

        ``ready``: lend progressively (``PrefillSession.lend(ready=)``): pages not yet wholly below
        ``ready`` tokens (recurrent state: until final) hold ``UNCOMPUTED`` until ``extend`` commits them.
        """
        tables = self._tables(num_tokens, seed)
        if ready is not None:
            self._uncompute(tables, num_tokens, ready)
        try:
            lease = self.session.lend(request or f"req-{seed}", num_tokens, tables,
                                      selection or self.layout.full_selection(), self.now,
                                      meta={"seed": seed}, peer=peer, lease_id=lease_id, ready=ready,
                                      prompt_digest=prompt_digest)
        except BaseException:
            self._free(tables)
            raise
        self.lent[lease.id] = Lent(lease, tables, seed)
        return lease

    def ticket(self, num_tokens: int, seed: int, **kw):
        lease = self.lend(num_tokens, seed, **kw)
        return self.session.ticket(lease, *self.endpoint)

    def offer(self, peer: str, num_tokens: int, seed: int, *, request: str | None = None,
              selection: RowSelection | None = None, ready: int | None = None):
        """Fill, lend and push a request's pages to ``peer`` (``ready``: progressively, as in ``lend``)."""
        tables = self._tables(num_tokens, seed)
        if ready is not None:
            self._uncompute(tables, num_tokens, ready)
        try:
            lease = self.session.offer(peer, request or f"req-{seed}", num_tokens, tables,
                                       selection or self.layout.full_selection(), self.now, meta={"seed": seed},
                                       ready=ready)
        except BaseException:
            self._free(tables)
            raise
        self.lent[lease.id] = Lent(lease, tables, seed)
        self.world.pump()
        return lease

    def _free(self, tables: dict) -> None:
        for name, table in tables.items():
            self.free[name].release(table)

    # ------------------------------------------------ progressive lending (issue 17)
    def extend(self, lease, ready: int, *, pump: bool = True, **kw):
        """Prefill committed ``ready`` tokens of a progressive lease (a Lease, Ticket or id): the pages
        now complete get their bytes, then ``PrefillSession.extend`` lends them (``kw``: its options, such
        as ``meta``); the grown lease."""
        lease_id = lease if isinstance(lease, bytes) else getattr(lease, "id", None) or lease.lease
        lent = self.lent.get(lease_id)
        if lent is None:  # ended: the session says how (LeaseUnknown, LeaseExpired)
            return self.session.extend(lease_id, ready, {}, self.now, **kw)
        self._compute(lent.tables, lent.lease.num_tokens, ready, lent.seed)
        grown = self.session.extend(lease_id, ready, lent.tables, self.now, **kw)
        lent.lease = grown
        if pump:
            self.world.pump()
        return grown

    def _committed(self, name: str, num_tokens: int, ready: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows a decoder at ``num_tokens`` reads, whether each is complete at ``ready`` tokens)."""
        group = self.layout.groups[name]
        tpp = self.layout.tokens_per_page
        rows = group.pages_read(num_tokens, tpp)
        if ready >= num_tokens:
            return rows, np.ones(rows.size, dtype=bool)
        if group.recurrent:
            return rows, np.zeros(rows.size, dtype=bool)
        return rows, (rows + 1) * tpp <= ready

    def _uncompute(self, tables: dict, num_tokens: int, ready: int) -> None:
        """Pages prefill has not computed yet hold ``UNCOMPUTED`` (a read of one before its extension shows)."""
        for name, table in tables.items():
            rows, done = self._committed(name, num_tokens, ready)
            for layer in group_layers(self.layout, name):
                slots(self.pools[layer])[table[rows[~done]]] = UNCOMPUTED

    def _compute(self, tables: dict, num_tokens: int, ready: int, seed: int) -> None:
        """Prefill computed up to ``ready`` tokens: every page complete then holds the request's bytes."""
        n_pages = -(-num_tokens // self.layout.tokens_per_page)
        for name, table in tables.items():
            rows, done = self._committed(name, num_tokens, ready)
            for layer in group_layers(self.layout, name):
                view = slots(self.pools[layer])
                view[table[rows[done]]] = pattern(seed, layer, n_pages, view.shape[1])[rows[done]]

    def on_event(self, event) -> None:
        self.events.append(event)
        if isinstance(event, LeaseEnded):
            self.ended.append((event.lease.id, event.reason))
            self.world.on_lease_ended(self, event)
            lent = self.lent.pop(event.lease.id, None)
            if lent is not None:
                if self.world.scribble:  # the engine reuses the pages: a late read would copy garbage
                    for name, table in lent.tables.items():
                        rows = table[table >= 0]
                        for layer in group_layers(self.layout, name):
                            slots(self.pools[layer])[rows] = SCRIBBLE
                self._free(lent.tables)

    def expected_locks(self) -> dict[str, np.ndarray]:
        """Lock counts the live leases account for, per region."""
        out = {r.name: np.zeros(r.num_pages, dtype=np.int64) for r in self.layout.regions}
        for lent in self.lent.values():
            for name, gp in lent.lease.pages.items():
                for layer in group_layers(self.layout, name):
                    out[f"L{layer}.kv"][np.unique(gp.ordinals)] += 1
        return out


class DecodeEnd:
    def __init__(self, world: World, name: str, pages: int, config: NodeConfig, certified: bool,
                 read_window: int | None = None) -> None:
        self.world = world
        self.name = name
        self.certified = certified  # its certificate is from the cluster CA
        self.config = config
        self.pools = make_pools(pages)
        for pool in self.pools:
            slots(pool)[:] = SENTINEL
        self.layout = make_layout(self.pools)
        self.memory = Memory(self.pools)
        self.metadata = f"memory:{name}:{next(_uid)}".encode()
        self.session = DecodeSession(self.layout, KIND, name=name, config=config, read_window=read_window)
        self.backend = MemoryBackend(world, self)
        self.free = {g: FreeList(pages, world.np_rng) for g in self.layout.groups}
        self.records: dict[int, Record] = {}
        self.by_tag: dict[bytes, Record] = {}
        self.events: list = []
        self.offers: list = []  # (conn, offer) pushed and not yet taken
        self.finished: list[Record] = []
        self.wires: dict[int, Wire] = {}  # by decode conn
        self.alive = True
        self.on_offer: Callable | None = None  # engine hook: called with (conn, offer)

    @property
    def now(self) -> float:
        return self.world.now

    # ----------------------------------------------------------- engine side
    def alloc(self, num_tokens: int, resume_from: int = 0, seed: int | None = None) -> dict:
        """Destination tables; pages below ``resume_from`` hold what an earlier fetch read (``seed``)."""
        n_pages = -(-num_tokens // self.layout.tokens_per_page)
        dst = {name: self.free[name].alloc(n_pages) for name in self.layout.groups}
        for name, table in dst.items():
            for layer in group_layers(self.layout, name):
                view = slots(self.pools[layer])
                view[table] = SENTINEL
                kept = self.kept_pages(resume_from)
                if kept.size:
                    view[table[kept]] = pattern(seed, layer, n_pages, view.shape[1])[kept]
        return dst

    def kept_pages(self, resume_from: int) -> np.ndarray:
        return np.arange(resume_from // self.layout.tokens_per_page, dtype=np.int64)

    def release_dst(self, record: Record) -> None:
        if not record.freed:
            record.freed = True
            for name, table in record.dst.items():
                self.free[name].release(table)

    def _track(self, fetch: Fetch, dst: dict, resume_from: int, seed: int | None = None) -> Record:
        record = Record(fetch, dst, resume_from, known_seed=seed)
        record.remember_seed()  # while the offer is known
        record.bounds.append(fetch.bound)
        tpp = self.layout.tokens_per_page
        kept = set(self.kept_pages(resume_from).tolist())
        for name, table in dst.items():
            group = self.layout.groups[name]
            for page in group.pages_read(fetch.num_tokens, tpp).tolist():
                if page not in kept:
                    for layer in group_layers(self.layout, name):
                        record.allowed.add((layer, int(table[page])))
        self.records[fetch.id] = record
        return record

    def fetch_offer(self, conn: int, offer, dst: dict | None = None, resume_from: int = 0,
                    timeout: float | None = None) -> Record:
        dst = self.alloc(offer.num_tokens, resume_from, offer.meta.get("seed")) if dst is None else dst
        try:
            fetch = self.session.fetch_offer(conn, offer, dst, self.now, resume_from, timeout)
        except BaseException:
            self._free_tables(dst)
            raise
        self.offers = [(c, o) for c, o in self.offers if o.id != offer.id]
        record = self._track(fetch, dst, resume_from)
        self.world.pump()
        return record

    def fetch_ticket(self, ticket, dst: dict | None = None, resume_from: int = 0, seed: int | None = None,
                     timeout: float | None = None, prompt_digest: bytes | None = None) -> Record:
        dst = self.alloc(ticket.num_tokens, resume_from, seed) if dst is None else dst
        try:
            fetch = self.session.fetch_ticket(ticket, dst, self.now, resume_from, timeout, prompt_digest)
        except BaseException:
            self._free_tables(dst)
            raise
        record = self._track(fetch, dst, resume_from, seed)
        self.world.pump()
        return record

    def claim(self, ticket, prompt_digest: bytes | None = None) -> None:
        """Claim a ticket ahead of its fetch (``DecodeSession.claim_ticket``)."""
        self.session.claim_ticket(ticket, self.now, prompt_digest)
        self.world.pump()

    def unclaim(self, ticket) -> None:
        self.session.unclaim(ticket)
        self.world.pump()

    def _free_tables(self, dst) -> None:
        if isinstance(dst, dict):
            for name, table in dst.items():
                if name in self.free and isinstance(table, np.ndarray) and table.dtype.kind == "i":
                    try:
                        self.free[name].release(table)
                    except AssertionError:
                        pass

    def cancel(self, record: Record) -> None:
        self.session.cancel(record.fetch.id, self.now)
        self.world.pump()

    def running(self) -> list[Record]:
        return [r for r in self.records.values() if not r.finished]

    # ------------------------------------------------------------ checks
    def expected(self, record: Record, layer: int, n_pages: int) -> np.ndarray:
        """What ``record``'s destination pages of ``layer`` must hold once it is done."""
        name = self.layout.buffer_map[f"L{layer}.K"].group
        view = slots(self.pools[layer])
        want = np.full((n_pages, view.shape[1]), SENTINEL, dtype=np.uint8)
        rows = self.layout.groups[name].pages_read(record.fetch.num_tokens, self.layout.tokens_per_page)
        kept = self.kept_pages(record.resume_from)
        rows = np.union1d(rows, kept).astype(np.int64)
        want[rows] = pattern(record.seed, layer, n_pages, view.shape[1])[rows]
        return want

    def check_done(self, record: Record) -> None:
        """(ii) a done fetch's destination holds exactly the lent bytes, and nothing else was written."""
        f = record.fetch
        n_pages = -(-f.num_tokens // self.layout.tokens_per_page)
        for name, table in record.dst.items():
            for layer in group_layers(self.layout, name):
                got = slots(self.pools[layer])[table]
                want = self.expected(record, layer, n_pages)
                bad = np.flatnonzero((got != want).any(axis=1))
                if bad.size:
                    raise ContractError(f"fetch {f.id} ({f.request}) done but layer {layer} token page "
                                        f"{int(bad[0])} differs from the source")

    def check_bound(self, record: Record) -> None:
        """Every page a decoder at the bound reads holds the lent bytes (the bound is safe to use)."""
        f = record.fetch
        if f.bound <= 0 or record.seed is None:
            return
        tpp = self.layout.tokens_per_page
        n_pages = -(-f.num_tokens // tpp)
        for name, table in record.dst.items():
            rows = self.layout.groups[name].pages_read(f.bound, tpp)
            for layer in group_layers(self.layout, name):
                view = slots(self.pools[layer])
                got = view[table[rows]]
                want = pattern(record.seed, layer, n_pages, view.shape[1])[rows]
                bad = np.flatnonzero((got != want).any(axis=1))
                if bad.size:
                    raise ContractError(
                        f"fetch {f.id} ({f.request}, {f.state.value}) has bound {f.bound} but layer {layer} "
                        f"token page {int(rows[bad[0]])} below it does not hold the lent bytes")

    def on_event(self, event) -> None:
        self.events.append(event)
        if isinstance(event, Offered):
            self.offers.append((event.conn, event.offer))
            if self.on_offer is not None:
                self.on_offer(event.conn, event.offer)
        elif isinstance(event, FetchFinished):
            record = self.records.get(event.fetch.id)
            if record is None:
                return  # a fetch this engine never saw start (it raised)
            if record.finished:
                raise ContractError(f"fetch {event.fetch.id} finished twice")
            f = event.fetch
            if not f.done or not f.quiet:
                raise ContractError(f"FetchFinished for fetch {f.id} in state {f.state.value}, quiet={f.quiet}")
            open_reads = [t for t in record.tags if not self.backend.reads[t].reported]
            if open_reads:
                raise ContractError(f"fetch {f.id} finished with reads {open_reads} not yet terminal")
            record.finished = True
            self.finished.append(record)
            if f.state is FetchState.DONE:
                if f.bound != f.num_tokens or f.error is not None:
                    raise ContractError(f"fetch {f.id} done with bound {f.bound} of {f.num_tokens}")
                self.check_done(record)
            else:
                if not isinstance(f.error, KvlendError):
                    raise ContractError(f"fetch {f.id} failed without a typed error: {f.error!r}")
                if getattr(f.error, "bound", None) != f.bound:
                    raise ContractError(f"fetch {f.id}: error bound {getattr(f.error, 'bound', None)} != {f.bound}")
            self.check_bound(record)


# ------------------------------------------------------------------ network
class _Fin:
    def __init__(self, reason: str) -> None:
        self.reason = reason


@dataclass(eq=False)
class Wire:
    decode: DecodeEnd
    dconn: int
    prefill: PrefillEnd
    pconn: int
    to_prefill: deque = field(default_factory=deque)
    to_decode: deque = field(default_factory=deque)
    decode_open: bool = True
    prefill_open: bool = True
    hold_to_prefill: bool = False
    hold_to_decode: bool = False

    @property
    def open(self) -> bool:
        return self.decode_open or self.prefill_open


def hold_never(backend: MemoryBackend, read: Read) -> None:
    """Post/cancel policy: the read stays in flight until the test ends it."""


class World:
    """Prefill and decode sessions over an in-memory network and backend, on a fake clock."""

    def __init__(self, seed: int = 0, *, shuffle: bool = False, fragment: bool = False, scribble: bool = True,
                 start: float = 1000.0) -> None:
        self.now = start
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.shuffle = shuffle  # deliver across wires in a random order
        self.fragment = fragment  # split each send into random pieces
        self.scribble = scribble
        self.prefills: list[PrefillEnd] = []
        self.decodes: list[DecodeEnd] = []
        self.by_metadata: dict[bytes, PrefillEnd] = {}
        self.wires: list[Wire] = []
        self.post_policy: Callable[[MemoryBackend, Read], None] = hold_never
        self.cancel_policy: Callable[[MemoryBackend, Read], None] = hold_never
        self.lease_checks = True

    # ----------------------------------------------------------- building
    def add_prefill(self, name: str = "prefill", *, host: str = "10.0.0.1", port: int = 7000, pages: int = 256,
                    config: NodeConfig = NodeConfig(), offset: float = 0.0, certified: bool = True) -> PrefillEnd:
        if any(p.alive and p.endpoint == (host, port) for p in self.prefills):
            raise ValueError(f"{host}:{port} is taken")
        end = PrefillEnd(self, name, host, port, pages, config, offset, certified)
        self.prefills.append(end)
        self.by_metadata[end.metadata] = end
        return end

    def add_decode(self, name: str = "decode", *, pages: int = 256, config: NodeConfig = NodeConfig(),
                   certified: bool = True, read_window: int | None = None) -> DecodeEnd:
        end = DecodeEnd(self, name, pages, config, certified, read_window)
        self.decodes.append(end)
        return end

    def connect(self, decode: DecodeEnd, prefill: PrefillEnd) -> int:
        """Open (or reuse) decode's link to ``prefill`` and run the handshake; the link id."""
        conn = decode.session.link_to(*prefill.endpoint, decode.now)
        self.pump()
        return conn

    def wire(self, decode: DecodeEnd, dconn: int) -> Wire:
        return decode.wires[dconn]

    # ------------------------------------------------------------- pumping
    def ends(self) -> list:
        return [e for e in (*self.decodes, *self.prefills) if e.alive]

    def pump(self, max_steps: int = 200_000) -> None:
        """Perform actions, report terminal reads and deliver bytes until nothing moves."""
        for _ in range(max_steps):
            if self._flush() or self._deliver_completion() or self._deliver_message():
                continue
            self.after_pump()
            return
        raise ContractError("the sessions never settle")

    def after_pump(self) -> None:
        for d in self.decodes:
            if not d.alive:
                continue
            for record in d.records.values():
                if record.finished:
                    continue
                f = record.fetch
                record.remember_seed()  # while the offer is known
                # The prefill voided the lease (released, refused): what was read under it is void too.
                voided = f.bound == record.resume_from and f.state is FetchState.CANCELLING
                if (f.bound < record.bounds[-1] and not voided) or not 0 <= f.bound <= f.num_tokens:
                    raise ContractError(f"fetch {f.id} ({f.state.value}) bound went {record.bounds[-1]} -> "
                                        f"{f.bound}")
                record.bounds.append(f.bound)
                d.check_bound(record)

    def _flush(self) -> bool:
        moved = False
        for end in self.ends():
            actions = end.session.take_actions()
            events = end.session.take_events()
            for action in actions:
                moved = True
                if isinstance(end, DecodeEnd):
                    self._perform_decode(end, action)
                else:
                    self._perform_prefill(end, action)
                if not end.alive:
                    break
            for event in events:
                moved = True
                end.on_event(event)
        return moved

    def _deliver_completion(self) -> bool:
        backends = [d.backend for d in self.decodes if d.alive and d.backend.queue]
        if not backends:
            return False
        (self.rng.choice(backends) if self.shuffle else backends[0]).deliver()
        return True

    def _deliver_message(self) -> bool:
        ready = []
        for w in self.wires:
            if w.to_prefill and not w.hold_to_prefill:
                ready.append((w, True))
            if w.to_decode and not w.hold_to_decode:
                ready.append((w, False))
        if not ready:
            return False
        wire, to_prefill = self.rng.choice(ready) if self.shuffle else ready[0]
        queue = wire.to_prefill if to_prefill else wire.to_decode
        item = queue.popleft()
        if to_prefill:
            if isinstance(item, _Fin):
                if wire.prefill_open:
                    wire.prefill_open = False
                    wire.to_decode.clear()
                    if wire.prefill.alive:
                        wire.prefill.session.closed(wire.pconn, wire.prefill.now, item.reason)
            elif wire.prefill_open and wire.prefill.alive:
                wire.prefill.session.receive(wire.pconn, item, wire.prefill.now)
        else:
            if isinstance(item, _Fin):
                if wire.decode_open:
                    wire.decode_open = False
                    wire.to_prefill.clear()
                    if wire.decode.alive:
                        wire.decode.session.closed(wire.dconn, wire.decode.now, item.reason)
            elif wire.decode_open and wire.decode.alive:
                wire.decode.session.receive(wire.dconn, item, wire.decode.now)
        self._gc()
        return True

    def deliver(self, wire: Wire, *, to_decode: bool = True) -> None:
        """Deliver the next item queued on one direction of ``wire`` (even if held), then pump."""
        saved = [(w, w.hold_to_decode, w.hold_to_prefill) for w in self.wires]
        for w in self.wires:
            w.hold_to_decode = w.hold_to_prefill = True
        if to_decode:
            wire.hold_to_decode = False
        else:
            wire.hold_to_prefill = False
        try:
            if not self._deliver_message():
                raise ContractError("nothing queued on that wire")
        finally:
            for w, a, b in saved:
                w.hold_to_decode, w.hold_to_prefill = a, b
        self.pump()

    def _gc(self) -> None:
        self.wires = [w for w in self.wires if w.open or w.to_prefill or w.to_decode]

    def _push(self, queue: deque, data: bytes) -> None:
        if self.fragment and len(data) > 1:
            cuts = sorted(self.rng.sample(range(1, len(data)), min(len(data) - 1, self.rng.randint(0, 3))))
            for a, b in zip([0, *cuts], [*cuts, len(data)]):
                queue.append(data[a:b])
        else:
            queue.append(data)

    def _perform_decode(self, d: DecodeEnd, action) -> None:
        s, now = d.session, d.now
        if isinstance(action, Connect):
            target = next((p for p in self.prefills if p.alive and p.endpoint == (action.host, action.port)), None)
            if target is None:
                s.closed(action.conn, now, "connection refused")
                return
            wire = Wire(d, action.conn, target, target.new_conn())
            d.wires[action.conn] = wire
            target.wires[wire.pconn] = wire
            self.wires.append(wire)
            target.session.accept(wire.pconn, target.now)
            s.connected(action.conn, now)
            self._tls(wire)
        elif isinstance(action, Send):
            wire = d.wires.get(action.conn)
            if wire is not None and wire.decode_open and wire.prefill_open:
                self._push(wire.to_prefill, action.data)
        elif isinstance(action, Close):
            wire = d.wires.get(action.conn)
            if wire is not None and wire.decode_open:
                wire.decode_open = False
                wire.to_decode.clear()
                wire.to_prefill.append(_Fin(action.reason))
        elif isinstance(action, AddPeer):
            if not d.backend.add_peer(action.conn, action.metadata):
                s.closed(action.conn, now, "loading its backend metadata failed")
        elif isinstance(action, RemovePeer):
            d.backend.remove_peer(action.conn)
        elif isinstance(action, Post):
            d.backend.post(action.conn, action.batches, action.tag)
        elif isinstance(action, Cancel):
            d.backend.cancel(action.tag)
        else:
            raise ContractError(f"decode emitted an unknown action {action!r}")

    def _tls(self, wire: Wire) -> None:
        """The TLS handshake, done at once: each side learns the other's certificate name, or,
        if either certificate is not the cluster CA's, both see the connection refused."""
        d, p = wire.decode, wire.prefill
        if not (d.certified and p.certified):
            wire.decode_open = wire.prefill_open = False
            why = "TLS handshake failed: CERTIFICATE_VERIFY_FAILED"
            p.session.closed(wire.pconn, p.now, why, refused=True)
            d.session.closed(wire.dconn, d.now, why, refused=True)
            self._gc()
            return
        p.session.authenticated(wire.pconn, d.name, p.now)
        d.session.authenticated(wire.dconn, p.name, d.now)

    def _perform_prefill(self, p: PrefillEnd, action) -> None:
        wire = p.wires.get(action.conn)
        if isinstance(action, Send):
            if wire is not None and wire.prefill_open and wire.decode_open:
                self._push(wire.to_decode, action.data)
        elif isinstance(action, Close):
            if wire is not None and wire.prefill_open:
                wire.prefill_open = False
                wire.to_prefill.clear()
                wire.to_decode.append(_Fin(action.reason))
        else:
            raise ContractError(f"prefill emitted {action!r}: it may only send and close")

    # --------------------------------------------------------------- checks
    def on_post(self, d: DecodeEnd, tag: bytes) -> None:
        owner = [r for r in d.records.values() if tag in r.fetch.tags]
        if len(owner) != 1:
            raise ContractError(f"posted tag {tag!r} belongs to {len(owner)} running fetches")
        owner[0].tags.add(tag)
        d.by_tag[tag] = owner[0]

    def on_write(self, d: DecodeEnd, read: Read, addr: int, length: int) -> None:
        """(i) nothing lands in a finished fetch's destination, nor outside the pages it reads."""
        record = d.by_tag.get(read.tag)
        if record is None:
            raise ContractError(f"read {read.tag!r} of no fetch writes")
        f = record.fetch
        if record.finished:
            raise ContractError(f"read {read.tag!r} writes into fetch {f.id}, which already finished "
                                f"({f.state.value}): its destination was declared quiet")
        layer, off = d.memory.locate(addr, length)
        stride = slots(d.pools[layer]).shape[1]
        for slot in range(off // stride, (off + length - 1) // stride + 1):
            if (layer, slot) not in record.allowed:
                raise ContractError(f"read {read.tag!r} of fetch {f.id} writes slot {slot} of layer {layer}, "
                                    "which is not one of the pages it reads")

    def on_lease_ended(self, p: PrefillEnd, event: LeaseEnded) -> None:
        """``Done``/``Abort`` only once every read under the lease is terminal."""
        if not self.lease_checks or event.reason not in ("done", "aborted"):
            return
        for d in self.decodes:
            if not d.alive:
                continue
            for record in d.records.values():
                if record.fetch.lease != event.lease.id:
                    continue
                open_reads = [t for t in record.tags if not d.backend.reads[t].terminal]
                if open_reads:
                    raise ContractError(f"prefill {p.name} ended lease {event.lease.hex} ({event.reason}) while "
                                        f"reads {open_reads} of fetch {record.fetch.id} may still land")

    def check_locks(self) -> None:
        """(iii) every prefill's page locks are exactly those of its live leases."""
        for p in self.prefills:
            if not p.alive:
                continue
            want = p.expected_locks()
            for region, counts in want.items():
                got = p.lender.locks.refcounts(region)
                if not np.array_equal(got, counts):
                    raise ContractError(f"prefill {p.name} region {region}: locks {np.flatnonzero(got)} "
                                        f"!= live leases' {np.flatnonzero(counts)}")
            if p.lender.active_leases != len(p.lent):
                raise ContractError(f"prefill {p.name}: {p.lender.active_leases} active leases, "
                                    f"{len(p.lent)} not ended")

    # ----------------------------------------------------------------- time
    def next_deadline(self) -> float | None:
        times = []
        for end in self.ends():
            t = end.session.next_deadline()
            if t is not None:
                times.append(t - getattr(end, "offset", 0.0))
        return min(times) if times else None

    def tick(self) -> None:
        ends = self.ends()
        if self.shuffle:
            self.rng.shuffle(ends)
        for end in ends:
            end.session.tick(end.now)
            self.pump()

    def advance(self, dt: float, *, step: float | None = None) -> None:
        """Let ``dt`` seconds pass, ticking at every deadline on the way (and every ``step`` s)."""
        target = self.now + dt
        for _ in range(1_000_000):
            t = target
            nxt = self.next_deadline()
            if nxt is not None:
                t = min(t, max(nxt, self.now) + EPS)
            if step is not None:
                t = min(t, self.now + step)
            self.now = max(self.now, t)
            self.tick()
            if self.now >= target:
                return
        raise ContractError("advance: deadlines never stop")

    def jump(self, dt: float) -> None:
        """The clock jumps ``dt`` at once (a suspended VM, an NTP step): one tick at the new time."""
        self.now += dt
        self.tick()

    # ---------------------------------------------------------------- faults
    def cut(self, wire: Wire, reason: str = "connection reset") -> None:
        """Both ends see the connection die (bytes in flight are lost)."""
        wire.to_prefill.clear()
        wire.to_decode.clear()
        d_open, p_open = wire.decode_open, wire.prefill_open
        wire.decode_open = wire.prefill_open = False
        if d_open and wire.decode.alive:
            wire.decode.session.closed(wire.dconn, wire.decode.now, reason)
        if p_open and wire.prefill.alive:
            wire.prefill.session.closed(wire.pconn, wire.prefill.now, reason)
        self._gc()
        self.pump()

    def kill_prefill(self, p: PrefillEnd) -> None:
        """The prefill process dies: its connections reset, reads from its memory fail."""
        p.alive = False
        for d in self.decodes:
            if not d.alive:
                continue
            for conn, peer in list(d.backend.peers.items()):
                if peer is p:
                    for read in d.backend.in_flight(conn):
                        d.backend._terminal(read, PeerLost(f"prefill {p.name} died"))
        for wire in list(p.wires.values()):
            if wire.open:
                self.cut(wire, f"prefill {p.name} died")
        self.pump()

    def kill_decode(self, d: DecodeEnd, *, silent: bool = False) -> None:
        """The decode process dies; with ``silent`` its connections stay half-open on the prefills."""
        d.alive = False
        d.backend.die()
        for wire in list(d.wires.values()):
            wire.decode_open = False
            wire.to_prefill.clear()
            wire.to_decode.clear()
            if not silent and wire.prefill_open and wire.prefill.alive:
                wire.prefill_open = False
                wire.prefill.session.closed(wire.pconn, wire.prefill.now, f"decode {d.name} died")
        self._gc()
        self.pump()

    def settle(self, slack: float = 1.0) -> None:
        """(iv) past every fetch deadline plus the cancel grace, with reads left as they are."""
        cfg = max((d.config for d in self.decodes if d.alive), key=lambda c: c.transfer_timeout + c.cancel_grace,
                  default=NodeConfig())
        self.advance(cfg.transfer_timeout + cfg.cancel_grace + slack)


def finish_all(world: World, d: DecodeEnd, *, conn: int | None = None) -> int:
    """Complete every read in flight (in posting order, or shuffled); how many."""
    reads = d.backend.in_flight(conn)
    if world.shuffle:
        world.rng.shuffle(reads)
    for read in reads:
        if not read.terminal:
            d.backend.finish(read.tag)
    world.pump()
    return len(reads)


def connected(world: World, prefill: PrefillEnd, decode: DecodeEnd) -> int:
    """Link ``decode`` to ``prefill``, check that both ends see it ready, and return the link id."""
    conn = world.connect(decode, prefill)
    assert decode.session.ready(conn) and prefill.session.peers == [decode.name]
    return conn


def rig(config: NodeConfig, *, decode_config: NodeConfig | None = None, seed: int = 0, offset: float = 0.0,
        decode: str = "decode", read_window: int | None = None,
        **world_kw) -> tuple[World, PrefillEnd, DecodeEnd, int]:
    """A fresh world (``world_kw``) with one prefill on ``config`` and one decode on ``decode_config``
    (else ``config``) linked to it: ``(world, prefill, decode, link id)``."""
    world = World(seed, **world_kw)
    prefill = world.add_prefill(config=config, offset=offset)
    end = world.add_decode(decode, config=decode_config or config, read_window=read_window)
    return world, prefill, end, connected(world, prefill, end)
