"""Scenario 6: progressive lending: a long prompt prefilled in chunks, lent chunk by chunk or at the
end, timed from the last chunk to "decode may start"."""

from __future__ import annotations

import os
import time

import numpy as np

from ...backend import NixlBackend
from ..lender_process import LenderProcess
from ..pools import GROUP, PAGE_BYTES, TPP, expected_ok, fragmented
from ..reader import Reader
from ..sizes import Sizes
from ..timing import XFER_TIMEOUT, stats


def run(lender: LenderProcess, backend, sizes: Sizes, progress) -> dict:
    """Progressive lending: one long prompt prefilled in chunks (compute simulated), read by a DecodeNode
    over a ticket, lent as its chunks commit (on) or once prefill is done (off), rounds alternating.
    Measured: from the last chunk's end to "decode may start" (the fetch done, ack included)."""
    import tempfile

    from kvlend.runtime import DecodeNode
    from kvlend.security.certs import Authority, save_rank

    pages, chunk = sizes.s6_pages, sizes.s6_chunk_pages
    reader = Reader(lender, backend, pages, sizes.s6_layers, False, 0)
    nbytes = pages * 2 * sizes.s6_layers * PAGE_BYTES
    dst = fragmented(pages, pages, seed=6)
    ca = Authority.create()
    tails: dict[str, list[float]] = {"on": [], "off": []}
    reads: list[float] = []
    verified = {}
    wall = time.time() - time.monotonic()
    progress(f"scenario 6: a {pages * TPP}-token prompt ({nbytes >> 20} MiB) prefilled in chunks of {chunk * TPP} "
             f"tokens ({sizes.s6_compute_s * 1e3:g} ms of simulated compute each), lent progressively or at the "
             f"end, {sizes.s6_rounds} rounds each")
    node_backend = NixlBackend(f"bench-stream-decode-{os.getpid()}", timeout=XFER_TIMEOUT)
    decode = DecodeNode(reader.local, node_backend, ca.issue("bench-stream-decode", "decode"))
    try:
        with tempfile.TemporaryDirectory(prefix="kvlend-bench-") as certs:
            credentials = save_rank(ca.issue("bench-stream-prefill", "prefill"), certs)
            for i in range(2 * (sizes.s6_rounds + 1)):  # the first round of each mode warms up
                mode = ("on", "off")[i % 2]
                for a in reader.arrays:
                    a[dst] = 0
                lender.conn.send(("stream", {"credentials": credentials, "pages": pages, "chunk_pages": chunk,
                                             "compute_s": sizes.s6_compute_s, "progressive": mode == "on",
                                             "round": i}))
                ticket = lender.receive("ticket")
                started = time.monotonic()
                handle = decode.start_fetch(ticket, {GROUP: dst})
                result = handle.wait(XFER_TIMEOUT)
                ready = wall + started + handle.timeline["finished"]
                last = lender.receive("last")
                verified[mode] = all(expected_ok(a, r, np.arange(pages), dst) for r, a in enumerate(reader.arrays))
                if i >= 2:
                    tails[mode].append(ready - last)
                    if mode == "off":
                        reads.append(result.read_seconds)
    finally:
        decode.close()
        node_backend.close()
        reader.close()
    results = {f"progressive_{m}": {**stats(v), "verified": verified[m]} for m, v in tails.items()}
    on, off = results["progressive_on"]["p50_ms"], results["progressive_off"]["p50_ms"]
    transfer_ms = float(np.median(reads)) * 1e3
    one_chunk_ms = transfer_ms * chunk / pages
    left_ms = on - (off - transfer_ms)  # the tail's transfer: less the round trips the off tail also pays
    return {
        "name": "progressive lending: last prefill chunk to decode may start", "tokens": pages * TPP,
        "chunk_tokens": chunk * TPP, "compute_ms_per_chunk": sizes.s6_compute_s * 1e3, "bytes": nbytes,
        "results": results, "transfer_ms_off": transfer_ms, "one_chunk_transfer_ms": one_chunk_ms,
        "transfer_left_ms": left_ms,
        "ratios": {"tail on/off": on / off, "transfer hidden": max(0.0, 1 - on / off)},
        "targets": {"transfer left after the last chunk <= 2 chunks' transfer": left_ms <= 2 * one_chunk_ms},
        "path": "prefill (PrefillNode) and decode (DecodeNode) in two processes over TLS; a ticket per round; "
                "'decode may start' = the fetch finished (every read landed, done acked)",
    }
