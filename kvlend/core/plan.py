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
from typing import Mapping

import numpy as np

from ..errors import LayoutError, PageRangeError
from .layout import MemoryKind, MemoryRegion, RowSelection, SelectionMode
from .negotiate import Piece, RegionPair, TransferPlan, merge_pieces
from .pages import GroupPages, int_array
from .plan_lists import small_reads
from .reads import ReadBatch

_U64 = np.uint64
# Descriptors of one segment: (src, dst, length) columns, and (rows, src device, dst device) per region pair.
_Columns = tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int, int]]]


class _Pages:
    """One (remote group, local group) pair's pages, validated once and shared by its region pairs."""

    def __init__(self, token_pages: np.ndarray, ordinals: np.ndarray, local: np.ndarray) -> None:
        self.token_pages = token_pages  # remote token pages, int64 (P,)
        self.ordinals = ordinals  # remote slots, int64 (P,)
        self.local = local  # local slots, int64 (P, local_per_remote), or (P, 1) when pages merge
        self.src_slots = ordinals.astype(_U64)
        self.dst_slots = local.astype(_U64)

    @property
    def src_bounds(self) -> tuple[int, int]:
        return int(self.ordinals.min()), int(self.ordinals.max())

    @property
    def dst_bounds(self) -> tuple[int, int]:
        return int(self.local.min()), int(self.local.max())

    def fits(self, src_pages: int, dst_pages: int) -> bool:
        """Every slot is in ``[0, pages)`` on its side (as uint64, a negative slot is huge)."""
        return bool(self.src_slots.max() < src_pages) and bool(self.dst_slots.max() < dst_pages)


@dataclass(frozen=True, eq=False)
class _Work:
    """What one region pair reads under one selection."""

    order: int  # position among the selection's region pairs
    pair: RegionPair
    pieces: tuple[Piece, ...]
    remote: MemoryRegion
    local: MemoryRegion

    @property
    def key(self) -> tuple[str, str]:
        return self.pair.remote_group, self.pair.local_group

    def columns(self, group: _Pages) -> _Columns:
        src, dst, lengths = _runs(self.pair, list(self.pieces), group, self.remote, self.local)
        return src, dst, lengths, [(src.size, self.remote.device_id, self.local.device_id)]


@dataclass(frozen=True, eq=False)
class _Block:
    """Consecutive region pairs of a batch with one piece and one local page per remote page that
    share a group's pages: computed in one vectorised step, one descriptor per page per pair
    (``_batch`` joins whole slots consecutive on both sides into runs)."""

    order: int
    key: tuple[str, str]
    table: np.ndarray  # uint64 (pairs, 5): src base, src stride, dst base, dst stride, length
    devices: tuple[tuple[int, int], ...]  # (src, dst) device per pair

    def columns(self, group: _Pages) -> _Columns:
        """(src, dst, length) of every descriptor, pair by pair, and (rows, src device, dst device) per pair."""
        t, n = self.table, group.src_slots.size
        src = (t[:, 0:1] + group.src_slots * t[:, 1:2]).ravel()
        dst = (t[:, 2:3] + group.dst_slots[:, 0] * t[:, 3:4]).ravel()
        return src, dst, np.repeat(t[:, 4], n), [(n, *d) for d in self.devices]


@dataclass(frozen=True, eq=False)
class _Spec:
    """Everything about a (plan, selection) that does not depend on the pages: built once, cached."""

    work: tuple[_Work, ...]  # the selection's region pairs, plan order
    groups: tuple[tuple[tuple[str, str], RegionPair, int, int], ...]  # key, first pair, fewest pages (src, dst)
    batches: tuple[tuple[tuple[MemoryKind, MemoryKind], tuple], ...]  # kinds -> _Block | _Work segments
    lists: bool  # one batch of _Blocks only: short leases take plan_lists' path


_CACHE_SIZE = 64
_spec_cache: dict[tuple[int, RowSelection], tuple[TransferPlan, _Spec]] = {}


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
    spec = _spec(plan, selection)
    if spec.lists:
        small = small_reads(plan, spec, src, dst)
        if small is not None:
            return small
    pages = _resolve(plan, spec, src, dst)
    out = []
    for kinds, segments in spec.batches:
        parts: list[_Columns] = []
        first = 0  # the order of the first segment with reads
        for seg in segments:
            group = pages.get(seg.key)
            if group is None or not group.ordinals.size:
                continue
            cols = seg.columns(group)
            if cols[0].size:
                if not parts:
                    first = seg.order
                parts.append(cols)
        if parts:
            out.append((first, _batch(kinds, parts)))
    return [batch for _, batch in sorted(out, key=lambda item: item[0])]


