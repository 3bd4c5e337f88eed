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
surely valid (before the conservative cutoff: TTL minus one heartbeat after
the lease was surely renewed), unless the prefill's done ack confirms it.

A prefill whose layout this rank cannot read (negotiation refused the pair)
is remembered by its layout id: a ticket naming that layout fails at once
with the same ``LayoutMismatch``, and every lease this rank came for there is
declined (a ``Claim`` over the refused link before its ``Bye``, over a link
opened to say it) so its prefill frees the pages rather than at their TTL.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ..core.fetchplan import destination_pages, needed_pages, rows_read, skip_below, split_chunks
from ..core.layout import PageLayout
from ..core.negotiate import TransferPlan, negotiate
from ..core.pages import int_array
from ..core.plan import plan_reads
from ..core.prompt import check_digest
from ..core.text import printable
from ..core.reads import ReadBatch
from ..core.tracker import DeliveryTracker
from ..errors import (
    AuthError, ConfigError, IncompleteFetch, KvlendError, LayoutMismatch, PageRangeError, PeerLost, PeerProtocolError,
    PromptMismatch, QuotaExceeded, TransferCancelled, TransferTimeout, UsageError,
)
from .actions import (
    AddPeer, Cancel, Close, Connect, FetchFinished, Offered, Outbox, PeerGone, PeerReady, Post, RemovePeer, Send,
)
from .codes import Code, code_of, detail_of, lease_error, link_error
from .config import NodeConfig
from .connection import Connection
from . import states
from .prefill import peer_layout
from .states import TERMINAL, FetchEvent, FetchState, LinkEvent, LinkState
from .ticket import Ticket
from .wire import (
    MAX_META, Abort, Bye, Claim, Done, DoneAck, Extend, Handshake, Heartbeat, LeaseOffer, Message, Offer, Renewed,
)

log = logging.getLogger("kvlend.session")
_REASON = 4000
_PLAN_CACHE = 64
_BEATS_KEPT = 64  # unanswered heartbeats remembered per link (a prefill that stalls costs no more)
_REFUSED_KEPT = 4096  # early claims' refusals remembered per link


@dataclass(eq=False)
class Fetch:
    """One lease being read into ``dst``.  Read its fields; the session changes them."""

    id: int
    link: int
    lease: bytes
    num_tokens: int
    dst: Mapping[str, Any]
    resume_from: int
    started: float
    deadline: float
    request: str = ""  # known once the offer is
    offer: LeaseOffer | None = None
    bound: int = 0  # safe-resume bound so far, in tokens
    error: KvlendError | None = None
    bytes: int = 0
    descriptors: int = 0
    finished: float | None = None
    tags: set = field(default_factory=set)  # reads posted and not yet terminal
    sure_until: float = -math.inf  # reads landing before this count for the bound without the ack
    claimed_at: float | None = None
    posted: float | None = None  # reads posted (all chunks at once)
    landed: float | None = None  # every read landed (before the done ack)
    quiet_by: float = math.inf  # CANCELLING: tear the link down if reads are still in flight then
    read_rows: dict = field(default_factory=dict)  # remote group -> token pages read or skipped so far
    ticket: Ticket | None = None  # redeemed from this ticket (its page table lets reads start with the claim)
    confirmed: bool = True  # False while reads posted from the ticket's pages await the claim's answer
    prompt_digest: bytes = b""  # what its claim carries: the digest of the prompt it reads for (empty: none)
    _state: FetchState | None = field(default=None, repr=False)  # changed only by ``states.transition``'s moves

    @property
    def state(self) -> FetchState:
        return self._state

    @property
    def done(self) -> bool:
        return self._state in TERMINAL

    @property
    def quiet(self) -> bool:
        """Nothing posted for this fetch can still write into ``dst``."""
        return not self.tags

    @property
    def seconds(self) -> float:
        return (self.finished if self.finished is not None else self.started) - self.started

    @property
    def read_seconds(self) -> float | None:
        """Posting the reads to the last landing: the data movement alone, without claim or ack."""
        return None if self.posted is None or self.landed is None else self.landed - self.posted

    @property
    def key(self) -> str:
        return f"fetch-{self.id}"


@dataclass(eq=False)
class _Link:
    id: int
    endpoint: tuple[str, int]
    deadline: float  # for reaching READY
    started: float
    state: LinkState | None = None  # changed only by ``DecodeSession._link_to``
    conn: Connection | None = None
    plan: TransferPlan | None = None
    expect: str | None = None  # the identity tickets for this endpoint name (checked against the certificate's)
    peer: str | None = None  # the prefill's identity: its certificate's name
    backend_peer: bool = False  # AddPeer was asked for
    handshake_ms: float = 0.0
    offers: dict = field(default_factory=dict)  # pushed, not yet fetched or declined: lease id -> offer
    sure: dict = field(default_factory=dict)  # lease id -> valid at least until then (offers not yet fetched)
    beats: deque = field(default_factory=deque)  # (sent at, lease ids) of heartbeats not yet answered
    blind: int = 0  # unanswered heartbeats sent after ``beats`` was full (answered after those in it)
    next_beat: float = 0.0
    waiting: list = field(default_factory=list)  # fetch ids to claim once READY
    abandoned: set = field(default_factory=set)  # leases whose claim we gave up on: their offer is stale
    early: dict = field(default_factory=dict)  # claimed ahead of a fetch, not yet answered: lease id -> sent at
    claimed: dict = field(default_factory=dict)  # claimed ahead, until fetched or given back: lease id -> its digest
    refused: OrderedDict = field(default_factory=OrderedDict)  # early claims the prefill refused: id -> (code, detail)
    declines: dict = field(default_factory=dict)  # to give back if the prefill refuses our layout: id -> digest


