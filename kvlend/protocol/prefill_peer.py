"""What a prefill session knows of one decode connection (``Peer``): its handshake, the lease ids it may
name, its wasted messages and its log lines; and the check of a peer's handshake (``peer_layout``)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from ..core.layout import PageLayout
from ..core.text import printable
from ..errors import KvlendError, PeerProtocolError, QuotaExceeded
from . import states
from .budget import Strikes
from .connection import Connection
from .states import PeerEvent, PeerState
from .wire import Handshake, Message

log = logging.getLogger("kvlend.session")
LOG_EVERY = 10.0  # seconds between a peer's summary lines about its heartbeats
REFUSED_KEPT = 64  # a peer's latest claims of ids nobody lent, that a heartbeat racing their refusal may name


@dataclass(eq=False)
class Peer:
    conn: Connection
    source: str | None = None  # the address it connected from
    layout: PageLayout | None = None  # set once the layouts were exchanged
    layout_by: float = math.inf  # once authenticated: when its layout must have come
    named: dict[bytes, None] = field(default_factory=dict)  # ids it claimed or was offered, newest last (capped)
    log_after: float = -math.inf  # its next heartbeat summary line, no earlier
    unlogged: int = 0  # heartbeats with something to say since its last line
    refused_until: float | None = None  # its layout was refused: it may decline leases until then
    banned: str | None = None  # refused: its identity is in its backoff; its bye waits until refused_until
    strikes: Strikes | None = None  # its wasted messages (``budget``), once authenticated
    refused: dict[bytes, None] = field(default_factory=dict)  # ids nobody lent it claimed lately (capped)
    state: PeerState | None = None  # changed only by ``to``

    @property
    def name(self) -> str | None:
        return self.conn.peer if self.conn.ready else None

    def to(self, event: PeerEvent) -> None:
        """The one place a peer's state changes: checked against ``states.PEER``."""
        self.state = states.transition("peer", self.state, event)

    def summary(self, now: float, level: int, text: str, what: str = "heartbeat from",
                counted: str = "heartbeats with something to say") -> None:
        """One line about its refused messages, unless it had one less than ``LOG_EVERY`` s ago."""
        if now < self.log_after:
            self.unlogged += 1
            return
        more = f" ({self.unlogged} more {counted} since the last line)" if self.unlogged else ""
        log.log(level, "%s %s: %s%s", what, printable(self.name), printable(text, 1000), more)
        self.log_after, self.unlogged = now + LOG_EVERY, 0

    def strike(self, now: float, what: str) -> None:
        """It sent what no honest decode sends: throttled, and past its allowance (``max_strikes``) dropped."""
        strikes = self.strikes
        assert strikes is not None  # authenticated
        if strikes.strike(now):
            raise QuotaExceeded("max_strikes", math.ceil(strikes.count), strikes.allowance,
                                f"it {what}; messages no decode needs (one forgiven every "
                                f"{strikes.forgiven:.3g} s):")


def remember(ids: dict[bytes, None], lease_id: bytes, cap: int) -> None:
    """Keep ``lease_id`` in ``ids``, newest last (the oldest of more than ``cap`` is forgotten): in a peer's
    ``named``, it may name it in its heartbeats (a lease it still holds stays nameable through the lender)."""
    ids.pop(lease_id, None)
    ids[lease_id] = None
    if len(ids) > cap:
        del ids[next(iter(ids))]


class Goodbye(KvlendError):
    """A peer closed the channel in order."""


def peer_layout(message: Message, backend_kind: str) -> PageLayout:
    """The layout a peer's handshake carries, after checking it is one and the backends match."""
    if not isinstance(message, Handshake):
        raise PeerProtocolError(f"expected handshake, got {message.TYPE}")
    if message.backend != backend_kind:
        raise PeerProtocolError(f"peer uses transfer backend {message.backend!r}, we use {backend_kind!r}")
    return message.page_layout()
