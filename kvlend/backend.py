"""The transfer-backend contract and the registry that finds installed backends.

A backend owns byte movement: it registers pool regions once, exchanges
opaque metadata with peers, posts one-sided reads of coalesced descriptor
runs and reports their completion by tag.  The core never imports one;
backends are found through the ``kvlend.transfer_backends`` entry points.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from .errors import BackendError, KvlendError
from .layout import MemoryKind, MemoryRegion

ENTRY_POINT_GROUP = "kvlend.transfer_backends"


@dataclass(frozen=True, eq=False)
class ReadBatch:
    """Reads from one remote memory kind into one local memory kind.

    ``remote`` and ``local`` are ``(N, 3)`` uint64 arrays of
    ``(address, length, device_id)``; row ``i`` of ``remote`` is copied into
    row ``i`` of ``local`` (lengths are equal).
    """

    remote_kind: MemoryKind
    local_kind: MemoryKind
    remote: np.ndarray
    local: np.ndarray

    def __post_init__(self) -> None:
        for side in (self.remote, self.local):
            if side.dtype != np.uint64 or side.ndim != 2 or side.shape[1] != 3:
                raise BackendError(f"descriptor arrays must be (N, 3) uint64, got {side.dtype} {side.shape}")
        if self.remote.shape != self.local.shape:
            raise BackendError(f"remote {self.remote.shape} and local {self.local.shape} descriptor counts differ")
        if not np.array_equal(self.remote[:, 1], self.local[:, 1]):
            raise BackendError("remote and local descriptor lengths differ")

    @property
    def count(self) -> int:
        return int(self.remote.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.remote[:, 1].sum())


@dataclass(frozen=True)
class Completion:
    """A posted read finished: ``error`` is None on success."""

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
        """Forget a peer (disconnect); stale handles to it become invalid."""

    def post_read(self, peer: str, batches: Sequence[ReadBatch], tag: bytes) -> None:
        """Start reading ``batches`` from ``peer``; one ``Completion(tag)`` reports all of them."""

    def poll(self) -> list[Completion]:
        """Progress the backend and return the reads that finished since the last poll."""

    def deregister(self) -> None:
        """Deregister every region this backend registered."""

    def close(self) -> None:
        """Abort what is in flight, deregister and release the agent."""


def available_backends() -> dict[str, str]:
    """Installed backends: name -> ``module:object``."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_backend(name: str, /, **options) -> TransferBackend:
    """Instantiate the installed backend ``name`` with ``options``."""
    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        have = sorted(available_backends()) or ["none"]
        raise BackendError(
            f"no transfer backend {name!r} is installed (installed: {', '.join(have)}); "
            f"backends register under the entry-point group {ENTRY_POINT_GROUP!r}"
        )
    try:
        factory = matches[0].load()
    except Exception as exc:
        raise BackendError(f"transfer backend {name!r} failed to load: {type(exc).__name__}: {exc}") from exc
    try:
        return factory(**options)
    except KvlendError:
        raise
    except Exception as exc:  # e.g. TypeError for an option the backend does not take
        raise BackendError(f"transfer backend {name!r} refused options {options!r}: "
                           f"{type(exc).__name__}: {exc}") from exc