class DecodeSession(Outbox):
    """Reads leases from any number of prefill ranks into ``layout``'s pages."""

    def __init__(self, layout: PageLayout, backend_kind: str, metadata: bytes, *,
                 name: str = "decode", config: NodeConfig = NodeConfig()) -> None:
        self.layout = layout
        self.name = name
        self.config = config
        self.tracker = DeliveryTracker(layout)
        self._kind = backend_kind
        self._metadata = metadata
        self._links: dict[int, _Link] = {}
        self._by_endpoint: dict[tuple[str, int], int] = {}
        self._fetches: dict[int, Fetch] = {}  # every fetch not forgotten, by id
        self._live: dict[bytes, Fetch] = {}  # fetches not finished, by lease (one at most per lease)
        self._on_link: dict[int, dict[int, Fetch]] = {}  # fetches not finished, by link and id
        self._tags: dict[bytes, tuple[int, int]] = {}  # tag -> (fetch id, chunk)
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
        self._links[conn] = link = _Link(conn, (host, port), now + self.config.handshake_timeout, now)
        self._link_to(link, LinkEvent.OPEN)
        self._by_endpoint[(host, port)] = conn
        self._actions.append(Connect(conn, host, port))
        return conn

    def link_to(self, host: str, port: int, now: float) -> int:
        """The link to ``host:port``, opened on first use and shared by every later fetch."""
        conn = self._by_endpoint.get((host, port))
        return conn if conn is not None else self.open(host, port, now)

    def connected(self, conn: int, now: float) -> None:
        """The shell's connection for ``conn`` is up: its TLS handshake starts."""
        link = self._links.get(conn)
        if link is not None and link.state is LinkState.CONNECTING:
            link.conn = Connection(now)
            self._link_to(link, LinkEvent.CONNECTED)

    def authenticated(self, conn: int, identity: str, now: float) -> None:
        """TLS verified that the prefill at ``conn`` holds a certificate for ``identity``: hand it our layout."""
        link = self._links.get(conn)
        if link is None or link.state is not LinkState.TLS:
            return
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
        link.conn.send(Handshake(self.layout.encode(), self._kind, self._metadata))
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
                lost = PeerLost(f"link to {_where(link)} failed: {exc}")
            self._fail_link(conn, lost, now)

    def closed(self, conn: int, now: float, why: str = "connection closed", refused: bool = False) -> None:
        """The shell's connection for ``conn`` ended or could not be opened (``refused``: TLS failed,
        an ``AuthError`` rather than ``PeerLost``)."""
        link = self._links.get(conn)
        if link is not None:
            error = AuthError if refused else PeerLost
            self._fail_link(conn, error(f"{_where(link)}: {why}"), now)

    def disconnect(self, conn: int, now: float, reason: str = "decode closing the link") -> None:
        """Close a link in order; its fetches fail with ``PeerLost`` once their reads are quiet."""
        link = self._links.get(conn)
        if link is None:
            return
        self._fail_link(conn, PeerLost(f"{_where(link)}: {reason}"), now, bye=Code.OK)

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
        timeout = _timeout(timeout, self.config.transfer_timeout)
        link = self._ready_link(conn)
        if not isinstance(offer, LeaseOffer):
            raise UsageError(f"expected a LeaseOffer, got {type(offer).__name__}")
        self._check_not_fetching(offer.id)
        if offer.id not in link.offers:
            raise UsageError(f"lease {offer.id.hex()} is no longer offered on this link "
                                "(fetched, declined or withdrawn): ask the prefill to lend it again")
        resume_from = _resume_point(resume_from, offer.num_tokens)
        offer = link.offers[offer.id]  # as grown by any extension since it was offered
        work = self._work(link.plan, offer, dst, resume_from)  # may raise: nothing changed yet
        fetch = self._new_fetch(conn, offer.id, offer.num_tokens, dst, resume_from, now, timeout, FetchEvent.TAKE)
        fetch.sure_until = link.sure.get(offer.id, -math.inf)
        self._begin(fetch, offer, work, now, created=True)
        link.offers.pop(offer.id, None)
        link.sure.pop(offer.id, None)
        return fetch

    def fetch_ticket(self, ticket: Ticket, dst: Mapping[str, Any], now: float, resume_from: int = 0,
                     timeout: float | None = None, prompt_digest: bytes | None = None) -> Fetch:
        """Redeem ``ticket``: connect to its prefill if no link is open, claim the lease, read it.

        ``prompt_digest``: ``prompt_digest`` of the prompt the pages are read for; the claim carries it
        and the prefill refuses it (``PromptMismatch``) unless its lease holds that prompt's KV.
        """
        timeout = _timeout(timeout, self.config.transfer_timeout)
        digest = check_digest(prompt_digest) or b""
        if not isinstance(ticket, Ticket):
            raise UsageError(f"expected a Ticket, got {type(ticket).__name__}")
        self._check_size(ticket.num_tokens)
        resume_from = _resume_point(resume_from, ticket.num_tokens)
        if not isinstance(dst, Mapping):
            raise PageRangeError(f"dst: must map local groups to page tables, got {type(dst).__name__}")
        self._check_not_fetching(ticket.lease)
        known = self._by_endpoint.get(ticket.endpoint)
        if known is not None and self._links[known].plan is not None:
            check_destination(self._links[known].plan, dst, ticket.num_tokens)
        self._check_issuer(ticket)
        self._check_claimed(ticket, digest)
        refusal = self._unreadable.get(ticket.layout_id)
        if refusal is not None:  # no plan can read it: fail now, and let its prefill free the pages
            self._decline(ticket, digest, now)
            conn = self._by_endpoint.get(ticket.endpoint, 0)  # 0: none (declined before): the fetch needs none
            fetch = self._new_fetch(conn, ticket.lease, ticket.num_tokens, dst, resume_from, now, timeout,
                                    FetchEvent.REDEEM)
            self._fail(fetch, clone_error(refusal), now, tell_prefill=False)
            return fetch
        conn = self.link_to(ticket.host, ticket.port, now)
        link = self._links[conn]
        link.expect = ticket.prefill
        offer = link.offers.get(ticket.lease)
        if offer is not None and offer.num_tokens == ticket.num_tokens:  # claimed ahead and answered: read it
            fetch = self.fetch_offer(conn, offer, dst, now, resume_from, timeout)
            link.claimed.pop(ticket.lease, None)
            return fetch
        if offer is not None:  # not what the ticket says: claim again, and the answer fails the fetch
            link.offers.pop(ticket.lease)
            link.sure.pop(ticket.lease, None)
        fetch = self._new_fetch(conn, ticket.lease, ticket.num_tokens, dst, resume_from, now, timeout,
                                FetchEvent.REDEEM)
        fetch.ticket, fetch.prompt_digest = ticket, digest
        link.claimed.pop(ticket.lease, None)
        refusal = link.refused.pop(ticket.lease, None)
        sent = link.early.pop(ticket.lease, None)  # None too for a claim queued until the link is ready
        if refusal is not None:
            code, detail = refusal
            self._fail(fetch, lease_error(code, f"prefill {link.peer} refused lease {ticket.lease.hex()}: {detail}"),
                       now, tell_prefill=False)
        elif sent is not None:  # claimed ahead, answer still on its way: wait for it
            fetch.claimed_at = sent
        elif link.state is LinkState.READY:
            self._claim(link, fetch, now)
        else:
            link.waiting.append(fetch.id)
        return fetch

    def claim_ticket(self, ticket: Ticket, now: float, prompt_digest: bytes | None = None) -> None:
        """Claim ``ticket``'s lease now and keep it alive (heartbeats) until ``fetch_ticket`` reads it.

        For an engine that learns of a request before it has pages to read it into: the lease
        no longer has to outlive the engine's queue on its TTL alone.  Idempotent; a refusal is
        remembered and fails the later fetch at once.  ``unclaim`` gives a lease back unread.
        ``prompt_digest``: as in ``fetch_ticket``, which must then pass the same.
        """
        if not isinstance(ticket, Ticket):
            raise UsageError(f"expected a Ticket, got {type(ticket).__name__}")
        digest = check_digest(prompt_digest) or b""
        self._check_size(ticket.num_tokens)
        if ticket.lease in self._live:
            return
        self._check_issuer(ticket)
        if ticket.layout_id in self._unreadable:
            self._decline(ticket, digest, now)
            return
        link = self._links[self.link_to(ticket.host, ticket.port, now)]
        link.expect = ticket.prefill
        if ticket.lease in link.early or ticket.lease in link.offers or ticket.lease in link.refused:
            return
        if len(link.early) >= self.config.quotas.max_leases_per_peer:
            raise QuotaExceeded("max_leases_per_peer", len(link.early) + 1, self.config.quotas.max_leases_per_peer,
                                "early claims on one link:")
        link.claimed[ticket.lease] = digest
        if link.state is LinkState.READY:
            link.early[ticket.lease] = now
            link.conn.send(Claim(ticket.lease, digest))
        else:
            link.early[ticket.lease] = None

    def _check_claimed(self, ticket: Ticket, digest: bytes) -> None:
        """``PromptMismatch`` if ``ticket``'s lease was claimed ahead for another prompt than ``digest``'s."""
        conn = self._by_endpoint.get(ticket.endpoint)
        claimed = self._links[conn].claimed.get(ticket.lease) if conn is not None else None
        if claimed is not None and claimed != digest:
            raise PromptMismatch(f"lease {ticket.lease.hex()} was claimed for another prompt than this fetch's")

    def _decline(self, ticket: Ticket, digest: bytes, now: float) -> None:
        """Give back a lease of a layout no plan of ours reads, over a link to its prefill opened for it: the
        prefill refuses our layout, and our ``Claim`` of the lease (with ``digest``, as any claim), before our
        ``Bye``, makes it end it."""
        if ticket.lease in self._declined:
            return
        self._declined[ticket.lease] = None
        while len(self._declined) > _REFUSED_KEPT:
            self._declined.popitem(last=False)
        link = self._links[self.link_to(ticket.host, ticket.port, now)]
        if link.state is LinkState.READY:
            return  # its prefill's layout is one we read, not the ticket's: the lease, if any, waits its TTL
        link.expect = ticket.prefill
        if len(link.declines) < self.config.quotas.max_leases_per_peer:  # past that, the lease waits its TTL
            link.declines[ticket.lease] = digest

    def _check_issuer(self, ticket: Ticket) -> None:
        """``AuthError`` if the link to the ticket's endpoint serves (or awaits) another prefill than it names."""
        conn = self._by_endpoint.get(ticket.endpoint)
        link = self._links.get(conn) if conn is not None else None
        if link is None:
            return
        known = link.peer or link.expect
        if known is not None and known != ticket.prefill:
            raise AuthError(f"the ticket for lease {ticket.lease.hex()} names the prefill {ticket.prefill!r}, "
                            f"but {ticket.host}:{ticket.port} is {'' if link.peer else 'expected to be '}{known!r}")

    def unclaim(self, ticket: Ticket) -> None:
        """Give back a lease claimed ahead and never fetched: the prefill releases it at once."""
        conn = self._by_endpoint.get(ticket.endpoint)
        link = self._links.get(conn) if conn is not None else None
        if link is None:
            return
        link.refused.pop(ticket.lease, None)
        link.claimed.pop(ticket.lease, None)
        if ticket.lease in link.early:
            if link.early.pop(ticket.lease) is not None:  # sent: its offer may still come, dropped then
                link.abandoned.add(ticket.lease)
                link.conn.send(Abort(ticket.lease, Code.CANCELLED, "unclaimed: the decode will not read it"))
        elif ticket.lease in link.offers and link.state is LinkState.READY:
            self.decline(conn, link.offers[ticket.lease], "unclaimed: the decode will not read it")

    def decline(self, conn: int, offer: LeaseOffer, reason: str) -> None:
        """Tell the prefill this rank will not read ``offer``: it releases the lease at once."""
        link = self._ready_link(conn)
        if offer.id in self._live:
            raise UsageError(f"lease {offer.id.hex()} is being fetched: cancel the fetch instead")
        link.offers.pop(offer.id, None)
        link.sure.pop(offer.id, None)
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
        entry = self._tags.pop(tag, None)
        if entry is None:
            return
        fetch = self._fetches.get(entry[0])
        if fetch is None:
            return
        fetch.tags.discard(tag)
        if fetch.state is FetchState.READING:
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

    # ------------------------------------------------------------------ time
    def tick(self, now: float) -> None:
        """Deadlines, escalation of reads that will not go quiet, and heartbeats."""
        for conn, link in list(self._links.items()):
            if link.state is not LinkState.READY and now > link.deadline:
                self._fail_link(conn, TransferTimeout(
                    f"{_where(link)}: no handshake within {self.config.handshake_timeout:.3g} s"), now)
        for fetch in list(self._live.values()):
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
                    link.conn.send(Heartbeat(tuple(leases)))
                    if link.blind or len(link.beats) >= _BEATS_KEPT:
                        link.blind += 1  # its answer will confirm nothing
                    else:
                        link.beats.append((now, frozenset(leases)))
                link.next_beat = now + self.config.heartbeat

    def next_deadline(self) -> float | None:
        """When ``tick`` next has work (None: nothing pending)."""
        times = [link.deadline for link in self._links.values() if link.state is not LinkState.READY]
        times += [link.next_beat for link in self._links.values()
                  if link.state is LinkState.READY and self._renewable(link)]
        for f in self._live.values():
            if f.state is FetchState.CANCELLING:
                if f.link in self._links:  # once its link is torn down there is nothing left to escalate
                    times.append(f.quiet_by)
            elif not f.done:
                times.append(f.deadline)
        return min(times) if times else None

    # --------------------------------------------------------------- outputs
    def _connections(self):
        return ((conn, link.conn) for conn, link in self._links.items() if link.conn is not None)

    # -------------------------------------------------------------- messages
    def _handle(self, conn: int, link: _Link, message: Message, now: float) -> None:
        if link.state is LinkState.HANDSHAKE:
            self._handshake(conn, link, message, now)
        elif isinstance(message, Offer):
            self._offer(conn, link, message.lease, now)
        elif isinstance(message, Extend):
            self._extended(conn, link, message, now)
        elif isinstance(message, Renewed):
            self._renewed(conn, link, message)
        elif isinstance(message, DoneAck):
            fetch = self._fetch_of(conn, message.lease, FetchState.ACKING)
            if fetch is not None:
                self._acked(fetch, message, now)
        elif isinstance(message, Abort):
            self._withdrawn(conn, link, message, now)
        elif isinstance(message, Bye):
            raise PeerLost(f"prefill {link.peer} closed: {message.detail}")
        else:
            raise PeerProtocolError(f"unexpected {message.TYPE} from prefill {link.peer}")

    def _handshake(self, conn: int, link: _Link, message: Message, now: float) -> None:
        if isinstance(message, Bye):
            raise link_error(message.code, f"prefill {link.peer} refused the handshake: {message.detail}")
        remote = peer_layout(message, self._kind)
        # Addresses are not part of a layout id, but the plan holds them: a restarted
        # prefill with the same layout elsewhere in memory needs its own plan.
        key = (self.layout.layout_id, remote.layout_id, tuple((r.name, r.address) for r in remote.regions))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _PLAN_CACHE:
                self._plans.clear()
            quotas = self.config.quotas
            try:
                plan = negotiate(self.layout, remote, max_page_ratio=quotas.max_page_ratio,
                                 max_pieces=quotas.max_pieces)
            except LayoutMismatch as exc:
                self._unreadable_layout(conn, link, remote, exc, now)
                return
            self._plans[key] = plan
        if not message.metadata:
            raise PeerProtocolError(f"prefill {link.peer} sent no backend metadata")
        link.plan = plan
        self._link_to(link, LinkEvent.LAYOUT)
        link.handshake_ms = (now - link.started) * 1e3
        link.next_beat = now + self.config.heartbeat
        link.backend_peer = True
        self._actions.append(AddPeer(conn, message.metadata))
        self._events.append(PeerReady(conn, link.peer))
        log.info("handshake with %s: %s", printable(link.peer), plan.summary().splitlines()[0])
        waiting, link.waiting = link.waiting, []
        for fid in waiting:
            fetch = self._fetches.get(fid)
            if fetch is not None and fetch.state is FetchState.CLAIMING:
                self._claim(link, fetch, now)
        for lease in [i for i, sent in link.early.items() if sent is None]:
            link.early[lease] = now
            link.conn.send(Claim(lease, link.claimed.get(lease, b"")))
        link.declines.clear()  # a layout we read after all: nothing to give back

    def _unreadable_layout(self, conn: int, link: _Link, remote: PageLayout, refusal: LayoutMismatch,
                           now: float) -> None:
        """No plan reads ``remote``: remember it, decline every lease we came for, and close the link."""
        self._unreadable[remote.layout_id] = refusal
        while len(self._unreadable) > _PLAN_CACHE:
            self._unreadable.popitem(last=False)
        came_for = [(self._fetches[f].lease, self._fetches[f].prompt_digest) for f in link.waiting
                    if f in self._fetches] + [(lease, link.claimed.get(lease, b"")) for lease in link.early]
        for lease, digest in dict([*came_for, *link.declines.items()]).items():
            link.conn.send(Claim(lease, digest))  # refused as we are, a claim gives the lease back
        self._fail_link(conn, refusal, now, bye=code_of(refusal))  # the claims go out before the bye

    def _offer(self, conn: int, link: _Link, offer: LeaseOffer, now: float) -> None:
        if offer.id in link.abandoned:  # the answer to a claim we gave up on (and aborted)
            link.abandoned.discard(offer.id)
            return
        unknown = sorted(map(repr, set(offer.pages) - set(link.plan.remote.groups)))
        if unknown:
            raise PeerProtocolError(f"prefill {link.peer} offered lease {offer.id.hex()} with unknown groups "
                                f"[{', '.join(unknown)}]")
        _check_committed(link, offer.id, offer.pages, offer.ready, offer.num_tokens)
        fetch = self._fetch_of(conn, offer.id, FetchState.CLAIMING)
        if fetch is None:
            ahead = self._live.get(offer.id)
            if ahead is not None and ahead.link == conn and not ahead.confirmed:  # the answer to a claim whose reads went ahead from the ticket
                self._confirm(ahead, offer, now)
                return
        if fetch is None and offer.id in link.early:  # claimed ahead: held (and heartbeated) for its fetch
            sent = link.early.pop(offer.id)
            link.offers[offer.id] = offer
            link.sure[offer.id] = sent + offer.ttl - self.config.heartbeat  # renewed when our claim arrived
            return
        if fetch is None:  # pushed: trusted once a heartbeat renewal confirms it, which we ask for now
            try:
                self._check_size(offer.num_tokens)
            except QuotaExceeded as exc:  # tracking it would cost memory in proportion: decline at once
                link.conn.send(_abort(offer.id, exc))
                log.warning("prefill %s offered a lease too large to read: %s", printable(link.peer), exc)
                return
            link.offers[offer.id] = offer
            link.next_beat = now
            self._events.append(Offered(conn, offer))
            return
        if offer.num_tokens != fetch.num_tokens:
            self._fail(fetch, PeerProtocolError(f"lease {offer.id.hex()} has {offer.num_tokens} tokens, its ticket "
                                            f"said {fetch.num_tokens}"), now)
            return
        fetch.request = offer.request
        # The prefill renewed the lease when the claim arrived, which was after we sent it.
        fetch.sure_until = fetch.claimed_at + offer.ttl - self.config.heartbeat
        try:
            work = self._work(link.plan, offer, fetch.dst, fetch.resume_from)
            self._move(fetch, FetchEvent.POST)
            self._begin(fetch, offer, work, now, created=False)
        except Exception as exc:  # the engine's bad table, or a bug: this fetch fails, the link and lease stay
            if isinstance(exc, states.IllegalTransition):
                raise
            error = exc if isinstance(exc, KvlendError) else KvlendError(
                f"request {offer.request}: starting the reads failed: {type(exc).__name__}: {exc}")
            if fetch.state is FetchState.READING:
                self._move(fetch, FetchEvent.UNPOST)
            fetch.claimed_at = None  # nothing was posted: the lease stays ours to claim again, or to expire
            self._fail(fetch, error, now)

    def _extended(self, conn: int, link: _Link, message: Extend, now: float) -> None:
        """A progressive lease grew: an offer not yet fetched grows; a fetch reading it posts the new pages."""
        offer = link.offers.get(message.lease)
        if offer is not None:
            link.offers[message.lease] = _grown(link, offer, message)
            return
        fetch = self._fetch_of(conn, message.lease, FetchState.READING)
        if fetch is None:
            if self._fetch_of(conn, message.lease, FetchState.ACKING) is not None:
                raise PeerProtocolError(f"prefill {link.peer} extended lease {message.lease.hex()} after it was final")
            return  # a fetch that failed, or a claim given up: nothing to read
        grown = _grown(link, fetch.offer, message)  # a malformed extension fails the link
        try:
            work = self._work(link.plan, grown, fetch.dst, fetch.resume_from, fetch.read_rows)
            fetch.offer = grown
            self._post_work(fetch, work, now, begin=False)
        except Exception as exc:  # the engine's table, or a bug: this fetch fails, the link stays
            if isinstance(exc, states.IllegalTransition):
                raise
            error = exc if isinstance(exc, KvlendError) else KvlendError(
                f"request {fetch.request}: reading an extension failed: {type(exc).__name__}: {exc}")
            self._fail(fetch, error, now)

    def _renewed(self, conn: int, link: _Link, message: Renewed) -> None:
        """A heartbeat's answer: its leases were renewed after we sent it, so they hold a TTL from then."""
        if not link.beats:
            if not link.blind:
                raise PeerProtocolError(f"prefill {link.peer} answered a heartbeat that was never sent")
            link.blind -= 1  # not remembered: trust nothing from it
            return
        sent, asked = link.beats.popleft()
        if not set(message.leases) <= asked:
            raise PeerProtocolError(f"prefill {link.peer} renewed leases the heartbeat did not name")
        for lease in message.leases:
            offer = link.offers.get(lease)
            if offer is not None:
                link.sure[lease] = max(link.sure.get(lease, -math.inf), sent + offer.ttl - self.config.heartbeat)
        for lease in set(message.leases):
            fetch = self._live.get(lease)
            if fetch is not None and fetch.link == conn and fetch.offer is not None and fetch.confirmed:
                fetch.sure_until = max(fetch.sure_until, sent + fetch.offer.ttl - self.config.heartbeat)

    def _withdrawn(self, conn: int, link: _Link, message: Abort, now: float) -> None:
        """The prefill refused a claim or ended the lease: nothing read under it may be used.

        A lease it ended after its offer came keeps its pages locked until we say we are quiet:
        an ``Abort`` back, at once for an offer nobody reads, once its reads are terminal for a
        fetch (a fetch that sent its done has said so already).
        """
        offered = message.lease in link.offers
        if message.lease in link.early or offered:
            link.early.pop(message.lease, None)
            link.claimed.pop(message.lease, None)
            link.refused[message.lease] = message.code, message.detail  # what a later fetch of its ticket fails with
            while len(link.refused) > _REFUSED_KEPT:
                link.refused.popitem(last=False)
        link.offers.pop(message.lease, None)
        link.sure.pop(message.lease, None)
        if offered:
            link.conn.send(Abort(message.lease, Code.CANCELLED, "withdrawn before it was read"))
        fetch = self._live.get(message.lease)
        if fetch is not None and fetch.link == conn:
            fetch.bound = fetch.resume_from  # its pages may be reused under our reads
            error = lease_error(message.code, f"prefill {link.peer} refused lease {message.lease.hex()}: "
                                              f"{message.detail}")
            self._fail(fetch, error, now, tell_prefill=fetch.state is not FetchState.CLAIMING)  # acks if it read
        link.abandoned.discard(message.lease)  # this was the answer: nothing more comes for it
        log.info("prefill %s withdrew lease %s: %s", printable(link.peer), message.lease.hex(),
                 printable(message.detail))

    def _acked(self, fetch: Fetch, ack: DoneAck, now: float) -> None:
        if ack.ok and not fetch.confirmed:  # the channel is ordered: the claim's answer comes first
            fetch.bound = fetch.resume_from
            self._finish(fetch, FetchEvent.FAIL, PeerProtocolError(
                f"request {fetch.request or fetch.lease.hex()}: done acknowledged before the claim was answered"), now)
            return
        if not ack.ok:
            fetch.bound = fetch.resume_from  # nothing read under this lease may be used
            self._finish(fetch, FetchEvent.FAIL, lease_error(
                ack.code, f"request {fetch.request}: prefill refused done ({ack.detail}); discard what was read"), now)
            return
        bound = self.tracker.bound(fetch.key)
        fetch.bound = bound
        if bound < fetch.num_tokens:
            self._finish(fetch, FetchEvent.FAIL, IncompleteFetch(
                f"request {fetch.request}: every read landed but they cover only {bound} of "
                f"{fetch.num_tokens} tokens (the lease does not hold every page this rank needs)"), now)
        else:
            self._finish(fetch, FetchEvent.ACK, None, now)

    # -------------------------------------------------------------- internals
    def _check_size(self, num_tokens: int) -> None:
        cap = self.config.quotas.max_num_tokens
        if num_tokens > cap:
            raise QuotaExceeded("max_num_tokens", num_tokens, cap, "a lease of")

    def _check_not_fetching(self, lease: bytes) -> None:
        if lease in self._live:
            raise UsageError(f"lease {lease.hex()} is already being fetched")

    def _ready_link(self, conn: int) -> _Link:
        link = self._links.get(conn)
        if link is None or link.state is not LinkState.READY:
            why = self._gone.get(conn) if isinstance(conn, int) else None
            raise PeerLost(f"link {conn!r} is not connected" + (f" (it closed: {why})" if why is not None else
                                                                  f" (open: {sorted(self._links)})"))
        return link

    def _new_fetch(self, conn: int, lease: bytes, num_tokens: int, dst, resume_from: int, now: float,
                   timeout: float, start: FetchEvent) -> Fetch:
        self._next_fetch += 1
        fetch = Fetch(self._next_fetch, conn, lease, num_tokens, dst, resume_from, now, now + timeout,
                      bound=resume_from)
        self._fetches[fetch.id] = fetch
        self._live[lease] = fetch
        self._on_link.setdefault(conn, {})[fetch.id] = fetch
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

    def _link_to(self, link: _Link, event: LinkEvent) -> None:
        """The one place a link's state changes: checked against ``states.LINK``."""
        link.state = states.transition("link", link.state, event)

    def _claim(self, link: _Link, fetch: Fetch, now: float) -> None:
        fetch.claimed_at = now
        link.conn.send(Claim(fetch.lease, fetch.prompt_digest))
        self._read_ahead(link, fetch, now)

    def _read_ahead(self, link: _Link, fetch: Fetch, now: float) -> None:
        """Post a ticket's reads from the page table it carries while its claim is on the way.

        Nothing read counts until the claim's answer confirms the lease and the same pages
        (``_confirm``): the lease was live when the claim arrived, so it was live for every read
        before that, and the answer renews it for a TTL after.  A ticket without pages, for another
        layout than the link's, or with pages this rank cannot read, waits for the answer instead, and so
        does a fetch bound to its prompt: no byte moves before the prefill checked the prompt digest.
        """
        ticket = fetch.ticket
        if not self.config.read_ahead or fetch.prompt_digest or ticket is None or ticket.pages is None \
                or ticket.layout_id != link.plan.remote.layout_id \
                or not set(ticket.pages) <= set(link.plan.remote.groups):
            return
        offer = LeaseOffer(fetch.lease, "", fetch.num_tokens, ticket.pages, link.plan.remote.full_selection(),
                           self.config.ttl)
        try:
            work = self._work(link.plan, offer, fetch.dst, fetch.resume_from)
            self._move(fetch, FetchEvent.READ_AHEAD)
            fetch.confirmed = False
            self._begin(fetch, offer, work, now, created=False)
        except KvlendError:  # a bad table is reported when the answer comes, as without a page table
            if fetch.state is FetchState.READING:
                self._move(fetch, FetchEvent.UNPOST)
            fetch.confirmed = True

    def _confirm(self, fetch: Fetch, offer: LeaseOffer, now: float) -> None:
        """The claim's answer for reads posted ahead: the same pages, final, every row, or they are void."""
        if fetch.state is FetchState.CANCELLING:
            return  # it ends once quiet, and its abort releases the lease
        ahead = fetch.offer
        same = (offer.num_tokens == fetch.num_tokens and offer.final and offer.selection == ahead.selection
                and offer.pages.keys() == ahead.pages.keys()
                and all(np.array_equal(offer.pages[g].token_pages, ahead.pages[g].token_pages)
                        and np.array_equal(offer.pages[g].ordinals, ahead.pages[g].ordinals) for g in offer.pages))
        if not same:
            fetch.bound = fetch.resume_from
            self._fail(fetch, PeerProtocolError(f"lease {offer.id.hex()}: the claim's answer names other pages than "
                                            "its ticket; what was read from the ticket's is discarded"), now)
            return
        fetch.offer, fetch.request, fetch.confirmed = offer, offer.request, True
        fetch.sure_until = fetch.claimed_at + offer.ttl - self.config.heartbeat
        if fetch.state is FetchState.READING and now < fetch.sure_until:
            fetch.bound = max(fetch.resume_from, self.tracker.bound(fetch.key))

    def _work(self, plan: TransferPlan, offer: LeaseOffer, dst: Mapping[str, Any], resume_from: int,
              done_rows: Mapping[str, np.ndarray] | None = None):
        """Every chunk's descriptors and local pages, what the tracker waits for, and the remote rows
        this reads; of a grown offer, only rows not read (or skipped) before (``done_rows``).

        Computed before any state changes, so a bad destination table fails first.
        """
        given = offer.pages if not done_rows else {
            rg: gp.select(~np.isin(gp.token_pages, done_rows[rg])) if rg in done_rows else gp
            for rg, gp in offer.pages.items()}
        pages, kept = skip_below(plan, given, offer.num_tokens, resume_from)
        chunks = [(plan_reads(plan, src, dst, offer.selection), local)
                  for src, local in split_chunks(plan, pages, offer.num_tokens, self.config.chunk_pages)]
        needed = needed_pages(plan, given, offer.num_tokens)
        read = rows_read(plan, given, offer.num_tokens)
        if done_rows:
            read = {rg: np.union1d(done_rows.get(rg, read[rg][:0]), rows) for rg, rows in read.items()}
        return chunks, kept, needed, read

    def _begin(self, fetch: Fetch, offer: LeaseOffer, work, now: float, created: bool) -> None:
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

    def _post_work(self, fetch: Fetch, work, now: float, begin: bool) -> None:
        """Post ``work``'s chunks (tracking the fetch first if ``begin``); the posts are all or nothing."""
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
            for batches, local in chunks:
                self._seq += 1
                tag = f"{self.name}:{self._seq}".encode()
                self.tracker.post(fetch.key, self._seq, local)
                self._actions.append(Post(fetch.link, batches, tag))
                tags.append(tag)
                self._tags[tag] = (fetch.id, self._seq)
                fetch.bytes += _nbytes(batches)
                fetch.descriptors += sum(b.count for b in batches)
        except BaseException:
            del self._actions[mark:]
            for tag in tags:
                self._tags.pop(tag, None)
            fetch.bytes, fetch.descriptors = counted
            raise
        fetch.tags.update(tags)
        fetch.read_rows = read
        if fetch.posted is None:
            fetch.posted = now
        if now < fetch.sure_until:
            fetch.bound = max(fetch.resume_from, self.tracker.bound(fetch.key))
        self._progress(fetch, now)

    def _progress(self, fetch: Fetch, now: float) -> None:
        """Move a fetch on once its reads allow: send done, or finish a failure when quiet."""
        if fetch.tags:
            return
        if fetch.state is FetchState.READING:
            if not fetch.offer.final:
                return  # a progressive lease: the prefill has more to lend (``Extend``)
            self._move(fetch, FetchEvent.LAND)
            fetch.landed = now
            self._links[fetch.link].conn.send(Done(fetch.lease, self.tracker.bound(fetch.key)))
        elif fetch.state is FetchState.CANCELLING:
            link = self._links.get(fetch.link)
            if link is not None and link.state is LinkState.READY and fetch.offer is not None:
                link.conn.send(_abort(fetch.lease, fetch.error))
            self._finish(fetch, FetchEvent.QUIET, fetch.error, now)

    def _fail(self, fetch: Fetch, error: KvlendError, now: float, tell_prefill: bool = True) -> None:
        """Stop a fetch: cancel what is in flight; it finishes once quiet."""
        if fetch.done or fetch.state is FetchState.CANCELLING:
            return
        link = self._links.get(fetch.link)
        if fetch.state is FetchState.CLAIMING:
            if tell_prefill and link is not None and link.state is LinkState.READY and fetch.claimed_at is not None:
                link.conn.send(_abort(fetch.lease, error))
                link.abandoned.add(fetch.lease)
            if link is not None and fetch.id in link.waiting:
                link.waiting.remove(fetch.id)
            self._finish(fetch, FetchEvent.FAIL, error, now)
            return
        if not fetch.confirmed and link is not None:
            link.abandoned.add(fetch.lease)  # the claim's answer may still come: it is not an offer to us
        if fetch.state is FetchState.ACKING:  # every read is terminal; the prefill releases on our done
            self._finish(fetch, FetchEvent.FAIL, error, now)
            return
        fetch.error = error
        self._move(fetch, FetchEvent.FAIL)
        fetch.quiet_by = now + self.config.cancel_grace
        self.tracker.abort(fetch.key)
        for tag in sorted(fetch.tags):
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
        while len(self._gone) > _PLAN_CACHE:
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
                printable(_where(link)), printable(error))

    def _fetch_of(self, conn: int, lease: bytes, state: FetchState) -> Fetch | None:
        """The fetch of ``lease`` on link ``conn`` if it is in ``state`` (one not finished)."""
        fetch = self._live.get(lease)
        return fetch if fetch is not None and fetch.link == conn and fetch.state is state else None

    def _renewable(self, link: _Link) -> list[bytes]:
        """Leases on ``link`` that must not expire: fetches not finished, and offers not yet taken."""
        ids = [f.lease for f in self._on_link.get(link.id, {}).values()
               if f.offer is not None or f.claimed_at is not None]
        fetched = set(ids)
        return ids + [i for i in link.offers if i not in fetched]


