"""Registering kvlend's memory regions with a NIXL agent, where the registered spans lie, and checking
a read's local rows against them."""

from __future__ import annotations

import bisect

import numpy as np

from kvlend.core.layout import MemoryKind
from kvlend.errors import BackendError
from kvlend.transport import ReadBatch

from .calls import as_error, quietly
from .nixl_build import api as nixl

MEM = {MemoryKind.HOST: "DRAM", MemoryKind.DEVICE: "VRAM"}
_SHORT_LIST = 32  # descriptor rows checked in Python rather than numpy


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


def check_local(spans: dict, index: int, batch: ReadBatch) -> None:
    """Every local row of ``batches[index]`` must lie inside one registered span (``spans``) of its kind and device."""
    rows = batch.local
    if rows.shape[0] <= _SHORT_LIST and _inside(spans, batch.local_kind, rows.tolist()):
        return
    addr, length, dev = rows[:, 0], rows[:, 1], rows[:, 2]
    end = addr + length
    first = int(dev[0])
    devices = (first,) if (dev == first).all() else np.unique(dev).tolist()
    ok = end > addr  # neither empty nor wrapped around
    for device in devices:
        found = spans.get((batch.local_kind, device))
        inside = found is not None
        if inside:  # the span starting at or below addr must reach end
            starts, ends_before = found[:2]
            inside = end <= ends_before[np.searchsorted(starts, addr, side="right")]
        ok &= inside if len(devices) == 1 else inside | (dev != device)
    if not ok.all():
        if not length.all():
            raise BackendError(f"batches[{index}]: zero-length descriptor at row {int(np.argmin(length != 0))}")
        row = int(np.argmin(ok))
        raise BackendError(
            f"batches[{index}]: local row {row} (0x{int(addr[row]):x}+{int(length[row])}, "
            f"{batch.local_kind.value} device {int(dev[row])}) is outside every registered region"
        )


def _inside(spans: dict, kind: MemoryKind, rows: list[list[int]]) -> bool:
    """``check_local``'s test on a short list, row by row with ``bisect`` (a numpy call costs
    more than a row); False also where a row is bad, for the vectorised check to name it."""
    for address, length, device in rows:
        found = spans.get((kind, device))
        if found is None or not length:
            return False
        starts, ends_before = found[2:]
        if address + length > ends_before[bisect.bisect_right(starts, address)]:
            return False
    return True
