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
from dataclasses import dataclass, field

from kvlend.core.text import printable
from kvlend.errors import KvlendError
from kvlend.protocol.config import NodeConfig
from kvlend.runtime import DecodeNode, FetchState, PrefillNode
from kvlend.security.credentials import Credentials
from kvlend.transport import load_backend

from .amx import request_amx
from .scheduler import SHARE_COUNTS, Endpoint, StepPlan, share_lease, worker_tickets

log = logging.getLogger("kvlend.vllm")
_FINISHED_KEPT = 65536
_ASKED_KEPT = 4096  # lease ids claimed before any lend, remembered in case they are shares of the next


@dataclass(frozen=True)
class WorkerSettings:
    credentials: Credentials  # the node's identity is its certificate's common name
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None
    config: NodeConfig = NodeConfig()
    stats_path: str | None = None  # decode: one JSON line per finished load
    tp_size: int = 1  # the engine's tensor-parallel workers; this one is tp_rank
    tp_rank: int = 0
    etcd: tuple[str, ...] = ()  # kvlend's registry: publish this rank there (and, decoding, trust it)
    cluster_prefix: str = "/kvlend/default"


def _place(node) -> None:
    """Let the node's loop run on any CPU, ahead of the engine's compute.

    vLLM's CPU worker pins its process to the cores of its OpenMP threads, which spin
    between steps: a loop thread left on those cores starves, and with it every claim,
    heartbeat and NIXL progress (reads measured stuck for 10 s with two engines on one
    core).  The loop mostly sleeps in poll, so a higher priority (``KVLEND_LOOP_NICE``,
    default -10; needs CAP_SYS_NICE) costs the engine little and answers a peer at once.  Its
    busy moments are the copies themselves (a shared-memory read runs on this thread), which on a
    small host queue behind vLLM's busy processes (BENCHMARKS.md, issue 26, measures -5 against -10).
    """
    tid = node.loop_thread.native_id
    try:
        os.sched_setaffinity(tid, range(os.cpu_count() or 1))
    except (AttributeError, OSError) as exc:
        log.warning("kvlend loop thread keeps vLLM's CPU affinity (%s)", exc)
    nice = int(os.environ.get("KVLEND_LOOP_NICE", "-10"))
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)  # Linux: a thread id names that thread alone
    except OSError as exc:
        log.info("kvlend loop thread keeps its priority (%s)", exc)


def _request_amx() -> None:
    """AMX before NIXL loads UCX, for engines started without the launcher's sitecustomize.

    With bf16 on an AMX CPU a decode worker died of SIGILL once UCX was loaded (``kvlend_vllm.amx``).
    """
    log.info("kvlend: AMX tile state %s", "granted" if request_amx() else "not granted")


def _registry(settings: WorkerSettings):
    """The rank's ``Registry`` in etcd, started, or None without ``etcd`` (its record goes up with the node,
    signed with the rank's certificate; records are checked against its cluster CA).  It reaches etcd as
    the ``KVLEND_ETCD_*`` variables say, or else over TLS with the rank's own certificate: etcd run from
    the cluster CA with client certificates required, as ``EtcdMembers`` runs it."""
    if not settings.etcd:
        return None
    from kvlend.cluster.registry import Registry, etcd_security_from_env

    security = etcd_security_from_env() or {"etcd_credentials": settings.credentials}
    return Registry(list(settings.etcd), settings.cluster_prefix, cluster_ca=settings.credentials.ca_pem,
                    **security).start()


def _close(node, registry) -> None:
    """The node (which withdraws its record), its backend, then the registry."""
    if node is not None:
        backend = node.backend
        node.close()
        backend.close()
    if registry is not None:
        registry.close()


def _backend(credentials: Credentials):
    _request_amx()
    # The progress thread starves under busy polling on small hosts; the node's loop drives NIXL.
    # The pid keeps a restarted worker's agent apart from its predecessor's.
    return load_backend("nixl", name=f"{credentials.identity}-{os.getpid()}", timeout=10.0)


@dataclass
class _Loan:
    """One request this worker lent: the scheduler's lease (its ticket's), what it was lent with, and the
    leases that carry it now: that lease, or the shares it was split into for a decode with more workers."""

    request: str
    lease: bytes
    num_tokens: int
    tables: dict[str, list[int]]
    ready: int | None  # tokens lent so far (None: all)
    digest: bytes
    shares: tuple[bytes, ...]  # every share id a decode may claim (``share_lease``), while splittable
    leases: list[bytes] = field(default_factory=list)
    split: int = 0  # the shares it was split into (0: not split)


