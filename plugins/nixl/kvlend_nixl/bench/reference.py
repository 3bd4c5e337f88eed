"""kvlend's own read in process, sized like a request measured elsewhere (inside vLLM): the yardstick
``scripts/vllm-bench`` sets its read times against, timed on the same host in the same run."""

from __future__ import annotations

import os

import numpy as np

from ..backend import NixlBackend
from .lender_process import LenderProcess
from .pools import PAGE_BYTES, TPP
from .reader import Reader
from .timing import XFER_TIMEOUT, side_by_side, stats


def in_process_read(nbytes: int, descriptors: int, reps: int = 20) -> dict:
    """p50 of ``Reader.kvlend`` (lend, plan, post, poll, tracker, release; two agents, two processes)
    reading about ``nbytes`` laid out as ``descriptors`` contiguous runs: K and V regions of
    ``descriptors // 2`` layers, one lease of contiguous pages in each (so one descriptor per region)."""
    layers = max(1, descriptors // 2)
    pages = max(1, round(nbytes / (2 * layers * PAGE_BYTES)))
    slots = np.arange(pages, dtype=np.int64)
    lender = LenderProcess()
    backend = NixlBackend(f"bench-reference-{os.getpid()}", timeout=XFER_TIMEOUT)
    try:
        reader = Reader(lender, backend, pages, layers, False, 0)
        try:
            times = side_by_side({"kvlend": lambda: reader.kvlend(slots, slots, pages * TPP)}, reps, warmup=3)
            result = stats(times["kvlend"], pages * 2 * layers * PAGE_BYTES)
            result["verified"] = reader.verified(lambda: reader.kvlend(slots, slots, pages * TPP), slots, slots)
        finally:
            reader.close()
    finally:
        backend.close()
        lender.close()
    return {**result, "bytes": pages * 2 * layers * PAGE_BYTES, "descriptors": 2 * layers}
