"""``PrefillNode``: a ``PrefillSession`` behind sockets, a backend and (optionally) a thread.

Thread-safety: every public method may be called from any engine thread
while the node serves; ``on_release`` and ``on_claim_wait`` run on the loop's thread (the node's
own after ``start()``), never under the node's lock, so it may call back
into the node.  Hand released requests to the engine's thread (a queue)
rather than freeing pages from the callback if the cache is not thread-safe.

With a ``Registry`` the node publishes its ``RankRecord`` (role ``prefill``,
its advertised endpoint, its layout, ``load`` = leases holding locks, kept
current from the loop) and listens for decode ranks leaving: a decode whose
record left holds locks for nothing, so its leases are released at once
rather than at their TTL.  The caller owns the registry (closing the node
withdraws its record; close the registry after the node).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..cluster.records import RankRecord
from ..cluster.view import JOINED, LEFT, Change
from ..core.layout import PageLayout, RowSelection
from ..core.lender import Lease, LendOptions
from ..core.negotiate import negotiate
from ..core.text import printable
from ..errors import ConfigError, KvlendError
from ..metrics import METRICS
from ..protocol.actions import ClaimWaits, LeaseEnded, PeerGone, PeerReady
from ..protocol.config import NodeConfig
from ..protocol.inputs import Data, Input
from ..protocol.prefill import PrefillSession
from ..protocol.ticket import Ticket, host_problem
from ..protocol.wire import Handshake
from ..security.credentials import Credentials
from ..transport import TransferBackend
from .clock import lease_clock
from .membership import Membership, rank_record
from .shell import Shell, log

if TYPE_CHECKING:
    from ..cluster.registry import Registry

DEFAULT_HOST = "127.0.0.1"  # listen on loopback unless told otherwise


def _reads(local: PageLayout, remote: PageLayout) -> bool:
    """Whether a decode of layout ``local`` can read leases of ``remote`` (``negotiate`` accepts the pair)."""
    try:
        negotiate(local, remote)
        return True
    except KvlendError:
        return False


def _decode_change(change: Change) -> bool:
    """The registry changes a prefill acts on: a decode's record joining or leaving."""
    return change.kind in (JOINED, LEFT) and change.record.role == "decode"


_TARGET_PROGRESS = 0.002  # seconds between backend polls while leases are live (a reader's first read needs it)


