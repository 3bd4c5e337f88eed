"""Real NIXL agents for the tests: one per call under a unique name, regions over numpy arrays,
a backing-off poll loop, and the lender that runs in a child process."""

from __future__ import annotations

import secrets
import struct
import time

import numpy as np

from kvlend.core.layout import MemoryKind, MemoryRegion
from kvlend.transport import Completion, load_backend

PAGE = 4096


def nixl(prefix: str):
    """A real NIXL agent (UCX) under a name unique to this process and call."""
    return load_backend("nixl", name=f"{prefix}-{secrets.token_hex(4)}")


def host_region(arr: np.ndarray, name: str, page: int = PAGE) -> MemoryRegion:
    return MemoryRegion(name, MemoryKind.HOST, 0, arr.nbytes, page, arr.nbytes // page, arr.ctypes.data)


def random_bytes(size: int, seed: int) -> np.ndarray:
    """``size`` random bytes from ``seed`` (raw generator output: 0.3 s for 256 MiB)."""
    words = np.random.default_rng(seed).bit_generator.random_raw(-(-size // 8))
    return words.view(np.uint8)[:size]


def poll_until(initiator, tags, deadline_s: float, others=()) -> dict[bytes, Completion]:
    """Poll ``initiator`` (and ``others``, the targets) until every tag completed.

    Backs off from 0 to a 1 ms sleep instead of spinning: NIXL's progress and
    the peer need the CPU too.  Fails the test when ``deadline_s`` passes.
    """
    want, got = set(tags), {}
    end = time.monotonic() + deadline_s
    pause = 0.0
    while want - set(got):
        for other in others:
            other.poll()
        fresh = initiator.poll()
        for c in fresh:
            got[c.tag] = c
        if time.monotonic() > end:
            raise AssertionError(f"tags {sorted(want - set(got))} not complete within {deadline_s} s")
        pause = 0.0 if fresh else min(max(pause * 2, 50e-6), 1e-3)
        time.sleep(pause)
    return got


def lender_main(conn, name: str, size: int, seed: int) -> None:
    """Child process: lend a pattern-filled buffer until told to stop.

    Sends its metadata and then the buffer address (8 bytes) as plain bytes,
    then keeps polling so the reader's first transfer can complete.
    """
    from kvlend_nixl import NixlBackend

    buf = random_bytes(size, seed)
    with NixlBackend(name) as backend:
        backend.register([host_region(buf, "lent")])
        conn.send_bytes(backend.metadata())
        conn.send_bytes(struct.pack("<Q", buf.ctypes.data))
        pause = 0.0
        while not conn.poll(pause):
            backend.poll()
            pause = min(max(pause * 2, 50e-6), 1e-3)
