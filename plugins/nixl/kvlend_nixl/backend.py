"""``NixlBackend``: kvlend's transfer backend over NIXL (UCX underneath).

**Completion contract.**  ``poll()`` reports each posted tag exactly once, and
only when the transport has finished with the tag's destination: NIXL said
DONE or ERR for every handle of the tag, or the agent itself was destroyed.
A read that fails early (``cancel``, its ``timeout``, ``remove_peer``) is held
back until then ("quarantined"), and its Completion carries the error.
Until then the caller must not reuse the destination pages.

Why, as measured with NIXL 1.5.1 / UCX 1.23 over ``UCX_TLS=tcp`` (README):
NIXL cannot abort a READ.  Releasing an in-flight handle frees it while the
GET runs on to its end (writes went on for 140-230 ms, until the whole buffer
had landed).  ``remove_remote_agent`` makes ``check_xfer_state`` raise
NotFound at once, but the GET still runs to its end.  Against a peer that is
alive but stopped, the GET stays PROC (past 25 s), survives release and
removal, and resumes writing when the peer does.  So a failed read keeps its
handles, and they are polled until they are terminal.  A peer leaves NIXL
only once its reads have settled.  If handles are still not terminal
``abort_grace`` seconds after the abort, the agent is taken out of service
and rebuilt under the same name with the same regions and peers.  Every
other read in flight then ends with ``BackendError``.  Where its reads land
only while it is progressed (tcp, CPU copies, no progress thread) the old
agent is retired: its unsettled reads stay with it, and it is progressed until
they are terminal (their Completions wait until then: the destinations stay
quarantined), then closed, so a stopped peer that resumes does not meet a
closed socket (which UCX answers with an abort).  A drain that takes longer
than ``abort_grace`` stops: the reads are reported, the agent is kept open and
never progressed again, and ``close()`` drains it once more, with a deadline.
Otherwise it is destroyed, which stops every write (50 ms over tcp).  A
peer's death needs no escalation: NIXL reports the disconnect (ERR 14-18 ms
after a SIGKILL), and nothing was written after it.

Also shaped by NIXL's measured behaviour:

* The progress thread is off by default.  On small hosts it starves under
  polling Python threads, so ``poll()`` progresses the agent itself, and the
  lender must call ``poll()`` too: a peer's first read completes only once
  the target side has been progressed.
* Reads are built per post with ``initialize_xfer``: descriptors are
  variable-length coalesced runs, which a list prepped once per peer cannot
  index.
* Over cma (one host) ``transfer()`` copies synchronously; a read it
  reports DONE is settled there and then (handles released, its completion
  queued for the next ``poll()``).  It runs outside this object's lock, but the agent itself is unlocked by default
  (``NIXL_THREAD_SYNC_NONE``): using one backend from several threads at
  once (say, polling during a post) needs ``thread_safe=True``.
* Every NIXL exception becomes a ``BackendError``/``PeerLost``; runtime
  failures come back as ``Completion(tag, error)``, bad arguments raise.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import secrets
import threading
import time
import weakref
from typing import Mapping, Sequence

import numpy as np

from kvlend.core.layout import MemoryKind, MemoryRegion
from kvlend.errors import BackendError, KvlendError, PeerLost, TransferCancelled, TransferTimeout
from kvlend.metrics import METRICS
from kvlend.transport import Completion, ReadBatch

from . import tcp
from .calls import MAX_NAME, Read, as_error, check_tag, peer_name, post, quietly, release
from .memory import MEM, check_gpus, check_local, register as register_regions, spans as registered_spans
from .nixl_build import api as nixl, bindings as _nb
from .retired import Retired, progressed_only

log = logging.getLogger(__name__)

_ERROR_MODES = ("peer", "none")
_MAX_METADATA = 64 << 20
_MAX_RETIRED = 64  # agents set aside by resets (each a UCX worker, its sockets and under 1 MiB)


def _check_seconds(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise BackendError(f"{name} must be a positive finite number of seconds, got {value!r}")
    return float(value)


class NixlBackend:
    """A NIXL agent with one UCX backend, driven by ``poll()``.

    ``name`` is the NIXL agent name peers know this side by (default: unique
    per process); ``kind`` is the registry name both ends must share.
    ``progress_thread``: NIXL's own progress thread (off: ``poll()`` progresses;
    on: never busy-spin around it).  ``num_threads``: UCX worker threads that
    split big descriptor batches.  ``error_mode``: UCX ``peer`` (detects dead
    peers) or ``none`` (shared-memory notifications, no disconnect detection).
    ``timeout``: seconds a tag may stay in flight before it is cancelled and
    ends with ``TransferTimeout``.  ``abort_grace``: seconds a cancelled,
    timed-out or orphaned read may take to stop before the agent is rebuilt.
    ``thread_safe``: NIXL locks (RW) for use from several threads.
    ``backend_params``: further UCX backend parameters.  ``tcp_window``: where READs may go over
    tcp, ``read_window`` is the bytes a reader keeps in flight per peer (``kvlend_nixl.tcp``;
    False: None, for measuring its cost); the socket buffers are pinned either way.  It applies to a
    peer on this host only if ``read_window_local`` (``UCX_TLS`` leaves no shared-memory transport).
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
        abort_grace: float = 1.0,
        thread_safe: bool = False,
        backend_params: Mapping[str, str] | None = None,
        tcp_window: bool = True,
    ) -> None:
        if name is None:
            name = f"kvlend-{os.getpid()}-{secrets.token_hex(4)}"
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise BackendError(f"name must be a str of 1..{MAX_NAME} characters, got {name!r}")
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 0:
            raise BackendError(f"num_threads must be an int >= 0, got {num_threads!r}")
        if error_mode not in _ERROR_MODES:
            raise BackendError(f"error_mode must be one of {_ERROR_MODES}, got {error_mode!r}")
        self.timeout = _check_seconds("timeout", timeout)
        self.abort_grace = _check_seconds("abort_grace", abort_grace)
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
        sync = nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW if locking else nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        self.name = name
        window = tcp.pin(os.environ) if tcp.carries_reads(os.environ, tcp.rdma_devices()) else None
        self.read_window: int | None = window if tcp_window else None
        self.read_window_local = tcp.local_reads_over_tcp(os.environ)  # peers on this host need it too
        self._config = nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=[], sync_mode=sync)
        self._params = params
        self._agent: nixl.nixl_agent | None = self._start_agent()  # None: lost in a reset, made again on use
        self._closed = False
        self._lock = threading.RLock()
        self._registrations: list = []  # nixlRegDList per register() call and kind
        self._registered: set[tuple] = set()
        self._spans: dict[tuple[MemoryKind, int], tuple] = {}  # memory.spans
        self._peers: dict[str, bytes] = {}
        self._leaving: dict[str, bytes] = {}  # removed peers NIXL keeps until their reads settle
        self._reads: dict[bytes, Read] = {}
        self._completed: list[Completion] = []
        self._resets = 0
        self._orphans = 0  # agents that outlived their reset
        self._retire = progressed_only(progress_thread)
        self._retired: list[Retired] = []  # reset, drained or given up on, kept open (oldest first)

    def _start_agent(self) -> nixl.nixl_agent:
        try:
            agent = nixl.nixl_agent(self.name, self._config)
            agent.create_backend("UCX", self._params)
        except Exception as exc:
            raise as_error(exc, f"creating NIXL agent {self.name!r} with UCX {self._params}") from None
        return agent

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> NixlBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open_agent(self) -> nixl.nixl_agent:
        if self._closed:
            raise BackendError(f"NIXL backend {self.name!r} is closed")
        if self._agent is None:
            self._rebuild()
        return self._agent

    @property
    def in_flight(self) -> int:
        """Tags posted and not yet returned by ``poll()`` (quarantined ones included)."""
        with self._lock:
            return len(self._reads) + len(self._completed) + sum(len(r.reads) for r in self._retired if not r.reported)

    @property
    def resets(self) -> int:
        """How often the agent was rebuilt to stop reads that would not end."""
        return self._resets

    # ------------------------------------------------------------- memory
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register each region once (HOST as DRAM, DEVICE as VRAM)."""
        with self._lock:
            agent = self._open_agent()
            new: dict[tuple, MemoryRegion] = {}
            for r in regions:
                if not isinstance(r, MemoryRegion):
                    raise BackendError(f"register() takes MemoryRegion objects, got {type(r).__name__}")
                if r.address == 0:
                    raise BackendError(f"region {r.name!r} has no address (address=0)")
                key = (r.kind, r.device_id, r.address, r.size)
                if key not in self._registered:
                    new[key] = r
            devices = [r for r in new.values() if r.kind is MemoryKind.DEVICE]
            if devices:
                check_gpus(devices)
            self._registrations.extend(register_regions(agent, new))
            self._registered.update(new)
            self._spans = registered_spans(self._registered)

    def deregister(self) -> None:
        """Deregister everything; refused while reads are in flight or quarantined."""
        with self._lock:
            agent = self._open_agent()
            if self._reads:
                raise BackendError(f"cannot deregister while {len(self._reads)} reads are in flight")
            failures = [
                exc for dlist in self._registrations
                if (exc := quietly(agent.deregister_memory, dlist)) is not None
            ]
            self._registrations.clear()
            self._registered.clear()
            self._spans = {}
        if failures:
            raise as_error(failures[0], f"deregistering ({len(failures)} lists failed)")

    # -------------------------------------------------------------- peers
    def metadata(self) -> bytes:
        """This agent's metadata; it changes when the agent is rebuilt (see ``resets``)."""
        with self._lock:
            agent = self._open_agent()
            try:
                return bytes(agent.get_agent_metadata())
            except Exception as exc:
                raise as_error(exc, "reading local agent metadata") from None

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
            self._open_agent()
            if self._peers.get(name) == data:
                return name
            if self._leaving.get(name) == data:  # removed, still in NIXL: take it back as it is
                self._peers[name] = self._leaving.pop(name)
                return name
            if name in self._peers or name in self._leaving:
                self._replace(name)
            try:
                self._agent.add_remote_agent(data)
            except Exception as exc:
                # NIXL 1.5 keeps the UCX connection of a half-loaded peer, so
                # later loads under this name may fail until the agent is new.
                raise as_error(exc, f"loading metadata of peer {name!r} (malformed or truncated?)") from None
            self._peers[name] = data
            return name

    def _replace(self, name: str) -> None:
        """Unload an old incarnation; NIXL holds one per name, so reads from it must stop first."""
        if name in self._peers:
            self._forget_peer(name, f"peer {name!r} was replaced by new metadata (restarted?)")
        if name in self._leaving and not self._reset(f"peer {name!r} was replaced while its reads could still write"):
            raise BackendError(f"peer {name!r} cannot be replaced while a read is being posted; retry")

    def remove_peer(self, peer: str) -> None:
        """Forget a peer; its unfinished reads end with ``PeerLost`` once they cannot write."""
        with self._lock:
            self._open_agent()
            self._known(peer)
            self._forget_peer(peer, f"peer {peer!r} was removed")

    def _known(self, peer: str) -> None:
        if peer not in self._peers:
            raise BackendError(f"unknown peer {peer!r} (known: {sorted(self._peers) or 'none'})")

    def _forget_peer(self, peer: str, why: str) -> None:
        """Fail the peer's unsettled reads; unload it from NIXL now, or once they settle.

        Unloading earlier would make NIXL answer NotFound for their handles
        while the GETs go on writing.
        """
        now = time.monotonic()
        busy = [r for r in self._reads.values() if r.peer == peer and not r.settled]
        for read in busy:
            read.fail(PeerLost(why), now)
        data = self._peers.pop(peer)
        if busy:
            self._leaving[peer] = data
        else:
            quietly(self._agent.remove_remote_agent, peer)

    # -------------------------------------------------------------- reads
    def post_read(self, peer: str, batches: Sequence[ReadBatch], tag: bytes) -> None:
        """Post every batch; ``poll()`` reports one ``Completion(tag)`` for all."""
        check_tag(tag)
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
                    check_local(self._spans, i, b)
            batches = [b for b in batches if b.count]
            handles: list = []
            try:
                for b in batches:
                    local = agent.get_xfer_descs(np.ascontiguousarray(b.local), MEM[b.local_kind])
                    remote = agent.get_xfer_descs(np.ascontiguousarray(b.remote), MEM[b.remote_kind])
                    handles.append(agent.initialize_xfer("READ", local, remote, peer))
            except Exception as exc:
                release(handles)  # never posted: releasing aborts nothing
                err = as_error(exc, f"building read {tag!r} from peer {peer!r}")
                if not isinstance(err, PeerLost):
                    raise err from None
                self._completed.append(Completion(tag, err))
                return
            read = Read(peer, handles, time.monotonic() + self.timeout, live=[False] * len(handles))
            self._reads[tag] = read
        # Outside this object's lock (over cma the copy happens inside transfer()); concurrent
        # calls into the agent are safe only with thread_safe=True (NIXL's RW sync mode).
        live, error = post(agent, handles, f"posting read {tag!r} to peer {peer!r}")
        del agent  # a reset must be able to destroy it
        with self._lock:
            if self._reads.get(tag) is not read:  # closed meanwhile
                release(handles)
                return
            read.live[:len(live)] = live
            read.posted = True
            if error is not None:
                read.fail(error, time.monotonic())
            elif not any(live):  # over cma transfer() copies synchronously: terminal already
                del self._reads[tag]
                release(handles)
                self._completed.append(Completion(tag))

    def cancel(self, tag: bytes) -> None:
        """Start cancelling ``tag``; ``poll()`` still reports it, once it cannot write any more.

        It then ends with ``TransferCancelled``, unless it had already completed
        (its success is reported).  An unknown or already reported tag is ignored.
        """
        check_tag(tag)
        with self._lock:
            self._open_agent()
            read = self._reads.get(tag)
            if read is not None and not read.settled:
                read.fail(TransferCancelled(f"read {tag!r} from peer {read.peer!r} was cancelled"), time.monotonic())

    def poll(self) -> list[Completion]:
        """Progress the agent; return the reads that can no longer write, each exactly once."""
        with self._lock:
            if not self._closed and self._agent is None and quietly(self._rebuild) is not None:
                self._drain(time.monotonic())  # the retired agents still drain
                out, self._completed = self._completed, []  # nothing else is in flight without an agent
                return out
            try:
                self._open_agent().get_new_notifs()  # progresses the worker (the target side needs it)
            except Exception as exc:
                raise as_error(exc, "progressing the NIXL agent") from None
            now = time.monotonic()
            for tag, read in self._reads.items():
                if read.posted:
                    self._check(tag, read, now)
            self._settle()
            self._drain(now)
            stuck = [t for t, r in self._reads.items() if r.posted and now - r.failed_at >= self.abort_grace]
            if stuck:
                self._reset(f"reads {stuck} had not stopped {self.abort_grace:g} s after they were aborted")
            out, self._completed = self._completed, []
            return out

    def _check(self, tag: bytes, read: Read, now: float) -> None:
        """Ask NIXL about each live handle; an overdue read is cancelled with ``TransferTimeout``."""
        for i, h in enumerate(read.handles):
            if read.live[i]:
                read.live[i], error = self._state(tag, read.peer, h)
                if error is not None:
                    read.fail(error, now)
        if any(read.live) and now >= read.deadline:
            read.fail(TransferTimeout(
                f"read {tag!r} from peer {read.peer!r} still in flight after {self.timeout:g} s; cancelled"
            ), now)

    def _state(self, tag: bytes, peer: str, handle) -> tuple[bool, KvlendError | None]:
        """Whether ``handle`` is still in flight, and its error if it failed."""
        try:
            state = self._agent.check_xfer_state(handle)
        except _nb.nixlNotFoundError:
            # NIXL drops a peer by itself only after UCX reported it disconnected, which
            # fails the endpoint every handle to that peer uses; this backend unloads a
            # peer only once its reads have settled.
            return False, PeerLost(f"read {tag!r}: NIXL dropped peer {peer!r} after a disconnect")
        except Exception as exc:  # error statuses raise
            return False, as_error(exc, f"read {tag!r} from peer {peer!r}")
        if state == "ERR":
            return False, BackendError(f"read {tag!r} from peer {peer!r}: NIXL returned ERR")
        return state == "PROC", None

    def _settle(self) -> None:
        """Report reads that can no longer write; unload removed peers whose reads all settled."""
        for tag in [t for t, r in self._reads.items() if r.settled]:
            read = self._reads.pop(tag)
            release(read.handles)  # terminal: releasing only frees
            read.handles = []  # a handle object holds the agent, and a caller's variable may still hold the read
            self._completed.append(Completion(tag, read.error))
        if not self._leaving:
            return
        busy = {r.peer for r in self._reads.values()}
        for peer in [p for p in self._leaving if p not in busy]:
            del self._leaving[peer]
            quietly(self._agent.remove_remote_agent, peer)

    def _reset(self, why: str) -> bool:
        """Take the agent out of service, the one way found to stop a GET NIXL cannot abort, and rebuild it.

        Every read in flight ends (``BackendError`` unless it already failed);
        regions and known peers are loaded into the new agent, removed peers
        are gone.  Not while another thread is inside ``transfer()`` (False).
        The old agent is retired where that stops its reads, else destroyed (``_drop_agent``).
        """
        if not all(r.posted for r in self._reads.values()):
            return False
        log.warning("NIXL backend %r: rebuilding its agent: %s", self.name, why)
        now = time.monotonic()
        retire = self._retire and not any(kind is MemoryKind.DEVICE for kind, *_ in self._registered)
        draining = {}
        for tag, read in list(self._reads.items()):
            read.fail(BackendError(f"read {tag!r} from peer {read.peer!r} aborted: {why}"), now)
            if retire and not read.settled:  # drained with its agent; reported once it cannot write
                draining[tag] = self._reads.pop(tag)
                continue
            release(read.handles)  # no handle object may keep the agent alive
            read.handles, read.live = [], []
        self._leaving.clear()
        self._drop_agent(list(self._reads), Retired(None, draining, now + self.abort_grace) if retire else None)
        self._resets += 1
        self._settle()
        if (exc := quietly(self._rebuild)) is not None:
            log.warning("NIXL backend %r: %s; retried on the next call", self.name, exc)
        return True

    def _rebuild(self) -> None:
        """A new agent under this name, with the regions and the known peers loaded again."""
        try:
            agent = self._start_agent()
            self._registrations = register_regions(agent, self._registered)
        except BackendError as exc:
            raise BackendError(f"NIXL backend {self.name!r} has had no agent since its reset: {exc}") from None
        self._agent = agent
        for peer, data in list(self._peers.items()):
            if (exc := quietly(agent.add_remote_agent, data)) is not None:
                log.warning("NIXL backend %r: peer %r not reloaded after the reset: %s", self.name, peer, exc)
                del self._peers[peer]

    def _drop_agent(self, tags: list[bytes], retired: Retired | None) -> None:
        """Retire the agent (``retired``: its reads still posted) where its reads need it progressed
        to land, else destroy it.

        Retired: drained (``kvlend_nixl.retired``), then destroyed; one whose drain gave up is kept
        open, never progressed again.  Destroying closes its connections, and a peer that was
        stopped with reads from it queued is aborted by UCX when it resumes (its software GET reply
        meets the closed socket: ``ucs_fatal`` in ``ucp_request_try_send``, plugins/nixl/README.md);
        kept open, that peer's replies land in a socket nobody reads.  Only the oldest beyond
        ``_MAX_RETIRED`` is destroyed (its reads reported first).  GPU memory is always destroyed:
        its copy engines write on their own.
        """
        doomed = [self._agent]  # never in a local variable: _destroy must drop the last reference
        self._agent = None
        self._registrations = []
        if retired is not None:
            retired.agent = doomed.pop()
            self._retired.append(retired)
            if len(self._retired) <= _MAX_RETIRED:
                return
            self._retire_now(self._retired.pop(0), "too many retired agents")
            return
        self._destroy(doomed, tags)

    def _drain(self, now: float) -> None:
        """Progress the retired agents still draining; report and close those drained, report those
        whose drain ran out (never progressed again after)."""
        for retired in [r for r in self._retired if not r.reported]:
            if retired.drain():
                self._retired.remove(retired)
                self._retire_now(retired, "drained")
            elif now >= retired.until:
                log.warning("NIXL backend %r: a retired agent's %d reads did not drain within %g s; it is kept "
                            "open and never progressed again", self.name, len(retired.reads), self.abort_grace)
                self._completed.extend(retired.report())

    def _retire_now(self, retired: Retired, why: str) -> None:
        """Report ``retired``'s reads (if not yet) and destroy its agent."""
        self._completed.extend(retired.report())
        retired.release()
        doomed, retired.agent = [retired.agent], None
        log.info("NIXL backend %r: closing a retired agent (%s)", self.name, why)
        self._destroy(doomed, list(retired.reads))

    def _destroy(self, doomed: list[nixl.nixl_agent], tags: list[bytes]) -> None:
        """Drop the agent in ``doomed``, and check it is gone: only then has UCX closed its connections.

        One that something still holds (a stored exception's traceback, say) is set aside and
        never progressed again.  Over tcp a GET lands only while its agent is progressed, and
        over cma only inside ``transfer()``, so its reads (``tags``) can no longer write there;
        an RDMA NIC could still write, so the backend turns unhealthy, logs the tags and goes on
        with a new agent rather than failing every later call.
        """
        core = weakref.ref(doomed[0].agent)  # the C++ agent; each handle object holds it too
        doomed.clear()
        if core() is not None:
            gc.collect()  # a reference cycle is the harmless case
        if core() is not None:
            self._orphans += 1
            METRICS.inc("kvlend_orphaned_agents_total")
            log.error("NIXL backend %r: its old agent outlived the reset (still referenced); it is never progressed "
                      "again, but over RDMA reads %s may still write into their destinations", self.name, tags)

    @property
    def healthy(self) -> bool:
        """False once an agent outlived its reset (see ``_destroy``): restart the process when idle."""
        return self._orphans == 0

    def close(self) -> None:
        """Abort reads, deregister, forget peers and drop the agent (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            agent, self._agent = self._agent, None
            if agent is not None:  # None: lost in a reset, which left nothing in flight
                for read in self._reads.values():
                    if read.posted:  # an unposted one is released by its poster
                        release(read.handles)
                for dlist in self._registrations:
                    quietly(agent.deregister_memory, dlist)
                for peer in [*self._peers, *self._leaving]:
                    quietly(agent.remove_remote_agent, peer)
            self._reads.clear()
            self._completed.clear()
            self._registrations.clear()
            self._registered.clear()
            self._spans = {}
            self._peers.clear()
            self._leaving.clear()
            end = time.monotonic() + self.abort_grace  # at exit late answers may land: drain, then close
            while not all([r.drain() for r in self._retired]) and time.monotonic() < end:
                time.sleep(0.001)
            while self._retired:
                retired = self._retired.pop(0)
                retired.release()
                doomed, retired.agent = [retired.agent], None
                self._destroy(doomed, [])

