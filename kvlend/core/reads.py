"""``ReadBatch``: the planner's output and the transport's input.

A core type, so the pure planner never imports the transport plane.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import BackendError
from .layout import MemoryKind


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

    @classmethod
    def _planned(cls, remote_kind: MemoryKind, local_kind: MemoryKind, remote: np.ndarray,
                 local: np.ndarray) -> ReadBatch:
        """A batch the planner built (fresh (N, 3) uint64 arrays, equal lengths by construction):
        the per-request hot path, which skips ``__post_init__``'s checks."""
        obj = object.__new__(cls)
        for name, value in (("remote_kind", remote_kind), ("local_kind", local_kind),
                            ("remote", remote), ("local", local)):
            object.__setattr__(obj, name, value)
        return obj

    @property
    def count(self) -> int:
        return int(self.remote.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.remote[:, 1].sum())
