"""The sessions' state machines: one state field per object, one table of legal moves each.

As h11's ``_state.py``: each table maps ``(state, event)`` to the next state, and
every change of a state field goes through ``transition`` (``core.tables``), which refuses a pair
the table lacks (``IllegalTransition``: a bug in the session, never a peer's doing;
peers' mistakes are ``PeerProtocolError`` before any transition is tried).
``None`` as a state is "not yet created": the events from it are the ways an object
begins.  ``markdown()`` renders every table (the lender's ``loan`` too) for docs/design.md.

A fetch (``DecodeSession``): claim a ticket's lease (or take a pushed offer), read.  If every read
landed while the lease was surely valid (``Fetch.sure_until``) and they cover it, the fetch is done
at once (``usable``) and its ``Done`` is bookkeeping, batched into the link's next heartbeat; if not,
it sends ``Done`` and waits for the ack, as before protocol 6.  A failure cancels the reads still in flight and the
fetch ends ``failed`` only once they are terminal (``CANCELLING`` -> ``QUIET``), so no
late read writes into a destination the engine reuses.

A link (``DecodeSession``, one per prefill endpoint) and a peer connection
(``PrefillSession``, one per decode rank) go through TLS and the layout handshake
before any lease moves; a refused peer may only give its leases back and leave.

A lease on a link (``DecodeSession``, apart from a fetch reading it): claimed ahead of
its fetch, held once answered, pushed, refused, or given back; ``gone`` is forgotten.
A loan (the ``Lender``'s one record of a lease, ``core.loans``): a claim waiting for its lend,
lent, offered on a connection, or released but held until that reader is quiet.
"""

from __future__ import annotations

from enum import Enum
from typing import Mapping, TypeVar

from ..core import tables
from ..core.loans import LOAN, LoanEvent, LoanState  # the lender's table, re-exported with the sessions'
from ..core.tables import TABLES, IllegalTransition, label

__all__ = ["FETCH", "LEASE", "LINK", "LOAN", "PEER", "TABLES", "TERMINAL", "FetchEvent", "FetchState",
           "IllegalTransition", "LeaseEvent", "LeaseState", "LinkEvent", "LinkState", "LoanEvent", "LoanState",
           "PeerEvent", "PeerState", "markdown", "transition"]


class FetchState(str, Enum):
    CLAIMING = "claiming"  # waiting for a link, or for the offer a claim asked for
    READING = "reading"  # chunks posted
    ACKING = "acking"  # every chunk landed, not all surely in the lease's life; done sent, the ack awaited
    CANCELLING = "cancelling"  # failed or cancelled; reads still in flight (destination not quiet)
    DONE = "done"
    FAILED = "failed"


TERMINAL = frozenset((FetchState.DONE, FetchState.FAILED))


class FetchEvent(str, Enum):
    TAKE = "take"  # the engine fetches a pushed offer: its reads are posted at once
    REDEEM = "redeem"  # the engine fetches a ticket: its lease is claimed (once the link is ready)
    READ_AHEAD = "read_ahead"  # the ticket's page table is read while the claim is on its way
    POST = "post"  # the claim's answer came: its reads are posted
    UNPOST = "unpost"  # posting failed and was undone: nothing is in flight
    USABLE = "usable"  # every read of the final lease landed while it was surely valid, covering it: done
    LAND = "land"  # every read of the final lease landed, not all surely in its life: Done is sent, its ack awaited
    FAIL = "fail"  # failed, cancelled, refused, timed out, or its link died
    QUIET = "quiet"  # every read of a failed fetch is terminal: Abort is sent
    ACK = "ack"  # the prefill acknowledged Done, and the reads cover the lease


S, E = FetchState, FetchEvent
FETCH: Mapping[tuple[FetchState | None, FetchEvent], FetchState] = {
    (None, E.TAKE): S.READING,
    (None, E.REDEEM): S.CLAIMING,
    (S.CLAIMING, E.READ_AHEAD): S.READING,
    (S.CLAIMING, E.POST): S.READING,
    (S.CLAIMING, E.FAIL): S.FAILED,  # nothing posted: over at once
    (S.READING, E.UNPOST): S.CLAIMING,
    (S.READING, E.USABLE): S.DONE,  # its Done goes out unanswered with the link's next heartbeat
    (S.READING, E.LAND): S.ACKING,
    (S.READING, E.FAIL): S.CANCELLING,
    (S.ACKING, E.ACK): S.DONE,
    (S.ACKING, E.FAIL): S.FAILED,  # every read is terminal already; the prefill releases on our Done
    (S.CANCELLING, E.QUIET): S.FAILED,
}
del S, E


