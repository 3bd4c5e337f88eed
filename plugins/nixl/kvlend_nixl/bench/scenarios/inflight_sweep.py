"""Scenario 7: the decode's CPU per request as load grows: fetches in flight and prefill ranks swept,
small requests so that the control plane is most of the cost."""

from __future__ import annotations

import os
import tempfile

import numpy as np

from ...backend import NixlBackend
from ..fetching import keep_in_flight
from ..lender_process import LenderProcess
from ..pools import PAGE_BYTES, fragmented, make_pools
from ..sizes import S7_PAGES, Sizes
from ..timing import XFER_TIMEOUT

POOL = 64 * S7_PAGES  # each lender process's pages: requests draw fragmented slots from it
CEILING = 1.3  # CPU per request at the most in flight, at most this times that at the fewest


def run(lender: LenderProcess, backend, sizes: Sizes, progress) -> dict:
    """For each count of prefill ranks (PrefillNodes in the two lender processes, several per process),
    one DecodeNode redeems tickets of ``S7_PAGES`` pages each with ``k`` fetches in flight, for each
    ``k``; reported: this process's CPU per request (its node loop and the driver) and requests/s."""
    from kvlend.runtime import DecodeNode
    from kvlend.security.certs import Authority

    lenders = [lender, LenderProcess()]
    counts = {k: max(sizes.s7_requests, 3 * k) for k in sizes.s7_inflight}
    # A page of its own for every request of a point (its bytes are checked after it)
    arrays, local = make_pools(max(max(counts.values()), max(sizes.s7_peers)) * S7_PAGES, 1, False, fill=False)
    for a in arrays:  # fault every page in now: the first point would pay for the kernel's zeroing
        a.fill(1)
    ca = Authority.create()
    blocks = []
    try:
        for lend in lenders:
            lend.call("pools", {"pages": POOL, "layers": 1, "combined": False, "staging": 0})
        for peers in sizes.s7_peers:
            progress(f"scenario 7: {peers} prefill rank(s), {'/'.join(map(str, counts))} fetches in flight, "
                     f"{S7_PAGES}-page requests ({sum(counts.values())} in all)")
            work = _lend(lenders, peers, [peers] + list(counts.values()), ca)
            node_backend = NixlBackend(f"bench-sweep-{peers}-{os.getpid()}", timeout=XFER_TIMEOUT)
            decode = DecodeNode(local, node_backend, ca.issue(f"bench-sweep-decode-{peers}", "decode"))
            try:
                keep_in_flight(decode, work[0], arrays, peers, "scenario 7")  # links up: TLS and NIXL metadata
                points = {f"{k} in flight": keep_in_flight(decode, todo, arrays, k, "scenario 7")
                          for k, todo in zip(counts, work[1:])}
            finally:
                decode.close()
                node_backend.close()
                for lend in lenders:
                    lend.call("close_nodes")
            blocks.append(_block(peers, points, counts))
    finally:
        lenders[1].close()
    return {"name": "decode CPU per request as load grows", "pages": S7_PAGES,
            "bytes_per_request": S7_PAGES * 2 * PAGE_BYTES, "requests": blocks,
            "path": "DecodeNode redeeming tickets from PrefillNodes over TLS (claim, offer, read, done ack); "
                    "CPU: this process's time (the node's loop thread and the driver), byte checks left out"}


def _lend(lenders: list[LenderProcess], peers: int, counts: list[int], ca) -> list[list]:
    """``peers`` PrefillNodes (node j in lender process j % 2), each lending its share of every batch
    of ``counts`` requests, round robin; the batches of (node, source slots, ticket)."""
    from kvlend.security.certs import save_rank

    rng = np.random.default_rng(7 + peers)
    batches = [[(i % peers, fragmented(POOL, S7_PAGES, seed=int(rng.integers(1 << 30)))) for i in range(n)]
               for n in counts]
    tickets = []
    with tempfile.TemporaryDirectory(prefix="kvlend-bench-") as certs:
        for j in range(peers):
            mine = [src for batch in batches for node, src in batch if node == j]
            tickets.append(iter(lenders[j % 2].call("node_tickets", {
                "credentials": save_rank(ca.issue(f"bench-sweep-prefill-{peers}-{j}", "prefill"),
                                         certs), "requests": mine})))
    return [[(node, src, next(tickets[node])) for node, src in batch] for batch in batches]


def _block(peers: int, points: dict, counts: dict) -> dict:
    for point, n in zip(points.values(), counts.values()):
        point["cpu_us_per_request"] = point["cpu_seconds"] / n * 1e6
        point["requests_per_s"] = n / point["seconds"]
    first, last = points[f"{min(counts)} in flight"], points[f"{max(counts)} in flight"]
    growth = last["cpu_us_per_request"] / first["cpu_us_per_request"]
    return {"label": f"{peers} prefill rank{'s' if peers > 1 else ''}", "peers": peers, "results": points,
            "ratios": {f"CPU per request {max(counts)}/{min(counts)} in flight": growth},
            "targets": {f"CPU per request at {max(counts)} in flight <= {CEILING}x that at {min(counts)}":
                        growth <= CEILING}}
