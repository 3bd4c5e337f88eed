"""Registering kvlend's memory regions with a NIXL agent, and where the registered spans lie."""

from __future__ import annotations

import numpy as np

from kvlend.core.layout import MemoryKind
from kvlend.errors import BackendError

from .calls import as_error, quietly
from .nixl_build import api as nixl

MEM = {MemoryKind.HOST: "DRAM", MemoryKind.DEVICE: "VRAM"}


def register(agent: nixl.nixl_agent, keys) -> list:
    """Register ``(kind, device, address, size)`` keys, one NIXL list per kind; all or none."""
    rows: dict[MemoryKind, list] = {}
    for kind, device, address, size in keys:
        rows.setdefault(kind, []).append([address, size, device])
    done = []
    try:
        for kind, arr in rows.items():
            done.append(agent.register_memory(np.array(arr, dtype=np.uint64), MEM[kind]))
    except Exception as exc:
        for dlist in done:
            quietly(agent.deregister_memory, dlist)
        raise as_error(exc, f"registering {sum(map(len, rows.values()))} regions") from None
    return done


def check_gpus(regions) -> None:
    """DEVICE regions need CUDA and a device with each region's id."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        names = ", ".join(repr(r.name) for r in regions)
        raise BackendError(f"DEVICE regions {names} need a CUDA GPU, but none is available")
    count = torch.cuda.device_count()
    for r in regions:
        if r.device_id >= count:
            raise BackendError(f"region {r.name!r}: device_id {r.device_id} but only {count} CUDA devices")


def spans(keys) -> dict[tuple[MemoryKind, int], tuple[np.ndarray, np.ndarray, list[int], list[int]]]:
    """Registered regions per (kind, device) as sorted, merged [start, end) spans.

    Stored as (starts, ends_before) with ``ends_before[i]`` the end of span
    ``i - 1`` (0 for i = 0), so ``ends_before[searchsorted(starts, a, "right")]``
    is the end of the span that starts at or below address ``a``; as arrays, for
    long descriptor lists, and as lists (``bisect``), for short ones.
    """
    grouped: dict[tuple[MemoryKind, int], list[tuple[int, int]]] = {}
    for kind, device, address, size in keys:
        grouped.setdefault((kind, device), []).append((address, address + size))
    out = {}
    for key, spans in grouped.items():
        merged: list[list[int]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        arr = np.array(merged, dtype=np.uint64)
        starts, ends_before = arr[:, 0].copy(), np.concatenate([np.zeros(1, dtype=np.uint64), arr[:, 1]])
        out[key] = (starts, ends_before, starts.tolist(), ends_before.tolist())
    return out

