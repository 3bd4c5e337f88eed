"""Delivery tracker (fetch ledger): the decode side's record of read chunks.

Each posted chunk names the token pages of each local layer group it reads;
a page counts as delivered only when its chunk is ``done``.  The safe-resume
bound is the largest token position ``t <= num_tokens`` at which every group
has every page it reads delivered: decode may start, or resume after a fault,
from there.  Full attention needs the delivered prefix, a windowed group only
its sinks and read window at ``t``, and recurrent state is valid only whole and
only at ``t == num_tokens``.  Pure: no clocks, no I/O.

Lifecycle: ``begin`` -> ``post``/``done``/``fail`` (and ``need``, as a
progressive lease grows) -> ``finish``.  ``abort``
freezes a request: completions that arrive later (reads already in flight)
are ignored and return False, but still leave ``pending``, so the caller knows
when its destination pages are quiet.  An aborted request may be finished at
any time; the tracker remembers the last ``remember`` such ids so that even
later completions are ignored rather than refused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping

import numpy as np

from ..errors import PageRangeError, TrackerError
from .layout import PageLayout
from .pages import int_array


@dataclass(frozen=True)
class TrackerStats:
    requests: int  # tracked now (aborted ones included until finished)
    pending: int  # chunks in flight
    done: int  # chunks completed and counted
    failed: int  # chunks failed
    ignored: int  # completions that arrived after their request was aborted


@dataclass
class _Request:
    num_tokens: int
    needed: dict[str, np.ndarray]  # group -> bool per token page: will be delivered
    delivered: dict[str, np.ndarray]  # group -> bool per token page: its chunk is done
    missing: int  # needed pages not yet delivered, over all groups
    pending: dict[Hashable, dict[str, np.ndarray]] = field(default_factory=dict)
    settled: set[Hashable] = field(default_factory=set)
    errors: dict[Hashable, BaseException | None] = field(default_factory=dict)  # failed chunks
    aborted: bool = False
    bound: int | None = None  # cached until the next delivery


class DeliveryTracker:
    """Chunks in flight, done and failed per request, and each request's safe-resume bound."""

    def __init__(self, layout: PageLayout, remember: int = 4096) -> None:
        if isinstance(remember, bool) or not isinstance(remember, int) or remember < 0:
            raise TrackerError(f"remember: must be an int >= 0, got {remember!r}")
        self.layout = layout
        self._remember = remember
        self._requests: dict[str, _Request] = {}
        self._aborted: OrderedDict[str, None] = OrderedDict()  # finished after abort
        self._done = self._failed = self._ignored = 0

    # ------------------------------------------------------------ requests
    def begin(self, request: str, num_tokens: int, needed: Mapping[str, Any] | None = None) -> None:
        """Start tracking ``request``; ``needed`` maps every group to the token pages to be delivered.

        Default: per group, what a decoder at ``num_tokens`` reads.
        """
        if not isinstance(request, str) or not request:
            raise TrackerError(f"request: must be a non-empty str, got {request!r}")
        if request in self._requests:
            raise TrackerError(f"request {request!r} is already tracked")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
            raise PageRangeError(f"num_tokens: must be an int > 0, got {num_tokens!r}")
        groups = self.layout.groups
        tpp = self.layout.tokens_per_page
        checked = needed is None  # what a decoder reads is in range, sorted and unique
        if checked:
            needed = {name: g.pages_read(num_tokens, tpp) for name, g in groups.items()}
        elif not isinstance(needed, Mapping) or set(needed) != set(groups):
            have = set(needed) if isinstance(needed, Mapping) else set()
            raise PageRangeError(
                f"needed: must map every group; missing {sorted(set(groups) - have)}, "
                f"unknown [{', '.join(sorted(map(repr, have - set(groups))))}]"
            )
        masks, missing = {}, 0
        for name, g in groups.items():
            size = 1 if g.recurrent else -(-num_tokens // tpp)
            pages = needed[name] if checked else _pages(f"needed[{name!r}]", needed[name], size)
            mask = np.zeros(size, dtype=bool)
            mask[pages] = True
            masks[name] = mask
            missing += len(pages)
        self._aborted.pop(request, None)
        self._requests[request] = _Request(
            num_tokens, masks, {name: np.zeros(m.size, dtype=bool) for name, m in masks.items()}, missing,
        )

    def need(self, request: str, pages: Mapping[str, Any]) -> None:
        """More token pages will be delivered (a progressive lease grew): add them to what is needed.

        ``pages[group]`` as in ``post``; pages already needed are fine.  Checked before anything changes.
        """
        r = self._get(request)
        if r.aborted:
            raise TrackerError(f"request {request!r} was aborted; it needs nothing more")
        for name, idx in _group_pages(r, pages).items():
            need, have = r.needed[name], r.delivered[name]
            fresh = idx[~need[idx]]
            r.missing += int(np.count_nonzero(~have[fresh]))
            need[fresh] = True

    def abort(self, request: str) -> None:
        """Give up on ``request``: later completions of its chunks are ignored."""
        self._get(request).aborted = True

    def finish(self, request: str) -> None:
        """Forget ``request``; refused while chunks are in flight unless it was aborted."""
        r = self._get(request)
        if r.pending and not r.aborted:
            raise TrackerError(f"request {request!r} has {len(r.pending)} chunk(s) in flight; abort it first")
        del self._requests[request]
        if r.aborted and self._remember:
            self._aborted[request] = None
            while len(self._aborted) > self._remember:
                self._aborted.popitem(last=False)

    # -------------------------------------------------------------- chunks
    def post(self, request: str, chunk_id: Hashable, pages: Mapping[str, Any]) -> None:
        """Record a chunk in flight that reads ``pages[group]`` (token pages, all of them needed)."""
        r = self._get(request)
        if r.aborted:
            raise TrackerError(f"request {request!r} was aborted; post nothing more for it")
        _check_chunk_id(chunk_id)
        if chunk_id in r.pending or chunk_id in r.settled:
            raise TrackerError(f"chunk {chunk_id!r} of request {request!r} was already posted")
        chunk = {}
        for name, idx in _group_pages(r, pages).items():
            need = r.needed[name]
            if not need[idx].all():
                extra = idx[~need[idx]]
                raise PageRangeError(
                    f"pages[{name!r}]: token page {int(extra[0])} is not needed by request {request!r}")
            if idx.size:
                chunk[name] = idx
        if not chunk:
            raise PageRangeError(f"chunk {chunk_id!r} of request {request!r} names no pages")
        r.pending[chunk_id] = chunk

    def done(self, request: str, chunk_id: Hashable) -> bool:
        """The chunk's reads completed: its pages count as delivered. False if ignored (aborted)."""
        settled = self._settle(request, chunk_id)
        if settled is None:
            return False
        r, chunk = settled
        for name, idx in chunk.items():
            have = r.delivered[name]
            r.missing -= idx.size - int(np.count_nonzero(have[idx]))
            have[idx] = True
        r.bound = None
        self._done += 1
        return True

    def fail(self, request: str, chunk_id: Hashable, error: BaseException | None = None) -> bool:
        """The chunk's reads failed: nothing it names counts. False if ignored (aborted)."""
        settled = self._settle(request, chunk_id)
        if settled is None:
            return False
        r, _ = settled
        r.errors[chunk_id] = error
        self._failed += 1
        return True

    def _settle(self, request: str, chunk_id: Hashable) -> tuple[_Request, dict[str, np.ndarray]] | None:
        """The chunk's request and pages, taken off those pending; None if ignored (its request aborted)."""
        if request in self._aborted and request not in self._requests:
            self._ignored += 1
            return None
        r = self._get(request)
        if chunk_id not in r.pending:
            state = "already settled" if chunk_id in r.settled else "never posted"
            raise TrackerError(f"chunk {chunk_id!r} of request {request!r} was {state}")
        chunk = r.pending.pop(chunk_id)
        r.settled.add(chunk_id)
        if r.aborted:
            self._ignored += 1
            return None
        return r, chunk

    # ------------------------------------------------------------- queries
    def bound(self, request: str) -> int:
        """The safe-resume bound: largest ``t <= num_tokens`` whose reads are all delivered."""
        r = self._get(request)
        if r.bound is None:
            r.bound = self._bound(r)
        return r.bound

    def _bound(self, r: _Request) -> int:
        tpp, n = self.layout.tokens_per_page, r.num_tokens
        groups = self.layout.groups.items()
        if all(not g.recurrent and g.read_window >= n for _, g in groups):
            # Full attention at every t <= n: the bound is where the shortest delivered prefix ends.
            bound = n
            for name, _ in groups:
                have = r.delivered[name]
                if not have.all():
                    bound = min(bound, int(have.argmin()) * tpp)
            return bound
        # Reads only grow between page boundaries, so boundaries and n are the only candidates.
        t = np.append(np.arange(0, n, tpp, dtype=np.int64), n)
        ok = np.ones(t.size, dtype=bool)
        end = -(-t // tpp)
        for name, g in self.layout.groups.items():
            have = r.delivered[name]
            if g.recurrent:
                ok &= (t == n) & bool(have[0])
                continue
            # missing[i] = pages not delivered among [0, i)
            missing = np.concatenate(([0], np.cumsum(~have)))
            start = np.maximum(0, t - g.read_window) // tpp
            sinks = np.minimum(g.sinks, start)
            ok &= (missing[sinks] == 0) & (missing[end] == missing[start])
        return int(t[ok].max()) if ok.any() else 0

    def complete(self, request: str) -> bool:
        """Every needed page of every group is delivered."""
        return self._get(request).missing == 0

    def failed(self, request: str) -> bool:
        """Some chunk of ``request`` failed (what was delivered still counts for the bound)."""
        return bool(self._get(request).errors)

    def errors(self, request: str) -> Mapping[Hashable, BaseException | None]:
        """Failed chunk ids of ``request`` and the error each was failed with."""
        return dict(self._get(request).errors)

    def aborted(self, request: str) -> bool:
        return self._get(request).aborted

    def pending(self, request: str) -> tuple[Hashable, ...]:
        """Chunk ids in flight, in posting order."""
        return tuple(self._get(request).pending)

    @property
    def stats(self) -> TrackerStats:
        return TrackerStats(
            requests=len(self._requests),
            pending=sum(len(r.pending) for r in self._requests.values()),
            done=self._done, failed=self._failed, ignored=self._ignored,
        )

    def _get(self, request: str) -> _Request:
        r = self._requests.get(request) if isinstance(request, str) else None
        if r is None:
            raise TrackerError(f"request {request!r} is not tracked")
        return r


def _check_chunk_id(chunk_id: Any) -> None:
    if isinstance(chunk_id, bool) or not isinstance(chunk_id, (int, str)):
        raise TrackerError(f"chunk id: must be an int or a str, got {type(chunk_id).__name__}")


def _group_pages(r: _Request, pages: Any) -> dict[str, np.ndarray]:
    """``pages`` (group -> token pages) checked against the request's groups and sizes, all before any use."""
    if not isinstance(pages, Mapping):
        raise PageRangeError(f"pages: must be a mapping of group name to token pages, got {type(pages).__name__}")
    unknown = sorted(map(repr, set(pages) - set(r.needed)))
    if unknown:
        raise PageRangeError(f"pages: unknown groups [{', '.join(unknown)}]")
    return {name: _pages(f"pages[{name!r}]", value, r.needed[name].size) for name, value in pages.items()}


def _pages(where: str, value: Any, size: int) -> np.ndarray:
    """Token-page indices in ``[0, size)`` as a sorted, unique int64 array."""
    arr = int_array(where, value)
    if arr.size == 0:
        return arr
    ascending = arr.size == 1 or bool((arr[1:] > arr[:-1]).all())  # the usual case: already sorted, unique
    lo, hi = (arr[0], arr[-1]) if ascending else (arr.min(), arr.max())
    if lo < 0 or hi >= size:
        raise PageRangeError(f"{where}: token page {int(lo if lo < 0 else hi)} is outside [0, {size})")
    return arr if ascending else np.unique(arr)
