"""The transfer-backend contract.

A backend owns byte movement: it registers pool regions once, exchanges
opaque metadata with peers, posts one-sided reads of coalesced descriptor
runs (the planner's ``ReadBatch``) and reports their completion by tag.
The core never imports one; ``registry`` finds installed backends.

**Completions are terminal.**  ``poll`` reports each posted tag exactly once,
and only when the transport has finished with that tag's destination: the
read succeeded, or it failed, timed out or was cancelled *and* the
transport confirmed it will not write there again (after an abort it is
done or in error, or the peer's endpoint is torn down).  Over TCP or RDMA a
read that failed may still be in flight; reporting it early lets the caller
reuse pages a late write would then corrupt.  Callers rely on this: a fetch
is reported failed, and its lease released, only once every read is terminal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from ..core.layout import MemoryRegion
from ..core.reads import ReadBatch
from ..errors import KvlendError


@dataclass(frozen=True)
class Completion:
    """A posted read is terminal: ``error`` is None on success.  Nothing lands in its destination later."""

    tag: bytes
    error: KvlendError | None = None


@runtime_checkable
class TransferBackend(Protocol):
    kind: str  # the registry name both ends must share, e.g. "nixl"
    name: str  # this agent's name, unique per process

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register pool regions (once, at start-up)."""

    def metadata(self) -> bytes:
        """This agent's metadata for a peer (connection info and registrations)."""

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; return the peer's name for ``post_read``."""

    def remove_peer(self, peer: str) -> None:
        """Forget a peer, tearing its endpoint down: its reads in flight end (``PeerLost``), each
        reported once it can no longer write."""

    def post_read(self, peer: str, batches: Sequence[ReadBatch], tag: bytes) -> None:
        """Start reading ``batches`` from ``peer``; one ``Completion(tag)`` reports all of them.

        Bad arguments raise (nothing is posted); failures after posting come back as completions.
        """

    def cancel(self, tag: bytes) -> None:
        """Start cancelling the read ``tag`` (unknown or reported tags: nothing to do).

        Its completion still follows from ``poll``, once terminal: ``TransferCancelled``,
        or success if it finished first.
        """

    def poll(self) -> list[Completion]:
        """Progress the backend and return the reads that became terminal since the last poll."""

    def deregister(self) -> None:
        """Deregister every region this backend registered."""

    def close(self) -> None:
        """Abort what is in flight, deregister and release the agent."""
