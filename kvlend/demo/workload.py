"""Options the example ranks must agree on (kept free of torch so ``kvlend --help`` stays fast)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from kvlend.errors import KvlendError

PRESET_NAMES = ("tiny", "llama", "hybrid")  # toy_engine.PRESETS; the engine rejects anything else
MODEL_NAMES = ("llama", "hybrid")
PROGRESSIVE = ("off", "on", "both")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=64, help="number of requests (default 64)")
    p.add_argument("--seed", type=int, default=0, help="prompt and model seed (default 0)")
    p.add_argument("--preset", default="tiny", choices=PRESET_NAMES,
                   help="toy model size: tiny, llama (Llama-3-8B KV geometry, bf16) or hybrid "
                        "(= tiny with --model hybrid) (default tiny)")
    p.add_argument("--model", default="llama", choices=MODEL_NAMES,
                   help="layer kinds: llama (full attention everywhere) or hybrid (sliding-window attention "
                        "over 64 tokens plus a sink, Mamba-style recurrent state, full attention) (default llama)")
    p.add_argument("--tokens-per-page", type=int, default=None,
                   help="the prefill's page size (default: the preset's, 16)")
    p.add_argument("--decode-tokens-per-page", type=int, default=None,
                   help="the decode's page size, an integer multiple or fraction of the prefill's (default: the same)")
    p.add_argument("--decode-tp", type=int, default=1,
                   help="decode tensor-parallel degree: that many decode ranks each read their head slice (default 1)")
    p.add_argument("--host-layers", type=int, default=0,
                   help="the prefill keeps its first N attention layers' pools in the HOST tier, lent with NAMED "
                        "rows beside the rest (pinned host memory when its cache is on a GPU) (default 0)")
    p.add_argument("--min-len", type=int, default=8, help="shortest prompt in tokens (default 8)")
    p.add_argument("--max-len", type=int, default=640, help="longest prompt in tokens (default 640)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens decode generates (default 8)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any one wait may take (default 60)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="chunked prefill: compute each prompt this many tokens at a time (default: all at once)")
    p.add_argument("--progressive", default="off", choices=PROGRESSIVE,
                   help="with --chunk-tokens: lend each request's pages as its chunks commit (on), only once "
                        "its prefill is done (off), or alternate the two request by request, to compare them "
                        "in one run (both) (default off)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics while the pair runs: the decode rank on this port, "
                        "prefill rank r on this port + 1 + r (needs prometheus_client)")


def progressive(args: argparse.Namespace, index: int) -> bool:
    """Whether request ``index`` is lent as its chunks commit (``--progressive both``: the even ones)."""
    return args.chunk_tokens is not None and (args.progressive == "on" or args.progressive == "both" and index % 2 == 0)


def workload_argv(args: argparse.Namespace) -> list[str]:
    """The same options as a command line, for launching a rank."""
    argv = [
        "--requests", str(args.requests), "--seed", str(args.seed), "--preset", args.preset,
        "--model", args.model, "--decode-tp", str(args.decode_tp), "--host-layers", str(args.host_layers),
        "--min-len", str(args.min_len), "--max-len", str(args.max_len),
        "--max-new-tokens", str(args.max_new_tokens), "--timeout", str(args.timeout),
    ]
    if args.metrics_port is not None:
        argv += ["--metrics-port", str(args.metrics_port)]
    if args.chunk_tokens is not None:
        argv += ["--chunk-tokens", str(args.chunk_tokens)]
    argv += ["--progressive", args.progressive]
    for flag, value in (("--tokens-per-page", args.tokens_per_page),
                        ("--decode-tokens-per-page", args.decode_tokens_per_page)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def run_rank(main: Callable[[], int], role: str) -> int:
    """Run a rank's ``main``; a kvlend failure is one line on stderr and exit status 1, Ctrl-C exits 130."""
    try:
        return main()
    except KvlendError as exc:
        print(f"{role}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
