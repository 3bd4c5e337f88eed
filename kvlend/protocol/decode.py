"""``DecodeSession``: the reading side of the control protocol, sans-IO.

Fed connection events, received bytes, transfer completions and ``now``;
returns actions (connect, send, close, add or remove a backend peer, post or
cancel reads) and events (offers pushed, fetches finished).  It runs many
fetches at once over many links, each link one prefill endpoint.

A fetch's life: (claim a ticket's lease) -> post its chunks -> every chunk
done -> ``Done`` -> the prefill's ack -> ``done``.  A progressive lease
(offered before prefill finished) grows by ``Extend`` messages: each one's
new pages are posted at once, and ``Done`` waits for the final extension.  Any failure (a chunk
failed, the deadline passed, the link died, the engine cancelled) first
cancels the reads still in flight and waits until the backend reports each
one terminal: only then is the fetch ``failed``, its destination quiet and
``Abort`` sent, so neither side reuses pages a late read could still write.
The safe-resume bound counts a read only if it landed while the lease was
surely valid (before the conservative cutoff: the lease's own TTL, from its
offer, minus one of its heartbeats after the lease was surely renewed), unless
the prefill's done ack confirms it.  A link is heartbeated at the pace its
shortest lease needs (``NodeConfig.beat_for``): a progressive lease's TTL may
be far shorter than ours.

A prefill whose layout this rank cannot read (negotiation refused the pair)
is remembered by its layout id: a ticket naming that layout fails at once
with the same ``LayoutMismatch``, and every lease this rank came for there is
declined (a ``Claim`` over the refused link before its ``Bye``, over a link
opened to say it) so its prefill frees the pages rather than at their TTL.

With a ``read_window`` (the backend's, over tcp: ``core/tcpwindow.py``) the bytes of reads posted
and not yet terminal per link stay within it; chunks over it wait, in order, and are posted by
``take_actions`` as earlier ones end.  A waiting chunk counts as in flight for its fetch (the
deadline still applies) and is simply dropped if the fetch fails.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import OrderedDict
from typing import Any, Iterator, Mapping

from ..core.layout import PageLayout
from ..core.negotiate import TransferPlan
from ..core.tcpwindow import ReadWindow, pieces
from ..core.text import printable
from ..core.tracker import DeliveryTracker
from ..errors import (
    AuthError,
    ConfigError,
    KvlendError,
    LayoutMismatch,
    PeerLost,
    PeerProtocolError,
    QuotaExceeded,
    TransferCancelled,
    TransferTimeout,
    UsageError,
)
from . import states
from .actions import Cancel, Close, Connect, FetchFinished, Outbox, PeerGone, Post, RemovePeer, Send
from .codes import Code
from .config import NodeConfig
from .connection import Connection
from .decode_claims import TicketClaims
from .decode_link import PLAN_CACHE, PrefillLink, where
from .decode_messages import PrefillMessages
from .fetch import Fetch, Work, check_destination, clone_error, nbytes, plan_work, resume_point, timeout_arg
from .inputs import Authenticated, Connected, Data, Gone, Input
from .states import TERMINAL, FetchEvent, FetchState, LeaseEvent, LeaseState, LinkEvent, LinkState
from .wire import Abort, Bye, Done, Handshake, Heartbeat, LeaseOffer, Message

__all__ = ["DecodeSession", "Fetch", "FetchState", "check_destination", "clone_error"]

log = logging.getLogger("kvlend.session")
_REASON = 4000
_BEATS_KEPT = 64  # unanswered heartbeats remembered per link (a prefill that stalls costs no more)


class DecodeSession(TicketClaims, PrefillMessages, Outbox):
    """Reads leases from any number of prefill ranks into ``layout``'s pages."""

    def __init__(self, layout: PageLayout, backend_kind: str, *,
                 name: str = "decode", config: NodeConfig = NodeConfig(), read_window: int | None = None) -> None:
        self.layout = layout
        self.name = name
        self.config = config
        self.tracker = DeliveryTracker(layout)
        self._kind = backend_kind
        # What a prefill learns of us: the layout to negotiate with, never where our memory is nor how to
        # reach it (a prefill only answers reads; a peer posing as one gets nothing to read or write with).
        self._hello = Handshake(layout.without_addresses().encode(), backend_kind, b"")
        self._links: dict[int, PrefillLink] = {}
        self._by_endpoint: dict[tuple[str, int], int] = {}
        self._fetches: dict[int, Fetch] = {}  # every fetch not forgotten, by id
        self._live: dict[bytes, Fetch] = {}  # fetches not finished, by lease (one at most per lease)
        self._on_link: dict[int, dict[int, Fetch]] = {}  # fetches not finished, by link and id
        self._tags: dict[bytes, tuple[int, int]] = {}  # tag -> (fetch id, chunk)
        self._window = ReadWindow(read_window)  # bytes in flight per link (tcp: core/tcpwindow.py)
        self._held: dict[bytes, Post] = {}  # posts waiting for room in the window, by tag
        self._pieces: dict[int, int] = {}  # chunk (seq) cut into pieces for the window -> pieces not yet landed
        self._timers: list[tuple[float, int]] = []  # (deadline or quiet_by, fetch id): a heap, stale ones skipped
        self._plans: dict[tuple, TransferPlan] = {}
        self._unreadable: OrderedDict[str, LayoutMismatch] = OrderedDict()  # remote layout id -> why refused
        self._declined: OrderedDict[bytes, None] = OrderedDict()  # leases given back lately
        self._next_conn = self._next_fetch = self._seq = 0
        self._gone: OrderedDict[int, KvlendError] = OrderedDict()  # why recent links closed
        super().__init__()

    # ------------------------------------------------------------------ links
    def open(self, host: str, port: int, now: float) -> int:
        """Start connecting to a prefill endpoint (a new link); its id."""
        if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int) \
                or not 0 < port < 65536:
            raise ConfigError(f"prefill endpoint: expected a host and a port in [1, 65535], got {host!r}:{port!r}")
        self._next_conn += 1
        conn = self._next_conn
        self._links[conn] = link = PrefillLink(conn, (host, port), now + self.config.handshake_timeout, now)
        self._link_to(link, LinkEvent.OPEN)
        self._by_endpoint[(host, port)] = conn
        self._actions.append(Connect(conn, host, port))
        return conn

    def link_to(self, host: str, port: int, now: float) -> int:
        """The link to ``host:port``, opened on first use and shared by every later fetch."""
        conn = self._by_endpoint.get((host, port))
        return conn if conn is not None else self.open(host, port, now)

    def handle(self, event: Input, now: float) -> None:
        """One record from the shell (``protocol.inputs``), to the call below that takes it."""
        match event:
            case Connected(conn, windowed):
                self.connected(conn, now, windowed)
            case Authenticated(conn, identity):
                self.authenticated(conn, identity, now)
            case Data(conn, messages, error):
                self.deliver(conn, messages, error, now)
            case Gone(conn, why, refused):
                self.closed(conn, now, why, refused)
            case _:
                raise TypeError(f"a decode session takes no {type(event).__name__}: it listens to nobody")

    def connected(self, conn: int, now: float, windowed: bool = True) -> None:
        """The shell's connection for ``conn`` is up: its TLS handshake starts.  ``windowed``: its reads
        may go over tcp, so the read window applies (the shell knows a peer on this host reads over
        shared memory)."""
        link = self._links.get(conn)
        if link is not None and link.state is LinkState.CONNECTING:
            link.conn = Connection(now)
            link.windowed = windowed
            self._link_to(link, LinkEvent.CONNECTED)

    def authenticated(self, conn: int, identity: str, now: float) -> None:
        """TLS verified that the prefill at ``conn`` holds a certificate for ``identity``: hand it our layout."""
        link = self._links.get(conn)
        if link is None or link.state is not LinkState.TLS:
            return
        assert link.conn is not None  # set on CONNECTED
        try:
            link.conn.authenticate(identity)
        except KvlendError as exc:
            self._fail_link(conn, exc, now)
            return
        if link.expect is not None and identity != link.expect:
            self._fail_link(conn, AuthError(f"{link.endpoint[0]}:{link.endpoint[1]} authenticated as {identity!r}, "
                                            f"but its tickets name the prefill {link.expect!r}"), now)
            return
        link.peer = identity
        link.conn.send(self._hello)
        self._link_to(link, LinkEvent.AUTHENTICATED)

    def receive(self, conn: int, data: bytes, now: float) -> None:
        """Received (decrypted) bytes, decoded here; the shell decodes them off its lock and calls ``deliver``."""
        link = self._links.get(conn)
        if link is not None and link.conn is not None:
            self.deliver(conn, *link.conn.read(data), now)

    def deliver(self, conn: int, messages: list[Message], error: KvlendError | None, now: float) -> None:
        """Messages decoded from link ``conn``'s bytes (a ``FrameReader``'s), then the error that ended its
        stream, if any."""
        link = self._links.get(conn)
        if link is None or link.conn is None:
            return
        try:
            if not link.conn.ready and (messages or error is not None):
                raise PeerProtocolError("bytes arrived before the prefill was authenticated")
            for message in messages:
                if conn not in self._links:
                    return
                self._handle(conn, link, message, now)
            if error is not None and conn in self._links:
                raise error
        except KvlendError as exc:
            if link.state is not LinkState.READY or isinstance(exc, PeerLost):
                lost = exc  # a refused handshake says why (LayoutMismatch, AuthError, ...)
            else:
                lost = PeerLost(f"link to {where(link)} failed: {exc}")
            self._fail_link(conn, lost, now)

    def closed(self, conn: int, now: float, why: str = "connection closed", refused: bool = False) -> None:
        """The shell's connection for ``conn`` ended or could not be opened (``refused``: TLS failed,
        an ``AuthError`` rather than ``PeerLost``)."""
        link = self._links.get(conn)
        if link is not None:
            error = AuthError if refused else PeerLost
            self._fail_link(conn, error(f"{where(link)}: {why}"), now)

    def disconnect(self, conn: int, now: float, reason: str = "decode closing the link") -> None:
        """Close a link in order; its fetches fail with ``PeerLost`` once their reads are quiet."""
        link = self._links.get(conn)
        if link is None:
            return
        self._fail_link(conn, PeerLost(f"{where(link)}: {reason}"), now, bye=Code.OK)

    def plan(self, conn: int) -> TransferPlan | None:
        link = self._links.get(conn)
        return None if link is None else link.plan

    def ready(self, conn: int) -> bool:
        link = self._links.get(conn)
        return link is not None and link.state is LinkState.READY

    def link_info(self, conn: int) -> dict | None:
        link = self._links.get(conn)
        if link is None:
            return None
        assert link.state is not None  # opened
        return {"endpoint": link.endpoint, "peer": link.peer, "state": link.state.value,
                "handshake_ms": link.handshake_ms, "plan": link.plan}

    def link_error(self, conn: int) -> KvlendError | None:
        """Why a recently closed link closed (None if it is open or long gone)."""
        return self._gone.get(conn)

    @property
    def links(self) -> list[int]:
        return list(self._links)

    # --------------------------------------------------------------- fetches
    def fetch_offer(self, conn: int, offer: LeaseOffer, dst: Mapping[str, Any], now: float,
                    resume_from: int = 0, timeout: float | None = None) -> Fetch:
        """Start reading a pushed ``offer`` into ``dst`` (local group -> slot per local token page).

        ``timeout`` (default the config's ``transfer_timeout``) bounds the fetch up to the
        done ack.  Bad arguments raise before anything changes or is posted.
        """
        timeout = timeout_arg(timeout, self.config.transfer_timeout)
        link = self._ready_link(conn)
        if not isinstance(offer, LeaseOffer):
            raise UsageError(f"expected a LeaseOffer, got {type(offer).__name__}")
        self._check_not_fetching(offer.id)
        held = link.leases.get(offer.id)
        if held is None or held.offer is None:
            raise UsageError(f"lease {offer.id.hex()} is no longer offered on this link "
                                "(fetched, declined or withdrawn): ask the prefill to lend it again")
        resume_from = resume_point(resume_from, offer.num_tokens)
        offer = held.offer  # as grown by any extension since it was offered
        assert link.plan is not None  # ready
        work = self._work(link.plan, offer, dst, resume_from)  # may raise: nothing changed yet
        fetch = self._new_fetch(conn, offer.id, offer.num_tokens, dst, resume_from, now, timeout, FetchEvent.TAKE)
        fetch.sure_until = held.sure if held.sure is not None else -math.inf
        self._begin(fetch, offer, work, now, created=True)
        link.lease_to(offer.id, LeaseEvent.FETCH)
        return fetch


    def decline(self, conn: int, offer: LeaseOffer, reason: str) -> None:
        """Tell the prefill this rank will not read ``offer``: it releases the lease at once."""
        link = self._ready_link(conn)
        if offer.id in self._live:
            raise UsageError(f"lease {offer.id.hex()} is being fetched: cancel the fetch instead")
        if link.state_of(offer.id) in (LeaseState.HELD, LeaseState.OFFERED):
            link.lease_to(offer.id, LeaseEvent.DECLINE)
        assert link.conn is not None  # ready
        link.conn.send(Abort(offer.id, Code.CANCELLED, reason[:_REASON]))

    def cancel(self, fetch_id: int, now: float) -> None:
        """Give up on a fetch; it ends ``failed`` (``TransferCancelled``) once its reads are quiet."""
        fetch = self._fetches.get(fetch_id)
        if fetch is not None and not fetch.done:
            self._fail(fetch, TransferCancelled(f"fetch {fetch_id} cancelled"), now)

    def get(self, fetch_id: int) -> Fetch | None:
        return self._fetches.get(fetch_id)

    def forget(self, fetch_id: int) -> None:
        """Drop a finished fetch's record (the engine has taken its result)."""
        fetch = self._fetches.get(fetch_id)
        if fetch is not None and fetch.done:
            del self._fetches[fetch_id]

    @property
    def in_flight(self) -> int:
        """Fetches not yet finished."""
        return len(self._live)

    # ----------------------------------------------------------- completions
    def completed(self, tag: bytes, error: KvlendError | None, now: float) -> None:
        """The backend is done with read ``tag`` (terminal: it will not write again)."""
        self._window.end(tag)
        entry = self._tags.pop(tag, None)
        if entry is None:
            return
        fetch = self._fetches.get(entry[0])
        if fetch is None:
            return
        fetch.tags.discard(tag)
        whole = self._whole(entry[1], error)
        if fetch.state is FetchState.READING and whole:
            if error is None:
                self.tracker.done(fetch.key, entry[1])
                if now < fetch.sure_until:
                    fetch.bound = max(fetch.resume_from, self.tracker.bound(fetch.key))
            else:
                self.tracker.fail(fetch.key, entry[1], error)
                if isinstance(error, PeerLost) and fetch.link in self._links:
                    self._fail_link(fetch.link, error, now)
                else:
                    self._fail(fetch, error, now)
        self._progress(fetch, now)

    def _whole(self, seq: int, error: KvlendError | None) -> bool:
        """Whether chunk ``seq`` is settled by this completion: it was posted whole, or this was its last
        piece to land, or the first of its pieces to fail (the others then count for nothing)."""
        left = self._pieces.get(seq)
        if left is None:
            return True
        if error is None and left > 1:
            self._pieces[seq] = left - 1
            return False
        del self._pieces[seq]
        return True

    # ------------------------------------------------------------------ time
    def tick(self, now: float) -> None:
        """Deadlines, escalation of reads that will not go quiet, and heartbeats."""
        for conn, link in list(self._links.items()):
            if link.state is not LinkState.READY and now > link.deadline:
                self._fail_link(conn, TransferTimeout(
                    f"{where(link)}: no handshake within {self.config.handshake_timeout:.3g} s"), now)
        while self._timers and self._timers[0][0] < now:  # each fetch whose deadline or quiet_by passed
            fetch = self._fetches.get(heapq.heappop(self._timers)[1])
            if fetch is None or fetch.done:
                continue
            if fetch.state is FetchState.CANCELLING and now > fetch.quiet_by and fetch.link in self._links:
                self._fail_link(fetch.link, PeerLost(
                    f"reads of request {fetch.request} still in flight {self.config.cancel_grace:.3g} s after "
                    "cancelling; tearing the link down to stop them"), now)
            elif not fetch.done and fetch.state is not FetchState.CANCELLING and now > fetch.deadline:
                what = "no done ack" if fetch.state is FetchState.ACKING else "reads not finished"
                self._fail(fetch, TransferTimeout(
                    f"request {fetch.request or fetch.lease.hex()}: {what} within "
                    f"{fetch.deadline - fetch.started:.3g} s"), now)
        for link in list(self._links.values()):
            if link.state is LinkState.READY and now >= link.next_beat:
                leases = self._renewable(link)
                if leases:
                    assert link.conn is not None  # ready
                    link.conn.send(Heartbeat(tuple(leases)))
                    if link.blind or len(link.beats) >= _BEATS_KEPT:
                        link.blind += 1  # its answer will confirm nothing
                    else:
                        link.beats.append((now, frozenset(leases)))
                link.next_beat = now + link.beat

    def next_deadline(self) -> float | None:
        """When ``tick`` next has work (None: nothing pending)."""
        times = [link.deadline for link in self._links.values() if link.state is not LinkState.READY]
        times += [link.next_beat for link in self._links.values()
                  if link.state is LinkState.READY and self._any_renewable(link)]
        timers = self._timers
        while timers and not self._timer_due(*timers[0]):
            heapq.heappop(timers)
        if timers:
            times.append(timers[0][0])
        return min(times) if times else None

    def _timer_due(self, at: float, fetch_id: int) -> bool:
        """Whether ``tick`` has work for this fetch at ``at``: its deadline while it runs, its quiet_by
        while it cancels on a live link (once the link is torn down nothing is left to escalate)."""
        f = self._fetches.get(fetch_id)
        if f is None or f.done:
            return False
        if f.state is FetchState.CANCELLING:
            return at == f.quiet_by and f.link in self._links
        return at == f.deadline

    # --------------------------------------------------------------- outputs
    def take_actions(self) -> list:
        """The actions queued, and the posts the read window admits now that every change was made
        (a fetch failing withdraws its waiting reads first, so none is posted for a link torn down)."""
        for tag in self._window.admit():
            self._actions.append(self._held.pop(tag))
        return super().take_actions()

    @property
    def reads_waiting(self) -> int:
        """Reads held back by the tcp read window."""
        return len(self._held)

    def _connections(self) -> Iterator[tuple[int, Connection]]:
        return ((conn, link.conn) for conn, link in self._links.items() if link.conn is not None)

    # -------------------------------------------------------------- messages


    # -------------------------------------------------------------- internals
    def _check_size(self, num_tokens: int) -> None:
        cap = self.config.quotas.max_num_tokens
        if num_tokens > cap:
            raise QuotaExceeded("max_num_tokens", num_tokens, cap, "a lease of")

    def _check_not_fetching(self, lease: bytes) -> None:
        if lease in self._live:
            raise UsageError(f"lease {lease.hex()} is already being fetched")

    def _ready_link(self, conn: int) -> PrefillLink:
        link = self._links.get(conn)
        if link is None or link.state is not LinkState.READY:
            why = self._gone.get(conn) if isinstance(conn, int) else None
            raise PeerLost(f"link {conn!r} is not connected" + (f" (it closed: {why})" if why is not None else
                                                                  f" (open: {sorted(self._links)})"))
        return link

    def _new_fetch(self, conn: int, lease: bytes, num_tokens: int, dst: Mapping[str, Any], resume_from: int, now: float,
                   timeout: float, start: FetchEvent) -> Fetch:
        self._next_fetch += 1
        fetch = Fetch(self._next_fetch, conn, lease, num_tokens, dst, resume_from, now, now + timeout,
                      bound=resume_from)
        self._fetches[fetch.id] = fetch
        self._live[lease] = fetch
        self._on_link.setdefault(conn, {})[fetch.id] = fetch
        heapq.heappush(self._timers, (fetch.deadline, fetch.id))
        self._move(fetch, start)
        return fetch

    def _move(self, fetch: Fetch, event: FetchEvent) -> None:
        """The one place a fetch's state changes: checked against ``states.FETCH``; a fetch that
        finishes leaves the indexes of fetches not finished."""
        fetch._state = states.transition("fetch", fetch._state, event)
        if fetch._state in TERMINAL:
            self._unindex(fetch)

    def _unindex(self, fetch: Fetch) -> None:
        if self._live.get(fetch.lease) is fetch:
            del self._live[fetch.lease]
        on_link = self._on_link.get(fetch.link)
        if on_link is not None:
            on_link.pop(fetch.id, None)
            if not on_link:
                del self._on_link[fetch.link]

    def _link_to(self, link: PrefillLink, event: LinkEvent) -> None:
        """The one place a link's state changes: checked against ``states.LINK``."""
        link.state = states.transition("link", link.state, event)


    def _work(self, plan: TransferPlan, offer: LeaseOffer, dst: Mapping[str, Any], resume_from: int,
              done_rows: Mapping[str, Any] | None = None) -> Work:
        """``plan_work`` in this session's chunks: computed before any state changes, so a bad table fails first."""
        return plan_work(plan, offer, dst, resume_from, self.config.chunk_pages, done_rows)

    def _begin(self, fetch: Fetch, offer: LeaseOffer, work: Work, now: float, created: bool) -> None:
        """Track the fetch and post its chunks; all or nothing.

        On failure everything is undone and the exception propagates; a fetch ``created`` for
        this call is forgotten too (its caller never saw it).
        """
        fetch.offer, fetch.request = offer, offer.request
        try:
            self._post_work(fetch, work, now, begin=True)
        except BaseException:
            self._forget_tracking(fetch)
            fetch.bytes = fetch.descriptors = 0
            fetch.offer = None
            fetch.read_rows = {}
            if created:
                del self._fetches[fetch.id]
                self._unindex(fetch)
            raise

    def _post_work(self, fetch: Fetch, work: Work, now: float, begin: bool) -> None:
        """Post ``work``'s chunks (tracking the fetch first if ``begin``); the posts are all or nothing."""
        assert fetch.offer is not None  # set by ``_begin``
        chunks, kept, needed, read = work
        mark = len(self._actions)
        tags: list[bytes] = []
        counted = fetch.bytes, fetch.descriptors
        try:
            if begin:
                self.tracker.begin(fetch.key, fetch.offer.num_tokens, needed)
            else:
                self.tracker.need(fetch.key, needed)
            if kept:
                self._seq += 1  # read by an earlier lease, verified then
                self.tracker.post(fetch.key, f"resumed-{self._seq}", kept)
                self.tracker.done(fetch.key, f"resumed-{self._seq}")
            limit = self._window.limit if self._links[fetch.link].windowed else None  # None: no window applies
            for batches, local in chunks:
                self._seq += 1
                self.tracker.post(fetch.key, self._seq, local)
                size = nbytes(batches)
                parts = pieces(batches, limit) if limit is not None and size > limit else [batches]
                if len(parts) > 1:
                    self._pieces[self._seq] = len(parts)
                for i, part in enumerate(parts):
                    tag = f"{self.name}:{self._seq}{f'.{i}' if len(parts) > 1 else ''}".encode()
                    tags.append(tag)
                    post = Post(fetch.link, part, tag)
                    if limit is None or self._window.submit(fetch.link, tag, nbytes(part)):
                        self._actions.append(post)
                    else:
                        self._held[tag] = post
                    self._tags[tag] = (fetch.id, self._seq)
                fetch.bytes += size
                fetch.descriptors += sum(b.count for b in batches)
        except BaseException:
            del self._actions[mark:]
            for tag in tags:
                entry = self._tags.pop(tag, None)
                if entry is not None:
                    self._pieces.pop(entry[1], None)
                self._window.end(tag)
                self._held.pop(tag, None)
            fetch.bytes, fetch.descriptors = counted
            raise
        fetch.tags.update(tags)
        fetch.read_rows = read
        if fetch.posted is None:
            fetch.posted = now
        if fetch.final_at is None and fetch.offer.final:
            fetch.final_at, fetch.early_bytes = now, counted[0]
        if now < fetch.sure_until:
            fetch.bound = max(fetch.resume_from, self.tracker.bound(fetch.key))
        self._progress(fetch, now)

    def _progress(self, fetch: Fetch, now: float) -> None:
        """Move a fetch on once its reads allow: send done, or finish a failure when quiet."""
        if fetch.tags:
            return
        if fetch.state is FetchState.READING:
            assert fetch.offer is not None  # reading one
            if not fetch.offer.final:
                return  # a progressive lease: the prefill has more to lend (``Extend``)
            self._move(fetch, FetchEvent.LAND)
            fetch.landed = now
            connection = self._links[fetch.link].conn
            assert connection is not None  # a fetch reads over a ready link
            connection.send(Done(fetch.lease, self.tracker.bound(fetch.key)))
        elif fetch.state is FetchState.CANCELLING:
            link = self._links.get(fetch.link)
            if link is not None and link.state is LinkState.READY and fetch.offer is not None:
                assert link.conn is not None and fetch.error is not None  # ready; set as it failed
                link.conn.send(Abort.of(fetch.lease, fetch.error))
            self._finish(fetch, FetchEvent.QUIET, fetch.error, now)

    def _fail(self, fetch: Fetch, error: KvlendError, now: float, tell_prefill: bool = True) -> None:
        """Stop a fetch: cancel what is in flight; it finishes once quiet."""
        if fetch.done or fetch.state is FetchState.CANCELLING:
            return
        link = self._links.get(fetch.link)
        if fetch.state is FetchState.CLAIMING:
            if tell_prefill and link is not None and link.state is LinkState.READY and fetch.claimed_at is not None:
                assert link.conn is not None  # ready
                link.conn.send(Abort.of(fetch.lease, error))
                link.lease_to(fetch.lease, LeaseEvent.ABANDON)
            self._finish(fetch, FetchEvent.FAIL, error, now)
            return
        if not fetch.confirmed and link is not None:
            link.lease_to(fetch.lease, LeaseEvent.ABANDON)  # the claim's answer may still come: not an offer to us
        if fetch.state is FetchState.ACKING:  # every read is terminal; the prefill releases on our done
            self._finish(fetch, FetchEvent.FAIL, error, now)
            return
        fetch.error = error
        self._move(fetch, FetchEvent.FAIL)
        fetch.quiet_by = now + self.config.cancel_grace
        heapq.heappush(self._timers, (fetch.quiet_by, fetch.id))
        self.tracker.abort(fetch.key)
        for tag in sorted(fetch.tags):
            if self._window.waiting(tag):  # never posted: nothing to stop
                self._window.end(tag)
                self._pieces.pop(self._tags[tag][1], None)
                del self._held[tag], self._tags[tag]
                fetch.tags.discard(tag)
            else:
                self._actions.append(Cancel(tag))
        if not tell_prefill:
            fetch.offer = None  # the prefill already ended the lease: no Abort
        self._progress(fetch, now)

    def _finish(self, fetch: Fetch, event: FetchEvent, error: KvlendError | None, now: float) -> None:
        self._move(fetch, event)
        fetch.finished = now
        if error is None:
            fetch.bound = fetch.num_tokens
        else:
            error.request, error.bound = fetch.request, fetch.bound
            level = logging.INFO if isinstance(error, TransferCancelled) else logging.WARNING
            log.log(level, "request %s (lease %s) failed at bound %d: %s", printable(fetch.request or "?"),
                    fetch.lease.hex(), fetch.bound, printable(error))
        fetch.error = error
        self._forget_tracking(fetch)
        self._events.append(FetchFinished(fetch))

    def _forget_tracking(self, fetch: Fetch) -> None:
        try:
            self.tracker.abort(fetch.key)
            self.tracker.finish(fetch.key)
        except KvlendError:
            pass  # never begun

    def _fail_link(self, conn: int, error: KvlendError, now: float, bye: Code | None = None) -> None:
        """Drop a link: its fetches fail; its backend peer is removed, which makes their reads terminal.

        ``bye``: the code of the ``Bye`` that closes it in order (None: none, the link is broken)."""
        link = self._links.pop(conn)
        self._link_to(link, LinkEvent.CLOSE)
        busy = bool(self._on_link.get(conn))
        self._gone[conn] = error
        while len(self._gone) > PLAN_CACHE:
            self._gone.popitem(last=False)
        if self._by_endpoint.get(link.endpoint) == conn:
            del self._by_endpoint[link.endpoint]
        for fetch in list(self._on_link.get(conn, {}).values()):
            if not fetch.done:
                self._fail(fetch, clone_error(error), now, tell_prefill=False)  # one error object each
        if link.conn is not None:
            if bye is not None and link.conn.ready:
                link.conn.send(Bye(bye, str(error)[:_REASON]))
            data = link.conn.data_to_send()
            if data and bye is not None:
                self._actions.append(Send(conn, data))
        if link.backend_peer:
            self._actions.append(RemovePeer(conn))
        self._actions.append(Close(conn, str(error)))
        self._events.append(PeerGone(conn, link.peer, str(error)))
        log.log(logging.WARNING if busy and bye is None else logging.INFO, "link to %s closed: %s",
                printable(where(link)), printable(error))

    def _fetch_of(self, conn: int, lease: bytes, state: FetchState) -> Fetch | None:
        """The fetch of ``lease`` on link ``conn`` if it is in ``state`` (one not finished)."""
        fetch = self._live.get(lease)
        return fetch if fetch is not None and fetch.link == conn and fetch.state is state else None

    def _waiting(self, link: PrefillLink) -> list[Fetch]:
        """Fetches whose claim waits for ``link`` to be ready (claiming, nothing sent yet), oldest first."""
        return [f for f in self._on_link.get(link.id, {}).values()
                if f.state is FetchState.CLAIMING and f.claimed_at is None]

    def _any_renewable(self, link: PrefillLink) -> bool:
        """``_renewable(link)`` is not empty (without building it: asked every turn)."""
        return bool(link.offers) or any(f.offer is not None or f.claimed_at is not None
                                        for f in self._on_link.get(link.id, {}).values())

    def _renewable(self, link: PrefillLink) -> list[bytes]:
        """Leases on ``link`` that must not expire: fetches not finished, and offers not yet taken."""
        ids = [f.lease for f in self._on_link.get(link.id, {}).values()
               if f.offer is not None or f.claimed_at is not None]
        fetched = set(ids)
        return ids + [i for i in link.offers if i not in fetched]
