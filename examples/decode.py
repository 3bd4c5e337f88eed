"""Decode rank(s) of the example pair: read each lease into their own pages and generate from it.

With ``--decode-tp N`` this one process runs the N decode tensor-parallel
ranks: N nodes with N NIXL agents, each reading its head slice into its own
shard, merged into one cache to generate.  Every request's tokens are
checked against what one process generates alone from the same prompt with
the prefill's model.  Writes a JSON report (``--report``) and exits 0 only
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
from workload import add_workload_args, run_rank  # noqa: E402

from kvlend.backend import load_backend  # noqa: E402
from kvlend.metrics import METRICS  # noqa: E402
from kvlend.control import load_secret  # noqa: E402
from kvlend.errors import ProtocolError  # noqa: E402
from kvlend.layout import ReplicaRank  # noqa: E402
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
    host, _, port = args.connect.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        p.error(f"--connect: expected HOST:PORT with a port in [1, 65535], got {args.connect!r}")
    logging.basicConfig(level=os.environ.get("KVLEND_LOG", "WARNING"), format="decode %(levelname)s %(name)s: %(message)s")

    config = model_config(args, "decode")
    model = toy_engine.ToyModel(config)
    prefill_config = model_config(args)
    reference_model = model if prefill_config == config else toy_engine.ToyModel(prefill_config)
    tpp, tp = config.tokens_per_page, args.decode_tp
    num_pages = 2 * -(-(args.max_len + args.max_new_tokens + prefill_config.tokens_per_page) // tpp)
    cache = toy_engine.PagedKVCache(config, num_pages, seed=args.seed + 1, state_slots=1)
    shards = [cache] if tp == 1 else [
        toy_engine.PagedKVCache(config, num_pages, state_slots=1, replica=ReplicaRank(tp, r)) for r in range(tp)
    ]
    secret = load_secret()
    if args.metrics_port is not None:
        METRICS.serve(args.metrics_port)
    node_config = NodeConfig(transfer_timeout=args.timeout, chunk_pages=args.chunk_pages)
    nodes = [DecodeNode(s.layout(), load_backend("nixl", name=f"decode-{os.getpid()}-{r}", timeout=args.timeout),
                        secret, name=f"decode-tp{r}", config=node_config) for r, s in enumerate(shards)]
    latencies, descriptors, failures = [], [], []
    nbytes = nbytes_full = tokens = 0
    start = time.monotonic()
    try:
        links = [node.connect(host, int(port)) for node in nodes]
        for done in range(1, args.requests + 1):
            offers = [node.next_offer(args.timeout) for node in nodes]
            if len({offer.request for _, offer in offers}) != 1:
                raise ProtocolError(f"the decode ranks were offered different requests: {[o.request for _, o in offers]}")
            request, num_tokens, meta = offers[0][1].request, offers[0][1].num_tokens, offers[0][1].meta
            # Whole remote pages land whole: cover the last one even past num_tokens.
            span = max(tpp, prefill_config.tokens_per_page)
            table = cache.alloc(-(-num_tokens // span) * (span // tpp))
            slot = cache.alloc_state()
            try:
                results = [node.fetch(peer, offer, shard.group_tables(table, slot))
                           for node, shard, (peer, offer) in zip(nodes, shards, offers)]
                if tp > 1:
                    toy_engine.merge_shards(cache, shards, table, slot)
                out = toy_engine.decode(model, cache, table, num_tokens, meta["first"], args.max_new_tokens, slot)
            finally:
                cache.free(table)
                cache.free_state(slot)
            reference = toy_engine.generate_reference(reference_model, meta["prompt"], args.max_new_tokens)
            if out != reference or any(r.bound != num_tokens for r in results):
                failures.append(request)
            latencies.append(max(r.seconds for r in results))
            descriptors.append(sum(r.descriptors for r in results))
            nbytes += sum(r.bytes for r in results)
            nbytes_full += toy_engine.lent_bytes(links[0].plan.remote, num_tokens, windowed=False)
            tokens += num_tokens
            _progress(done, args.requests, len(failures), nbytes, start)
    finally:
        for node in nodes:
            node.close()
            node.backend.close()
    seconds = sum(latencies)
    report = {
        "requests": len(latencies),
        "tokens": tokens,
        "bytes": nbytes,
        "bytes_full": nbytes_full,
        "gbps": nbytes / seconds / 1e9 if seconds else 0.0,
        "latency_ms_p50": float(np.percentile(latencies, 50) * 1e3),
        "latency_ms_p99": float(np.percentile(latencies, 99) * 1e3),
        "descriptors_per_request": float(np.mean(descriptors)),
        "handshake_ms": max(link.handshake_ms for link in links),
        "model": "hybrid" if config.layer_kinds else "llama",
        "tokens_per_page": [prefill_config.tokens_per_page, tpp],
        "decode_tp": tp,
        "plan": links[0].plan.kind,
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
    sys.exit(run_rank(main, "decode"))
