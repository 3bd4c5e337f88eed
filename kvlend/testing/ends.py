"""The two ends of a world: a prefill engine that lends seeded pages and a decode engine that fetches them.

Each end owns real numpy pools (``kvcache``'s toy layout), the real session
(``PrefillSession`` or ``DecodeSession``) and the engine's bookkeeping: which
pages are lent, which fetch writes where.  The decode end checks every fetch
the session reports finished: a done fetch holds exactly the lent bytes, a
failed one carries a typed error whose bound names bytes really there.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..core.layout import RowSelection
from ..core.lease import LendOptions
from ..errors import KvlendError
from ..protocol.actions import FetchFinished, LeaseEnded, Offered
from ..protocol.config import NodeConfig
from ..protocol.decode import DecodeSession, Fetch, FetchState
from ..protocol.prefill import PrefillSession
from .backend import KIND, ContractError, Memory, MemoryBackend
from .kvcache import SENTINEL, FreeList, group_layers, make_layout, make_pools, pattern, prefill_request, slots

if TYPE_CHECKING:
    from .world import Wire, World

SCRIBBLE = 0xEE  # what a prefill engine writes into pages it got back (reused by another request)
UNCOMPUTED = 0x3C  # what a progressive lease's pages hold until prefill computed them (``extend``)
_uid = itertools.count(1)


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
    """A prefill engine and its session: lends requests whose pages it fills from a seed, on its own clock."""

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

        ``ready``: lend progressively (``LendOptions.ready``): pages not yet wholly below
        ``ready`` tokens (recurrent state: until final) hold ``UNCOMPUTED`` until ``extend`` commits them.
        """
        tables = self._tables(num_tokens, seed)
        if ready is not None:
            self._uncompute(tables, num_tokens, ready)
        try:
            lease = self.session.lend(request or f"req-{seed}", num_tokens, tables,
                                      selection or self.layout.full_selection(), self.now,
                                      LendOptions(lease_id, ready, prompt_digest, {"seed": seed}), peer=peer)
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
                                       selection or self.layout.full_selection(), self.now,
                                       LendOptions(ready=ready, meta={"seed": seed}))
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
    """A decode engine, its session and its backend: fetches into pages it allocates, and checks what lands."""

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

