"""The connector's worker side: a kvlend node over the KV tensors vLLM registered.

It runs in vLLM's worker process (the one that owns the KV memory), with the
node's loop on its own thread so claims, heartbeats and reads progress
between engine steps.  vLLM's hooks only hand work over and collect results:
none of them blocks on the network.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvlend.core.text import printable
from kvlend.errors import KvlendError
from kvlend.protocol.config import NodeConfig
from kvlend.runtime import DecodeNode, FetchState, PrefillNode
from kvlend.security.credentials import Credentials
from kvlend.transport import load_backend

from .amx import request_amx
from .scheduler import Endpoint, StepPlan

log = logging.getLogger("kvlend.vllm")
_FINISHED_KEPT = 65536


@dataclass(frozen=True)
class WorkerSettings:
    credentials: Credentials  # the node's identity is its certificate's common name
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None
    config: NodeConfig = NodeConfig()
    stats_path: str | None = None  # decode: one JSON line per finished fetch


def _place(node) -> None:
    """Let the node's loop run on any CPU, ahead of the engine's compute.

    vLLM's CPU worker pins its process to the cores of its OpenMP threads, which spin
    between steps: a loop thread left on those cores starves, and with it every claim,
    heartbeat and NIXL progress (reads measured stuck for 10 s with two engines on one
    core).  The loop mostly sleeps in poll, so a higher priority (``KVLEND_LOOP_NICE``,
    default -5; needs CAP_SYS_NICE) costs the engine little and answers a peer at once.
    """
    tid = node.loop_thread.native_id
    try:
        os.sched_setaffinity(tid, range(os.cpu_count() or 1))
    except (AttributeError, OSError) as exc:
        log.warning("kvlend loop thread keeps vLLM's CPU affinity (%s)", exc)
    nice = int(os.environ.get("KVLEND_LOOP_NICE", "-5"))
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)  # Linux: a thread id names that thread alone
    except OSError as exc:
        log.info("kvlend loop thread keeps its priority (%s)", exc)


def _request_amx() -> None:
    """AMX before NIXL loads UCX, for engines started without the launcher's sitecustomize.

    With bf16 on an AMX CPU a decode worker died of SIGILL once UCX was loaded (``kvlend_vllm.amx``).
    """
    log.info("kvlend: AMX tile state %s", "granted" if request_amx() else "not granted")


def _backend(credentials: Credentials):
    _request_amx()
    # The progress thread starves under busy polling on small hosts; the node's loop drives NIXL.
    # The pid keeps a restarted worker's agent apart from its predecessor's.
    return load_backend("nixl", name=f"{credentials.identity}-{os.getpid()}", timeout=10.0)


class ProducerWorker:
    """Prefill: lend blocks under the scheduler's lease ids; report them back when their lease ends."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.node: PrefillNode | None = None
        self._lock = threading.Lock()
        self._ended: set[str] = set()  # leases over (done, aborted, expired, released): blocks may be freed
        # Requests vLLM said finished (only those may be reported), the most recent ones: a lend
        # comes a step after its request finished, so this need not remember long.
        self._finished: OrderedDict[str, None] = OrderedDict()

    def register(self, layout) -> Endpoint:
        s = self.settings
        self.node = PrefillNode(layout, _backend(s.credentials), s.credentials, host=s.host, port=s.port,
                                advertise=s.advertise, config=s.config, on_release=self._on_release)
        self.node.start()
        _place(self.node)
        log.info("kvlend prefill %s listening on %s:%d (layout %s)", self.node.name, self.node.host,
                 self.node.port, layout.layout_id)
        return Endpoint(self.node.advertise, self.node.port, self.node.name, layout.layout_id)

    def _on_release(self, lease, reason: str) -> None:
        with self._lock:
            self._ended.add(lease.request)

    def start(self, plan: StepPlan) -> None:
        for lend in plan.lends:
            try:
                self.node.lend(lend.request, lend.num_tokens, {"full": list(lend.blocks)},
                               self.node.layout.full_selection(), lease_id=lend.lease, prompt_digest=lend.digest)
            except KvlendError as exc:  # nothing lent: free the blocks now; a claim is refused after claim_wait
                log.warning("request %s: not lent (%s); its blocks are freed", lend.request, printable(exc))
                with self._lock:
                    self._ended.add(lend.request)

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        with self._lock:
            self._finished.update(dict.fromkeys(finished_req_ids))
            while len(self._finished) > _FINISHED_KEPT:
                self._finished.popitem(last=False)
            done = {request for request in self._ended if request in self._finished}
            self._ended -= done
            for request in done:
                del self._finished[request]
        return done

    def close(self) -> None:
        if self.node is not None:
            backend = self.node.backend
            self.node.close()
            backend.close()


@dataclass
class _Loading:
    handle: Any
    blocks: tuple[int, ...]
    num_tokens: int
    resume_from: int  # tokens vLLM held already (its prefix cache): not read
    started: float
    reported_at: float | None = None  # when vLLM was told it finished (its bound covered the ticket)
    cancelled: bool = False


