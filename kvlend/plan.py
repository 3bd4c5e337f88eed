"""Turn a lease's pages and the decode page table into coalesced read descriptors.

Order is fixed so that results are reproducible: region pair by region pair
(plan order), remote token page by token page, and inside a page the pieces
by remote offset.  Each descriptor is a maximal run of that sequence that is
contiguous on both sides, so the count is the least the order allows.  All
per-page work is vectorised with numpy; Python loops only over region pairs
and pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Mapping

import numpy as np

from .backend import ReadBatch
from .errors import LayoutError, PageRangeError
from .layout import MemoryRegion, RowSelection, SelectionMode
from .negotiate import Piece, RegionPair, TransferPlan, merge_pieces
from .pages import GroupPages

_U64 = np.uint64


@dataclass(frozen=True, eq=False)
class _Pages:
    """One (remote group, local group) pair's pages, validated once and shared by its region pairs."""

    token_pages: np.ndarray  # remote token pages, int64 (P,)
    ordinals: np.ndarray  # remote slots, int64 (P,)
    local: np.ndarray  # local slots, int64 (P, local_per_remote), or (P, 1) when pages merge

    @cached_property
    def src_bounds(self) -> tuple[int, int]:
        return int(self.ordinals.min()), int(self.ordinals.max())

    @cached_property
    def dst_bounds(self) -> tuple[int, int]:
        return int(self.local.min()), int(self.local.max())

    @cached_property
    def src_slots(self) -> np.ndarray:
        return self.ordinals.astype(_U64)

    @cached_property
    def dst_slots(self) -> np.ndarray:
        return self.local.astype(_U64)

    @cached_property
    def slot_runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(remote slot, local slot, pages) of each run of slots consecutive on both sides."""
        brk = np.ones(self.ordinals.size, dtype=bool)
        brk[1:] = (np.diff(self.ordinals) != 1) | (np.diff(self.local[:, 0]) != 1)
        starts = np.flatnonzero(brk)
        counts = np.diff(np.append(starts, self.ordinals.size)).astype(_U64)
        return self.src_slots[starts], self.dst_slots[starts, 0], counts


def plan_reads(
    plan: TransferPlan,
    src: Mapping[str, GroupPages],
    dst: Mapping[str, np.ndarray],
    selection: RowSelection = RowSelection.all(),
) -> list[ReadBatch]:
    """Descriptors reading the lease's pages ``src`` into the local slots ``dst``.

    ``src`` is keyed by remote group (the lease's token pages and slots; a
    group left out reads nothing, so a lease can be read in chunks), ``dst``
    by local group: the local slot of every local token page (a length-1
    array for recurrent groups; entries of pages not read are not
    inspected).  ``selection`` names remote buffers, or ALL (which needs a
    remote layout without HOST regions, see ``PageLayout.check_selection``).
    Returns one ``ReadBatch`` per (remote kind, local kind), in plan order.
    """
    _check_selection(plan, selection)
    work = [(pair, pieces) for pair in plan.pairs if (pieces := _selected(plan, pair, selection))]
    pages = _resolve(plan, work, src, dst)
    batches: dict[tuple, list] = {}
    for pair, pieces in work:
        rr, lr = plan.remote.region(pair.remote_region), plan.local.region(pair.local_region)
        group = pages.get((pair.remote_group, pair.local_group))
        if group is None or not group.ordinals.size:
            continue
        runs = _runs(pair, pieces, group, rr, lr)
        if runs[0].size:
            batches.setdefault((rr.kind, lr.kind), []).append((runs, rr.device_id, lr.device_id))
    return [_batch(kinds, tables) for kinds, tables in batches.items()]


# ------------------------------------------------------------------ validation
def _check_selection(plan: TransferPlan, selection: RowSelection) -> None:
    plan.remote.check_selection(selection)
    if selection.mode is SelectionMode.NAMED:
        readable = {p.buffer for pair in plan.pairs for p in pair.pieces} | set(plan.read_elsewhere)
        missing = [n for n in selection.names if n not in readable]
        if missing:
            raise LayoutError(f"selection: remote buffers {missing} have no local counterpart in this plan "
                              f"(uncovered local layers {list(plan.uncovered)})")


def _selected(plan: TransferPlan, pair: RegionPair, selection: RowSelection) -> list[Piece]:
    """The pair's pieces for ``selection``, sorted by (sub, src_offset) and merged."""
    if selection.mode is SelectionMode.ALL:
        if pair.whole_slot:
            stride = plan.remote.region(pair.remote_region).page_stride
            return [Piece("", 0, 0, stride)]
        return merge_pieces(list(pair.pieces))
    names = set(selection.names)
    return merge_pieces([p for p in pair.pieces if p.buffer in names])


