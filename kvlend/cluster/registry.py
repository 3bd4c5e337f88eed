"""``Registry``: a rank's link to the cluster registry in etcd (the I/O shell around ``ClusterView``).

One daemon thread runs an asyncio loop with an ``aetcd`` client (a
maintained asyncio etcd v3 client: put, lease, prefix watch, all over
etcd's gRPC API; the other Python clients measured here either fail to
import with current protobuf or cannot attach a lease to a put).  Each pass:

1. connect to one endpoint (rotating through the list on failure);
2. if this rank publishes, keep its record under a lease of ``ttl``
   seconds: granted once, refreshed every ``ttl / 3``, granted again only
   if it expired while etcd was out of reach; revoked on ``close``, so a
   clean shutdown leaves at once and a dead rank one TTL later;
3. read the prefix (a snapshot at a revision), then watch from the next
   revision, so no change is missed between the two;
4. probe etcd every ``ttl / 3`` (the lease refresh, or a linearizable read
   for a rank that only watches), because a member that lost its quorum
   keeps a watch open and silent.

Any failure or deadline marks the view degraded and starts the next pass
after a short backoff; the ranks known stay known (an unreachable registry
says nothing about the ranks), so a node keeps serving the peers it has.
Every etcd call has a deadline (``timeout``); nothing here blocks a caller
longer than the ``timeout`` it passes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Callable, Iterable, Mapping, Sequence

from ..core.layout import PageLayout
from ..errors import RegistryError
from .records import RankRecord, record_key
from .view import Change, ClusterView

log = logging.getLogger(__name__)

Listener = Callable[[list[Change]], None]
MIN_TTL = 1.0  # etcd refuses shorter leases with the fast raft timings used here (2 s with its defaults)
_BACKOFF = (0.05, 1.0)


def _endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RegistryError(f"etcd endpoint {text!r}: expected host:port")
    return host, int(port)


class Registry:
    """Publishes this rank's record (optional) and keeps a live ``ClusterView`` of the prefix.

    ``endpoints``: etcd client endpoints as ``host:port``.  ``ttl``: seconds
    a record outlives its rank (etcd leases count whole seconds).  ``timeout``: the deadline of each etcd call.
    ``update_interval``: the least time between two puts of a changing
    record (load changes are coalesced).  Listeners get each batch of
    ``Change`` on the registry thread; they must be quick and must not call
    back into a blocking wait.
    """

    def __init__(self, endpoints: Sequence[str], prefix: str = "/kvlend/default", *, ttl: float = 5.0,
                 timeout: float = 2.0, update_interval: float = 0.25) -> None:
        if isinstance(endpoints, str) or not endpoints:
            raise RegistryError(f"endpoints: expected a non-empty list of host:port, got {endpoints!r}")
        self.endpoints = [_endpoint(e) for e in endpoints]
        for name, value, low in (("ttl", ttl, MIN_TTL), ("timeout", timeout, 0.05),
                                 ("update_interval", update_interval, 0.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < 3600:
                raise RegistryError(f"{name}: expected seconds in [{low}, 3600), got {value!r}")
        self.prefix = prefix
        self.view = ClusterView(prefix)  # read under ``self._cond``; use the query methods
        self.ttl, self.timeout, self.update_interval = float(ttl), float(timeout), float(update_interval)
        self._cond = threading.Condition()
        self._listeners: list[Listener] = []
        self._record: RankRecord | None = None
        self._lease: int | None = None
        self._published: RankRecord | None = None  # what etcd holds for us, as far as we know
        self._withdrawn = False  # ``withdraw`` asked for the lease to go
        self._retired = False  # withdrawn and not published again: ``update`` does nothing
        self._ready = False
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._endpoint = ""
        self.reconnects = 0

    # ---------------------------------------------------------------- control
    def start(self) -> Registry:
        """Start the registry thread; it connects in the background (see ``ready``)."""
        if self._thread is not None:
            raise RegistryError("registry already started")
        self._thread = threading.Thread(target=self._run, name="kvlend-registry", daemon=True)
        self._thread.start()
        return self

    def ready(self, timeout: float) -> bool:
        """Wait until a first snapshot of the prefix was read (True), or ``timeout`` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._ready, timeout)

    def wait_for(self, predicate: Callable[[ClusterView], bool], timeout: float) -> bool:
        """Wait until ``predicate(view)`` holds (checked on every change), or ``timeout`` passed."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.view), timeout)

    def add_listener(self, listener: Listener) -> None:
        with self._cond:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._cond:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def publish(self, record: RankRecord) -> None:
        """Keep ``record`` published under this rank's lease (from now on, and again after reconnects)."""
        if not isinstance(record, RankRecord):
            raise RegistryError(f"publish: expected a RankRecord, got {type(record).__name__}")
        with self._cond:
            if self._record is not None and self._record.identity != record.identity:
                raise RegistryError(f"this registry publishes {self._record.identity!r}, not {record.identity!r}")
            self._record = record
            self._withdrawn = self._retired = False  # a lease still held is reused
        self._poke()

    def update(self, **fields) -> None:
        """Change fields of the published record (say, ``load=3``); puts are coalesced."""
        with self._cond:
            if self._record is None:
                if self._retired:  # withdrawn: a node's loop may still report its load once
                    return
                raise RegistryError("update: nothing published yet")
            try:
                record = dataclasses.replace(self._record, **fields)
            except TypeError as exc:  # a field RankRecord does not have
                raise RegistryError(f"update: {exc}") from None
            if record == self._record:
                return
            self._record = record
        self._poke()

    def withdraw(self) -> None:
        """Stop publishing: this rank's record leaves now (its lease is revoked); the view stays live.

        For a node that stops serving while its process, and the registry, go on; ``publish``
        puts the record back under a new lease.
        """
        with self._cond:
            if self._record is None:
                return
            self._record = None
            self._withdrawn = self._retired = True
        self._poke()

    def close(self, timeout: float | None = None) -> None:
        """Revoke this rank's lease (its record leaves at once) and stop; idempotent."""
        timeout = self.timeout * 2 if timeout is None else timeout
        with self._cond:
            self._stopping = True
        self._poke()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout + self.timeout)
            if self._thread.is_alive():
                log.warning("registry thread did not stop within %.1f s", timeout + self.timeout)

    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- queries
    @property
    def degraded(self) -> bool:
        with self._cond:
            return self.view.degraded or not self._ready

    def ranks(self, role: str | None = None) -> list[RankRecord]:
        with self._cond:
            return self.view.ranks(role)

    def get(self, identity: str) -> RankRecord | None:
        with self._cond:
            return self.view.get(identity)

    def compatible(self, layout: PageLayout, role: str = "prefill") -> list[RankRecord]:
        with self._cond:
            return self.view.compatible(layout, role)

    def pick(self, layout: PageLayout, routed: Mapping[str, int] | None = None,
             exclude: Iterable[str] = ()) -> RankRecord:
        with self._cond:
            return self.view.pick(layout, routed, exclude)

    def status(self) -> dict:
        """What ``kvlend cluster status`` prints: health, endpoint, revision and the live ranks."""
        with self._cond:
            v = self.view
            return {
                "endpoint": self._endpoint, "ready": self._ready, "degraded": v.degraded or not self._ready,
                "degraded_for_s": None if v.degraded_since is None else round(time.monotonic() - v.degraded_since, 3),
                "why": v.degraded_why, "revision": v.revision, "reconnects": self.reconnects,
                "published": self._published is not None,
                "ranks": [{"identity": r.identity, "role": r.role, "endpoint": f"{r.host}:{r.port}",
                           "layout_id": r.layout_id[:16], "tp": f"{r.tp_rank}/{r.tp_size}",
                           "pp": f"{r.pp_rank}/{r.pp_size}", "load": r.load, "capacity": r.capacity,
                           **({"meta": dict(r.meta)} if r.meta else {})} for r in v.ranks()],
                "rejected": dict(v.rejected),
            }

    # ---------------------------------------------------------------- thread
    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop already closed
                pass

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:  # never expected: each pass catches its own failures
            log.exception("registry thread failed")

    async def _main(self) -> None:
        import aetcd

        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        backoff, turn = _BACKOFF[0], 0
        while not self._stopping:
            host, port = self.endpoints[turn % len(self.endpoints)]
            turn += 1
            try:
                await self._pass(aetcd, host, port)
                backoff = _BACKOFF[0]
            except Exception as exc:  # every etcd, gRPC and deadline failure ends this pass alike
                self._degrade(f"etcd {host}:{port}: {type(exc).__name__}: {exc}".strip())
            if self._stopping:
                break
            self.reconnects += 1
            await self._nap(backoff)
            backoff = min(backoff * 2, _BACKOFF[1])
        await self._revoke(aetcd)

    async def _call(self, coro):
        try:
            return await asyncio.wait_for(coro, self.timeout)
        except asyncio.TimeoutError:
            name = getattr(coro, "__qualname__", "call")
            raise RegistryError(f"{name} did not answer within {self.timeout:g} s") from None

    async def _pass(self, aetcd, host: str, port: int) -> None:
        client = aetcd.Client(host, port, timeout=max(1, round(self.timeout)), connect_wait_timeout=max(1, round(self.timeout)))
        try:
            await self._call(client.connect())
            self._endpoint = f"{host}:{port}"
            await self._keep_record(client)
            prefix = self.view.prefix.encode()
            snap = await self._call(client.get_prefix(prefix))
            with self._cond:
                changes = self.view.reset(snap.header.revision, [(kv.key, kv.value) for kv in snap.kvs])
                was = self.view.degraded_since
                self.view.mark_healthy()
                self._ready = True
            if was is not None:
                log.warning("cluster registry recovered at %s after %.1f s", self._endpoint, time.monotonic() - was)
            self._notify(changes)
            watch = await self._call(client.watch_prefix(prefix, start_revision=snap.header.revision + 1))
            watcher = asyncio.ensure_future(self._watch(watch, aetcd.rtypes.EventKind.DELETE))
            try:
                await self._keep(client, watcher)
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
                try:
                    await asyncio.wait_for(watch.cancel(), self.timeout)
                except Exception:  # the stream is gone with the connection anyway
                    pass
        finally:
            try:
                await asyncio.wait_for(client.close(), self.timeout)
            except Exception:
                pass

    async def _watch(self, watch, delete) -> None:
        try:
            async for event in watch:
                kv = event.kv
                with self._cond:
                    if event.kind == delete:
                        changes = self.view.delete(kv.mod_revision, kv.key)
                        mine = self._record is not None and any(
                            c.record.identity == self._record.identity for c in changes)
                        if mine:  # deleted by hand while we live: put it back (``_keep`` wakes now)
                            self._published = None
                    else:
                        changes = self.view.put(kv.mod_revision, kv.key, kv.value)
                self._notify(changes)
                if event.kind == delete:
                    self._wake.set()
            raise RegistryError("the watch stream ended")
        finally:
            self._wake.set()  # ``_keep`` notices at once

    async def _keep(self, client, watcher: asyncio.Future) -> None:
        """Until stopped: put record changes (coalesced), and probe etcd every ttl / 3."""
        probe_every = self.ttl / 3
        next_probe = time.monotonic() + probe_every
        while not self._stopping:
            if watcher.done():
                watcher.result()  # raises why the watch ended
                raise RegistryError("the watch ended")
            put = await self._keep_record(client)
            if time.monotonic() >= next_probe:
                if self._lease is not None:
                    await self._refresh(client)
                else:
                    await self._call(client.get(b"/kvlend-probe"))  # linearizable: needs a quorum
                next_probe = time.monotonic() + probe_every
            if put and self.update_interval:
                await asyncio.sleep(self.update_interval)  # coalesce a burst of updates into one put
            else:
                await self._nap(next_probe - time.monotonic())

    async def _keep_record(self, client) -> bool:
        """Put the record if etcd may not hold the current one (first time, changed, reconnected);
        revoke the lease of a withdrawn one."""
        with self._cond:
            record, withdrawn = self._record, self._withdrawn
        if withdrawn and record is None and self._lease is not None:
            try:
                await self._call(client.revoke_lease(self._lease))
            except Exception as exc:  # gone already, or etcd is out: unrefreshed, it lapses within the TTL
                log.info("revoking the withdrawn record's lease failed: %s", exc)
            with self._cond:
                self._lease, self._published, self._withdrawn = None, None, False
            return False
        if record is None or record == self._published:
            return False
        if self._lease is None:
            self._lease = (await self._call(client.lease(int(round(self.ttl))))).id
        elif self._published is None:  # reconnected: the lease may have run out meanwhile
            await self._refresh(client)
        await self._call(client.put(record_key(self.prefix, record.identity).encode(), record.encode(),
                                    lease=self._lease))
        with self._cond:
            self._published = record
        return True

    async def _refresh(self, client) -> None:
        reply = await self._call(client.refresh_lease(self._lease))
        if reply is None or reply.TTL <= 0:  # expired while unreachable: its record is gone, put it again
            self._lease = (await self._call(client.lease(int(round(self.ttl))))).id
            with self._cond:
                self._published = None

    async def _revoke(self, aetcd) -> None:
        """Best effort, within the deadline: a clean shutdown's record leaves now rather than at its TTL."""
        if self._lease is None:
            return
        for host, port in self.endpoints:
            client = aetcd.Client(host, port, timeout=max(1, round(self.timeout)), connect_wait_timeout=1)
            try:
                await self._call(client.connect())
                await self._call(client.revoke_lease(self._lease))
                self._lease = None
                return
            except Exception as exc:
                log.info("revoking the registry lease at %s:%d failed: %s", host, port, exc)
            finally:
                try:
                    await asyncio.wait_for(client.close(), self.timeout)
                except Exception:
                    pass

    async def _nap(self, seconds: float) -> None:
        """Sleep up to ``seconds``; a ``publish``, ``update`` or ``close`` wakes it early."""
        self._wake.clear()
        if self._stopping:
            return
        try:
            await asyncio.wait_for(self._wake.wait(), max(0.0, seconds))
        except asyncio.TimeoutError:
            pass

    def _degrade(self, why: str) -> None:
        with self._cond:
            first = not self.view.degraded
            self.view.mark_degraded(time.monotonic(), why)
            self._published = None  # etcd may have lost it (lease expiry): put again once back
            self._cond.notify_all()
        if first and not self._stopping:
            log.warning("cluster registry degraded (serving known peers): %s", why)

    def _notify(self, changes: list[Change]) -> None:
        with self._cond:
            self._cond.notify_all()
            listeners = list(self._listeners)
        if not changes:
            return
        for listener in listeners:
            try:
                listener(changes)
            except Exception:
                log.exception("registry listener failed")
