"""Disaggregated vLLM demo: prefill server + decode server + router, one workload.

Why: the end-to-end check of a KV connector is what a user would run — two
`vllm serve` processes joined by a connector, a router in front, and an
OpenAI client measuring TTFT and throughput.  `--check` also boots one plain
server and compares greedy tokens, so a connector that moves wrong KV fails.

    python -m kvlend_vllm.demo --connector kvlend|nixl [--size tiny|hybrid|mamba|lfm2|large] [--check] ...
    python -m kvlend_vllm.demo --router vllm-router --prefills 2 --decodes 1 [--policy power_of_two]

``--router vllm-router`` puts vLLM's own P/D router in front (it carries kvlend's
tickets unchanged), which takes any number of prefills and decodes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping

from kvlend.ports import spare_port
from kvlend.security.certs import Authority, save_rank
from kvlend_vllm import launch, models

HOST = "127.0.0.1"
DEFAULT_TOKENS = {"tiny": "32,300,1000", "hybrid": "32,300,1000", "mamba": "32,300,1000", "lfm2": "32,300,1000",
                  "large": "512,2048,8000"}
# Prometheus counters the server that transfers exports for each connector
# (the decode, which reads; the prefill in push mode, which writes), summed
# over label sets.  NixlConnector's are vLLM's; kvlend's are defined by
# kvlend_vllm.connector (names here must follow it).
KV_METRICS = {
    "nixl": {"kv_bytes": "vllm:nixl_bytes_transferred_sum",
             "kv_xfer_s": "vllm:nixl_xfer_time_seconds_sum",
             "kv_read_s": "vllm:nixl_xfer_time_seconds_sum",  # NIXL's transfer time is its reads alone
             "kv_transfers": "vllm:nixl_xfer_time_seconds_count",
             "kv_descriptors": "vllm:nixl_num_descriptors_sum",
             "kv_failed": "vllm:nixl_num_failed_transfers_total"},
    "kvlend": {"kv_bytes": "vllm:kvlend_bytes_transferred_sum",
               "kv_xfer_s": "vllm:kvlend_xfer_time_seconds_sum",
               "kv_read_s": "vllm:kvlend_read_time_seconds_sum",
               "kv_transfers": "vllm:kvlend_xfer_time_seconds_count",
               "kv_descriptors": "vllm:kvlend_num_descriptors_sum",
               "kv_failed": "vllm:kvlend_failed_transfers_total",
               "kv_recomputed_blocks": "vllm:kvlend_recomputed_blocks_total",
               "kv_local_blocks": "vllm:kvlend_local_blocks_total"},
}
KV_METRICS["nixl-push"] = KV_METRICS["nixl"]  # NixlPushConnector's, counted on the prefill
KV_METRICS["kvlend-progressive"] = KV_METRICS["kvlend"]  # kvlend, its router in progressive mode
KV_METRICS["mooncake"] = {}  # MooncakeConnector logs its transfer stats but exports no metric
# Prompt tokens the decode took from a KV transfer (vLLM's own count, the same for every connector).
EXTERNAL_TOKENS = {"external_tokens": 'vllm:prompt_tokens_by_source_total|source="external_kv_transfer"'}


def make_prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """n token-id prompts cycling over lengths; ids 4.. skip the specials."""
    rng = random.Random(seed)
    return [[rng.randrange(4, models.VOCAB) for _ in range(lengths[i % len(lengths)])]
            for i in range(n)]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def scrape(url: str, names: dict[str, str]) -> dict[str, float]:
    """Sum each named Prometheus sample of url/metrics over its label sets (``name|label="value"``: over
    those with that label)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for key, spec in names.items():
        name, _, label = spec.partition("|")
        labels = rf"{{[^}}]*{re.escape(label)}[^}}]*}}" if label else r"(?:{[^}]*})?"
        vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}{labels} (\S+)$", text, re.M)]
        if vals:
            out[key] = sum(vals)
    return out


