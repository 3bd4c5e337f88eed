"""The decode's leases as its engine asks for them (``TicketClaims``): tickets redeemed with a fetch or
claimed ahead of it, their refusals, pushed offers taken or declined, leases given back, reads posted from a
ticket's page table before the claim's answer, and the layouts no plan of ours reads."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Mapping

import numpy as np

from ..core.prompt import check_digest
from ..core.tracker import DeliveryTracker
from ..errors import (
    AuthError,
    LayoutMismatch,
    PageRangeError,
    PeerProtocolError,
    PromptMismatch,
    QuotaExceeded,
    UsageError,
)
from .codes import Code, lease_error
from .config import NodeConfig
from .decode_fetches import Fetches
from .decode_link import CLAIMED_AHEAD, PLAN_CACHE, REASON_CHARS, REFUSED_KEPT, UNCLAIM_DETAIL, Links, PrefillLink
from .fetch import Fetch, check_destination, clone_error, resume_point, timeout_arg
from .states import FetchEvent, FetchState, IllegalTransition, LeaseEvent, LeaseState, LinkState
from .ticket import Ticket
from .wire import Abort, Claim, LeaseOffer


def check_size(config: NodeConfig, num_tokens: int) -> None:
    """``QuotaExceeded`` for a lease longer than this rank reads (tracking it costs memory in proportion)."""
    cap = config.quotas.max_num_tokens
    if num_tokens > cap:
        raise QuotaExceeded("max_num_tokens", num_tokens, cap, "a lease of")


class TicketClaims:
    """Starts fetches from tickets and offers, claims ahead and gives back; remembers refused layouts."""

    def __init__(self, config: NodeConfig, tracker: DeliveryTracker, links: Links, fetches: Fetches) -> None:
        self._config = config
        self._tracker = tracker
        self._links = links
        self._fetches = fetches
        self._unreadable: OrderedDict[str, LayoutMismatch] = OrderedDict()  # remote layout id -> why refused
        self._declined: OrderedDict[bytes, None] = OrderedDict()  # leases given back lately

    def unreadable(self, layout_id: str, refusal: LayoutMismatch) -> None:
        """No plan of ours reads the layout ``layout_id``: its tickets fail at once, their leases given back."""
        self._unreadable[layout_id] = refusal
        while len(self._unreadable) > PLAN_CACHE:
            self._unreadable.popitem(last=False)

    def fetch_offer(self, conn: int, offer: LeaseOffer, dst: Mapping[str, Any], now: float,
                    resume_from: int = 0, timeout: float | None = None) -> Fetch:
        """A fetch of a pushed (or held) offer, its reads posted (``DecodeSession.fetch_offer``)."""
        timeout = timeout_arg(timeout, self._config.transfer_timeout)
        link = self._links.ready(conn)
        if not isinstance(offer, LeaseOffer):
            raise UsageError(f"expected a LeaseOffer, got {type(offer).__name__}")
        self._fetches.check_not_fetching(offer.id)
        held = link.leases.get(offer.id)
        if held is None or held.offer is None:
            raise UsageError(f"lease {offer.id.hex()} is no longer offered on this link "
                             "(fetched, declined or withdrawn): ask the prefill to lend it again")
        resume_from = resume_point(resume_from, offer.num_tokens)
        offer = held.offer  # as grown by any extension since it was offered
        assert link.plan is not None  # ready
        work = self._fetches.work(link.plan, offer, dst, resume_from)  # may raise: nothing changed yet
        fetch = self._fetches.new(conn, offer.id, offer.num_tokens, dst, resume_from, now, timeout, FetchEvent.TAKE)
        fetch.sure_until = held.sure if held.sure is not None else -math.inf
        fetch.granted_at = now  # a held offer taken: no claim to wait for
        self._fetches.begin(fetch, offer, work, now, created=True)
        link.lease_to(offer.id, LeaseEvent.FETCH)
        return fetch

    def decline(self, conn: int, offer: LeaseOffer, reason: str) -> None:
        """Give back an offer unread (``DecodeSession.decline``)."""
        link = self._links.ready(conn)
        if self._fetches.of_lease(offer.id) is not None:
            raise UsageError(f"lease {offer.id.hex()} is being fetched: cancel the fetch instead")
        if link.state_of(offer.id) in (LeaseState.HELD, LeaseState.OFFERED):
            link.lease_to(offer.id, LeaseEvent.DECLINE)
        assert link.conn is not None  # ready
        link.conn.send(Abort(offer.id, Code.CANCELLED, reason[:REASON_CHARS]))

    def fetch_ticket(self, ticket: Ticket, dst: Mapping[str, Any], now: float, resume_from: int = 0,
                     timeout: float | None = None, prompt_digest: bytes | None = None) -> Fetch:
        """A fetch of ``ticket``'s lease, claimed now, once its link is ready, or ahead
        (``DecodeSession.fetch_ticket``)."""
        timeout = timeout_arg(timeout, self._config.transfer_timeout)
        digest = check_digest(prompt_digest) or b""
        if not isinstance(ticket, Ticket):
            raise UsageError(f"expected a Ticket, got {type(ticket).__name__}")
        check_size(self._config, ticket.num_tokens)
        resume_from = resume_point(resume_from, ticket.num_tokens)
        if not isinstance(dst, Mapping):
            raise PageRangeError(f"dst: must map local groups to page tables, got {type(dst).__name__}")
        self._fetches.check_not_fetching(ticket.lease)
        linked = self._links.at(ticket.endpoint)
        plan = linked.plan if linked is not None else None
        if plan is not None:
            check_destination(plan, dst, ticket.num_tokens)
        self._check_issuer(ticket)
        self._check_claimed(ticket, digest)
        unreadable = self._unreadable.get(ticket.layout_id)
        if unreadable is not None:  # no plan can read it: fail now, and let its prefill free the pages
            self._decline(ticket, digest, now)
            declining = self._links.at(ticket.endpoint)
            conn = declining.id if declining is not None else 0  # 0: none (declined before): the fetch needs none
            fetch = self._fetches.new(conn, ticket.lease, ticket.num_tokens, dst, resume_from, now, timeout,
                                      FetchEvent.REDEEM)
            self._fetches.fail(fetch, clone_error(unreadable), now, tell_prefill=False)
            return fetch
        link = self._links.to(ticket.host, ticket.port, now)
        conn = link.id
        link.expect = ticket.prefill
        known = link.leases.get(ticket.lease)
        if known is not None and known.offer is not None and known.offer.num_tokens == ticket.num_tokens:
            return self.fetch_offer(conn, known.offer, dst, now, resume_from, timeout)  # claimed ahead, answered
        refusal: tuple | None = None
        sent: float | None = None  # None too for a claim queued until the link is ready
        if known is not None and known.state not in (LeaseState.ABANDONED, LeaseState.DECLINING):
            # its claim ahead, refusal, or an offer not what the ticket says (claim again: the answer fails it)
            refusal, sent = known.refusal, known.sent
            link.lease_to(ticket.lease, LeaseEvent.FETCH)
        fetch = self._fetches.new(conn, ticket.lease, ticket.num_tokens, dst, resume_from, now, timeout,
                                  FetchEvent.REDEEM)
        fetch.ticket, fetch.prompt_digest = ticket, digest
        if refusal is not None:
            code, detail = refusal
            refused = lease_error(code, f"prefill {link.peer} refused lease {ticket.lease.hex()}: {detail}")
            self._fetches.fail(fetch, refused, now, tell_prefill=False)
        elif sent is not None:  # claimed ahead, answer still on its way: wait for it
            fetch.claimed_at = sent
        elif link.state is LinkState.READY:
            self.claim(link, fetch, now)
        return fetch  # else it waits for the link (``Fetches.waiting``)

    def claim_ticket(self, ticket: Ticket, now: float, prompt_digest: bytes | None = None) -> None:
        """Claim ``ticket``'s lease ahead of its fetch (``DecodeSession.claim_ticket``)."""
        if not isinstance(ticket, Ticket):
            raise UsageError(f"expected a Ticket, got {type(ticket).__name__}")
        digest = check_digest(prompt_digest) or b""
        check_size(self._config, ticket.num_tokens)
        if self._fetches.of_lease(ticket.lease) is not None:
            return
        self._check_issuer(ticket)
        if ticket.layout_id in self._unreadable:
            self._decline(ticket, digest, now)
            return
        link = self._links.to(ticket.host, ticket.port, now)
        link.expect = ticket.prefill
        if link.state_of(ticket.lease) in (*CLAIMED_AHEAD, LeaseState.HELD, LeaseState.OFFERED, LeaseState.REFUSED):
            return
        early = link.count(*CLAIMED_AHEAD)
        if early >= self._config.quotas.max_leases_per_peer:
            raise QuotaExceeded("max_leases_per_peer", early + 1, self._config.quotas.max_leases_per_peer,
                                "early claims on one link:")
        if link.state is LinkState.READY:
            claim = link.lease_to(ticket.lease, LeaseEvent.CLAIM)
            claim.sent, claim.digest = now, digest
            assert link.conn is not None  # ready
            link.conn.send(Claim(ticket.lease, digest))
        else:
            link.lease_to(ticket.lease, LeaseEvent.QUEUE).digest = digest

    def _check_claimed(self, ticket: Ticket, digest: bytes) -> None:
        """``PromptMismatch`` if ``ticket``'s lease was claimed ahead for another prompt than ``digest``'s."""
        linked = self._links.at(ticket.endpoint)
        known = linked.leases.get(ticket.lease) if linked is not None else None
        if known is not None and known.state in (*CLAIMED_AHEAD, LeaseState.HELD) and known.digest != digest:
            raise PromptMismatch(f"lease {ticket.lease.hex()} was claimed for another prompt than this fetch's")

    def _decline(self, ticket: Ticket, digest: bytes, now: float) -> None:
        """Give back a lease of a layout no plan of ours reads, over a link to its prefill opened for it: the
        prefill refuses our layout, and our ``Claim`` of the lease (with ``digest``, as any claim), before our
        ``Bye``, makes it end it."""
        if ticket.lease in self._declined:
            return
        self._declined[ticket.lease] = None
        while len(self._declined) > REFUSED_KEPT:
            self._declined.popitem(last=False)
        link = self._links.to(ticket.host, ticket.port, now)
        if link.state is LinkState.READY:
            return  # its prefill's layout is one we read, not the ticket's: the lease, if any, waits its TTL
        link.expect = ticket.prefill
        if link.state_of(ticket.lease) in (None, LeaseState.DECLINING) \
                and link.count(LeaseState.DECLINING) < self._config.quotas.max_leases_per_peer:  # past that: its TTL
            link.lease_to(ticket.lease, LeaseEvent.GIVE_BACK).digest = digest

    def _check_issuer(self, ticket: Ticket) -> None:
        """``AuthError`` if the link to the ticket's endpoint serves (or awaits) another prefill than it names."""
        link = self._links.at(ticket.endpoint)
        if link is None:
            return
        known = link.peer or link.expect
        if known is not None and known != ticket.prefill:
            raise AuthError(f"the ticket for lease {ticket.lease.hex()} names the prefill {ticket.prefill!r}, "
                            f"but {ticket.host}:{ticket.port} is {'' if link.peer else 'expected to be '}{known!r}")

    def unclaim(self, ticket: Ticket) -> None:
        """Give back a lease claimed ahead and never fetched (``DecodeSession.unclaim``)."""
        link = self._links.at(ticket.endpoint)
        if link is None:
            return
        known = link.leases.get(ticket.lease)
        state = None if known is None else known.state
        if state in (LeaseState.QUEUED, LeaseState.REFUSED):
            link.lease_to(ticket.lease, LeaseEvent.UNCLAIM)
        elif state in (LeaseState.CLAIMED, LeaseState.RECLAIMED):  # sent: its answer may still come, dropped then
            link.lease_to(ticket.lease, LeaseEvent.UNCLAIM)
            assert link.conn is not None  # a claim went out on it
            link.conn.send(Abort(ticket.lease, Code.CANCELLED, UNCLAIM_DETAIL))
        elif state in (LeaseState.HELD, LeaseState.OFFERED) and link.state is LinkState.READY:
            assert known is not None and known.offer is not None  # held or offered: an offer
            self.decline(link.id, known.offer, UNCLAIM_DETAIL)

    def claim(self, link: PrefillLink, fetch: Fetch, now: float) -> None:
        """Send ``fetch``'s claim over ``link`` (ready) and read ahead what its ticket names."""
        fetch.claimed_at = now
        assert link.conn is not None  # ready
        link.conn.send(Claim(fetch.lease, fetch.prompt_digest))
        self._read_ahead(link, fetch, now)

    def _read_ahead(self, link: PrefillLink, fetch: Fetch, now: float) -> None:
        """Post a ticket's reads from the page table it carries while its claim is on the way.

        Nothing read counts until the claim's answer confirms the lease and the same pages
        (``confirm``): the lease was live when the claim arrived, so it was live for every read
        before that, and the answer renews it for a TTL after.  A ticket without pages, for another
        layout than the link's, or with pages this rank cannot read, waits for the answer instead, and so
        does a fetch bound to its prompt: no byte moves before the prefill checked the prompt digest.
        """
        ticket = fetch.ticket
        assert link.plan is not None  # ready
        if not self._config.read_ahead or fetch.prompt_digest or ticket is None or ticket.pages is None \
                or ticket.layout_id != link.plan.remote.layout_id \
                or not set(ticket.pages) <= set(link.plan.remote.groups):
            return
        offer = LeaseOffer(fetch.lease, "", fetch.num_tokens, ticket.pages, link.plan.remote.full_selection(),
                           self._config.ttl)
        try:
            work = self._fetches.work(link.plan, offer, fetch.dst, fetch.resume_from)
            self._fetches.move(fetch, FetchEvent.READ_AHEAD)
            fetch.confirmed = False
            self._fetches.begin(fetch, offer, work, now, created=False)
        except Exception as exc:  # a bad table (or a planner bug) is reported when the answer comes, as without pages
            if isinstance(exc, IllegalTransition):
                raise
            if fetch.state is FetchState.READING:
                self._fetches.move(fetch, FetchEvent.UNPOST)
            fetch.confirmed = True

    def confirm(self, fetch: Fetch, offer: LeaseOffer, now: float) -> None:
        """The claim's answer for reads posted ahead: the same pages, final, every row, or they are void."""
        if fetch.state is FetchState.CANCELLING:
            return  # it ends once quiet, and its abort releases the lease
        ahead = fetch.offer
        assert ahead is not None and fetch.claimed_at is not None  # read ahead from a claimed ticket's pages
        same = (offer.num_tokens == fetch.num_tokens and offer.final and offer.selection == ahead.selection
                and offer.pages.keys() == ahead.pages.keys()
                and all(np.array_equal(offer.pages[g].token_pages, ahead.pages[g].token_pages)
                        and np.array_equal(offer.pages[g].ordinals, ahead.pages[g].ordinals) for g in offer.pages))
        if not same:
            fetch.bound = fetch.resume_from
            other = PeerProtocolError(f"lease {offer.id.hex()}: the claim's answer names other pages than its ticket; "
                                      "what was read from the ticket's is discarded")
            self._fetches.fail(fetch, other, now)
            return
        fetch.offer, fetch.request, fetch.confirmed, fetch.granted_at = offer, offer.request, True, now
        fetch.sure_until = fetch.claimed_at + offer.ttl - self._config.beat_for(offer.ttl)
        if fetch.state is FetchState.READING and now < fetch.sure_until:
            fetch.bound = max(fetch.resume_from, self._tracker.bound(fetch.key))
        self._fetches.confirmed(fetch, now)
