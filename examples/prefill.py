"""Prefill rank of the example pair: computes each prompt's KV into its pages and lends them.

Run by ``examples/pair.py`` (or ``kvlend demo``); standalone:
``KVLEND_SECRET=<hex> python examples/prefill.py --requests 64``.  It prints
``LISTENING <host> <port>`` once a decode rank may connect, serves every
request, waits for the leases to end, and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import toy_engine  # noqa: E402
from workload import add_workload_args  # noqa: E402

from kvlend.backend import load_backend  # noqa: E402
from kvlend.control import load_secret  # noqa: E402
from kvlend.errors import TransferTimeout  # noqa: E402
from kvlend.node import NodeConfig, PrefillNode  # noqa: E402


def model_config(args) -> toy_engine.ModelConfig:
    return toy_engine.preset(args.preset, seed=args.seed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to listen on (default: any free port)")
    p.add_argument("--max-inflight", type=int, default=16, help="leases outstanding at once (default 16)")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("KVLEND_LOG", "WARNING"), format="prefill %(levelname)s %(name)s: %(message)s")

    config = model_config(args)
    model = toy_engine.ToyModel(config)
    prompts = toy_engine.make_prompts(args.requests, args.seed, args.min_len, args.max_len, config.vocab)
    tpp = config.tokens_per_page
    pages_per_request = -(-args.max_len // tpp)
    cache = toy_engine.PagedKVCache(config, pages_per_request * (args.max_inflight + 1), seed=args.seed)
    layout = cache.layout()
    tables = {}
    released: queue.SimpleQueue = queue.SimpleQueue()  # filled by the node's thread

    def reclaim() -> None:
        while not released.empty():
            cache.free(tables.pop(released.get()))

    node = PrefillNode(layout, load_backend("nixl", name=f"prefill-{os.getpid()}"), load_secret(),
                       host=args.host, port=args.port, config=NodeConfig(transfer_timeout=args.timeout),
                       on_release=lambda lease, reason: released.put(lease.request))
    print(f"LISTENING {node.address[0]} {node.address[1]}", flush=True)
    node.start()
    try:
        peer = node.wait_for_peer(args.timeout)
        for i, prompt in enumerate(prompts):
            deadline = time.monotonic() + args.timeout
            while len(tables) >= args.max_inflight or cache.num_free < pages_per_request:
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"no lease ended within {args.timeout} s")
                time.sleep(0.001)
                reclaim()
            request = f"req-{i}"
            table, first = toy_engine.prefill(model, cache, prompt)
            tables[request] = table
            node.offer(peer, request, len(prompt), {"full": table}, layout.full_selection(),
                       meta={"first": first, "prompt": prompt})
        deadline = time.monotonic() + args.timeout
        while tables and time.monotonic() < deadline:
            time.sleep(0.005)
            reclaim()
        if tables:
            print(f"prefill: {len(tables)} leases never ended", file=sys.stderr)
            return 1
        return 0
    finally:
        node.close()
        node.backend.close()


if __name__ == "__main__":
    sys.exit(main())
