"""Page locks: refcounted pins on page slots that a peer may be reading.

The lender takes one lock per lent (region, page) and drops it when the lease
ends; the engine's cache manager asks ``can_evict`` before it evicts or reuses
a slot, so a page is never overwritten under a peer's one-sided read.  Counts
are one int32 numpy array over all regions (each region a slice of it), so a
lease over many regions is locked in one vectorised pass: locking, unlocking
and point queries are O(pages touched); ``locked_pages`` (a gauge, read rarely)
counts a region's slots.
"""

from __future__ import annotations

from typing import Any, Iterable, NoReturn

import numpy as np

from ..errors import PageRangeError
from .layout import PageLayout
from .pages import int_array

_INT32_MAX = np.iinfo(np.int32).max

# Validated flat slots (sorted, unique) and how often each is listed (None: once each).
Slots = tuple[np.ndarray, "np.ndarray | None"]


class PageLocks:
    """Refcounted locks per (region, page slot) of one layout."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        sizes = [r.num_pages for r in layout.regions]
        self._sizes = np.array(sizes, dtype=np.int64)
        self._size_list = sizes
        self._bases = np.cumsum([0] + sizes[:-1]).astype(np.int64)  # region i is _flat[_bases[i]:][:sizes[i]]
        self._flat = np.zeros(sum(sizes), dtype=np.int32)
        self._index = {r.name: i for i, r in enumerate(layout.regions)}
        self._counts = {r.name: self._flat[b:b + r.num_pages] for r, b in zip(layout.regions, self._bases.tolist())}
        self._bases_of: dict[tuple[str, ...], np.ndarray] = {}  # region names -> their bases, a column

    def _region(self, region: Any) -> np.ndarray:
        counts = self._counts.get(region) if isinstance(region, str) else None
        if counts is None:
            self._no_region(region)
        return counts

    def _no_region(self, region: Any) -> NoReturn:
        raise PageRangeError(f"region: no region {region!r}; have {sorted(self._counts)}")

    def _ordinals(self, region: str, ordinals: Any) -> tuple[np.ndarray, np.ndarray]:
        counts = self._region(region)
        arr = int_array(f"ordinals of region {region!r}", ordinals)
        if arr.size == 0:
            return counts, arr
        lo, hi = arr.min(), arr.max()
        if lo < 0 or hi >= counts.size:
            bad = lo if lo < 0 else hi
            raise PageRangeError(f"ordinal {int(bad)} is outside region {region!r} of {counts.size} pages")
        return counts, arr

    def _flatten(self, items: Iterable[tuple[str, Any]]) -> Slots:
        """Validate every (region, ordinals) before any count changes.

        Returns the flat slots to change (sorted, unique) and how many times
        each is listed (None: once each).
        """
        regions: list[int] = []
        parts: list[np.ndarray] = []
        for region, ordinals in items:
            index = self._index.get(region) if isinstance(region, str) else None
            if index is None:
                self._no_region(region)
            if not (type(ordinals) is np.ndarray and ordinals.dtype == np.int64 and ordinals.ndim == 1):
                ordinals = int_array(f"ordinals of region {region!r}", ordinals)
            if ordinals.size:
                regions.append(index)
                parts.append(ordinals)
        if not parts:
            return np.zeros(0, dtype=np.int64), None
        first = parts[0]
        if all(p is first for p in parts) and all(a < b for a, b in zip(regions, regions[1:])):
            # The lender's case: one sorted, unique array for regions in layout order.
            if first.size == 1 or (first[1:] > first[:-1]).all():
                if first[0] < 0 or first[-1] >= min(self._size_list[i] for i in regions):
                    self._range_error(regions, parts)
                flat = first + self._bases[regions[0]] if len(regions) == 1 else \
                    (self._bases[regions][:, None] + first).ravel()
                return flat, None
        lengths = [p.size for p in parts]
        cat = np.concatenate(parts)
        if ((cat < 0) | (cat >= np.repeat(self._sizes[regions], lengths))).any():
            self._range_error(regions, parts)
        flat = np.sort(cat + np.repeat(self._bases[regions], lengths))
        keep = np.ones(flat.size, dtype=bool)
        keep[1:] = flat[1:] != flat[:-1]
        starts = np.flatnonzero(keep)
        return flat[starts], np.diff(np.append(starts, flat.size))

    def _shared_slots(self, regions: tuple[str, ...], ordinals: np.ndarray) -> Slots:
        """The flat slots of the same ``ordinals`` in each of ``regions``: the lender's hot path.

        The caller vouches that ``regions`` are distinct names of this layout in layout order and
        that ``ordinals`` is a sorted, unique int64 array within the smallest of them (the lender
        checked both); what ``_flatten`` would otherwise check again on every lease.
        """
        bases = self._bases_of.get(regions)
        if bases is None:
            bases = self._bases_of[regions] = self._bases[[self._index[r] for r in regions]][:, None]
        return (bases + ordinals).ravel(), None

    def _range_error(self, regions: list[int], parts: list[np.ndarray]) -> None:
        """Raise for the first region with an ordinal out of range, as ``lock`` of it alone would."""
        for index, arr in zip(regions, parts):
            self._ordinals(self.layout.regions[index].name, arr)

    def _region_of(self, flat_slot: int) -> tuple[str, int]:
        i = int(np.searchsorted(self._bases, flat_slot, side="right")) - 1
        return self.layout.regions[i].name, int(flat_slot - self._bases[i])

    def lock(self, region: str, ordinals: Any) -> None:
        """Add one lock per entry (a page listed twice is locked twice)."""
        self.lock_many(((region, ordinals),))

    def unlock(self, region: str, ordinals: Any) -> None:
        """Drop one lock per entry; refuses (changing nothing) to go below zero."""
        self.unlock_many(((region, ordinals),))

    def lock_many(self, items: Iterable[tuple[str, Any]]) -> None:
        """``lock`` for several (region, ordinals) at once; all or nothing."""
        self._add(*self._flatten(items))

    def lock_slots(self, slots: Slots) -> None:
        """Lock validated ``slots`` (``_flatten``'s or ``_shared_slots``'s) once more; all or nothing.

        The lender validates a lease's slots once and keeps them, so its release unlocks exactly
        what its lend locked without validating them again.
        """
        self._add(*slots)

    def _add(self, pages: np.ndarray, n: np.ndarray | None) -> None:
        if not pages.size:
            return
        before = self._flat[pages]
        step: np.ndarray | int
        if n is None:
            step = 1
            over = before == _INT32_MAX
        else:
            step = n
            over = before.astype(np.int64) + n > _INT32_MAX
        if over.any():
            region, _ = self._region_of(int(pages[np.argmax(over)]))
            raise PageRangeError(f"region {region!r}: a page lock count would exceed {_INT32_MAX}")
        self._flat[pages] = before + step

    def unlock_many(self, items: Iterable[tuple[str, Any]]) -> None:
        """``unlock`` for several (region, ordinals) at once; all or nothing."""
        self.unlock_slots(self._flatten(items))

    def unlock_slots(self, slots: Slots) -> None:
        """Drop one lock per validated slot (as ``lock_slots`` took them); all or nothing."""
        pages, n = slots
        if not pages.size:
            return
        after = self._flat[pages] - (1 if n is None else n)
        if after.min() < 0:
            i = int(np.argmin(after))
            region, page = self._region_of(int(pages[i]))
            raise PageRangeError(
                f"unlock of page {page} in region {region!r} {1 if n is None else int(n[i])} time(s) "
                f"but it holds {int(self._flat[pages[i]])} lock(s)"
            )
        self._flat[pages] = after

    def is_locked(self, region: str, ordinal: int) -> bool:
        counts, arr = self._ordinals(region, np.asarray([ordinal]))
        return bool(counts[arr[0]] > 0)

    def can_evict(self, region: str, ordinals: Any) -> np.ndarray:
        """One bool per entry: True where no peer may be reading the page."""
        counts, arr = self._ordinals(region, ordinals)
        return counts[arr] == 0

    def locked_pages(self, region: str | None = None) -> int:
        """Number of pages holding at least one lock (in ``region``, or in all)."""
        return int(np.count_nonzero(self._flat if region is None else self._region(region)))

    def refcounts(self, region: str) -> np.ndarray:
        """A read-only copy of the lock counts of every page of ``region``."""
        out = self._region(region).copy()
        out.flags.writeable = False
        return out
