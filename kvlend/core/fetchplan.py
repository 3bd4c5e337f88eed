"""What one fetch reads: a lease's pages split into chunks, mapped to local pages.

Pure functions of a ``TransferPlan`` and an offer's pages (remote group ->
``GroupPages``): which local token pages the tracker waits for, which remote
pages a resume may skip, how the reads split into posted chunks of whole
pages on both sides, and how many page-table entries the destination needs.
Integer page-size ratios only (``negotiate`` refuses anything else).

A lease holds what a decoder reads by the *remote* layout; the local group
may read less (a smaller window, fewer sinks, a smaller kept window).  Only
remote pages holding tokens of local pages the local group reads are read,
and a local page counts only when the pages given hold all of its tokens
below ``num_tokens`` (``negotiate`` refuses pairs where a lease cannot).

Page ratios work in *spans* of ``max(remote, local)`` tokens per page: a span
holds whole pages on both sides, so chunks and resume skips are cut at span
boundaries.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .negotiate import TransferPlan
from .pages import GroupPages


def local_pages(remote_pages: np.ndarray, rtpp: int, ltpp: int, num_tokens: int) -> np.ndarray:
    """Local token pages whose every token below ``num_tokens`` ``remote_pages`` hold (sorted).

    A big remote page holds several local pages (clipped at ``num_tokens``);
    a big local page needs all its small remote pages that exist.
    """
    if rtpp >= ltpp:
        k = rtpp // ltpp
        pages = (remote_pages[:, None] * k + np.arange(k)[None, :]).reshape(-1)
        return pages[pages < -(-num_tokens // ltpp)]
    k = ltpp // rtpp
    local, have = np.unique(remote_pages // k, return_counts=True)
    want = np.minimum(local * k + k, -(-num_tokens // rtpp)) - local * k
    return local[have == want]


def _holding(remote_pages: np.ndarray, local: np.ndarray, rtpp: int, ltpp: int) -> np.ndarray:
    """Mask of ``remote_pages`` that hold tokens of the local pages ``local``."""
    if rtpp >= ltpp:
        return np.isin(remote_pages, local // (rtpp // ltpp))
    return np.isin(remote_pages // (ltpp // rtpp), local)


def _read(plan: TransferPlan, rg: str, gp: GroupPages, num_tokens: int) -> tuple[GroupPages, np.ndarray]:
    """The pages of remote group ``rg`` worth reading, and the local pages they complete.

    Local pages are those the local group reads at ``num_tokens`` and ``gp`` holds whole.
    """
    lg = plan.group_map[rg]
    if plan.remote.groups[rg].recurrent:
        return gp, np.zeros(min(len(gp), 1), dtype=np.int64)
    rtpp, ltpp = plan.remote.tokens_per_page, plan.local.tokens_per_page
    reads = plan.local.groups[lg].pages_read(num_tokens, ltpp)
    if rtpp == ltpp and len(reads) == len(gp) and np.array_equal(reads, gp.token_pages):
        return gp, gp.token_pages  # the common case: the lease holds exactly the pages this group reads
    local = np.intersect1d(reads, local_pages(gp.token_pages, rtpp, ltpp, num_tokens), assume_unique=True)
    keep = _holding(gp.token_pages, local, rtpp, ltpp)
    return (gp if keep.all() else gp.select(keep)), local


def rows_read(plan: TransferPlan, pages: Mapping[str, GroupPages], num_tokens: int) -> dict[str, np.ndarray]:
    """Per remote group, the token pages of ``pages`` worth reading (those ``needed_pages`` counts).

    A progressive lease's reader reads these once; a remote page left out (it holds part of a local
    page whose other part is not lent yet) is read once a later extension completes that page.
    """
    return {rg: _read(plan, rg, gp, num_tokens)[0].token_pages for rg, gp in pages.items() if rg in plan.group_map}


def needed_pages(plan: TransferPlan, pages: Mapping[str, GroupPages], num_tokens: int) -> dict[str, np.ndarray]:
    """Per local group, the local token pages that reading ``pages`` delivers (every group keyed)."""
    needed = {name: np.zeros(0, dtype=np.int64) for name in plan.local.groups}
    for rg, gp in pages.items():
        if rg in plan.group_map:
            needed[plan.group_map[rg]] = _read(plan, rg, gp, num_tokens)[1]
    return needed


def skip_below(plan: TransferPlan, pages: Mapping[str, GroupPages], num_tokens: int,
               bound: int) -> tuple[dict[str, GroupPages], dict[str, np.ndarray]]:
    """``pages`` worth reading minus the spans wholly below ``bound``, and the local pages skipped.

    A resume skips whole spans only, so no local page is left half read, and
    the skipped local pages (verified by an earlier read) are never written
    again.  Recurrent state is valid only whole, at the end, so it is always read.
    """
    span = max(plan.remote.tokens_per_page, plan.local.tokens_per_page)
    ltpp = plan.local.tokens_per_page
    rest, kept = {}, {}
    for rg, gp in pages.items():
        lg = plan.group_map.get(rg)
        if lg is None or plan.remote.groups[rg].recurrent:
            rest[rg] = gp
            continue
        gp, local = _read(plan, rg, gp, num_tokens)
        below = (local * ltpp // span + 1) * span <= bound
        rest[rg] = gp.select(_holding(gp.token_pages, local[~below], plan.remote.tokens_per_page, ltpp))
        if below.any():
            kept[lg] = local[below]
    return rest, kept


def split_chunks(plan: TransferPlan, pages: Mapping[str, GroupPages], num_tokens: int,
                 chunk_pages: int) -> list[tuple[dict[str, GroupPages], dict[str, np.ndarray]]]:
    """Split the ``pages`` worth reading into chunks of whole pages on both sides.

    Each chunk is (remote pages, the local pages they complete); a chunk spans
    ``chunk_pages`` spans; recurrent state rows go in the last chunk.
    """
    rtpp = plan.remote.tokens_per_page
    span = chunk_pages * max(rtpp, plan.local.tokens_per_page)  # tokens per chunk, page-aligned both sides
    n_chunks = max(1, -(-num_tokens // span))
    chunks: list[tuple[dict, dict]] = [({}, {}) for _ in range(n_chunks)]
    for rg, gp in pages.items():
        lg = plan.group_map.get(rg)
        if lg is None:
            continue
        gp, local = _read(plan, rg, gp, num_tokens)
        if not len(gp):
            continue
        if plan.remote.groups[rg].recurrent:
            chunks[-1][0][rg], chunks[-1][1][lg] = gp, local
            continue
        first, last = int(gp.token_pages[0]) * rtpp // span, int(gp.token_pages[-1]) * rtpp // span
        if first == last:  # the usual short lease: one chunk
            chunks[first][0][rg], chunks[first][1][lg] = gp, local
            continue
        which = gp.token_pages * rtpp // span  # non-decreasing: token pages are sorted
        where = local * plan.local.tokens_per_page // span
        for c in np.unique(which).tolist():
            lo, hi = np.searchsorted(which, [c, c + 1])
            chunks[c][0][rg] = gp if hi - lo == len(gp) else GroupPages._checked(
                gp.token_pages[lo:hi].copy(), gp.ordinals[lo:hi].copy())
            chunks[c][1][lg] = local[slice(*np.searchsorted(where, [c, c + 1]))]
    return [c for c in chunks if c[0]]


def destination_pages(plan: TransferPlan, num_tokens: int,
                      pages: Mapping[str, GroupPages] | None = None) -> dict[str, int]:
    """Entries each local group's destination page table needs for ``plan_reads`` (recurrent: 1).

    ``ceil(num_tokens / local tokens per page)``, except that a remote page
    larger than a local page lands whole, as ``k`` local pages: the table then
    reaches the end of the last remote page read, past ``num_tokens`` (pages
    decode fills next).  Every local page inside a remote page read is
    written, even one the local group does not read, so its entry must be a
    slot.  With ``pages`` (an offer's), the count covers what reading them
    writes; without, what a whole lease at ``num_tokens`` writes.
    """
    rtpp, ltpp = plan.remote.tokens_per_page, plan.local.tokens_per_page
    out = {name: 1 if g.recurrent else -(-num_tokens // ltpp) for name, g in plan.local.groups.items()}
    if rtpp <= ltpp:
        return out
    for rg, lg in plan.group_map.items():
        if plan.remote.groups[rg].recurrent or (pages is not None and rg not in pages):
            continue
        if pages is None:
            end = -(-num_tokens // rtpp)
        else:
            read = _read(plan, rg, pages[rg], num_tokens)[0].token_pages
            end = int(read[-1]) + 1 if read.size else 0
        out[lg] = max(out[lg], end * (rtpp // ltpp))
    return out
