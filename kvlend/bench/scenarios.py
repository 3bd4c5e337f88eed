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
import multiprocessing
import os
import platform
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np

from ..errors import KvlendError
from ..core.layout import MemoryKind, MemoryRegion, PageLayout, layout_from_pools
from ..core.lender import Lender
from ..core.negotiate import negotiate
from ..core.plan import plan_reads
from ..core.tracker import DeliveryTracker
from ..protocol.config import NodeConfig

HEADS, TPP, HEAD_DIM = 8, 16, 128  # Llama-3-8B-like: 32 KiB per K (or V) page per layer, 2-byte elements
PAGE_BYTES = HEADS * TPP * HEAD_DIM * 2
GROUP = "full"
CALL_TIMEOUT = 120.0  # seconds for one lender command (pool allocation of a few GiB included)
XFER_TIMEOUT = 30.0


class BenchError(KvlendError):
    """The benchmark could not run (lender process died, a wait passed its deadline, bad data)."""


@dataclass(frozen=True)
class Sizes:
    s1_bytes: int
    s2_requests: tuple[tuple[int, int], ...]  # (tokens, layers)
    s3_layers: int
    s3_pages: int
    reps: int
    s3_reps: int
    s5_requests: int = 300  # from two prefill processes, 1..S5_MAX_PAGES pages each
    s5_inflight: int = 32
    s6_pages: int = 512  # one prompt: 8192 tokens
    s6_layers: int = 4
    s6_chunk_pages: int = 64  # chunked prefill: 1024 tokens a chunk
    s6_compute_s: float = 0.040  # simulated compute per chunk (the prefill's GPU time)
    s6_rounds: int = 6  # per mode


FULL = Sizes(256 << 20, ((1024, 32), (8192, 32), (32768, 8)), 1, 16, 10, 500)
QUICK = Sizes(8 << 20, ((1024, 4),), 1, 16, 3, 30, 24, 8, 64, 1, 16, 0.005, 2)
S5_MAX_PAGES = 64


# ------------------------------------------------------------------ pools
def _shape(pages: int, layers: int, combined: bool) -> list[tuple[int, ...]]:
    if combined:
        return [(pages, 2, HEADS, TPP, HEAD_DIM)] * layers
    return [(pages, HEADS, TPP, HEAD_DIM)] * (2 * layers)


def _pools(pages: int, layers: int, combined: bool, fill: bool) -> tuple[list[np.ndarray], PageLayout]:
    """Per-layer pools (K and V apart unless ``combined``); ``fill`` stamps every 8-byte word."""
    arrays = [np.zeros(s, dtype=np.uint16) for s in _shape(pages, layers, combined)]
    if fill:
        for r, a in enumerate(arrays):
            words = a.reshape(-1).view(np.uint64)
            words[:] = np.arange(words.size, dtype=np.uint64)
            words += np.uint64(r << 40)
    if combined:
        layout = layout_from_pools(kv=arrays, kept_window=1 << 30)
    else:
        layout = layout_from_pools(k=arrays[0::2], v=arrays[1::2], kept_window=1 << 30)
    return arrays, layout


def _region(arr: np.ndarray, name: str) -> MemoryRegion:
    return MemoryRegion(name, MemoryKind.HOST, 0, arr.nbytes, arr.nbytes, 1, arr.ctypes.data)


def _expected_ok(dst: np.ndarray, r: int, src_slots: np.ndarray, dst_slots: np.ndarray) -> bool:
    """Every word of ``dst[dst_slots]`` holds the stamp of region ``r``'s ``src_slots``."""
    per = dst[0].nbytes // 8
    got = dst.reshape(dst.shape[0], -1).view(np.uint64)[dst_slots]
    want = (src_slots.astype(np.uint64)[:, None] * np.uint64(per) + np.arange(per, dtype=np.uint64)[None, :])
    return bool(np.array_equal(got, want + np.uint64(r << 40)))


# ----------------------------------------------------------- lender side
def _lender_main(conn) -> None:
    """The lender process: owns source pools, answers commands, keeps its agent progressed."""
    from kvlend_nixl import NixlBackend

    backend = NixlBackend(f"bench-lender-{os.getpid()}", timeout=XFER_TIMEOUT)
    agent = backend._agent  # raw NIXL: the target only has to be progressed
    arrays: list[np.ndarray] = []
    layout: PageLayout | None = None
    staging = np.zeros(0, np.uint8)
    spin, notifs = False, 0
    cold: list = []  # scenario 4 objects, kept alive until quit
    streamer = None  # scenario 6's PrefillNode
    try:
        while True:
            if conn.poll(0 if spin else 0.0005):
                cmd, arg = conn.recv()
                if cmd == "quit":
                    break
                if cmd == "pools":
                    backend.deregister()
                    arrays = staging = None
                    arrays, layout = _pools(arg["pages"], arg["layers"], arg["combined"], fill=True)
                    staging = np.zeros(max(arg["staging"], 1), np.uint8)
                    backend.register(list(layout.regions) + [_region(staging, "staging")])
                    conn.send((layout.encode(), backend.metadata(), staging.ctypes.data))
                elif cmd == "gather":  # host staging baseline: copy the lent pages into one buffer
                    start = time.perf_counter()
                    offset = 0
                    for a in arrays:
                        n = len(arg) * a[0].nbytes
                        out = staging[offset:offset + n].view(a.dtype).reshape((len(arg),) + a.shape[1:])
                        np.take(a, arg, axis=0, out=out)
                        offset += n
                    conn.send(time.perf_counter() - start)
                elif cmd == "tickets":  # scenario 3 through the node: lend the current pools' pages, ticket each
                    cold.append(_ticket_prefill(layout, arg))
                    conn.send(cold[-1][1])
                elif cmd == "stream":  # scenario 6: chunked prefill of one prompt, lent as it goes or at the end
                    if streamer is None:
                        streamer = _stream_prefill(layout, arg)
                        cold.append((streamer,))
                    _stream(streamer, layout, arg, conn)
                elif cmd == "prefill":  # scenario 4: a PrefillNode that offers one lease to its first peer
                    cold.append(_cold_prefill(arg))
                    conn.send(cold[-1][0].address)
                elif cmd == "listener":  # scenario 4 baseline: a raw agent behind NIXL's own listener
                    cold.append(_cold_listener(arg))
                    conn.send(cold[-1][1])
                elif cmd == "spin":
                    spin = bool(arg)
                    conn.send(True)
                elif cmd == "notifs":  # count since the last call, waiting up to 2 s for ``arg`` of them
                    deadline = time.monotonic() + 2.0
                    while notifs < (arg or 0) and time.monotonic() < deadline:
                        notifs += sum(len(v) for v in agent.get_new_notifs().values())
                    conn.send(notifs)
                    notifs = 0
            notifs += sum(len(v) for v in agent.get_new_notifs().values())
    finally:
        for obj in cold:
            obj[0].close()
        backend.close()


