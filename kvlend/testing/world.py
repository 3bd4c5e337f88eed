"""The world: prefill and decode ends over an in-memory network, on a fake clock, checked on every step.

Each ``Connect`` of a ``DecodeSession`` becomes a ``Wire`` to the
``PrefillSession`` listening at that endpoint (``accept`` + ``connected``,
then ``authenticated`` on both sides with the other's name, as the shell does
once TLS verified both certificates; an end added with ``certified=False``
holds a certificate of another CA, so both sides see ``closed(...,
refused=True)`` instead); ``Send`` queues bytes on the wire, in order
(optionally split into fragments, and, across *different* wires only,
delivered in a random order); ``Close`` queues an end-of-stream after the
bytes sent before it, which the other side sees as ``closed``.  A wire can
be held (its bytes wait) or cut (both ends see ``closed`` at once).

Checks raise ``ContractError`` the moment they break: a write into a fetch
that already finished, or outside its destination's pages; a
``FetchFinished`` while one of its reads is not yet reported terminal; a
``Done`` or ``Abort`` releasing a lease on the prefill while a read under it
is still in flight; a tag posted twice; a session that never settles.

Time is ``World.now`` (its ``clock``, a ``FakeClock``); a prefill may run on a
clock offset from the decode's, since the two ends share no clock.  Nothing
ticks by itself: heartbeats (and the prefill's ``Renewed`` answers, bytes like
any other) flow only when the test ticks (``tick``, ``advance``, ``jump``).  A
pushed offer asks for a heartbeat at once, and its reads count for the bound
only once that renewal came back, so a test that wants a pushed fetch's bound
to advance before the done ack ticks once after the offer arrived.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import PeerLost
from ..protocol.actions import AddPeer, Cancel, Close, Connect, LeaseEnded, Post, RemovePeer, Send
from ..protocol.config import NodeConfig
from ..protocol.decode import FetchState
from .backend import ContractError, MemoryBackend, Read
from .clock import FakeClock
from .ends import DecodeEnd, PrefillEnd
from .kvcache import slots

EPS = 1e-6  # a tick just past a deadline (sessions compare strictly)


class _Fin:
    def __init__(self, reason: str) -> None:
        self.reason = reason


@dataclass(eq=False)
class Wire:
    """One connection: bytes queued each way; ``hold_to_*`` keeps them waiting."""

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
        self.clock = FakeClock(start)  # the decodes' time; a prefill's is this plus its offset
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

    @property
    def now(self) -> float:
        """The clock's time; setting it ticks no one (``advance`` and ``jump`` do)."""
        return self.clock.now

    @now.setter
    def now(self, value: float) -> None:
        self.clock.now = value

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
                if record.fetch.lease != event.lease.id or not record.fetch.confirmed:
                    continue  # reads ahead of a claim never answered hold no lease, and count for nothing
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
