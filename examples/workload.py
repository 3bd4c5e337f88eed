"""Options the example ranks must agree on (kept free of torch so ``kvlend --help`` stays fast)."""

from __future__ import annotations

import argparse

PRESET_NAMES = ("tiny", "llama")  # toy_engine.PRESETS; the engine rejects anything else


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=64, help="number of requests (default 64)")
    p.add_argument("--seed", type=int, default=0, help="prompt and model seed (default 0)")
    p.add_argument("--preset", default="tiny", choices=PRESET_NAMES, help="toy model shape (default tiny)")
    p.add_argument("--min-len", type=int, default=8, help="shortest prompt in tokens (default 8)")
    p.add_argument("--max-len", type=int, default=640, help="longest prompt in tokens (default 640)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens decode generates (default 8)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any one wait may take (default 60)")


def workload_argv(args: argparse.Namespace) -> list[str]:
    """The same options as a command line, for launching a rank."""
    return [
        "--requests", str(args.requests), "--seed", str(args.seed), "--preset", args.preset,
        "--min-len", str(args.min_len), "--max-len", str(args.max_len),
        "--max-new-tokens", str(args.max_new_tokens), "--timeout", str(args.timeout),
    ]
