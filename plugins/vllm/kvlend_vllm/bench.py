"""kvlend's connector against vLLM's own NixlConnector: same machine, model, prompts and run.

    scripts/vllm-bench [--size large|mamba] [--lengths 512,2048,8192] [--requests 6] [--rounds 2]
                       [--shared 0,50,90 --shared-tokens 2048]
                       [--connectors kvlend,nixl:1,nixl:2,nixl:4,nixl-push:1]

Each round boots one connector's prefill/decode pair and router, runs every
row (each prompt length one request at a time, then a burst of concurrent
requests, then with ``--shared`` one row per shared-prefix share: prompts
whose first P % of tokens are the same, after one warm-up request with that
prefix, so both engines' prefix caches hold it and each connector may move
only what the decode lacks), stops the pair and boots the other connector's: the pairs never
compete for the CPU, and alternating rounds spread the host's noise over
both.  Per row: TTFT p50/p99 through the router, the decode leg's TTFT (TTFT
minus the prefill call, which both connectors share), and the KV transfer
time each connector reports for itself in vLLM's ``/metrics``
(reads alone, posted to landed: ``vllm:kvlend_read_time_seconds`` and
``vllm:nixl_xfer_time_seconds``; and kvlend's whole fetch, claim to done,
``vllm:kvlend_xfer_time_seconds``), mean per request, and the descriptors each posts
per request (``vllm:kvlend_num_descriptors``, ``vllm:nixl_num_descriptors``).  Once every
pair is stopped, kvlend's own read in process (``kvlend_nixl.bench.reference``) of each plain
kvlend row's bytes and descriptors per request is timed: the yardstick its reads inside
vLLM are held to (issue 26: at most 1.3x).  Ratios are baseline/kvlend:
above 1 means kvlend is faster.  ``nixl:N`` is NixlConnector with ``num_threads``
N, its progress threads (vLLM's default, plain ``nixl``, is 4): a fair run sweeps it.
``nixl-push[:N]`` is its push mode (NixlPushConnector): the router sends each
request to both engines at once, the decode registers its blocks with the
prefill, which WRITEs the KV when it finishes; its transfer figures are the
prefill's (writes, not reads).  ``mooncake`` is vLLM's MooncakeConnector over
tcp, driven the same way (the prefill pushes); it exports no transfer metrics,
so its rows have TTFT and decode leg only.  ``kvlend-progressive`` is kvlend with
its router in progressive mode: both legs at once, the prefill lending each chunk
of vLLM's chunked prefill as it computes; its rows add the share of the bytes
read while the prefill still computed and the tail (the last lend to the last
byte landed), from the decode's per-fetch lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from kvlend.ports import spare_port

from . import launch, models
from .demo import (
    EXTERNAL_TOKENS,
    KV_METRICS,
    boot,
    make_prompts,
    pct,
    scrape,
    settled,
    start_engine,
    start_router,
    workload,
    write_certs,
)

# summed over a row's requests
_KV_KEYS = ("kv_transfers", "kv_xfer_s", "kv_read_s", "kv_bytes", "kv_descriptors", "kv_failed")


def row(name: str, results: list[dict], before: dict, after: dict, wall: float, external: int = 0,
        fetches: list[dict] = ()) -> dict:
    """``external``: prompt tokens the decode took from KV transfers (vLLM's count); ``fetches``: kvlend's
    per-fetch lines of the row (``stats_path``)."""
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    leg = [r["ttft_s"] - r["prefill_ms"] / 1e3 for r in ok if r["ttft_s"] is not None and r["prefill_ms"]]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in _KV_KEYS}
    read = [f for f in fetches if f["ok"] and f.get("landed_s") is not None]
    return {"row": name, "requests": len(results), "errors": len(results) - len(ok),
            "ttft_s": ttft, "decode_leg_s": leg, **delta, "external_tokens": int(external), "wall_s": round(wall, 2),
            "early_bytes": sum(f["early_bytes"] for f in read), "fetched_bytes": sum(f["bytes"] for f in read),
            # the last lend (or, lent whole, the reads posted) to the last byte landed
            "tail_s": [f["landed_s"] - max(f["posted_s"] or 0, f["final_s"] or 0) for f in read],
            "read_s": [f["landed_s"] - f["posted_s"] for f in read if f["posted_s"] is not None]}


def external_tokens(url: str, before: int, timeout: float = 10.0) -> int:
    """Prompt tokens the decode at ``url`` took from KV transfers since ``before``, once the count holds
    still for a second (vLLM publishes a step's stats after the step) or at the deadline."""
    deadline, last, since = time.monotonic() + timeout, None, time.monotonic()
    while time.monotonic() < deadline:
        now = scrape(url, EXTERNAL_TOKENS).get("external_tokens", 0)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 1.0 and now > before:
            break
        time.sleep(0.25)
    return int((last or 0) - before)


def summary(rows: list[dict]) -> dict:
    """One connector's figures for one row, pooled over rounds (every request's TTFT, summed metrics)."""
    ttft = [t for r in rows for t in r["ttft_s"]]
    leg = [t for r in rows for t in r["decode_leg_s"]]
    total = {k: sum(r[k] for r in rows) for k in _KV_KEYS}
    n = total["kv_transfers"]
    requests = sum(r["requests"] for r in rows)
    fetched = sum(r.get("fetched_bytes", 0) for r in rows)
    tails = [t for r in rows for t in r.get("tail_s", ())]
    reads = [t for r in rows for t in r.get("read_s", ())]
    return {"requests": requests, "errors": sum(r["errors"] for r in rows),
            "read_while_prefilling_pct": round(100 * sum(r.get("early_bytes", 0) for r in rows) / fetched, 1)
            if fetched else None, "tail_p50_ms": _ms(pct(tails, 50)),
            "external_tokens_per_request": round(sum(r.get("external_tokens", 0) for r in rows) / requests)
            if requests else None,
            "ttft_p50_ms": _ms(pct(ttft, 50)), "ttft_p99_ms": _ms(pct(ttft, 99)),
            "decode_leg_p50_ms": _ms(pct(leg, 50)), "decode_leg_p99_ms": _ms(pct(leg, 99)),
            "read_ms_mean": round(total["kv_read_s"] / n * 1e3, 2) if n else None,
            "read_p50_ms": None if not reads else round(pct(reads, 50) * 1e3, 2),  # kvlend's, from its fetch lines
            "xfer_ms_mean": round(total["kv_xfer_s"] / n * 1e3, 2) if n else None,
            "mib_per_request": round(total["kv_bytes"] / n / 2**20, 2) if n else None,
            "descriptors_per_request": round(total["kv_descriptors"] / n, 1) if n else None,
            "transfers": int(n), "failed": int(total["kv_failed"])}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def parse_connector(spec: str) -> tuple[str, int | None]:
    """``kvlend``, ``kvlend-progressive``, ``nixl[:N]``, ``nixl-push[:N]`` (NixlConnector, pull or push, with
    num_threads N) or ``mooncake`` (MooncakeConnector over tcp) -> (kind, threads)."""
    kind, _, threads = spec.partition(":")
    if kind not in KV_METRICS or (threads and (not kind.startswith("nixl") or not threads.isdigit()
                                               or int(threads) < 1)):
        raise ValueError(f"connector {spec!r}: expected kvlend, kvlend-progressive, nixl[:N], nixl-push[:N] "
                         "or mooncake")
    return kind, int(threads) if threads else None


def run_pair(spec: str, args, model: str, max_len: int, log_dir: str, certs: dict) -> list[dict]:
    connector, threads = parse_connector(spec)
    name = spec.replace(":", "-")
    progressive = connector == "kvlend-progressive"
    stats = os.path.join(log_dir, f"{name}-fetches.jsonl")
    prefill_extra, decode_extra = ({"claim_wait": 25}, {"transfer_timeout": args.request_timeout}) if progressive \
        else ({}, {})  # a progressive fetch spans the prefill's queue and compute
    prefill_extra, decode_extra = {**prefill_extra, **args.kvlend_extra}, {**decode_extra, **args.kvlend_extra}
    engine = "kvlend" if progressive else connector
    servers = []
    try:
        side_channel, engine_id, push = spare_port(), f"{name}-prefill", None
        if connector == "nixl-push":  # the decode registers its blocks with the prefill, named in advance
            push = {"remote_engine_id": engine_id, "remote_host": "127.0.0.1", "remote_port": side_channel,
                    "tp_size": 1, "pp_size": 1}
        elif connector == "mooncake":  # the same, through the prefill's bootstrap server
            push = {"remote_engine_id": engine_id, "remote_bootstrap_addr": f"http://127.0.0.1:{side_channel}"}
        caching = models.prefix_caching(args.size)
        prefill = start_engine(f"{name}-prefill", engine, "kv_producer", model, max_len, args.kv_cache_gib,
                               log_dir, certs["prefill"], prefill_extra, dtype=args.dtype, nixl_threads=threads,
                               side_channel=side_channel, engine_id=engine_id, prefix_caching=caching)
        decode = start_engine(f"{name}-decode", engine, "kv_consumer", model, max_len, args.kv_cache_gib,
                              log_dir, certs["decode"], {"stats_path": stats, **decode_extra},
                              dtype=args.dtype, nixl_threads=threads, prefix_caching=caching)
        servers = [prefill, decode]
        servers.append(start_router(prefill, decode, log_dir, args.request_timeout, push, progressive))
        boot(servers, args.boot_timeout)
        url, rows = servers[2].url, []
        counted = prefill if push else decode  # the engine that moves the bytes counts them
        before = scrape(counted.url, KV_METRICS[connector])
        asyncio.run(workload(url, model, make_prompts(2, [64], seed=99), 2, 1, args.request_timeout))  # warm-up
        settled(counted.url, connector, before, 2)  # its metrics must not land in the first row
        plan = [(f"{n} tokens", make_prompts(args.requests, [n], seed=n), 1, None) for n in args.lengths]
        if args.burst:
            plan.append((f"{args.burst} concurrent x {args.burst_tokens} tokens",
                         make_prompts(args.burst, [args.burst_tokens], seed=7), args.burst, None))
        for share in args.shared:
            prompts = shared_prompts(args.requests + 1, args.shared_tokens, share)
            plan.append((f"{args.shared_tokens} tokens, {share}% shared prefix", prompts[1:], 1, prompts[:1]))
        for name, prompts, concurrency, warm in plan:
            if warm:  # puts the shared prefix in both engines' caches; not counted
                before = scrape(counted.url, KV_METRICS[connector])
                asyncio.run(workload(url, model, warm, args.max_tokens, 1, args.request_timeout))
                settled(counted.url, connector, before, 1)
            before = scrape(counted.url, KV_METRICS[connector])
            external = scrape(decode.url, EXTERNAL_TOKENS).get("external_tokens", 0)
            seen = len(fetch_lines(stats))
            results, wall = asyncio.run(workload(url, model, prompts, args.max_tokens, concurrency,
                                                 args.request_timeout))
            after = settled(counted.url, connector, before, len(results))
            external = external_tokens(decode.url, external)
            rows.append({"connector": spec, **row(name, results, before, after, wall, external,
                                                  fetch_lines(stats)[seen:])})
            print(f"bench: {spec} {name}: " + json.dumps(summary([rows[-1]])), flush=True)
        return rows
    finally:
        with ThreadPoolExecutor(max(1, len(servers))) as pool:
            list(pool.map(launch.Server.stop, servers))


def fetch_lines(path: str) -> list[dict]:
    """kvlend's per-fetch lines written so far (whole lines only); none for another connector."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().split("\n")[:-1] if line.strip()]


def shared_prompts(n: int, tokens: int, share: int) -> list[list[int]]:
    """``n`` prompts of ``tokens`` tokens whose first ``share`` % are the same (and differ after it)."""
    common = make_prompts(1, [tokens * share // 100], seed=1000 + share)[0] if share else []
    tails = make_prompts(n, [tokens - len(common)], seed=2000 + share)
    return [common + tail for tail in tails]


def merge(rows: list[dict]) -> list[dict]:
    """One line per (row, connector), pooled over the rounds."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["row"], r["connector"]), []).append(r)
    return [{"row": name, "connector": connector, "rounds": len(group), **summary(group)}
            for (name, connector), group in groups.items()]


def table(merged: list[dict]) -> str:
    """Each row's connectors in run order, then each baseline's ratios to each kvlend mode (above 1: kvlend
    faster), and progressive kvlend's to plain kvlend (above 1: progressive faster)."""
    lines = ["| row | connector | TTFT p50 ms | TTFT p99 ms | decode leg p50 ms | decode leg p99 ms | reads ms (mean) "
             "| whole transfer ms (mean) | MiB/request | descriptors/request | reads ms in process (p50) "
             "| KV tokens/request | read while prefilling | tail p50 ms | requests (errors) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by_row: dict[str, dict[str, dict]] = {}
    for m in merged:
        by_row.setdefault(m["row"], {})[m["connector"]] = m
    for name, runs in by_row.items():
        for connector, m in runs.items():
            ours = connector.startswith("kvlend")
            share = m.get("read_while_prefilling_pct")
            lines.append(f"| {name} | {connector} | {m['ttft_p50_ms']} | {m['ttft_p99_ms']} | "
                         f"{m['decode_leg_p50_ms']} | {m['decode_leg_p99_ms']} | {m['read_ms_mean']} | "
                         f"{m['xfer_ms_mean'] if ours else ''} | {m['mib_per_request']} | "
                         f"{m.get('descriptors_per_request')} | {_yardstick(m)} | "
                         f"{m.get('external_tokens_per_request')} | {'' if share is None else f'{share} %'} | "
                         f"{m.get('tail_p50_ms') if ours else ''} | {m['requests']} ({m['errors']}) |")
        modes = [c for c in runs if c.startswith("kvlend")]
        pairs = [(c, k) for k in modes for c in runs if not c.startswith("kvlend")]
        if "kvlend-progressive" in runs and "kvlend" in runs:
            pairs.append(("kvlend", "kvlend-progressive"))
        for connector, mode in pairs:
            m, ours = runs[connector], runs[mode]
            cells = [_ratio(m[k], ours[k]) for k in ("ttft_p50_ms", "ttft_p99_ms", "decode_leg_p50_ms",
                                                      "decode_leg_p99_ms", "read_ms_mean")]
            lines.append(f"| {name} | {connector}/{mode} | {' | '.join(cells)} | | | | | | | | |")
    return "\n".join(lines)


def yardsticks(merged: list[dict], reps: int = 20) -> None:
    """Time kvlend's own read in process (``kvlend_nixl.bench.reference``) of each plain kvlend row's bytes and
    descriptors per request, with the engines stopped, and add it to the row: ``in_process_read_ms`` and
    ``read_vs_in_process`` (the p50 of the row's reads in vLLM, from kvlend's fetch lines, over it; the
    target is at most 1.3)."""
    from kvlend_nixl.bench.reference import in_process_read

    for m in merged:
        if m["connector"] != "kvlend" or not m.get("mib_per_request") or not m.get("descriptors_per_request"):
            continue
        ref = in_process_read(int(m["mib_per_request"] * 2**20), round(m["descriptors_per_request"]), reps)
        m["in_process_read_ms"] = round(ref["p50_ms"], 2)
        m["in_process_read"] = {k: ref[k] for k in ("bytes", "descriptors", "verified")}
        ours = m.get("read_p50_ms") or m["read_ms_mean"]
        m["read_vs_in_process"] = round(ours / ref["p50_ms"], 2) if ours else None


def _yardstick(m: dict) -> str:
    if "in_process_read_ms" not in m:
        return ""
    return f"{m['in_process_read_ms']} (vLLM's p50 {m.get('read_p50_ms')}: {m['read_vs_in_process']}x)"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(models.SIZES), default="large")
    ap.add_argument("--lengths", default="512,2048,8192", help="prompt lengths, one row each")
    ap.add_argument("--requests", type=int, default=6, help="requests per length row (one at a time)")
    ap.add_argument("--burst", type=int, default=16, help="concurrent requests in the burst row (0: none)")
    ap.add_argument("--burst-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--dtype", choices=launch.DTYPES, default="bfloat16",
                    help="weights and KV cache (default bfloat16)")
    ap.add_argument("--rounds", type=int, default=2, help="kvlend then nixl, this many times")
    ap.add_argument("--connectors", default="kvlend,nixl",
                    help="run in this order each round: kvlend, kvlend-progressive (its router sends both legs at "
                         "once, the prefill lends chunk by chunk), nixl (vLLM's default num_threads 4), nixl:N, "
                         "nixl-push or nixl-push:N (its push mode: the prefill WRITEs; the router sends to both), "
                         "mooncake (MooncakeConnector over tcp, push)")
    ap.add_argument("--shared", default="", help="shared-prefix shares in %%, one row each (say 0,50,90)")
    ap.add_argument("--shared-tokens", type=int, default=2048, help="prompt length of the shared-prefix rows")
    ap.add_argument("--kvlend-extra", type=json.loads, default={},
                    help="more kv_connector_extra_config for kvlend's engines, as JSON (say '{\"heartbeat\": 0.5}')")
    ap.add_argument("--kv-cache-gib", type=int, default=4)
    ap.add_argument("--boot-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--json", help="write every row and the merged table here")
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.shared = [int(x) for x in args.shared.split(",") if x]
    if any(not 0 <= x < 100 for x in args.shared):
        ap.error("--shared: shares in [0, 100)")
    try:
        for spec in args.connectors.split(","):
            parse_connector(spec)
    except ValueError as exc:
        ap.error(f"--connectors: {exc}")
    max_len = models.SIZES[args.size]["max_position_embeddings"]
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    log_dir = tempfile.mkdtemp(prefix="kvlend-vllm-bench-")
    certs = write_certs(log_dir, {"prefill": "prefill",
                                  "decode": "decode"})  # one pair at a time: the rounds share them
    model = models.ensure_model(args.size)
    print(f"bench: model {model}, logs (and kvlend's per-fetch timelines, CONNECTOR-fetches.jsonl) in {log_dir}",
          flush=True)
    rows = []
    for round_no in range(args.rounds):
        for connector in args.connectors.split(","):
            print(f"bench: round {round_no + 1}/{args.rounds}: {connector}", flush=True)
            rows += run_pair(connector, args, model, max_len, log_dir, certs)
            if args.json:  # after every pair: a long run stopped early keeps what it measured
                write_json(args, rows, complete=False)
    merged = merge(rows)
    print("bench: kvlend's own read in process of each row's bytes per request (the engines are stopped)", flush=True)
    yardsticks(merged)
    print(table(merged))
    if args.json:
        write_json(args, rows, complete=True, merged=merged)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def write_json(args, rows: list[dict], complete: bool, merged: list[dict] | None = None) -> None:
    with open(args.json, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k != "json"}, "complete": complete,
                   "rows": rows, "merged": merged or merge(rows), "cpus": os.cpu_count()}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
