"""Scenario 1: one large contiguous lease read by kvlend, by raw NIXL (one descriptor) and by memcpy,
at each size (a short prompt's cache and a long one's)."""

from __future__ import annotations

from functools import partial

import numpy as np

from ..lender_process import LenderProcess
from ..pools import PAGE_BYTES, TPP, descriptor_rows
from ..reader import Reader
from ..sizes import Sizes
from ..timing import ratio, side_by_side, stats

# kvlend/raw at least: a small read leaves more room for per-request overhead to show
TARGETS = {8 << 20: 0.90, 256 << 20: 0.97}


def run(lender: LenderProcess, backend, sizes: Sizes, progress) -> dict:
    return {"name": "large contiguous read",
            "requests": [_one(lender, backend, nbytes, sizes.reps, progress) for nbytes in sizes.s1_bytes]}


def _one(lender: LenderProcess, backend, nbytes: int, reps: int, progress) -> dict:
    pages = nbytes // (2 * PAGE_BYTES)
    reader = Reader(lender, backend, pages, 1, True, 0)
    nbytes = pages * 2 * PAGE_BYTES
    slots = np.arange(pages, dtype=np.int64)
    try:
        local, remote = reader.descriptors(slots, slots, pages * TPP)
        one_l = descriptor_rows(np.array([reader.local.regions[0].address]), np.array([nbytes]))
        one_r = descriptor_rows(np.array([reader.remote.regions[0].address]), np.array([nbytes]))
        methods = {"kvlend": lambda: reader.kvlend(slots, slots, pages * TPP),
                   "raw_nixl": lambda: reader.raw(one_l, one_r),
                   "memcpy": partial(np.copyto, np.empty(nbytes, np.uint8), np.ones(nbytes, np.uint8))}
        progress(f"scenario 1: {nbytes >> 20} MiB as one lease: kvlend, raw NIXL (one descriptor), memcpy, "
                 f"{reps} rounds")
        times = side_by_side(methods, reps, warmup=2)
        kv, raw, mem = (stats(times[k], nbytes) for k in methods)
        del methods["memcpy"]  # free its two buffers before verifying
        kv["descriptors"] = len(local)
        kv["verified"] = reader.verified(methods["kvlend"], slots, slots)
        raw["verified"] = reader.verified(methods["raw_nixl"], slots, slots)
    finally:
        reader.close()
    floor = TARGETS.get(nbytes, 0.90)
    return {
        "bytes": nbytes, "label": f"{nbytes >> 20} MiB",
        "results": {"kvlend": kv, "raw_nixl": raw, "memcpy": mem},
        "ratios": {"kvlend/raw": ratio(kv, raw), "kvlend/memcpy": ratio(kv, mem)},
        "targets": {f"kvlend/raw >= {floor:.2f}": ratio(kv, raw) >= floor},
    }
