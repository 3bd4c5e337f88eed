"""``NixlBackend``: kvlend's transfer backend over NIXL (UCX underneath).

Shaped by NIXL 1.5.1's measured behaviour (see README):

* The progress thread is off by default.  On small hosts it starves under
  polling Python threads, so ``poll()`` progresses the agent itself, and the
  lender must call ``poll()`` too: a peer's first read completes only once
  the target side has been progressed.
* Reads are built per post with ``initialize_xfer``: descriptors are
  variable-length coalesced runs, which a list prepped once per peer cannot
  index.
* Over cma (one host) ``transfer()`` copies synchronously; it runs outside
  this object's lock, but the agent itself is unlocked by default
  (``NIXL_THREAD_SYNC_NONE``): using one backend from several threads at
  once (say, polling during a post) needs ``thread_safe=True``.
* Every NIXL exception becomes a ``BackendError``/``PeerLost``; runtime
  failures come back as ``Completion(tag, error)``, bad arguments raise.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
from nixl import _bindings as _nb
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from kvlend.backend import Completion, ReadBatch
from kvlend.errors import BackendError, KvlendError, PeerLost, TransferTimeout
from kvlend.layout import MemoryKind, MemoryRegion

_MEM = {MemoryKind.HOST: "DRAM", MemoryKind.DEVICE: "VRAM"}
_ERROR_MODES = ("peer", "none")
_MAX_METADATA = 64 << 20
_MAX_NAME = 256
# Serialized agent metadata starts with the agent's name (nixlSerDes, NIXL 1.x).
_MD_PREFIX = b"nixlSerDes|Agent"
_DISCONNECT = (_nb.nixlRemoteDisconnectError,)


def _quiet_nixl_logging() -> None:
    """NIXL logs every agent and backend creation at INFO on stdout; keep WARNING.

    An explicit ``NIXL_LOG_LEVEL`` (read by NIXL itself) is left to rule.
    """
    if "NIXL_LOG_LEVEL" in os.environ:
        return
    log = logging.getLogger("nixl")
    if log.level == logging.INFO:  # NIXL's own default, not a user's choice
        log.setLevel(logging.WARNING)


_quiet_nixl_logging()


def _as_error(exc: BaseException, what: str) -> KvlendError:
    if isinstance(exc, KvlendError):
        return exc
    cls = PeerLost if isinstance(exc, _DISCONNECT) else BackendError
    return cls(f"{what}: {type(exc).__name__}: {exc}")


def peer_name(metadata: bytes) -> str:
    """The agent name inside NIXL metadata, read before loading it.

    NIXL refuses (NOT_ALLOWED) new metadata under a name it already holds, so a
    restarted peer must be removed first, and for that its name must be known.
    """
    head = len(_MD_PREFIX)
    if not metadata.startswith(_MD_PREFIX) or len(metadata) < head + 8:
        raise BackendError("peer metadata is not NIXL agent metadata (bad header)")
    (size,) = struct.unpack_from("=Q", metadata, head)
    end = head + 8 + size
    if not 0 < size <= _MAX_NAME or len(metadata) <= end or metadata[end:end + 1] != b"|":
        raise BackendError(f"peer metadata has a malformed agent name (length {size})")
    try:
        return metadata[head + 8:end].decode("utf-8")
    except UnicodeDecodeError:
        raise BackendError("peer metadata agent name is not UTF-8") from None


@dataclass(eq=False)
class _Read:
    """One tag: its handles, which are done, and its first error."""

    peer: str
    handles: list
    deadline: float
    posted: bool = False
    done: list = field(default_factory=list)
    error: KvlendError | None = None


class NixlBackend:
    """A NIXL agent with one UCX backend, driven by ``poll()``.

    ``name`` is the NIXL agent name peers know this side by (default: unique
    per process); ``kind`` is the registry name both ends must share.
    ``progress_thread``: NIXL's own progress thread (off: ``poll()`` progresses;
    on: never busy-spin around it).  ``num_threads``: UCX worker threads that
    split big descriptor batches.  ``error_mode``: UCX ``peer`` (detects dead
    peers) or ``none`` (shared-memory notifications, no disconnect detection).
    ``timeout``: seconds a tag may stay in flight before it fails with
    ``TransferTimeout``.  ``thread_safe``: NIXL locks (RW) for use from several
    threads.  ``backend_params``: further UCX backend parameters.
    """

    kind = "nixl"

    def __init__(
        self,
        name: str | None = None,
        *,
        progress_thread: bool = False,
        num_threads: int = 0,
        error_mode: str = "peer",
        timeout: float = 10.0,
        thread_safe: bool = False,
        backend_params: Mapping[str, str] | None = None,
    ) -> None:
        if name is None:
            name = f"kvlend-{os.getpid()}-{secrets.token_hex(4)}"
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME:
            raise BackendError(f"name must be a str of 1..{_MAX_NAME} characters, got {name!r}")
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 0:
            raise BackendError(f"num_threads must be an int >= 0, got {num_threads!r}")
        if error_mode not in _ERROR_MODES:
            raise BackendError(f"error_mode must be one of {_ERROR_MODES}, got {error_mode!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise BackendError(f"timeout must be a positive finite number of seconds, got {timeout!r}")
        params = dict(backend_params or {})
        for key, value in params.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise BackendError(f"backend_params must map str to str, got {key!r}: {value!r}")
            if key in ("ucx_error_handling_mode", "num_threads"):
                raise BackendError(f"backend_params[{key!r}]: use the {key.removeprefix('ucx_')} option instead")
        params["ucx_error_handling_mode"] = error_mode
        if num_threads:
            params["num_threads"] = str(num_threads)
        # UCX worker threads need a locking mode too (nixl PR 686).
        locking = thread_safe or num_threads > 0
        sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW if locking else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[], sync_mode=sync)
        try:
            agent = nixl_agent(name, config)
            agent.create_backend("UCX", params)
        except Exception as exc:
            raise _as_error(exc, f"creating NIXL agent {name!r} with UCX {params}") from None
        self.name = name
        self.timeout = float(timeout)
        self._agent = agent
        self._lock = threading.RLock()
        self._registrations: list = []  # nixlRegDList per register() call and kind
        self._registered: set[tuple] = set()
        self._spans: dict[tuple[MemoryKind, int], tuple[np.ndarray, np.ndarray]] = {}
        self._peers: dict[str, bytes] = {}
        self._reads: dict[bytes, _Read] = {}
        self._completed: list[Completion] = []
        self._unreleased: list = []  # handles whose release failed; retried on poll

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> NixlBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open_agent(self) -> nixl_agent:
        if self._agent is None:
            raise BackendError(f"NIXL backend {self.name!r} is closed")
        return self._agent

    # ------------------------------------------------------------- memory
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register each region once (HOST as DRAM, DEVICE as VRAM)."""
        with self._lock:
            agent = self._open_agent()
            new: dict[MemoryKind, dict[tuple, MemoryRegion]] = {}
            for r in regions:
                if not isinstance(r, MemoryRegion):
                    raise BackendError(f"register() takes MemoryRegion objects, got {type(r).__name__}")
                if r.address == 0:
                    raise BackendError(f"region {r.name!r} has no address (address=0)")
                key = (r.kind, r.device_id, r.address, r.size)
                if key not in self._registered:
                    new.setdefault(r.kind, {})[key] = r
            if MemoryKind.DEVICE in new:
                _check_gpus(new[MemoryKind.DEVICE].values())
            done = []
            try:
                for kind, rows in new.items():
                    arr = np.array([[r.address, r.size, r.device_id] for r in rows.values()], dtype=np.uint64)
                    done.append(agent.register_memory(arr, _MEM[kind]))
            except Exception as exc:
                for dlist in done:
                    self._quietly(agent.deregister_memory, dlist)
                raise _as_error(exc, f"registering {sum(map(len, new.values()))} regions") from None
            self._registrations.extend(done)
            for rows in new.values():
                self._registered.update(rows)
            self._spans = _spans(self._registered)

    def deregister(self) -> None:
        """Deregister everything; refused while reads are in flight."""
        with self._lock:
            agent = self._open_agent()
            if self._reads:
                raise BackendError(f"cannot deregister while {len(self._reads)} reads are in flight")
            failures = [
                exc for dlist in self._registrations
                if (exc := self._quietly(agent.deregister_memory, dlist)) is not None
            ]
            self._registrations.clear()
            self._registered.clear()
            self._spans = {}
        if failures:
            raise _as_error(failures[0], f"deregistering ({len(failures)} lists failed)")

    # -------------------------------------------------------------- peers
    def metadata(self) -> bytes:
        with self._lock:
            agent = self._open_agent()
            try:
                return bytes(agent.get_agent_metadata())
            except Exception as exc:
                raise _as_error(exc, "reading local agent metadata") from None

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer; a peer already known under the same name is replaced."""
        if not isinstance(metadata, (bytes, bytearray, memoryview)):
            raise BackendError(f"peer metadata must be bytes, got {type(metadata).__name__}")
        data = bytes(metadata)
        if len(data) > _MAX_METADATA:
            raise BackendError(f"peer metadata of {len(data)} bytes exceeds the cap of {_MAX_METADATA}")
        name = peer_name(data)
        if name == self.name:
            raise BackendError(f"peer metadata names this agent itself ({name!r})")
        with self._lock:
            agent = self._open_agent()
            if self._peers.get(name) == data:
                return name
            if name in self._peers:
                self._drop_peer(agent, name, f"peer {name!r} was replaced by new metadata (restarted?)")
            try:
                agent.add_remote_agent(data)
            except Exception as exc:
                # NIXL 1.5 keeps the UCX connection of a half-loaded peer, so
                # later loads under this name may fail until the agent is new.
                raise _as_error(exc, f"loading metadata of peer {name!r} (malformed or truncated?)") from None
            self._peers[name] = data
            return name

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            agent = self._open_agent()
            self._known(peer)
            self._drop_peer(agent, peer, f"peer {peer!r} was removed")

    def _known(self, peer: str) -> None:
        if peer not in self._peers:
            raise BackendError(f"unknown peer {peer!r} (known: {sorted(self._peers) or 'none'})")

    def _drop_peer(self, agent: nixl_agent, peer: str, why: str) -> None:
        for read in self._reads.values():
            if read.peer == peer and read.error is None:
                read.error = PeerLost(why)
        self._finish_failed()
        del self._peers[peer]
        self._quietly(agent.remove_remote_agent, peer)

    # -------------------------------------------------------------- reads
    def post_read(self, peer: str, batches: Sequence[ReadBatch], tag: bytes) -> None:
        """Post every batch; ``poll()`` reports one ``Completion(tag)`` for all."""
        if not isinstance(tag, bytes):
            raise BackendError(f"tag must be bytes, got {type(tag).__name__}")
        batches = list(batches)
        for i, b in enumerate(batches):
            if not isinstance(b, ReadBatch):
                raise BackendError(f"batches[{i}] must be a ReadBatch, got {type(b).__name__}")
        with self._lock:
            agent = self._open_agent()
            self._known(peer)
            if tag in self._reads:
                raise BackendError(f"tag {tag!r} is already in flight")
            for i, b in enumerate(batches):
                if b.count:
                    self._check_local(i, b)
            batches = [b for b in batches if b.count]
            handles: list = []
            try:
                for b in batches:
                    local = agent.get_xfer_descs(np.ascontiguousarray(b.local), _MEM[b.local_kind])
                    remote = agent.get_xfer_descs(np.ascontiguousarray(b.remote), _MEM[b.remote_kind])
                    handles.append(agent.initialize_xfer("READ", local, remote, peer))
            except Exception as exc:
                for h in handles:
                    self._release(h)
                err = _as_error(exc, f"building read {tag!r} from peer {peer!r}")
                if not isinstance(err, PeerLost):
                    raise err from None
                self._completed.append(Completion(tag, err))
                return
            read = _Read(peer, handles, time.monotonic() + self.timeout, done=[False] * len(handles))
            self._reads[tag] = read
        # Outside this object's lock (over cma the copy happens inside transfer()); concurrent
        # calls into the agent are safe only with thread_safe=True (NIXL's RW sync mode).
        done, error = [], None
        for h in handles:
            try:
                state = agent.transfer(h)
            except Exception as exc:
                error = _as_error(exc, f"posting read {tag!r} to peer {peer!r}")
                break
            if state == "ERR":
                error = BackendError(f"posting read {tag!r} to peer {peer!r}: NIXL returned ERR")
                break
            done.append(state == "DONE")
        with self._lock:
            if self._reads.get(tag) is not read:  # closed meanwhile
                for h in handles:
                    self._release(h)
                return
            read.done[:len(done)] = done
            read.posted = True
            if read.error is None:
                read.error = error
            self._finish_failed()

    def _check_local(self, index: int, batch: ReadBatch) -> None:
        """Every local row must lie inside one registered region of its kind and device."""
        rows = batch.local
        addr, length, dev = rows[:, 0], rows[:, 1], rows[:, 2]
        end = addr + length
        first = int(dev[0])
        devices = (first,) if (dev == first).all() else np.unique(dev).tolist()
        ok = end > addr  # neither empty nor wrapped around
        for device in devices:
            spans = self._spans.get((batch.local_kind, device))
            inside = spans is not None
            if inside:  # the span starting at or below addr must reach end
                starts, ends_before = spans
                inside = end <= ends_before[np.searchsorted(starts, addr, side="right")]
            ok &= inside if len(devices) == 1 else inside | (dev != device)
        if not ok.all():
            if not length.all():
                raise BackendError(f"batches[{index}]: zero-length descriptor at row {int(np.argmin(length != 0))}")
            row = int(np.argmin(ok))
            raise BackendError(
                f"batches[{index}]: local row {row} (0x{int(addr[row]):x}+{int(length[row])}, "
                f"{batch.local_kind.value} device {int(dev[row])}) is outside every registered region"
            )

    def poll(self) -> list[Completion]:
        """Progress the agent; return reads finished, failed or overdue since the last poll."""
        with self._lock:
            agent = self._open_agent()
            try:
                agent.get_new_notifs()  # progresses the worker (the target side needs it)
            except Exception as exc:
                raise _as_error(exc, "progressing the NIXL agent") from None
            now = time.monotonic()
            for tag, read in self._reads.items():
                if not read.posted or read.error is not None:
                    continue
                read.error = self._check(agent, tag, read)
                if read.error is None and not all(read.done) and now >= read.deadline:
                    read.error = TransferTimeout(
                        f"read {tag!r} from peer {read.peer!r} still in flight after {self.timeout:g} s; aborted"
                    )
            for tag in [t for t, r in self._reads.items() if r.posted and r.error is None and all(r.done)]:
                for h in self._reads.pop(tag).handles:
                    self._release(h)
                self._completed.append(Completion(tag))
            self._finish_failed()
            for h in self._unreleased[:]:
                self._unreleased.remove(h)
                self._release(h)
            out, self._completed = self._completed, []
            return out

    def _check(self, agent: nixl_agent, tag: bytes, read: _Read) -> KvlendError | None:
        for i, h in enumerate(read.handles):
            if read.done[i]:
                continue
            try:
                state = agent.check_xfer_state(h)
            except Exception as exc:
                return _as_error(exc, f"read {tag!r} from peer {read.peer!r}")
            if state == "ERR":
                return BackendError(f"read {tag!r} from peer {read.peer!r}: NIXL returned ERR")
            read.done[i] = state == "DONE"
        return None

    def _finish_failed(self) -> None:
        """Abort and report every posted read that has an error."""
        for tag in [t for t, r in self._reads.items() if r.posted and r.error is not None]:
            read = self._reads.pop(tag)
            for h in read.handles:
                self._release(h)
            self._completed.append(Completion(tag, read.error))

    def _release(self, handle) -> None:
        """Release (aborting if active); a handle NIXL cannot free yet is retried later."""
        if self._quietly(handle.release) is not None:
            self._unreleased.append(handle)

    @staticmethod
    def _quietly(fn, *args) -> Exception | None:
        try:
            fn(*args)
        except Exception as exc:
            return exc
        return None

    def close(self) -> None:
        """Abort reads, deregister, forget peers and drop the agent (idempotent)."""
        with self._lock:
            agent = self._agent
            if agent is None:
                return
            for read in self._reads.values():
                if read.posted:  # an unposted one is released by its poster
                    for h in read.handles:
                        self._quietly(h.release)
            self._reads.clear()
            self._completed.clear()
            for h in self._unreleased:
                self._quietly(h.release)
            self._unreleased.clear()
            for dlist in self._registrations:
                self._quietly(agent.deregister_memory, dlist)
            self._registrations.clear()
            self._registered.clear()
            self._spans = {}
            for peer in self._peers:
                self._quietly(agent.remove_remote_agent, peer)
            self._peers.clear()
            self._agent = None


def _check_gpus(regions) -> None:
    """DEVICE regions need CUDA and a device with each region's id."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        names = ", ".join(repr(r.name) for r in regions)
        raise BackendError(f"DEVICE regions {names} need a CUDA GPU, but none is available")
    count = torch.cuda.device_count()
    for r in regions:
        if r.device_id >= count:
            raise BackendError(f"region {r.name!r}: device_id {r.device_id} but only {count} CUDA devices")


def _spans(keys) -> dict[tuple[MemoryKind, int], tuple[np.ndarray, np.ndarray]]:
    """Registered regions per (kind, device) as sorted, merged [start, end) spans.

    Stored as (starts, ends_before) with ``ends_before[i]`` the end of span
    ``i - 1`` (0 for i = 0), so ``ends_before[searchsorted(starts, a, "right")]``
    is the end of the span that starts at or below address ``a``.
    """
    grouped: dict[tuple[MemoryKind, int], list[tuple[int, int]]] = {}
    for kind, device, address, size in keys:
        grouped.setdefault((kind, device), []).append((address, address + size))
    out = {}
    for key, spans in grouped.items():
        merged: list[list[int]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        arr = np.array(merged, dtype=np.uint64)
        out[key] = (arr[:, 0].copy(), np.concatenate([np.zeros(1, dtype=np.uint64), arr[:, 1]]))
    return out
