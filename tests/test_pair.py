"""The example pair end to end: prefill ranks and a decode as processes over NIXL on loopback.

The decode rank checks every request's generated tokens against a
single-process reference; here the test also recomputes from the workload
what the report must say (prompt tokens, bytes moved, requests per prefill
rank), so a pair that moved the wrong requests, or too few pages, cannot
report success.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvlend.demo import toy_engine
from tests.support.children import ROOT
from tests.support.example_pair import run_json

pytestmark = pytest.mark.system


REPORT_KEYS = {"requests", "bytes", "gbps", "latency_ms_p50", "latency_ms_p99", "descriptors_per_request",
               "handshake_ms", "prefills", "inflight", "max_inflight", "verified"}


def expected(requests: int, max_len: int, min_len: int = 8, seed: int = 0) -> tuple[int, int]:
    """(prompt tokens, bytes read) for the pair's workload with the tiny preset: every page of every layer."""
    config = toy_engine.preset("tiny", seed=seed)
    prompts = toy_engine.make_prompts(requests, seed, min_len, max_len, config.vocab)
    tpp = config.tokens_per_page
    slot = 2 * config.kv_heads * tpp * config.head_dim * 4  # K and V, float32
    pages = sum(-(-len(p) // tpp) for p in prompts)
    return sum(map(len, prompts)), pages * config.layers * slot


def test_example_pair_verifies_every_request():
    report = run_json([sys.executable, "-m", "kvlend.demo.pair", "--json", "--requests", "12", "--max-len", "200",
                       "--timeout", "30"])
    assert report["verified"] is True
    assert report["mismatched"] == []
    assert report["requests"] == 12
    assert report["prefill_exit"] == 0 and report["prefill_exits"] == [0, 0]
    assert (report["tokens"], report["bytes"]) == expected(12, 200)
    assert report["prefills"] == 2 and report["prefill_requests"] == [6, 6]  # i % 2 == rank
    assert report["inflight"] == 16 and 1 <= report["max_inflight"] <= 16


def test_kvlend_demo_reports_json_with_many_in_flight_from_two_prefills():
    """Short prompts are lent faster than the decode generates and checks them: fetches pile up towards
    the limit, never past it (the text form of the same report is tested in test_cli)."""
    kvlend = Path(sys.executable).with_name("kvlend")
    report = run_json([str(kvlend), "demo", "--json", "--requests", "12", "--max-len", "64", "--inflight", "8",
                       "--timeout", "30"])
    assert REPORT_KEYS <= set(report)
    assert report["verified"] is True
    assert report["requests"] == 12 and report["prefill_requests"] == [6, 6]
    assert report["prefills"] == 2 and report["inflight"] == 8 and 3 <= report["max_inflight"] <= 8, report
    tokens, nbytes = expected(12, 64)
    assert (report["tokens"], report["bytes"]) == (tokens, nbytes)
    assert report["gbps"] > 0
    assert 0 < report["latency_ms_p50"] <= report["latency_ms_p99"]
    assert report["descriptors_per_request"] >= toy_engine.preset("tiny").layers  # one region per layer at least
    assert report["handshake_ms"] > 0


def test_chunked_prefill_lent_progressively_verifies_and_reports_both_modes():
    """``--progressive both``: even requests are lent as their chunks commit, odd ones once prefill is
    done; every request's tokens equal the chunked single-process reference, every page was read."""
    requests, min_len, max_len = 6, 300, 700
    report = run_json([sys.executable, "-m", "kvlend.demo.pair", "--json", "--requests", str(requests),
                       "--min-len", str(min_len), "--max-len", str(max_len), "--chunk-tokens", "128",
                       "--progressive", "both", "--prefills", "1", "--inflight", "3", "--timeout", "60"])
    tokens, nbytes = expected(requests, max_len, min_len)
    assert report["verified"] is True and report["mismatched"] == [] and report["requests"] == requests
    assert report["tokens"] == tokens and report["bytes"] == nbytes  # progressive leases read every page once
    modes = report["after_last_chunk"]
    assert {m: modes[m]["requests"] for m in modes} == {"on": 3, "off": 3}
    assert all(modes[m]["p50_ms"] > 0 for m in modes)
    assert 0.0 <= report["transfer_hidden"] <= 1.0 and report["chunk_tokens"] == 128


def test_progressive_lending_needs_chunked_prefill():
    proc = subprocess.run([str(Path(sys.executable).parent / "kvlend"), "demo", "--progressive", "on"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs chunked prefill (--chunk-tokens N)" in proc.stderr
