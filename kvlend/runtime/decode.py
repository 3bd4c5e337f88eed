"""``DecodeNode``: a ``DecodeSession`` behind sockets, a backend and (optionally) a thread.

The engine starts fetches and gets handles back at once; many may be in
flight, from many prefills, sharing one link per prefill endpoint.  It
collects the finished ones with ``finished()`` (the way vLLM's
``get_finished`` runs each step) or waits on some with a deadline.
``on_finished(handle)`` hears of each as it finishes, on the loop's thread
and never under the node's lock, before ``finished()`` returns it: an engine
that steps only when it has work still logs a fetch when it ends.

Thread-safety: every public method may be called from any engine thread;
after ``start()`` the node's thread does all I/O, otherwise the engine's
calls to ``step``, ``wait``, ``fetch`` and ``next_offer`` drive it.  Handles
are safe to read from any thread.

With a ``Registry`` the node publishes a ``decode`` record (port 0: it only
dials out; ``load`` = fetches in flight) and trusts the registry, while it is
healthy, on which prefills exist: a ticket naming a prefill the registry
does not list fails at once without dialling, unless a live link
authenticated as that prefill: a record that leaves (deleted by anyone who
can write to etcd, or lapsed) stops new routing there but closes nothing,
since the link's own liveness (TLS, heartbeats, its deadlines) decides
whether its prefill is there.  A record that moves its endpoint breaks
nothing live either: a ticket rides the open link that authenticated as
its prefill, wherever either says it is, and only a new connection dials
the record's endpoint.  While
the registry is degraded, tickets are redeemed at the endpoint they name
(an etcd outage says nothing about the prefills).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from ..cluster.records import RankRecord
from ..core.negotiate import TransferPlan
from ..core.text import printable
from ..errors import ConfigError, KvlendError, PeerLost, TransferTimeout, UsageError
from ..metrics import METRICS
from ..protocol.actions import FetchFinished, Offered, PeerReady
from ..protocol.config import NodeConfig
from ..protocol.decode import DecodeSession, Fetch, FetchState, clone_error
from ..protocol.fetch import phases
from ..protocol.ticket import Ticket
from ..protocol.wire import LeaseOffer
from ..security.credentials import Credentials
from ..transport import TransferBackend
from .clock import lease_clock
from .membership import Membership, rank_record
from .shell import Shell, log

if TYPE_CHECKING:
    from ..cluster.registry import Registry


@dataclass(frozen=True)
class FetchResult:
    request: str
    bound: int
    bytes: int
    descriptors: int
    seconds: float
    resumed_from: int = 0  # tokens below this were read by an earlier lease, not this one
    read_seconds: float | None = None  # posting the reads to the last landing (``seconds`` adds claim and ack)


@dataclass(frozen=True)
class Link:
    """A connected prefill endpoint: pass it back to ``fetch`` and ``decline``."""

    id: int
    host: str
    port: int
    peer: str
    plan: TransferPlan
    handshake_ms: float


class FetchHandle:
    """One fetch in flight: its state, bound so far and error; ``cancel()`` gives up on it."""

    def __init__(self, node: DecodeNode, fetch: Fetch) -> None:
        self._node = node
        self._fetch = fetch

    @property
    def id(self) -> int:
        return self._fetch.id

    @property
    def request(self) -> str:
        return self._fetch.request

    @property
    def state(self) -> FetchState:
        return self._fetch.state

    @property
    def done(self) -> bool:
        """Finished, successfully or not; nothing can still land in the destination."""
        return self._fetch.done

    @property
    def ok(self) -> bool:
        return self._fetch.state is FetchState.DONE

    @property
    def quiet(self) -> bool:
        """No read of this fetch is in flight: its destination pages may be reused (if it failed)."""
        return self._fetch.quiet

    @property
    def bound(self) -> int:
        """The safe-resume bound so far (tokens of ``dst`` holding verified KV)."""
        return self._fetch.bound

    @property
    def error(self) -> KvlendError | None:
        return self._fetch.error

    @property
    def early_bytes(self) -> int:
        """Bytes whose reads were posted before the lease was final: what a progressive lease's reader
        read while its prefill still computed (0 for a lease lent whole)."""
        return self._fetch.early_bytes

    @property
    def timeline(self) -> dict[str, float | None]:
        """Seconds from the start to each step so far (None: not reached): ``claimed`` (claim sent),
        ``granted`` (the claim answered, or a held offer taken), ``posted`` (the reads posted),
        ``final`` (the whole lease was lent: a progressive one's last extend), ``first_landed`` and
        ``landed`` (the first and the last read landed), ``usable`` (its pages hold verified KV),
        ``acked`` (the prefill answered its done), ``finished``.  For profiling where a fetch's time goes."""
        f = self._fetch
        return {name: None if at is None else at - f.started
                for name, at in (("claimed", f.claimed_at), ("granted", f.granted_at), ("posted", f.posted),
                                 ("final", f.final_at), ("first_landed", f.first_landed_at), ("landed", f.landed),
                                 ("usable", f.usable_at), ("acked", f.acked_at), ("finished", f.finished))}

    @property
    def phases(self) -> dict[str, float | None]:
        """Seconds in each step: claim->grant, grant->landed, landed->usable, usable->acked (``fetch.phases``)."""
        return phases(self._fetch)

    @property
    def meta(self) -> Mapping[str, Any]:
        offer = self._fetch.offer
        return {} if offer is None else offer.meta

    def cancel(self) -> None:
        self._node.cancel(self)

    def wait(self, timeout: float) -> FetchResult:
        """Block until done; the result, or raise its error (with ``.request`` and ``.bound``)."""
        self._node.wait([self], timeout)
        return self.result()

    def result(self) -> FetchResult:
        f = self._fetch
        if not f.done:
            raise TransferTimeout(f"fetch {f.id} of request {f.request} has not finished")
        if f.error is not None:
            raise f.error
        return FetchResult(f.request, f.bound, f.bytes, f.descriptors, f.seconds, f.resume_from, f.read_seconds)

    def __repr__(self) -> str:
        return f"FetchHandle({self.id}, request={self.request!r}, state={self.state.value}, bound={self.bound})"


class DecodeNode(Shell):
    """Reads leases offered by, or ticketed from, prefill ranks into this rank's pages.

    ``registry``: publish this rank there and check tickets against it (one registry per rank;
    the caller starts it and closes it after the node).  ``capacity``: the fetches this rank
    takes at once (default ``config.quotas.max_leases_per_peer``).  ``meta``: a few strings for
    the record (the engine's API address, say); its host is this machine's name.
    ``on_finished(handle)``: called once per fetch as it finishes (see the module's docstring).
    """

    ROLE = "decode"
    PEER_ROLES = ("prefill",)

    def __init__(self, layout, backend: TransferBackend, credentials: Credentials, *,
                 config: NodeConfig = NodeConfig(), clock: Callable[[], float] = lease_clock,
                 registry: Registry | None = None, capacity: int | None = None,
                 meta: Mapping[str, str] | None = None,
                 on_finished: Callable[[FetchHandle], None] | None = None) -> None:
        self.on_finished = on_finished or (lambda handle: None)
        super().__init__(None, backend, credentials, clock, config)
        record = None if registry is None else rank_record(
            self.name, "decode", (socket.gethostname() or "localhost")[:255], 0, layout, config, capacity, meta)
        backend.register(layout.regions)
        self.layout = layout
        self.session = DecodeSession(layout, backend.kind, name=self.name, config=config,
                                     read_window=getattr(backend, "read_window", None))
        self.tracker = self.session.tracker
        self._handles: dict[int, FetchHandle] = {}
        self._finished: list[FetchHandle] = []
        self._batching = 0  # open batch() blocks: start_fetch leaves the flush to the last one's end
        self._offers: deque[tuple[Link, LeaseOffer]] = deque()
        if registry is not None:
            self._join(Membership(registry, self._wake, load=lambda: len(self._handles)), record)

    # ----------------------------------------------------------------- links
    def connect(self, host: str, port: int, timeout: float | None = None) -> Link:
        """The link to ``host:port`` once it is ready: authenticated, layouts exchanged, plan made.

        Reuses an open link; raises ``AuthError`` (TLS refused either side's certificate),
        ``PeerLost``, ``LayoutMismatch``, ``PeerProtocolError`` or ``TransferTimeout`` (after ``timeout``,
        default the config's ``handshake_timeout``).
        """
        with self._lock:
            conn = self.session.link_to(host, port, self.clock())
        self._wake()
        failure: list[KvlendError] = []

        def ready() -> bool:
            if self.session.ready(conn):
                return True
            if conn not in self.session.links:
                failure.append(self._link_error(conn))
                return True
            return False

        self._wait_until(ready, timeout or self.config.handshake_timeout, f"no handshake with {host}:{port}")
        if failure:
            raise failure[0]
        with self._lock:
            return self._link(conn)

    @property
    def links(self) -> list[Link]:
        """The open links that are ready."""
        with self._lock:
            return [self._link(c) for c in self.session.links if self.session.ready(c)]

    def disconnect(self, link: Link) -> None:
        with self._lock:
            self.session.disconnect(link.id, self.clock())
        self._wake()

    # --------------------------------------------------------------- fetches
    def start_fetch(self, source: Ticket | str | bytes | LeaseOffer, dst: Mapping[str, Any], *,
                    link: Link | None = None, resume_from: int = 0, timeout: float | None = None,
                    prompt_digest: bytes | None = None) -> FetchHandle:
        """Start reading ``source`` into ``dst`` (local group -> slot per local token page); never blocks.

        ``source`` is a ticket (object, bytes or text: the prefill is connected on first use) or an
        offer pushed over ``link``.  ``timeout`` (default ``config.transfer_timeout``) bounds the
        fetch up to the prefill's done ack.  Bad arguments raise here, before anything changes, and
        so does a ticket the registry (when healthy) rules out: ``PeerLost`` if its prefill is not
        listed (see ``_registered``, also for a prefill listed at another endpoint).
        ``prompt_digest``: ``kvlend.prompt_digest`` of the prompt ``dst`` is for, sent with the claim; a
        ticket lent for another prompt then fails (``PromptMismatch``) before any byte moves.
        """
        started = time.perf_counter()
        with self._lock:
            now = self.clock()
            if isinstance(source, LeaseOffer) or link is not None:
                if link is None:
                    raise UsageError("a pushed offer needs the link it came over")
                if prompt_digest is not None:
                    raise UsageError("a pushed offer was lent to this rank by name: it takes no prompt_digest")
                fetch = self.session.fetch_offer(link.id, source, dst, now, resume_from, timeout)
            else:
                fetch = self.session.fetch_ticket(self._registered(_ticket(source), resume_from), dst, now,
                                                  resume_from, timeout, prompt_digest)
            handle = self._handles[fetch.id] = FetchHandle(self, fetch)
        self._wake()
        if not self.threaded and not self._batching:
            self.flush()  # post now: the engine drives the loop
        METRICS.observe("kvlend_post_seconds", time.perf_counter() - started)
        return handle

    @contextlib.contextmanager
    def batch(self):
        """Start several fetches as one (an engine step's): on a node without a loop thread, their
        claims and reads go out when the block ends, one write per prefill, not one per fetch.  A
        node with a loop thread sends as soon as the thread runs (blocks are accepted, change nothing)."""
        self._batching += 1
        try:
            yield self
        finally:
            self._batching -= 1
            if not self._batching and not self.threaded:
                self.flush()

    def claim(self, ticket: Ticket | str | bytes, prompt_digest: bytes | None = None) -> None:
        """Claim ``ticket``'s lease now and keep it alive until ``start_fetch(ticket, ...)`` reads it.

        For an engine that learns of a request before it has pages for it (vLLM: at arrival,
        before blocks are allocated); ``unclaim`` gives it back unread.  Never blocks; refuses what
        ``start_fetch`` would refuse by the registry.  ``prompt_digest``: as for ``start_fetch``, which
        must then give the same.
        """
        ticket = self._registered(_ticket(ticket))
        with self._lock:
            self.session.claim_ticket(ticket, self.clock(), prompt_digest)
        self._wake()
        if not self.threaded:
            self.flush()

    def unclaim(self, ticket: Ticket | str | bytes) -> None:
        """Give back a lease claimed with ``claim`` and never fetched."""
        ticket = _ticket(ticket)
        try:
            ticket = self._registered(ticket)  # where ``claim`` sent it
        except PeerLost:
            pass
        with self._lock:
            self.session.unclaim(ticket)
        self._wake()

    def finished(self) -> list[FetchHandle]:
        """Fetches that finished since the last call (progresses the loop when it has no thread)."""
        if not self.threaded:
            self.step(0.0)
        with self._lock:
            out, self._finished = self._finished, []
            return out

    def wait(self, handles: Iterable[FetchHandle], timeout: float) -> None:
        """Block until every handle is done; ``TransferTimeout`` after ``timeout`` s (they go on)."""
        handles = list(handles)
        self._wait_until(lambda: all(h.done for h in handles), timeout,
                         f"{sum(not h.done for h in handles)} of {len(handles)} fetches not finished")

    def cancel(self, handle: FetchHandle) -> None:
        with self._lock:
            self.session.cancel(handle.id, self.clock())
        self._wake()

    def fetch(self, link: Link, offer: LeaseOffer, dst: Mapping[str, Any], *, resume_from: int = 0,
              timeout: float | None = None) -> FetchResult:
        """Read a pushed offer and wait: the result, or raise (``.request`` and ``.bound`` set).

        The blocking form of ``start_fetch``; it never waits much past ``timeout`` plus
        ``cancel_grace`` (the session's own deadlines end the fetch first).
        """
        handle = self.start_fetch(offer, dst, link=link, resume_from=resume_from, timeout=timeout)
        limit = timeout or self.config.transfer_timeout
        self.wait([handle], limit + self.config.cancel_grace + 1.0)
        return handle.result()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self.session.in_flight

    # -------------------------------------------------------------- registry
    def compatible_prefills(self) -> list[RankRecord]:
        """The live prefills whose layout this rank can read (``negotiate`` accepts it), by identity."""
        if self.registry is None:
            raise ConfigError("compatible_prefills: this decode node was built without a registry")
        return self.registry.compatible(self.layout)

    def _registered(self, ticket: Ticket, resume_from: Any = 0) -> Ticket:
        """``ticket`` as this rank should redeem it; ``PeerLost`` without dialling if the registry rules it out.

        A ready link that authenticated as the ticket's prefill carries it, listed or not, wherever
        the ticket or the record says it is (a link's certificate proves who it is; a record's
        presence or endpoint proves nothing).  Otherwise: not listed (healthy registry): ``PeerLost``,
        the prefill is gone; listed at another endpoint than the ticket's: to the listed endpoint,
        where the channel checks the certificate and the prefill itself answers for the lease (a
        restarted process refuses it: ``LeaseUnknown``).  Degraded (or not yet ready): as is.
        """
        registry = self.registry
        if registry is None or registry.degraded:
            return ticket
        record = registry.get(ticket.prefill)
        if record is not None and record.role == "prefill" and record.endpoint == ticket.endpoint:
            return ticket
        with self._lock:
            for conn in self.session.links:
                info = self.session.link_info(conn)
                if info["peer"] == ticket.prefill and self.session.ready(conn):
                    host, port = info["endpoint"]
                    return replace(ticket, host=host, port=port)
        if record is None or record.role != "prefill":
            error = PeerLost(
                f"prefill {ticket.prefill!r} is not in the cluster registry (it left or never joined): lease "
                f"{ticket.lease.hex()} cannot be read; not dialling {ticket.host}:{ticket.port}")
            error.request, error.bound = "", resume_from  # as on a fetch's error: nothing was read
            raise error
        return replace(ticket, host=record.host, port=record.port)

    # ---------------------------------------------------------------- offers
    def next_offer(self, timeout: float) -> tuple[Link, LeaseOffer]:
        """The next lease pushed by a prefill rank still connected (offers from lost links are dropped)."""
        def ready() -> bool:
            while self._offers and not self.session.ready(self._offers[0][0].id):
                self._offers.popleft()  # its lease expires on the prefill; nobody can read it now
            return bool(self._offers) or not self.session.links

        self._wait_until(ready, timeout, "no lease offered")
        with self._lock:
            if not self._offers:
                raise self._link_error(None)
            return self._offers.popleft()

    def decline(self, link: Link, offer: LeaseOffer, reason: str) -> None:
        """Tell the prefill this rank will not read ``offer``: it releases it at once."""
        with self._lock:
            self.session.decline(link.id, offer, reason)
        self._wake()

    def close(self) -> None:
        """Close every link in order; fetches still in flight fail once quiet.  Idempotent."""
        if self._closed:
            return
        self._leave()  # the record leaves now
        with self._lock:
            for conn in self.session.links:
                self.session.disconnect(conn, self.clock(), "decode shutting down")
        self._wake()
        try:  # let cancelled reads go quiet before the agent goes
            self._wait_until(lambda: not self.session.in_flight, self.config.cancel_grace, "fetches still in flight")
        except TransferTimeout as exc:
            log.warning("decode %s closing: %s", self.name, printable(exc))
        self._shutdown()

    # ------------------------------------------------------------------ loop
    def _read_done(self, tag: bytes, error: KvlendError | None, now: float) -> None:
        self.session.completed(tag, error, now)

    def _deliver(self, events: list) -> None:
        finished = []
        with self._lock:
            for event in events:
                if isinstance(event, FetchFinished):
                    handle = self._handles.pop(event.fetch.id, None)
                    self.session.forget(event.fetch.id)
                    if handle is not None:
                        finished.append(handle)
                        _record(handle)
                elif isinstance(event, PeerReady):
                    info = self.session.link_info(event.conn)
                    if info is not None:
                        METRICS.observe("kvlend_handshake_seconds", info["handshake_ms"] / 1e3)
                elif isinstance(event, Offered) and self.session.link_info(event.conn) is not None:
                    self._offers.append((self._link(event.conn), event.offer))
            self._changed.notify_all()
        for handle in finished:
            try:
                self.on_finished(handle)
            except Exception:
                log.exception("decode %s: on_finished failed for fetch %d", self.name, handle.id)
        if finished:
            with self._lock:
                self._finished.extend(finished)

    def _link(self, conn: int) -> Link:
        info = self.session.link_info(conn)
        host, port = info["endpoint"]
        return Link(conn, host, port, info["peer"], info["plan"], info["handshake_ms"])

    def _link_error(self, conn: int | None) -> KvlendError:
        error = None if conn is None else self.session.link_error(conn)
        if error is not None:
            return clone_error(error)
        return PeerLost("no prefill rank is connected" if conn is None else f"link {conn} closed")


def _ticket(source) -> Ticket:
    if isinstance(source, Ticket):
        return source
    if isinstance(source, str):
        return Ticket.from_text(source)
    if isinstance(source, (bytes, bytearray)):
        return Ticket.decode(bytes(source))
    raise UsageError(f"expected a Ticket (object, bytes or text) or a LeaseOffer, got {type(source).__name__}")


def _record(handle: FetchHandle) -> None:
    f = handle._fetch
    if f.error is not None:
        METRICS.inc("kvlend_failed_transfers_total", type(f.error).__name__)
        return
    METRICS.observe("kvlend_transfer_seconds", f.seconds)
    METRICS.observe("kvlend_transfer_bytes", f.bytes)
    METRICS.observe("kvlend_transfer_descriptors", f.descriptors)
    if f.resume_from:
        METRICS.inc("kvlend_resumes_total")
