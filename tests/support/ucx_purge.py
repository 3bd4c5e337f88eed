"""Reproducer of the UCX crash in a NIXL target over tcp (docs/faults.md, "UCX purges queued GET answers").

One target (the lender) and one reader, both real NIXL agents over ``UCX_TLS=tcp`` in their own
processes.  The target is stopped (SIGSTOP); the reader posts reads of ``--bytes`` in ``--piece``
descriptors and never progresses its agent again (as a retired agent, or a decode that stalls);
the target is resumed and answers until the sockets are full, and the rest of its answers wait
inside UCX; then the reader is SIGKILLed, which closes its socket, and UCX purges the waiting
answers.  With ``--window`` the reader posts only what the TCP read window admits
(``kvlend.core.tcpwindow``), so no answer ever waits.

Prints one JSON line: how the target ended (``rc``: None if it was still alive ``--grace`` seconds
after the reader died, else its exit status, negative for a signal) and what was posted.

    python -m tests.support.ucx_purge --bytes 64M [--window] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import struct
import sys
import time

import numpy as np

# The children's environment: tcp only, and glibc keeping freed blocks in the heap (``_litter``).
_CHILD_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo",
              "MALLOC_MMAP_THRESHOLD_": str(4 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
SEGFAULT_OR_ABORT = (-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS, 134, 139)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _litter(block: int = 1 << 20, count: int = 64) -> list:
    """Leave freed heap memory whose every 8-byte word reads as UCX's IOV datatype class (``& 7 == 2``).

    UCX's request pool grows by malloc'd chunks, which hold what the process freed before; a
    long-lived prefill's heap holds anything.  This makes the stale ``send.datatype`` that a GET
    answer inherits read IOV, the case that crashes, rather than leave it to chance.  The blocks
    are kept apart by small live ones (so they are not merged and handed back to the system), and
    the child runs with ``MALLOC_MMAP_THRESHOLD_`` above ``block`` (so they come from the heap).
    Returns the small blocks, to be kept.
    """
    word = (2).to_bytes(8, "little")
    littered, pins = [], []
    for _ in range(count):
        littered.append(bytearray(word * (block // 8)))
        pins.append(bytearray(1024))  # above pymalloc's 512 bytes: from malloc, between the big ones
    del littered
    return pins


def _target(conn, size: int, litter: bool) -> None:
    """The lender: register ``size`` bytes, hand out its metadata and address, then poll until told to stop."""
    from kvlend_nixl import NixlBackend
    from tests.support.agents import host_region, random_bytes

    buf = random_bytes(size, 7)
    with NixlBackend(f"purge-target-{os.getpid()}") as backend:
        backend.register([host_region(buf, "lent")])
        pins = _litter() if litter else []  # noqa: F841 (kept alive while serving)
        conn.send_bytes(backend.metadata())
        conn.send_bytes(struct.pack("<Q", buf.ctypes.data))
        while not conn.poll(0.0005):
            backend.poll()


def _reader(conn, size: int, piece: int, window: bool) -> None:
    """The reader: post the reads (all of them, or what the window admits) once told, then never progress."""
    from kvlend.core.layout import MemoryKind
    from kvlend.core.reads import ReadBatch
    from kvlend_nixl import NixlBackend
    from tests.support.agents import host_region, poll_until

    dst = np.zeros(size, dtype=np.uint8)
    with NixlBackend(f"purge-reader-{os.getpid()}") as backend:
        backend.register([host_region(dst, "dst")])
        peer = backend.add_peer(conn.recv_bytes())
        (remote,) = struct.unpack("<Q", conn.recv_bytes())
        warm = np.array([[dst.ctypes.data, piece, 0]], dtype=np.uint64)
        backend.post_read(peer, [ReadBatch(MemoryKind.HOST, MemoryKind.HOST,
                                           np.array([[remote, piece, 0]], dtype=np.uint64), warm)], b"warm")
        poll_until(backend, [b"warm"], 60)  # connected both ways, as a reader that served before
        conn.send_bytes(b"ready")
        count = size // piece
        if window:  # what the decode's window (kvlend.core.tcpwindow) lets one reader have in flight
            count = min(count, backend.read_window // piece)
        rows = np.arange(count, dtype=np.uint64) * np.uint64(piece)
        local = np.stack([rows + np.uint64(dst.ctypes.data), np.full(count, piece, np.uint64),
                          np.zeros(count, np.uint64)], axis=1)
        remote_rows = local.copy()
        remote_rows[:, 0] = rows + np.uint64(remote)
        conn.recv_bytes()  # the target is stopped now
        if count:
            backend.post_read(peer, [ReadBatch(MemoryKind.HOST, MemoryKind.HOST, remote_rows, local)], b"r")
        conn.send_bytes(struct.pack("<Q", count * piece))
        conn.recv_bytes()  # never reached: the parent SIGKILLs this process


def _wait_message(conn, seconds: float, what: str) -> bytes:
    if not conn.poll(seconds):
        raise TimeoutError(f"no {what} within {seconds} s")
    return conn.recv_bytes()


def run_once(size: int, piece: int, window: bool, litter: bool = True, answer_s: float = 1.0,
             grace_s: float = 3.0) -> dict:
    """One trial; how the target ended and what the reader posted."""
    ctx = mp.get_context("spawn")
    t_conn, t_child = ctx.Pipe()
    r_conn, r_child = ctx.Pipe()
    target = ctx.Process(target=_target, args=(t_child, size, litter), daemon=True)
    reader = ctx.Process(target=_reader, args=(r_child, size, piece, window), daemon=True)
    saved = {k: os.environ.get(k) for k in _CHILD_ENV}
    os.environ.update(_CHILD_ENV)  # inherited by the spawned children; this process's own UCX is untouched
    try:
        target.start()
        reader.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        r_conn.send_bytes(_wait_message(t_conn, 60, "target metadata"))
        r_conn.send_bytes(_wait_message(t_conn, 10, "target address"))
        _wait_message(r_conn, 60, "reader ready")
        os.kill(target.pid, signal.SIGSTOP)
        r_conn.send_bytes(b"post")
        (posted,) = struct.unpack("<Q", _wait_message(r_conn, 30, "reader post"))
        time.sleep(0.2)  # the GET requests travel to the stopped target's socket
        os.kill(target.pid, signal.SIGCONT)
        time.sleep(answer_s)  # the target answers until the sockets are full; the rest waits in UCX
        os.kill(reader.pid, signal.SIGKILL)  # the reader's socket closes: UCX purges what waits
        reader.join(10)
        target.join(grace_s)
        rc = target.exitcode
        return {"rc": rc, "crashed": rc in SEGFAULT_OR_ABORT, "posted": posted, "window": window}
    finally:
        for p in (reader, target):
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                if p is target:
                    t_conn.send_bytes(b"stop")
                    p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="64M", type=_size, help="bytes the reader reads (default 64M)")
    ap.add_argument("--piece", default="256K", type=_size, help="bytes per descriptor (default 256K)")
    ap.add_argument("--window", action="store_true", help="post only what the TCP read window admits")
    ap.add_argument("--no-litter", action="store_true", help="leave the target's freed heap as it is")
    ap.add_argument("--runs", default=1, type=int)
    args = ap.parse_args(argv)
    crashed = 0
    for _ in range(args.runs):
        out = run_once(args.bytes, args.piece, args.window, not args.no_litter)
        crashed += out["crashed"]
        print(json.dumps(out), flush=True)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