def _ticket_prefill(layout: PageLayout, arg: dict):
    """A started PrefillNode over the lender's current pools, and a ticket for each source table in
    ``arg['requests']`` (locks stack: pages lent by several tickets are locked once per ticket)."""
    from kvlend_nixl import NixlBackend

    from ..runtime import PrefillNode
    from ..security.credentials import Credentials

    node = PrefillNode(layout, NixlBackend(f"bench-node-{os.getpid()}"), Credentials.from_env(arg["credentials"]))
    node.start()
    selection = layout.full_selection()
    tickets = [node.lend(f"node-{i}", len(src) * TPP, {GROUP: src}, selection).to_text()
               for i, src in enumerate(arg["requests"])]
    return node, tickets


def _stream_prefill(layout: PageLayout, arg: dict):
    """Scenario 6's PrefillNode over the lender's current pools."""
    from kvlend_nixl import NixlBackend

    from ..runtime import PrefillNode
    from ..security.credentials import Credentials

    node = PrefillNode(layout, NixlBackend(f"bench-stream-{os.getpid()}", timeout=XFER_TIMEOUT),
                       Credentials.from_env(arg["credentials"]))
    node.start()
    return node


def _stream(node, layout: PageLayout, arg: dict, conn) -> None:
    """One prompt's chunked prefill, each chunk's compute simulated by a sleep (a GPU's time, which
    leaves the CPU free).  Progressive: lend after the first chunk and send the ticket at once, extend
    after each later chunk; otherwise lend once the last chunk is done.  Sends ("ticket", text), then
    ("last", wall time the last chunk finished)."""
    pages, chunk = arg["pages"], arg["chunk_pages"]
    src = {GROUP: np.arange(pages, dtype=np.int64)}
    tokens, lease = pages * TPP, None
    for done in range(chunk, pages + chunk, chunk):
        time.sleep(arg["compute_s"])
        ready = min(done, pages) * TPP
        if ready == tokens:
            last = time.time()
        if lease is not None:
            node.extend(lease, ready, src)
        elif arg["progressive"] or ready == tokens:
            ticket = node.lend(f"stream-{arg['round']}", tokens, src, layout.full_selection(), ready=ready)
            lease = ticket.lease
            conn.send(("ticket", ticket.to_text()))
    conn.send(("last", last))


def _cold_prefill(arg: dict):
    """A PrefillNode on its own agent; a thread offers ``arg['pages']`` pages once a decode connects."""
    import threading

    from kvlend_nixl import NixlBackend

    from ..runtime import PrefillNode
    from ..security.credentials import Credentials

    arrays, layout = _pools(arg["pages"], 1, False, fill=True)
    node = PrefillNode(layout, NixlBackend(f"cold-prefill-{os.getpid()}"), Credentials.from_env(arg["credentials"]))
    node.start()

    def offer() -> None:
        try:
            peer = node.wait_for_peer(30.0)
            node.offer(peer, "cold", arg["pages"] * TPP, {GROUP: np.arange(arg["pages"])}, layout.full_selection())
        except KvlendError:
            pass  # the decode side times out and reports it

    threading.Thread(target=offer, daemon=True).start()
    return node, arrays


class _Closer:
    def __init__(self, fn) -> None:
        self.close = fn


def _cold_listener(arg: dict):
    """A raw NIXL agent with its listener on ``arg['port']`` and one stamped buffer."""
    from kvlend_nixl.nixl_build import api

    buf = np.arange(arg["bytes"] // 8, dtype=np.uint64)
    agent = api.nixl_agent("cold-listener", api.nixl_agent_config(enable_listen_thread=True, listen_port=arg["port"]))
    reg = agent.register_memory(_rows(np.array([buf.ctypes.data]), np.array([buf.nbytes])), "DRAM")
    return _Closer(lambda: (agent.deregister_memory(reg), buf)), (agent.name, buf.ctypes.data)


class _Lender:
    """The lender process and its pipe; always terminated on exit."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_lender_main, args=(child,), daemon=True, name="kvlend-bench-lender")
        self.proc.start()
        child.close()

    def call(self, cmd: str, arg=None, timeout: float = CALL_TIMEOUT):
        try:
            self.conn.send((cmd, arg))
            deadline = time.monotonic() + timeout
            while not self.conn.poll(0.05):
                if not self.proc.is_alive():
                    raise BenchError(f"lender process died (exit code {self.proc.exitcode}) during {cmd!r}")
                if time.monotonic() > deadline:
                    raise BenchError(f"lender did not answer {cmd!r} within {timeout:g} s")
            return self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
            raise BenchError(f"lender pipe closed during {cmd!r}: {exc}") from None

    def receive(self, what: str, timeout: float = CALL_TIMEOUT):
        """The next message the lender sends on its own (a command answered in several parts)."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.01):
            if not self.proc.is_alive():
                raise BenchError(f"lender process died (exit code {self.proc.exitcode}) before sending {what}")
            if time.monotonic() > deadline:
                raise BenchError(f"lender sent no {what} within {timeout:g} s")
        kind, value = self.conn.recv()
        if kind != what:
            raise BenchError(f"lender sent {kind!r}, expected {what!r}")
        return value

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("quit", None))
                self.proc.join(5)
        except (OSError, ValueError):
            pass
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


# ----------------------------------------------------------- reader side
def _stats(samples: list[float], nbytes: int | None = None) -> dict:
    ms = np.array(samples) * 1e3
    out = {"n": len(samples), "p50_ms": float(np.median(ms)), "min_ms": float(ms.min()), "max_ms": float(ms.max()),
           "p10_ms": float(np.percentile(ms, 10)), "p90_ms": float(np.percentile(ms, 90)),
           "p99_ms": float(np.percentile(ms, 99))}
    if nbytes:
        out["gbps"] = nbytes / (out["p50_ms"] / 1e3) / 1e9
    return out


def _side_by_side(methods: dict[str, Callable[[], object]], reps: int, warmup: int) -> dict[str, list[float]]:
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


