"""What the sessions ask of their I/O shell (actions) and tell the engine (events).

Frozen records only: the shell performs actions in the order given and hands
events to the engine; neither side decides anything from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from ..core.reads import ReadBatch


# ------------------------------------------------------------------ actions
@dataclass(frozen=True)
class Send:
    """Write ``data`` to connection ``conn`` (in order, without blocking the loop)."""
    conn: int
    data: bytes


@dataclass(frozen=True)
class Close:
    """Close connection ``conn`` once what was sent before is flushed (best effort)."""
    conn: int
    reason: str


@dataclass(frozen=True)
class Connect:
    """Open a connection to a prefill's control endpoint; report it with ``connected`` or ``closed``."""
    conn: int
    host: str
    port: int


@dataclass(frozen=True)
class AddPeer:
    """Load a prefill's backend metadata; report the backend peer name with ``peer_added``."""
    conn: int
    metadata: bytes


@dataclass(frozen=True)
class RemovePeer:
    """Forget link ``conn``'s backend peer, tearing its endpoint down: its reads go terminal (``PeerLost``)."""
    conn: int


@dataclass(frozen=True)
class Post:
    """Post one-sided reads from link ``conn``'s backend peer; the backend reports ``tag`` once,
    when the transport is done with it."""
    conn: int
    batches: Sequence[ReadBatch]
    tag: bytes


@dataclass(frozen=True)
class Cancel:
    """Start cancelling the read ``tag``; its (terminal) completion still follows."""
    tag: bytes


# ------------------------------------------------------------------- events
@dataclass(frozen=True)
class PeerReady:
    """A peer authenticated and exchanged layouts."""
    conn: int
    peer: str


@dataclass(frozen=True)
class PeerGone:
    conn: int
    peer: str | None
    reason: str


@dataclass(frozen=True)
class LeaseEnded:
    """Prefill: a lease ended (``done``, ``aborted``, ``expired`` or ``released``); its pages may be reused."""
    lease: Any
    reason: str


@dataclass(frozen=True)
class ClaimWaits:
    """Prefill: a claim names a lease not lent (yet) and waits up to ``claim_wait`` for its lend: the engine
    may lend under that id now (a share of a lease it lent, say, which only its reader can name)."""
    lease_id: bytes


@dataclass(frozen=True)
class Offered:
    """Decode: a prefill pushed a lease over link ``conn``."""
    conn: int
    offer: Any


@dataclass(frozen=True)
class FetchFinished:
    """Decode: a fetch reached ``done`` or ``failed``; nothing can still land in its destination."""
    fetch: Any


@dataclass(eq=False)
class Queue:
    """What the parts of a session queued, in order: actions for its shell, events for its engine (one
    object they share, handed over by the session's ``take_actions`` and ``take_events``)."""
    actions: list = field(default_factory=list)
    events: list = field(default_factory=list)


class Outbox:
    """What a session queued: actions (bytes each connection's framing produced go first as
    ``Send``) and events, handed over in order by ``take_actions`` and ``take_events``."""

    def __init__(self) -> None:
        self._actions: list = []
        self._events: list = []

    def _connections(self) -> Iterator[tuple[int, Any]]:
        """(connection id, ``Connection``) of every open connection."""
        raise NotImplementedError

    def take_actions(self) -> list:
        for conn, connection in self._connections():
            data = connection.data_to_send()
            if data:
                self._actions.append(Send(conn, data))
        out, self._actions = self._actions, []
        return out

    def take_events(self) -> list:
        out, self._events = self._events, []
        return out
