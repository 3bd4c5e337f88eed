"""Keep many ticket fetches going through a DecodeNode and check every byte: the driver of the
scenarios that load a decode with requests in flight (5 and 7)."""

from __future__ import annotations

import time

import numpy as np

from .pools import GROUP, expected_ok
from .timing import XFER_TIMEOUT, BenchError, breakdown

IDLE_WAIT = 0.002  # s; the node's loop cuts it short for reads in flight and deadlines


def keep_in_flight(decode, work: list, arrays: list[np.ndarray], inflight: int, what: str) -> dict:
    """Redeem ``work`` ((side, source slots, ticket) each) with ``inflight`` fetches going, each into
    pages of ``arrays`` of its own, driving the node's loop from here (it has no thread of its own).
    Every byte is checked once all are done, as the raw baseline's are: checks between fetches would
    leave each next one cold caches that the engine's loop would not.  Returns wall seconds and this
    process's CPU seconds (the node's loop and this driver), and the p50 of each phase of the fetches."""
    need = sum(len(src) for _, src, _ in work)
    if need > arrays[0].shape[0]:
        raise BenchError(f"{what}: {need} destination pages needed, the pools have {arrays[0].shape[0]}")
    running: dict[int, tuple] = {}
    done: list[tuple] = []
    pending = list(work)
    pending.reverse()  # pop() from the end: the first request goes first
    next_page = 0
    start, start_cpu = time.perf_counter(), time.process_time()
    while pending or running:
        with decode.batch():  # the fetches an engine step would start: their claims go out together
            while pending and len(running) < inflight:
                _, src, ticket = pending.pop()
                dst = np.arange(next_page, next_page + len(src), dtype=np.int64)
                next_page += len(src)
                handle = decode.start_fetch(ticket, {GROUP: dst}, timeout=XFER_TIMEOUT)
                running[handle.id] = (handle, src, dst)
        finished = decode.finished()  # steps the node's loop once, without waiting
        if not finished:
            decode.step(IDLE_WAIT)  # as an engine's loop would: sleep in poll until a message comes
        for handle in finished:
            done.append(running.pop(handle.id))
        if time.perf_counter() - start > XFER_TIMEOUT * 4:
            raise BenchError(f"{what}: {len(running)} kvlend fetches still running")
    seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    for handle, _, _ in done:
        handle.result()  # raises its error
    verified = all(expected_ok(a, r, src, dst) for _, src, dst in done for r, a in enumerate(arrays))
    return {"seconds": seconds, "cpu_seconds": cpu, "verified": verified,
            "breakdown": breakdown([handle for handle, _, _ in done])}
