"""kvlend's connector against vLLM's own NixlConnector: same machine, model, prompts and run.

    scripts/vllm-bench [--size large] [--lengths 512,2048,8192] [--requests 6] [--rounds 2]

Each round boots one connector's prefill/decode pair and router, runs every
row (each prompt length one request at a time, then a burst of concurrent
requests), stops the pair and boots the other connector's: the pairs never
compete for the CPU, and alternating rounds spread the host's noise over
both.  Per row: TTFT p50/p99 through the router, the decode leg's TTFT (TTFT
minus the prefill call, which both connectors share), and the KV transfer
time each connector reports for itself in vLLM's ``/metrics``
(reads alone, posted to landed: ``vllm:kvlend_read_time_seconds`` and
``vllm:nixl_xfer_time_seconds``; and kvlend's whole fetch, claim to done ack,
``vllm:kvlend_xfer_time_seconds``), mean per request.  Ratios are nixl/kvlend:
above 1 means kvlend is faster.
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

from . import launch, models
from .demo import KV_METRICS, boot, make_prompts, pct, scrape, start_engine, start_router, workload, write_certs

_KV_KEYS = ("kv_transfers", "kv_xfer_s", "kv_read_s", "kv_bytes", "kv_failed")  # summed over a row's requests


def row(name: str, results: list[dict], before: dict, after: dict, wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    leg = [r["ttft_s"] - r["prefill_ms"] / 1e3 for r in ok if r["ttft_s"] is not None and r["prefill_ms"]]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in _KV_KEYS}
    return {"row": name, "requests": len(results), "errors": len(results) - len(ok),
            "ttft_s": ttft, "decode_leg_s": leg, **delta, "wall_s": round(wall, 2)}


def summary(rows: list[dict]) -> dict:
    """One connector's figures for one row, pooled over rounds (every request's TTFT, summed metrics)."""
    ttft = [t for r in rows for t in r["ttft_s"]]
    leg = [t for r in rows for t in r["decode_leg_s"]]
    total = {k: sum(r[k] for r in rows) for k in _KV_KEYS}
    n = total["kv_transfers"]
    return {"requests": sum(r["requests"] for r in rows), "errors": sum(r["errors"] for r in rows),
            "ttft_p50_ms": _ms(pct(ttft, 50)), "ttft_p99_ms": _ms(pct(ttft, 99)),
            "decode_leg_p50_ms": _ms(pct(leg, 50)), "decode_leg_p99_ms": _ms(pct(leg, 99)),
            "read_ms_mean": round(total["kv_read_s"] / n * 1e3, 2) if n else None,
            "xfer_ms_mean": round(total["kv_xfer_s"] / n * 1e3, 2) if n else None,
            "mib_per_request": round(total["kv_bytes"] / n / 2**20, 2) if n else None,
            "transfers": int(n), "failed": int(total["kv_failed"])}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def settled(url: str, connector: str, before: dict, expected: int, timeout: float = 30.0) -> dict:
    """The decode's metrics once they count ``expected`` more transfers (vLLM publishes them late)."""
    deadline = time.monotonic() + timeout
    while True:
        after = scrape(url, KV_METRICS[connector])
        done = after.get("kv_transfers", 0) + after.get("kv_failed", 0) - before.get("kv_transfers", 0) \
            - before.get("kv_failed", 0)
        if done >= expected or time.monotonic() > deadline:
            return after
        time.sleep(0.5)


def run_pair(connector: str, args, model: str, max_len: int, log_dir: str, certs: dict) -> list[dict]:
    servers = []
    try:
        prefill = start_engine(f"{connector}-prefill", connector, "kv_producer", model, max_len, args.kv_cache_gib,
                               log_dir, certs["prefill"], dtype=args.dtype)
        decode = start_engine(f"{connector}-decode", connector, "kv_consumer", model, max_len, args.kv_cache_gib,
                              log_dir, certs["decode"], {"stats_path": os.path.join(log_dir, "kvlend-fetches.jsonl")},
                              dtype=args.dtype)
        servers = [prefill, decode]
        servers.append(start_router(prefill, decode, log_dir, args.request_timeout))
        boot(servers, args.boot_timeout)
        url, rows = servers[2].url, []
        before = scrape(decode.url, KV_METRICS[connector])
        asyncio.run(workload(url, model, make_prompts(2, [64], seed=99), 2, 1, args.request_timeout))  # warm-up
        settled(decode.url, connector, before, 2)  # its metrics must not land in the first row
        plan = [(f"{n} tokens", make_prompts(args.requests, [n], seed=n), 1) for n in args.lengths]
        plan.append((f"{args.burst} concurrent x {args.burst_tokens} tokens",
                     make_prompts(args.burst, [args.burst_tokens], seed=7), args.burst))
        for name, prompts, concurrency in plan:
            before = scrape(decode.url, KV_METRICS[connector])
            results, wall = asyncio.run(workload(url, model, prompts, args.max_tokens, concurrency,
                                                 args.request_timeout))
            after = settled(decode.url, connector, before, len(results))
            rows.append({"connector": connector, **row(name, results, before, after, wall)})
            print(f"bench: {connector} {name}: " + json.dumps(summary([rows[-1]])), flush=True)
        return rows
    finally:
        with ThreadPoolExecutor(max(1, len(servers))) as pool:
            list(pool.map(launch.Server.stop, servers))


