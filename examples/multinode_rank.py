"""One rank of the multi-node loopback test (``scripts/multinode-loopback``).

``--role prefill`` fills K/V pools (numpy, HND) with a deterministic byte
pattern, waits for ``--peers`` decode ranks and lends every request to each.
``--role decode`` connects, fetches each lease into its own pages (in another
order than the prefill's) and checks every byte against the pattern -- for a
decode rank of a larger tensor-parallel degree, against its head slice of the
prefill's pages.  Each rank writes one JSON result (``--report``) before it
tears NIXL down, so a hang at shutdown cannot hide the result.

A rank is who its certificate names: it loads the files named by
``$KVLEND_CA`` (the cluster CA certificate), ``$KVLEND_CERT`` and
``$KVLEND_KEY`` (its own certificate and key).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np

from kvlend.core.layout import ReplicaRank, layout_from_pools
from kvlend.demo.workload import run_rank
from kvlend.errors import KvlendError
from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode, reload_on_sighup
from kvlend.security.credentials import Credentials
from kvlend.transport import load_backend

DTYPE = np.float16


def pool_pattern(seed: int, layer: int, role: int, shape: tuple[int, ...]) -> np.ndarray:
    """The prefill's pool bytes: both ends derive them, so decode checks without trusting the peer."""
    rng = np.random.default_rng([seed, layer, role])
    nbytes = int(np.prod(shape)) * np.dtype(DTYPE).itemsize
    return rng.integers(0, 256, nbytes, dtype=np.uint8).view(DTYPE).reshape(shape)


def source_table(seed: int, request: int, pool_pages: int, request_pages: int) -> np.ndarray:
    """Prefill slots of ``request``: a seeded shuffle, so runs are not one contiguous range."""
    order = np.random.default_rng([seed, 7]).permutation(pool_pages)
    start = (request * request_pages) % pool_pages
    return np.roll(order, -start)[:request_pages].astype(np.int64)


def make_pools(args, heads: int, pages: int, fill: bool):
    shape = (pages, heads, args.tokens_per_page, args.head_dim)
    if fill:
        return [[pool_pattern(args.seed, layer, role, shape) for role in (0, 1)] for layer in range(args.layers)]
    return [[np.zeros(shape, dtype=DTYPE) for _ in (0, 1)] for _ in range(args.layers)]


def config(args) -> NodeConfig:
    # A failed read is reported once quiet: within transfer_timeout + cancel_grace at worst.
    return NodeConfig(ttl=args.ttl, heartbeat=min(1.0, args.ttl / 4), handshake_timeout=args.timeout,
                      transfer_timeout=args.transfer_timeout, cancel_grace=min(2.0, args.transfer_timeout / 2))


def backend(args, role: str, credentials: Credentials):
    # The progress thread stays off: nodes poll the agent themselves (see the NIXL plugin README).
    return load_backend("nixl", name=f"{role}-{credentials.identity}-{os.getpid()}", timeout=args.transfer_timeout)


def emit(args, result: dict) -> None:
    text = json.dumps(result)
    if args.report:
        with open(args.report + ".tmp", "w") as f:
            f.write(text)
        os.replace(args.report + ".tmp", args.report)
    print("RESULT " + text, flush=True)