def _grown(link: _Link, offer: LeaseOffer, message: Extend) -> LeaseOffer:
    """``offer`` with ``message``'s rows; ``PeerProtocolError`` for an extension no prefill sends."""
    if not offer.ready < message.ready <= offer.num_tokens:
        raise PeerProtocolError(f"prefill {link.peer} extended lease {message.lease.hex()} from {offer.ready} to "
                            f"{message.ready} tokens (of {offer.num_tokens})")
    unknown = sorted(map(repr, set(message.pages) - set(link.plan.remote.groups)))
    if unknown:
        raise PeerProtocolError(f"prefill {link.peer} extended lease {message.lease.hex()} with unknown groups "
                            f"[{', '.join(unknown)}]")
    _check_committed(link, message.lease, message.pages, message.ready, offer.num_tokens)
    if len(set(offer.meta) | set(message.meta)) > MAX_META:
        raise PeerProtocolError(f"prefill {link.peer} grew lease {message.lease.hex()}'s meta past {MAX_META} entries")
    return offer.extended(message.ready, message.pages, message.meta)


def _check_committed(link: _Link, lease: bytes, pages: Mapping[str, Any], ready: int, num_tokens: int) -> None:
    """A lease not yet final lends only pages wholly below ``ready`` and no recurrent state: a prefill
    naming more would have its reader count bytes it has not computed."""
    if ready == num_tokens:
        return
    remote = link.plan.remote
    for group, gp in pages.items():
        if not len(gp):
            continue
        if remote.groups[group].recurrent or (int(gp.token_pages[-1]) + 1) * remote.tokens_per_page > ready:
            raise PeerProtocolError(f"prefill {link.peer} lent rows of group {group!r} past the {ready} tokens it has "
                                f"committed of lease {lease.hex()}")


