"""Prefill rank of the example pair: computes each prompt's KV into its pages and lends them.

Run by ``kvlend demo`` (``kvlend.demo.pair``), once per prefill rank;
standalone it needs this rank's TLS credentials (``kvlend certs`` writes them):
``KVLEND_CA=ca.pem KVLEND_CERT=prefill-0.pem KVLEND_KEY=prefill-0.key python -m kvlend.demo.prefill --requests 64``.
Its identity is its certificate's name (the pair issues ``prefill-<rank>``).
It prints ``LISTENING <host> <port>`` once a decode rank may connect, waits
for ``--decode-tp`` decode ranks, and pushes its share of the requests
(those ``i`` with ``i % --prefills == --rank``) to each of them (each reads
its head slice), keeping at most ``--max-inflight`` requests lent at once;
then waits for the leases to end, and exits 0.  With ``--chunk-tokens`` it
prefills chunk by chunk; a request lent progressively (``--progressive``) is
offered after its first chunk and extended after each later one, so the
decode reads while the rest computes.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import queue
import sys
import time
from collections import Counter

from kvlend.demo import toy_engine
from kvlend.demo.workload import add_workload_args, progressive, run_rank
from kvlend.errors import TransferTimeout
from kvlend.metrics import METRICS
from kvlend.runtime import NodeConfig, PrefillNode, reload_on_sighup
from kvlend.security.credentials import Credentials
from kvlend.transport import load_backend


def model_config(args, side: str = "prefill") -> toy_engine.ModelConfig:
    """The toy model one rank runs; the two sides differ at most in tokens per page."""
    config = toy_engine.preset(args.preset, seed=args.seed)
    if args.model == "hybrid" and not config.layer_kinds:
        config = toy_engine.hybrid(config)
    tpp = args.tokens_per_page or config.tokens_per_page
    if side == "decode" and args.decode_tokens_per_page:
        tpp = args.decode_tokens_per_page
    return dataclasses.replace(config, tokens_per_page=tpp)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Environment: KVLEND_CA, KVLEND_CERT, KVLEND_KEY name the cluster CA "
                                       "certificate, this rank's certificate and its key (PEM files).")
    add_workload_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to listen on (default: any free port)")
    p.add_argument("--max-inflight", type=int, default=16,
                   help="requests lent at once, at most: cover the decode's --inflight (default 16)")
    p.add_argument("--prefills", type=int, default=1, help="prefill ranks sharing the requests (default 1)")
    p.add_argument("--rank", type=int, default=0,
                   help="this rank among --prefills: it lends requests i with i %% prefills == rank (default 0)")
    args = p.parse_args(argv)
    if args.max_inflight < 1:
        p.error(f"--max-inflight: must be >= 1, got {args.max_inflight}")
    if not 0 <= args.rank < args.prefills:
        p.error(f"--rank: must be in [0, --prefills {args.prefills}), got {args.rank}")
    logging.basicConfig(level=os.environ.get("KVLEND_LOG", "WARNING"),
                        format="prefill %(levelname)s %(name)s: %(message)s")
    credentials = Credentials.from_env()  # before any work: a rank without credentials stops here

    config = model_config(args)
    model = toy_engine.ToyModel(config)
    prompts = toy_engine.make_prompts(args.requests, args.seed, args.min_len, args.max_len, config.vocab)
    tpp = config.tokens_per_page
    pages_per_request = -(-args.max_len // tpp)
    cache = toy_engine.PagedKVCache(config, pages_per_request * (args.max_inflight + 1), seed=args.seed,
                                    state_slots=args.max_inflight + 1,
                                    host_layers=config.attention_layers[:args.host_layers])
    layout = cache.layout()
    held = {}  # request -> (page table, state slot)
    ended: Counter = Counter()  # request -> leases ended, counted on the node's thread
    released: queue.SimpleQueue = queue.SimpleQueue()

    def reclaim() -> None:
        while not released.empty():
            request = released.get()
            ended[request] += 1
            if ended[request] == args.decode_tp:
                del ended[request]
                table, slot = held.pop(request)
                cache.free(table)
                cache.free_state(slot)

    if args.metrics_port is not None:
        METRICS.serve(args.metrics_port + 1 + args.rank)  # the decode serves on --metrics-port itself
    backend = load_backend("nixl", name=f"prefill-{os.getpid()}", timeout=args.timeout)
    node = PrefillNode(layout, backend, credentials, host=args.host, port=args.port,
                       config=NodeConfig(transfer_timeout=args.timeout),
                       on_release=lambda lease, reason: released.put(lease.request))
    reload_on_sighup(node)  # renewed certificate files take over for new links
    print(f"LISTENING {node.address[0]} {node.address[1]}", flush=True)
    node.start()
    try:
        peers = node.wait_for_peers(args.decode_tp, args.timeout)
        for i, prompt in enumerate(prompts):
            if i % args.prefills != args.rank:
                continue  # another prefill rank's share
            deadline = time.monotonic() + args.timeout
            while len(held) >= args.max_inflight or cache.num_free < pages_per_request:
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"no lease ended within {args.timeout} s")
                time.sleep(0.001)
                reclaim()
            request = f"req-{i}"
            slot = cache.alloc_state()
            lend_chunks = progressive(args, i)
            leases = []
            for table, done, first in toy_engine.prefill_chunks(model, cache, prompt, slot, args.chunk_tokens):
                tables = cache.group_tables(table, slot)
                final = {} if first is None else {"first": first, "last_chunk_at": time.time()}
                if leases:  # progressive: the readers hear of the new pages at once and read them now
                    for lease in leases:
                        node.extend(lease.id, done, tables, meta=final)
                elif lend_chunks or first is not None:
                    held[request] = (table, slot)
                    leases = [node.offer(peer, request, len(prompt), tables, layout.full_selection(),
                                         meta={"prompt": prompt, "progressive": lend_chunks, **final}, ready=done)
                              for peer in peers]
        deadline = time.monotonic() + args.timeout
        while held and time.monotonic() < deadline:
            time.sleep(0.005)
            reclaim()
        if held:
            print(f"prefill {args.rank}: {len(held)} requests' leases never ended", file=sys.stderr)
            return 1
        # Serve until the decode hangs up (it may still be reading another prefill rank's requests), so
        # the links close in order: a prefill that leaves first is a lost peer to the decode.
        deadline = time.monotonic() + args.timeout
        while node.ready_peers() and time.monotonic() < deadline:  # past it: close anyway, every lease ended
            time.sleep(0.01)
        return 0
    finally:
        node.close()
        node.backend.close()


if __name__ == "__main__":
    sys.exit(run_rank(main, "prefill"))