def _spec(plan: TransferPlan, selection: RowSelection) -> _Spec:
    """Validate ``selection`` and lay out the work; once per (plan, selection)."""
    cache_key = (id(plan), selection)
    hit = _spec_cache.get(cache_key)
    if hit is not None and hit[0] is plan:  # the cache holds the plan, so its id is not reused meanwhile
        return hit[1]
    _check_selection(plan, selection)
    work: list[_Work] = []
    for pair in plan.pairs:
        pieces = _selected(plan, pair, selection)
        if pieces:
            rr, lr = plan.remote.region(pair.remote_region), plan.local.region(pair.local_region)
            work.append(_Work(len(work), pair, tuple(pieces), rr, lr))
    groups: dict[tuple[str, str], list] = {}
    batches: dict[tuple[MemoryKind, MemoryKind], list] = {}
    for w in work:
        g = groups.setdefault(w.key, [w.key, w.pair, w.remote.num_pages, w.local.num_pages])
        g[2], g[3] = min(g[2], w.remote.num_pages), min(g[3], w.local.num_pages)
        segments = batches.setdefault((w.remote.kind, w.local.kind), [])
        if w.pair.remote_per_local != 1 or len(w.pieces) != 1:
            segments.append(w)
            continue
        p = w.pieces[0]
        row = (w.remote.address + p.src_offset, w.remote.page_stride, w.local.address + p.dst_offset,
               w.local.page_stride, p.length)
        if not (segments and isinstance(segments[-1], list) and segments[-1][1] == w.key):
            segments.append([w.order, w.key, [], []])
        segments[-1][2].append(row)
        segments[-1][3].append((w.remote.device_id, w.local.device_id))
    laid_out = tuple((kinds, tuple(s if isinstance(s, _Work) else _Block(s[0], s[1], np.array(s[2], dtype=_U64),
                                                                          tuple(s[3])) for s in segs))
                     for kinds, segs in batches.items())
    lists = len(laid_out) == 1 and all(isinstance(s, _Block) for s in laid_out[0][1])
    spec = _Spec(tuple(work), tuple(tuple(g) for g in groups.values()), laid_out, lists)
    if len(_spec_cache) >= _CACHE_SIZE:
        _spec_cache.clear()
    _spec_cache[cache_key] = (plan, spec)
    return spec


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


def _resolve(plan: TransferPlan, spec: _Spec, src: Mapping[str, GroupPages],
             dst: Mapping[str, np.ndarray]) -> dict[tuple[str, str], _Pages]:
    """Check every input against the plan before any descriptor is computed.

    Each group's slots are checked against the smallest region it reads from or
    into; if that fails, ``_resolve_pairs`` finds the error pair by pair.
    """
    _check_names("src", src, plan.remote.groups)
    _check_names("dst", dst, plan.local.groups)
    resolved: dict[tuple[str, str], _Pages] = {}
    for key, pair, src_pages, dst_pages in spec.groups:
        if pair.remote_group not in src:
            continue
        group = resolved[key] = _group_pages(plan, pair, src, dst)
        if group.ordinals.size and not group.fits(src_pages, dst_pages):
            _resolve_pairs(plan, spec.work, src, dst)
    return resolved


def _resolve_pairs(plan: TransferPlan, work: tuple[_Work, ...], src: Mapping[str, GroupPages],
                   dst: Mapping[str, np.ndarray]) -> None:
    """Check the inputs pair by pair in plan order, raising the first error."""
    resolved: dict[tuple[str, str], _Pages] = {}
    for w in work:
        pair = w.pair
        if pair.remote_group not in src:
            continue
        group = resolved.get(w.key)
        if group is None:
            group = resolved[w.key] = _group_pages(plan, pair, src, dst)
        if group.ordinals.size:
            _check_slots("src", pair.remote_group, group.src_bounds, w.remote)
            _check_slots("dst", pair.local_group, group.dst_bounds, w.local)


def _check_names(side: str, given: Mapping, groups: Mapping) -> None:
    if type(given) is dict and given.keys() <= groups.keys():  # the common case, without building sets
        return
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
    table = int_array(f"dst[{lg!r}]", dst[lg])
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
    if m == s == 1:
        local = table[tokens][:, None]
    else:
        local = table[(tokens // m)[:, None] * s + np.arange(s)]
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
    """(remote address, local address, length) of every piece of every page of one region pair with
    several pieces, or several remote pages per local page (one piece per page is a ``_Block``);
    ``_batch`` joins them into maximal runs."""
    m = pair.remote_per_local
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
    return src, dst, lengths


def _batch(kinds: tuple[MemoryKind, MemoryKind], parts: list[_Columns]) -> ReadBatch:
    """Concatenate the region pairs' descriptors in plan order and merge neighbours contiguous on
    both sides (and on the same devices) into maximal runs."""
    if len(parts) == 1:
        src, dst, lengths, devices = parts[0]
    else:
        src, dst, lengths = (np.concatenate(col) for col in list(zip(*parts))[:3])
        devices = [d for p in parts for d in p[3]]
    brk = np.empty(src.size, dtype=bool)
    brk[0] = True
    np.not_equal(src[:-1] + lengths[:-1], src[1:], out=brk[1:])
    brk[1:] |= dst[:-1] + lengths[:-1] != dst[1:]
    src_dev: np.ndarray | int  # per descriptor, or one for all
    dst_dev: np.ndarray | int
    if any(d[1:] != devices[0][1:] for d in devices):
        counts = [d[0] for d in devices]
        src_dev = np.repeat(np.array([d[1] for d in devices], dtype=_U64), counts)
        dst_dev = np.repeat(np.array([d[2] for d in devices], dtype=_U64), counts)
        brk[1:] |= (src_dev[1:] != src_dev[:-1]) | (dst_dev[1:] != dst_dev[:-1])
    else:
        src_dev, dst_dev = devices[0][1], devices[0][2]
    starts = np.flatnonzero(brk)
    if starts.size < src.size:
        lengths = np.add.reduceat(lengths, starts)
        src, dst = src[starts], dst[starts]
        if isinstance(src_dev, np.ndarray) and isinstance(dst_dev, np.ndarray):  # set together
            src_dev, dst_dev = src_dev[starts], dst_dev[starts]
    remote, local = np.empty((src.size, 3), dtype=_U64), np.empty((src.size, 3), dtype=_U64)
    remote[:, 0], remote[:, 1], remote[:, 2] = src, lengths, src_dev
    local[:, 0], local[:, 1], local[:, 2] = dst, lengths, dst_dev
    return ReadBatch._planned(kinds[0], kinds[1], remote, local)
