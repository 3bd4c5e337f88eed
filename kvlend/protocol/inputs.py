"""What the shell tells a session about its connections: frozen records, one per thing that happened.

The other way from ``actions``: the shell turns sockets and TLS into these, in the order
accepted, connected, authenticated, data, gone within a loop turn, and each session's
``handle`` passes one to the call that takes it.  A prefill only accepts, a decode only connects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..errors import KvlendError
from .wire import Message


@dataclass(frozen=True)
class Accepted:
    """A peer connected to the prefill's listener as connection ``conn`` (from address ``source``)."""
    conn: int
    source: str | None


@dataclass(frozen=True)
class Connected:
    """The decode's connection ``conn`` (its ``Connect``) is up.  ``windowed``: its reads may go over
    tcp, so the read window applies (a peer on this host may read over shared memory)."""
    conn: int
    windowed: bool


@dataclass(frozen=True)
class Authenticated:
    """TLS verified that the peer on ``conn`` holds a certificate for ``identity``."""
    conn: int
    identity: str


@dataclass(frozen=True)
class Data:
    """Messages decoded from ``conn``'s bytes this turn, then the error that ended its stream, if any."""
    conn: int
    messages: list[Message]
    error: KvlendError | None


@dataclass(frozen=True)
class Gone:
    """Connection ``conn`` ended or could not be opened (``refused``: TLS refused the peer)."""
    conn: int
    why: str
    refused: bool = False


Input = Union[Accepted, Connected, Authenticated, Data, Gone]