def settled(url: str, connector: str, before: dict, expected: int, timeout: float = 30.0) -> dict:
    """The decode's metrics once they count ``expected`` more transfers (vLLM publishes them late)."""
    if not KV_METRICS[connector]:
        return {}  # a connector that exports none
    deadline = time.monotonic() + timeout
    while True:
        after = scrape(url, KV_METRICS[connector])
        done = after.get("kv_transfers", 0) + after.get("kv_failed", 0) - before.get("kv_transfers", 0) \
            - before.get("kv_failed", 0)
        if done >= expected or time.monotonic() > deadline:
            return after
        time.sleep(0.5)


def decode_metrics(decodes: list[launch.Server], connector: str, answered: int, timeout: float = 10.0) -> dict:
    """The decodes' transfer counters summed, once they count ``answered`` transfers (vLLM publishes a
    step's stats after the step) or at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        total: dict[str, float] = {}
        for decode in decodes:
            for key, value in scrape(decode.url, KV_METRICS[connector]).items():
                total[key] = total.get(key, 0.0) + value
        if total.get("kv_transfers", 0) + total.get("kv_failed", 0) >= answered or time.monotonic() > deadline:
            return total
        time.sleep(0.5)


def group_rss_gib(servers: list[launch.Server]) -> dict[str, float]:
    """RSS of each server's whole process group."""
    import psutil
    rss = {s.name: 0 for s in servers}
    pgids = {s.proc.pid: s.name for s in servers if s.proc}
    for p in psutil.process_iter(["pid", "memory_info"]):
        with contextlib.suppress(psutil.Error, OSError):
            name = pgids.get(os.getpgid(p.info["pid"]))
            if name and p.info["memory_info"]:
                rss[name] += p.info["memory_info"].rss
    return {k: round(v / 2**30, 2) for k, v in rss.items()}


