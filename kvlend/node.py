"""Prefill and decode endpoints: the thin I/O shell around the pure core.

``PrefillNode`` registers its pools once, authenticates decode ranks on the
control channel, checks their layouts, lends pages and offers the leases.
``DecodeNode`` connects, negotiates a plan (cached per pair of layouts),
reads each lease in chunks, tracks delivery and only reports success once
the prefill confirms the lease was still valid when the reads ended.
Every wait has a deadline; nothing here is clever.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from .backend import TransferBackend
from .control import DEFAULT_HOST, Channel, Listener, connect, wait_readable
from .errors import (
    ConfigError, KvlendError, LayoutMismatch, LeaseExpired, LeaseUnknown, PageRangeError, PeerLost, ProtocolError,
    TransferTimeout, TrackerError,
)
from .layout import PageLayout, RowSelection
from .lender import Lease, Lender
from .metrics import METRICS
from .negotiate import TransferPlan, negotiate
from .plan import plan_reads
from .tracker import DeliveryTracker
from .wire import Abort, Bye, Done, DoneAck, Handshake, Heartbeat, LeaseOffer, Message, Offer, check_offer

log = logging.getLogger(__name__)

# The prefill sends while holding its lock: a decode that stops reading is dropped
# after this long rather than stalling every other peer.
SEND_TIMEOUT = 2.0


@dataclass(frozen=True)
class NodeConfig:
    """Timeouts (seconds) and sizes shared by both ends."""

    ttl: float = 30.0  # lease lifetime without a heartbeat
    heartbeat: float = 1.0  # decode renews leases this often while reading
    handshake_timeout: float = 10.0
    transfer_timeout: float = 30.0  # one lease, posting to the prefill's done ack
    chunk_pages: int = 256  # remote token pages per posted chunk

    def __post_init__(self) -> None:
        for name in ("ttl", "heartbeat", "handshake_timeout", "transfer_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"NodeConfig.{name} must be a positive number of seconds, got {value!r}")
        if self.heartbeat >= self.ttl:
            raise ConfigError(f"NodeConfig.heartbeat {self.heartbeat} must be shorter than ttl {self.ttl}")
        if isinstance(self.chunk_pages, bool) or not isinstance(self.chunk_pages, int) or self.chunk_pages < 1:
            raise ConfigError(f"NodeConfig.chunk_pages must be an int >= 1, got {self.chunk_pages!r}")


def _handshake(layout: PageLayout, backend: TransferBackend) -> Handshake:
    return Handshake(layout=layout.encode(), backend=backend.kind, metadata=backend.metadata())


def _peer_layout(message: Message, backend: TransferBackend) -> PageLayout:
    if not isinstance(message, Handshake):
        raise ProtocolError(f"expected handshake, got {message.TYPE}")
    if message.backend != backend.kind:
        raise ProtocolError(f"peer uses transfer backend {message.backend!r}, we use {backend.kind!r}")
    return PageLayout.decode(message.layout)


# ------------------------------------------------------------------ prefill
class _Goodbye(KvlendError):
    """A peer closed the channel in order."""


@dataclass(eq=False)
class _DecodePeer:
    channel: Channel
    layout: PageLayout | None = None


class PrefillNode:
    """Lends pages of ``layout`` to authenticated decode ranks.

    ``on_release(lease, reason)`` is called when a lease ends (``"done"``,
    ``"aborted"`` or ``"expired"``): the engine may then reuse its pages.
    """

    def __init__(
        self,
        layout: PageLayout,
        backend: TransferBackend,
        secret: bytes,
        *,
        name: str = "prefill",
        host: str = DEFAULT_HOST,
        port: int = 0,
        config: NodeConfig = NodeConfig(),
        on_release: Callable[[Lease, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.layout = layout
        self.backend = backend
        self.config = config
        self.name = name
        self.lender = Lender(layout)
        self.on_release = on_release or (lambda lease, reason: None)
        self.clock = clock
        self.listener = Listener(secret, name, host, port)  # a port in use fails before anything is registered
        try:
            backend.register(layout.regions)
        except BaseException:
            self.listener.close()
            raise
        self.peers: dict[str, _DecodePeer] = {}
        METRICS.gauge("kvlend_active_leases", lambda: self.lender.active_leases, name)
        METRICS.gauge("kvlend_locked_pages", lambda: self.lender.locks.locked_pages(), name)
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self, interval: float = 0.002) -> None:
        """Serve peers from a background thread, so done acks and NIXL progress
        do not wait for the engine's next iteration; ``offer`` stays safe to call."""
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.step(interval)
                except Exception:  # keep serving the other leases; the engine sees it in the log
                    log.exception("prefill %s: step failed", self.name)
                    self._stop.wait(interval)

        self._thread = threading.Thread(target=loop, name=f"kvlend-{self.name}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.host, self.listener.port

    def ready_peers(self) -> list[str]:
        with self._lock:
            return [n for n, p in self.peers.items() if p.layout is not None]

    def wait_for_peers(self, count: int, timeout: float) -> list[str]:
        """Wait until ``count`` decode ranks completed the handshake; their names, sorted."""
        deadline = self.clock() + timeout
        while len(self.ready_peers()) < count:
            if self.clock() > deadline:
                raise TransferTimeout(f"{len(self.ready_peers())} of {count} decode ranks completed the "
                                      f"handshake within {timeout:.3g} s")
            if self._thread is None:
                self.step(0.01)
            else:
                time.sleep(0.005)
        return sorted(self.ready_peers())

    def wait_for_peer(self, timeout: float) -> str:
        return self.wait_for_peers(1, timeout)[0]

    def offer(
        self, peer: str, request: str, num_tokens: int, pages: Mapping[str, Any],
        selection: RowSelection = RowSelection.all(), meta: Mapping[str, Any] | None = None,
    ) -> Lease:
        """Lend ``request``'s pages to ``peer`` and send it the offer."""
        with self._lock:
            return self._offer(peer, request, num_tokens, pages, selection, meta)

    def _offer(self, peer, request, num_tokens, pages, selection, meta) -> Lease:
        target = self.peers.get(peer)
        if target is None or target.layout is None:
            raise PeerLost(f"decode rank {peer!r} is not connected")
        meta = check_offer(request, meta or {})
        lease = self.lender.lend(request, num_tokens, pages, selection, self.clock(), self.config.ttl, peer=peer)
        offer = LeaseOffer(lease.id, request, num_tokens, lease.pages, selection, lease.ttl, meta)
        try:
            target.channel.send(Offer(offer), timeout=SEND_TIMEOUT)
        except ProtocolError:  # too large to frame: nothing was sent, the channel is intact
            self._end(lease.id, "aborted")
            raise
        except KvlendError:
            self._end(lease.id, "aborted")
            self._drop(peer, "send failed")
            raise
        METRICS.inc("kvlend_leases_total")
        log.debug("lease %s: offered request %s (%d pages) to %s", lease.hex, request, lease.num_pages, peer)
        return lease

    def step(self, timeout: float = 0.0) -> None:
        """Accept peers, answer their messages, expire leases and progress the backend.

        Waits up to ``timeout`` for something to arrive (without holding the lock).
        """
        wait_readable(self.listener.waitables() + [p.channel for p in list(self.peers.values())], timeout)
        with self._lock:
            self._step()

    def _step(self) -> None:
        while (channel := self.listener.accept(0.0)) is not None:  # never blocks on a half-open hello
            if channel.peer in self.peers:
                self._drop(channel.peer, "replaced by a new connection")
            self.peers[channel.peer] = _DecodePeer(channel)
        for name in list(self.peers):
            self._serve(name)
        for lease in self.lender.expire(self.clock()):
            log.warning("lease %s of request %s expired (peer %s)", lease.hex, lease.request, lease.peer)
            METRICS.inc("kvlend_expired_leases_total")
            self.on_release(lease, "expired")
        self.backend.poll()

    def _serve(self, name: str) -> None:
        peer = self.peers[name]
        try:
            while (message := peer.channel.poll()) is not None:
                self._handle(name, peer, message)
        except _Goodbye as bye:
            self._drop(name, f"said bye: {bye}", logging.INFO)
        except KvlendError as exc:
            self._drop(name, str(exc))

    def _handle(self, name: str, peer: _DecodePeer, message: Message) -> None:
        now = self.clock()
        if peer.layout is None:
            layout = _peer_layout(message, self.backend)
            try:
                plan = negotiate(layout, self.layout)  # refuse a decode we cannot serve before it sees a lease
            except LayoutMismatch:
                # Our layout without backend metadata: the decode negotiates too and names every field.
                peer.channel.send(Handshake(self.layout.encode(), self.backend.kind, b""), timeout=SEND_TIMEOUT)
                raise
            peer.channel.send(_handshake(self.layout, self.backend), timeout=SEND_TIMEOUT)
            peer.layout = layout
            log.info("handshake with %s: %s", name, plan.summary().splitlines()[0])
        elif isinstance(message, Heartbeat):
            for lease_id in message.leases:
                try:
                    self.lender.check_read(lease_id, name, now)
                    self.lender.renew(lease_id, now)
                except KvlendError as exc:
                    log.info("heartbeat for lease %s from %s: %s", lease_id.hex(), name, exc)
        elif isinstance(message, Done):
            try:
                self.lender.check_read(message.lease, name, now)
            except KvlendError as exc:
                peer.channel.send(DoneAck(message.lease, False, f"{type(exc).__name__}: {exc}"), timeout=SEND_TIMEOUT)
                return
            self._end(message.lease, "done")
            peer.channel.send(DoneAck(message.lease, True, ""), timeout=SEND_TIMEOUT)
            log.debug("lease %s: done by %s at bound %d", message.lease.hex(), name, message.bound)
        elif isinstance(message, Abort):
            try:
                self.lender.check_read(message.lease, name, now)
            except KvlendError:
                return
            log.info("lease %s aborted by %s: %s", message.lease.hex(), name, message.reason)
            self._end(message.lease, "aborted")
        elif isinstance(message, Bye):
            raise _Goodbye(message.reason)
        else:
            raise ProtocolError(f"unexpected {message.TYPE} from decode rank {name}")

    def _end(self, lease_id: bytes, reason: str) -> None:
        lease = self.lender.release(lease_id)
        if lease is not None:
            self.on_release(lease, reason)

    def _drop(self, name: str, why: str, level: int = logging.WARNING) -> None:
        """Forget a peer's connection; its leases stay until they expire (its reads may still land)."""
        peer = self.peers.pop(name)
        log.log(level, "dropped decode rank %s: %s", name, why)
        if peer.layout is None:
            try:
                peer.channel.send(Bye(why[:4000]), timeout=1.0)
            except KvlendError:
                pass
        peer.channel.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            for name in list(self.peers):
                self._drop(name, "prefill shutting down", logging.INFO)
            self.listener.close()
        METRICS.remove_gauge("kvlend_active_leases", self.name)
        METRICS.remove_gauge("kvlend_locked_pages", self.name)


# ------------------------------------------------------------------- decode
@dataclass(frozen=True)
class FetchResult:
    request: str
    bound: int
    bytes: int
    descriptors: int
    seconds: float
    resumed_from: int = 0  # tokens below this were read by an earlier lease, not this one


@dataclass(eq=False)
class PrefillLink:
    """One connected prefill rank: its channel, backend peer name and plan."""

    channel: Channel
    agent: str
    plan: TransferPlan
    handshake_ms: float
    offers: deque = field(default_factory=deque)
    # Start of the last read that drained the channel: whatever arrives later was lent after it.
    drained_at: float = 0.0
    lent_after: dict = field(default_factory=dict)  # lease id -> drained_at when its offer was read


class DecodeNode:
    """Reads leases offered by prefill ranks into this rank's pages."""

    def __init__(
        self,
        layout: PageLayout,
        backend: TransferBackend,
        secret: bytes,
        *,
        name: str = "decode",
        config: NodeConfig = NodeConfig(),
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.layout = layout
        self.backend = backend
        self.secret = secret
        self.name = name
        self.config = config
        self.clock = clock
        self.sleep = sleep
        self.tracker = DeliveryTracker(layout)
        self.links: dict[str, PrefillLink] = {}
        self._plans: dict[tuple, TransferPlan] = {}
        self._tags: dict[bytes, tuple[str, int]] = {}  # backend tag -> (request, chunk), until it completes
        self._seq = 0
        backend.register(layout.regions)

    def connect(self, host: str, port: int) -> PrefillLink:
        """Authenticate, exchange layouts and metadata, negotiate; re-handshakes a known peer."""
        start = self.clock()
        channel = connect(host, port, self.secret, self.name, timeout=self.config.handshake_timeout)
        try:
            channel.send(_handshake(self.layout, self.backend))
            reply = channel.recv(self.config.handshake_timeout)
            if isinstance(reply, Bye):
                raise ProtocolError(f"prefill {channel.peer} refused the handshake: {reply.reason}")
            remote = _peer_layout(reply, self.backend)
            # Addresses are not part of a layout id, but the plan holds them: a restarted
            # prefill with the same layout elsewhere in memory needs its own plan.
            key = (self.layout.layout_id, remote.layout_id, tuple((r.name, r.address) for r in remote.regions))
            plan = self._plans.get(key)
            if plan is None:
                if len(self._plans) >= 64:  # prefills that restarted many times: start over
                    self._plans.clear()
                plan = self._plans[key] = negotiate(self.layout, remote)
            if not reply.metadata:
                raise ProtocolError(f"prefill {channel.peer} sent no backend metadata")
            if channel.peer in self.links:
                self.disconnect(channel.peer)
            agent = self.backend.add_peer(reply.metadata)
        except KvlendError:
            channel.close()
            raise
        link = PrefillLink(channel, agent, plan, (self.clock() - start) * 1e3, drained_at=start)
        METRICS.observe("kvlend_handshake_seconds", link.handshake_ms / 1e3)
        self.links[channel.peer] = link
        log.info("handshake with %s: %s", channel.peer, plan.summary().splitlines()[0])
        return link

    def _link(self, peer: str) -> PrefillLink:
        link = self.links.get(peer)
        if link is None:
            raise PeerLost(f"no prefill rank {peer!r} is connected (have {sorted(self.links)})")
        return link

    def disconnect(self, peer: str) -> None:
        self._link(peer)
        link = self.links.pop(peer)
        link.channel.close()
        try:
            self.backend.remove_peer(link.agent)
        except KvlendError as exc:
            log.info("removing NIXL peer %s: %s", link.agent, exc)

    def next_offer(self, timeout: float) -> tuple[str, LeaseOffer]:
        """The next lease offered by any connected prefill rank."""
        deadline = self.clock() + timeout
        while True:
            for peer, link in self.links.items():
                if link.offers:
                    return peer, link.offers.popleft()
            if not self.links:
                raise PeerLost("no prefill rank is connected")
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise TransferTimeout(f"no lease offered within {timeout:.3g} s")
            wait_readable([link.channel for link in self.links.values()], min(remaining, 0.05))
            for peer in list(self.links):
                try:
                    self._pump(peer)
                except (PeerLost, ProtocolError):  # gone, or a channel that can no longer be trusted
                    self.disconnect(peer)  # the next connect to it re-handshakes
                    raise

    def _pump(self, peer: str, timeout: float = 0.0) -> list[DoneAck]:
        """Read what ``peer`` sent: queue offers, return done acks.

        A prefill may close right after its last ack (the example's does once
        its last lease ends), so ack and close can both be waiting here: acks
        already read are returned, and the closed channel raises on the next call.
        """
        link = self.links[peer]
        acks = []
        started = self.clock()
        while True:
            try:
                message = link.channel.poll(timeout)
            except PeerLost:
                if acks:
                    return acks
                raise
            if message is None:
                link.drained_at = started
                return acks
            timeout = 0.0
            if isinstance(message, Offer):
                link.offers.append(message.lease)
                link.lent_after[message.lease.id] = link.drained_at
            elif isinstance(message, DoneAck):
                acks.append(message)
            elif isinstance(message, Bye):
                raise PeerLost(f"prefill {peer} closed: {message.reason}")
            elif isinstance(message, Abort):
                log.info("prefill %s withdrew lease %s: %s", peer, message.lease.hex(), message.reason)
            else:
                raise ProtocolError(f"unexpected {message.TYPE} from prefill {peer}")

    def fetch(self, peer: str, offer: LeaseOffer, dst: Mapping[str, np.ndarray], *,
              resume_from: int = 0) -> FetchResult:
        """Read ``offer`` into the local slots ``dst`` (local group -> slot per local token page).

        Returns once every chunk landed and the prefill confirmed the lease
        was valid throughout.  Otherwise raises (``PeerLost``,
        ``TransferTimeout``, ``LeaseExpired``, ...) with ``.request`` and
        ``.bound`` set on the error (bad arguments -- an unknown peer, a bad
        ``resume_from`` or destination table -- raise first, before anything is
        read, and carry neither): the safe-resume bound in tokens, up to
        which ``dst`` holds verified KV (just ``resume_from`` if the prefill
        refused the done: nothing read under that lease may be used).  A lost
        prefill's link is dropped, so the next ``connect`` to it re-handshakes.

        ``resume_from`` (a bound from an earlier, failed fetch of the same
        request into the same ``dst``) skips every token page wholly below
        it: those pages count as delivered and are not read again.
        """
        link = self._link(peer)
        plan = link.plan
        start = self.clock()
        deadline = start + self.config.transfer_timeout
        resume_from = _resume_point(resume_from, offer.num_tokens)
        # Without the done ack, reads count only if they landed while the lease was surely
        # valid: lent no earlier than ``lent_after``, renewals unconfirmed, one heartbeat of slack.
        sure_until = link.lent_after.pop(offer.id, -math.inf) + offer.ttl - self.config.heartbeat
        safe = [resume_from]
        offer_pages, kept = _skip_below(offer, plan, resume_from)
        # Plan every chunk first: a bad destination table fails before anything is posted or tracked.
        chunks = [(plan_reads(plan, src, dst, offer.selection), local_pages)
                  for src, local_pages in self._chunks(plan, offer, offer_pages)]
        if self._abandoned(offer.request):
            self.tracker.finish(offer.request)  # an earlier attempt's late completions are ignored
        self.tracker.begin(offer.request, offer.num_tokens, self._needed(plan, offer))
        if kept:
            self.tracker.post(offer.request, "resumed", kept)  # read by an earlier lease, verified then
            self.tracker.done(offer.request, "resumed")
        nbytes = ndesc = 0
        next_beat = self.clock() + self.config.heartbeat
        try:
            for batches, local_pages in chunks:
                self._seq += 1
                tag = f"{self.name}:{self._seq}".encode()
                self.backend.post_read(link.agent, batches, tag)
                self.tracker.post(offer.request, self._seq, local_pages)
                self._tags[tag] = (offer.request, self._seq)
                nbytes += sum(b.nbytes for b in batches)
                ndesc += sum(b.count for b in batches)
                if self.clock() >= next_beat:  # posting can be slow (synchronous copies): keep the lease
                    next_beat = self._beat(link, offer)
            posted = self.clock()
            self._await_chunks(peer, offer, deadline, next_beat, sure_until, safe)
            link.channel.send(Done(offer.id, self.tracker.bound(offer.request)))
            ack = self._await_ack(peer, offer, deadline)
        except KvlendError as exc:
            METRICS.inc("kvlend_failed_transfers_total", type(exc).__name__)
            raise self._give_up(peer, offer, exc, sure_until, safe) from None
        bound = self.tracker.bound(offer.request)
        self.tracker.finish(offer.request)
        if not ack.ok:
            kind = LeaseExpired if ack.error.startswith("LeaseExpired") else LeaseUnknown
            error = kind(f"request {offer.request}: prefill refused done ({ack.error}); discard what was read")
            error.request, error.bound = offer.request, resume_from  # nothing read under this lease counts
            METRICS.inc("kvlend_failed_transfers_total", kind.__name__)
            raise error
        result = FetchResult(offer.request, bound, nbytes, ndesc, self.clock() - start, resume_from)
        log.debug("request %s (lease %s): %d bytes in %d descriptors, bound %d, %.2f ms",
                  offer.request, offer.id.hex(), nbytes, ndesc, bound, result.seconds * 1e3)
        METRICS.observe("kvlend_transfer_seconds", result.seconds)
        METRICS.observe("kvlend_post_seconds", posted - start)
        METRICS.observe("kvlend_transfer_bytes", nbytes)
        METRICS.observe("kvlend_transfer_descriptors", ndesc)
        if resume_from:
            METRICS.inc("kvlend_resumes_total")
        return result

    def decline(self, peer: str, offer: LeaseOffer, reason: str) -> None:
        """Tell ``peer`` this rank will not read ``offer``: the prefill releases it at once."""
        link = self._link(peer)
        link.lent_after.pop(offer.id, None)
        link.channel.send(Abort(offer.id, reason[:4000]))

    def _beat(self, link: PrefillLink, offer: LeaseOffer) -> float:
        # Renew the offers queued behind this one too, so a long queue cannot outlive its TTL.
        link.channel.send(Heartbeat((offer.id, *(o.id for o in link.offers))))
        return self.clock() + self.config.heartbeat

    def _settle(self) -> bool:
        """Feed backend completions to the tracker; True if any arrived."""
        completions = self.backend.poll()
        for c in completions:
            if c.tag not in self._tags:
                continue
            request, chunk = self._tags.pop(c.tag)
            try:
                live = chunk in self.tracker.pending(request)
            except TrackerError:
                live = False
            if not live:  # a read of an attempt given up on and forgotten (its request may be fetched again)
                continue
            if c.error is None:
                self.tracker.done(request, chunk)
            else:
                self.tracker.fail(request, chunk, c.error)
            if self.tracker.aborted(request) and not self.tracker.pending(request):
                self.tracker.finish(request)  # a late completion of a request we gave up on
        return bool(completions)

    def _await_chunks(self, peer: str, offer: LeaseOffer, deadline: float, next_beat: float,
                      sure_until: float, safe: list[int]) -> None:
        link = self.links[peer]
        idle = 0.0
        while self.tracker.pending(offer.request):
            progressed = self._settle()
            if self.clock() < sure_until:
                safe[0] = self.tracker.bound(offer.request)
            if self.tracker.failed(offer.request):
                error = next(e for e in self.tracker.errors(offer.request).values() if e is not None)
                raise error
            now = self.clock()
            if now > deadline:
                raise TransferTimeout(f"request {offer.request}: reads not finished within {self.config.transfer_timeout:.3g} s")
            if now >= next_beat:
                next_beat = self._beat(link, offer)
            self._pump(peer)
            # Back off instead of spinning: on small hosts a spin starves NIXL.
            idle = 0.0 if progressed else min(max(idle * 2, 20e-6), 1e-3)
            if idle:
                self.sleep(idle)

    def _await_ack(self, peer: str, offer: LeaseOffer, deadline: float) -> DoneAck:
        while True:
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise TransferTimeout(f"request {offer.request}: no done ack from {peer}")
            for ack in self._pump(peer, min(remaining, 0.05)):
                if ack.lease == offer.id:
                    return ack

    def _give_up(self, peer: str, offer: LeaseOffer, exc: KvlendError, sure_until: float,
                 safe: list[int]) -> KvlendError:
        """Stop reading ``offer``; return the error to raise, carrying the safe-resume bound.

        Reads that landed while the lease was surely valid still count for the
        bound.  A failure whose control channel is gone too is the prefill's
        loss: ``PeerLost``, and the link (with its NIXL peer) is dropped so a
        later ``connect`` starts fresh.
        """
        self._settle_quietly(offer)
        if self.clock() < sure_until:
            safe[0] = self.tracker.bound(offer.request)
        bound = safe[0]
        self.tracker.abort(offer.request)
        link = self.links.get(peer)
        if link is not None and not isinstance(exc, PeerLost) and not self._alive(peer):
            exc = PeerLost(f"prefill {peer} is gone ({type(exc).__name__}: {exc})")
        if link is not None and isinstance(exc, PeerLost):
            self.disconnect(peer)  # fails its reads still in flight
            self._settle_quietly(offer)
        elif link is not None:
            try:
                link.channel.send(Abort(offer.id, f"{type(exc).__name__}: {exc}"[:4000]), timeout=1.0)
            except KvlendError:
                pass
        log.warning("request %s (lease %s) failed at bound %d: %s", offer.request, offer.id.hex(), bound, exc)
        if not self.tracker.pending(offer.request):
            self.tracker.finish(offer.request)
        exc.request, exc.bound = offer.request, bound
        return exc

    def _settle_quietly(self, offer: LeaseOffer) -> None:
        try:
            self._settle()
        except KvlendError as late:
            log.info("request %s (lease %s): settling after failure: %s", offer.request, offer.id.hex(), late)

    def _abandoned(self, request: str) -> bool:
        try:
            return self.tracker.aborted(request)
        except TrackerError:
            return False

    def _alive(self, peer: str) -> bool:
        """Whether ``peer``'s control channel still works (queued offers and acks are kept)."""
        try:
            self._pump(peer)
        except (PeerLost, ProtocolError):  # a channel that failed authentication is as good as gone
            return False
        return True

    # ------------------------------------------------------------ chunking
    def _chunks(self, plan: TransferPlan, offer: LeaseOffer, offer_pages: Mapping) -> list[tuple[dict, dict]]:
        """Split the lease into chunks of whole pages on both sides; state rows go last."""
        rtpp, ltpp = plan.remote.tokens_per_page, plan.local.tokens_per_page
        span = self.config.chunk_pages * max(rtpp, ltpp)  # tokens per chunk, page-aligned both sides
        groups = plan.remote.groups
        n_chunks = max(1, -(-offer.num_tokens // span))
        chunks: list[tuple[dict, dict]] = [({}, {}) for _ in range(n_chunks)]
        for rg, pages in offer_pages.items():
            lg = plan.group_map.get(rg)
            if lg is None or not len(pages):
                continue
            if groups[rg].recurrent:
                chunks[-1][0][rg] = pages
                chunks[-1][1][lg] = np.zeros(1, dtype=np.int64)
                continue
            which = (pages.token_pages * rtpp) // span
            for c in np.unique(which):
                part = pages.select(which == c)
                chunks[c][0][rg] = part
                chunks[c][1][lg] = _local_pages(part.token_pages, rtpp, ltpp, offer.num_tokens)
        return [c for c in chunks if c[0]]

    def _needed(self, plan: TransferPlan, offer: LeaseOffer) -> dict[str, np.ndarray]:
        needed = {name: np.zeros(0, dtype=np.int64) for name in self.layout.groups}
        rtpp, ltpp = plan.remote.tokens_per_page, plan.local.tokens_per_page
        for rg, pages in offer.pages.items():
            lg = plan.group_map.get(rg)
            if lg is None:
                continue
            if plan.remote.groups[rg].recurrent:
                needed[lg] = np.zeros(1, dtype=np.int64)
            else:
                needed[lg] = np.union1d(needed[lg], _local_pages(pages.token_pages, rtpp, ltpp, offer.num_tokens))
        return needed

    def close(self) -> None:
        for peer in list(self.links):
            try:
                self.links[peer].channel.send(Bye("decode shutting down"), timeout=1.0)
            except KvlendError:
                pass
            self.disconnect(peer)


def _resume_point(resume_from: int, num_tokens: int) -> int:
    if isinstance(resume_from, bool) or not isinstance(resume_from, (int, np.integer)) \
            or not 0 <= resume_from <= num_tokens:
        raise PageRangeError(f"resume_from: must be an int in [0, {num_tokens}], got {resume_from!r}")
    return int(resume_from)


def _skip_below(offer: LeaseOffer, plan: TransferPlan, bound: int) -> tuple[dict, dict]:
    """The offer's pages minus token pages wholly below ``bound``, and the local pages those cover.

    Recurrent state is valid only whole, at the end, so it is always read.
    """
    if not bound:
        return dict(offer.pages), {}
    rtpp, ltpp = plan.remote.tokens_per_page, plan.local.tokens_per_page
    pages, kept = {}, {}
    for rg, gp in offer.pages.items():
        lg = plan.group_map.get(rg)
        if lg is None or plan.remote.groups[rg].recurrent:
            pages[rg] = gp
            continue
        below = (gp.token_pages + 1) * rtpp <= bound
        pages[rg] = gp.select(~below)
        local = _local_pages(gp.token_pages[below], rtpp, ltpp, offer.num_tokens)
        local = local[(local + 1) * ltpp <= bound]  # only local pages whose every token was read
        if local.size:
            kept[lg] = np.union1d(kept.get(lg, local), local)
    return pages, kept


def _local_pages(remote_pages: np.ndarray, rtpp: int, ltpp: int, num_tokens: int) -> np.ndarray:
    """Local token pages holding the tokens of ``remote_pages`` (integer page ratios)."""
    last = -(-num_tokens // ltpp)
    if rtpp >= ltpp:
        k = rtpp // ltpp
        pages = (remote_pages[:, None] * k + np.arange(k)[None, :]).reshape(-1)
        return pages[pages < last]
    return np.unique(remote_pages // (ltpp // rtpp))
