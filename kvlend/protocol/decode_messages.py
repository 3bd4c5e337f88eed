"""The prefill's messages to a decode (``PrefillMessages``): its handshake, offers, extensions, renewals,
withdrawals and done acks, each checked before it changes anything (``PeerProtocolError`` closes the link)."""

from __future__ import annotations

import logging
from typing import Callable

from ..core.layout import PageLayout
from ..core.negotiate import TransferPlan, negotiate
from ..core.text import printable
from ..core.tracker import DeliveryTracker
from ..errors import IncompleteFetch, KvlendError, LayoutMismatch, PeerLost, PeerProtocolError, QuotaExceeded
from .actions import AddPeer, Offered, PeerReady, Queue
from .codes import Code, code_of, lease_error, link_error
from .config import NodeConfig
from .decode_claims import TicketClaims, check_size
from .decode_fetches import Fetches
from .decode_link import PLAN_CACHE, UNCLAIM_DETAIL, Links, PrefillLink, check_committed, grown_offer
from .fetch import Fetch
from .prefill import peer_layout
from .states import FetchEvent, FetchState, IllegalTransition, LeaseEvent, LeaseState, LinkEvent, LinkState
from .wire import Abort, Bye, Claim, DoneAck, Extend, Handshake, LeaseOffer, Message, Offer, Renewed

log = logging.getLogger("kvlend.session")