class ProducerWorker:
    """Prefill: lend blocks under the scheduler's lease ids (this worker's: one per request, split into
    shares when a decode with more workers claims one), grow progressive lends; report a request back
    once all its leases ended."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.node: PrefillNode | None = None
        self.registry = None
        # Notified as leases end.  Held while lending, extending and releasing, so that a split on the
        # node's thread and an extend on the engine's see the same leases.
        self._lock = threading.Condition()
        self._open: dict[str, int] = {}  # request -> its leases not yet over
        self._requests: dict[bytes, str] = {}  # lease id -> request, while the lease lives
        self._loans: dict[str, _Loan] = {}  # request -> what this worker lent, until reported
        self._shares: dict[bytes, tuple[str, int]] = {}  # share id -> (request, shares), while splittable
        self._asked: OrderedDict[bytes, None] = OrderedDict()  # claimed before any lend: maybe shares
        self._ended: set[str] = set()  # requests whose leases are all over (done, aborted, expired, released)
        # Requests vLLM said finished (only those may be reported), the most recent ones: a lend
        # comes a step after its request finished, so this need not remember long.
        self._finished: OrderedDict[str, None] = OrderedDict()

    def register(self, layout) -> Endpoint:
        s = self.settings
        self.registry = _registry(s)
        self.node = PrefillNode(layout, _backend(s.credentials), s.credentials, host=s.host, port=s.port,
                                advertise=s.advertise, config=s.config, on_release=self._on_release,
                                on_claim_wait=self.claim_waits, registry=self.registry)
        self.node.start()
        _place(self.node)
        log.info("kvlend prefill %s listening on %s:%d (layout %s)", self.node.name, self.node.host,
                 self.node.port, layout.layout_id)
        return Endpoint(self.node.advertise, self.node.port, self.node.name, layout.layout_id)

    def _on_release(self, lease, reason: str) -> None:
        self._lease_over(lease.id)

    def _lease_over(self, lease: bytes) -> None:
        with self._lock:
            request = self._requests.pop(lease, None)
            if request is None:  # preempted, and vLLM reused its blocks at the lease's ttl (``preempt``)
                return
            self._open[request] -= 1
            if not self._open[request]:
                del self._open[request]
                self._ended.add(request)
            self._lock.notify_all()

    def start(self, plan: StepPlan) -> None:
        for lend in plan.lends:  # the lock one item at a time: the node's thread takes it as leases end
            with self._lock:
                self._lend(lend)
        for extend in plan.extends:
            with self._lock:
                self._extend(extend)
        for request in plan.releases:
            with self._lock:
                loan = self._loans.get(request)
                if loan is not None:
                    self._unshare(loan)
                    for lease in loan.leases:
                        self.node.release(lease)  # on_release once its reader is quiet

    def _extend(self, extend) -> None:
        loan = self._loans.get(extend.request)
        if loan is None:
            return
        loan.ready, loan.tables = extend.ready, {g: list(t) for g, t in extend.tables.items()}
        for lease in loan.leases:
            try:
                self.node.extend(lease, extend.ready, loan.tables)
            except KvlendError as exc:  # the lease ended (expired unclaimed, say): its end is reported
                log.info("request %s: lease %s not extended (%s)", extend.request, lease.hex()[:8], printable(exc))

    def _lend(self, lend) -> None:
        lease = lend.leases[self.settings.tp_rank]
        if lease in self._requests:  # a router's (a client's) id: in use
            log.warning("request %s: not lent (a lease id it names is another request's)", lend.request)
            self._ended.add(lend.request)  # reported once vLLM says it finished, like a refused lend
            return
        shares = {share_lease(lease, i, count): (lend.request, count) for count in SHARE_COUNTS
                  for i in range(count)}
        loan = _Loan(lend.request, lease, lend.num_tokens, {g: list(t) for g, t in lend.tables.items()},
                     lend.ready, lend.digest, tuple(shares), [lease])
        self._loans[lend.request] = loan
        self._open[lend.request] = 1
        self._requests[lease] = lend.request
        self._shares.update(shares)
        self._lend_one(lend.request, lease, loan)
        asked = next((shares[s] for s in shares if self._asked.pop(s, False) is None), None)
        if asked is not None:  # a decode worker claimed its share before this lend
            self._split(*asked)

    def _lend_one(self, name: str, lease: bytes, loan: _Loan) -> None:
        try:
            self.node.lend(name, loan.num_tokens, loan.tables, self.node.layout.full_selection(), lease_id=lease,
                           ready=loan.ready, prompt_digest=loan.digest)
        except KvlendError as exc:  # not lent: a claim is refused after claim_wait
            log.warning("request %s: not lent (%s)", name, printable(exc))
            self._lease_over(lease)

    def claim_waits(self, lease_id: bytes) -> None:
        """A claim waits for a lease not lent (on the node's thread).  If it names a share of a lease this
        worker lent, a decode with more workers reads it: split that lease into its shares now; else
        remember it, in case its lease is lent next."""
        with self._lock:
            found = self._shares.get(lease_id)
            if found is not None:
                self._split(*found)
                return
            self._asked[lease_id] = None
            while len(self._asked) > _ASKED_KEPT:
                self._asked.popitem(last=False)

    def _split(self, request: str, count: int) -> None:
        """Lend ``request``'s lease as ``count`` shares, each read by one decode worker, then release the
        lease itself: its ticket is read through the shares.  Under the lock."""
        loan = self._loans.get(request)
        if loan is None or loan.split or request not in self._open:  # already split, or over
            return
        loan.split = count
        self._unshare(loan)
        shares = [share_lease(loan.lease, i, count) for i in range(count)]
        self._open[request] += count
        self._requests.update(dict.fromkeys(shares, request))
        loan.leases = shares
        for i, share in enumerate(shares):
            self._lend_one(f"{request}#{i}/{count}", share, loan)
        self.node.release(loan.lease)
        log.debug("request %s: lent as %d shares", request, count)

    def _unshare(self, loan: _Loan) -> None:
        """No decode may split this loan any more."""
        for share in loan.shares:
            self._shares.pop(share, None)
        loan.shares = ()

    def _forget(self, request: str) -> None:
        loan = self._loans.pop(request, None)
        if loan is not None:
            self._unshare(loan)

    def preempt(self, requests: list[str]) -> None:
        """vLLM takes these progressively lent requests' blocks back in this step, and its forward may
        overwrite them: end their leases and wait until no read of them can still land, so no reader's
        bound covers a reused block.  That is once their readers are quiet, and never later than the
        leases' TTL (``NodeConfig.progressive_ttl``, 1 s in the connector) after ending them: an ended
        lease is never renewed, and a reader counts no read that lands a TTL after its last renewal.
        A reader that ignores the end holds vLLM's step that long; the node drops it as the lease expires."""
        node = self.node
        with self._lock:
            loans = [self._loans[r] for r in requests if r in self._loans]
            leases = [lease for loan in loans for lease in loan.leases]
            for loan in loans:
                self._unshare(loan)
            for lease in leases:
                node.release(lease)
            deadline = node.clock() + self.settings.config.lease_ttl(progressive=True)  # on the leases' clock
            while any(lease in self._requests for lease in leases) and node.clock() < deadline:
                self._lock.wait(deadline - node.clock())
            late = [lease for lease in leases if self._requests.pop(lease, None) is not None]
            for request in requests:  # vLLM frees these blocks itself: never reported as sent
                self._open.pop(request, None)
                self._ended.discard(request)
                self._forget(request)
        if late:
            log.warning("requests %s: a reader of their blocks ignored the end of its lease for its whole ttl "
                        "(%.3g s); no read of them counts any more, vLLM reuses them now", requests,
                        self.settings.config.lease_ttl(progressive=True))

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        with self._lock:
            self._finished.update(dict.fromkeys(finished_req_ids))
            while len(self._finished) > _FINISHED_KEPT:
                self._finished.popitem(last=False)
            done = {request for request in self._ended if request in self._finished}
            self._ended -= done
            for request in done:
                del self._finished[request]
                self._forget(request)
        return done

    def close(self) -> None:
        _close(self.node, self.registry)


@dataclass
class _Loading:
    request: str
    handles: list  # one fetch per prefill worker holding heads of this worker's slice
    tables: dict[str, tuple[int, ...]]  # block ids per group
    num_tokens: int
    resume_from: int  # tokens vLLM held already (its prefix cache): not read
    started: float
    finished: int = 0  # handles vLLM's step collected (engine thread)
    recorded: int = 0  # handles the node's thread heard end (stats line)
    reported_at: float | None = None  # when vLLM was told it finished (every bound covered the ticket)
    cancelled: bool = False  # the request was aborted: its blocks are freed, not recomputed
    broken: bool = False  # a fetch of its share could not start: the others were cancelled, all is recomputed

    def verified(self) -> bool:
        """Every fetch read the whole ticket, verified, and nothing is in flight (done acks may be pending)."""
        return not self.broken and all(h.ok or (h.state is FetchState.ACKING and h.bound >= self.num_tokens)
                                       for h in self.handles)

    def bound(self) -> int:
        """Tokens below which every head of this worker's slice landed, verified."""
        return self.resume_from if self.broken else min(h.bound for h in self.handles)


class ConsumerWorker:
    """Decode: fetch tickets into vLLM's blocks; failed blocks are reported only once quiet.

    Each load reads this worker's share of the tickets (``worker_tickets``): one fetch per
    prefill worker holding heads of its slice, all into the same blocks.  A load is reported
    finished as soon as every fetch's safe-resume bound covers the whole ticket and no read
    is in flight, without waiting for the prefills' done acks: a bound counts only reads that
    landed while the lease was surely alive (README, *Resume*).  A failed load is reported
    once all its fetches are quiet, with the blocks above the lowest bound to recompute.
    The stats line of a load is written by the node's thread when its last fetch ends:
    vLLM steps only while it has requests, and the done ack often comes after the last one.
    """

    def __init__(self, settings: WorkerSettings, block_size: int, stats) -> None:
        self.settings = settings
        self.block_size = block_size
        self.stats = stats  # a KvlendStats: what vLLM logs and exports
        self.node: DecodeNode | None = None
        self.registry = None
        self._lock = threading.Lock()  # the loads: the node's thread reads them when a fetch ends
        self._loading: dict[str, _Loading] = {}
        self._by_handle: dict[int, _Loading] = {}
        self._done: set[str] = set()
        self._invalid: set[int] = set()
        self._failed: set[str] = set()

    def register(self, layout) -> None:
        s = self.settings
        self.registry = _registry(s)
        self.node = DecodeNode(layout, _backend(s.credentials), s.credentials, config=s.config,
                               registry=self.registry, on_finished=self._record if s.stats_path else None)
        self.node.start()
        _place(self.node)
        log.info("kvlend decode %s ready (layout %s, tp rank %d of %d)", self.node.name, layout.layout_id,
                 s.tp_rank, s.tp_size)

    def _mine(self, tickets: tuple[str, ...]) -> tuple[str, ...]:
        return worker_tickets(tickets, self.settings.tp_size, self.settings.tp_rank)

    def start(self, plan: StepPlan) -> None:
        for tickets, digest in plan.claims:
            for text in self._mine(tickets):
                try:
                    self.node.claim(text, prompt_digest=digest)
                except KvlendError as exc:  # the fetch will claim again, or fail and be recomputed
                    log.warning("early claim of a ticket failed: %s", printable(exc))
        for tickets in plan.unclaims:
            for text in self._mine(tickets):
                try:
                    self.node.unclaim(text)
                except KvlendError as exc:
                    log.info("giving back an unread lease: %s", printable(exc))
        for request in plan.cancels:
            loading = self._loading.get(request)
            if loading is not None and loading.reported_at is None:
                for handle in loading.handles:
                    handle.cancel()
                loading.cancelled = True
        for load in plan.loads:
            self._start_load(load)

    def _start_load(self, load) -> None:
        loading = _Loading(load.request, [], load.tables, load.num_tokens, load.resume_from, time.perf_counter())
        refused: KvlendError | None = None
        with self._lock:  # the node's thread may end a fetch before it is filed here
            for text in self._mine(load.tickets):
                try:
                    handle = self.node.start_fetch(text, {g: list(t) for g, t in load.tables.items()},
                                                   resume_from=load.resume_from,
                                                   prompt_digest=load.digest)
                except KvlendError as exc:  # it read nothing: the load is recomputed once the others are quiet
                    log.warning("request %s: fetch not started (%s); recomputing", load.request, printable(exc))
                    loading.broken, refused = True, exc
                    for handle in loading.handles:
                        handle.cancel()
                    break
                loading.handles.append(handle)
                self._by_handle[handle.id] = loading
            if loading.handles:
                self._loading[load.request] = loading
                return
        self._recompute(loading, load.resume_from)  # nothing started: nothing is in flight
        self._done.add(load.request)
        if self.settings.stats_path:
            self._write(loading, None, 0, type(refused).__name__, {})

    def finished_recving(self) -> set[str]:
        for handle in self.node.finished():  # each already quiet: nothing can still land
            with self._lock:
                loading = self._by_handle.pop(handle.id)
                loading.finished += 1
                if loading.finished < len(loading.handles):
                    continue
                if self._loading.get(loading.request) is loading:
                    del self._loading[loading.request]
            self._ended(loading)
        for loading in self._loading.values():
            if loading.reported_at is None and not loading.cancelled and loading.verified():
                loading.reported_at = time.perf_counter()
                self._done.add(loading.request)
        done, self._done = self._done, set()
        return done

    def _ended(self, loading: _Loading) -> None:
        """Every fetch of a load is over and quiet: account for it, and tell vLLM unless already told."""
        request, handles = loading.request, loading.handles
        if not loading.broken and all(h.ok for h in handles):
            results = [h.result() for h in handles]
            self.stats.record(seconds=max(r.seconds for r in results),
                              read_seconds=max(r.read_seconds or 0.0 for r in results),
                              nbytes=sum(r.bytes for r in results), descriptors=sum(r.descriptors for r in results),
                              local_blocks=loading.resume_from // self.block_size)
        elif loading.reported_at is not None:  # its KV was complete and verified before this (a lost ack, say)
            log.info("request %s: fetch ended after its KV was complete: %s", request,
                     "; ".join(printable(h.error) for h in handles if not h.ok))
        elif not loading.cancelled:  # an aborted request's blocks are freed, not recomputed
            bound = loading.bound()
            recomputed = self._recompute(loading, bound)  # pages below every verified bound landed whole
            log.warning("request %s: KV fetch failed at token %d (%s); %d blocks recomputed", request, bound,
                        "; ".join(printable(h.error) for h in handles if not h.ok), recomputed)
        if loading.reported_at is None:
            self._done.add(request)

    def _recompute(self, loading: _Loading, token: int) -> int:
        """Have vLLM recompute a quiet load from ``token`` on; the blocks it writes again.

        With one KV cache group vLLM takes the blocks to recompute; with several it takes only the
        request (a block id names a block within one group), which it then recomputes whole.
        """
        if len(self.node.layout.groups) == 1:
            blocks = self._blocks_from(loading, token)
            self._invalid.update(blocks)
        else:
            blocks = self._blocks_from(loading, 0)
            self._failed.add(loading.request)
        self.stats.record_failure(len(blocks))
        return len(blocks)

    def _blocks_from(self, loading: _Loading, token: int) -> list[int]:
        """The blocks a load writes from the page holding ``token`` on, in every group (a windowed
        group's rows below its window are vLLM's placeholders: never written, never reported)."""
        first = token // self.block_size
        groups = self.node.layout.groups
        return [loading.tables[name][row] for name in loading.tables
                for row in groups[name].pages_read(loading.num_tokens, self.block_size).tolist() if row >= first]

    def load_errors(self) -> set[int]:
        """Blocks to recompute (a model with one KV cache group), reported once."""
        invalid, self._invalid = self._invalid, set()
        return invalid

    def failed_loads(self) -> set[str]:
        """Requests to recompute whole (a model with several KV cache groups), reported once, each with
        or before its ``finished_recving``."""
        failed, self._failed = self._failed, set()
        return failed

    def _record(self, handle) -> None:
        """A load's stats line (``stats_path``), on the node's thread as its last fetch ends."""
        with self._lock:
            loading = self._by_handle.get(handle.id)
            if loading is None:
                return
            loading.recorded += 1
            if loading.recorded < len(loading.handles):
                return
        handles = loading.handles
        results = [h.result() if h.ok else None for h in handles]
        failed = [h for h in handles if not h.ok]
        # seconds: start until its last fetch ended; transfer_s: kvlend's claim to done ack (the slowest).
        self._write(loading, None if failed else round(max(r.seconds for r in results), 6),
                    sum(r.bytes for r in results if r is not None),
                    type(failed[0].error).__name__ if failed else None, handle.timeline,
                    sum(h.early_bytes for h in handles), sum(r.descriptors for r in results if r is not None),
                    handle.phases)

    def _write(self, loading: _Loading, transfer_s: float | None, nbytes: int, error: str | None,
               timeline: dict, early_bytes: int = 0, descriptors: int = 0, phases: dict | None = None) -> None:
        line = {"request": loading.request, "ok": error is None, "tp_rank": self.settings.tp_rank,
                "fetches": len(loading.handles), "seconds": round(time.perf_counter() - loading.started, 6),
                "transfer_s": transfer_s, "bytes": nbytes, "descriptors": descriptors, "early_bytes": early_bytes,
                "blocks": max(map(len, loading.tables.values())),
                "resume_from": loading.resume_from, "bound": loading.bound(), "error": error,
                "reported_s": None if loading.reported_at is None else round(loading.reported_at - loading.started, 6),
                **{f"{k}_s": None if v is None else round(v, 6) for k, v in timeline.items()},
                "phases_s": {k: None if v is None else round(v, 6) for k, v in (phases or {}).items()}}
        with open(self.settings.stats_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def close(self) -> None:
        _close(self.node, self.registry)
