"""Keep many ticket fetches going through a DecodeNode and check every byte: the driver of the
scenarios that load a decode with requests in flight (5 and 7)."""

from __future__ import annotations

import time

import numpy as np

from .pools import GROUP, expected_ok
from .timing import XFER_TIMEOUT, BenchError

IDLE_WAIT = 0.002  # s; the node's loop cuts it short for reads in flight and deadlines


def keep_in_flight(decode, work: list, arrays: list[np.ndarray], inflight: int, what: str) -> dict:
    """Redeem ``work`` ((side, source slots, ticket) each) with ``inflight`` fetches going, each into
    free pages of ``arrays``, driving the node's loop from here (it has no thread of its own); check
    every byte as each ends.  Returns wall seconds and this process's
    CPU seconds (the node's loop thread and this driver), the checks left out of both."""
    free = list(range(arrays[0].shape[0]))
    running: dict[int, tuple] = {}
    pending = list(work)
    pending.reverse()  # pop() from the end: the first request goes first
    checking = checking_cpu = 0.0
    verified = True
    start, start_cpu = time.perf_counter(), time.process_time()
    while pending or running:
        while pending and len(running) < inflight:
            _, src, ticket = pending.pop()
            dst = np.array(free[:len(src)], dtype=np.int64)
            del free[:len(src)]
            handle = decode.start_fetch(ticket, {GROUP: dst}, timeout=XFER_TIMEOUT)
            running[handle.id] = (handle, src, dst)
        finished = decode.finished()  # steps the node's loop once, without waiting
        if not finished:
            decode.step(IDLE_WAIT)  # as an engine's loop would: sleep in poll until a message comes
        for handle in finished:
            _, src, dst = running.pop(handle.id)
            t, t_cpu = time.perf_counter(), time.process_time()
            handle.result()  # raises its error
            verified &= all(expected_ok(a, r, src, dst) for r, a in enumerate(arrays))
            checking += time.perf_counter() - t
            checking_cpu += time.process_time() - t_cpu
            free.extend(dst.tolist())
        if time.perf_counter() - start > XFER_TIMEOUT * 4:
            raise BenchError(f"{what}: {len(running)} kvlend fetches still running")
    return {"seconds": time.perf_counter() - start - checking,
            "cpu_seconds": time.process_time() - start_cpu - checking_cpu, "verified": verified}
