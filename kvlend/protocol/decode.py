"""``DecodeSession``: the reading side of the control protocol, sans-IO.

Fed connection events, received bytes, transfer completions and ``now``;
returns actions (connect, send, close, add or remove a backend peer, post or
cancel reads) and events (offers pushed, fetches finished).  It runs many
fetches at once over many links, each link one prefill endpoint.

A fetch's life: (claim a ticket's lease) -> post its chunks -> every chunk
done -> ``done``, if they all landed while the lease was surely valid (below) and cover it: its
``Done`` then goes unanswered in the link's next ``Heartbeat`` (batched per link and turn, folded
into one due anyway; protocol 6).  Otherwise -> ``Done`` -> the prefill's ack -> ``done``.  A progressive lease
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

The session is a facade over parts that each own their state: ``Links`` (decode_link.py), ``Fetches``
(decode_fetches.py), ``TicketClaims`` (decode_claims.py) and ``PrefillMessages`` (decode_messages.py).
They share one ``Queue`` of actions and events; closing a link, which touches links and fetches, is
the session's (``_fail_link``), passed to the parts that need it.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from ..core.layout import PageLayout
from ..core.negotiate import TransferPlan
from ..core.text import printable
from ..core.tracker import DeliveryTracker
from ..errors import AuthError, KvlendError, PeerLost, PeerProtocolError, TransferCancelled, TransferTimeout
from .actions import Close, PeerGone, Queue, RemovePeer, Send
from .codes import Code
from .config import NodeConfig
from .connection import Connection
from .decode_claims import TicketClaims
from .decode_fetches import Fetches
from .decode_link import REASON_CHARS, Links, PrefillLink, where
from .decode_messages import PrefillMessages
from .fetch import Fetch, check_destination, clone_error
from .inputs import Authenticated, Connected, Data, Gone, Input
from .states import FetchState, LinkEvent, LinkState
from .ticket import Ticket
from .wire import Bye, Handshake, Heartbeat, LeaseOffer, Message

__all__ = ["DecodeSession", "Fetch", "FetchState", "check_destination", "clone_error"]

log = logging.getLogger("kvlend.session")
_BEATS_KEPT = 64  # unanswered heartbeats remembered per link (a prefill that stalls costs no more)


class DecodeSession:
    """Reads leases from any number of prefill ranks into ``layout``'s pages."""

    def __init__(self, layout: PageLayout, backend_kind: str, *,
                 name: str = "decode", config: NodeConfig = NodeConfig(), read_window: int | None = None) -> None:
        self.layout = layout
        self.name = name
        self.config = config
        self.tracker = DeliveryTracker(layout)
        # What a prefill learns of us: the layout to negotiate with, never where our memory is nor how to
        # reach it (a prefill only answers reads; a peer posing as one gets nothing to read or write with).
        self._hello = Handshake(layout.without_addresses().encode(), backend_kind, b"")
        self._queue = Queue()
        self._links = Links(config, self._queue)
        self._fetches = Fetches(name, config, self.tracker, self._links, self._queue, self._fail_link, read_window)
        self._claims = TicketClaims(config, self.tracker, self._links, self._fetches)
        self._messages = PrefillMessages(layout, backend_kind, config, self.tracker, self._links, self._fetches,
                                         self._claims, self._queue, self._fail_link)

    # ------------------------------------------------------------------ links
    def open(self, host: str, port: int, now: float) -> int:
        """Start connecting to a prefill endpoint (a new link); its id."""
        return self._links.open(host, port, now).id

    def link_to(self, host: str, port: int, now: float) -> int:
        """The link to ``host:port``, opened on first use and shared by every later fetch."""
        return self._links.to(host, port, now).id

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
            self._links.move(link, LinkEvent.CONNECTED)

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
        self._links.move(link, LinkEvent.AUTHENTICATED)

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
                self._messages.handle(conn, link, message, now)
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
        return self._links.error(conn)

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
        return self._claims.fetch_offer(conn, offer, dst, now, resume_from, timeout)

    def decline(self, conn: int, offer: LeaseOffer, reason: str) -> None:
        """Tell the prefill this rank will not read ``offer``: it releases the lease at once."""
        self._claims.decline(conn, offer, reason)

    def fetch_ticket(self, ticket: Ticket, dst: Mapping[str, Any], now: float, resume_from: int = 0,
                     timeout: float | None = None, prompt_digest: bytes | None = None) -> Fetch:
        """Redeem ``ticket``: connect to its prefill if no link is open, claim the lease, read it.

        ``prompt_digest``: ``prompt_digest`` of the prompt the pages are read for; the claim carries it
        and the prefill refuses it (``PromptMismatch``) unless its lease holds that prompt's KV.
        """
        return self._claims.fetch_ticket(ticket, dst, now, resume_from, timeout, prompt_digest)

    def claim_ticket(self, ticket: Ticket, now: float, prompt_digest: bytes | None = None) -> None:
        """Claim ``ticket``'s lease now and keep it alive (heartbeats) until ``fetch_ticket`` reads it.

        For an engine that learns of a request before it has pages to read it into: the lease
        no longer has to outlive the engine's queue on its TTL alone.  Idempotent; a refusal is
        remembered and fails the later fetch at once.  ``unclaim`` gives a lease back unread.
        ``prompt_digest``: as in ``fetch_ticket``, which must then pass the same.
        """
        self._claims.claim_ticket(ticket, now, prompt_digest)

    def unclaim(self, ticket: Ticket) -> None:
        """Give back a lease claimed ahead and never fetched: the prefill releases it at once."""
        self._claims.unclaim(ticket)

    def cancel(self, fetch_id: int, now: float) -> None:
        """Give up on a fetch; it ends ``failed`` (``TransferCancelled``) once its reads are quiet."""
        fetch = self._fetches.get(fetch_id)
        if fetch is not None and not fetch.done:
            self._fetches.fail(fetch, TransferCancelled(f"fetch {fetch_id} cancelled"), now)

    def get(self, fetch_id: int) -> Fetch | None:
        return self._fetches.get(fetch_id)

    def forget(self, fetch_id: int) -> None:
        """Drop a finished fetch's record (the engine has taken its result)."""
        self._fetches.forget(fetch_id)

    @property
    def in_flight(self) -> int:
        """Fetches not yet finished."""
        return self._fetches.running

    # ----------------------------------------------------------- completions
    def completed(self, tag: bytes, error: KvlendError | None, now: float) -> None:
        """The backend is done with read ``tag`` (terminal: it will not write again)."""
        self._fetches.completed(tag, error, now)

    # ------------------------------------------------------------------ time
    def tick(self, now: float) -> None:
        """Deadlines, escalation of reads that will not go quiet, and heartbeats."""
        for conn, link in list(self._links.items()):
            if link.state is not LinkState.READY and now > link.deadline:
                self._fail_link(conn, TransferTimeout(
                    f"{where(link)}: no handshake within {self.config.handshake_timeout:.3g} s"), now)
        self._fetches.tick(now)
        for link in list(self._links.values()):
            if link.state is LinkState.READY and now >= link.next_beat:
                leases = self._renewable(link)
                if leases:
                    assert link.conn is not None  # ready
                    link.conn.send(Heartbeat(tuple(leases), _take_done(link)))
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
        timer = self._fetches.next_timer()
        if timer is not None:
            times.append(timer)
        return min(times) if times else None

    def _any_renewable(self, link: PrefillLink) -> bool:
        """``_renewable(link)`` is not empty (without building it: asked every turn)."""
        return bool(link.offers) or any(f.offer is not None or f.claimed_at is not None
                                        for f in self._fetches.on(link.id))

    def _renewable(self, link: PrefillLink) -> list[bytes]:
        """Leases on ``link`` that must not expire: fetches not finished, and offers not yet taken."""
        ids = [f.lease for f in self._fetches.on(link.id) if f.offer is not None or f.claimed_at is not None]
        fetched = set(ids)
        return ids + [i for i in link.offers if i not in fetched]

    # --------------------------------------------------------------- outputs
    def take_actions(self) -> list:
        """The actions queued, and the posts the read window admits now that every change was made
        (a fetch failing withdraws its waiting reads first, so none is posted for a link torn down),
        then the bytes each link's framing produced."""
        queue = self._queue
        queue.actions += self._fetches.admit()
        for conn, link in self._links.items():
            if link.done and link.conn is not None:  # this turn's finished fetches, their Done unanswered
                link.conn.send(Heartbeat((), _take_done(link)))
            data = link.conn.data_to_send() if link.conn is not None else b""
            if data:
                queue.actions.append(Send(conn, data))
        out, queue.actions = queue.actions, []
        return out

    def take_events(self) -> list:
        out, self._queue.events = self._queue.events, []
        return out

    @property
    def reads_waiting(self) -> int:
        """Reads held back by the tcp read window."""
        return self._fetches.reads_waiting

    # ----------------------------------------------------------------- closing
    def _fail_link(self, conn: int, error: KvlendError, now: float, bye: Code | None = None) -> None:
        """Drop a link: its fetches fail; its backend peer is removed, which makes their reads terminal.

        ``bye``: the code of the ``Bye`` that closes it in order (None: none, the link is broken)."""
        link = self._links.drop(conn, error)
        busy = self._fetches.link_closed(conn, error, now)
        if link.conn is not None:
            if bye is not None and link.conn.ready:
                if link.done:
                    link.conn.send(Heartbeat((), _take_done(link)))
                link.conn.send(Bye(bye, str(error)[:REASON_CHARS]))
            data = link.conn.data_to_send()
            if data and bye is not None:
                self._queue.actions.append(Send(conn, data))
        if link.backend_peer:
            self._queue.actions.append(RemovePeer(conn))
        self._queue.actions.append(Close(conn, str(error)))
        self._queue.events.append(PeerGone(conn, link.peer, str(error)))
        log.log(logging.WARNING if busy and bye is None else logging.INFO, "link to %s closed: %s",
                printable(where(link)), printable(error))


def _take_done(link: PrefillLink) -> tuple[bytes, ...]:
    """The leases ``link``'s fetches finished in their life since the last heartbeat: one message releases them."""
    done, link.done = tuple(link.done), []
    return done
