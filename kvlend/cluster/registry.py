"""``Registry``: a rank's link to the cluster registry in etcd (the I/O shell around ``ClusterView``).

One daemon thread runs an asyncio loop with an ``aetcd`` client (a
maintained asyncio etcd v3 client: put, lease, prefix watch, all over
etcd's gRPC API; the other Python clients measured here either fail to
import with current protobuf or cannot attach a lease to a put).  Each pass:

1. connect to one endpoint (rotating through the list on failure);
2. if this rank publishes, keep its record, signed with its certificate's key
   (``signing``), under a lease of ``ttl``
   seconds: granted once, refreshed every ``ttl / 3``, granted again only
   if it expired while etcd was out of reach; revoked on ``close``, so a
   clean shutdown leaves at once and a dead rank one TTL later;
3. read the prefix (a snapshot at a revision, in pages of ``PAGE`` keys
   read at that one revision, so no reply nears gRPC's message cap however
   many ranks there are), then watch from the next revision, so no change is
   missed between the two; a record is checked against the cluster CA
   (``cluster_ca``: its signer's certificate, name and role) before
   anything else, and a verified record's layout is fetched from its
   ``layouts/<digest>`` key the first time a digest is seen, checked
   against the digest, and kept (within the view's bounds: at most
   ``MAX_LAYOUTS`` layouts and ``MAX_LAYOUT_CACHE_BYTES``, each fetch one
   ``timeout``, so a pass fetches at most that many, each under the 1 MiB
   ``MAX_LAYOUT_BYTES``);
4. probe etcd every ``ttl / 3`` (the lease refresh, or a linearizable read
   for a rank that only watches), because a member that lost its quorum
   keeps a watch open and silent.

A write by anyone else over this rank's own key (garbage, a forged
endpoint) is answered by putting the record back at once.  Records that do
not decode change nothing (the view keeps the last valid one, for at most
one ``ttl``: after that the rank counts as gone, since a live publisher
would have put its own back) and are
logged once per key per ``REJECT_LOG_EVERY`` seconds.

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
from ..security.credentials import CA_ENV, Credentials
from .etcd_client import (
    ETCD_CA_ENV,
    ETCD_CERT_ENV,
    ETCD_KEY_ENV,
    ETCD_PASSWORD_ENV,
    ETCD_USER_ENV,
    etcd_security_from_env,
    parse_endpoint,
    read_pem,
    tls_client,
)
from .records import RankRecord, layout_key, record_key
from .signing import RecordSigner, RecordVerifier
from .view import Change, ClusterView

__all__ = [
    "ETCD_CA_ENV", "ETCD_CERT_ENV", "ETCD_KEY_ENV", "ETCD_PASSWORD_ENV", "ETCD_USER_ENV", "MIN_TTL", "PAGE",
    "REJECT_LOG_EVERY", "Listener", "Registry", "cluster_ca_from_env", "etcd_security_from_env",
]

log = logging.getLogger(__name__)

Listener = Callable[[list[Change]], None]
MIN_TTL = 1.0  # etcd refuses shorter leases with the fast raft timings used here (2 s with its defaults)
_BACKOFF = (0.05, 1.0)
PAGE = 16  # keys per prefix read: 16 values at etcd's 1.5 MiB request cap stay under the receive cap below
_MAX_RECEIVE = 32 << 20  # gRPC's default is 4 MiB
_MINE_KEPT = 8  # the last values put for this rank: their watch events are not someone else's writes
REJECT_LOG_EVERY = 60.0
_PUT_BACK_GAP = 0.1  # two processes publishing one identity trade at most ~10 puts a second


def cluster_ca_from_env(environ: Mapping[str, str] | None = None) -> bytes:
    """The cluster CA's PEM from the file ``$KVLEND_CA`` names: what a reader checks records against."""
    import os

    path = (os.environ if environ is None else environ).get(CA_ENV)
    if not path:
        raise RegistryError(f"reading the cluster registry needs the cluster CA to check records: set ${CA_ENV}")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise RegistryError(f"cluster CA {path!r}: {exc.strerror or exc}") from None


