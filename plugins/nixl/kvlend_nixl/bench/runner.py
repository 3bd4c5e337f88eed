"""``kvlend bench``: kvlend's read path against baselines measured in the same run.

Two NIXL agents in two processes on loopback: this process reads, a lender
process started with multiprocessing ``spawn`` owns the source pools and
answers commands over a pipe.  Every figure is reported next to a baseline
(raw NIXL on the same bytes, memcpy, per-page descriptors, host staging)
timed in the same run, so the ratios hold on any host even when the
absolute numbers do not.  A CLI tool, not core: it does I/O, clocks and
subprocesses.  Both agents run with the progress thread off and are
progressed by polling (see plugins/nixl/README.md).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import sys

from ..backend import NixlBackend
from .lender_process import LenderProcess
from .scenarios import SCENARIOS
from .sizes import FULL, QUICK
from .timing import XFER_TIMEOUT, BenchError


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                  if line.startswith("model name")), platform.processor())
    mem = next((line.split()[1] for line in _read("/proc/meminfo").splitlines() if line.startswith("MemTotal")), "0")
    return {"nproc": os.cpu_count(), "memory_gib": round(int(mem) / 2**20, 1), "cpu": model,
            "python": platform.python_version()}


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def run(scenarios: list[int], quick: bool, reps: int | None, progress=None) -> dict:
    """Run the scenarios; the lender process is always terminated."""
    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    sizes = QUICK if quick else FULL
    if reps is not None:  # S1/S2 repetitions; S3 and S5 keep their own request counts
        sizes = dataclasses.replace(sizes, reps=reps)
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        raise BenchError(f"--scenario: unknown scenario(s) {unknown}; have {sorted(SCENARIOS)}")
    report = {"machine": machine(), "quick": quick, "reps": sizes.reps, "scenarios": {}}
    # What is loaded by now (torch, NIXL) is never garbage: freeze it, or a full collection over it
    # (about 50 ms here) lands inside some timed run.  Serving engines do the same after start-up.
    gc.collect()
    gc.freeze()
    lender = LenderProcess()
    backend = NixlBackend(f"bench-reader-{os.getpid()}", timeout=XFER_TIMEOUT)
    try:
        for s in scenarios:
            report["scenarios"][str(s)] = SCENARIOS[s](lender, backend, sizes, progress)
    finally:
        backend.close()
        lender.close()
    return report
