"""NixlBackend over real NIXL/UCX agents on DRAM (no mocks).

Progress threads are off, so every loop polls the lender too, as a real
lender must (a peer's first read completes only after the target progressed).
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import struct
import threading
import time

import numpy as np
import pytest

from kvlend.core.layout import MemoryKind, MemoryRegion
from kvlend.errors import BackendError, KvlendError, PeerLost, TransferCancelled, TransferTimeout
from kvlend.transport import ReadBatch, TransferBackend, available_backends, load_backend
from kvlend_nixl import NixlBackend
from kvlend_nixl.backend import peer_name
from tests.support.agents import PAGE, host_region, lender_main, poll_until, random_bytes

DEADLINE = 10.0
SIZE = 1 << 20
HOST = MemoryKind.HOST


def uniq(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def rows(base: int, offsets, lengths) -> np.ndarray:
    offsets = np.asarray(offsets, dtype=np.uint64)
    lengths = np.broadcast_to(np.asarray(lengths, dtype=np.uint64), offsets.shape)
    return np.stack([np.uint64(base) + offsets, lengths, np.zeros_like(offsets)], axis=1)


def batch(src: np.ndarray, dst: np.ndarray, src_off, dst_off, lengths) -> ReadBatch:
    return ReadBatch(HOST, HOST, rows(src.ctypes.data, src_off, lengths), rows(dst.ctypes.data, dst_off, lengths))


class Pair:
    """A reader and a lender agent in this process, each with one 1 MiB pool."""

    def __init__(self, seed: int = 1, **reader_options):
        self.reader = NixlBackend(uniq("reader"), **reader_options)
        self.lender = NixlBackend(uniq("lender"))
        self.src = random_bytes(SIZE, seed)
        self.dst = np.zeros(SIZE, np.uint8)
        self.reader.register([host_region(self.dst, "dst")])
        self.lender.register([host_region(self.src, "src")])
        self.peer = self.reader.add_peer(self.lender.metadata())

    def drain(self, tags):
        return poll_until(self.reader, tags, DEADLINE, others=[self.lender])

    def close(self):
        self.reader.close()
        self.lender.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


# ------------------------------------------------------------------ registry
@pytest.mark.nixl
def test_load_backend_finds_nixl_through_its_entry_point():
    assert available_backends()["nixl"] == "kvlend_nixl:NixlBackend"
    agent = uniq("via-registry")
    backend = load_backend("nixl", name=agent, timeout=5.0)
    unnamed = load_backend("nixl")
    try:
        assert isinstance(backend, NixlBackend)
        assert isinstance(backend, TransferBackend)
        assert backend.kind == unnamed.kind == "nixl"  # what a handshake compares
        assert backend.name == agent
        assert unnamed.name.startswith("kvlend-")
        assert peer_name(unnamed.metadata()) == unnamed.name
    finally:
        backend.close()
        unnamed.close()


@pytest.mark.nixl
def test_unknown_backend_names_the_installed_ones():
    with pytest.raises(BackendError, match=r"'no-such'.*installed: .*nixl"):
        load_backend("no-such")


@pytest.mark.nixl
def test_options_the_backend_does_not_take_are_a_backend_error():
    with pytest.raises(BackendError, match=r"backend 'nixl' refused options \{'bogus': 1\}: TypeError") as info:
        load_backend("nixl", bogus=1)
    assert isinstance(info.value.__cause__, TypeError)
    with pytest.raises(BackendError, match="error_mode") as info:  # the backend's own errors pass through
        load_backend("nixl", error_mode="bogus")
    assert info.value.__cause__ is None


@pytest.mark.nixl
@pytest.mark.parametrize("options, field", [
    ({"error_mode": "bogus"}, "error_mode"),
    ({"timeout": 0}, "timeout"),
    ({"timeout": float("inf")}, "timeout"),
    ({"abort_grace": 0}, "abort_grace"),
    ({"num_threads": -1}, "num_threads"),
    ({"name": ""}, "name"),
    ({"backend_params": {"num_threads": "2"}}, "num_threads"),
    ({"backend_params": {"engine_config": 3}}, "backend_params"),
])
def test_bad_options_are_refused_before_an_agent_exists(options, field):
    with pytest.raises(BackendError, match=field):
        NixlBackend(**options)


# ------------------------------------------------------------- happy paths
@pytest.mark.nixl
def test_scattered_batches_in_one_process_move_the_right_bytes(pair):
    rng = np.random.default_rng(7)
    expected = np.zeros(SIZE, np.uint8)
    tags, cursor = [], 0
    for t in range(3):
        batches = []
        for _ in range(3):
            # variable-length coalesced runs, scattered over the lender's pool
            lengths = rng.integers(1, 24, size=8) * 512
            src_off = rng.integers(0, (SIZE - 24 * 512) // 64, size=8) * 64
            dst_off = cursor + np.concatenate([[0], np.cumsum(lengths)[:-1]])
            cursor += int(lengths.sum())
            batches.append(batch(pair.src, pair.dst, src_off, dst_off, lengths))
            for s, d, n in zip(src_off, dst_off, lengths):
                expected[d:d + n] = pair.src[s:s + n]
        tag = f"chunk-{t}".encode()
        pair.reader.post_read(pair.peer, batches, tag)
        tags.append(tag)
    done = pair.drain(tags)
    assert {c.tag: c.error for c in done.values()} == {t: None for t in tags}
    assert np.array_equal(pair.dst, expected)
    assert pair.reader.poll() == []


@pytest.mark.nixl
@pytest.mark.parametrize("options", [
    {"progress_thread": True}, {"error_mode": "none"}, {"num_threads": 2}, {"thread_safe": True},
])
def test_reads_work_under_each_agent_option(options):
    p = Pair(seed=11, **options)
    try:
        n = 64
        order = np.random.default_rng(3).permutation(SIZE // PAGE)[:n]
        p.reader.post_read(p.peer, [batch(p.src, p.dst, order * PAGE, np.arange(n) * PAGE, PAGE)], b"opt")
        assert p.drain([b"opt"])[b"opt"].error is None
        assert np.array_equal(p.dst[:n * PAGE].reshape(n, PAGE), p.src.reshape(-1, PAGE)[order])
    finally:
        p.close()


@pytest.mark.nixl
def test_empty_read_completes_at_once(pair):
    empty = np.zeros((0, 3), np.uint64)
    pair.reader.post_read(pair.peer, [ReadBatch(HOST, HOST, empty, empty)], b"nothing")
    assert pair.drain([b"nothing"])[b"nothing"].error is None


@pytest.mark.nixl
def test_thread_safe_backend_posts_from_a_worker_thread():
    p = Pair(thread_safe=True)
    try:
        tags = [f"t{i}".encode() for i in range(8)]

        def post():
            for i, tag in enumerate(tags):
                p.reader.post_read(p.peer, [batch(p.src, p.dst, [i * PAGE], [i * PAGE], PAGE)], tag)

        worker = threading.Thread(target=post)
        worker.start()
        done = p.drain(tags)  # polls while the worker is still posting
        worker.join(DEADLINE)
        assert not worker.is_alive()
        assert all(done[t].error is None for t in tags)
        assert np.array_equal(p.dst[:8 * PAGE], p.src[:8 * PAGE])
    finally:
        p.close()


@pytest.mark.nixl
def test_register_is_once_per_region_and_device_needs_a_gpu(pair):
    again = host_region(pair.dst, "dst-again")
    pair.reader.register([again, again])  # already registered: no second NIXL registration
    assert len(pair.reader._registrations) == 1
    with pytest.raises(BackendError, match="no address"):
        pair.reader.register([MemoryRegion("nowhere", HOST, 0, PAGE, PAGE, 1, 0)])
    try:
        import torch
        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if gpu:
        t = torch.zeros(SIZE, dtype=torch.uint8, device="cuda")
        pair.reader.register([MemoryRegion("vram", MemoryKind.DEVICE, t.device.index or 0, SIZE, PAGE,
                                           SIZE // PAGE, t.data_ptr())])
        assert len(pair.reader._registrations) == 2
    else:
        with pytest.raises(BackendError, match="need a CUDA GPU"):
            pair.reader.register([MemoryRegion("vram", MemoryKind.DEVICE, 0, SIZE, PAGE, SIZE // PAGE, 1 << 40)])
        assert len(pair.reader._registrations) == 1


# --------------------------------------------------------------- bad input
@pytest.mark.nixl
def test_invalid_reads_raise_before_anything_is_posted(pair):
    good = batch(pair.src, pair.dst, [0], [0], PAGE)
    with pytest.raises(BackendError, match="unknown peer 'nobody'"):
        pair.reader.post_read("nobody", [good], b"x")
    with pytest.raises(BackendError, match="ReadBatch"):
        pair.reader.post_read(pair.peer, [object()], b"x")
    with pytest.raises(BackendError, match="tag must be bytes"):
        pair.reader.post_read(pair.peer, [good], "x")
    with pytest.raises(BackendError, match="uint64"):
        ReadBatch(HOST, HOST, np.zeros((1, 3), np.float64), np.zeros((1, 3), np.float64))
    outside = batch(pair.src, pair.dst, [0], [SIZE], PAGE)  # past the end of the local pool
    with pytest.raises(BackendError, match="local row 0 .* outside every registered region"):
        pair.reader.post_read(pair.peer, [good, outside], b"x")
    remote_outside = batch(pair.src, pair.dst, [SIZE], [0], PAGE)  # NIXL checks the peer's side
    with pytest.raises(BackendError, match="building read b'x'"):
        pair.reader.post_read(pair.peer, [good, remote_outside], b"x")
    wrong_kind = ReadBatch(HOST, MemoryKind.DEVICE, good.remote, good.local)
    with pytest.raises(BackendError, match="DEVICE device 0\\) is outside"):
        pair.reader.post_read(pair.peer, [wrong_kind], b"x")
    assert pair.reader.poll() == [] and pair.reader._reads == {}
    pair.reader.post_read(pair.peer, [good], b"x")  # the tag was never taken
    with pytest.raises(BackendError, match="already in flight"):
        pair.reader.post_read(pair.peer, [good], b"x")
    assert pair.drain([b"x"])[b"x"].error is None
    assert np.array_equal(pair.dst[:PAGE], pair.src[:PAGE])


@pytest.mark.nixl
@pytest.mark.parametrize("count", [1, 40])  # short lists are checked row by row, long ones vectorised
@pytest.mark.parametrize("last, why", [((SIZE - PAGE // 2, PAGE), "outside every registered region"),
                                        ((0, 0), "zero-length descriptor")])
def test_a_bad_last_local_row_is_named_whatever_the_list_length(pair, count, last, why):
    offsets, lengths = [i * PAGE for i in range(count - 1)] + [last[0]], [PAGE] * (count - 1) + [last[1]]
    bad = batch(pair.src, pair.dst, [0] * count, offsets, lengths)
    with pytest.raises(BackendError, match=f"batches\\[0\\]: .*{why}"):
        pair.reader.post_read(pair.peer, [bad], b"x")
    assert pair.reader._reads == {}


@pytest.mark.nixl
def test_bad_peer_metadata_is_a_backend_error(pair):
    md = pair.lender.metadata()
    assert peer_name(md) == pair.peer
    assert pair.reader.add_peer(md) == pair.peer  # same metadata again: kept as is
    with pytest.raises(BackendError, match="this agent itself"):
        pair.reader.add_peer(pair.reader.metadata())
    with pytest.raises(BackendError, match="must be bytes"):
        pair.reader.add_peer("metadata")
    with NixlBackend(uniq("stranger")) as stranger:
        stranger.register([host_region(np.zeros(PAGE, np.uint8), "s")])
        other = stranger.metadata()
    for cut in range(0, len(other), 23):
        with pytest.raises(BackendError):
            pair.reader.add_peer(other[:cut])
    # The known peer is untouched by all that.
    pair.reader.post_read(pair.peer, [batch(pair.src, pair.dst, [0], [0], PAGE)], b"still")
    assert pair.drain([b"still"])[b"still"].error is None


# ----------------------------------------------------------------- failures
# The lender is never polled in these tests until said so, so a peer's first
# read stays in flight: NIXL's own handle state, checked by in_nixl_flight.
def in_nixl_flight(backend: NixlBackend, tag: bytes) -> bool:
    read = backend._reads.get(tag)  # a read whose transfer() finished the copy is settled at once
    return read is not None and all(backend._agent.check_xfer_state(h) == "PROC" for h in read.handles)


def poll_quietly(backend: NixlBackend, seconds: float) -> list:
    """Everything ``backend`` reports within ``seconds`` of polling (lender not polled)."""
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        out += backend.poll()
        time.sleep(1e-3)
    return out


@pytest.mark.nixl
def test_cancel_of_an_unknown_or_reported_tag_is_a_no_op(pair):
    pair.reader.cancel(b"never-posted")
    pair.reader.post_read(pair.peer, [batch(pair.src, pair.dst, [0], [0], PAGE)], b"x")
    assert pair.drain([b"x"])[b"x"].error is None
    pair.reader.cancel(b"x")  # already reported
    assert pair.reader.poll() == [] and pair.reader.in_flight == 0
    with pytest.raises(BackendError, match="tag must be bytes"):
        pair.reader.cancel("x")


@pytest.mark.nixl
def test_cancel_after_the_read_finished_reports_its_success(pair):
    pair.reader.post_read(pair.peer, [batch(pair.src, pair.dst, [0], [0], PAGE)], b"wire-up")
    pair.drain([b"wire-up"])  # from now on, over cma, the copy happens inside transfer()
    pair.reader.post_read(pair.peer, [batch(pair.src, pair.dst, [0], [0], SIZE)], b"done")
    assert pair.reader.in_flight == 1 and not in_nixl_flight(pair.reader, b"done")
    pair.reader.cancel(b"done")
    assert pair.drain([b"done"])[b"done"].error is None
    assert np.array_equal(pair.dst, pair.src) and pair.reader.in_flight == 0


@pytest.mark.nixl
def test_cancelled_read_is_reported_only_once_nixl_has_finished_it():
    p = Pair()
    try:
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [0], [0], PAGE)], b"wanted")
        assert in_nixl_flight(p.reader, b"wanted")
        p.reader.cancel(b"wanted")
        assert poll_quietly(p.reader, 0.2) == []  # quarantined: NIXL still says PROC
        assert p.reader.in_flight == 1 and in_nixl_flight(p.reader, b"wanted")
        [done] = p.drain([b"wanted"]).values()  # the lender progresses: the handle ends
        assert isinstance(done.error, TransferCancelled) and "cancelled" in str(done.error)
        assert p.reader.in_flight == 0 and p.reader.resets == 0
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [PAGE], [PAGE], PAGE)], b"next")
        assert p.drain([b"next"])[b"next"].error is None
        assert np.array_equal(p.dst[PAGE:2 * PAGE], p.src[PAGE:2 * PAGE])
    finally:
        p.close()


@pytest.mark.nixl
def test_read_that_never_stops_gets_the_agent_rebuilt_after_the_grace():
    p = Pair(abort_grace=0.3)
    try:
        before = p.reader.metadata()
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [0], [0], PAGE)], b"stuck")
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [PAGE], [PAGE], PAGE)], b"bystander")
        p.reader.cancel(b"stuck")
        start = time.monotonic()
        done = poll_until(p.reader, [b"stuck", b"bystander"], DEADLINE)
        assert time.monotonic() - start >= 0.3
        assert isinstance(done[b"stuck"].error, TransferCancelled)
        # The rebuilt agent stops every read of the old one.
        assert type(done[b"bystander"].error) is BackendError and "aborted" in str(done[b"bystander"].error)
        assert p.reader.resets == 1 and p.reader.metadata() != before
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [0], [0], SIZE)], b"after")  # regions, peer reloaded
        assert p.drain([b"after"])[b"after"].error is None
        assert np.array_equal(p.dst, p.src)
    finally:
        p.close()


@pytest.mark.nixl
def test_a_reset_that_cannot_make_an_agent_still_reports_and_tries_again(monkeypatch):
    p = Pair(abort_grace=0.2)
    try:
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [0], [0], PAGE)], b"stuck")
        p.reader.cancel(b"stuck")

        def no_device():
            raise BackendError("no usable UCX device (link down?)")

        monkeypatch.setattr(p.reader, "_start_agent", no_device)
        [done] = poll_until(p.reader, [b"stuck"], DEADLINE).values()
        assert isinstance(done.error, TransferCancelled) and p.reader.resets == 1
        with pytest.raises(BackendError, match="no agent since its reset: no usable UCX device"):
            p.reader.post_read(p.peer, [batch(p.src, p.dst, [0], [0], PAGE)], b"refused")
        assert p.reader.poll() == [] and p.reader.in_flight == 0
        monkeypatch.undo()  # the device is back: the next call makes the agent
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [0], [0], SIZE)], b"back")
        assert p.drain([b"back"])[b"back"].error is None
        assert np.array_equal(p.dst, p.src)
    finally:
        p.close()


@pytest.mark.nixl
def test_removed_peer_fails_its_reads_with_peer_lost_once_they_stopped():
    p = Pair()
    try:
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [0], [0], PAGE)], b"pending")
        p.reader.remove_peer(p.peer)
        with pytest.raises(BackendError, match="unknown peer") as info:
            p.reader.post_read(p.peer, [batch(p.src, p.dst, [0], [0], PAGE)], b"later")
        assert type(info.value).__module__ == "kvlend.errors"
        with pytest.raises(BackendError, match="unknown peer"):
            p.reader.remove_peer(p.peer)
        assert poll_quietly(p.reader, 0.1) == [] and in_nixl_flight(p.reader, b"pending")
        [done] = p.drain([b"pending"]).values()
        assert isinstance(done.error, PeerLost) and "removed" in str(done.error)
        assert p.reader.resets == 0
        assert p.reader.add_peer(p.lender.metadata()) == p.peer  # unloaded from NIXL, loads again
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [0], [0], PAGE)], b"back")
        assert p.drain([b"back"])[b"back"].error is None
    finally:
        p.close()


@pytest.mark.nixl
def test_removed_peer_added_back_while_its_reads_drain_is_kept():
    p = Pair()
    try:
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [0], [0], PAGE)], b"pending")
        p.reader.remove_peer(p.peer)
        assert p.reader.add_peer(p.lender.metadata()) == p.peer
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [PAGE], [PAGE], PAGE)], b"new")
        done = p.drain([b"pending", b"new"])
        assert isinstance(done[b"pending"].error, PeerLost) and done[b"new"].error is None
        assert np.array_equal(p.dst[PAGE:2 * PAGE], p.src[PAGE:2 * PAGE])
    finally:
        p.close()


@pytest.mark.nixl
def test_peer_replaced_while_its_read_is_in_flight_rebuilds_the_agent():
    p = Pair()
    twin = NixlBackend(p.peer)  # a new incarnation under the same name, the old one still alive
    try:
        fresh = random_bytes(SIZE, 42)
        twin.register([host_region(fresh, "src")])
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [0], [0], PAGE)], b"old")
        assert p.reader.add_peer(twin.metadata()) == p.peer
        assert p.reader.resets == 1
        [done] = poll_until(p.reader, [b"old"], DEADLINE).values()
        assert isinstance(done.error, PeerLost) and "replaced" in str(done.error)
        p.reader.post_read(p.peer, [batch(fresh, p.dst, [0], [0], SIZE)], b"new")
        assert poll_until(p.reader, [b"new"], DEADLINE, others=[twin])[b"new"].error is None
        assert np.array_equal(p.dst, fresh)
    finally:
        twin.close()
        p.close()


@pytest.mark.nixl
def test_overdue_read_times_out_and_the_link_still_works():
    p = Pair(timeout=0.2, abort_grace=0.3)
    try:
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [0], [0], PAGE)], b"slow")
        [done] = poll_until(p.reader, [b"slow"], DEADLINE).values()  # lender not polled: the grace ends it
        assert isinstance(done.error, TransferTimeout) and "cancelled" in str(done.error)
        assert p.reader.resets == 1
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [PAGE], [PAGE], PAGE)], b"next")
        assert p.drain([b"next"])[b"next"].error is None
        assert np.array_equal(p.dst[PAGE:2 * PAGE], p.src[PAGE:2 * PAGE])
    finally:
        p.close()


@pytest.mark.nixl
def test_restarted_peer_with_the_same_name_replaces_the_stale_one(pair):
    name = pair.peer
    pair.reader.post_read(pair.peer, [batch(pair.src, pair.dst, [0], [0], PAGE)], b"old")
    pair.drain([b"old"])
    pair.lender.close()
    pair.lender = NixlBackend(name)  # same name, new incarnation and new pool
    fresh = random_bytes(SIZE, 99)
    pair.lender.register([host_region(fresh, "src")])
    assert pair.reader.add_peer(pair.lender.metadata()) == name
    pair.reader.post_read(name, [batch(fresh, pair.dst, [0], [0], SIZE)], b"new")
    assert pair.drain([b"new"])[b"new"].error is None
    assert np.array_equal(pair.dst, fresh)


@pytest.mark.nixl
def test_close_is_idempotent_and_final():
    backend = NixlBackend(uniq("closing"))
    buf = np.zeros(SIZE, np.uint8)
    backend.register([host_region(buf, "buf")])
    backend.deregister()
    backend.register([host_region(buf, "buf")])
    with backend:
        pass
    backend.close()
    for call in (backend.poll, backend.metadata, backend.deregister, lambda: backend.remove_peer("x"),
                 lambda: backend.cancel(b"x")):
        with pytest.raises(BackendError, match="closed"):
            call()


# ------------------------------------------------------------ two processes
def _spawn_lender(ctx, name: str, seed: int):
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=lender_main, args=(child, name, SIZE, seed), daemon=True)
    proc.start()
    multiprocessing.connection.wait([parent, proc.sentinel], timeout=60)
    if not parent.poll():
        proc.kill()
        raise AssertionError(f"lender process sent no metadata (exit code {proc.exitcode})")
    metadata = parent.recv_bytes()
    (address,) = struct.unpack("<Q", parent.recv_bytes())
    return proc, parent, metadata, address


def _remote_read(reader, peer, address, dst, src_pages, tag) -> None:
    n = len(src_pages)
    remote = rows(address, np.asarray(src_pages) * PAGE, PAGE)
    local = rows(dst.ctypes.data, np.arange(n) * PAGE, PAGE)
    reader.post_read(peer, [ReadBatch(HOST, HOST, remote[: n // 2], local[: n // 2]),
                            ReadBatch(HOST, HOST, remote[n // 2:], local[n // 2:])], tag)


@pytest.mark.system
def test_two_processes_read_then_survive_the_lender_dying():
    ctx = multiprocessing.get_context("spawn")
    name = uniq("lender-proc")
    reader = NixlBackend(uniq("reader"), timeout=5.0)
    dst = np.zeros(SIZE, np.uint8)
    reader.register([host_region(dst, "dst")])
    proc, conn, metadata, address = _spawn_lender(ctx, name, seed=3)
    try:
        peer = reader.add_peer(metadata)
        assert peer == name
        order = np.random.default_rng(5).permutation(SIZE // PAGE)
        _remote_read(reader, peer, address, dst, order, b"first")
        assert poll_until(reader, [b"first"], DEADLINE)[b"first"].error is None
        expected = random_bytes(SIZE, 3).reshape(-1, PAGE)[order].ravel()
        assert np.array_equal(dst, expected)

        os.kill(proc.pid, signal.SIGKILL)
        proc.join(DEADLINE)
        _remote_read(reader, peer, address, dst, order[:4], b"orphan")
        error = poll_until(reader, [b"orphan"], DEADLINE)[b"orphan"].error
        assert isinstance(error, (PeerLost, TransferTimeout)), error
        assert isinstance(error, KvlendError)

        # The lender restarts under the same name: the stale peer is replaced.
        proc, conn, metadata, address = _spawn_lender(ctx, name, seed=4)
        assert reader.add_peer(metadata) == name
        dst[:] = 0
        _remote_read(reader, name, address, dst, np.arange(SIZE // PAGE), b"again")
        assert poll_until(reader, [b"again"], DEADLINE)[b"again"].error is None
        assert np.array_equal(dst, random_bytes(SIZE, 4))
        conn.send_bytes(b"stop")
        proc.join(DEADLINE)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        reader.close()


@pytest.mark.nixl
def test_a_retired_agent_is_drained_and_its_read_reported_only_once_it_cannot_write():
    p = Pair(abort_grace=0.2)
    try:
        p.reader.post_read(p.peer, [batch(p.src, p.dst, [0], [0], PAGE)], b"stuck")  # lands once the lender polls
        p.reader.cancel(b"stuck")
        end = time.monotonic() + DEADLINE
        while p.reader.resets == 0 and time.monotonic() < end:
            assert p.reader.poll() == []
            time.sleep(1e-3)
        [retired] = p.reader._retired
        retired.until = math.inf  # the drain's own deadline is not what this test is about
        assert poll_quietly(p.reader, 0.2) == [] and p.reader.in_flight == 1  # quarantined while it may write
        [done] = p.drain([b"stuck"]).values()  # the lender answers: the retired agent drains
        assert isinstance(done.error, TransferCancelled)
        assert np.array_equal(p.dst[:PAGE], p.src[:PAGE])  # what landed during the drain, before the report
        assert p.reader._retired == [] and p.reader.in_flight == 0  # closed once drained
    finally:
        p.close()
