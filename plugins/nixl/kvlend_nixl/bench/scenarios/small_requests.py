"""Scenario 3: small requests back to back: latency of kvlend in process and through the nodes, against
raw NIXL READs with a notification."""

from __future__ import annotations

import itertools
import os
import time

import numpy as np

from kvlend.protocol.config import NodeConfig

from ...backend import NixlBackend
from ..lender_process import LenderProcess
from ..peer_engine import RAW_BASELINE, notification
from ..pools import GROUP, PAGE_BYTES, TPP, expected_ok, fragmented
from ..reader import Reader
from ..sizes import Sizes
from ..timing import XFER_TIMEOUT, breakdown, side_by_side, stats


def run(lender: LenderProcess, backend, sizes: Sizes, progress) -> dict:
    n = sizes.s3_pages
    pool = n * 8
    reader = Reader(lender, backend, pool, sizes.s3_layers, False, 0)
    src, dst = fragmented(pool, n, seed=3), fragmented(pool, n, seed=4)
    tokens = n * TPP
    nbytes = n * 2 * sizes.s3_layers * PAGE_BYTES
    try:
        local, remote = reader.descriptors(src, dst, tokens)
        raw_methods = ("raw_nixl_notif", "raw_nixl_prepped")
        sent = len(raw_methods) * (sizes.s3_reps + 6)  # timed, warm-up and the verifying read of each
        lender.call("expect", [(f"s3-{i}", n) for i in range(sent)])  # each read's request holds n blocks
        names = itertools.count()
        lender.call("spin", True)  # the target busy-polls its notifications, as the raw baseline needs
        try:
            methods = {"kvlend": lambda: reader.kvlend(src, dst, tokens),
                       "raw_nixl_notif": lambda: reader.raw(local, remote, notification(f"s3-{next(names)}")),
                       "raw_nixl_prepped": lambda: reader.prepped(src, dst, notification(f"s3-{next(names)}"))}
            progress(f"scenario 3: {n}-page requests: kvlend, raw NIXL READ with a notification the target acts "
                     f"on as NixlConnector does (descriptor lists built per request, and prepared lists by index), "
                     f"{sizes.s3_reps} rounds")
            lender.call("notifs")
            times = side_by_side(methods, sizes.s3_reps, warmup=5)
            results = {k: stats(times[k]) for k in methods}
            for k, fn in methods.items():
                results[k]["verified"] = reader.verified(fn, src, dst)
        finally:
            lender.call("spin", False)
        seen = lender.call("notifs", sent)
        progress(f"scenario 3: the same requests through the nodes (ticket, claim over TLS, read; the Done rides "
                 f"the next message), {sizes.s3_reps} rounds")
        results["kvlend_node"] = _node_path(lender, reader, src, dst, sizes.s3_reps)
        progress(f"scenario 3: the same through the nodes with read_ahead (reads go with the claim), "
                 f"{sizes.s3_reps} rounds")
        results["kvlend_node_ahead"] = _node_path(lender, reader, src, dst, sizes.s3_reps, read_ahead=True)
        progress(f"scenario 3: the same through the nodes, each ticket claimed one request ahead (as kvlend's "
                 f"vLLM worker claims at a request's arrival), {sizes.s3_reps} rounds")
        results["kvlend_node_claimed_ahead"] = _node_path(lender, reader, src, dst, sizes.s3_reps, read_ahead=True,
                                                          claim_ahead=True)
    finally:
        reader.close()
    kv = results["kvlend"]
    faster = min(raw_methods, key=lambda k: results[k]["p50_ms"])
    return {
        "name": "small requests back to back", "pages": n, "layers": sizes.s3_layers, "bytes": nbytes,
        "descriptors": len(local),
        "path": "kvlend: lend + plan_reads + post_read + poll + tracker + release, in-process, no TCP control channel; "
                "kvlend_node: the same request through PrefillNode and DecodeNode (ticket, claim over TLS, read; two "
                "processes), claim first; kvlend_node_ahead: the same with NodeConfig(read_ahead=True), the reads "
                "posted from the ticket's page table as the claim goes out; kvlend_node_claimed_ahead: the same, each "
                "ticket claimed (DecodeNode.claim) as the request before it starts, so its claim's answer overlaps "
                "that fetch",
        "baseline": RAW_BASELINE,
        "notifications": {"sent": sent, "seen_by_target": seen["seen"], "freed_by_target": seen["freed"],
                          "unknown_to_target": seen["unknown"]},
        "results": results,
        "ratios": {f"p50 kvlend/{k}": kv["p50_ms"] / results[k]["p50_ms"] for k in raw_methods}
        | {f"p99 kvlend/{k}": kv["p99_ms"] / results[k]["p99_ms"] for k in raw_methods}
        | {"p50 kvlend_node/kvlend": results["kvlend_node"]["p50_ms"] / kv["p50_ms"],
           "p50 kvlend_node_ahead/kvlend_node":
               results["kvlend_node_ahead"]["p50_ms"] / results["kvlend_node"]["p50_ms"]}
        | {f"p50 {k}/{faster}": results[k]["p50_ms"] / results[faster]["p50_ms"]
           for k in ("kvlend_node", "kvlend_node_ahead", "kvlend_node_claimed_ahead")},
        "node_overhead_ms": results["kvlend_node"]["p50_ms"] - kv["p50_ms"],
        "node_ahead_overhead_ms": results["kvlend_node_ahead"]["p50_ms"] - kv["p50_ms"],
        "targets": {f"p50 <= 1.5x the faster raw ({faster})": kv["p50_ms"] <= 1.5 * results[faster]["p50_ms"],
                    f"p99 <= 3x the faster raw ({faster})": kv["p99_ms"] <= 3 * results[faster]["p99_ms"],
                    f"through the nodes with read_ahead p50 <= 3x the faster raw ({faster})":
                        results["kvlend_node_ahead"]["p50_ms"] <= 3 * results[faster]["p50_ms"]},
    }


