"""Decode rank(s) of the example pair: read many leases at once into their own pages and generate from them.

One process connects to every prefill rank (``--connect HOST:PORT``, once
per prefill), collects the leases they push, and keeps up to ``--inflight``
requests' fetches in flight with ``DecodeNode.start_fetch``, each into
freshly allocated pages; it collects the finished ones with ``finished()``,
generates from each, frees the pages and starts more; once every request is
in, it checks each one's tokens against what one process generates alone
from the same prompt with the prefill's model (and chunking).  With ``--decode-tp N`` the process runs the N decode
tensor-parallel ranks: N nodes with N NIXL agents, each reading its head
slice into its own shard; a request is done when every rank's fetch is,
and the shards are merged into one cache to generate.  Writes a JSON
report (``--report``) and exits 0 only if every request verified.

Each decode TP rank proves its own identity: ``$KVLEND_CA`` names the cluster
CA certificate, and ``$KVLEND_CERT`` and ``$KVLEND_KEY`` each rank's
certificate and key, ``{rank}`` in them standing for the TP rank
(``kvlend.demo.pair`` issues ``decode-tp0``, ``decode-tp1``, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvlend.core.fetchplan import destination_pages
from kvlend.core.layout import ReplicaRank
from kvlend.demo import toy_engine
from kvlend.demo.prefill import model_config
from kvlend.demo.workload import add_workload_args, run_rank
from kvlend.errors import ConfigError, KvlendError, PeerLost, PeerProtocolError, TransferTimeout
from kvlend.metrics import METRICS
from kvlend.runtime import DecodeNode, NodeConfig, reload_on_sighup
from kvlend.security.credentials import Credentials
from kvlend.transport import load_backend

POLL = 0.002  # seconds one idle wait lasts before the loop looks at offers and finished fetches again


@dataclass(eq=False)
class Request:
    """One request being fetched (on every decode TP rank) or waiting to be decoded."""

    name: str
    num_tokens: int
    meta: dict
    prefill: int  # index into --connect
    table: np.ndarray
    slot: int | None
    started: float  # time.monotonic() just before the first start_fetch
    handles: list = field(default_factory=list)  # one per decode TP rank
    finished: int = 0  # handles reported by finished()

    @property
    def in_flight(self) -> bool:
        return not all(h.done for h in self.handles)


def _progress(done: int, total: int, failed: int, nbytes: int, start: float, inflight: int) -> None:
    if not sys.stderr.isatty() and done not in (total, 1) and done % max(1, total // 8):
        return
    end = "\n" if done == total or not sys.stderr.isatty() else ""
    print(f"\r  decode: {done}/{total} requests ({done - failed} verified, {inflight} in flight), "
          f"{nbytes / 2**20:.1f} MiB read, {time.monotonic() - start:.1f} s",
          end=end, file=sys.stderr, flush=True)


def _address(text: str, p: argparse.ArgumentParser) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        p.error(f"--connect: expected HOST:PORT with a port in [1, 65535], got {text!r}")
    return host, int(port)


def _busy_seconds(spans: list[tuple[float, float]]) -> float:
    """How long at least one of the ``(start, end)`` spans was open."""
    total, reach = 0.0, -np.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _progressive_report(args, after: dict[str, list[float]], read_times: list[float], mean_tokens: float) -> dict:
    """From each request's last prefill chunk to "decode may start", per lending mode, and how much of
    the transfer progressive lending hid behind prefill compute (against the off mode's tail)."""
    if args.chunk_tokens is None:
        return {}
    out: dict = {"chunk_tokens": args.chunk_tokens, "progressive": args.progressive, "after_last_chunk": {
        mode: {"requests": len(v), "p50_ms": float(np.percentile(v, 50) * 1e3),
               "p99_ms": float(np.percentile(v, 99) * 1e3)}
        for mode, v in after.items() if v}}
    if after["on"] and after["off"]:
        on, off = np.median(after["on"]), np.median(after["off"])
        out["transfer_hidden"] = float(max(0.0, 1 - on / off))
        out["one_chunk_ms"] = float(np.median(read_times) * 1e3 * min(1.0, args.chunk_tokens / mean_tokens))
    return out


def rank_credentials(tp: int) -> list[Credentials]:
    """Each decode TP rank's credentials: ``{rank}`` in ``$KVLEND_CERT`` and ``$KVLEND_KEY`` names its files."""
    ranks = [Credentials.from_env(rank=r, ranks=tp) for r in range(tp)]
    if len({c.identity for c in ranks}) != tp:  # a prefill would refuse the second as already connected
        raise ConfigError(f"the decode ranks' certificates must name distinct identities: {ranks}")
    return ranks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Environment: KVLEND_CA names the cluster CA certificate; KVLEND_CERT and "
                                       "KVLEND_KEY each decode rank's certificate and key (PEM files; with "
                                       "--decode-tp above 1, {rank} in them is the TP rank).")
    add_workload_args(p)
    p.add_argument("--connect", required=True, action="append", metavar="HOST:PORT",
                   help="a prefill rank's control address; once per prefill rank (required)")
    p.add_argument("--inflight", type=int, default=16, help="requests fetched at once, at most (default 16)")
    p.add_argument("--report", help="write the JSON report to this file")
    p.add_argument("--chunk-pages", type=int, default=256, help="token pages per posted chunk (default 256)")
    args = p.parse_args(argv)
    addresses = [_address(a, p) for a in args.connect]
    if len(set(addresses)) != len(addresses):
        p.error(f"--connect: an address is named twice in {args.connect}")
    if args.inflight < 1:
        p.error(f"--inflight: must be >= 1, got {args.inflight}")
    logging.basicConfig(level=os.environ.get("KVLEND_LOG", "WARNING"),
                        format="decode %(levelname)s %(name)s: %(message)s")
    credentials = rank_credentials(args.decode_tp)  # before any work: a rank without credentials stops here

    config = model_config(args, "decode")
    model = toy_engine.ToyModel(config)
    prefill_config = model_config(args)
    reference_model = model if prefill_config == config else toy_engine.ToyModel(prefill_config)
    tpp, tp, limit = config.tokens_per_page, args.decode_tp, args.inflight
    # Whole remote pages land whole: a request may need its last one past num_tokens.
    span = max(tpp, prefill_config.tokens_per_page)
    per_request = -(-args.max_len // span) * (span // tpp)
    # Each request in flight holds its pages (a step decodes every fetched one before starting more);
    # the one being decoded also takes pages for its new tokens.
    num_pages = limit * per_request + -(-(args.max_len + args.max_new_tokens) // tpp) + 1
    cache = toy_engine.PagedKVCache(config, num_pages, seed=args.seed + 1, state_slots=limit)
    shards = [cache] if tp == 1 else [
        toy_engine.PagedKVCache(config, num_pages, state_slots=limit, replica=ReplicaRank(tp, r)) for r in range(tp)
    ]
    if args.metrics_port is not None:
        METRICS.serve(args.metrics_port)
    node_config = NodeConfig(transfer_timeout=args.timeout, chunk_pages=args.chunk_pages)
    nodes = [DecodeNode(s.layout(), load_backend("nixl", name=f"decode-{os.getpid()}-{r}", timeout=args.timeout),
                        credentials[r], config=node_config) for r, s in enumerate(shards)]
    reload_on_sighup(*nodes)  # renewed certificate files take over for new links
    expected = {f"req-{i}" for i in range(args.requests)}
    offered: dict[str, dict[int, tuple]] = {}  # request -> decode TP rank -> (link, offer), until every rank has one
    ready: deque[str] = deque()  # requests offered to every rank, not yet started, in arrival order
    seen: set[str] = set()  # requests offered to every rank
    active: dict[str, Request] = {}  # started and not yet decoded (holding pages)
    fetching: dict[Request, None] = {}  # started, some rank's fetch not yet reported by finished() (in order)
    owner: dict[tuple[int, int], Request] = {}  # (decode TP rank, fetch id) -> request
    completed: deque[Request] = deque()  # every rank's fetch finished, not yet decoded
    latencies, spans, descriptors, failures = [], [], [], []
    generated: list[tuple[str, list[int], list[int]]] = []  # (request, prompt, tokens decoded from the fetched KV)
    after_last_chunk: dict[str, list[float]] = {"on": [], "off": []}
    read_times: list[float] = []  # lent once prefill was done: the whole transfer after the last chunk
    wall = time.time() - time.monotonic()  # this process's clocks: the prefill stamps its chunks in wall time
    from_prefill = [0] * len(addresses)
    nbytes = nbytes_full = tokens = max_inflight = 0
    start = time.monotonic()
    links: list[list] = []
    try:
        for node in nodes:
            node.start()  # the node's thread does all I/O; this thread plans, decodes and verifies
        by_link = [{} for _ in nodes]  # decode TP rank -> link id -> index of its prefill in --connect
        for i, (host, port) in enumerate(addresses):
            row = [node.connect(host, port, args.timeout) for node in nodes]
            for rank, link in enumerate(row):
                by_link[rank][link.id] = i
            links.append(row)

        def file_offer(rank: int, link, offer) -> None:
            """An offer pushed to decode TP rank ``rank``: a request is ready once every rank has one."""
            name = offer.request
            if name not in expected or name in seen or rank in offered.get(name, {}):
                raise PeerProtocolError(f"decode rank {rank} was offered request {name!r} "
                                        f"{'again' if name in expected else 'that is not in the workload'}")
            got = offered.setdefault(name, {})
            if got:
                other = min(got)
                other_link, other_offer = got[other]
                if ((by_link[rank][link.id], offer.num_tokens)
                        != (by_link[other][other_link.id], other_offer.num_tokens)):
                    raise PeerProtocolError(f"the decode ranks were offered request {name!r} by different prefill "
                                            "ranks or with different lengths")
            got[rank] = (link, offer)
            if len(got) == tp:
                seen.add(name)
                ready.append(name)

        def take_offers() -> bool:
            """File every offer already pushed to any rank (never waits)."""
            got = False
            for rank, node in enumerate(nodes):
                while True:
                    try:
                        link, offer = node.next_offer(0)
                    except TransferTimeout:  # none waiting
                        break
                    file_offer(rank, link, offer)
                    got = True
            return got

        def pages_for(link, offer) -> int:
            """Page-table entries a request's destination needs (one table serves every attention group)."""
            # A progressive offer's later pages are not known yet: make room for the whole lease.
            need = destination_pages(link.plan, offer.num_tokens, offer.pages if offer.final else None)
            return max(n for g, n in need.items() if not link.plan.local.groups[g].recurrent)

        def start_request(name: str) -> None:
            got = offered.pop(name)
            per_rank = [got[r] for r in range(tp)]
            offer = per_rank[0][1]
            table = cache.alloc(max(pages_for(link, o) for link, o in per_rank))
            slot = cache.alloc_state()
            req = Request(name, offer.num_tokens, dict(offer.meta), by_link[0][per_rank[0][0].id], table, slot,
                          time.monotonic())
            active[name] = req
            fetching[req] = None
            for rank, (node, shard, (link, o)) in enumerate(zip(nodes, shards, per_rank)):
                try:
                    handle = node.start_fetch(o, shard.group_tables(table, slot), link=link)  # returns at once
                except PeerLost as exc:
                    raise PeerLost(f"request {name}: prefill rank {req.prefill} at {args.connect[req.prefill]} "
                                   f"is gone: {exc}") from None
                req.handles.append(handle)
                owner[rank, handle.id] = req

        def collect() -> bool:
            """Move requests whose every rank's fetch finished to ``completed``."""
            got = False
            for rank, node in enumerate(nodes):
                for handle in node.finished():
                    req = owner.pop((rank, handle.id), None)
                    if req is None:
                        continue
                    req.finished += 1
                    if req.finished == tp:
                        del fetching[req]
                        completed.append(req)
                        got = True
            return got

        def finish(req: Request) -> None:
            """Decode one fetched request, check its tokens, free its pages."""
            nonlocal nbytes, nbytes_full, tokens
            del active[req.name]
            results = [h.result() for h in req.handles]  # a failed fetch raises its error here
            meta = dict(req.handles[0].meta)  # as the final extension left it (a progressive lease's first token)
            try:
                if tp > 1:
                    toy_engine.merge_shards(cache, shards, req.table, req.slot)
                out = toy_engine.decode(model, cache, req.table, req.num_tokens, meta["first"],
                                        args.max_new_tokens, req.slot)
            finally:
                cache.free(req.table)  # every rank's fetch is done: nothing can still land in these pages
                cache.free_state(req.slot)
            generated.append((req.name, meta["prompt"], out))  # checked once every fetch is in (see below)
            if "last_chunk_at" in meta:  # the prefill's last chunk done -> every rank may start decoding
                ready_at = wall + req.started + max(h.timeline["finished"] for h in req.handles)
                tail = after_last_chunk["on" if meta.get("progressive") else "off"]
                tail.append(ready_at - meta["last_chunk_at"])
                if not meta.get("progressive"):
                    read_times.append(max(r.read_seconds or 0.0 for r in results))
            if any(r.bound != req.num_tokens for r in results):
                failures.append(req.name)
            seconds = max(r.seconds for r in results)  # start_fetch -> finished, the slowest rank
            latencies.append(seconds)
            spans.append((req.started, req.started + seconds))
            descriptors.append(sum(r.descriptors for r in results))
            nbytes += sum(r.bytes for r in results)
            nbytes_full += toy_engine.lent_bytes(links[req.prefill][0].plan.remote, req.num_tokens, windowed=False)
            tokens += req.num_tokens
            from_prefill[req.prefill] += 1

        def idle(remaining: float) -> None:
            """Nothing to do now: wait a moment for an offer (if one could start) or for a fetch to finish."""
            wait = min(POLL, remaining)
            try:
                if len(active) < limit and len(seen) < args.requests:
                    missing = [r for r in range(tp) if any(r not in got for got in offered.values())]
                    rank = missing[0] if missing else 0
                    file_offer(rank, *nodes[rank].next_offer(wait))
                elif fetching:
                    pending = [(r, h) for req in fetching for r, h in enumerate(req.handles) if not h.done]
                    if pending:  # the oldest; when all are done, finished() reports them on the next step
                        rank, handle = pending[0]
                        nodes[rank].wait([handle], wait)
                else:
                    time.sleep(wait)
            except TransferTimeout:
                pass

        # One engine step: start fetches for the offers that came in (the transfers run on the nodes'
        # threads while this one decodes), collect the finished fetches, decode and verify each.
        deadline = time.monotonic() + args.timeout
        while len(latencies) < args.requests:
            moved = len(seen) < args.requests and take_offers()  # once all are in, prefills may hang up
            while ready and len(active) < limit:  # every fetched request was decoded: active ones are fetching
                start_request(ready.popleft())
                max_inflight = max(max_inflight, sum(req.in_flight for req in fetching))
                moved = True
            moved = collect() or moved
            while completed:
                finish(completed.popleft())
                _progress(len(latencies), args.requests, len(failures), nbytes, start, len(fetching))
                moved = True
            now = time.monotonic()
            if moved:
                deadline = now + args.timeout
            elif now >= deadline:
                raise TransferTimeout(
                    f"decode: no lease offered and no fetch finished within {args.timeout:g} s "
                    f"({len(latencies)} of {args.requests} requests done, {len(fetching)} in flight, "
                    f"{len(seen)} offered to every rank)")
            else:
                idle(deadline - now)
    finally:
        # On a failure, cancel what is still in flight and let it go quiet on the nodes' own threads
        # before closing them (close() steps the loop itself while fetches are in flight).
        left = [(rank, h) for req in active.values() for rank, h in enumerate(req.handles) if not h.done]
        for _rank, handle in left:
            handle.cancel()
        for rank, node in enumerate(nodes):
            try:
                node.wait([h for r, h in left if r == rank], node_config.cancel_grace + 1.0)
            except KvlendError:
                pass  # close() tears the links down
        for node in nodes:
            node.close()
            node.backend.close()
    # The reference (prefill and decode alone, with the prefill's model and chunking) runs after the
    # transfers: computed in the loop, it would hold up fetches (and time) behind a second prefill.
    for name, prompt, out in generated:
        if out != toy_engine.generate_reference(reference_model, prompt, args.max_new_tokens, args.chunk_tokens):
            failures.append(name)
    busy = _busy_seconds(spans)
    report = {
        "requests": len(latencies),
        "tokens": tokens,
        "bytes": nbytes,
        "bytes_full": nbytes_full,
        "gbps": nbytes / busy / 1e9 if busy else 0.0,
        "latency_ms_p50": float(np.percentile(latencies, 50) * 1e3),
        "latency_ms_p99": float(np.percentile(latencies, 99) * 1e3),
        "descriptors_per_request": float(np.mean(descriptors)),
        "handshake_ms": max(link.handshake_ms for row in links for link in row),
        "model": "hybrid" if config.layer_kinds else "llama",
        "tokens_per_page": [prefill_config.tokens_per_page, tpp],
        "decode_tp": tp,
        "plan": links[0][0].plan.kind,
        "prefills": len(addresses),
        "prefill_requests": from_prefill,
        "inflight": limit,
        "max_inflight": max_inflight,
        "verified": not failures and len(latencies) == args.requests,
        "mismatched": failures,
    }
    report.update(_progressive_report(args, after_last_chunk, read_times, tokens / max(1, len(latencies))))
    text = json.dumps(report)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0 if report["verified"] else 1


if __name__ == "__main__":
    sys.exit(run_rank(main, "decode"))
