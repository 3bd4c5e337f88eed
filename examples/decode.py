"""Decode rank of the example pair: reads each lease into its own pages and generates from it.

Every request's tokens are checked against what one process generates alone
from the same prompt.  Writes a JSON report (``--report``) and exits 0 only
if every request verified.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import toy_engine  # noqa: E402
from prefill import model_config  # noqa: E402
from workload import add_workload_args  # noqa: E402

from kvlend.backend import load_backend  # noqa: E402
from kvlend.control import load_secret  # noqa: E402
from kvlend.node import DecodeNode, NodeConfig  # noqa: E402


def _progress(done: int, total: int, failed: int, nbytes: int, start: float) -> None:
    if not sys.stderr.isatty() and done not in (total, 1) and done % max(1, total // 8):
        return
    end = "\n" if done == total or not sys.stderr.isatty() else ""
    print(f"\r  decode: {done}/{total} requests ({done - failed} verified), {nbytes / 2**20:.1f} MiB read, "
          f"{time.monotonic() - start:.1f} s", end=end, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--connect", required=True, metavar="HOST:PORT", help="the prefill rank's control address")
    p.add_argument("--report", help="write the JSON report to this file")
    p.add_argument("--chunk-pages", type=int, default=256, help="token pages per posted chunk (default 256)")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("KVLEND_LOG", "WARNING"), format="decode %(levelname)s %(name)s: %(message)s")

    config = model_config(args)
    model = toy_engine.ToyModel(config)
    tpp = config.tokens_per_page
    cache = toy_engine.PagedKVCache(config, 2 * -(-(args.max_len + args.max_new_tokens) // tpp), seed=args.seed + 1)
    node = DecodeNode(cache.layout(), load_backend("nixl", name=f"decode-{os.getpid()}"), load_secret(),
                      config=NodeConfig(transfer_timeout=args.timeout, chunk_pages=args.chunk_pages))
    host, port = args.connect.rsplit(":", 1)
    link = node.connect(host, int(port))
    latencies, descriptors, failures = [], [], []
    nbytes = tokens = 0
    start = time.monotonic()
    try:
        for done in range(1, args.requests + 1):
            peer, offer = node.next_offer(args.timeout)
            table = cache.alloc(-(-offer.num_tokens // tpp))
            try:
                result = node.fetch(peer, offer, {"full": table})
                out = toy_engine.decode(model, cache, table, offer.num_tokens, offer.meta["first"], args.max_new_tokens)
            finally:
                cache.free(table)
            reference = toy_engine.generate_reference(model, offer.meta["prompt"], args.max_new_tokens)
            if out != reference:
                failures.append(offer.request)
            latencies.append(result.seconds)
            descriptors.append(result.descriptors)
            nbytes += result.bytes
            tokens += offer.num_tokens
            _progress(done, args.requests, len(failures), nbytes, start)
    finally:
        node.close()
        node.backend.close()
    seconds = sum(latencies)
    report = {
        "requests": len(latencies),
        "tokens": tokens,
        "bytes": nbytes,
        "gbps": nbytes / seconds / 1e9 if seconds else 0.0,
        "latency_ms_p50": float(np.percentile(latencies, 50) * 1e3),
        "latency_ms_p99": float(np.percentile(latencies, 99) * 1e3),
        "descriptors_per_request": float(np.mean(descriptors)),
        "handshake_ms": link.handshake_ms,
        "verified": not failures and len(latencies) == args.requests,
        "mismatched": failures,
    }
    text = json.dumps(report)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0 if report["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