class PrefillMessages:
    """Handles what a prefill sends over a link; keeps the plans negotiated with prefill layouts."""

    def __init__(self, layout: PageLayout, backend_kind: str, config: NodeConfig, tracker: DeliveryTracker,
                 links: Links, fetches: Fetches, claims: TicketClaims, queue: Queue,
                 close_link: Callable[[int, KvlendError, float, Code | None], None]) -> None:
        self._layout = layout
        self._kind = backend_kind
        self._config = config
        self._tracker = tracker
        self._links = links
        self._fetches = fetches
        self._claims = claims
        self._queue = queue
        self._close_link = close_link
        self._plans: dict[tuple, TransferPlan] = {}

    def handle(self, conn: int, link: PrefillLink, message: Message, now: float) -> None:
        if link.state is LinkState.HANDSHAKE:
            self._handshake(conn, link, message, now)
        elif isinstance(message, Offer):
            self._offer(conn, link, message.lease, now)
        elif isinstance(message, Extend):
            self._extended(conn, link, message, now)
        elif isinstance(message, Renewed):
            self._renewed(conn, link, message)
        elif isinstance(message, DoneAck):
            fetch = self._fetches.of(conn, message.lease, FetchState.ACKING)
            if fetch is not None:
                self._acked(fetch, message, now)
        elif isinstance(message, Abort):
            self._withdrawn(conn, link, message, now)
        elif isinstance(message, Bye):
            raise PeerLost(f"prefill {link.peer} closed: {message.detail}")
        else:
            raise PeerProtocolError(f"unexpected {message.TYPE} from prefill {link.peer}")

    def _handshake(self, conn: int, link: PrefillLink, message: Message, now: float) -> None:
        if isinstance(message, Bye):
            raise link_error(message.code, f"prefill {link.peer} refused the handshake: {message.detail}")
        remote = peer_layout(message, self._kind)
        assert isinstance(message, Handshake)  # checked by peer_layout
        # Addresses are not part of a layout id, but the plan holds them: a restarted
        # prefill with the same layout elsewhere in memory needs its own plan.
        key = (self._layout.layout_id, remote.layout_id, tuple((r.name, r.address) for r in remote.regions))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= PLAN_CACHE:
                self._plans.clear()
            quotas = self._config.quotas
            try:
                plan = negotiate(self._layout, remote, max_page_ratio=quotas.max_page_ratio,
                                 max_pieces=quotas.max_pieces)
            except LayoutMismatch as exc:
                self._unreadable_layout(conn, link, remote, exc, now)
                return
            self._plans[key] = plan
        if not message.metadata:
            raise PeerProtocolError(f"prefill {link.peer} sent no backend metadata")
        link.plan = plan
        self._links.move(link, LinkEvent.LAYOUT)
        link.handshake_ms = (now - link.started) * 1e3
        link.beat = self._config.heartbeat
        link.next_beat = now + link.beat
        link.backend_peer = True
        self._queue.actions.append(AddPeer(conn, message.metadata))
        assert link.peer is not None and link.conn is not None  # authenticated
        self._queue.events.append(PeerReady(conn, link.peer))
        log.info("handshake with %s: %s", printable(link.peer), plan.summary().splitlines()[0])
        for fetch in self._fetches.waiting(link):
            if fetch.state is FetchState.CLAIMING:
                self._claims.claim(link, fetch, now)
        for lease in list(link.by_state[LeaseState.QUEUED]):
            claim = link.lease_to(lease, LeaseEvent.CLAIM)
            claim.sent = now
            link.conn.send(Claim(lease, claim.digest))
        for lease, given_back in list(link.by_state[LeaseState.UNCLAIMED].items()):
            link.conn.send(Claim(lease, given_back.digest))  # the prefill ends a lease only its holder aborts
            link.conn.send(Abort(lease, Code.CANCELLED, UNCLAIM_DETAIL))
            link.lease_to(lease, LeaseEvent.CLAIM)
        for lease in list(link.by_state[LeaseState.DECLINING]):
            link.lease_to(lease, LeaseEvent.LAYOUT)  # a layout we read after all: nothing to give back

    def _unreadable_layout(self, conn: int, link: PrefillLink, remote: PageLayout, refusal: LayoutMismatch,
                           now: float) -> None:
        """No plan reads ``remote``: remember it, decline every lease we came for, and close the link."""
        self._claims.unreadable(remote.layout_id, refusal)
        came_for = [(f.lease, f.prompt_digest) for f in self._fetches.waiting(link)]
        came_for += [(lease, known.digest) for state in (LeaseState.QUEUED, LeaseState.UNCLAIMED, LeaseState.DECLINING)
                     for lease, known in link.by_state[state].items()]
        assert link.conn is not None  # it sent its layout
        for lease, digest in dict(came_for).items():
            link.conn.send(Claim(lease, digest))  # refused as we are, a claim gives the lease back
        self._close_link(conn, refusal, now, code_of(refusal))  # the claims go out before the bye

    def _offer(self, conn: int, link: PrefillLink, offer: LeaseOffer, now: float) -> None:
        state = link.state_of(offer.id)
        if state in (LeaseState.ABANDONED, LeaseState.RECLAIMED):  # the answer to a claim we gave up (and aborted)
            link.lease_to(offer.id, LeaseEvent.OFFER)
            return
        assert link.plan is not None and link.conn is not None  # offers come over ready links
        unknown = sorted(map(repr, set(offer.pages) - set(link.plan.remote.groups)))
        if unknown:
            raise PeerProtocolError(f"prefill {link.peer} offered lease {offer.id.hex()} with unknown groups "
                                f"[{', '.join(unknown)}]")
        check_committed(link, offer.id, offer.pages, offer.ready, offer.num_tokens)
        beat = self._config.beat_for(offer.ttl)  # a lease shorter than our heartbeat allows: beat more often
        if beat < link.beat:
            link.beat, link.next_beat = beat, min(link.next_beat, now + beat)
        fetch = self._fetches.of(conn, offer.id, FetchState.CLAIMING)
        if fetch is None:
            ahead = self._fetches.of_lease(offer.id)
            if ahead is not None and ahead.link == conn and not ahead.confirmed:
                # the answer to a claim whose reads went ahead from the ticket
                self._claims.confirm(ahead, offer, now)
                return
        if fetch is None and state is LeaseState.CLAIMED:  # claimed ahead: held (and heartbeated) for its fetch
            sent = link.leases[offer.id].sent
            assert sent is not None  # claimed
            held = link.lease_to(offer.id, LeaseEvent.OFFER)
            held.offer = offer
            held.sure = sent + offer.ttl - self._config.beat_for(offer.ttl)  # renewed when our claim came
            return
        if fetch is None:  # pushed: trusted once a heartbeat renewal confirms it, which we ask for now
            try:
                check_size(self._config, offer.num_tokens)
            except QuotaExceeded as exc:  # tracking it would cost memory in proportion: decline at once
                link.conn.send(Abort.of(offer.id, exc))
                log.warning("prefill %s offered a lease too large to read: %s", printable(link.peer), exc)
                return
            link.lease_to(offer.id, LeaseEvent.OFFER).offer = offer
            link.next_beat = now
            self._queue.events.append(Offered(conn, offer))
            return
        if offer.num_tokens != fetch.num_tokens:
            self._fetches.fail(fetch, PeerProtocolError(f"lease {offer.id.hex()} has {offer.num_tokens} tokens, "
                                                        f"its ticket said {fetch.num_tokens}"), now)
            return
        fetch.request, fetch.granted_at = offer.request, now
        assert fetch.claimed_at is not None  # the answer to its claim
        # The prefill renewed the lease when the claim arrived, which was after we sent it.
        fetch.sure_until = fetch.claimed_at + offer.ttl - self._config.beat_for(offer.ttl)
        try:
            work = self._fetches.work(link.plan, offer, fetch.dst, fetch.resume_from)
            self._fetches.move(fetch, FetchEvent.POST)
            self._fetches.begin(fetch, offer, work, now, created=False)
        except Exception as exc:  # the engine's bad table, or a bug: this fetch fails, the link and lease stay
            if isinstance(exc, IllegalTransition):
                raise
            error = exc if isinstance(exc, KvlendError) else KvlendError(
                f"request {offer.request}: starting the reads failed: {type(exc).__name__}: {exc}")
            if fetch.state is FetchState.READING:
                self._fetches.move(fetch, FetchEvent.UNPOST)
            fetch.claimed_at = None  # nothing was posted: the lease stays ours to claim again, or to expire
            self._fetches.fail(fetch, error, now)

    def _extended(self, conn: int, link: PrefillLink, message: Extend, now: float) -> None:
        """A progressive lease grew: an offer not yet fetched grows; a fetch reading it posts the new pages."""
        known = link.leases.get(message.lease)
        if known is not None and known.offer is not None:
            known.offer = grown_offer(link, known.offer, message)
            return
        fetch = self._fetches.of(conn, message.lease, FetchState.READING)
        if fetch is None:
            if self._fetches.of(conn, message.lease, FetchState.ACKING) is not None:
                raise PeerProtocolError(f"prefill {link.peer} extended lease {message.lease.hex()} after it was final")
            return  # a fetch that failed, or a claim given up: nothing to read
        assert fetch.offer is not None and link.plan is not None  # reading it, over a ready link
        grown = grown_offer(link, fetch.offer, message)  # a malformed extension fails the link
        try:
            work = self._fetches.work(link.plan, grown, fetch.dst, fetch.resume_from, fetch.read_rows)
            fetch.offer = grown
            self._fetches.post(fetch, work, now, begin=False)
        except Exception as exc:  # the engine's table, or a bug: this fetch fails, the link stays
            if isinstance(exc, IllegalTransition):
                raise
            error = exc if isinstance(exc, KvlendError) else KvlendError(
                f"request {fetch.request}: reading an extension failed: {type(exc).__name__}: {exc}")
            self._fetches.fail(fetch, error, now)

    def _renewed(self, conn: int, link: PrefillLink, message: Renewed) -> None:
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
            known = link.leases.get(lease)
            if known is not None and known.offer is not None:
                sure = sent + known.offer.ttl - self._config.beat_for(known.offer.ttl)
                known.sure = sure if known.sure is None else max(known.sure, sure)
        for lease in set(message.leases):
            fetch = self._fetches.of_lease(lease)
            if fetch is not None and fetch.link == conn and fetch.offer is not None and fetch.confirmed:
                ttl = fetch.offer.ttl
                fetch.sure_until = max(fetch.sure_until, sent + ttl - self._config.beat_for(ttl))

    def _withdrawn(self, conn: int, link: PrefillLink, message: Abort, now: float) -> None:
        """The prefill refused a claim or ended the lease: nothing read under it may be used.

        A lease it ended after its offer came keeps its pages locked until we say we are quiet:
        an ``Abort`` back, at once for an offer nobody reads, once its reads are terminal for a
        fetch (a fetch that sent its done has said so already).
        """
        state = link.state_of(message.lease)
        offered = state in (LeaseState.HELD, LeaseState.OFFERED)
        if offered or state in (LeaseState.CLAIMED, LeaseState.RECLAIMED):
            link.lease_to(message.lease, LeaseEvent.WITHDRAW).refusal = message.code, message.detail
        if offered:
            assert link.conn is not None  # ready
            link.conn.send(Abort(message.lease, Code.CANCELLED, "withdrawn before it was read"))
        fetch = self._fetches.of_lease(message.lease)
        if fetch is not None and fetch.link == conn:
            fetch.bound = fetch.resume_from  # its pages may be reused under our reads
            error = lease_error(message.code, f"prefill {link.peer} refused lease {message.lease.hex()}: "
                                              f"{message.detail}")
            acks = fetch.state is not FetchState.CLAIMING  # it read: its Abort says it is quiet
            self._fetches.fail(fetch, error, now, tell_prefill=acks)
        if link.state_of(message.lease) is LeaseState.ABANDONED:  # this was the answer: nothing more comes for it
            link.lease_to(message.lease, LeaseEvent.WITHDRAW)
        log.info("prefill %s withdrew lease %s: %s", printable(link.peer), message.lease.hex(),
                 printable(message.detail))

    def _acked(self, fetch: Fetch, ack: DoneAck, now: float) -> None:
        fetch.acked_at = now
        assert fetch.confirmed  # reads ahead send no Done before the claim's answer confirms them
        if not ack.ok:
            fetch.bound = fetch.resume_from  # nothing read under this lease may be used
            self._fetches.finish(fetch, FetchEvent.FAIL, lease_error(
                ack.code, f"request {fetch.request}: prefill refused done ({ack.detail}); discard what was read"), now)
            return
        bound = self._tracker.bound(fetch.key)
        fetch.bound = bound
        if bound < fetch.num_tokens:
            self._fetches.finish(fetch, FetchEvent.FAIL, IncompleteFetch(
                f"request {fetch.request}: every read landed but they cover only {bound} of "
                f"{fetch.num_tokens} tokens (the lease does not hold every page this rank needs)"), now)
        else:
            self._fetches.finish(fetch, FetchEvent.ACK, None, now)
