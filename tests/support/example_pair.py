"""The demo's pair (``python -m kvlend.demo.pair``) as the tests run it: a process whose last stdout line
is its JSON report, and the bytes a hybrid model's run must move."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvlend.demo import toy_engine as te
from kvlend.security.credentials import CA_ENV, CERT_ENV, KEY_ENV

from .children import ROOT

RUN_TIMEOUT = 120  # seconds for a whole pair run


def run(argv: list[str]) -> str:
    """The command's stdout, after checking it exited 0 (without credentials of ours: the pair makes its own)."""
    env = {k: v for k, v in os.environ.items() if k not in (CA_ENV, CERT_ENV, KEY_ENV)}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr[-4000:]}"
    return proc.stdout


def run_json(argv: list[str]) -> dict:
    return json.loads(run(argv).strip().splitlines()[-1])


def pair(*args: str) -> dict:
    """The example pair with one prefill rank (two are the pair tests' business: one spawn less here)."""
    report = run_json([sys.executable, "-m", "kvlend.demo.pair", "--json", "--timeout", "30", "--prefills", "1",
                       *args])
    assert report["verified"] is True, report
    assert report["mismatched"] == [] and report["prefill_exit"] == 0
    return report


def expected_bytes(config: te.ModelConfig, requests: int, max_len: int, min_len: int = 8, **cache) -> tuple[int, int]:
    """(bytes lent, bytes if every page were lent) for the pair's workload on the prefill's layout."""
    layout = te.PagedKVCache(config, 1, **cache).layout()
    prompts = te.make_prompts(requests, 0, min_len, max_len, config.vocab)
    return (sum(te.lent_bytes(layout, len(p)) for p in prompts),
            sum(te.lent_bytes(layout, len(p), windowed=False) for p in prompts))
