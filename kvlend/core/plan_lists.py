"""The planner's small-request path: a short lease planned on plain Python lists.

numpy costs about a microsecond a call whatever the size, and several after the copy of the
previous request has pushed it out of the CPU caches; a 16-page lease makes some thirty such
calls in ``plan._resolve``, ``_Block.columns`` and ``_batch``.  For a lease of at most
``SMALL_PAGES`` pages whose region pairs all have one piece and equal page sizes on both sides
(``_Block`` segments with one local page per remote page, the common layout), this module
computes the same descriptors with list arithmetic and builds the output in one numpy call.
It returns None for anything else, including any input the vectorised path would refuse, which
then runs and raises its own error.
Property tests check both paths give the same batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from .negotiate import TransferPlan
from .pages import GroupPages
from .reads import ReadBatch

if TYPE_CHECKING:  # plan imports this module
    from .plan import _Spec

# Measured on 2 vCPUs, 16 fragmented pages over K and V (12 descriptors): 15 against 20 us warm,
# 34 against 46 us after an 8 MiB copy; at 24 pages (26 descriptors) the vectorised path is ahead.
SMALL_PAGES = 16


def small_reads(plan: TransferPlan, spec: _Spec, src: Mapping[str, GroupPages],
                dst: Mapping[str, np.ndarray]) -> list[ReadBatch] | None:
    """The batches ``plan.plan_reads`` would return, or None where this path does not apply.

    The caller checked that ``spec`` has one batch of ``_Block`` segments only (``spec.lists``).
    """
    if not isinstance(src, Mapping) or not isinstance(dst, Mapping):
        return None
    kinds, segments = spec.batches[0]
    if not src.keys() <= plan.remote.groups.keys() or not dst.keys() <= plan.local.groups.keys():
        return None
    pages: dict[tuple[str, str], tuple[list[int], list[int]]] = {}  # remote and local slot per page read
    for key, pair, src_pages, dst_pages in spec.groups:
        rg, lg = key
        if rg not in src:
            continue
        lease_pages, table = src[rg], dst.get(lg)
        if (type(lease_pages) is not GroupPages or type(table) is not np.ndarray or table.ndim != 1
                or table.dtype != np.int64 or pair.local_per_remote != 1 or plan.local.groups[lg].recurrent):
            return None
        tokens = lease_pages.token_pages
        if tokens.size > SMALL_PAGES or (tokens.size and tokens[-1] >= table.size):
            return None
        ordinals = lease_pages.ordinals.tolist()
        slots = table.tolist()
        into = [slots[t] for t in tokens.tolist()]
        if ordinals and (min(ordinals) < 0 or max(ordinals) >= src_pages
                         or min(into) < 0 or max(into) >= dst_pages):
            return None
        pages[key] = (ordinals, into)
    remote: list[tuple[int, int, int]] = []  # (address, length, device) per descriptor
    local: list[tuple[int, int, int]] = []
    for seg in segments:
        group = pages.get(seg.key)
        if not group or not group[0]:
            continue
        ordinals, slots = group
        runs: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}  # (remote, local slot, pages) per run
        for (src_base, src_stride, dst_base, dst_stride, length), (src_dev, dst_dev) in zip(
                seg.table.tolist(), seg.devices):
            shape = (src_stride, dst_stride, length)
            if shape not in runs:
                runs[shape] = [(ordinals[i], slots[i], n) for i, n in _runs(ordinals, slots, *shape)]
            start = len(remote)
            remote += [(src_base + o * src_stride, n * length, src_dev) for o, _, n in runs[shape]]
            local += [(dst_base + d * dst_stride, n * length, dst_dev) for _, d, n in runs[shape]]
            if start:  # the pair's first run may continue the row before it
                (ps, pn, pdev), (ls, _, ldev), (s, n, _), (t, _, _) = remote[start - 1], local[start - 1], \
                    remote[start], local[start]
                if ps + pn == s and ls + pn == t and (pdev, ldev) == (src_dev, dst_dev):
                    remote[start - 1:start + 1] = [(ps, pn + n, pdev)]
                    local[start - 1:start + 1] = [(ls, pn + n, ldev)]
    if not remote:
        return []
    table = np.array((remote, local), dtype=np.uint64)
    return [ReadBatch._planned(kinds[0], kinds[1], table[0], table[1])]


def _runs(ordinals: list[int], local: list[int], src_stride: int, dst_stride: int,
          length: int) -> list[tuple[int, int]]:
    """(first page, pages) of each maximal run of pages whose pieces are adjacent on both sides."""
    breaks = [i for i, (a, b, c, d) in enumerate(zip(ordinals, ordinals[1:], local, local[1:]), 1)
              if (b - a) * src_stride != length or (d - c) * dst_stride != length]
    starts = [0, *breaks]
    return [(first, end - first) for first, end in zip(starts, [*breaks, len(ordinals)])]
