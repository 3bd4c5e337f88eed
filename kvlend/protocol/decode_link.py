"""A decode rank's links to prefill endpoints (``Links``, the one owner of each link's state), what each
knows of the leases lent over it, and the checks of what its prefill lends."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from ..core.negotiate import TransferPlan
from ..errors import ConfigError, KvlendError, PeerLost, PeerProtocolError
from . import states
from .actions import Connect, Queue
from .config import NodeConfig
from .connection import Connection
from .states import LeaseEvent, LeaseState, LinkEvent, LinkState
from .wire import MAX_META, Extend, LeaseOffer

PLAN_CACHE = 64  # plans, refused layouts and closed links' errors remembered
REFUSED_KEPT = 4096  # early claims' refusals remembered per link, and leases declined lately
UNCLAIM_DETAIL = "unclaimed: the decode will not read it"  # why a lease claimed ahead is given back
REASON_CHARS = 4000  # of a reason sent to a prefill (in an Abort or a Bye)

L = LeaseState
_OFFERS = (L.HELD, L.OFFERED)  # with an offer not yet fetched: heartbeated, fetched by ``fetch_offer``
CLAIMED_AHEAD = (L.QUEUED, L.CLAIMED, L.RECLAIMED)  # claims ahead not yet answered (``max_leases_per_peer``)
_KEEPS = {  # what a lease's record holds in each state; the rest is cleared as it enters it
    L.QUEUED: {"digest"}, L.CLAIMED: {"digest", "sent"}, L.RECLAIMED: {"digest", "sent"},
    L.HELD: {"digest", "offer", "sure"}, L.OFFERED: {"offer", "sure"}, L.REFUSED: {"refusal"},
    L.DECLINING: {"digest"}, L.UNCLAIMED: {"digest"}, L.ABANDONED: set(), L.GONE: set(),
}
_CLEARED = {"offer": None, "sure": None, "sent": None, "digest": b"", "refusal": None}
del L


@dataclass(eq=False)
class LinkLease:
    """What a link knows of one lease apart from a fetch reading it."""

    state: LeaseState | None = None  # changed only by ``PrefillLink.lease_to``
    offer: LeaseOffer | None = None  # held or offered: as grown by extensions since
    sure: float | None = None  # held or offered: valid at least until then (None: no renewal known yet)
    sent: float | None = None  # claimed (or reclaimed): when the claim went out
    digest: bytes = b""  # the prompt digest its claim ahead carries (or its give-back claim)
    refusal: tuple | None = None  # refused: (code, detail), what a later fetch of its ticket fails with


@dataclass(eq=False)
class PrefillLink:
    id: int
    endpoint: tuple[str, int]
    deadline: float  # for reaching READY
    started: float
    state: LinkState | None = None  # changed only by ``Links.move``
    conn: Connection | None = None
    plan: TransferPlan | None = None
    expect: str | None = None  # the identity tickets for this endpoint name (checked against the certificate's)
    peer: str | None = None  # the prefill's identity: its certificate's name
    backend_peer: bool = False  # AddPeer was asked for
    handshake_ms: float = 0.0
    leases: dict[bytes, LinkLease] = field(default_factory=dict)  # one state each (``lease_to``)
    # state -> {id: LinkLease}, oldest first
    by_state: dict[LeaseState, dict[bytes, LinkLease]] = field(default_factory=lambda: {s: {} for s in LeaseState})
    _offered: dict[bytes, LinkLease] = field(default_factory=dict)  # held or offered, in the order the offers came
    beats: deque = field(default_factory=deque)  # (sent at, lease ids) of heartbeats not yet answered
    blind: int = 0  # unanswered heartbeats sent after ``beats`` was full (answered after those in it)
    done: list = field(default_factory=list)  # leases read whole in their life: released by the next heartbeat
    next_beat: float = 0.0
    beat: float = 0.0  # heartbeat interval: ``heartbeat``, lowered to the shortest offer's ``beat_for(ttl)`` seen
    windowed: bool = True  # its reads are kept within the session's read window (False: a peer on this host)

    def state_of(self, lease: bytes) -> LeaseState | None:
        record = self.leases.get(lease)
        return None if record is None else record.state

    def lease_to(self, lease: bytes, event: LeaseEvent) -> LinkLease:
        """The one place a lease's state on this link changes: checked against ``states.LEASE``; the
        indexes follow, a lease ``gone`` is forgotten, and past ``REFUSED_KEPT`` refusals the oldest is."""
        record = self.leases.get(lease) or LinkLease()
        before, after = record.state, states.transition("lease", record.state, event)
        if before is not None:
            del self.by_state[before][lease]
        record.state = after
        for name in _CLEARED.keys() - _KEEPS[after]:
            setattr(record, name, _CLEARED[name])
        if after is LeaseState.GONE:
            self.leases.pop(lease, None)
        else:
            self.leases[lease] = self.by_state[after][lease] = record
        if after in _OFFERS:
            self._offered.setdefault(lease, record)
        else:
            self._offered.pop(lease, None)
        refused = self.by_state[LeaseState.REFUSED]
        if len(refused) > REFUSED_KEPT:
            self.lease_to(next(iter(refused)), LeaseEvent.FORGET)
        return record

    def count(self, *among: LeaseState) -> int:
        return sum(len(self.by_state[state]) for state in among)

    @property
    def offers(self) -> dict[bytes, LeaseOffer]:
        """Offers not yet fetched or declined (held or pushed), in the order they came."""
        return {lease: record.offer for lease, record in self._offered.items() if record.offer is not None}

    @property
    def sure(self) -> dict[bytes, float]:
        """Offers not yet fetched known valid at least until then."""
        return {lease: record.sure for lease, record in self._offered.items() if record.sure is not None}

    @property
    def abandoned(self) -> set[bytes]:
        """Leases whose claim we gave up: their answer is dropped when it comes."""
        return set(self.by_state[LeaseState.ABANDONED]) | set(self.by_state[LeaseState.RECLAIMED])


class Links(Mapping[int, PrefillLink]):
    """The decode's open links by id (a read-only mapping), by endpoint, and why recent ones closed."""

    def __init__(self, config: NodeConfig, queue: Queue) -> None:
        self._config = config
        self._queue = queue
        self._links: dict[int, PrefillLink] = {}
        self._by_endpoint: dict[tuple[str, int], int] = {}
        self._gone: OrderedDict[int, KvlendError] = OrderedDict()  # why recent links closed
        self._next = 0

    def __getitem__(self, conn: int) -> PrefillLink:
        return self._links[conn]

    def __iter__(self) -> Iterator[int]:
        return iter(self._links)

    def __len__(self) -> int:
        return len(self._links)

    def __contains__(self, conn: object) -> bool:  # the dict's, not a try of __getitem__: asked per read
        return conn in self._links

    def get(self, conn: int, default: None = None) -> PrefillLink | None:  # type: ignore[override]
        return self._links.get(conn)

    def open(self, host: str, port: int, now: float) -> PrefillLink:
        """Start connecting to a prefill endpoint (a new link)."""
        if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int) \
                or not 0 < port < 65536:
            raise ConfigError(f"prefill endpoint: expected a host and a port in [1, 65535], got {host!r}:{port!r}")
        self._next += 1
        conn = self._next
        self._links[conn] = link = PrefillLink(conn, (host, port), now + self._config.handshake_timeout, now)
        self.move(link, LinkEvent.OPEN)
        self._by_endpoint[(host, port)] = conn
        self._queue.actions.append(Connect(conn, host, port))
        return link

    def to(self, host: str, port: int, now: float) -> PrefillLink:
        """The link to ``host:port``, opened on first use and shared by every later fetch."""
        link = self.at((host, port))
        return link if link is not None else self.open(host, port, now)

    def at(self, endpoint: tuple[str, int]) -> PrefillLink | None:
        """The open link to ``endpoint``, if any."""
        conn = self._by_endpoint.get(endpoint)
        return None if conn is None else self._links[conn]

    def move(self, link: PrefillLink, event: LinkEvent) -> None:
        """The one place a link's state changes: checked against ``states.LINK``."""
        link.state = states.transition("link", link.state, event)

    def ready(self, conn: int) -> PrefillLink:
        """The ready link ``conn``; ``PeerLost`` (saying why it closed, if it did lately) if there is none."""
        link = self._links.get(conn)
        if link is None or link.state is not LinkState.READY:
            why = self._gone.get(conn) if isinstance(conn, int) else None
            raise PeerLost(f"link {conn!r} is not connected" + (f" (it closed: {why})" if why is not None else
                                                                  f" (open: {sorted(self._links)})"))
        return link

    def drop(self, conn: int, error: KvlendError) -> PrefillLink:
        """Close link ``conn`` for ``error`` (remembered for ``error``): no longer open, nor at its endpoint."""
        link = self._links.pop(conn)
        self.move(link, LinkEvent.CLOSE)
        self._gone[conn] = error
        while len(self._gone) > PLAN_CACHE:
            self._gone.popitem(last=False)
        if self._by_endpoint.get(link.endpoint) == conn:
            del self._by_endpoint[link.endpoint]
        return link

    def error(self, conn: int) -> KvlendError | None:
        """Why a recently closed link closed (None if it is open or long gone)."""
        return self._gone.get(conn)


def grown_offer(link: PrefillLink, offer: LeaseOffer, message: Extend) -> LeaseOffer:
    """``offer`` with ``message``'s rows; ``PeerProtocolError`` for an extension no prefill sends."""
    if not offer.ready < message.ready <= offer.num_tokens:
        raise PeerProtocolError(f"prefill {link.peer} extended lease {message.lease.hex()} from {offer.ready} to "
                            f"{message.ready} tokens (of {offer.num_tokens})")
    assert link.plan is not None  # offers come over ready links
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
    assert link.plan is not None  # offers come over ready links
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
