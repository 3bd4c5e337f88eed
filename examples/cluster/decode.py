"""The cluster loopback's decode rank: requests routed to the least loaded prefill, every byte checked, a
failure retried once on another prefill."""

from __future__ import annotations

import http.client
import os
import threading
import time

import numpy as np

from kvlend.cluster.router import Router
from kvlend.errors import KvlendError, RegistryError
from kvlend.runtime import DecodeNode, reload_on_sighup
from kvlend.security.credentials import Credentials
from multinode_rank import backend, config, emit, make_pools  # examples/, the rank script's folder

from .api import ApiError, post_prefill
from .kv import build_layout, page_shape, pages_of, request_pattern
from .watch import Watch, open_registry, say


class Busy(Exception):
    """The prefill had no free pages (503): back-pressure, not a failure."""


class Decoder:
    """The decode rank's requests: ``concurrency`` workers, each with its own destination slots."""

    def __init__(self, args, credentials: Credentials, node: DecodeNode, router: Router, pools) -> None:
        self.args, self.node, self.router, self.pools = args, node, router, pools
        self.identity = credentials.identity
        self.context = credentials.context(server=False)
        self.pages = pages_of(args, args.tokens)
        self.grace = node.config.cancel_grace
        self.lock = threading.Lock()
        self.next = 0
        self.served: list[dict] = []
        self.failures: list[dict] = []
        self.lost: list[dict] = []
        self.mismatched: list[str] = []
        self.routes: list[tuple[str, float]] = []
        self.busy = 0
        self.stuck: list[str] = []

    def _take(self) -> int | None:
        with self.lock:
            if self.args.requests and self.next >= self.args.requests:
                return None
            if self.args.stop_file and os.path.exists(self.args.stop_file):
                return None
            self.next += 1
            return self.next - 1

    def worker(self, w: int) -> None:
        dst = np.arange(w * self.pages, (w + 1) * self.pages, dtype=np.int64)[::-1].copy()  # not the prefill's order
        while (i := self._take()) is not None:
            if not self.request(f"{self.identity}-{i}", dst):
                return  # its slots may still be written: this worker stops
            if self.args.pause:
                time.sleep(self.args.pause)

    def request(self, request: str, dst: np.ndarray) -> bool:
        """Serve ``request`` (retried once on another prefill); False if ``dst`` cannot be reused."""
        failed: list[str] = []
        deadline = time.monotonic() + 2 * (self.args.transfer_timeout + self.grace) + 4.0
        while len(failed) < 2:
            try:
                record = self.router.pick(exclude=failed)
            except RegistryError as exc:
                if time.monotonic() > deadline:
                    self._lose(request, failed, f"RegistryError: {exc}")
                    return True
                time.sleep(0.05)
                continue
            prefill = record.identity
            with self.lock:
                self.routes.append((prefill, time.time()))
            try:
                outcome = self.attempt(request, record, dst)
            except Busy:
                with self.lock:
                    self.busy += 1
                if time.monotonic() > deadline:
                    self._lose(request, failed, "every prefill was full")
                    return True
                time.sleep(0.02)
                continue
            finally:
                self.router.finished(prefill)
            if outcome is None:
                return True
            if outcome == "stuck":
                return False
            failed.append(prefill)
            self.router.failed(prefill)  # until its record leaves, a dead prefill looks idle
        self._lose(request, failed, "failed on two prefills")
        time.sleep(0.25)  # both prefills just failed: do not spin on a broken network
        return True

    def _lose(self, request: str, failed: list[str], why: str) -> None:
        with self.lock:
            self.lost.append({"request": request, "prefills": failed, "why": why})
        say("LOST", request, why)

    def attempt(self, request: str, record, dst: np.ndarray) -> str | None:
        """One try on ``record``: None when served and verified, "failed" or "stuck" (raises ``Busy``)."""
        args, prefill = self.args, record.identity
        for pair in self.pools:
            pair[0][dst] = 0
            pair[1][dst] = 0
        started, wall = time.monotonic(), time.time()
        stage, handle = "api", None
        try:
            try:
                answer = post_prefill(record.meta["api"], self.context, request, args.tokens, args.transfer_timeout)
            except ApiError as exc:
                if exc.status == 503:
                    raise Busy() from None
                raise
            stage = "fetch"
            say("FETCHING", request, prefill)
            fetch_start = time.monotonic()
            handle = self.node.start_fetch(answer["ticket"], {"full": dst}, timeout=args.transfer_timeout)
            result = handle.wait(args.transfer_timeout + self.grace + 1.0)
            fetch_end = time.monotonic()
        except Busy:
            raise
        except (KvlendError, OSError, http.client.HTTPException, ApiError, KeyError, ValueError) as exc:
            noticed = time.monotonic()
            with self.lock:
                self.failures.append({"request": request, "prefill": prefill, "stage": stage,
                                      "error": type(exc).__name__, "typed": isinstance(exc, KvlendError),
                                      "message": str(exc)[:300], "seconds": round(noticed - started, 3),
                                      "started": wall, "at": time.time(), "deadline": args.transfer_timeout,
                                      "grace": self.grace})
            say("FAILED", request, prefill, stage, type(exc).__name__, f"{noticed - started:.3f}")
            if handle is not None and not handle.done:
                handle.cancel()
                try:
                    self.node.wait([handle], self.grace + 2.0)
                except KvlendError:
                    with self.lock:
                        self.stuck.append(request)
                    say("STUCK", request, prefill)
                    return "stuck"
            return "failed"
        shape = page_shape(args, self.pages)
        good = all(np.array_equal(pair[role][dst].view(np.uint8),
                                  request_pattern(args.seed, request, layer, role, shape).view(np.uint8))
                   for layer, pair in enumerate(self.pools) for role in (0, 1))
        with self.lock:
            self.served.append({"request": request, "prefill": prefill, "bytes": result.bytes,
                                "seconds": result.seconds, "interval": (fetch_start, fetch_end),
                                "verified": good})
            if not good:
                self.mismatched.append(request)
        say("SERVED", request, prefill, result.bytes, "ok" if good else "MISMATCH")
        return None


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Time during which at least one of ``intervals`` was running (their union's length)."""
    total, end = 0.0, -1e300
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def run_decode(args, credentials: Credentials) -> int:
    pools = make_pools(args, args.heads, pages_of(args, args.tokens) * args.concurrency, fill=False)
    layout = build_layout(pools)
    registry = open_registry(args)
    watch = Watch(registry)
    node = DecodeNode(layout, backend(args, "decode", credentials), credentials, config=config(args),
                      registry=registry, capacity=args.concurrency)
    reload_on_sighup(node)
    node.start()
    router = Router(registry, layout)
    error = None
    decoder = Decoder(args, credentials, node, router, pools)
    start = end = time.monotonic()
    try:
        if not registry.ready(args.timeout):
            raise RegistryError(f"etcd at {args.etcd} did not answer within {args.timeout:g} s")
        watch.start()
        if not registry.wait_for(lambda view: len(view.compatible(layout, "prefill")) >= args.prefills, args.timeout):
            raise RegistryError(f"fewer than {args.prefills} compatible prefills in the registry within "
                                f"{args.timeout:g} s: {[r.identity for r in registry.ranks('prefill')]}")
        say("DISCOVERED", " ".join(r.identity for r in registry.compatible(layout, "prefill")))
        start = time.monotonic()
        workers = [threading.Thread(target=decoder.worker, args=(w,), name=f"worker-{w}", daemon=True)
                   for w in range(args.concurrency)]
        for t in workers:
            t.start()
        limit = time.monotonic() + args.serve
        for t in workers:
            t.join(max(0.0, limit - time.monotonic()))
        if any(t.is_alive() for t in workers):
            error = f"workers still running after {args.serve:g} s"
        end = time.monotonic()
    except KvlendError as exc:
        error = f"{type(exc).__name__}: {exc}"
    events = watch.close()
    with decoder.lock:
        per_prefill: dict[str, dict] = {}
        for s in decoder.served:
            p = per_prefill.setdefault(s["prefill"], {"requests": 0, "bytes": 0, "fetch_seconds": 0.0, "_iv": []})
            p["requests"] += 1
            p["bytes"] += s["bytes"]
            p["fetch_seconds"] += s["seconds"]
            p["_iv"].append(s["interval"])
        for p in per_prefill.values():
            p["busy_seconds"] = round(busy_seconds(p.pop("_iv")), 4)
            p["gbps"] = round(p["bytes"] / p["busy_seconds"] / 1e9, 3) if p["busy_seconds"] else 0.0
            p["fetch_seconds"] = round(p["fetch_seconds"], 4)
        by_request = {s["request"]: s["prefill"] for s in decoder.served}  # who served a request in the end
        nbytes = sum(s["bytes"] for s in decoder.served)
        busy = busy_seconds([s["interval"] for s in decoder.served])
        served = len(decoder.served)
        result = {"role": "decode", "identity": decoder.identity, "started": decoder.next, "requests": served,
                  "bytes": nbytes, "seconds": round(end - start, 4), "busy_seconds": round(busy, 4),
                  "gbps": round(nbytes / busy / 1e9, 3) if busy else 0.0, "per_prefill": per_prefill,
                  "failures": decoder.failures,
                  "retried": {f["request"]: by_request.get(f["request"]) for f in decoder.failures},
                  "lost": decoder.lost, "mismatched": decoder.mismatched,
                  "stuck": decoder.stuck, "busy_refusals": decoder.busy,
                  "routes": [[p, round(t, 3)] for p, t in decoder.routes], "events": events, "error": error}
    result["verified"] = (error is None and served == decoder.next > 0 and not decoder.lost
                          and not decoder.mismatched and not decoder.stuck)
    emit(args, result)
    node.close()
    registry.close()
    node.backend.close()
    return 0 if result["verified"] else 1
