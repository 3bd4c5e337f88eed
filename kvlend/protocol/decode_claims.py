"""Redeeming tickets, for ``DecodeSession``: claims made with a fetch or ahead of it, their refusals,
leases given back, and reads posted from a ticket's page table before the claim's answer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ..core.prompt import check_digest
from ..errors import (
    AuthError,
    KvlendError,
    PageRangeError,
    PeerProtocolError,
    PromptMismatch,
    QuotaExceeded,
    UsageError,
)
from .codes import Code, lease_error
from .decode_link import CLAIMED_AHEAD, REFUSED_KEPT, UNCLAIM_DETAIL, PrefillLink
from .fetch import Fetch, check_destination, clone_error, resume_point, timeout_arg
from .states import FetchEvent, FetchState, LeaseEvent, LeaseState, LinkState
from .ticket import Ticket
from .wire import Abort, Claim, LeaseOffer

if TYPE_CHECKING:
    from collections import OrderedDict

    from ..core.negotiate import TransferPlan
    from ..core.tracker import DeliveryTracker
    from ..errors import LayoutMismatch
    from .config import NodeConfig
    from .fetch import Work


class TicketClaims:
    """``DecodeSession``'s ticket methods (a mixin: it uses the session's links, fetches and config)."""

    if TYPE_CHECKING:  # what it uses of the session, for the type checker (decode.py defines them)
        config: NodeConfig
        tracker: DeliveryTracker
        _links: dict[int, PrefillLink]
        _by_endpoint: dict[tuple[str, int], int]
        _live: dict[bytes, Fetch]
        _declined: OrderedDict[bytes, None]
        _unreadable: OrderedDict[str, LayoutMismatch]

        def link_to(self, host: str, port: int, now: float) -> int: ...
        def fetch_offer(self, conn: int, offer: LeaseOffer, dst: Mapping[str, Any], now: float,
                        resume_from: int = 0, timeout: float | None = None) -> Fetch: ...
        def decline(self, conn: int, offer: LeaseOffer, reason: str) -> None: ...
        def _check_size(self, num_tokens: int) -> None: ...
        def _check_not_fetching(self, lease: bytes) -> None: ...
        def _new_fetch(self, conn: int, lease: bytes, num_tokens: int, dst: Mapping[str, Any], resume_from: int,
                       now: float, timeout: float, start: FetchEvent) -> Fetch: ...
        def _move(self, fetch: Fetch, event: FetchEvent) -> None: ...
        def _work(self, plan: TransferPlan, offer: LeaseOffer, dst: Mapping[str, Any], resume_from: int,
                  done_rows: Mapping[str, Any] | None = None) -> Work: ...
        def _begin(self, fetch: Fetch, offer: LeaseOffer, work: Work, now: float, created: bool) -> None: ...
        def _fail(self, fetch: Fetch, error: KvlendError, now: float, tell_prefill: bool = True) -> None: ...

    def fetch_ticket(self, ticket: Ticket, dst: Mapping[str, Any], now: float, resume_from: int = 0,
                     timeout: float | None = None, prompt_digest: bytes | None = None) -> Fetch:
        """Redeem ``ticket``: connect to its prefill if no link is open, claim the lease, read it.

        ``prompt_digest``: ``prompt_digest`` of the prompt the pages are read for; the claim carries it
        and the prefill refuses it (``PromptMismatch``) unless its lease holds that prompt's KV.
        """
        timeout = timeout_arg(timeout, self.config.transfer_timeout)
        digest = check_digest(prompt_digest) or b""
        if not isinstance(ticket, Ticket):
            raise UsageError(f"expected a Ticket, got {type(ticket).__name__}")
        self._check_size(ticket.num_tokens)
        resume_from = resume_point(resume_from, ticket.num_tokens)
        if not isinstance(dst, Mapping):
            raise PageRangeError(f"dst: must map local groups to page tables, got {type(dst).__name__}")
        self._check_not_fetching(ticket.lease)
        linked = self._by_endpoint.get(ticket.endpoint)
        plan = self._links[linked].plan if linked is not None else None
        if plan is not None:
            check_destination(plan, dst, ticket.num_tokens)
        self._check_issuer(ticket)
        self._check_claimed(ticket, digest)
        unreadable = self._unreadable.get(ticket.layout_id)
        if unreadable is not None:  # no plan can read it: fail now, and let its prefill free the pages
            self._decline(ticket, digest, now)
            conn = self._by_endpoint.get(ticket.endpoint, 0)  # 0: none (declined before): the fetch needs none
            fetch = self._new_fetch(conn, ticket.lease, ticket.num_tokens, dst, resume_from, now, timeout,
                                    FetchEvent.REDEEM)
            self._fail(fetch, clone_error(unreadable), now, tell_prefill=False)
            return fetch
        conn = self.link_to(ticket.host, ticket.port, now)
        link = self._links[conn]
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
        fetch = self._new_fetch(conn, ticket.lease, ticket.num_tokens, dst, resume_from, now, timeout,
                                FetchEvent.REDEEM)
        fetch.ticket, fetch.prompt_digest = ticket, digest
        if refusal is not None:
            code, detail = refusal
            self._fail(fetch, lease_error(code, f"prefill {link.peer} refused lease {ticket.lease.hex()}: {detail}"),
                       now, tell_prefill=False)
        elif sent is not None:  # claimed ahead, answer still on its way: wait for it
            fetch.claimed_at = sent
        elif link.state is LinkState.READY:
            self._claim(link, fetch, now)
        return fetch  # else it waits for the link (``_waiting``)

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
        if link.state_of(ticket.lease) in (*CLAIMED_AHEAD, LeaseState.HELD, LeaseState.OFFERED, LeaseState.REFUSED):
            return
        early = link.count(*CLAIMED_AHEAD)
        if early >= self.config.quotas.max_leases_per_peer:
            raise QuotaExceeded("max_leases_per_peer", early + 1, self.config.quotas.max_leases_per_peer,
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
        conn = self._by_endpoint.get(ticket.endpoint)
        known = self._links[conn].leases.get(ticket.lease) if conn is not None else None
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
        link = self._links[self.link_to(ticket.host, ticket.port, now)]
        if link.state is LinkState.READY:
            return  # its prefill's layout is one we read, not the ticket's: the lease, if any, waits its TTL
        link.expect = ticket.prefill
        if link.state_of(ticket.lease) in (None, LeaseState.DECLINING) \
                and link.count(LeaseState.DECLINING) < self.config.quotas.max_leases_per_peer:  # past that: its TTL
            link.lease_to(ticket.lease, LeaseEvent.GIVE_BACK).digest = digest

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
        known = link.leases.get(ticket.lease)
        state = None if known is None else known.state
        if state in (LeaseState.QUEUED, LeaseState.REFUSED):
            link.lease_to(ticket.lease, LeaseEvent.UNCLAIM)
        elif state in (LeaseState.CLAIMED, LeaseState.RECLAIMED):  # sent: its answer may still come, dropped then
            link.lease_to(ticket.lease, LeaseEvent.UNCLAIM)
            assert link.conn is not None  # a claim went out on it
            link.conn.send(Abort(ticket.lease, Code.CANCELLED, UNCLAIM_DETAIL))
        elif state in (LeaseState.HELD, LeaseState.OFFERED) and link.state is LinkState.READY:
            assert conn is not None and known is not None and known.offer is not None  # held or offered: an offer
            self.decline(conn, known.offer, UNCLAIM_DETAIL)

    def _claim(self, link: PrefillLink, fetch: Fetch, now: float) -> None:
        fetch.claimed_at = now
        assert link.conn is not None  # ready
        link.conn.send(Claim(fetch.lease, fetch.prompt_digest))
        self._read_ahead(link, fetch, now)

    def _read_ahead(self, link: PrefillLink, fetch: Fetch, now: float) -> None:
        """Post a ticket's reads from the page table it carries while its claim is on the way.

        Nothing read counts until the claim's answer confirms the lease and the same pages
        (``_confirm``): the lease was live when the claim arrived, so it was live for every read
        before that, and the answer renews it for a TTL after.  A ticket without pages, for another
        layout than the link's, or with pages this rank cannot read, waits for the answer instead, and so
        does a fetch bound to its prompt: no byte moves before the prefill checked the prompt digest.
        """
        ticket = fetch.ticket
        assert link.plan is not None  # ready
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
        assert ahead is not None and fetch.claimed_at is not None  # read ahead from a claimed ticket's pages
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
        fetch.sure_until = fetch.claimed_at + offer.ttl - self.config.beat_for(offer.ttl)
        if fetch.state is FetchState.READING and now < fetch.sure_until:
            fetch.bound = max(fetch.resume_from, self.tracker.bound(fetch.key))