class PrefillNode(Shell):
    """Lends pages of ``layout`` to authenticated decode ranks.

    ``on_release(lease, reason)`` is called when a lease ends (``"done"``,
    ``"aborted"``, ``"expired"`` or ``"released"``): the engine may then reuse its pages.
    ``on_claim_wait(lease_id)`` is called when a claim names a lease not lent and waits
    ``claim_wait`` for it: the engine may lend under that id now.  Both run on the loop's thread.
    ``advertise`` is the host that tickets name (default ``host``; set it when
    listening on a wildcard address).

    ``registry``: publish this rank there (one registry per rank; the caller starts it and closes
    it after the node).  ``capacity``: the leases this rank takes at once, which routers divide
    its load by; default ``config.quotas.max_leases_per_peer``, fine while the prefills are alike
    (set it, say to the engine's batch size, when they differ).  ``meta``: a few strings for the record (the
    engine's API address, say).

    A decode rank whose record leaves the registry has its leases released at once (reason
    ``"released"``, their pages at their expiry unless it said goodbye: it may still be reading
    them) if it has no live link to this node; if it is still connected (its link
    renews its leases, so it is alive: its record may have run out because it lost etcd, and it
    keeps serving known peers), they are released when that link drops instead.
    """

    ROLE = "prefill"
    PEER_ROLES = ("decode",)

    def __init__(self, layout: PageLayout, backend: TransferBackend, credentials: Credentials, *,
                 host: str = DEFAULT_HOST, port: int = 0, advertise: str | None = None,
                 config: NodeConfig = NodeConfig(),
                 on_release: Callable[[Lease, str], None] | None = None,
                 on_claim_wait: Callable[[bytes], None] | None = None,
                 clock: Callable[[], float] = lease_clock,
                 registry: Registry | None = None, capacity: int | None = None,
                 meta: Mapping[str, str] | None = None) -> None:
        self.layout = layout
        self.on_release = on_release or (lambda lease, reason: None)
        self.on_claim_wait = on_claim_wait or (lambda lease_id: None)
        super().__init__(None, backend, credentials, clock, config)
        try:
            self.host, self.port = self._sockets.listen(host, port)  # a port in use fails before registering
            self.advertise = advertise or self.host
            problem = host_problem(self.advertise)
            if problem is not None:  # every ticket would name it: refuse it now, not at the first lend
                raise ConfigError(f"advertise: expected an IP address or a DNS name: {problem}")
            record = None if registry is None else rank_record(self.name, "prefill", self.advertise, self.port,
                                                               layout, config, capacity, meta)
            backend.register(layout.regions)
        except BaseException:
            self._sockets.close_all()
            raise
        self.session = PrefillSession(layout, backend.kind, backend.metadata(), name=self.name, config=config)
        self.lender = self.session.lender
        self._departed: set[str] = set()  # decodes whose record left while still connected
        if registry is not None:
            try:
                self._join(Membership(registry, self._wake, load=lambda: self.lender.active_leases,
                                      watches=_decode_change, act=self._decode_changed), record)
            except BaseException:
                self._sockets.close_all()
                raise
        METRICS.gauge("kvlend_active_leases", lambda: self.lender.active_leases, self.name)
        METRICS.gauge("kvlend_locked_pages", lambda: self.lender.locks.locked_pages(), self.name)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    # ---------------------------------------------------------------- engine
    def offer(self, peer: str, request: str, num_tokens: int, pages: Mapping[str, Any],
              selection: RowSelection = RowSelection.all(), meta: Mapping[str, Any] | None = None,
              ready: int | None = None) -> Lease:
        """Lend ``request``'s pages to the connected decode rank ``peer`` and push it the offer
        (``ready``: progressively, as in ``lend``)."""
        with self._lock:
            lease = self.session.offer(peer, request, num_tokens, pages, selection, self.clock(),
                                       LendOptions(ready=ready, meta=meta or {}))
        METRICS.inc("kvlend_leases_total")
        log.debug("lease %s: offered request %s (%d pages) to %s", lease.hex, printable(request), lease.num_pages,
                  printable(peer))
        self._wake()
        return lease

    def lend(self, request: str, num_tokens: int, pages: Mapping[str, Any],
             selection: RowSelection = RowSelection.all(), meta: Mapping[str, Any] | None = None,
             lease_id: bytes | None = None, ready: int | None = None, prompt_digest: bytes | None = None) -> Ticket:
        """Lend ``request``'s pages to whichever decode redeems the returned ticket.

        ``prompt_digest`` (``kvlend.prompt_digest`` of the request's prompt token ids): only a decode
        claiming with the same digest reads the pages, so the ticket alone, wherever it leaks, reads
        nothing.  Give it whenever tickets pass through hands you do not trust (HTTP clients, routers).

        ``lease_id``: lend under the id of a ``Ticket`` minted earlier from this node's ``advertise``,
        ``port``, name and layout id, for engines whose scheduler answers the client before the
        process owning the pages can lend (set ``NodeConfig.claim_wait`` so an early claim waits).
        ``ready``: lend progressively, while prefill still computes: only the pages of the first
        ``ready`` tokens now (rows past them may hold -1), the rest by ``extend`` as chunks commit.
        """
        with self._lock:
            options = LendOptions(lease_id=lease_id, ready=ready, prompt_digest=prompt_digest, meta=meta or {})
            lease = self.session.lend(request, num_tokens, pages, selection, self.clock(), options)
            ticket = self.session.ticket(lease, self.advertise, self.port)
        METRICS.inc("kvlend_leases_total")
        self._wake()
        return ticket

    def extend(self, lease_id: bytes, ready: int, pages: Mapping[str, Any],
               meta: Mapping[str, Any] | None = None) -> Lease:
        """A progressive lease grows: prefill has committed ``ready`` tokens (``pages``: the request's
        whole table, as in ``lend``).  Its reader, once it holds the offer, hears at once and reads the
        new pages while later chunks compute; ``ready == num_tokens`` makes the lease final.  ``meta``
        updates the offer's engine data (the first generated token, known only at the end)."""
        with self._lock:
            lease = self.session.extend(lease_id, ready, pages, self.clock(), meta=meta)
        self._wake()
        return lease

    def release(self, lease_id: bytes) -> Lease | None:
        """End a lease the engine no longer wants read (its request was cancelled).

        ``on_release(lease, "released")`` says when its pages may be reused: at once if no decode
        got its offer, else once that decode is quiet or the lease's expiry passes.
        """
        with self._lock:
            lease = self.session.release(lease_id)
        self._wake()
        return lease

    def can_evict(self, region: str, ordinals) -> Any:
        """Which of ``region``'s slots no lease holds (bool array): safe from any thread."""
        with self._lock:
            return self.lender.locks.can_evict(region, ordinals)

    @property
    def unauthenticated(self) -> int:
        """Connections accepted and not yet authenticated (TLS handshake not done)."""
        with self._lock:
            return self.session.pending

    def ready_peers(self) -> list[str]:
        with self._lock:
            return self.session.peers

    def live_decodes(self) -> list[RankRecord]:
        """The decode ranks the registry lists as alive (``RankRecord``s, by identity), connected or not,
        whose layout can read this rank's; ``ConfigError`` without a registry."""
        if self.registry is None:
            raise ConfigError("live_decodes: this prefill node was built without a registry")
        return [r for r in self.registry.ranks("decode") if r.page_layout is not None
                and _reads(r.page_layout, self.layout)]

    def wait_for_peers(self, count: int, timeout: float) -> list[str]:
        """Wait until ``count`` decode ranks completed the handshake; their names, sorted."""
        self._wait_until(lambda: len(self.session.peers) >= count, timeout,
                         f"fewer than {count} decode ranks completed the handshake")
        return self.ready_peers()

    def wait_for_peer(self, timeout: float) -> str:
        return self.wait_for_peers(1, timeout)[0]

    def close(self) -> None:
        """Say goodbye to every decode and stop serving (leases are not released).  Idempotent."""
        if self._closed:
            return
        self._leave()  # the record leaves now
        with self._lock:
            self.session.shutdown("prefill shutting down")
        self._shutdown()
        METRICS.remove_gauge("kvlend_active_leases", self.name)
        METRICS.remove_gauge("kvlend_locked_pages", self.name)

    # ------------------------------------------------------------- registry
    def _decode_changed(self, change: Change) -> bool:
        """A decode's record came back (its leases stay its own) or left (release them if it is gone)."""
        identity = change.record.identity
        if change.kind == JOINED:
            self._departed.discard(identity)
            return False
        with self._lock:
            if identity in self.session.peers:
                self._departed.add(identity)
                log.info("prefill %s: decode rank %s left the registry but is still connected: its leases "
                         "stay until its link drops", self.name, printable(identity))
                return False
            return self._release_peer(identity, "left the cluster registry")

    def _release_peer(self, identity: str, why: str) -> bool:
        """Release every lease bound to ``identity`` (under the lock); whether there were any."""
        self._departed.discard(identity)
        leases = self.lender.leases_of(identity)
        for lease in leases:
            self.session.release(lease.id)
        if leases:
            log.warning("prefill %s: decode rank %s %s: released its %d leases", self.name, printable(identity),
                        why, len(leases))
        return bool(leases)

    # ------------------------------------------------------------------ loop
    def _busy(self) -> float | None:
        return _TARGET_PROGRESS if self.lender.active_leases else None

    def _prepare(self, inputs: list[Input]) -> None:
        """Negotiate a decode's layout off the node's lock, unless cached or its identity may not ask now (the
        session refuses it then); only the loop's thread touches the cache."""
        for event in inputs:
            if not isinstance(event, Data):
                continue
            channel = self._channels.get(event.conn)
            for message in event.messages:
                if isinstance(message, Handshake) and channel is not None and channel.identity is not None:
                    self.session.negotiations.prepare(channel.identity, message, self.clock())

    def _throttled(self, now: float) -> dict:
        return self.session.throttled(now)

    def _deliver(self, events: list) -> None:
        for event in events:
            if isinstance(event, LeaseEnded):
                if event.reason == "expired":
                    METRICS.inc("kvlend_expired_leases_total")
                try:
                    self.on_release(event.lease, event.reason)
                except Exception:
                    log.exception("prefill %s: on_release failed for lease %s", self.name, event.lease.hex)
            elif isinstance(event, ClaimWaits):
                try:
                    self.on_claim_wait(event.lease_id)
                except Exception:
                    log.exception("prefill %s: on_claim_wait failed for lease %s", self.name, event.lease_id.hex())
            elif isinstance(event, PeerReady):
                log.info("prefill %s: decode rank %s ready", self.name, printable(event.peer))
            elif isinstance(event, PeerGone):
                log.debug("prefill %s: connection %d gone: %s", self.name, event.conn, printable(event.reason))
                if event.peer is not None and event.peer in self._departed:
                    with self._lock:
                        if event.peer not in self.session.peers:  # not a refused duplicate of a live peer
                            self._release_peer(event.peer, "left the cluster registry and its link dropped")