def _node_path(lender: LenderProcess, reader: Reader, src: np.ndarray, dst: np.ndarray, reps: int,
               read_ahead: bool = False, claim_ahead: bool = False) -> dict:
    """Scenario 3's request through the nodes: a PrefillNode in the lender lends tickets ahead, and a
    DecodeNode here redeems each (claim and offer over the TLS control channel, read; the Done rides the
    next message), driving its own loop from ``wait`` as an engine's step would; ``read_ahead``: its
    reads go out with the claim, from the ticket's page table; ``claim_ahead``: each ticket is claimed
    (untimed) as the request before it starts, so its answer arrives while that request is read, as
    in an engine whose requests arrive before their pages are allocated."""
    import tempfile

    from kvlend.runtime import DecodeNode
    from kvlend.security.certs import Authority, save_rank

    warmup = 5  # the first wires UCX up and does the TLS handshake
    ca = Authority.create()
    with tempfile.TemporaryDirectory(prefix="kvlend-bench-") as certs:
        tickets = lender.call("tickets", {"credentials": save_rank(ca.issue("bench-node-prefill", "prefill"), certs),
                                          "requests": [src] * (warmup + reps + 1)})
    backend = NixlBackend(f"bench-node-decode-{os.getpid()}", timeout=XFER_TIMEOUT)
    decode = DecodeNode(reader.local, backend, ca.issue("bench-node-decode", "decode"),
                        config=NodeConfig(read_ahead=read_ahead))
    try:
        times, timed = [], []
        for i, ticket in enumerate(tickets[:-1]):
            if claim_ahead and i + 1 < len(tickets) - 1:
                decode.claim(tickets[i + 1])
            start = time.perf_counter()
            handle = decode.start_fetch(ticket, {GROUP: dst})
            handle.wait(XFER_TIMEOUT)
            if i >= warmup:
                times.append(time.perf_counter() - start)
                timed.append(handle)
        for a in reader.arrays:
            a[dst] = 0
        decode.start_fetch(tickets[-1], {GROUP: dst}).wait(XFER_TIMEOUT)
        verified = all(expected_ok(a, r, src, dst) for r, a in enumerate(reader.arrays))
    finally:
        decode.close()
        backend.close()
    return {**stats(times), "verified": verified, "breakdown": breakdown(timed)}