def _rows(addresses: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return np.stack([addresses.astype(np.uint64), lengths.astype(np.uint64), np.zeros(len(addresses), np.uint64)], 1)


def _fragmented(pool_pages: int, need: int, seed: int) -> np.ndarray:
    """``need`` slots from a pool allocated in short runs (1..4 pages) in random order."""
    rng = np.random.default_rng(seed)
    cuts = np.cumsum(rng.integers(1, 5, size=pool_pages))
    cuts = cuts[cuts < pool_pages]
    runs = np.split(np.arange(pool_pages), cuts)
    order = rng.permutation(len(runs))
    slots = np.concatenate([runs[i] for i in order])
    return slots[:need].astype(np.int64)


def _min_descriptors(src: np.ndarray, dst: np.ndarray, buffers: int) -> int:
    """Maximal runs contiguous on both sides, per buffer (buffers are separate regions)."""
    breaks = ~((np.diff(src) == 1) & (np.diff(dst) == 1))
    return buffers * (1 + int(breaks.sum()))


class _Reader:
    """This side: a NixlBackend, the local pools, a plan against the lender's, and the timed paths."""

    def __init__(self, lender: _Lender, backend, pages: int, layers: int, combined: bool, staging: int) -> None:
        encoded, metadata, self.remote_staging = lender.call(
            "pools", {"pages": pages, "layers": layers, "combined": combined, "staging": staging})
        self.lender_proc = lender
        self.backend = backend
        self.remote = PageLayout.decode(encoded)
        self.arrays, self.local = _pools(pages, layers, combined, fill=False)
        self.staging = np.zeros(max(staging, 1), np.uint8)
        backend.deregister()
        backend.register(list(self.local.regions) + [_region(self.staging, "staging")])
        self.peer = backend.add_peer(metadata)
        self.agent = backend._agent
        self.plan = negotiate(self.local, self.remote)
        self.lender = Lender(self.remote)  # the lend runs here: same CPU work, no control channel
        self.tracker = DeliveryTracker(self.local)
        self.selection = self.local.full_selection()
        self.seq = 0
        self._prepped = None  # (local handle, remote handle, local and remote first index of each region)

    # the kvlend path: lend + plan + post + poll + tracker + release
    def kvlend(self, src: np.ndarray, dst: np.ndarray, tokens: int) -> int:
        self.seq += 1
        request = f"r{self.seq}"
        lease = self.lender.lend(request, tokens, {GROUP: src}, self.selection, time.monotonic(), 60.0)
        batches = plan_reads(self.plan, lease.pages, {GROUP: dst}, lease.selection)
        self.tracker.begin(request, tokens)
        tag = request.encode()
        self.backend.post_read(self.peer, batches, tag)
        self.tracker.post(request, 0, {GROUP: lease.pages[GROUP].token_pages})
        deadline = time.monotonic() + XFER_TIMEOUT
        spins = 0
        while not self.tracker.complete(request):
            for c in self.backend.poll():
                if c.error is not None:
                    raise BenchError(f"kvlend read {tag!r} failed: {c.error}")
                self.tracker.done(request, 0)
            spins = _backoff(spins, deadline, "kvlend read")
        self.tracker.finish(request)
        self.lender.release(lease.id)
        return sum(b.count for b in batches)

    def descriptors(self, src: np.ndarray, dst: np.ndarray, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """kvlend's own coalesced descriptors for a request (local, remote)."""
        lease = self.lender.lend("plan-only", tokens, {GROUP: src}, self.selection, time.monotonic(), 60.0)
        batches = plan_reads(self.plan, lease.pages, {GROUP: dst}, lease.selection)
        self.lender.release(lease.id)
        return np.concatenate([b.local for b in batches]), np.concatenate([b.remote for b in batches])

    def per_page(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One descriptor per page per layer buffer, as common connectors post."""
        local, remote = [], []
        for lr, rr in zip(self.local.regions, self.remote.regions):
            local.append(_rows(lr.address + dst * lr.page_stride, np.full(len(dst), lr.page_stride)))
            remote.append(_rows(rr.address + src * rr.page_stride, np.full(len(src), rr.page_stride)))
        return np.concatenate(local), np.concatenate(remote)

    def raw(self, local: np.ndarray, remote: np.ndarray, notif: bytes = b"") -> None:
        a = self.agent
        self._wait(a.initialize_xfer("READ", a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(remote, "DRAM"),
                                     self.peer, notif))

    def prepped(self, src: np.ndarray, dst: np.ndarray, notif: bytes = b"") -> None:
        """Raw NIXL the way vLLM's NixlConnector posts: page lists prepared once per side (one strided
        row per region), then ``make_prepped_xfer`` by page index; NIXL merges adjacent entries."""
        a = self.agent
        if self._prepped is None:
            def strided(regions, agent_name):
                rows = np.array([[r.address, r.page_stride, 0, r.page_stride, r.num_pages] for r in regions],
                                dtype=np.uint64)
                return a.prep_xfer_dlist(agent_name, rows, "DRAM")
            def first_index(regions):
                return np.concatenate([[0], np.cumsum([r.num_pages for r in regions])[:-1]]).astype(np.int64)
            self._prepped = (strided(self.local.regions, "NIXL_INIT_AGENT"), strided(self.remote.regions, self.peer),
                             first_index(self.local.regions), first_index(self.remote.regions))
        local_h, remote_h, local_base, remote_base = self._prepped
        local_idx = (local_base[:, None] + dst[None, :]).ravel()
        remote_idx = (remote_base[:, None] + src[None, :]).ravel()
        self._wait(a.make_prepped_xfer("READ", local_h, local_idx, remote_h, remote_idx, notif))

    def _wait(self, h) -> None:
        """Post ``h`` and poll it to DONE, then release it."""
        a = self.agent
        try:
            state = a.transfer(h)
            deadline = time.monotonic() + XFER_TIMEOUT
            spins = 0
            while state == "PROC":
                spins = _backoff(spins, deadline, "raw NIXL read")
                state = a.check_xfer_state(h)
            if state != "DONE":
                raise BenchError(f"raw NIXL read ended in state {state}")
        finally:
            h.release()

    def verified(self, fn: Callable[[], object], src: np.ndarray, dst: np.ndarray) -> bool:
        """Zero the destination pages, run ``fn`` once, check every word landed where it belongs."""
        for a in self.arrays:
            a[dst] = 0
        fn()
        return all(_expected_ok(a, r, src, dst) for r, a in enumerate(self.arrays))

    def close(self) -> None:
        if self._prepped is not None:
            for handle in self._prepped[:2]:
                self.agent.release_dlist_handle(handle)
        try:
            self.backend.remove_peer(self.peer)
        except KvlendError:
            pass


def _backoff(spins: int, deadline: float, what: str) -> int:
    """Spin briefly, then yield the CPU (2-vCPU hosts starve the peer otherwise)."""
    if time.monotonic() > deadline:
        raise BenchError(f"{what} not done within {XFER_TIMEOUT:g} s")
    if spins > 50:
        time.sleep(20e-6)
    return spins + 1


# -------------------------------------------------------------- scenarios
def _ratio(a: dict, b: dict) -> float:
    """Throughput of ``a`` over ``b`` (> 1: ``a`` is faster), from medians."""
    return b["p50_ms"] / a["p50_ms"]


def scenario_1(lender: _Lender, backend, sizes: Sizes, progress) -> dict:
    pages = sizes.s1_bytes // (2 * PAGE_BYTES)
    reader = _Reader(lender, backend, pages, 1, True, 0)
    nbytes = pages * 2 * PAGE_BYTES
    slots = np.arange(pages, dtype=np.int64)
    try:
        local, remote = reader.descriptors(slots, slots, pages * TPP)
        one_l = _rows(np.array([reader.local.regions[0].address]), np.array([nbytes]))
        one_r = _rows(np.array([reader.remote.regions[0].address]), np.array([nbytes]))
        methods = {"kvlend": lambda: reader.kvlend(slots, slots, pages * TPP),
                   "raw_nixl": lambda: reader.raw(one_l, one_r),
                   "memcpy": partial(np.copyto, np.empty(nbytes, np.uint8), np.ones(nbytes, np.uint8))}
        progress(f"scenario 1: {nbytes >> 20} MiB as one lease: kvlend, raw NIXL (one descriptor), memcpy, "
                 f"{sizes.reps} rounds")
        times = _side_by_side(methods, sizes.reps, warmup=2)
        kv, raw, mem = (_stats(times[k], nbytes) for k in methods)
        del methods["memcpy"]  # free its two buffers before verifying
        kv["descriptors"] = len(local)
        kv["verified"] = reader.verified(methods["kvlend"], slots, slots)
        raw["verified"] = reader.verified(methods["raw_nixl"], slots, slots)
    finally:
        reader.close()
    return {
        "name": "large contiguous read", "bytes": nbytes,
        "results": {"kvlend": kv, "raw_nixl": raw, "memcpy": mem},
        "ratios": {"kvlend/raw": _ratio(kv, raw), "kvlend/memcpy": _ratio(kv, mem)},
        "targets": {"kvlend/raw >= 0.90": _ratio(kv, raw) >= 0.90},
    }


def scenario_2(lender: _Lender, backend, sizes: Sizes, progress) -> dict:
    rows, notes = [], []
    configs: dict[int, list[int]] = {}
    for tokens, layers in sizes.s2_requests:
        configs.setdefault(layers, []).append(tokens)
        if layers != 32:
            notes.append(f"{tokens} tokens: scaled to {layers} layers instead of 32 "
                         "(size cap: both processes hold pools and staging buffers in RAM)")
    for layers, requests in configs.items():
        need = max(requests) // TPP
        pool = need * 3 // 2
        reader = _Reader(lender, backend, pool, layers, False, need * 2 * layers * PAGE_BYTES)
        try:
            for tokens in requests:
                rows.append(_model_request(reader, lender, tokens, layers, pool, sizes.reps, progress))
        finally:
            reader.close()
    return {"name": "model-shaped fragmented reads (Llama-3-8B-like: 8 KV heads x 128, 2-byte, 16 tokens/page)",
            "requests": rows, "notes": notes}


def _model_request(reader: _Reader, lender: _Lender, tokens: int, layers: int, pool: int, reps: int, progress) -> dict:
    n = tokens // TPP
    src, dst = _fragmented(pool, n, seed=tokens), _fragmented(pool, n, seed=tokens + 1)
    nbytes = n * 2 * layers * PAGE_BYTES
    label = f"scenario 2: {tokens} tokens x {layers} layers ({nbytes >> 20} MiB)"
    local, remote = reader.descriptors(src, dst, tokens)
    pl, pr = reader.per_page(src, dst)
    steps: dict[str, list[float]] = {"gather": [], "transfer": [], "scatter": []}
    one_l = _rows(np.array([reader.staging.ctypes.data]), np.array([nbytes]))
    one_r = _rows(np.array([reader.remote_staging]), np.array([nbytes]))

    def staged() -> None:
        steps["gather"].append(lender.call("gather", src))  # timed inside the lender process
        start = time.perf_counter()
        reader.raw(one_l, one_r)
        steps["transfer"].append(time.perf_counter() - start)
        start = time.perf_counter()
        offset = 0
        for a in reader.arrays:
            size = n * a[0].nbytes
            a[dst] = reader.staging[offset:offset + size].view(a.dtype).reshape((n,) + a.shape[1:])
            offset += size
        steps["scatter"].append(time.perf_counter() - start)

    methods = {"kvlend": lambda: reader.kvlend(src, dst, tokens),
               "raw_same_descriptors": lambda: reader.raw(local, remote),
               "raw_per_page": lambda: reader.raw(pl, pr)}
    progress(f"{label}: kvlend, raw NIXL (same descriptors), raw NIXL (per page), {reps} rounds")
    times = _side_by_side(methods, reps, warmup=2)
    progress(f"{label}: host staging (gather, one-descriptor read, scatter), {reps} rounds")
    _side_by_side({"staging": staged}, reps, warmup=2)
    steps = {k: v[2:] for k, v in steps.items()}  # drop the warm-up
    kv, raw, per = (_stats(times[k], nbytes) for k in methods)
    stage = _stats([sum(t) for t in zip(*steps.values())], nbytes)
    stage["steps"] = {k: _stats(v) for k, v in steps.items()}
    for r, name in ((kv, "kvlend"), (raw, "raw_same_descriptors"), (per, "raw_per_page")):
        r["verified"] = reader.verified(methods[name], src, dst)
    stage["verified"] = reader.verified(staged, src, dst)
    minimum = _min_descriptors(src, dst, 2 * layers)
    return {
        "tokens": tokens, "layers": layers, "pages": n, "bytes": nbytes,
        "descriptors": {"kvlend": len(local), "minimum": minimum, "per_page": len(pl), "staging": 1},
        "results": {"kvlend": kv, "raw_same_descriptors": raw, "raw_per_page": per, "staging": stage},
        "ratios": {"kvlend/raw_same": _ratio(kv, raw), "kvlend/per_page": _ratio(kv, per),
                   "kvlend/staging": _ratio(kv, stage)},
        "targets": {"descriptors == minimum": len(local) == minimum,
                    "kvlend/raw_same >= 0.90": _ratio(kv, raw) >= 0.90,
                    "kvlend/staging >= 1.5": _ratio(kv, stage) >= 1.5},
    }


def scenario_3(lender: _Lender, backend, sizes: Sizes, progress) -> dict:
    n = sizes.s3_pages
    pool = n * 8
    reader = _Reader(lender, backend, pool, sizes.s3_layers, False, 0)
    src, dst = _fragmented(pool, n, seed=3), _fragmented(pool, n, seed=4)
    tokens = n * TPP
    nbytes = n * 2 * sizes.s3_layers * PAGE_BYTES
    try:
        local, remote = reader.descriptors(src, dst, tokens)
        lender.call("spin", True)  # the target busy-polls its notifications, as the raw baseline needs
        try:
            methods = {"kvlend": lambda: reader.kvlend(src, dst, tokens),
                       "raw_nixl_notif": lambda: reader.raw(local, remote, b"bench"),
                       "raw_nixl_prepped": lambda: reader.prepped(src, dst, b"bench")}
            progress(f"scenario 3: {n}-page requests: kvlend, raw NIXL READ with a notification (descriptor "
                     f"lists built per request, and prepared lists by index), {sizes.s3_reps} rounds")
            lender.call("notifs")
            times = _side_by_side(methods, sizes.s3_reps, warmup=5)
            results = {k: _stats(times[k]) for k in methods}
            for k, fn in methods.items():
                results[k]["verified"] = reader.verified(fn, src, dst)
        finally:
            lender.call("spin", False)
        raw_methods = ("raw_nixl_notif", "raw_nixl_prepped")
        sent = len(raw_methods) * (sizes.s3_reps + 6)  # timed, warm-up and the verifying read of each
        seen = lender.call("notifs", sent)
        progress(f"scenario 3: the same requests through the nodes (ticket, claim, read, done ack over TLS), "
                 f"{sizes.s3_reps} rounds")
        results["kvlend_node"] = _node_path(lender, reader, src, dst, sizes.s3_reps)
        progress(f"scenario 3: the same through the nodes with read_ahead (reads go with the claim), "
                 f"{sizes.s3_reps} rounds")
        results["kvlend_node_ahead"] = _node_path(lender, reader, src, dst, sizes.s3_reps, read_ahead=True)
    finally:
        reader.close()
    kv = results["kvlend"]
    faster = min(raw_methods, key=lambda k: results[k]["p50_ms"])
    return {
        "name": "small requests back to back", "pages": n, "layers": sizes.s3_layers, "bytes": nbytes,
        "descriptors": len(local),
        "path": "kvlend: lend + plan_reads + post_read + poll + tracker + release, in-process, no TCP control channel; "
                "kvlend_node: the same request through PrefillNode and DecodeNode (ticket, claim, read, done ack over "
                "TLS, two processes); kvlend_node_ahead: the same with NodeConfig(read_ahead=True), the reads posted "
                "from the ticket's page table as the claim goes out",
        "notifications": {"sent": sent, "seen_by_target": seen},
        "results": results,
        "ratios": {f"p50 kvlend/{k}": kv["p50_ms"] / results[k]["p50_ms"] for k in raw_methods}
        | {f"p99 kvlend/{k}": kv["p99_ms"] / results[k]["p99_ms"] for k in raw_methods}
        | {"p50 kvlend_node/kvlend": results["kvlend_node"]["p50_ms"] / kv["p50_ms"],
           "p50 kvlend_node_ahead/kvlend_node": results["kvlend_node_ahead"]["p50_ms"] / results["kvlend_node"]["p50_ms"]},
        "node_overhead_ms": results["kvlend_node"]["p50_ms"] - kv["p50_ms"],
        "node_ahead_overhead_ms": results["kvlend_node_ahead"]["p50_ms"] - kv["p50_ms"],
        "targets": {f"p50 <= 1.5x the faster raw ({faster})": kv["p50_ms"] <= 1.5 * results[faster]["p50_ms"],
                    f"p99 <= 3x the faster raw ({faster})": kv["p99_ms"] <= 3 * results[faster]["p99_ms"]},
    }


def _node_path(lender: _Lender, reader: _Reader, src: np.ndarray, dst: np.ndarray, reps: int,
               read_ahead: bool = False) -> dict:
    """Scenario 3's request through the nodes: a PrefillNode in the lender lends tickets ahead, and a
    DecodeNode here redeems each (claim, offer, read, done and its ack over the TLS control channel),
    driving its own loop from ``wait`` as an engine's step would; ``read_ahead``: its reads go out
    with the claim, from the ticket's page table."""
    import tempfile

    from kvlend_nixl import NixlBackend

    from ..runtime import DecodeNode
    from ..security.certs import Authority, save_rank

    warmup = 5  # the first wires UCX up and does the TLS handshake
    ca = Authority.create()
    with tempfile.TemporaryDirectory(prefix="kvlend-bench-") as certs:
        tickets = lender.call("tickets", {"credentials": save_rank(ca.issue("bench-node-prefill"), certs),
                                          "requests": [src] * (warmup + reps + 1)})
    backend = NixlBackend(f"bench-node-decode-{os.getpid()}", timeout=XFER_TIMEOUT)
    decode = DecodeNode(reader.local, backend, ca.issue("bench-node-decode"), config=NodeConfig(read_ahead=read_ahead))
    try:
        times = []
        for i, ticket in enumerate(tickets[:-1]):
            start = time.perf_counter()
            decode.start_fetch(ticket, {GROUP: dst}).wait(XFER_TIMEOUT)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        for a in reader.arrays:
            a[dst] = 0
        decode.start_fetch(tickets[-1], {GROUP: dst}).wait(XFER_TIMEOUT)
        verified = all(_expected_ok(a, r, src, dst) for r, a in enumerate(reader.arrays))
    finally:
        decode.close()
        backend.close()
    return {**_stats(times), "verified": verified}


def scenario_4(lender: _Lender, backend, sizes: Sizes, progress) -> dict:
    """First contact to first verified byte: kvlend's control channel vs NIXL's listener (one sample each)."""
    import socket
    import tempfile

    from kvlend_nixl import NixlBackend
    from kvlend_nixl.nixl_build import api

    from ..runtime import DecodeNode
    from ..security.certs import Authority, save_rank

    n = sizes.s3_pages
    ca = Authority.create()  # a throwaway cluster: the lender loads its rank's files, then they go
    with tempfile.TemporaryDirectory(prefix="kvlend-bench-") as certs:
        host, port = lender.call("prefill", {"pages": n, "credentials": save_rank(ca.issue("bench-prefill"), certs)})
    arrays, layout = _pools(n, 1, False, fill=False)
    progress("scenario 4: cold decode -> PrefillNode (TCP and TLS handshakes, negotiate, add_peer, first read)")
    cold_backend = NixlBackend(f"cold-decode-{os.getpid()}")
    decode = DecodeNode(layout, cold_backend, ca.issue("bench-decode"))
    try:
        start = time.perf_counter()
        link = decode.connect(host, port)
        peer, offer = decode.next_offer(30.0)
        decode.fetch(peer, offer, {GROUP: np.arange(n)})
        kv_s = time.perf_counter() - start
        slots = np.arange(n)
        verified = all(_expected_ok(a, r, slots, slots) for r, a in enumerate(arrays))
        handshake_ms = link.handshake_ms
    finally:
        decode.close()
        cold_backend.close()
    progress("scenario 4: cold raw NIXL agent -> peer listener (fetch_remote_metadata, first read)")
    with socket.socket() as sock:  # a free port for the peer's listener
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    nbytes = n * 2 * PAGE_BYTES
    name, address = lender.call("listener", {"port": free, "bytes": nbytes})
    dst = np.zeros(nbytes // 8, np.uint64)
    agent = api.nixl_agent(f"cold-raw-{os.getpid()}", api.nixl_agent_config(enable_listen_thread=True, listen_port=0))
    reg = agent.register_memory(_rows(np.array([dst.ctypes.data]), np.array([nbytes])), "DRAM")
    try:
        start = time.perf_counter()
        agent.fetch_remote_metadata(name, "127.0.0.1", free)
        deadline = time.monotonic() + 30.0
        while not agent.check_remote_metadata(name):
            if time.monotonic() > deadline:
                raise BenchError("NIXL listener metadata did not arrive within 30 s")
            time.sleep(0.0005)
        local = agent.get_xfer_descs(_rows(np.array([dst.ctypes.data]), np.array([nbytes])), "DRAM")
        remote = agent.get_xfer_descs(_rows(np.array([address]), np.array([nbytes])), "DRAM")
        h = agent.initialize_xfer("READ", local, remote, name)
        state = agent.transfer(h)
        spins = 0
        while state == "PROC":
            spins = _backoff(spins, deadline, "cold raw NIXL read")
            state = agent.check_xfer_state(h)
        raw_s = time.perf_counter() - start
        h.release()
        raw_ok = state == "DONE" and bool(np.array_equal(dst, np.arange(dst.size, dtype=np.uint64)))
    finally:
        agent.deregister_memory(reg)
    return {
        "name": "cold peer: first contact to first verified byte (one sample each)", "pages": n, "bytes": nbytes,
        "results": {"kvlend": {"ms": kv_s * 1e3, "handshake_ms": handshake_ms, "verified": verified},
                    "raw_nixl_listener": {"ms": raw_s * 1e3, "verified": raw_ok}},
        "ratios": {"kvlend/raw time": kv_s / raw_s},
        "targets": {"kvlend <= 50 ms": kv_s * 1e3 <= 50},
    }


def scenario_5(lender: _Lender, backend, sizes: Sizes, progress) -> dict:
    """Many requests in flight: two prefill processes lend 1..64-page requests, one decode reads them
    with ``s5_inflight`` in flight (kvlend: DecodeNode over tickets; raw: NIXL READs of the same
    descriptors at the same concurrency, each with a notification); aggregate GB/s and requests/s."""
    import tempfile

    from kvlend_nixl import NixlBackend

    from ..runtime import DecodeNode
    from ..security.certs import Authority, save_rank

    rng = np.random.default_rng(5)
    pool = 8 * S5_MAX_PAGES
    lenders = [lender, _Lender()]
    try:
        remotes = [_Remote(lend, pool) for lend in lenders]
        n = sizes.s5_requests
        requests = [(i % 2, _fragmented(pool, int(rng.integers(1, S5_MAX_PAGES + 1)), seed=500 + i)) for i in range(n)]
        local_pages = sizes.s5_inflight * S5_MAX_PAGES * 2
        arrays, local = _pools(local_pages, 1, False, fill=False)
        for a in arrays:  # fault every page in now: the first method would pay for the kernel's zeroing
            a.fill(1)
        ca = Authority.create()
        tickets: list[list[str]] = [[], []]
        with tempfile.TemporaryDirectory(prefix="kvlend-bench-") as certs:
            for side, lend in enumerate(lenders):  # each request twice: once per kvlend run
                tickets[side] = lend.call("tickets", {
                    "credentials": save_rank(ca.issue(f"bench-prefill-{side}"), certs),
                    "requests": [src for s_, src in requests if s_ == side] * 2})
        order = [iter(t) for t in tickets]
        work = [(side, src, next(order[side])) for side, src in requests]
        work_ahead = [(side, src, next(order[side])) for side, src in requests]
        nbytes = sum(len(src) for _, src in requests) * 2 * PAGE_BYTES
        progress(f"scenario 5: {n} requests of 1..{S5_MAX_PAGES} pages ({nbytes >> 20} MiB) from 2 prefill "
                 f"processes, {sizes.s5_inflight} in flight: kvlend DecodeNode, then raw NIXL")
        runs = {}
        for name, todo, config in (("kvlend", work, NodeConfig()), ("kvlend_read_ahead", work_ahead,
                                                                     NodeConfig(read_ahead=True))):
            node_backend = NixlBackend(f"bench-many-{name}-{os.getpid()}", timeout=XFER_TIMEOUT)
            decode = DecodeNode(local, node_backend, ca.issue(f"bench-decode-{name.replace('_', '-')}"), config=config)
            try:
                runs[name] = _many_kvlend(decode, todo, arrays, sizes.s5_inflight)
            finally:
                decode.close()
                node_backend.close()
        raw = _many_raw(backend, local, arrays, remotes, requests, sizes.s5_inflight)
    finally:
        lenders[1].close()
    results = {**runs, "raw_nixl_notif": raw}
    for r in results.values():
        r["gbps"] = nbytes / r["seconds"] / 1e9
        r["requests_per_s"] = n / r["seconds"]
    return {"name": "many requests in flight", "count": n, "inflight": sizes.s5_inflight, "bytes": nbytes,
            "results": results,
            "ratios": {f"GB/s {k}/raw": results[k]["gbps"] / raw["gbps"] for k in runs},
            "targets": {f"GB/s {k}/raw >= 0.90": results[k]["gbps"] >= 0.9 * raw["gbps"] for k in runs}}


class _Remote:
    """A lender process's pools, as this side's raw baseline and planner see them."""

    def __init__(self, lender: _Lender, pages: int) -> None:
        encoded, self.metadata, _ = lender.call("pools", {"pages": pages, "layers": 1, "combined": False, "staging": 0})
        self.layout = PageLayout.decode(encoded)


def _slots(free: list[int], n: int) -> np.ndarray:
    out = np.array(free[:n], dtype=np.int64)
    del free[:n]
    return out


def _many_kvlend(decode, work: list, arrays: list[np.ndarray], inflight: int) -> dict:
    """Keep ``inflight`` ticket fetches going, each into pages of its own; check every byte as each ends
    (the checks are not counted in the time)."""
    free = list(range(arrays[0].shape[0]))
    running: dict[int, tuple] = {}
    pending = list(work)
    checking, verified = 0.0, True
    start = time.perf_counter()
    while pending or running:
        while pending and len(running) < inflight:
            side, src, ticket = pending.pop(0)
            dst = _slots(free, len(src))
            handle = decode.start_fetch(ticket, {GROUP: dst}, timeout=XFER_TIMEOUT)
            running[handle.id] = (handle, src, dst)
        for handle in decode.finished():
            _, src, dst = running.pop(handle.id)
            t = time.perf_counter()
            handle.result()  # raises its error
            verified &= all(_expected_ok(a, r, src, dst) for r, a in enumerate(arrays))
            checking += time.perf_counter() - t
            free.extend(dst.tolist())
        if time.perf_counter() - start > XFER_TIMEOUT * 4:
            raise BenchError(f"scenario 5: {len(running)} kvlend fetches still running")
    return {"seconds": time.perf_counter() - start - checking, "verified": verified}


def _many_raw(backend, local: PageLayout, arrays: list[np.ndarray], remotes: list[_Remote], requests: list,
              inflight: int) -> dict:
    """The same reads straight through NIXL at the same concurrency: request i reads into lane
    i % inflight's pages once that lane's previous read is done; descriptors are planned beforehand
    (raw NIXL pays none of kvlend's work)."""
    backend.deregister()
    backend.register(local.regions)
    peers = [backend.add_peer(r.metadata) for r in remotes]
    agent = backend._agent
    plans = [negotiate(local, r.layout) for r in remotes]
    lenders = [Lender(r.layout) for r in remotes]
    lanes = [np.random.default_rng(900 + k).permutation(np.arange(k * S5_MAX_PAGES, (k + 1) * S5_MAX_PAGES))
             for k in range(inflight)]
    posts = []
    for i, (side, src) in enumerate(requests):
        lease = lenders[side].lend(f"raw-{i}", len(src) * TPP, {GROUP: src}, local.full_selection(), 0.0, 60.0)
        dst = lanes[i % inflight][:len(src)]
        batches = plan_reads(plans[side], lease.pages, {GROUP: dst}, lease.selection)
        lenders[side].release(lease.id)
        posts.append((peers[side], np.concatenate([b.local for b in batches]),
                      np.concatenate([b.remote for b in batches]), src, dst))
    try:
        busy: dict[int, object] = {}  # lane -> handle in flight
        start = time.perf_counter()
        for i, (peer, local_rows, remote_rows, _, _) in enumerate(posts):
            lane = i % inflight
            while lane in busy:
                for k, h in list(busy.items()):
                    state = agent.check_xfer_state(h)
                    if state != "PROC":
                        h.release()
                        del busy[k]
                        if state != "DONE":
                            raise BenchError(f"scenario 5: raw NIXL read ended in state {state}")
            h = agent.initialize_xfer("READ", agent.get_xfer_descs(local_rows, "DRAM"),
                                      agent.get_xfer_descs(remote_rows, "DRAM"), peer, b"bench")
            if agent.transfer(h) == "DONE":
                h.release()
            else:
                busy[lane] = h
        deadline = time.monotonic() + XFER_TIMEOUT
        while busy:
            for k, h in list(busy.items()):
                if agent.check_xfer_state(h) != "PROC":
                    h.release()
                    del busy[k]
            if time.monotonic() > deadline:
                raise BenchError("scenario 5: raw NIXL reads still in flight")
        seconds = time.perf_counter() - start
    finally:
        for peer in peers:
            backend.remove_peer(peer)
    # Lanes are reused: the last read of each lane still holds its bytes. Check those.
    verified = all(_expected_ok(a, r, src, dst) for _, _, _, src, dst in posts[-inflight:] for r, a in enumerate(arrays))
    return {"seconds": seconds, "verified": verified}


def scenario_6(lender: _Lender, backend, sizes: Sizes, progress) -> dict:
    """Progressive lending: one long prompt prefilled in chunks (compute simulated), read by a DecodeNode
    over a ticket, lent as its chunks commit (on) or once prefill is done (off), rounds alternating.
    Measured: from the last chunk's end to "decode may start" (the fetch done, ack included)."""
    import tempfile

    from kvlend_nixl import NixlBackend

    from ..runtime import DecodeNode
    from ..security.certs import Authority, save_rank

    pages, chunk = sizes.s6_pages, sizes.s6_chunk_pages
    reader = _Reader(lender, backend, pages, sizes.s6_layers, False, 0)
    nbytes = pages * 2 * sizes.s6_layers * PAGE_BYTES
    dst = _fragmented(pages, pages, seed=6)
    ca = Authority.create()
    tails: dict[str, list[float]] = {"on": [], "off": []}
    reads: list[float] = []
    verified = {}
    wall = time.time() - time.monotonic()
    progress(f"scenario 6: a {pages * TPP}-token prompt ({nbytes >> 20} MiB) prefilled in chunks of {chunk * TPP} "
             f"tokens ({sizes.s6_compute_s * 1e3:g} ms of simulated compute each), lent progressively or at the "
             f"end, {sizes.s6_rounds} rounds each")
    node_backend = NixlBackend(f"bench-stream-decode-{os.getpid()}", timeout=XFER_TIMEOUT)
    decode = DecodeNode(reader.local, node_backend, ca.issue("bench-stream-decode"))
    try:
        with tempfile.TemporaryDirectory(prefix="kvlend-bench-") as certs:
            credentials = save_rank(ca.issue("bench-stream-prefill"), certs)
            for i in range(2 * (sizes.s6_rounds + 1)):  # the first round of each mode warms up
                mode = ("on", "off")[i % 2]
                for a in reader.arrays:
                    a[dst] = 0
                lender.conn.send(("stream", {"credentials": credentials, "pages": pages, "chunk_pages": chunk,
                                             "compute_s": sizes.s6_compute_s, "progressive": mode == "on",
                                             "round": i}))
                ticket = lender.receive("ticket")
                started = time.monotonic()
                handle = decode.start_fetch(ticket, {GROUP: dst})
                result = handle.wait(XFER_TIMEOUT)
                ready = wall + started + handle.timeline["finished"]
                last = lender.receive("last")
                verified[mode] = all(_expected_ok(a, r, np.arange(pages), dst) for r, a in enumerate(reader.arrays))
                if i >= 2:
                    tails[mode].append(ready - last)
                    if mode == "off":
                        reads.append(result.read_seconds)
    finally:
        decode.close()
        node_backend.close()
        reader.close()
    results = {f"progressive_{m}": {**_stats(v), "verified": verified[m]} for m, v in tails.items()}
    on, off = results["progressive_on"]["p50_ms"], results["progressive_off"]["p50_ms"]
    transfer_ms = float(np.median(reads)) * 1e3
    one_chunk_ms = transfer_ms * chunk / pages
    left_ms = on - (off - transfer_ms)  # the tail's transfer: less the round trips the off tail also pays
    return {
        "name": "progressive lending: last prefill chunk to decode may start", "tokens": pages * TPP,
        "chunk_tokens": chunk * TPP, "compute_ms_per_chunk": sizes.s6_compute_s * 1e3, "bytes": nbytes,
        "results": results, "transfer_ms_off": transfer_ms, "one_chunk_transfer_ms": one_chunk_ms,
        "transfer_left_ms": left_ms,
        "ratios": {"tail on/off": on / off, "transfer hidden": max(0.0, 1 - on / off)},
        "targets": {"transfer left after the last chunk <= 2 chunks' transfer": left_ms <= 2 * one_chunk_ms},
        "path": "prefill (PrefillNode) and decode (DecodeNode) in two processes over TLS; a ticket per round; "
                "'decode may start' = the fetch finished (every read landed, done acked)",
    }


SCENARIOS = {1: scenario_1, 2: scenario_2, 3: scenario_3, 4: scenario_4, 5: scenario_5, 6: scenario_6}


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
    from kvlend_nixl import NixlBackend

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
    lender = _Lender()
    backend = NixlBackend(f"bench-reader-{os.getpid()}", timeout=XFER_TIMEOUT)
    try:
        for s in scenarios:
            report["scenarios"][str(s)] = SCENARIOS[s](lender, backend, sizes, progress)
    finally:
        backend.close()
        lender.close()
    return report


# ------------------------------------------------------------- formatting
def _fmt(r: dict) -> str:
    gb = f", {r['gbps']:.2f} GB/s" if "gbps" in r else ""
    return f"{r['p50_ms']:.3f} ms (min {r['min_ms']:.3f}, max {r['max_ms']:.3f}{gb})"


def format_report(report: dict) -> str:
    m = report["machine"]
    lines = [f"kvlend bench: {m['nproc']} CPUs, {m['memory_gib']} GiB, {m['cpu']}; "
             f"{report['reps']} reps after warm-up{' (--quick sizes)' if report['quick'] else ''}"]
    for key, s in report["scenarios"].items():
        lines.append(f"\nscenario {key}: {s['name']}")
        blocks = s.get("requests") or [s]
        for b in blocks:
            if "descriptors" in b and "tokens" in b:
                d = b["descriptors"]
                lines.append(f"  {b['tokens']} tokens x {b['layers']} layers, {b['bytes'] >> 20} MiB; descriptors: "
                             f"kvlend {d['kvlend']}, minimum {d['minimum']}, per page {d['per_page']}")
            for name, r in b["results"].items():
                extra = "" if "verified" not in r else f"  verified={r['verified']}"
                if name == "staging":
                    extra += "  [" + ", ".join(f"{k} {v['p50_ms']:.2f} ms" for k, v in r["steps"].items()) + "]"
                if "p99_ms" in r and key == "3":
                    extra = f"  p99 {r['p99_ms']:.3f} ms" + extra
                if "seconds" in r:  # scenario 5: one timed run of every request
                    lines.append(f"    {name:22s} {r['seconds'] * 1e3:.1f} ms, {r['gbps']:.2f} GB/s, "
                                 f"{r['requests_per_s']:.0f} requests/s{extra}")
                    continue
                if "ms" in r:  # scenario 4: one sample
                    more = f", handshake {r['handshake_ms']:.1f} ms" if "handshake_ms" in r else ""
                    lines.append(f"    {name:22s} {r['ms']:.1f} ms{more}{extra}")
                    continue
                lines.append(f"    {name:22s} {_fmt(r)}{extra}")
            lines.append("    ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in b["ratios"].items()))
            lines.append("    targets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in b["targets"].items()))
        if "one_chunk_transfer_ms" in s:
            lines.append(f"  the off mode's whole transfer {s['transfer_ms_off']:.2f} ms, one chunk's about "
                         f"{s['one_chunk_transfer_ms']:.2f} ms; left after the last chunk with progressive lending "
                         f"(its tail less the off tail's round trips) {s['transfer_left_ms']:.2f} ms")
        for note in s.get("notes", []):
            lines.append(f"  note: {note}")
        if "path" in s:
            lines.append(f"  path: {s['path']}")
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot, headless; checked before a run so a missing extra fails fast."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'kvlend[bench]'") from None
    return plt


_SERIES = {"kvlend": "kvlend", "raw_same_descriptors": "raw NIXL, kvlend's descriptors",
           "raw_nixl_notif": "raw NIXL, kvlend's descriptors", "raw_per_page": "raw NIXL, one descriptor per page",
           "raw_nixl_prepped": "raw NIXL, prepared page lists by index", "kvlend_node": "kvlend through the nodes",
           "kvlend_node_ahead": "kvlend through the nodes, reads ahead of the claim's answer",
           "staging": "host staging (gather + read + scatter)", "raw_nixl": "raw NIXL, one descriptor",
           "memcpy": "memcpy (same process)"}


def _throughputs(report: dict) -> tuple[list[str], dict[str, list[tuple[int, float]]]]:
    """Request labels, smallest first, and per method its (request index, GB/s at p50).

    Scenario 3 (small fragmented requests) and 2 (model-shaped, fragmented) come
    first, by size; scenario 1 (one contiguous lease) last.
    """
    blocks = []
    if "3" in report["scenarios"]:
        s3 = report["scenarios"]["3"]
        blocks.append((s3, f"{s3['pages']} pages x {s3['layers']} layer"))
    for b in report["scenarios"].get("2", {}).get("requests", []):
        blocks.append((b, f"{b['tokens'] // 1024}k tokens x {b['layers']} layers"))
    blocks.sort(key=lambda item: item[0]["bytes"])
    if "1" in report["scenarios"]:
        blocks.append((report["scenarios"]["1"], "one contiguous lease"))
    labels: list[str] = []
    series: dict[str, list[tuple[int, float]]] = {}
    for i, (b, label) in enumerate(blocks):
        labels.append(f"{label}\n{b['bytes'] / 2**20:g} MiB")
        for method, r in b["results"].items():
            series.setdefault(_SERIES[method], []).append((i, b["bytes"] / r["p50_ms"] / 1e6))
    return labels, series


def plot(report: dict, path: str) -> None:
    """Throughput against request size for kvlend and the baselines (needs the ``bench`` extra: matplotlib)."""
    plt = pyplot()
    labels, series = _throughputs(report)
    fig, ax = plt.subplots(figsize=(9, 5))
    lone = len(labels) - 1 if "1" in report["scenarios"] else None  # the contiguous lease: not on a line
    for (name, points), marker in zip(series.items(), "osD^vPX"):
        on_line = [p for p in points if p[0] != lone]
        (line,) = ax.plot([p[0] for p in on_line], [p[1] for p in on_line], marker=marker, label=name)
        ax.plot([p[0] for p in points if p[0] == lone], [p[1] for p in points if p[0] == lone], marker=marker,
                linestyle="none", color=line.get_color())
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel("request (fragmented pools, except the contiguous lease)")
    ax.set_ylabel("GB/s at p50 (higher is better)")
    m = report["machine"]
    ax.set_title(f"kvlend bench{' --quick' if report['quick'] else ''}: throughput by request size; "
                 f"{m['nproc']} CPUs, NIXL over UCX (cma) on loopback", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
