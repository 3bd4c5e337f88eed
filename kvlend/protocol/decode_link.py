"""A decode rank's link to one prefill endpoint, and the checks of what its prefill lends over it."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..core.negotiate import TransferPlan
from ..errors import PeerProtocolError
from .connection import Connection
from .states import LinkState
from .wire import MAX_META, Extend, LeaseOffer

PLAN_CACHE = 64  # plans, refused layouts and closed links' errors remembered
REFUSED_KEPT = 4096  # early claims' refusals remembered per link, and leases declined lately


@dataclass(eq=False)
class PrefillLink:
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


def grown_offer(link: PrefillLink, offer: LeaseOffer, message: Extend) -> LeaseOffer:
    """``offer`` with ``message``'s rows; ``PeerProtocolError`` for an extension no prefill sends."""
    if not offer.ready < message.ready <= offer.num_tokens:
        raise PeerProtocolError(f"prefill {link.peer} extended lease {message.lease.hex()} from {offer.ready} to "
                            f"{message.ready} tokens (of {offer.num_tokens})")
    unknown = sorted(map(repr, set(message.pages) - set(link.plan.remote.groups)))
    if unknown:
        raise PeerProtocolError(f"prefill {link.peer} extended lease {message.lease.hex()} with unknown groups "
                            f"[{', '.join(unknown)}]")
    check_committed(link, message.lease, message.pages, message.ready, offer.num_tokens)
    if len(set(offer.meta) | set(message.meta)) > MAX_META:
        raise PeerProtocolError(f"prefill {link.peer} grew lease {message.lease.hex()}'s meta past {MAX_META} entries")
    return offer.extended(message.ready, message.pages, message.meta)


def check_committed(link: PrefillLink, lease: bytes, pages: Mapping[str, Any], ready: int, num_tokens: int) -> None:
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


def where(link: PrefillLink) -> str:
    host, port = link.endpoint
    return f"prefill {link.peer or '?'} at {host}:{port}"
