"""The example pair end to end: prefill and decode as two processes over NIXL on loopback.

The decode rank checks every request's generated tokens against a
single-process reference; here the test also recomputes from the workload
what the report must say (prompt tokens, bytes moved), so a pair that moved
the wrong requests, or too few pages, cannot report success.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlend.control import SECRET_ENV, SECRET_FILE_ENV

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
import toy_engine  # noqa: E402

RUN_TIMEOUT = 120  # seconds for a whole pair run
REPORT_KEYS = {"requests", "bytes", "gbps", "latency_ms_p50", "latency_ms_p99", "descriptors_per_request",
               "handshake_ms", "verified"}


def expected(requests: int, max_len: int, min_len: int = 8, seed: int = 0) -> tuple[int, int]:
    """(prompt tokens, bytes read) for the pair's workload with the tiny preset: every page of every layer."""
    config = toy_engine.preset("tiny", seed=seed)
    prompts = toy_engine.make_prompts(requests, seed, min_len, max_len, config.vocab)
    tpp = config.tokens_per_page
    slot = 2 * config.kv_heads * tpp * config.head_dim * 4  # K and V, float32
    pages = sum(-(-len(p) // tpp) for p in prompts)
    return sum(map(len, prompts)), pages * config.layers * slot


def run_json(argv: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_example_pair_verifies_every_request():
    report = run_json([sys.executable, str(EXAMPLES / "pair.py"), "--json", "--requests", "12", "--max-len", "200",
                       "--timeout", "30"])
    assert report["verified"] is True
    assert report["mismatched"] == []
    assert report["requests"] == 12
    assert report["prefill_exit"] == 0
    assert (report["tokens"], report["bytes"]) == expected(12, 200)


@pytest.mark.slow
def test_kvlend_demo_reports_json():
    kvlend = Path(sys.executable).with_name("kvlend")
    report = run_json([str(kvlend), "demo", "--json", "--requests", "8", "--max-len", "128", "--timeout", "30"])
    assert REPORT_KEYS <= set(report)
    assert report["verified"] is True
    assert report["requests"] == 8
    tokens, nbytes = expected(8, 128)
    assert (report["tokens"], report["bytes"]) == (tokens, nbytes)
    assert report["gbps"] > 0
    assert 0 < report["latency_ms_p50"] <= report["latency_ms_p99"]
    assert report["descriptors_per_request"] >= toy_engine.preset("tiny").layers  # one region per layer at least
    assert report["handshake_ms"] > 0
