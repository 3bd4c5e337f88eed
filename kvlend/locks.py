"""Page locks: refcounted pins on page slots that a peer may be reading.

The lender takes one lock per lent (region, page) and drops it when the lease
ends; the engine's cache manager asks ``can_evict`` before it evicts or reuses
a slot, so a page is never overwritten under a peer's one-sided read.  Counts
are int32 numpy arrays, one per region: every call is O(pages touched).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import PageRangeError
from .layout import PageLayout
from .pages import int_array

_INT32_MAX = np.iinfo(np.int32).max


class PageLocks:
    """Refcounted locks per (region, page slot) of one layout."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self._counts = {r.name: np.zeros(r.num_pages, dtype=np.int32) for r in layout.regions}
        self._locked = {r.name: 0 for r in layout.regions}  # pages with a count > 0

    def _region(self, region: Any) -> np.ndarray:
        counts = self._counts.get(region) if isinstance(region, str) else None
        if counts is None:
            raise PageRangeError(f"region: no region {region!r}; have {sorted(self._counts)}")
        return counts

    def _ordinals(self, region: str, ordinals: Any) -> tuple[np.ndarray, np.ndarray]:
        counts = self._region(region)
        arr = int_array(f"ordinals of region {region!r}", ordinals)
        if arr.size == 0:
            return counts, arr
        lo, hi = arr.min(), arr.max()
        if lo < 0 or hi >= counts.size:
            bad = lo if lo < 0 else hi
            raise PageRangeError(f"ordinal {int(bad)} is outside region {region!r} of {counts.size} pages")
        return counts, arr.astype(np.int64, copy=False)

    def lock(self, region: str, ordinals: Any) -> None:
        """Add one lock per entry (a page listed twice is locked twice)."""
        counts, arr = self._ordinals(region, ordinals)
        pages, n = np.unique(arr, return_counts=True)
        before = counts[pages]
        if pages.size and int((before.astype(np.int64) + n).max()) > _INT32_MAX:
            raise PageRangeError(f"region {region!r}: a page lock count would exceed {_INT32_MAX}")
        self._locked[region] += int(np.count_nonzero(before == 0))
        counts[pages] = before + n.astype(np.int32)

    def unlock(self, region: str, ordinals: Any) -> None:
        """Drop one lock per entry; refuses (changing nothing) to go below zero."""
        counts, arr = self._ordinals(region, ordinals)
        pages, n = np.unique(arr, return_counts=True)
        after = counts[pages] - n.astype(np.int32)
        if pages.size and int(after.min()) < 0:
            i = int(np.argmin(after))
            raise PageRangeError(
                f"unlock of page {int(pages[i])} in region {region!r} {int(n[i])} time(s) "
                f"but it holds {int(counts[pages[i]])} lock(s)"
            )
        self._locked[region] -= int(np.count_nonzero(after == 0))
        counts[pages] = after

    def is_locked(self, region: str, ordinal: int) -> bool:
        counts, arr = self._ordinals(region, np.asarray([ordinal]))
        return bool(counts[arr[0]] > 0)

    def can_evict(self, region: str, ordinals: Any) -> np.ndarray:
        """One bool per entry: True where no peer may be reading the page."""
        counts, arr = self._ordinals(region, ordinals)
        return counts[arr] == 0

    def locked_pages(self, region: str | None = None) -> int:
        """Number of pages holding at least one lock (in ``region``, or in all)."""
        if region is None:
            return sum(self._locked.values())
        self._region(region)
        return self._locked[region]

    def refcounts(self, region: str) -> np.ndarray:
        """A read-only copy of the lock counts of every page of ``region``."""
        out = self._region(region).copy()
        out.flags.writeable = False
        return out
