"""Scenario 1: one large contiguous lease read by kvlend, by raw NIXL (one descriptor) and by memcpy,
at each size (a short prompt's cache and a long one's).  Over tcp also through a DecodeNode, with and
without the read window (``kvlend.core.tcpwindow``), whose pieces a lease this large goes in."""

from __future__ import annotations

import os
import tempfile
from functools import partial

import numpy as np

from kvlend.protocol.config import NodeConfig

from ...backend import NixlBackend
from ..lender_process import LenderProcess
from ..pools import GROUP, PAGE_BYTES, TPP, descriptor_rows
from ..reader import Reader
from ..sizes import Sizes
from ..timing import XFER_TIMEOUT, BenchError, ratio, side_by_side, stats

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
        windowed = backend.read_window is not None and backend.read_window_local  # the lender is on this host
        nodes = _through_nodes(lender, reader, slots, reps, progress) if windowed else {}
    finally:
        reader.close()
    floor = TARGETS.get(nbytes, 0.90)
    return {
        "bytes": nbytes, "label": f"{nbytes >> 20} MiB",
        "results": {"kvlend": kv, "raw_nixl": raw, "memcpy": mem, **nodes},
        "ratios": {"kvlend/raw": ratio(kv, raw), "kvlend/memcpy": ratio(kv, mem),
                   **{f"{k}/raw": ratio(r, raw) for k, r in nodes.items()}},
        "targets": {f"kvlend/raw >= {floor:.2f}": ratio(kv, raw) >= floor},
    }


def _through_nodes(lender: LenderProcess, reader: Reader, slots: np.ndarray, reps: int, progress) -> dict:
    """The same lease fetched by a DecodeNode from a PrefillNode in the lender process, with the tcp read
    window and without it (its cost), timed round-robin; each fetch redeems a ticket of its own."""
    from kvlend.runtime import DecodeNode
    from kvlend.security.certs import Authority, save_rank

    nbytes = len(slots) * 2 * PAGE_BYTES
    kinds = {"kvlend_node": True, "kvlend_node_no_window": False}
    ca = Authority.create()
    with tempfile.TemporaryDirectory(prefix="kvlend-bench-") as certs:
        tickets = iter(lender.call("tickets", {
            "credentials": save_rank(ca.issue("bench-prefill-s1", "prefill"), certs),
            "requests": [slots] * ((reps + 3) * len(kinds))}))
    progress(f"scenario 1: {nbytes >> 20} MiB through DecodeNode over tcp, with and without the read window, "
             f"{reps} rounds")
    nodes = {}
    try:
        for name, windowed in kinds.items():
            backend = NixlBackend(f"bench-s1-{name}-{os.getpid()}", timeout=XFER_TIMEOUT, tcp_window=windowed)
            nodes[name] = DecodeNode(reader.local, backend, ca.issue(f"bench-s1-{name.replace('_', '-')}", "decode"),
                                     config=NodeConfig(transfer_timeout=XFER_TIMEOUT))
        methods = {name: partial(_fetch, node, tickets, slots) for name, node in nodes.items()}
        times = side_by_side(methods, reps, warmup=2)
        out = {name: stats(times[name], nbytes) for name in methods}
        for name, fn in methods.items():
            out[name]["verified"] = reader.verified(fn, slots, slots)
        return out
    finally:
        for node in nodes.values():
            node.close()
            node.backend.close()


def _fetch(node, tickets, slots: np.ndarray) -> None:
    """One ticket's lease into ``slots``; ``wait`` drives the node's loop (it has no thread of its own)."""
    handle = node.start_fetch(next(tickets), {GROUP: slots}, timeout=XFER_TIMEOUT)
    node.wait([handle], XFER_TIMEOUT * 2)
    if not handle.ok:
        raise BenchError(f"scenario 1: a fetch through DecodeNode failed: {handle.error}")
