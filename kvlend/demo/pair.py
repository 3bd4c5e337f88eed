"""Launch prefill ranks and a decode rank as processes on loopback and report.

Each run makes a throwaway cluster CA and issues every rank its own
certificate (``prefill-0``, ``prefill-1``, ..., ``decode-tp0``, ...), written
into the run's private temporary directory and handed to each rank through
``$KVLEND_CA``, ``$KVLEND_CERT`` and ``$KVLEND_KEY``; the CA's key never
leaves this process.  ``--prefills`` prefill processes listen on
127.0.0.1, each computing and lending its share of the requests; one decode
process connects to all of them, keeps up to ``--inflight`` fetches in
flight over NIXL at once, and checks every request's generated tokens
against a single-process reference.  ``run_pair`` returns the decode's
report; ``main`` prints it (``--json`` for one JSON object).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time

from kvlend.demo.workload import add_workload_args, run_rank, workload_argv
from kvlend.errors import KvlendError, TransferTimeout
from kvlend.security.certs import Authority, save_rank
from kvlend.security.credentials import CA_ENV, CERT_ENV, KEY_ENV, RANK


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _forward(stdout, listening: queue.SimpleQueue) -> None:
    """Hand the prefill's ``LISTENING`` line over and copy every other line (NIXL's logs) to stderr.

    Reading until EOF keeps the pipe from filling up and blocking the prefill;
    ``None`` says the prefill closed its stdout without listening.
    """
    found = False
    for line in stdout:
        if not found and line.startswith("LISTENING "):
            found = True
            listening.put(line)
        else:
            sys.stderr.write(line)
    if not found:
        listening.put(None)


def check_args(args: argparse.Namespace) -> None:
    """Refuse options the ranks would fail on, before starting any of them."""
    for name, low in (("requests", 1), ("seed", 0), ("min_len", 1), ("max_new_tokens", 1), ("decode_tp", 1),
                      ("host_layers", 0), ("tokens_per_page", 1), ("decode_tokens_per_page", 1),
                      ("prefills", 1), ("inflight", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise KvlendError(f"--{name.replace('_', '-')}: must be >= {low}, got {value}")
    if args.prefills > args.requests:
        raise KvlendError(f"--prefills: {args.prefills} prefill ranks for {args.requests} requests would leave "
                          "a rank with nothing to lend")
    if args.max_len < args.min_len:
        raise KvlendError(f"--max-len: {args.max_len} is shorter than --min-len {args.min_len}")
    if not args.timeout > 0:
        raise KvlendError(f"--timeout: must be > 0 seconds, got {args.timeout:g}")
    if args.chunk_tokens is not None and args.chunk_tokens < 1:
        raise KvlendError(f"--chunk-tokens: must be >= 1, got {args.chunk_tokens}")
    if args.progressive != "off" and args.chunk_tokens is None:
        raise KvlendError(f"--progressive {args.progressive}: lending chunk by chunk needs chunked prefill "
                          "(--chunk-tokens N)")
    if args.metrics_port is not None:
        if not 1 <= args.metrics_port <= 65534:
            raise KvlendError(f"--metrics-port: must be in [1, 65534] (the prefill ranks take the next ports), "
                              f"got {args.metrics_port}")
        if args.metrics_port + args.prefills > 65535:
            raise KvlendError(f"--metrics-port: {args.metrics_port} + {args.prefills} prefill ranks passes port "
                              f"65535 (prefill rank r serves on {args.metrics_port} + 1 + r)")
        if importlib.util.find_spec("prometheus_client") is None:
            raise KvlendError("--metrics-port needs prometheus_client: pip install 'kvlend[metrics]'")
    from kvlend.demo.prefill import model_config  # imports torch: only once the cheap checks passed

    prefill, decode = model_config(args), model_config(args, "decode")
    small, large = sorted((prefill.tokens_per_page, decode.tokens_per_page))
    if large % small:
        raise KvlendError(f"--decode-tokens-per-page: {decode.tokens_per_page} is neither a multiple nor a "
                          f"fraction of the prefill's {prefill.tokens_per_page}")
    if prefill.kv_heads % args.decode_tp:
        raise KvlendError(f"--decode-tp: {args.decode_tp} does not divide the model's {prefill.kv_heads} KV heads")
    if args.host_layers > len(prefill.attention_layers):
        raise KvlendError(f"--host-layers: the model has only {len(prefill.attention_layers)} attention layers, "
                          f"got {args.host_layers}")
    if args.max_len + args.max_new_tokens > prefill.max_context:
        raise KvlendError(f"--max-len {args.max_len} + --max-new-tokens {args.max_new_tokens} exceed the model's "
                          f"context of {prefill.max_context} tokens")


def prefill_argv(args, rank: int) -> list[str]:
    """The command line of prefill rank ``rank``."""
    return [sys.executable, "-m", "kvlend.demo.prefill", *workload_argv(args),
            "--prefills", str(args.prefills), "--rank", str(rank), "--max-inflight", str(lend_ahead(args))]


def decode_argv(args, addresses: list[str], report_file: str) -> list[str]:
    """The decode's command line: it connects to every prefill rank's ``HOST:PORT``."""
    connect = [arg for address in addresses for arg in ("--connect", address)]
    return [sys.executable, "-m", "kvlend.demo.decode", *workload_argv(args), *connect,
            "--inflight", str(args.inflight), "--report", report_file]


def lend_ahead(args) -> int:
    """Each prefill rank's ``--max-inflight``: as many as the decode's ``--inflight``.

    Any one rank can then fill the decode's window alone (near the end only one may have requests
    left); its cache holds that many requests' pages.
    """
    return args.inflight


def _start_prefill(args, rank: int, env: dict) -> tuple[subprocess.Popen, queue.SimpleQueue]:
    proc = subprocess.Popen(prefill_argv(args, rank), env=env, stdout=subprocess.PIPE, text=True)
    listening: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_forward, args=(proc.stdout, listening), daemon=True).start()
    return proc, listening


def _address(proc: subprocess.Popen, listening: queue.SimpleQueue, rank: int, timeout: float) -> str:
    """``HOST:PORT`` once prefill rank ``rank`` listens."""
    try:
        line = listening.get(timeout=timeout)
    except queue.Empty:
        raise TransferTimeout(f"prefill rank {rank} did not start listening within {timeout:g} s") from None
    if line is None:
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        raise KvlendError(f"prefill rank {rank} did not start (exit {code})")
    _, host, port = line.split()
    return f"{host}:{port}"


def rank_envs(args, directory: str) -> tuple[list[dict], dict]:
    """A throwaway cluster: each prefill rank's credentials environment, and the decode process's.

    The decode process runs ``--decode-tp`` ranks, each with its own certificate: ``{rank}`` in its
    ``$KVLEND_CERT`` and ``$KVLEND_KEY`` is the TP rank.
    """
    ca = Authority.create()  # in memory only: nobody can issue another rank for this cluster
    prefills = [save_rank(ca.issue(f"prefill-{rank}", "prefill"), directory) for rank in range(args.prefills)]
    for rank in range(args.decode_tp):
        save_rank(ca.issue(f"decode-tp{rank}", "decode"), directory)
    decode = {CA_ENV: os.path.join(directory, "ca.pem"), CERT_ENV: os.path.join(directory, f"decode-tp{RANK}.pem"),
              KEY_ENV: os.path.join(directory, f"decode-tp{RANK}.key")}
    return prefills, decode


def run_pair(args) -> dict:
    """Run the prefill ranks and the decode; returns the decode's report dict (raises KvlendError on failure)."""
    with tempfile.TemporaryDirectory(prefix="kvlend-pair-") as tmp:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        prefill_envs, decode_env = rank_envs(args, os.path.join(tmp, "certs"))
        report_file = os.path.join(tmp, "report.json")
        budget = args.timeout * (args.requests + 4)  # a backstop: every wait inside the ranks has its own deadline
        prefills: list[subprocess.Popen] = []
        decode = None
        try:
            started = []
            for rank in range(args.prefills):
                started.append(_start_prefill(args, rank, {**env, **prefill_envs[rank]}))
                prefills.append(started[-1][0])  # stopped in `finally` even if a later one fails to start
            addresses = [_address(proc, listening, rank, args.timeout)
                         for rank, (proc, listening) in enumerate(started)]
            start = time.monotonic()
            decode = subprocess.Popen(decode_argv(args, addresses, report_file), env={**env, **decode_env})
            try:
                decode_rc = decode.wait(budget)
                if not os.path.exists(report_file):  # the prefill ranks are stopped, not waited for
                    raise KvlendError(f"decode rank failed (exit {decode_rc}) before writing its report")
                prefill_rcs = [proc.wait(max(1.0, budget - (time.monotonic() - start))) for proc in prefills]
            except subprocess.TimeoutExpired:
                raise TransferTimeout(f"the pair did not finish within {budget:.0f} s") from None
            with open(report_file) as f:
                report = json.load(f)
            report["prefill_exits"] = prefill_rcs
            report["prefill_exit"] = next((rc for rc in prefill_rcs if rc != 0), 0)
            report["wall_s"] = time.monotonic() - start
            report["verified"] = bool(report["verified"] and decode_rc == 0 and not any(prefill_rcs))
            return report
        finally:
            for proc in (decode, *prefills):
                if proc is not None:
                    _stop(proc)