class ConsumerWorker:
    """Decode: fetch tickets into vLLM's blocks; failed blocks are reported only once quiet.

    A load is reported finished as soon as its safe-resume bound covers the whole ticket
    and no read is in flight, without waiting for the prefill's done ack: the bound
    counts only reads that landed while the lease was surely alive (README, *Resume*).
    The stats line of a fetch is written by the node's thread when it ends: vLLM steps
    only while it has requests, and the done ack often comes after the last one.
    """

    def __init__(self, settings: WorkerSettings, block_size: int, stats) -> None:
        self.settings = settings
        self.block_size = block_size
        self.stats = stats  # a KvlendStats: what vLLM logs and exports
        self.node: DecodeNode | None = None
        self._lock = threading.Lock()  # the loads: the node's thread reads them when a fetch ends
        self._loading: dict[str, _Loading] = {}
        self._by_handle: dict[int, str] = {}
        self._done: set[str] = set()
        self._invalid: set[int] = set()

    def register(self, layout) -> None:
        s = self.settings
        self.node = DecodeNode(layout, _backend(s.credentials), s.credentials, config=s.config,
                               on_finished=self._record if s.stats_path else None)
        self.node.start()
        _place(self.node)
        log.info("kvlend decode %s ready (layout %s)", self.node.name, layout.layout_id)

    def start(self, plan: StepPlan) -> None:
        for text, digest in plan.claims:
            try:
                self.node.claim(text, prompt_digest=digest)
            except KvlendError as exc:  # the fetch will claim again, or fail and be recomputed
                log.warning("early claim of a ticket failed: %s", printable(exc))
        for text in plan.unclaims:
            try:
                self.node.unclaim(text)
            except KvlendError as exc:
                log.info("giving back an unread lease: %s", printable(exc))
        for request in plan.cancels:
            loading = self._loading.get(request)
            if loading is not None and loading.reported_at is None:
                loading.handle.cancel()
                loading.cancelled = True
        for load in plan.loads:
            started = time.perf_counter()
            with self._lock:  # the node's thread may end the fetch before it is filed here
                try:
                    handle = self.node.start_fetch(load.ticket, {"full": list(load.blocks)},
                                                   resume_from=load.resume_from, prompt_digest=load.digest)
                except KvlendError as exc:  # nothing was read: every block is recomputed
                    log.warning("request %s: fetch not started (%s); recomputing", load.request, printable(exc))
                    recompute = load.blocks[load.resume_from // self.block_size:]
                    self._invalid.update(recompute)
                    self.stats.record_failure(len(recompute))
                    self._done.add(load.request)
                    continue
                self._loading[load.request] = _Loading(handle, load.blocks, load.num_tokens, load.resume_from,
                                                       started)
                self._by_handle[handle.id] = load.request

    def finished_recving(self) -> set[str]:
        for handle in self.node.finished():  # each already quiet: nothing can still land
            with self._lock:
                request = self._by_handle.pop(handle.id)
                loading = self._loading.pop(request)
            if handle.ok:
                result = handle.result()
                self.stats.record(seconds=result.seconds, read_seconds=result.read_seconds or 0.0,
                                  nbytes=result.bytes, local_blocks=loading.resume_from // self.block_size)
            elif loading.reported_at is not None:  # its KV was complete and verified before this (a lost ack, say)
                log.info("request %s: fetch ended after its KV was complete: %s", request, printable(handle.error))
            elif not loading.cancelled:  # an aborted request's blocks are freed, not recomputed
                good = handle.bound // self.block_size  # pages below the verified bound landed whole
                self._invalid.update(loading.blocks[good:])
                self.stats.record_failure(len(loading.blocks) - good)
                log.warning("request %s: KV fetch failed at token %d (%s); %d blocks recomputed", request,
                            handle.bound, printable(handle.error), len(loading.blocks) - good)
            if loading.reported_at is None:
                self._done.add(request)
        for request, loading in self._loading.items():
            if loading.reported_at is None and loading.handle.state is FetchState.ACKING \
                    and loading.handle.bound >= loading.num_tokens:
                loading.reported_at = time.perf_counter()
                self._done.add(request)
        done, self._done = self._done, set()
        return done

    def load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def _record(self, handle) -> None:
        """The fetch's stats line (``stats_path``), on the node's thread as it ends."""
        with self._lock:
            request = self._by_handle[handle.id]
            loading = self._loading[request]
        seconds = time.perf_counter() - loading.started
        result = handle.result() if handle.ok else None
        # seconds: start_fetch until it ended; transfer_s: kvlend's claim to done ack.
        line = {"request": request, "ok": handle.ok, "seconds": round(seconds, 6),
                "transfer_s": round(result.seconds, 6) if result else None,
                "bytes": result.bytes if result else 0, "blocks": len(loading.blocks),
                "resume_from": loading.resume_from, "bound": handle.bound,
                "error": None if handle.ok else type(handle.error).__name__,
                "reported_s": None if loading.reported_at is None else round(loading.reported_at - loading.started, 6),
                **{f"{k}_s": None if v is None else round(v, 6) for k, v in handle.timeline.items()}}
        with open(self.settings.stats_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self.node is not None:
            backend = self.node.backend
            self.node.close()
            backend.close()
