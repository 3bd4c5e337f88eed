"""Read bandwidth of NixlBackend against raw nixl calls (two agents, one process).

    python plugins/nixl/bench.py [iterations]

Not a test: numbers depend on the host.  Progress thread off on both sides,
UCX defaults (cma on one host), DRAM only.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from kvlend.core.layout import MemoryKind, MemoryRegion
from kvlend.transport import ReadBatch
from kvlend_nixl import NixlBackend

SIZE = 64 << 20
PAGE = 4096


def region(arr: np.ndarray, name: str) -> MemoryRegion:
    return MemoryRegion(name, MemoryKind.HOST, 0, arr.nbytes, PAGE, arr.nbytes // PAGE, arr.ctypes.data)


def layouts(src: np.ndarray, dst: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    n = SIZE // PAGE
    order = np.random.default_rng(0).permutation(n).astype(np.uint64)
    def rows(base, index, length):
        return np.stack([base + index * np.uint64(length), np.full(len(index), length, np.uint64),
                         np.zeros(len(index), np.uint64)], axis=1)
    one = np.zeros(1, np.uint64)
    return {
        "1 x 64 MiB": (rows(src.ctypes.data, one, SIZE), rows(dst.ctypes.data, one, SIZE)),
        "16384 x 4 KiB scattered": (rows(src.ctypes.data, order, PAGE),
                                    rows(dst.ctypes.data, np.arange(n, dtype=np.uint64), PAGE)),
    }


def timed(fn, iterations: int) -> tuple[float, float]:
    fn()  # warm-up: the first read also wires the connection up
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return SIZE / statistics.median(times) / 1e9, SIZE / min(times) / 1e9


def main(iterations: int) -> None:
    src = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    dst = np.zeros(SIZE, np.uint8)
    reader, lender = NixlBackend("bench-reader"), NixlBackend("bench-lender")
    reader.register([region(dst, "dst")])
    lender.register([region(src, "src")])
    peer = reader.add_peer(lender.metadata())
    a, b = reader._agent, lender._agent  # raw agents of the same two backends
    for label, (remote, local) in layouts(src, dst).items():
        batch = [ReadBatch(MemoryKind.HOST, MemoryKind.HOST, remote, local)]

        def via_backend():
            reader.post_read(peer, batch, b"bench")
            while not reader.poll():
                lender.poll()

        def raw_initialize():
            h = a.initialize_xfer("READ", a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(remote, "DRAM"), peer)
            state = a.transfer(h)
            while state == "PROC":
                b.get_new_notifs()
                state = a.check_xfer_state(h)
            h.release()

        # Prepped lists fit only fixed page descriptors: prep every page once.
        pages = SIZE // PAGE
        idx = np.arange(pages, dtype=np.uint64) * np.uint64(PAGE)
        col = np.stack([idx, np.full(pages, PAGE, np.uint64), np.zeros(pages, np.uint64)], axis=1)
        t0 = time.perf_counter()
        lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", col + np.array([dst.ctypes.data, 0, 0], np.uint64), "DRAM")
        rh = a.prep_xfer_dlist(peer, col + np.array([src.ctypes.data, 0, 0], np.uint64), "DRAM")
        prep_ms = (time.perf_counter() - t0) * 1e3
        r_idx = ((remote[:, 0] - np.uint64(src.ctypes.data)) // np.uint64(PAGE)).astype(np.int64)
        l_idx = ((local[:, 0] - np.uint64(dst.ctypes.data)) // np.uint64(PAGE)).astype(np.int64)
        spans = (remote[:, 1] // np.uint64(PAGE)).astype(np.int64)
        r_list = np.concatenate([np.arange(s, s + n) for s, n in zip(r_idx, spans)]).astype(np.int32)
        l_list = np.concatenate([np.arange(s, s + n) for s, n in zip(l_idx, spans)]).astype(np.int32)

        def raw_prepped():
            h = a.make_prepped_xfer("READ", lh, l_list, rh, r_list)
            state = a.transfer(h)
            while state == "PROC":
                b.get_new_notifs()
                state = a.check_xfer_state(h)
            h.release()

        t0 = time.perf_counter()
        a.initialize_xfer("READ", a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(remote, "DRAM"), peer).release()
        init_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        a.make_prepped_xfer("READ", lh, l_list, rh, r_list).release()
        make_ms = (time.perf_counter() - t0) * 1e3
        print(f"{label}: initialize_xfer {init_ms:.2f} ms; prep both lists once {prep_ms:.1f} ms, "
              f"then make_prepped_xfer {make_ms:.2f} ms")
        for name, fn in (("backend", via_backend), ("raw initialize_xfer", raw_initialize),
                         ("raw prepped", raw_prepped)):
            med, best = timed(fn, iterations)
            print(f"  {name:20s} {med:6.2f} GB/s median, {best:6.2f} best")
        assert np.array_equal(dst[:PAGE], src[int(remote[0, 0] - src.ctypes.data):][:PAGE])
        lh.release()
        rh.release()
    reader.close()
    lender.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