def _resolve(plan: TransferPlan, work, src: Mapping[str, GroupPages], dst: Mapping[str, np.ndarray]) -> dict:
    """Check every input against the plan before any descriptor is computed."""
    _check_names("src", src, plan.remote.groups)
    _check_names("dst", dst, plan.local.groups)
    resolved: dict[tuple[str, str], _Pages] = {}
    for pair, _ in work:
        key = (pair.remote_group, pair.local_group)
        if pair.remote_group not in src:
            continue
        if key not in resolved:
            resolved[key] = _group_pages(plan, pair, src, dst)
        group = resolved[key]
        if group.ordinals.size:
            _check_slots("src", pair.remote_group, group.src_bounds, plan.remote.region(pair.remote_region))
            _check_slots("dst", pair.local_group, group.dst_bounds, plan.local.region(pair.local_region))
    return resolved


def _check_names(side: str, given: Mapping, groups: Mapping) -> None:
    unknown = sorted(set(given) - set(groups))
    if unknown:
        raise LayoutError(f"{side}: unknown groups {unknown}; the layout has {sorted(groups)}")


def _group_pages(plan: TransferPlan, pair: RegionPair, src: Mapping[str, GroupPages],
                 dst: Mapping[str, np.ndarray]) -> _Pages:
    rg, lg = pair.remote_group, pair.local_group
    if lg not in dst:
        raise LayoutError(f"dst: no page table for local group {lg!r}, which receives remote group {rg!r}")
    pages = src[rg]
    if not isinstance(pages, GroupPages):
        raise LayoutError(f"src[{rg!r}]: expected GroupPages, got {type(pages).__name__}")
    table = np.asarray(dst[lg])
    if table.ndim != 1 or table.dtype.kind not in "iu":
        raise PageRangeError(f"dst[{lg!r}]: expected a 1-D integer array, got {table.dtype} {table.shape}")
    tokens = pages.token_pages
    if plan.local.groups[lg].recurrent:
        if table.size != 1:
            raise PageRangeError(f"dst[{lg!r}]: a recurrent group has one row, got {table.size} entries")
        if tokens.size and tokens[-1] != 0:
            raise PageRangeError(f"src[{rg!r}]: recurrent state is token page 0 only, got {tokens.tolist()}")
    m, s = pair.remote_per_local, pair.local_per_remote
    if tokens.size and (tokens[-1] // m) * s + s > table.size:
        raise PageRangeError(
            f"src[{rg!r}]: remote token page {int(tokens[-1])} maps to local token page "
            f"{int((tokens[-1] // m) * s + s - 1)}, beyond dst[{lg!r}] of {table.size} pages")
    local = table.astype(np.int64)[(tokens // m)[:, None] * s + np.arange(s)]
    return _Pages(tokens, pages.ordinals, local)


def _check_slots(side: str, group: str, bounds: tuple[int, int], region: MemoryRegion) -> None:
    low, high = bounds
    if low < 0 or high >= region.num_pages:
        bad = low if low < 0 else high
        raise PageRangeError(f"{side}[{group!r}]: slot {bad} is outside region {region.name!r} "
                             f"of {region.num_pages} pages")


# ------------------------------------------------------------------ descriptors
def _runs(pair: RegionPair, pieces: list[Piece], group: _Pages, rr: MemoryRegion,
          lr: MemoryRegion) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(remote address, local address, length) of the maximal runs of one region pair."""
    m = pair.remote_per_local
    if m == 1 and len(pieces) == 1:
        # One piece per page: pages join only if the piece is the whole slot on both sides and the
        # slots are consecutive on both sides, which every region pair of the group shares.
        p = pieces[0]
        if p.length == rr.page_stride == lr.page_stride:
            src_slots, dst_slots, counts = group.slot_runs
            lengths = counts * _U64(p.length)
        else:
            src_slots, dst_slots = group.src_slots, group.dst_slots[:, 0]
            lengths = np.full(src_slots.size, p.length, dtype=_U64)
        return (_U64(rr.address + p.src_offset) + src_slots * _U64(rr.page_stride),
                _U64(lr.address + p.dst_offset) + dst_slots * _U64(lr.page_stride), lengths)
    src_base = _U64(rr.address) + group.src_slots * _U64(rr.page_stride)
    if m == 1:
        ordered = sorted(pieces, key=lambda p: p.src_offset)
        src_off, dst_off, length, sub = (np.array(col, dtype=_U64) for col in zip(
            *[(p.src_offset, p.dst_offset, p.length, p.sub) for p in ordered]))
        dst_slots = group.dst_slots[:, sub.astype(np.intp)]
        src = (src_base[:, None] + src_off).ravel()
        dst = (_U64(lr.address) + dst_slots * _U64(lr.page_stride) + dst_off).ravel()
        lengths = np.broadcast_to(length, dst_slots.shape).ravel()
    else:
        # Several remote pages fill one local page: each page takes its phase's pieces.
        phases = [sorted((p for p in pieces if p.sub == q), key=lambda p: p.src_offset) for q in range(m)]
        width = max(len(ph) for ph in phases)
        table = np.zeros((3, m, width), dtype=_U64)
        valid = np.zeros((m, width), dtype=bool)
        for q, ph in enumerate(phases):
            for i, p in enumerate(ph):
                table[:, q, i] = (p.src_offset, p.dst_offset, p.length)
                valid[q, i] = True
        phase = group.token_pages % m
        dst_base = _U64(lr.address) + group.dst_slots[:, 0] * _U64(lr.page_stride)
        keep = valid[phase].ravel()
        src = (src_base[:, None] + table[0][phase]).ravel()[keep]
        dst = (dst_base[:, None] + table[1][phase]).ravel()[keep]
        lengths = table[2][phase].ravel()[keep]
    return _coalesce(src, dst, lengths)


def _coalesce(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray):
    """Merge neighbours contiguous on both sides into maximal runs."""
    if not src.size:
        return src, dst, lengths
    brk = np.ones(src.size, dtype=bool)
    brk[1:] = (src[:-1] + lengths[:-1] != src[1:]) | (dst[:-1] + lengths[:-1] != dst[1:])
    starts = np.flatnonzero(brk)
    return src[starts], dst[starts], np.add.reduceat(lengths, starts)


def _batch(kinds, tables) -> ReadBatch:
    """Concatenate region pairs, merging a pair's first run into the previous pair's last."""
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, int, int]] = []
    for (src, dst, lengths), src_dev, dst_dev in tables:
        if parts and parts[-1][3:] == (src_dev, dst_dev):
            ps, pd, pl = parts[-1][:3]
            if ps[-1] + pl[-1] == src[0] and pd[-1] + pl[-1] == dst[0]:
                pl[-1] += lengths[0]
                src, dst, lengths = src[1:], dst[1:], lengths[1:]
        if src.size:
            parts.append((src, dst, lengths, src_dev, dst_dev))
    n = sum(p[0].size for p in parts)
    remote, local = np.empty((n, 3), dtype=_U64), np.empty((n, 3), dtype=_U64)
    at = 0
    for src, dst, lengths, src_dev, dst_dev in parts:
        rows = slice(at, at + src.size)
        remote[rows, 0], remote[rows, 1], remote[rows, 2] = src, lengths, src_dev
        local[rows, 0], local[rows, 1], local[rows, 2] = dst, lengths, dst_dev
        at += src.size
    return ReadBatch(kinds[0], kinds[1], remote, local)