class LinkState(str, Enum):
    """A decode rank's link to one prefill endpoint."""

    CONNECTING = "connecting"
    TLS = "tls"  # connected, TLS handshake under way
    HANDSHAKE = "handshake"  # authenticated, our layout sent, the prefill's awaited
    READY = "ready"
    CLOSED = "closed"


class LinkEvent(str, Enum):
    OPEN = "open"
    CONNECTED = "connected"
    AUTHENTICATED = "authenticated"
    LAYOUT = "layout"  # the prefill's layout came and a plan reads it
    CLOSE = "close"  # closed in order, refused, timed out or broken


S, E = LinkState, LinkEvent
LINK: Mapping[tuple[LinkState | None, LinkEvent], LinkState] = {
    (None, E.OPEN): S.CONNECTING,
    (S.CONNECTING, E.CONNECTED): S.TLS,
    (S.TLS, E.AUTHENTICATED): S.HANDSHAKE,
    (S.HANDSHAKE, E.LAYOUT): S.READY,
    **{(state, E.CLOSE): S.CLOSED for state in (S.CONNECTING, S.TLS, S.HANDSHAKE, S.READY)},
}
del S, E


class PeerState(str, Enum):
    """A prefill rank's connection from one decode rank."""

    PENDING = "pending"  # accepted, TLS under way (AUTH_TIMEOUT)
    AUTHENTICATED = "authenticated"  # its identity known, its layout awaited (handshake_timeout)
    READY = "ready"  # layouts exchanged: it may claim, read, renew and end leases
    REFUSED = "refused"  # its layout was refused: it may only give leases back and leave (AUTH_TIMEOUT)
    CLOSED = "closed"


class PeerEvent(str, Enum):
    ACCEPT = "accept"
    AUTHENTICATED = "authenticated"
    LAYOUT = "layout"  # its layout came and we serve it
    REFUSE = "refuse"  # its layout came and we cannot serve it
    CLOSE = "close"


S, E = PeerState, PeerEvent
PEER: Mapping[tuple[PeerState | None, PeerEvent], PeerState] = {
    (None, E.ACCEPT): S.PENDING,
    (S.PENDING, E.AUTHENTICATED): S.AUTHENTICATED,
    (S.AUTHENTICATED, E.LAYOUT): S.READY,
    (S.AUTHENTICATED, E.REFUSE): S.REFUSED,
    **{(state, E.CLOSE): S.CLOSED for state in (S.PENDING, S.AUTHENTICATED, S.READY, S.REFUSED)},
}
del S, E

class LeaseState(str, Enum):
    """A lease as a decode's link knows it apart from a fetch reading it (claims ahead, offers, refusals)."""

    QUEUED = "queued"  # claimed ahead before the link is ready: the claim goes out once it is
    CLAIMED = "claimed"  # claimed ahead: the claim went out, its answer is on its way
    HELD = "held"  # claimed ahead and answered: its offer is kept (heartbeated) for its fetch
    OFFERED = "offered"  # pushed by the prefill: the engine may fetch or decline it
    REFUSED = "refused"  # the prefill refused the claim or ended the lease: a later fetch of it fails so
    ABANDONED = "abandoned"  # a claim we gave up (and aborted): its answer is dropped when it comes
    UNCLAIMED = "unclaimed"  # given back while queued: once the link is ready, its claim goes out with an abort
    RECLAIMED = "reclaimed"  # claimed ahead again while an abandoned claim's answer is still owed
    DECLINING = "declining"  # of a layout we cannot read: a claim gives it back if the prefill refuses ours
    GONE = "gone"  # forgotten: fetched, given back, answered, or the oldest of too many refusals


class LeaseEvent(str, Enum):
    QUEUE = "queue"  # the engine claims it ahead while the link is not ready
    CLAIM = "claim"  # a claim ahead goes out
    OFFER = "offer"  # an offer for it came: a claim's answer, or pushed
    WITHDRAW = "withdraw"  # the prefill refused the claim or ended the lease (its Abort)
    FETCH = "fetch"  # a fetch takes it over: its offer, claim or refusal
    DECLINE = "decline"  # we decline its offer: the prefill releases it
    UNCLAIM = "unclaim"  # the engine gives back a lease claimed ahead
    ABANDON = "abandon"  # a fetch gave up its claim before the answer came
    GIVE_BACK = "give_back"  # its ticket names a layout we cannot read: give it back over a link opened for it
    LAYOUT = "layout"  # the link's layout is one we read after all: nothing to give back
    FORGET = "forget"  # too many refusals remembered: the oldest goes


