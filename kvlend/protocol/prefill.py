"""``PrefillSession``: the lending side of the control protocol, sans-IO.

Fed connections, received bytes and ``now``; returns actions (bytes to
send, connections to close) and events (peers ready or gone, leases ended).
It takes each decode rank's identity from the shell once TLS verified its
certificate, refuses a second connection presenting a live peer's identity,
checks each peer's layout before it sees a lease, lends pages
(to a connected peer as a pushed offer, or to any peer behind a ticket),
renews leases on heartbeats, answers claims and dones (a heartbeat's ``done``
ones unanswered: protocol 6), and expires leases whose reader went quiet.
Every timing decision is made here with the time passed in.

A lease the engine releases after its offer went out may be under a reader's
one-sided reads: its pages stay locked (``Lender.release`` holds them) until
that reader is quiet (its ``Abort`` or ``Done`` for the lease, or its ``Bye``:
a decode fails every fetch of a link before saying goodbye) or the lease
expires, and only then does ``LeaseEnded`` tell the engine, so no read a
reader still counts sees a reused page.  A reader still connected when such a lease expires ignored
its end for a whole TTL: it is dropped.

Each peer is held to ``config.quotas`` (see ``Quotas``): a lend or offer over
one raises ``QuotaExceeded`` to the engine, a claim over one is answered with an
``Abort`` naming the limit, a heartbeat naming too many ids renews nothing, and
a layout that would cost too much to negotiate is refused with a ``Bye``.
What it may cost beyond (``budget``): a claim of an id nobody lent that cannot
wait, a heartbeat naming such an id and an empty heartbeat are strikes that cut
its share of the loop's turns and, past ``max_strikes``, drop it; an identity
dropped for cause, or reconnecting too often, is held unread then refused for
a backoff that doubles; negotiations are cached by the layout's id
(``negotiations``), one new one per identity per backoff.  An id becomes one a
peer may name in its heartbeats only once its claim is granted or waits.  A peer
must send its layout within ``handshake_timeout`` of authenticating; one naming
in a heartbeat a lease it never claimed nor was offered is dropped; only the
lease's holder renews or ends it (a ticket's lease, once it claimed it).
A decode whose layout we cannot serve gets ours (without backend metadata or addresses, so
it names every difference itself) and ``AUTH_TIMEOUT`` to decline the leases
it came for and say ``Bye``: its ``Claim`` of a lease it may claim ends that
lease at once (``aborted``), rather than at its TTL.
Every string a peer chose (its identity, request ids, reasons) is escaped in log
lines (``printable``).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Mapping

from ..core.layout import PageLayout, RowSelection
from ..core.lender import NO_OPTIONS, Lease, Lender, LendOptions
from ..core.text import printable
from ..errors import (
    AuthError,
    KvlendError,
    LayoutMismatch,
    LeaseDenied,
    LeaseUnknown,
    PeerLost,
    PeerProtocolError,
    QuotaExceeded,
    UsageError,
)
from .actions import ClaimWaits, Close, LeaseEnded, Outbox, PeerGone, PeerReady, Send
from .budget import Handshakes, Share, Strikes
from .codes import Code, code_of, detail_of
from .config import NodeConfig
from .connection import AUTH_TIMEOUT, Connection
from .inputs import Accepted, Authenticated, Data, Gone, Input
from .negotiations import Negotiations
from .prefill_peer import REFUSED_KEPT, Goodbye, Peer, peer_layout, remember
from .states import LoanEvent, LoanState, PeerEvent, PeerState
from .ticket import Ticket
from .wire import (
    Abort,
    Bye,
    Claim,
    Done,
    DoneAck,
    Extend,
    Handshake,
    Heartbeat,
    LeaseOffer,
    Message,
    Offer,
    Renewed,
    check_offer,
)

log = logging.getLogger("kvlend.session")
_REASON = 4000  # characters of a reason sent to a peer
MAX_PENDING = 256  # connections not yet authenticated, in all
MAX_PENDING_PER_SOURCE = 32  # ... from one address
_NOTHING = Share(0, 0)  # a held connection's share of a turn


class PrefillSession(Outbox):
    """Lends ``layout``'s pages to authenticated decode ranks."""

    def __init__(self, layout: PageLayout, backend_kind: str, metadata: bytes, *,
                 name: str = "prefill", config: NodeConfig = NodeConfig()) -> None:
        self.layout = layout
        self.name = name
        self.config = config
        self.lender = Lender(layout)
        self._limits = config.quotas.lease_limits
        self._kind = backend_kind
        self._metadata = metadata
        self._peers: dict[int, Peer] = {}
        self._by_name: dict[str, int] = {}  # ready peers
        self._loans = self.lender.loans  # each lease's one record, the lender's: we move only who reads it
        self._waiting = self._loans.waiting  # claims of leases not yet lent, in deadline order
        quotas = config.quotas
        self._handshakes = Handshakes(quotas.handshake_backoff, quotas.max_handshake_backoff)
        self.negotiations = Negotiations(layout, quotas, self._handshakes)  # by the decode layout's digest
        super().__init__()

    # ----------------------------------------------------------- connections
    def handle(self, event: Input, now: float) -> None:
        """One record from the shell (``protocol.inputs``), to the call below that takes it."""
        match event:
            case Accepted(conn, source):
                self.accept(conn, now, source)
            case Authenticated(conn, identity):
                self.authenticated(conn, identity, now)
            case Data(conn, messages, error):
                self.deliver(conn, messages, error, now)
            case Gone(conn, why, refused):
                self.closed(conn, now, why, refused)
            case _:
                raise TypeError(f"a prefill session takes no {type(event).__name__}: it dials nobody")

    def accept(self, conn: int, now: float, source: str | None = None) -> None:
        """A decode rank connected (from address ``source``); it must authenticate within
        ``AUTH_TIMEOUT``.  Past ``MAX_PENDING_PER_SOURCE`` connections not yet authenticated from one
        address, or ``MAX_PENDING`` in all, a new one is closed at once: a flood of half-open
        connections costs a bounded few KiB each and cannot crowd out a peer's retry for long."""
        if conn in self._peers:
            raise UsageError(f"connection {conn} is already open")
        pending = [p for p in self._peers.values() if p.state in (PeerState.PENDING, PeerState.REFUSED)]
        from_source = sum(p.source == source for p in pending)
        if len(pending) >= MAX_PENDING or (source is not None and from_source >= MAX_PENDING_PER_SOURCE):
            log.warning("refused a connection from %s: %d connections not yet authenticated (%d from it)",
                        printable(source), len(pending), from_source)
            self._actions.append(Close(conn, "too many connections not yet authenticated"))
            return
        self._peers[conn] = peer = Peer(Connection(now, AUTH_TIMEOUT), source)
        peer.to(PeerEvent.ACCEPT)

    def authenticated(self, conn: int, identity: str, now: float) -> None:
        """The channel verified that connection ``conn``'s peer holds a certificate for ``identity``.
        A second connection presenting a live peer's identity is refused, never a replacement:
        the live peer keeps its link; a restarted one waits for it to drop.
        """
        peer = self._peers.get(conn)
        if peer is None:
            return
        try:
            peer.conn.authenticate(identity)
            if identity in self._by_name:
                raise AuthError(f"a decode rank with identity {identity!r} is already connected")
            self._handshakes.admit(identity, now)
        except QuotaExceeded as exc:  # an identity in its backoff: held unread, then told why (``tick``)
            self._hold(peer, detail_of(exc), now)
            return
        except KvlendError as exc:
            self._drop(conn, detail_of(exc), code=code_of(exc))  # the bye's code: the decode raises the same
            return
        self._by_name[identity] = conn
        peer.to(PeerEvent.AUTHENTICATED)
        peer.layout_by = now + self.config.handshake_timeout  # or it holds its identity's slot for nothing
        peer.strikes = Strikes(self.config.quotas.max_strikes, self.config.quotas.strike_forgiven)
        log.debug("control: connection %d authenticated as %s", conn, printable(identity))

    def receive(self, conn: int, data: bytes, now: float) -> None:
        """Received (decrypted) bytes, decoded here; the shell decodes them off its lock and calls ``deliver``."""
        peer = self._peers.get(conn)
        if peer is not None:
            self.deliver(conn, *peer.conn.read(data), now)

    def deliver(self, conn: int, messages: list[Message], error: KvlendError | None, now: float) -> None:
        """Messages decoded from connection ``conn``'s bytes (a ``FrameReader``'s), then the error that ended
        its stream, if any."""
        peer = self._peers.get(conn)
        if peer is None:
            return  # closed meanwhile; the shell may still hold bytes read before
        try:
            if not peer.conn.ready and (messages or error is not None):
                raise PeerProtocolError("bytes arrived before the peer was authenticated")
            for message in messages:
                if conn not in self._peers:
                    return
                self._handle(conn, peer, message, now)
            if error is not None and conn in self._peers:
                raise error
        except Goodbye as bye:
            self._drop(conn, f"said bye: {bye}", logging.INFO, quiet=True)
        except KvlendError as exc:  # for cause: its identity waits before it may connect again
            backoff = self._handshakes.dropped(peer.name, now) if peer.name is not None else 0.0
            self._drop(conn, f"{detail_of(exc)} (it may connect again in {backoff:.3g} s)", code=code_of(exc))

    def throttled(self, now: float) -> dict[int, Share]:
        """The connections whose share of a loop turn is cut, and that share: none for one held in its
        identity's backoff, a few messages while strikes are held against it."""
        share = self.config.quotas.throttled_share
        cut = {conn: share for conn, peer in self._peers.items()
               if peer.strikes is not None and peer.strikes.throttled(now)}
        cut.update((conn, _NOTHING) for conn, peer in self._peers.items() if peer.banned is not None)
        return cut

    def _hold(self, peer: Peer, why: str, now: float) -> None:
        """Refuse an identity in its backoff after holding its connection, unread, until the backoff passes
        (``AUTH_TIMEOUT`` at most): a peer that waits for its answer reconnects no faster, and one that does
        not wait holds one of its address's ``MAX_PENDING_PER_SOURCE`` slots meanwhile."""
        peer.to(PeerEvent.AUTHENTICATED)
        peer.to(PeerEvent.REFUSE)
        peer.banned = why
        assert peer.name is not None  # authenticated
        peer.refused_until = now + min(AUTH_TIMEOUT, self._handshakes.left(peer.name, now))

    def closed(self, conn: int, now: float, why: str = "connection closed", refused: bool = False) -> None:
        """The shell saw the connection end (``refused``: its TLS authentication failed); its leases
        stay until they expire (reads may still land)."""
        if conn in self._peers:
            self._drop(conn, why, logging.WARNING if refused else logging.INFO, notify=False)

    def shutdown(self, reason: str) -> None:
        """Say goodbye to every peer and close; leases stay until released or expired."""
        for conn, peer in list(self._peers.items()):
            if peer.state is PeerState.READY:  # a peer still in the handshake gets its bye from _drop
                peer.conn.send(Bye(Code.OK, reason[:_REASON]))
            self._drop(conn, reason, logging.INFO)

    # ---------------------------------------------------------------- engine
    def lend(self, request: str, num_tokens: int, pages: Mapping[str, Any], selection: RowSelection,
             now: float, options: LendOptions = NO_OPTIONS, *, peer: str | None = None) -> Lease:
        """Lend ``request``'s pages; with ``peer`` None any decode may claim it through a ticket.

        ``options`` (``LendOptions``) go to the lender as they are.  ``lease_id``: the id of a ticket minted
        before the lend (a claim already waiting is answered now).  ``ready``: lend progressively (see
        ``Lender.lend``); ``extend`` lends the rest.  Such a lease has ``config.progressive_ttl`` once claimed
        or offered (``NodeConfig.lease_ttl``).  ``prompt_digest``: only a claim for the same prompt reads it.
        ``QuotaExceeded`` (nothing lent) past ``max_num_tokens``, or past ``peer``'s lease or page quota.
        """
        check_offer(request, options.meta)  # what the decode would refuse must not take locks
        waiting = None if options.lease_id is None else self._waiting.get(options.lease_id)
        conn, digest = (None, b"") if waiting is None else (waiting.reader, waiting.digest)
        lease = self.lender.lend(request, num_tokens, pages, selection, now,
                                 self.config.lease_ttl(options.ready is not None), peer=peer, limits=self._limits,
                                 options=options, wait=self.config.ttl)
        if conn is not None:
            self._claim(self._peers[conn], lease.id, digest, now)
        return lease

    def offer(self, peer: str, request: str, num_tokens: int, pages: Mapping[str, Any],
              selection: RowSelection, now: float, options: LendOptions = NO_OPTIONS) -> Lease:
        """Lend to a connected ``peer`` and push the offer to it."""
        conn = self._by_name.get(peer)
        if conn is None or self._peers[conn].state is not PeerState.READY:
            raise PeerLost(f"decode rank {peer!r} is not connected")
        lease = self.lend(request, num_tokens, pages, selection, now, options, peer=peer)
        offer = self._offer_of(lease)
        try:
            self._peers[conn].conn.send(Offer(offer))
        except UsageError:  # too large to frame: nothing was queued
            self._end(lease.id, "aborted")
            raise
        self.lender.offered(lease.id, conn)
        remember(self._peers[conn].named, lease.id, self.config.quotas.max_heartbeat_ids)
        return lease

    def extend(self, lease_id: bytes, ready: int, pages: Mapping[str, Any], now: float, *,
               meta: Mapping[str, Any] | None = None) -> Lease:
        """A progressive lease grows to ``ready`` tokens (see ``Lender.extend``); its reader, if it has
        the offer, is told at once (``Extend``, pushed: no polling round trip).  ``meta`` updates the
        offer's engine data (the first generated token, say, once the last chunk is done)."""
        meta = check_offer("", meta or {})  # what the decode would refuse must not take locks
        loaned = self._loans.live(lease_id)
        if loaned is not None and meta:
            check_offer("", {**loaned.meta, **meta})  # an offer made later (a claim) carries it whole
        lease, added = self.lender.extend(lease_id, ready, pages, now, self._limits, meta)
        conn = None if loaned is None else loaned.reader
        if conn is not None and conn in self._peers:  # a reader that has the offer; a later claim gets it all
            self._peers[conn].conn.send(Extend(lease.id, lease.ready, added, meta))
        return lease

    def ticket(self, lease: Lease, host: str, port: int) -> Ticket:
        """The portable form of a lease, for the decode that ``host:port`` reaches us from."""
        ticket = Ticket(lease.id, host, port, self.name, lease.num_tokens, self.layout.layout_id)
        # A small, final lease of every row: its page table rides along, so its reader need not wait for
        # the claim's answer (it reads with the full selection of our layout, which it holds).  Not for a
        # lease bound to its prompt: nothing may be read before we checked the claim's digest.
        whole = lease.final and lease.selection == self.layout.full_selection() and lease.prompt_digest is None
        return ticket.with_pages(lease.pages) if whole else ticket

    def release(self, lease_id: bytes) -> Lease | None:
        """End a lease from the engine's side (its request was cancelled); None if already ended.

        Its reader, if connected, is told at once: nothing it read under the lease may be used.
        ``LeaseEnded`` says when its pages may be reused: at once if its offer never went out (or
        its reader said goodbye since), else once its reader is quiet or it expires (module doc).
        """
        lease = self.lender.release(lease_id)  # held for its reader, if its offer went out
        if lease is not None:
            if self._loans.state_of(lease_id) is not LoanState.HELD:
                self._events.append(LeaseEnded(lease, "released"))
            conn = self._by_name.get(lease.peer) if lease.peer is not None else None
            if conn is not None:
                self._peers[conn].conn.send(Abort.of(lease_id, LeaseUnknown("released by the prefill")))
        return lease

    @property
    def pending(self) -> int:
        """Connections not yet authenticated."""
        return sum(p.state is PeerState.PENDING for p in self._peers.values())

    @property
    def peers(self) -> list[str]:
        """Decode ranks that completed the handshake, sorted."""
        return sorted(n for n, c in self._by_name.items() if self._peers[c].layout is not None)

    # ------------------------------------------------------------------ time
    def tick(self, now: float) -> None:
        """Expire leases and waiting claims, and drop connections that did not authenticate or send their
        layout in time."""
        for conn, peer in list(self._peers.items()):
            if peer.state is PeerState.PENDING and now > peer.conn.deadline:
                self._drop(conn, f"no TLS handshake within {AUTH_TIMEOUT:.3g} s", notify=False)
            elif peer.state is PeerState.REFUSED:
                assert peer.refused_until is not None  # set as it was refused
                if now > peer.refused_until and peer.banned is not None:
                    self._drop(conn, peer.banned, logging.DEBUG, code=Code.QUOTA_EXCEEDED)  # its ban's line said why
                elif now > peer.refused_until:
                    self._drop(conn, f"its layout was refused and it did not leave within {AUTH_TIMEOUT:.3g} s",
                               code=Code.TIMEOUT)
            elif peer.state is PeerState.AUTHENTICATED and now > peer.layout_by:
                late = PeerProtocolError(f"no handshake within handshake_timeout "
                                         f"{self.config.handshake_timeout:.3g} s of authenticating")
                self._drop(conn, detail_of(late), code=code_of(late))
        while self._waiting:
            lease_id, waiting = next(iter(self._waiting.items()))
            if now <= waiting.deadline:
                break
            reader = waiting.reader
            assert reader is not None  # a waiting claim's connection
            self._loans.to(lease_id, LoanEvent.TIMEOUT)
            self._peers[reader].conn.send(Abort.of(lease_id, LeaseUnknown(
                f"lease {lease_id.hex()} was not lent within claim_wait {self.config.claim_wait:.3g} s")))
        for loan in self.lender.expire_loans(now):
            lease, reader = loan.lease, loan.reader
            assert lease is not None  # lent, offered or held
            if loan.state is LoanState.HELD:
                self._events.append(LeaseEnded(lease, "released"))
                if reader in self._peers:  # told the lease ended, it kept silent for a whole ttl
                    self._drop(reader, f"it never said it was quiet after lease {lease.hex} of request "
                               f"{printable(lease.request)} ended; its pages went at the lease's expiry")
                else:
                    log.info("lease %s of request %s released: its pages go at its expiry, its reader %s never "
                             "said it was quiet", lease.hex, printable(lease.request), printable(lease.peer))
                continue
            log.warning("lease %s of request %s expired (peer %s, lent %.3g s ago, not renewed for %.3g s)",
                        lease.hex, printable(lease.request), printable(lease.peer), now - lease.lent_at,
                        now - (lease.expires_at - lease.ttl))
            self._events.append(LeaseEnded(lease, "expired"))

    def next_deadline(self) -> float | None:
        """When ``tick`` next has work (None: nothing pending)."""
        times = [p.conn.deadline if not p.conn.ready else p.layout_by for p in self._peers.values()
                 if p.layout is None]
        if self._waiting:
            times.append(next(iter(self._waiting.values())).deadline)
        times.extend(p.refused_until for p in self._peers.values() if p.refused_until is not None)
        expiry = self.lender.next_expiry()
        if expiry is not None:
            times.append(expiry)
        return min(times) if times else None

    # --------------------------------------------------------------- outputs
    def _connections(self) -> Iterator[tuple[int, Connection]]:
        return ((conn, peer.conn) for conn, peer in self._peers.items())

    # -------------------------------------------------------------- handling
    def _handle(self, conn: int, peer: Peer, message: Message, now: float) -> None:
        name = peer.name
        assert name is not None  # authenticated: it sends messages
        if peer.banned is not None:
            return  # sent before it heard of its backoff: it gets its bye, nothing else
        if peer.state is PeerState.REFUSED:
            self._declined(peer, message, now)
        elif peer.state is PeerState.AUTHENTICATED:
            self._handshake(conn, peer, message, now)
        elif isinstance(message, Heartbeat):
            if message.leases or not message.done:  # one that only releases is not answered
                peer.conn.send(Renewed(self._heartbeat(peer, message.leases, now)))
            for lease_id in message.done:  # finished in the lease's life: released as a Done, no ack awaited
                self._done(peer, lease_id, conn, now)
        elif isinstance(message, Claim):
            if not self._claim(peer, message.lease, message.digest, now, conn):
                peer.strike(now, f"claimed lease {message.lease.hex()}, which nobody lent")
        elif isinstance(message, Done):
            exc = self._done(peer, message.lease, conn, now)
            peer.conn.send(DoneAck(message.lease, *((Code.OK, "") if exc is None else (code_of(exc), detail_of(exc)))))
        elif isinstance(message, Abort):
            if self._settle(message.lease, conn):
                return
            try:
                self._held(message.lease, name, now)
            except KvlendError:
                return
            log.info("lease %s aborted by %s: %s", message.lease.hex(), printable(name), printable(message.detail))
            self._end(message.lease, "aborted")
        elif isinstance(message, Bye):
            raise Goodbye(message.detail)
        else:
            raise PeerProtocolError(f"unexpected {message.TYPE} from decode rank {name}")

    def _done(self, peer: Peer, lease_id: bytes, conn: int, now: float) -> KvlendError | None:
        """``peer`` is done reading ``lease_id``: it ends; why it was no longer valid, if it was not."""
        self._settle(lease_id, conn)  # a held lease's reader is done reading it
        try:
            self._held(lease_id, peer.name or "", now)
        except KvlendError as exc:
            return exc
        self._end(lease_id, "done")
        return None

    def _heartbeat(self, peer: Peer, leases: tuple[bytes, ...], now: float) -> tuple[bytes, ...]:
        """Renew what ``peer`` holds of ``leases``; nothing if it names more than ``max_heartbeat_ids``.

        ``LeaseDenied`` (the peer is dropped) if it names a lease it never claimed nor was offered that the
        lender does not remember as ended: no decode does, so it is guessing or replaying others' ids.
        What was not renewed is one summary line, at most every ``LOG_EVERY`` s per peer.
        """
        name = peer.name
        assert name is not None  # ready
        cap = self.config.quotas.max_heartbeat_ids
        if not leases:
            peer.strike(now, "sent an empty heartbeat")
            return ()
        if len(leases) > cap:
            exc = QuotaExceeded("max_heartbeat_ids", len(leases), cap, "a heartbeat naming lease ids:")
            peer.summary(now, logging.WARNING, f"refused, nothing renewed: {exc}")
            return ()
        for lease_id in leases:
            if lease_id not in peer.named and not self._holds(lease_id, name, now):
                if lease_id not in peer.refused:
                    raise LeaseDenied(f"a heartbeat named lease {lease_id.hex()}, which {name!r} never claimed nor "
                                      "was offered")
                peer.strike(now, f"named lease {lease_id.hex()}, which nobody lent, in a heartbeat")
                return ()  # one racing its claim's refusal; a stream of them is a flood
        renewed, refused = [], []
        for lease_id in leases:
            try:
                self._held(lease_id, name, now)
                self.lender.renew(lease_id, now)  # LeaseLifetimeExceeded past max_lease_lifetime
                renewed.append(lease_id)
            except KvlendError as exc:
                refused.append(exc)
        if refused:
            peer.summary(now, logging.INFO,
                          f"{len(refused)} of {len(leases)} leases not renewed, the first: {refused[0]}")
        return tuple(renewed)

    def _holds(self, lease_id: bytes, name: str, now: float) -> bool:
        """Whether the lender's lease ``lease_id`` is ``name``'s, or ended (whoever held it)."""
        try:
            return self.lender.check_read(lease_id, name, now).peer == name
        except LeaseDenied:
            return False
        except KvlendError:
            return self.lender.known(lease_id)

    def _held(self, lease_id: bytes, name: str, now: float) -> Lease:
        """The live lease if ``name`` holds it; ``LeaseDenied`` for a ticket's lease nobody claimed yet,
        which no decode may renew or end before its holder claims it."""
        lease = self.lender.check_read(lease_id, name, now)
        if lease.peer is None:
            raise LeaseDenied(f"lease {lease.hex} is a ticket's that no decode claimed yet: claim it first")
        return lease

    def _handshake(self, conn: int, peer: Peer, message: Message, now: float) -> None:
        layout = peer_layout(message, self._kind)
        assert isinstance(message, Handshake) and peer.name is not None  # checked by peer_layout; authenticated
        try:
            # Refuse a decode we cannot serve before it sees a lease: computed once per layout (the shell may have
            # done it off the lock), at most one new one per identity's backoff, its cost capped by the quotas.
            negotiated = self.negotiations.result(peer.name, message, now)
        except QuotaExceeded:
            raise  # only the Bye: the decode's own caps may differ, so our layout would not tell it why
        except LayoutMismatch as exc:
            # Our layout without backend metadata or addresses: the decode negotiates too, names every field and
            # declines the leases it came for; its identity is free for another connection meanwhile.
            peer.conn.send(Handshake(self.layout.without_addresses().encode(), self._kind, b""))
            peer.refused_until = now + AUTH_TIMEOUT
            peer.to(PeerEvent.REFUSE)
            del self._by_name[peer.name]
            log.warning("refused decode rank %s: %s", printable(peer.name), printable(exc, _REASON))
            return
        peer.conn.send(Handshake(self.layout.encode(), self._kind, self._metadata))
        peer.layout = layout
        peer.to(PeerEvent.LAYOUT)
        log.info("handshake with %s: %s", printable(peer.name), negotiated.line)
        self._events.append(PeerReady(conn, peer.name))

    def _declined(self, peer: Peer, message: Message, now: float) -> None:
        """A decode whose layout we refused claims the leases it came for, to give them back, then leaves.
        Checked as any claim (a lease offered to another peer stays); granted, it ends the lease at once.
        """
        if isinstance(message, Bye):
            raise Goodbye(message.detail)
        if not isinstance(message, Claim):
            raise PeerProtocolError(f"unexpected {message.TYPE} from decode rank {peer.name}, whose layout was refused")
        assert peer.name is not None  # authenticated
        try:
            self.lender.claim(message.lease, peer.name, now, self._limits, prompt_digest=message.digest or None)
        except KvlendError as exc:
            peer.summary(now, logging.INFO, f"decline of lease {message.lease.hex()} refused: {exc}",
                          "declines from", "refused declines")
            if not self.lender.known(message.lease):
                peer.strike(now, f"declined lease {message.lease.hex()}, which nobody lent")
            return
        log.info("lease %s declined by %s: it cannot read our layout", message.lease.hex(), printable(peer.name))
        self._end(message.lease, "aborted")

    def _claim(self, peer: Peer, lease_id: bytes, digest: bytes, now: float, conn: int | None = None) -> bool:
        """Bind a ticket's lease to this peer and send its offer, renewed from now, if ``digest`` is its prompt's.

        A lease never lent (yet) waits up to ``claim_wait`` for the lend when ``conn`` is given,
        one waiting claim per lease id and at most ``max_leases_per_peer`` per connection.
        Returns False for a claim refused of an id nobody lent (a strike), True otherwise.  Only an id granted
        or waiting becomes one the peer may name in its heartbeats: a refused one never does.
        """
        cap = self.config.quotas.max_heartbeat_ids
        assert peer.name is not None  # ready
        known = self.lender.known(lease_id)
        if conn is not None and self.config.claim_wait > 0 and not known:
            if (lease_id not in self._waiting
                    and self._loans.waiting_count(conn) < self.config.quotas.max_leases_per_peer):
                self._loans.to(lease_id, LoanEvent.WAIT, reader=conn, deadline=now + self.config.claim_wait,
                              digest=digest)
                remember(peer.named, lease_id, cap)
                self._events.append(ClaimWaits(lease_id))
                return True
        try:
            # LeaseExpired, LeaseUnknown, LeaseDenied (PromptMismatch), or QuotaExceeded (the peer's, or the lifetime)
            lease = self.lender.claim(lease_id, peer.name, now, self._limits, prompt_digest=digest or None)
        except KvlendError as exc:
            peer.summary(now, logging.INFO, f"claim of lease {lease_id.hex()} refused: {exc}", "claims from",
                          "refused claims or heartbeats")
            peer.conn.send(Abort.of(lease_id, exc))
            if not known:  # a heartbeat racing this refusal may name it (a strike); its id is never nameable
                remember(peer.refused, lease_id, REFUSED_KEPT)
            return known
        remember(peer.named, lease_id, cap)
        peer.conn.send(Offer(self._offer_of(lease)))
        self.lender.offered(lease_id, self._by_name.get(peer.name))
        return True

    def _offer_of(self, lease: Lease) -> LeaseOffer:
        return LeaseOffer(lease.id, lease.request, lease.num_tokens, lease.pages, lease.selection, lease.ttl,
                          self._loans.all[lease.id].meta, lease.ready)

    def _settle(self, lease_id: bytes, conn: int) -> bool:
        """Whether ``lease_id`` was held for its reader on ``conn``, now quiet: its pages go."""
        loan = self._loans.get(lease_id)
        if loan is None or loan.state is not LoanState.HELD or loan.reader != conn:
            return False
        settled = self.lender.settle(lease_id)
        assert settled is not None  # held
        self._events.append(LeaseEnded(settled, "released"))
        return True

    def _end(self, lease_id: bytes, reason: str) -> None:
        lease = self.lender.end(lease_id)
        if lease is not None:
            self._events.append(LeaseEnded(lease, reason))

    def _drop(self, conn: int, why: str, level: int = logging.WARNING, notify: bool = True,
              quiet: bool = False, code: Code = Code.OK) -> None:
        """Forget a connection; its leases stay until they expire (its reads may still land).
        ``code``: what the ``Bye`` says, to a peer still in the handshake (others got theirs, or need none).
        ``quiet``: the peer said goodbye, so it counts no read made over this connection any more:
        leases held for it go now, and a later release of one offered on it need not wait.
        """
        peer = self._peers.pop(conn)
        peer.to(PeerEvent.CLOSE)
        if quiet:
            self._events.extend(LeaseEnded(lease, "released") for lease in self.lender.quiet(conn))
        for lease_id in self._loans.waiting_on(conn):
            self._loans.to(lease_id, LoanEvent.CLOSE)
        name = peer.name
        if name is not None and self._by_name.get(name) == conn:
            del self._by_name[name]
        log.log(level, "dropped decode rank %s: %s", printable(name) if name is not None else f"connection {conn}",
                printable(why, _REASON))
        if notify and peer.conn.ready and peer.layout is None:
            peer.conn.send(Bye(code, why[:_REASON]))  # tell a refused peer why (shutdown said bye already)
        data = peer.conn.data_to_send()
        if data and notify:
            self._actions.append(Send(conn, data))
        self._actions.append(Close(conn, why))
        self._events.append(PeerGone(conn, name, why))
