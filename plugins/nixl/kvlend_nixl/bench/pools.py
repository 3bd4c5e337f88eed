"""Stamped KV pools (Llama-3-8B-like pages), NIXL descriptor rows, fragmented slot choices and the
check that every word landed where it belongs."""

from __future__ import annotations

import numpy as np

from kvlend.core.layout import MemoryKind, MemoryRegion, PageLayout, layout_from_pools

HEADS, TPP, HEAD_DIM = 8, 16, 128  # Llama-3-8B-like: 32 KiB per K (or V) page per layer, 2-byte elements
PAGE_BYTES = HEADS * TPP * HEAD_DIM * 2
GROUP = "full"


def _shape(pages: int, layers: int, combined: bool) -> list[tuple[int, ...]]:
    if combined:
        return [(pages, 2, HEADS, TPP, HEAD_DIM)] * layers
    return [(pages, HEADS, TPP, HEAD_DIM)] * (2 * layers)


def make_pools(pages: int, layers: int, combined: bool, fill: bool) -> tuple[list[np.ndarray], PageLayout]:
    """Per-layer pools (K and V apart unless ``combined``); ``fill`` stamps every 8-byte word."""
    arrays = [np.zeros(s, dtype=np.uint16) for s in _shape(pages, layers, combined)]
    if fill:
        for r, a in enumerate(arrays):
            words = a.reshape(-1).view(np.uint64)
            words[:] = np.arange(words.size, dtype=np.uint64)
            words += np.uint64(r << 40)
    if combined:
        layout = layout_from_pools(kv=arrays, kept_window=1 << 30)
    else:
        layout = layout_from_pools(k=arrays[0::2], v=arrays[1::2], kept_window=1 << 30)
    return arrays, layout


def host_region(arr: np.ndarray, name: str) -> MemoryRegion:
    return MemoryRegion(name, MemoryKind.HOST, 0, arr.nbytes, arr.nbytes, 1, arr.ctypes.data)


def expected_ok(dst: np.ndarray, r: int, src_slots: np.ndarray, dst_slots: np.ndarray) -> bool:
    """Every word of ``dst[dst_slots]`` holds the stamp of region ``r``'s ``src_slots``."""
    per = dst[0].nbytes // 8
    got = dst.reshape(dst.shape[0], -1).view(np.uint64)[dst_slots]
    want = (src_slots.astype(np.uint64)[:, None] * np.uint64(per) + np.arange(per, dtype=np.uint64)[None, :])
    return bool(np.array_equal(got, want + np.uint64(r << 40)))


def descriptor_rows(addresses: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return np.stack([addresses.astype(np.uint64), lengths.astype(np.uint64), np.zeros(len(addresses), np.uint64)], 1)


def fragmented(pool_pages: int, need: int, seed: int) -> np.ndarray:
    """``need`` slots from a pool allocated in short runs (1..4 pages) in random order."""
    rng = np.random.default_rng(seed)
    cuts = np.cumsum(rng.integers(1, 5, size=pool_pages))
    cuts = cuts[cuts < pool_pages]
    runs = np.split(np.arange(pool_pages), cuts)
    order = rng.permutation(len(runs))
    slots = np.concatenate([runs[i] for i in order])
    return slots[:need].astype(np.int64)


def min_descriptors(src: np.ndarray, dst: np.ndarray, buffers: int) -> int:
    """Maximal runs contiguous on both sides, per buffer (buffers are separate regions)."""
    breaks = ~((np.diff(src) == 1) & (np.diff(dst) == 1))
    return buffers * (1 + int(breaks.sum()))