S, E = LeaseState, LeaseEvent
LEASE: Mapping[tuple[LeaseState | None, LeaseEvent], LeaseState] = {
    (None, E.QUEUE): S.QUEUED,
    (S.DECLINING, E.QUEUE): S.QUEUED,  # its claim gives it back as well
    (None, E.CLAIM): S.CLAIMED,
    (S.QUEUED, E.CLAIM): S.CLAIMED,
    (S.ABANDONED, E.CLAIM): S.RECLAIMED,
    (S.CLAIMED, E.OFFER): S.HELD,
    (None, E.OFFER): S.OFFERED,  # pushed
    (S.OFFERED, E.OFFER): S.OFFERED,  # pushed again: the newer offer
    (S.HELD, E.OFFER): S.OFFERED,  # pushed over one held: the engine hears of it
    (S.REFUSED, E.OFFER): S.OFFERED,
    (S.ABANDONED, E.OFFER): S.GONE,  # the abandoned claim's answer, dropped
    (S.RECLAIMED, E.OFFER): S.CLAIMED,  # the abandoned claim's answer, dropped: the new claim's is still owed
    **{(state, E.WITHDRAW): S.REFUSED for state in (S.CLAIMED, S.RECLAIMED, S.HELD, S.OFFERED)},
    (S.ABANDONED, E.WITHDRAW): S.GONE,  # the abandoned claim's answer
    **{(state, E.FETCH): S.GONE for state in (S.QUEUED, S.CLAIMED, S.HELD, S.OFFERED, S.REFUSED)},
    (S.RECLAIMED, E.FETCH): S.ABANDONED,  # the fetch waits for the new claim's answer; the old one's is dropped
    (S.HELD, E.DECLINE): S.GONE,
    (S.OFFERED, E.DECLINE): S.GONE,
    (S.QUEUED, E.UNCLAIM): S.UNCLAIMED,  # never sent: the prefill learns it is given back once the link is up
    (S.UNCLAIMED, E.CLAIM): S.ABANDONED,  # the claim and its abort go out together: the answer is dropped
    (S.UNCLAIMED, E.QUEUE): S.QUEUED,  # claimed ahead again before the link was ready
    (S.UNCLAIMED, E.FETCH): S.GONE,  # the fetch claims it itself
    (S.REFUSED, E.UNCLAIM): S.GONE,
    (S.CLAIMED, E.UNCLAIM): S.ABANDONED,  # aborted: its answer may still come
    (S.RECLAIMED, E.UNCLAIM): S.ABANDONED,
    (None, E.ABANDON): S.ABANDONED,
    (S.ABANDONED, E.ABANDON): S.ABANDONED,
    (None, E.GIVE_BACK): S.DECLINING,
    (S.DECLINING, E.GIVE_BACK): S.DECLINING,
    (S.DECLINING, E.LAYOUT): S.GONE,
    (S.REFUSED, E.FORGET): S.GONE,
}
del S, E

for _name, _table in (("fetch", FETCH), ("link", LINK), ("peer", PEER), ("lease", LEASE), ("loan", LOAN)):
    tables.register(_name, _table)
del _name, _table

_State = TypeVar("_State", bound=Enum)


def transition(name: str, state: _State | None, event: Enum) -> _State:
    """The state ``event`` moves an object of table ``name`` to from ``state`` (``IllegalTransition`` if
    the table has no such move): ``core.tables.transition``, looked up at each call, so that replacing it
    (as the stateful tests do to record every move) sees the sessions' moves and the lender's alike."""
    return tables.transition(name, state, event)


def markdown() -> str:
    """Every table as Markdown: one section per table, one row per legal move."""
    parts = []
    for name, table in TABLES.items():
        rows = [f"| {label(state)} | {label(event)} | {label(after)} |" for (state, event), after in table.items()]
        parts.append("\n".join([f"### {name}", "", "| state | event | next state |", "|---|---|---|", *rows]))
    return "\n\n".join(parts) + "\n"

