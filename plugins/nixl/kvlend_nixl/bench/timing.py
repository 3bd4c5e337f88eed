"""Clocks for the benchmark: deadlines and the error a missed one raises, fair round-robin timing,
and the statistics every figure is reported with."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from kvlend.errors import KvlendError
from kvlend.protocol.fetch import PHASES

CALL_TIMEOUT = 120.0  # seconds for one lender command (pool allocation of a few GiB included)
XFER_TIMEOUT = 30.0


class BenchError(KvlendError):
    """The benchmark could not run (lender process died, a wait passed its deadline, bad data)."""


def stats(samples: list[float], nbytes: int | None = None) -> dict:
    ms = np.array(samples) * 1e3
    out = {"n": len(samples), "p50_ms": float(np.median(ms)), "min_ms": float(ms.min()), "max_ms": float(ms.max()),
           "p10_ms": float(np.percentile(ms, 10)), "p90_ms": float(np.percentile(ms, 90)),
           "p99_ms": float(np.percentile(ms, 99))}
    if nbytes:
        out["gbps"] = nbytes / (out["p50_ms"] / 1e3) / 1e9
    return out


def breakdown(handles: list) -> dict:
    """Where the fetches' time went: the p50 of each phase of their timelines (``FetchHandle.phases``), in ms."""
    out = {}
    for name in PHASES:
        values = [p[name] for p in (h.phases for h in handles) if p[name] is not None]
        out[f"p50 {name} ms"] = float(np.median(values)) * 1e3 if values else None
    return out


def side_by_side(methods: dict[str, Callable[[], object]], reps: int, warmup: int) -> dict[str, list[float]]:
    """Warm each method up (the first transfer wires UCX up: 100+ ms), then time them
    round-robin, so drift on a shared host hits every method alike.  Each round starts one
    method later: a method that always ran right after ``memcpy`` (which evicts the caches) while
    another always ran right after it (reading the pages it just warmed) would be timed unfairly."""
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    order = list(methods.items())
    for r in range(reps):
        k = r % len(order)
        for name, fn in order[k:] + order[:k]:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def backoff(spins: int, deadline: float, what: str) -> int:
    """Spin briefly, then yield the CPU (2-vCPU hosts starve the peer otherwise)."""
    if time.monotonic() > deadline:
        raise BenchError(f"{what} not done within {XFER_TIMEOUT:g} s")
    if spins > 50:
        time.sleep(20e-6)
    return spins + 1


def ratio(a: dict, b: dict) -> float:
    """Throughput of ``a`` over ``b`` (> 1: ``a`` is faster), from medians."""
    return b["p50_ms"] / a["p50_ms"]