def run_prefill(args, credentials: Credentials) -> int:
    pools = make_pools(args, args.heads, args.pool_pages, fill=True)
    layout = layout_from_pools(k=[p[0] for p in pools], v=[p[1] for p in pools], kept_window=1 << 20,
                               replica=ReplicaRank(args.tp_size, args.tp_rank), scope="kvlend-multinode")
    request_pages = -(-args.tokens // args.tokens_per_page)
    released: list[str] = []
    node = PrefillNode(layout, backend(args, "prefill", credentials), credentials, host=args.host,
                       port=args.port, config=config(args), on_release=lambda lease, reason: released.append(reason))
    reload_on_sighup(node)  # renewed certificate files take over for new links
    print(f"LISTENING {node.address[0]} {node.address[1]}", flush=True)
    node.start()
    offered = 0
    error = None
    try:
        peers = node.wait_for_peers(args.peers, args.timeout)
        for i in range(args.requests):
            table = source_table(args.seed, i, args.pool_pages, request_pages)
            for peer in peers:
                node.offer(peer, f"req-{i}", args.tokens, {"full": table}, layout.full_selection())
                offered += 1
        deadline = time.monotonic() + args.timeout
        while len(released) < offered and time.monotonic() < deadline:
            time.sleep(0.01)
    except KvlendError as exc:
        error = f"{type(exc).__name__}: {exc}"
    reasons = {r: released.count(r) for r in set(released)}
    ok = error is None and reasons.get("done", 0) == offered == args.requests * args.peers
    emit(args, {"role": "prefill", "name": node.name, "offered": offered, "released": reasons,
                "error": error, "ok": ok})
    node.close()
    node.backend.close()
    return 0 if ok else 1


def connect_retrying(node: DecodeNode, host: str, port: int, timeout: float):
    """The prefill may not listen yet when this rank starts: retry until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return node.connect(host, port)
        except KvlendError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def run_decode(args, credentials: Credentials) -> int:
    if args.heads % args.tp_size:
        raise SystemExit(f"--heads {args.heads} is not divisible by --tp-size {args.tp_size}")
    local_heads = args.heads // args.tp_size
    request_pages = -(-args.tokens // args.tokens_per_page)
    pools = make_pools(args, local_heads, request_pages, fill=False)
    layout = layout_from_pools(k=[p[0] for p in pools], v=[p[1] for p in pools], kept_window=1 << 20,
                               replica=ReplicaRank(args.tp_size, args.tp_rank), scope="kvlend-multinode")
    # Expected bytes: this rank's head slice of the prefill's whole pools.
    full_shape = (args.pool_pages, args.heads, args.tokens_per_page, args.head_dim)
    heads = slice(args.tp_rank * local_heads, (args.tp_rank + 1) * local_heads)
    expected = [[pool_pattern(args.seed, layer, role, full_shape)[:, heads] for role in (0, 1)]
                for layer in range(args.layers)]
    node = DecodeNode(layout, backend(args, "decode", credentials), credentials, config=config(args))
    reload_on_sighup(node)
    host, port = args.connect.rsplit(":", 1)
    dst = np.arange(request_pages, dtype=np.int64)[::-1].copy()  # local order differs from the prefill's
    nbytes, seconds, fetched, mismatched, failures = 0, 0.0, 0, [], []
    error = None
    try:
        connect_retrying(node, host, int(port), args.timeout)
        for _ in range(args.requests):
            peer, offer = node.next_offer(args.timeout)
            i = int(offer.request.split("-")[1])
            for p in pools:
                p[0][:] = 0
                p[1][:] = 0
            start = time.monotonic()
            started = time.time()  # wall clock: the launcher compares it with when it broke the link
            print(f"FETCHING {offer.request}", flush=True)
            try:
                result = node.fetch(peer, offer, {"full": dst})
            except KvlendError as exc:
                failures.append({"request": offer.request, "error": type(exc).__name__, "message": str(exc)[:300],
                                 "seconds": time.monotonic() - start, "deadline": args.transfer_timeout,
                                 "grace": node.config.cancel_grace,
                                 "started": started})
                break
            nbytes += result.bytes
            seconds += result.seconds
            fetched += 1
            src = source_table(args.seed, i, args.pool_pages, request_pages)
            good = all(np.array_equal(pools[layer][role][dst].view(np.uint8), expected[layer][role][src].view(np.uint8))
                       for layer in range(args.layers) for role in (0, 1))
            if not good:
                mismatched.append(offer.request)
            print(f"FETCHED {fetched}", flush=True)
    except KvlendError as exc:
        error = f"{type(exc).__name__}: {exc}"
    verified = error is None and not failures and not mismatched and fetched == args.requests
    emit(args, {"role": "decode", "name": node.name, "tp_size": args.tp_size, "tp_rank": args.tp_rank,
                "requests": fetched, "bytes": nbytes, "seconds": seconds,
                "gbps": nbytes / seconds / 1e9 if seconds else 0.0, "verified": verified,
                "mismatched": mismatched, "failures": failures, "error": error})
    node.close()
    node.backend.close()
    return 0 if verified else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Environment: KVLEND_CA, KVLEND_CERT, KVLEND_KEY name the cluster CA "
                                       "certificate, this rank's certificate (its identity) and its key.")
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--host", default="127.0.0.1", help="prefill: address to listen on")
    p.add_argument("--port", type=int, default=47000, help="prefill: port to listen on")
    p.add_argument("--connect", metavar="HOST:PORT", help="decode: the prefill's control address")
    p.add_argument("--peers", type=int, default=1, help="prefill: decode ranks to serve")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="KV heads of the whole model (all tp ranks)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens-per-page", type=int, default=16)
    p.add_argument("--pool-pages", type=int, default=128, help="prefill pages per pool")
    p.add_argument("--tokens", type=int, default=256, help="tokens per request")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="connect / offer / drain deadline (s)")
    p.add_argument("--transfer-timeout", type=float, default=30.0, help="one lease's deadline (s)")
    p.add_argument("--ttl", type=float, default=30.0, help="lease lifetime without a heartbeat (s)")
    p.add_argument("--report", help="write the JSON result to this file too")
    args = p.parse_args(argv)
    if args.role == "decode" and not args.connect:
        p.error("--connect is required for --role decode")
    credentials = Credentials.from_env()
    logging.basicConfig(level=os.environ.get("KVLEND_LOG", "WARNING"),
                        format=f"{credentials.identity} %(levelname)s %(name)s: %(message)s")
    return (run_prefill if args.role == "prefill" else run_decode)(args, credentials)


if __name__ == "__main__":
    sys.exit(run_rank(main, "multinode_rank"))
