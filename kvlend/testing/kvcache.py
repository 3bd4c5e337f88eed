"""A toy paged KV cache in numpy: pools, layouts, seeded page contents and a free list.

Both ends of a ``World`` (and both ranks of a test over real nodes) build the
same layout from these, so the decode side can recompute what any lent page
must hold from a request's seed.
"""

from __future__ import annotations

import numpy as np

from ..core.layout import PageLayout, layout_from_pools

TPP = 4  # tokens per page: small pages keep a thousand leases fast
LAYERS = 4
WINDOWS = {2: 64, 3: 64}  # layers 2 and 3 form group "swa": 64-token window, 1 sink page
SINKS = 1
SENTINEL = 0xA5


def make_pools(num_pages: int, *, layers: int = LAYERS, heads: int = 2, head_dim: int = 8,
               dtype=np.uint16) -> list[np.ndarray]:
    """One zeroed pool per layer, ``[num_pages, 2 (K|V), heads, TPP, head_dim]``."""
    return [np.zeros((num_pages, 2, heads, TPP, head_dim), dtype=dtype) for _ in range(layers)]


def make_layout(pools: list[np.ndarray], windowed: bool = True) -> PageLayout:
    return layout_from_pools(kv=pools, kept_window=4096, windows=WINDOWS if windowed else None,
                             sinks=SINKS if windowed else 0)


def slots(pool: np.ndarray) -> np.ndarray:
    """The pool as uint8 ``[num_pages, slot_bytes]``, sharing memory."""
    return pool.view(np.uint8).reshape(pool.shape[0], -1)


def group_layers(layout: PageLayout, group: str) -> list[int]:
    return sorted({b.identity.layer for b in layout.groups[group].buffers})


def pattern(seed: int, layer: int, num_pages: int, slot_bytes: int) -> np.ndarray:
    """What token pages ``[0, num_pages)`` of ``layer`` hold for the request seeded ``seed``."""
    return np.random.default_rng([seed, layer]).integers(0, 256, (num_pages, slot_bytes), dtype=np.uint8)


class FreeList:
    """Page slots handed out in random order (scattered, with the odd contiguous run)."""

    def __init__(self, num_pages: int, rng: np.random.Generator) -> None:
        self.rng = rng
        self.free = set(range(num_pages))

    def __len__(self) -> int:
        return len(self.free)

    def alloc(self, n: int) -> np.ndarray:
        if n > len(self.free):
            raise AssertionError(f"free list exhausted: {n} pages wanted, {len(self.free)} free")
        pages = self.rng.choice(np.fromiter(self.free, dtype=np.int64), n, replace=False)
        if self.rng.random() < 0.3:
            pages.sort()  # runs that the planner may coalesce
        self.free.difference_update(pages.tolist())
        return pages

    def release(self, pages: np.ndarray) -> None:
        pages = [int(p) for p in pages if p >= 0]
        assert not self.free.intersection(pages), "page freed twice"
        self.free.update(pages)


def prefill_request(layout: PageLayout, pools: list[np.ndarray], free: dict[str, FreeList],
                    num_tokens: int, seed: int) -> dict[str, np.ndarray]:
    """Allocate and fill a request's pages the way a prefill engine would; return its page tables.

    Every group gets one entry per token page; a windowed group holds only the
    pages a decoder at ``num_tokens`` reads (sinks and window), -1 elsewhere,
    as an engine that already evicted the stale ones.
    """
    tables = {}
    n_pages = -(-num_tokens // layout.tokens_per_page)
    for name, group in layout.groups.items():
        rows = group.pages_read(num_tokens, layout.tokens_per_page)
        table = np.full(n_pages, -1, dtype=np.int64)
        table[rows] = free[name].alloc(rows.size)
        for layer in group_layers(layout, name):
            view = slots(pools[layer])
            view[table[rows]] = pattern(seed, layer, n_pages, view.shape[1])[rows]
        tables[name] = table
    return tables


def expected_pages(layout, table_by_group, seed, num_tokens):
    """What the decode's pages must hold: the seeded pattern of each lent token page."""
    out = {}
    n_pages = -(-num_tokens // TPP)
    for name, group in layout.groups.items():
        rows = group.pages_read(num_tokens, TPP)
        for layer in group_layers(layout, name):
            width = slots(make_pools(1)[layer]).shape[1]
            out[(name, layer)] = (rows, pattern(seed, layer, n_pages, width)[rows])
    return out