def format_report(r: dict) -> str:
    ranks = f"{r['prefills']} prefill rank{'' if r['prefills'] == 1 else 's'}"
    return "\n".join([
        "kvlend demo: prefill -> decode over NIXL (UCX, loopback)",
        f"  requests              {r['requests']} ({' + '.join(map(str, r['prefill_requests']))} from {ranks})",
        f"  prompt tokens         {r['tokens']}",
        f"  model                 {r['model']}, tokens/page {r['tokens_per_page'][0]} -> "
        f"{r['tokens_per_page'][1]}, decode tp {r['decode_tp']} ({r['plan']} plan)",
        f"  in flight             {r['inflight']} (max seen {r['max_inflight']}) from {ranks}",
        f"  bytes moved           {r['bytes']:,} ({r['bytes'] / 2**20:.1f} MiB; lending every page: "
        f"{r['bytes_full'] / 2**20:.1f} MiB)",
        f"  transfer throughput   {r['gbps']:.2f} GB/s",
        f"  transfer latency      p50 {r['latency_ms_p50']:.2f} ms, p99 {r['latency_ms_p99']:.2f} ms (per fetch)",
        f"  descriptors/request   {r['descriptors_per_request']:.1f}",
        f"  handshake             {r['handshake_ms']:.1f} ms",
        *_progressive_lines(r),
        f"  wall time             {r['wall_s']:.1f} s",
        "  verified              "
        + ("yes" if r["verified"] else "NO: " + ", ".join(r["mismatched"] or ["a rank failed"])),
    ])


def _progressive_lines(r: dict) -> list[str]:
    """Chunked prefill: from the last prefill chunk to "decode may start", per lending mode."""
    modes = r.get("after_last_chunk") or {}
    lines = []
    for mode in ("on", "off"):
        m = modes.get(mode)
        if m:
            lines.append(f"  last chunk -> ready   progressive {mode:3s}: p50 {m['p50_ms']:.2f} ms, "
                         f"p99 {m['p99_ms']:.2f} ms ({m['requests']} requests)")
    hidden = r.get("transfer_hidden")
    if hidden is not None:
        lines.append(f"  transfer hidden       {hidden * 100:.0f} % of the off-mode tail overlapped with prefill "
                     f"compute (one chunk's transfer is about {r['one_chunk_ms']:.2f} ms)")
    return lines


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The pair's options; ``kvlend demo`` adds them to its own parser."""
    p = p or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--prefills", type=int, default=2,
                   help="prefill processes; each lends its share of the requests (i %% N == its rank) (default 2)")
    p.add_argument("--inflight", type=int, default=16,
                   help="fetches the decode keeps in flight at once, at most (default 16)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    report = run_pair(args)
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report["verified"] else 1


if __name__ == "__main__":
    sys.exit(run_rank(main, "pair"))