def check_destination(plan: TransferPlan, dst: Any, num_tokens: int) -> None:
    """Refuse a destination table that cannot hold a lease of ``num_tokens`` (before anything is sent)."""
    if not isinstance(dst, Mapping) or set(dst) != set(plan.local.groups):
        have = sorted(map(str, dst)) if isinstance(dst, Mapping) else type(dst).__name__
        raise PageRangeError(f"dst: must map every local group {sorted(plan.local.groups)}, got {have}")
    for group, need in destination_pages(plan, num_tokens).items():
        table = int_array(f"dst[{group!r}]", dst[group])
        if table.size < need:
            raise PageRangeError(f"dst[{group!r}]: {table.size} entries, a lease of {num_tokens} tokens needs {need}")


def clone_error(error: KvlendError) -> KvlendError:
    """A copy of ``error`` (its fields too), so each fetch carries its own ``.request`` and ``.bound``."""
    clone = error.__class__.__new__(error.__class__)
    clone.__dict__.update(error.__dict__)
    clone.args = error.args
    return clone


def _where(link: _Link) -> str:
    host, port = link.endpoint
    return f"prefill {link.peer or '?'} at {host}:{port}"


def _nbytes(batches: list[ReadBatch]) -> int:
    return sum(b.nbytes for b in batches)


def _resume_point(resume_from: Any, num_tokens: int) -> int:
    if isinstance(resume_from, bool) or not isinstance(resume_from, (int, np.integer)) \
            or not 0 <= resume_from <= num_tokens:
        raise PageRangeError(f"resume_from: must be an int in [0, {num_tokens}], got {resume_from!r}")
    return int(resume_from)


def _timeout(value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"timeout: must be a positive number of seconds, got {value!r}")
    return float(value)


def _abort(lease: bytes, error: KvlendError) -> Abort:
    """The ``Abort`` that tells the prefill why this rank ends ``lease``."""
    return Abort(lease, code_of(error), detail_of(error))