def merge(rows: list[dict]) -> list[dict]:
    """One line per (row, connector), pooled over the rounds."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["row"], r["connector"]), []).append(r)
    return [{"row": name, "connector": connector, "rounds": len(group), **summary(group)}
            for (name, connector), group in groups.items()]


def table(merged: list[dict]) -> str:
    lines = ["| row | connector | TTFT p50 ms | TTFT p99 ms | decode leg p50 ms | decode leg p99 ms | reads ms (mean) "
             "| whole transfer ms (mean) | MiB/request | requests (errors) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    by_row = {}
    for m in merged:
        by_row.setdefault(m["row"], {})[m["connector"]] = m
    for name, pair in by_row.items():
        for connector in ("kvlend", "nixl"):
            m = pair.get(connector)
            if m:
                lines.append(f"| {name} | {connector} | {m['ttft_p50_ms']} | {m['ttft_p99_ms']} | "
                             f"{m['decode_leg_p50_ms']} | {m['decode_leg_p99_ms']} | {m['read_ms_mean']} | "
                             f"{m['xfer_ms_mean'] if connector == 'kvlend' else ''} | {m['mib_per_request']} | "
                             f"{m['requests']} ({m['errors']}) |")
        if len(pair) == 2 and pair["nixl"]["ttft_p50_ms"] and pair["kvlend"]["ttft_p50_ms"]:
            ratio = pair["nixl"]["ttft_p50_ms"] / pair["kvlend"]["ttft_p50_ms"]
            leg = _ratio(pair["nixl"]["decode_leg_p50_ms"], pair["kvlend"]["decode_leg_p50_ms"])
            reads = _ratio(pair["nixl"]["read_ms_mean"], pair["kvlend"]["read_ms_mean"])
            p99 = _ratio(pair["nixl"]["ttft_p99_ms"], pair["kvlend"]["ttft_p99_ms"])
            leg99 = _ratio(pair["nixl"]["decode_leg_p99_ms"], pair["kvlend"]["decode_leg_p99_ms"])
            lines.append(f"| {name} | nixl/kvlend | {ratio:.2f}x | {p99} | {leg} | {leg99} | {reads} | | | |")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(models.SIZES), default="large")
    ap.add_argument("--lengths", default="512,2048,8192", help="prompt lengths, one row each")
    ap.add_argument("--requests", type=int, default=6, help="requests per length row (one at a time)")
    ap.add_argument("--burst", type=int, default=16, help="concurrent requests in the last row")
    ap.add_argument("--burst-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--dtype", choices=launch.DTYPES, default="bfloat16",
                    help="weights and KV cache (default bfloat16)")
    ap.add_argument("--rounds", type=int, default=2, help="kvlend then nixl, this many times")
    ap.add_argument("--connectors", default="kvlend,nixl")
    ap.add_argument("--kv-cache-gib", type=int, default=4)
    ap.add_argument("--boot-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--json", help="write every row and the merged table here")
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    max_len = models.SIZES[args.size]["max_position_embeddings"]
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    log_dir = tempfile.mkdtemp(prefix="kvlend-vllm-bench-")
    certs = write_certs(log_dir, "prefill", "decode")  # one pair at a time: the rounds share them
    model = models.ensure_model(args.size)
    print(f"bench: model {model}, logs (and kvlend's per-fetch timeline, kvlend-fetches.jsonl) in {log_dir}",
          flush=True)
    rows = []
    for round_no in range(args.rounds):
        for connector in args.connectors.split(","):
            print(f"bench: round {round_no + 1}/{args.rounds}: {connector}", flush=True)
            rows += run_pair(connector, args, model, max_len, log_dir, certs)
    merged = merge(rows)
    print(table(merged))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows,
                       "merged": merged, "cpus": os.cpu_count()}, f, indent=1)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