class Registry:
    """Publishes this rank's record (optional) and keeps a live ``ClusterView`` of the prefix.

    ``endpoints``: etcd client endpoints as ``host:port``.  ``ttl``: seconds
    a record outlives its rank (etcd leases count whole seconds).  ``timeout``: the deadline of each etcd call.
    ``update_interval``: the least time between two puts of a changing
    record (load changes are coalesced).  etcd's own security: ``username`` and ``password``
    (etcd's auth: both or neither), ``ca_file`` (PEM: TLS to etcd, its server certificate checked
    against it), ``cert_file`` and ``key_file`` (PEM: a client certificate, for etcd's
    ``--client-cert-auth``; TLS only), or ``etcd_credentials`` (a rank's ``Credentials``: their CA checks
    etcd's server certificate and their certificate is the client's, when etcd runs from the cluster CA).
    ``cluster_ca``: the PEM of the cluster CA, whose rank certificates must sign every record read
    (``signing``; ``cluster_ca_from_env`` reads ``$KVLEND_CA``).  Listeners get each batch of
    ``Change`` on the registry thread; they must be quick and must not call
    back into a blocking wait.
    """

    def __init__(self, endpoints: Sequence[str], prefix: str = "/kvlend/default", *, cluster_ca: bytes,
                 ttl: float = 5.0, timeout: float = 2.0, update_interval: float = 0.25,
                 username: str | None = None, password: str | None = None, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None,
                 etcd_credentials: Credentials | None = None) -> None:
        if isinstance(endpoints, str) or not endpoints:
            raise RegistryError(f"endpoints: expected a non-empty list of host:port, got {endpoints!r}")
        self.endpoints = [parse_endpoint(e) for e in endpoints]
        for name, value, low in (("ttl", ttl, MIN_TTL), ("timeout", timeout, 0.05),
                                 ("update_interval", update_interval, 0.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < 3600:
                raise RegistryError(f"{name}: expected seconds in [{low}, 3600), got {value!r}")
        if (username is None) != (password is None):
            raise RegistryError("etcd username and password: give both or neither")
        if (cert_file is None) != (key_file is None) or (cert_file is not None and ca_file is None):
            raise RegistryError("etcd cert_file and key_file: give both, with ca_file (a client certificate is TLS)")
        if etcd_credentials is not None and ca_file is not None:
            raise RegistryError("etcd TLS: give etcd_credentials or ca_file (and a client pair), not both")
        self._auth = (username, password)
        self._tls = read_pem(ca_file, cert_file, key_file) if ca_file is not None else None
        if etcd_credentials is not None:
            self._tls = (etcd_credentials.ca_pem, etcd_credentials.cert_pem, etcd_credentials.key_pem)
        self.prefix = prefix
        self.view = ClusterView(prefix, RecordVerifier(cluster_ca))  # read under ``self._cond``; use the queries
        self.ttl, self.timeout, self.update_interval = float(ttl), float(timeout), float(update_interval)
        self._cond = threading.Condition()
        self._listeners: list[Listener] = []
        self._record: RankRecord | None = None
        self._signer: RecordSigner | None = None  # signs ``_record``: the rank's certificate key
        self._lease: int | None = None
        self._published: RankRecord | None = None  # what etcd holds for us, as far as we know
        self._mine: list[bytes] = []  # the values last put for this rank (see ``_foreign``)
        self._layout_stored = ""  # the digest whose ``layouts/`` key this connection has written
        self._reject_logged: dict[str, float] = {}  # key -> when its refusal was last logged
        self._put_back = False  # the next put answers someone else's write over our record
        self._last_put_back = -_PUT_BACK_GAP
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

    def publish(self, record: RankRecord, credentials: Credentials) -> None:
        """Keep ``record`` published under this rank's lease (from now on, and again after reconnects),
        signed with ``credentials`` (the rank's: their identity and role must be the record's).  Publish
        again with renewed credentials to sign with those from then on."""
        if not isinstance(record, RankRecord):
            raise RegistryError(f"publish: expected a RankRecord, got {type(record).__name__}")
        signer = RecordSigner(credentials)
        signer.sign(record)  # refuses another rank's record, or another role's, now rather than at the put
        with self._cond:
            if self._record is not None and self._record.identity != record.identity:
                raise RegistryError(f"this registry publishes {self._record.identity!r}, not {record.identity!r}")
            self._record, self._signer = record, signer
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
    def published(self) -> RankRecord | None:
        """The record this registry keeps published (None before ``publish``, after ``withdraw``)."""
        with self._cond:
            return self._record

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
                           "healthy": r.healthy,
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

    def _client(self, aetcd, host: str, port: int, connect_wait: float):
        options = {"grpc.max_receive_message_length": _MAX_RECEIVE}
        username, password = self._auth
        kind = aetcd.Client if self._tls is None else tls_client(aetcd)
        client = kind(host, port, username=username, password=password, timeout=max(1, round(self.timeout)),
                      options=options, connect_wait_timeout=max(1, round(connect_wait)))
        client.kvlend_tls = self._tls
        return client

    async def _pass(self, aetcd, host: str, port: int) -> None:
        client = self._client(aetcd, host, port, self.timeout)
        self._layout_stored = ""
        try:
            await self._call(client.connect())
            self._endpoint = f"{host}:{port}"
            await self._keep_record(client)
            prefix = self.view.prefix.encode()
            revision, items = await self._read_prefix(aetcd, client, prefix)
            await self._fetch_layouts(client, [value for _, value in items])
            with self._cond:
                changes = self.view.reset(revision, items, time.monotonic())
                rejected = dict(self.view.rejected)
                was = self.view.degraded_since
                self.view.mark_healthy()
                self._ready = True
            if was is not None:
                log.warning("cluster registry recovered at %s after %.1f s", self._endpoint, time.monotonic() - was)
            for key, why in rejected.items():
                self._log_rejected(key, why)
            self._notify(changes)
            watch = await self._call(client.watch_prefix(prefix, start_revision=revision + 1))
            watcher = asyncio.ensure_future(self._watch(client, watch, aetcd.rtypes.EventKind.DELETE))
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

    async def _read_prefix(self, aetcd, client, prefix: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Every key under ``prefix`` at one revision, ``PAGE`` keys a read (etcd ranges with a limit,
        each page from the key after the last one)."""
        end = aetcd.utils.prefix_range_end(prefix)
        start, revision, items = prefix, 0, []
        while True:
            request = aetcd.rpc.RangeRequest(key=start, range_end=end, limit=PAGE, revision=revision)
            reply = await self._call(client.kvstub.Range(request, timeout=self.timeout, metadata=client.metadata))
            revision = revision or reply.header.revision  # later pages read the first page's revision
            items.extend((kv.key, kv.value) for kv in reply.kvs)
            if not reply.more or not reply.kvs:
                return revision, items
            start = reply.kvs[-1].key + b"\0"

    async def _fetch_layouts(self, client, values: Iterable[bytes]) -> None:
        """Fetch the layouts these record values name that the view does not know yet.

        One missing or wrong is left out (the record naming it is then refused, and listed as such)."""
        with self._cond:
            wanted = {d for d in map(self.view.wanted_layout, values) if d is not None}
        for digest in sorted(wanted):
            with self._cond:
                room = self.view.make_room(keep=wanted)
            if not room:  # full of live ranks' layouts: the records naming the rest are refused (and logged)
                break
            got = await self._call(client.get(layout_key(self.prefix, digest).encode()))
            if got is None:
                continue
            try:
                with self._cond:
                    self.view.learn_layout(digest, got.value, keep=wanted)
            except RegistryError as exc:
                self._log_rejected(layout_key(self.prefix, digest), str(exc))

    async def _watch(self, client, watch, delete) -> None:
        try:
            async for event in watch:
                kv = event.kv
                if event.kind != delete:
                    await self._fetch_layouts(client, [kv.value])
                with self._cond:
                    if event.kind == delete:
                        changes = self.view.delete(kv.mod_revision, kv.key)
                        mine = self._record is not None and any(
                            c.record.identity == self._record.identity for c in changes)
                        if mine:  # deleted by hand while we live: put it back (``_keep`` wakes now)
                            self._published = None
                    else:
                        changes = self.view.put(kv.mod_revision, kv.key, kv.value, time.monotonic())
                        mine = self._foreign(kv)
                        if mine:  # someone else wrote over our record: put ours back
                            self._published, self._put_back, self._layout_stored = None, True, ""
                        why = self.view.rejected.get(kv.key.decode("utf-8", "replace"))
                if event.kind != delete and why is not None:
                    self._log_rejected(kv.key.decode("utf-8", "replace"), why)
                if mine and event.kind != delete:
                    self._warn_every(f"own:{kv.key!r}", "cluster registry: another writer replaced this rank's "
                                     "record at revision %d; putting it back (two ranks with one identity trade "
                                     "puts like this)", kv.mod_revision)
                self._notify(changes)
                if mine:
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
            with self._cond:  # a rank whose key holds a refused value for a TTL: its publisher is not there
                gone = self.view.expire_refused(time.monotonic(), self.ttl)
            if gone:
                self._notify(gone)
            if time.monotonic() >= next_probe:
                if self._lease is not None:
                    await self._refresh(client)
                else:
                    await self._call(client.get(f"{self.prefix}/probe".encode()))  # linearizable: needs a quorum
                next_probe = time.monotonic() + probe_every
            if put and self.update_interval:
                await asyncio.sleep(self.update_interval)  # coalesce a burst of updates into one put
            else:
                await self._nap(next_probe - time.monotonic())

    def _foreign(self, kv) -> bool:
        """Whether a put event on ``kv`` is someone else's write over this rank's own key (under ``_cond``)."""
        if self._record is None or kv.key != record_key(self.prefix, self._record.identity).encode():
            return False
        return kv.lease != self._lease or kv.value not in self._mine

    def _log_rejected(self, key: str, why: str) -> None:
        self._warn_every(key, "cluster registry: ignoring %r (the last valid record stays): %s", key[:300], why)

    def _warn_every(self, key: str, message: str, *args) -> None:
        """A warning about ``key``, at most once per ``REJECT_LOG_EVERY`` s (a hostile writer sets the pace)."""
        now = time.monotonic()
        if now - self._reject_logged.get(key, -REJECT_LOG_EVERY) < REJECT_LOG_EVERY:
            return
        if len(self._reject_logged) >= 1024:
            self._reject_logged.clear()
        self._reject_logged[key] = now
        log.warning(message, *args)

    async def _keep_record(self, client) -> bool:
        """Put the record if etcd may not hold the current one (first time, changed, reconnected);
        revoke the lease of a withdrawn one."""
        with self._cond:
            record, withdrawn, signer = self._record, self._withdrawn, self._signer
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
        if self._put_back:  # answering someone else's write: at most one put-back per ``_PUT_BACK_GAP``
            self._put_back = False
            await asyncio.sleep(max(0.0, self._last_put_back + _PUT_BACK_GAP - time.monotonic()))
            self._last_put_back = time.monotonic()
        if record.layout and self._layout_stored != record.layout_digest:
            await self._store_layout(client, record)
        value = signer.sign(record)
        with self._cond:  # before the put: a foreign write seen meanwhile clears it again (a failed put degrades)
            self._mine = [*self._mine[-(_MINE_KEPT - 1):], value]
            self._published = record
        await self._call(client.put(record_key(self.prefix, record.identity).encode(), value, lease=self._lease))
        return True

    async def _store_layout(self, client, record: RankRecord) -> None:
        """Make sure ``layouts/<digest>`` holds this rank's layout (once per connection and digest).

        Written without a lease: it is content-addressed, so every rank with the same layout writes
        the same bytes, and a layout outliving its ranks costs one key per distinct layout."""
        key = layout_key(self.prefix, record.layout_digest).encode()
        stored = await self._call(client.get(key))
        if stored is None or stored.value != record.layout:
            await self._call(client.put(key, record.layout))
        self._layout_stored = record.layout_digest

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
            client = self._client(aetcd, host, port, 1)
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
