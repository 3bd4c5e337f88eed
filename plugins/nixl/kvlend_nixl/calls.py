"""Calls on a NIXL agent, with NIXL's failures turned into kvlend's typed errors.

``NixlBackend`` drives the agent; these are the pieces that do not need its state:
a tag's read record, posting and releasing handles, a peer's name read from its
metadata before NIXL loads it.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from kvlend.errors import BackendError, KvlendError, PeerLost

from .nixl_build import api as nixl, bindings as _nb

MAX_NAME = 256
# Serialized agent metadata starts with the agent's name (nixlSerDes, NIXL 1.x).
_MD_PREFIX = b"nixlSerDes|Agent"
_DISCONNECT = (_nb.nixlRemoteDisconnectError,)


@dataclass(eq=False)
class Read:
    """One tag: its handles, which of them may still write, and its first error."""

    peer: str
    handles: list
    deadline: float
    live: list  # live[i]: handle i was posted and NIXL has not yet said DONE or ERR
    posted: bool = False
    error: KvlendError | None = None
    failed_at: float = math.inf  # when ``error`` was set: the abort grace runs from here

    @property
    def settled(self) -> bool:
        """Nothing of this read can write any more: it may be reported."""
        return self.posted and not any(self.live)

    def fail(self, error: KvlendError, now: float) -> None:
        """Keep the first error; the read stays quarantined until it settles."""
        if self.error is None:
            self.error, self.failed_at = error, now


def quietly(fn, *args) -> Exception | None:
    """Call ``fn``; the exception it raised, if any (clean-up that must go on past a failure)."""
    try:
        fn(*args)
    except Exception as exc:
        return exc
    return None


def as_error(exc: BaseException, what: str) -> KvlendError:
    """``exc`` as a kvlend error: ``PeerLost`` for a disconnect, ``BackendError`` for any other NIXL failure."""
    if isinstance(exc, KvlendError):
        return exc
    cls = PeerLost if isinstance(exc, _DISCONNECT) else BackendError
    return cls(f"{what}: {type(exc).__name__}: {exc}")


def peer_name(metadata: bytes) -> str:
    """The agent name inside NIXL metadata, read before loading it.

    NIXL refuses (NOT_ALLOWED) new metadata under a name it already holds, so a
    restarted peer must be removed first, and for that its name must be known.
    """
    head = len(_MD_PREFIX)
    if not metadata.startswith(_MD_PREFIX) or len(metadata) < head + 8:
        raise BackendError("peer metadata is not NIXL agent metadata (bad header)")
    (size,) = struct.unpack_from("=Q", metadata, head)
    end = head + 8 + size
    if not 0 < size <= MAX_NAME or len(metadata) <= end or metadata[end:end + 1] != b"|":
        raise BackendError(f"peer metadata has a malformed agent name (length {size})")
    try:
        return metadata[head + 8:end].decode("utf-8")
    except UnicodeDecodeError:
        raise BackendError("peer metadata agent name is not UTF-8") from None


def check_tag(tag) -> None:
    """Tags are bytes: NIXL carries them as notification messages."""
    if not isinstance(tag, bytes):
        raise BackendError(f"tag must be bytes, got {type(tag).__name__}")


def post(agent: nixl.nixl_agent, handles: list, what: str) -> tuple[list[bool], KvlendError | None]:
    """Post each handle; which are in flight, and the error that stopped posting."""
    live = []
    for h in handles:
        try:
            state = agent.transfer(h)
        except Exception as exc:
            return live, as_error(exc, what)
        if state == "ERR":
            return live, BackendError(f"{what}: NIXL returned ERR")
        live.append(state == "PROC")
    return live, None


def release(handles: list) -> None:
    """Release handles, ignoring failures: a handle NIXL keeps is retried by its finalizer."""
    for h in handles:
        quietly(h.release)