def write_certs(log_dir: str, roles: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """A throwaway cluster for one run: a fresh CA whose key is never written, and a certificate per
    identity (``roles``: identity to its role) in a new private directory under ``log_dir`` (keys 0600).
    Each identity's environment (``KVLEND_CA``, ``KVLEND_CERT``, ``KVLEND_KEY``)."""
    authority = Authority.create()
    directory = tempfile.mkdtemp(prefix="certs-", dir=log_dir)  # 0700, and never a previous run's
    return {identity: save_rank(authority.issue(identity, role), directory) for identity, role in roles.items()}


def start_engine(name: str, connector: str | None, role: str | None, model: str, max_len: int, kv_gib: int,
                 log_dir: str, tls_env: dict[str, str], kvlend_extra: dict | None = None,
                 dtype: str = "bfloat16", nixl_threads: int | None = None, extra: tuple = (),
                 side_channel: int | None = None, engine_id: str | None = None,
                 prefix_caching: bool = True) -> launch.Server:
    """One `vllm serve` with ``connector`` (kvlend | nixl | nixl-push | mooncake) in ``role``, or a plain
    one (None); ``tls_env`` names kvlend's credentials (``write_certs``); ``side_channel``/``engine_id``:
    a NIXL engine's side-channel port or a Mooncake prefill's bootstrap port (default: a free one) and
    its engine id (default: vLLM's random one); ``prefix_caching``: off for a recurrent model
    (``models.prefix_caching``)."""
    port, extra_env, cfg = spare_port(), {}, None
    if connector in ("nixl", "nixl-push"):
        cfg = launch.nixl_transfer_config(role, nixl_threads, push=connector == "nixl-push", engine_id=engine_id)
        extra_env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
                     "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel or spare_port())}
    elif connector == "mooncake":
        cfg = launch.mooncake_transfer_config(role, engine_id)
        extra_env = {**launch.mooncake_env(), "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(side_channel or spare_port())}
    elif connector == "kvlend":
        cfg = launch.kvlend_transfer_config(role, kvlend_extra)
        extra_env = dict(tls_env)
    return launch.Server(name, f"http://{HOST}:{port}").start(
        launch.vllm_serve_argv(model, port, kv_transfer_config=cfg, max_model_len=max_len, dtype=dtype,
                               prefix_caching=prefix_caching, extra=extra),
        launch.vllm_env(kv_gib, extra_env), os.path.join(log_dir, f"{name}.log"))


def start_router(prefill: launch.Server, decode: launch.Server, log_dir: str, timeout: float,
                 push_params: dict | None = None, progressive: bool = False) -> launch.Server:
    """kvlend's router; with ``push_params`` in push mode, with ``progressive`` in kvlend's progressive
    mode (``kvlend_vllm.router``)."""
    port = spare_port()
    push = ["--push-params", json.dumps(push_params)] if push_params is not None else []
    push += ["--progressive"] if progressive else []
    return launch.Server("router", f"http://{HOST}:{port}", ("/health",)).start(
        [sys.executable, "-m", "kvlend_vllm.router", "--port", str(port), "--prefill", prefill.url,
         "--decode", decode.url, "--timeout", str(timeout), *push], None, os.path.join(log_dir, "router.log"))


def start_vllm_router(prefills: list[launch.Server], decodes: list[launch.Server], policy: str, log_dir: str,
                      timeout: float) -> launch.Server:
    """vLLM's ``vllm-router`` in P/D mode; start it once the engines are up (it checks them at start-up)."""
    port = spare_port()
    argv = [os.path.join(os.path.dirname(sys.executable), "vllm-router"), "--host", HOST, "--port", str(port),
            "--vllm-pd-disaggregation", "--policy", policy, "--prometheus-port", str(spare_port()),
            "--request-timeout-secs", str(int(timeout)), "--health-check-interval-secs", "1"]
    for server in prefills:
        argv += ["--prefill", server.url]
    for server in decodes:
        argv += ["--decode", server.url]
    return launch.Server("router", f"http://{HOST}:{port}", ("/health",)).start(
        argv, None, os.path.join(log_dir, "router.log"))


def boot(servers: list[launch.Server], timeout: float) -> None:
    """Wait for all servers together, printing a progress line every 5 s."""
    t0 = time.monotonic()
    last = 0.0
    announced: set[str] = set()
    while not all([s.check() for s in servers]):
        for s in servers:
            if s.boot_s is not None and s.name not in announced:
                announced.add(s.name)
                print(f"demo: {s.name} ready in {s.boot_s:.1f}s", flush=True)
        now = time.monotonic() - t0
        if now > timeout:
            raise TimeoutError("not ready after %.0fs: %s" % (now, ", ".join(
                f"{s.name} (log {s.log_path})" for s in servers if s.boot_s is None)))
        if now - last >= 5:
            last = now
            print("demo: booting %3.0fs  " % now + "  ".join(
                f"{s.name}={'ready' if s.boot_s is not None else '...'}" for s in servers),
                flush=True)
        time.sleep(0.5)


async def one_request(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion; TTFT is time to the first non-empty chunk."""
    t0 = time.perf_counter()
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    ttft, ids, text = None, [], []
    async for chunk in raw.parse():
        c = chunk.choices[0] if chunk.choices else None
        if c is None:
            continue
        new = getattr(c, "token_ids", None) or (c.model_extra or {}).get("token_ids") or []
        if (new or c.text) and ttft is None:
            ttft = time.perf_counter() - t0
        ids.extend(new)
        text.append(c.text or "")
    prefill_ms = raw.headers.get("x-kvlend-prefill-ms")
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "token_ids": ids,
            "text": "".join(text), "prefill_ms": float(prefill_ms) if prefill_ms else None}


async def workload(base_url: str, model: str, prompts: list[list[int]], max_tokens: int,
                   concurrency: int, timeout: float) -> tuple[list[dict], float]:
    """All prompts through base_url with at most `concurrency` in flight."""
    import openai
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none",
                                timeout=timeout, max_retries=0)
    sem = asyncio.Semaphore(concurrency)
    results: list[dict | None] = [None] * len(prompts)

    async def run(i: int) -> None:
        async with sem:
            try:
                results[i] = await one_request(client, model, prompts[i], max_tokens)
            except Exception as e:                      # reported, not fatal
                results[i] = {"error": f"{type(e).__name__}: {e}"[:500]}

    async def progress(t0: float) -> None:
        while True:
            await asyncio.sleep(5)
            done = [r for r in results if r is not None]
            print(f"demo: running {time.monotonic() - t0:4.0f}s  {len(done)}/{len(prompts)} done, "
                  f"{sum('error' in r for r in done)} errors", flush=True)

    t0 = time.monotonic()
    ticker = asyncio.create_task(progress(t0))
    try:
        await asyncio.gather(*(run(i) for i in range(len(prompts))))
    finally:
        ticker.cancel()
        await client.close()
    return results, time.monotonic() - t0


def report(args, results: list[dict], wall_s: float, boot_s: dict, rss: dict,
           kv: dict, mismatches: list[int] | None) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    pre = [r["prefill_ms"] for r in ok if r["prefill_ms"] is not None]
    toks = sum(len(r["token_ids"]) for r in ok)
    rep = {"connector": args.connector, "router": args.router, "prefills": args.prefills, "decodes": args.decodes,
           "size": args.size, "dtype": args.dtype, "requests": len(results),
           "ok": len(ok), "errors": len(results) - len(ok),
           "first_errors": [r["error"] for r in results if "error" in r][:3],
           "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
           "concurrency": args.concurrency,
           "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
           "prefill_ms_p50": pct(pre, 50), "output_tokens": toks,
           "tokens_per_s": toks / wall_s if wall_s else None, "run_s": wall_s,
           "boot_s": boot_s, "rss_gib": rss, **kv}
    if mismatches is not None:
        rep["check_vs_single_server"] = "match" if not mismatches else f"MISMATCH at {mismatches}"
    return rep


def print_report(rep: dict) -> None:
    def f(v) -> str:
        return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))

    print("\n== kvlend vLLM demo ==")
    for k, v in rep.items():
        if isinstance(v, dict):
            v = "  ".join(f"{a}={f(b)}" for a, b in v.items()) or "-"
        print(f"  {k:24} {f(v) if not isinstance(v, str) else v}")


def _names(role: str, count: int) -> list[str]:
    """Server (and kvlend identity) names: ``prefill``, or ``prefill-0``, ``prefill-1``, ..."""
    return [role] if count == 1 else [f"{role}-{i}" for i in range(count)]


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connector", choices=("kvlend", "nixl"), default="kvlend")
    ap.add_argument("--size", choices=sorted(models.SIZES), default="tiny")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompt-tokens", help="comma-separated prompt lengths, cycled "
                    "(default tiny %s, large %s)" % (DEFAULT_TOKENS["tiny"], DEFAULT_TOKENS["large"]))
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", choices=launch.DTYPES, default="bfloat16",
                    help="weights and KV cache (default bfloat16)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kv-cache-gib", type=int, help="per server (default 1, large 4)")
    ap.add_argument("--check", action="store_true",
                    help="also boot one plain server and compare greedy tokens")
    ap.add_argument("--router", choices=("kvlend", "vllm-router"), default="kvlend",
                    help="kvlend's router (this demo gives it one prefill, one decode) "
                         "or vLLM's vllm-router (any number)")
    ap.add_argument("--prefills", type=int, default=1, help="prefill servers (more than 1: --router vllm-router)")
    ap.add_argument("--decodes", type=int, default=1, help="decode servers (more than 1: --router vllm-router)")
    ap.add_argument("--policy", default="round_robin",
                    help="vllm-router's policy: round_robin, power_of_two (load-aware), cache_aware, ...")
    ap.add_argument("--gpu-memory-utilization", type=float,
                    help="per server, on a GPU host (three servers share one GPU with --check: 0.25)")
    ap.add_argument("--boot-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--log-dir", help="server logs (default: a new temp dir)")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args(argv)
    args.prompt_tokens = args.prompt_tokens or DEFAULT_TOKENS[args.size]
    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    max_len = models.SIZES[args.size]["max_position_embeddings"]
    if max(lengths) + args.max_tokens > max_len:
        ap.error(f"prompt + max tokens exceed the {args.size} model's {max_len} positions")
    if min(args.prefills, args.decodes) < 1 or (args.router == "kvlend" and max(args.prefills, args.decodes) > 1):
        ap.error("--prefills/--decodes: at least 1 each; more than 1 needs --router vllm-router")
    kv_gib = args.kv_cache_gib or (4 if args.size == "large" else 1)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvlend-vllm-demo-")
    os.makedirs(log_dir, exist_ok=True)

    # SIGTERM as well as Ctrl-C must reach the finally below, which kills groups.
    signal.signal(signal.SIGTERM, _interrupt)
    names = {"kv_producer": _names("prefill", args.prefills), "kv_consumer": _names("decode", args.decodes)}
    certs = write_certs(log_dir, {**dict.fromkeys(names["kv_producer"], "prefill"),
                                  **dict.fromkeys(names["kv_consumer"], "decode")})
    model = models.ensure_model(args.size)
    print(f"demo: model {model}, logs in {log_dir}", flush=True)

    def engine(name: str, role: str | None) -> launch.Server:
        gpu = () if args.gpu_memory_utilization is None else ("--gpu-memory-utilization",
                                                               str(args.gpu_memory_utilization))
        return start_engine(name, args.connector if role else None, role, model, max_len, kv_gib, log_dir,
                            certs.get(name, {}), dtype=args.dtype, extra=gpu,
                            prefix_caching=models.prefix_caching(args.size))

    servers: list[launch.Server] = []
    try:
        prefills = [engine(name, "kv_producer") for name in names["kv_producer"]]
        decodes = [engine(name, "kv_consumer") for name in names["kv_consumer"]]
        servers += prefills + decodes
        single = engine("single", None) if args.check else None
        servers += [single] if single else []
        if args.router == "kvlend":
            router = start_router(prefills[0], decodes[0], log_dir, args.request_timeout)
        else:  # it checks its workers as it starts: they must be up
            boot(servers, args.boot_timeout)
            router = start_vllm_router(prefills, decodes, args.policy, log_dir, args.request_timeout)
        servers.append(router)
        boot(servers, args.boot_timeout)
        boot_s = {s.name: round(s.boot_s, 1) for s in servers}
        print("demo: ready  " + "  ".join(f"{k}={v}s" for k, v in boot_s.items()), flush=True)

        prompts = make_prompts(args.prompts, lengths)
        results, wall = asyncio.run(workload(router.url, model, prompts, args.max_tokens,
                                             args.concurrency, args.request_timeout))
        rss = group_rss_gib(servers)
        kv = decode_metrics(decodes, args.connector, sum("error" not in r for r in results))
        if len(prefills) + len(decodes) > 2:  # how the router spread the work
            kv["served"] = {s.name: scrape(s.url, {"n": "vllm:request_success_total"}).get("n", 0.0)
                            for s in prefills + decodes}
        mismatches = None
        if single:
            print("demo: checking against the single server", flush=True)
            base, _ = asyncio.run(workload(single.url, model, prompts, args.max_tokens,
                                           args.concurrency, args.request_timeout))
            mismatches = [i for i, (a, b) in enumerate(zip(results, base))
                          if "error" in a or "error" in b or not a["token_ids"]
                          or a["token_ids"] != b["token_ids"]]
    finally:
        print("demo: stopping servers", flush=True)
        with ThreadPoolExecutor(max(1, len(servers))) as pool:   # in parallel: each may take 15 s
            list(pool.map(launch.Server.stop, servers))
    rep = report(args, results, wall, boot_s, rss, kv, mismatches)
    print_report(rep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0 if rep["errors"] == 0 and not mismatches else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:          # the servers are already stopped (finally)
        print("demo: interrupted", file=sys.stderr)
        sys.exit(130)
