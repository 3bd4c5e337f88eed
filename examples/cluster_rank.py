"""One rank of the cluster loopback (``scripts/multinode-loopback --cluster``): N prefills x M decodes, etcd.

``--role prefill`` publishes its record in etcd (``kvlend.cluster.registry``)
with the address of a small HTTPS API in its ``meta``; ``POST /prefill
{"request": id, "tokens": n}`` fills free page slots with that request's KV
and lends them under a ticket, freed when the lease ends (503 when no slots
are free).  ``--role decode`` finds the prefills through etcd alone (no
address is given), routes each request to the least loaded one
(``kvlend.cluster.router.Router``), redeems the ticket and checks every
byte; a typed failure (a ``KvlendError``, or the API's HTTP or connection
error) is retried once on another prefill.

A request's KV is derived from the request id (and the seed, layer and
K/V), never from which prefill made it or where: bytes from any prefill
verify, and bytes from the wrong pages or the wrong request do not.

Both roles log registry events on stdout as they happen, with the wall
clock (the driver's namespaces share the kernel's): ``REGISTRY JOINED|LEFT
<identity> <t>``, ``REGISTRY DEGRADED|RECOVERED <t>``; a decode also logs
``SERVED`` and ``FAILED`` per request.  Each rank writes one JSON result
(``--report``) before it tears NIXL down.  Credentials: ``$KVLEND_CA``,
``$KVLEND_CERT``, ``$KVLEND_KEY`` (the rank's identity is its certificate's).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import http.server
import json
import logging
import os
import signal
import ssl
import sys
import threading
import time

import numpy as np
from multinode_rank import DTYPE, backend, config, emit, make_pools  # examples/, this script's folder
from workload import run_rank

from kvlend.cluster.registry import Registry, etcd_security_from_env
from kvlend.cluster.router import Router
from kvlend.cluster.view import JOINED, LEFT
from kvlend.core.layout import ReplicaRank, layout_from_pools
from kvlend.errors import KvlendError, RegistryError
from kvlend.runtime import DecodeNode, PrefillNode, reload_on_sighup
from kvlend.security.credentials import Credentials

SCOPE = "kvlend-cluster"
MAX_BODY = 4096


def request_pattern(seed: int, request: str, layer: int, role: int, shape: tuple[int, ...]) -> np.ndarray:
    """The KV of ``request``'s pages (K: role 0, V: role 1): both ends derive it from the request id alone."""
    key = int.from_bytes(hashlib.sha256(request.encode()).digest()[:8], "little")
    rng = np.random.default_rng([seed, key, layer, role])
    n = int(np.prod(shape)) * np.dtype(DTYPE).itemsize
    return rng.integers(0, 256, n, dtype=np.uint8).view(DTYPE).reshape(shape)


def pages_of(args, tokens: int) -> int:
    return -(-tokens // args.tokens_per_page)


def page_shape(args, pages: int) -> tuple[int, ...]:
    return (pages, args.heads, args.tokens_per_page, args.head_dim)


def build_layout(pools):
    return layout_from_pools(k=[p[0] for p in pools], v=[p[1] for p in pools], kept_window=1 << 20,
                             replica=ReplicaRank(1, 0), scope=SCOPE)


_SAY = threading.Lock()


def say(*words) -> None:
    """One whole line on stdout, even from several threads (the driver parses these)."""
    with _SAY:
        sys.stdout.write(" ".join(str(w) for w in words) + "\n")
        sys.stdout.flush()


class Watch:
    """Registry events with wall-clock times: logged as they come, and kept for the report."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="registry-watch", daemon=True)

    def start(self) -> Watch:
        self.registry.add_listener(self._changes)
        self._thread.start()
        return self

    def _add(self, event: str, identity: str = "") -> None:
        at = time.time()
        with self._lock:
            self.events.append({"event": event, "identity": identity, "at": at})
        say("REGISTRY", event.upper(), identity or "-", f"{at:.3f}")

    def _changes(self, changes) -> None:  # the registry thread: quick, never blocks
        for change in changes:
            if change.kind in (JOINED, LEFT):
                self._add(change.kind, change.record.identity)

    def _poll(self) -> None:
        """Degraded and recovered, as the rank sees them (the registry logs its reason too)."""
        was = False
        while not self._stop.wait(0.05):
            now = self.registry.degraded
            if now != was:
                self._add("degraded" if now else "recovered")
                was = now

    def close(self) -> list[dict]:
        self._stop.set()
        self._thread.join(1.0)
        self.registry.remove_listener(self._changes)
        with self._lock:
            return list(self.events)


def open_registry(args) -> Registry:
    endpoints = [e.strip() for e in args.etcd.split(",") if e.strip()]
    return Registry(endpoints, args.prefix, ttl=args.registry_ttl, timeout=args.registry_timeout,
                    **etcd_security_from_env()).start()


# ------------------------------------------------------------------ prefill
class Lending:
    """The prefill's page slots: which are free, which each live lease holds."""

    def __init__(self, args, pools, layout) -> None:
        self.args, self.pools, self.layout = args, pools, layout
        self.rng = np.random.default_rng([args.seed, 11])  # slots in a seeded random order
        self.free = set(range(args.pool_pages))
        self.leases: dict[bytes, np.ndarray] = {}
        self.lent = self.refused = 0
        self.released: dict[str, int] = {}
        self.node: PrefillNode | None = None
        self.lock = threading.Lock()

    def lend(self, request: str, tokens: int) -> dict | None:
        """Fill free slots with ``request``'s KV and lend them; None when too few are free."""
        n = pages_of(self.args, tokens)
        with self.lock:
            if n > len(self.free):
                self.refused += 1
                return None
            slots = self.rng.choice(np.fromiter(self.free, dtype=np.int64), n, replace=False)
            self.free.difference_update(slots.tolist())
        try:
            for layer, pair in enumerate(self.pools):  # the slots are ours alone until lent
                for role in (0, 1):
                    pair[role][slots] = request_pattern(self.args.seed, request, layer, role, page_shape(self.args, n))
            with self.lock:  # ``release`` waits for the lease to be known
                ticket = self.node.lend(request, tokens, {"full": slots}, self.layout.full_selection())
                self.leases[ticket.lease] = slots
                self.lent += 1
        except BaseException:
            with self.lock:
                self.free.update(slots.tolist())
            raise
        return {"ticket": ticket.to_text(), "prefill": self.node.name}

    def release(self, lease, reason: str) -> None:  # on_release: the node's thread
        with self.lock:
            slots = self.leases.pop(lease.id, None)
            if slots is not None:
                self.free.update(slots.tolist())
            self.released[reason] = self.released.get(reason, 0) + 1

    @property
    def live(self) -> int:
        with self.lock:
            return len(self.leases)


class Api(http.server.BaseHTTPRequestHandler):
    """``POST /prefill``: one request's pages, lent under a ticket.  Mutual TLS: cluster ranks only."""

    timeout = 10  # seconds a connection may stall (handshake included)
    server: ApiServer

    def setup(self) -> None:
        super().setup()
        self.request.do_handshake()  # here, on this connection's thread, not in the accept loop

    def do_POST(self) -> None:
        if self.path != "/prefill":
            return self._answer(404, {"error": f"no {self.path}: POST /prefill"})
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if not 0 < length <= MAX_BODY:
                raise ValueError(f"body of {length} bytes, expected 1..{MAX_BODY}")
            body = json.loads(self.rfile.read(length))
            request, tokens = body["request"], body["tokens"]
            if not isinstance(request, str) or not 0 < len(request) <= 200:
                raise ValueError("request: expected an id of 1..200 characters")
            if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 < tokens <= 1 << 20:
                raise ValueError("tokens: expected an int in [1, 2**20]")
        except (ValueError, KeyError, TypeError) as exc:
            return self._answer(400, {"error": f"bad request: {exc}"})
        try:
            answer = self.server.lending.lend(request, tokens)
        except KvlendError as exc:
            return self._answer(500, {"error": f"{type(exc).__name__}: {exc}"})
        if answer is None:
            return self._answer(503, {"error": "no free pages"})
        self._answer(200, answer)

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args) -> None:  # noqa: A002 -- the base class's name
        pass


class ApiServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, lending: Lending, context: ssl.SSLContext) -> None:
        super().__init__(address, Api)
        self.lending = lending
        self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        say(f"API {client_address[0]}: {type(exc).__name__}: {exc}")


def run_prefill(args, credentials: Credentials) -> int:
    stopping: list[int] = []  # a handler may take no lock (it may interrupt the lock's holder): just a flag
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    pools = make_pools(args, args.heads, args.pool_pages, fill=False)
    layout = build_layout(pools)
    lending = Lending(args, pools, layout)
    api = ApiServer((args.host, args.api_port), lending, credentials.context(server=True))
    registry = open_registry(args)
    watch = Watch(registry)
    capacity = max(1, args.pool_pages // pages_of(args, args.tokens))
    node = PrefillNode(layout, backend(args, "prefill", credentials), credentials, host=args.host, port=args.port,
                       config=config(args), on_release=lending.release, registry=registry, capacity=capacity,
                       meta={"api": f"{args.host}:{api.server_address[1]}"})
    reload_on_sighup(node)  # renewed certificate files take over for new links
    lending.node = node
    node.start()
    serving = threading.Thread(target=api.serve_forever, kwargs={"poll_interval": 0.1}, name="api", daemon=True)
    serving.start()
    ready = registry.ready(args.timeout)
    watch.start()
    say(f"LISTENING {node.address[0]} {node.address[1]} api {api.server_address[1]} registry "
        f"{'ready' if ready else 'NOT READY'}")
    until = time.monotonic() + args.serve
    while not stopping and time.monotonic() < until:  # until told to stop (signal or file), or the limit
        if args.stop_file and os.path.exists(args.stop_file):
            break
        time.sleep(0.1)
    say(f"STOPPING {time.time():.3f} leases {lending.live}")
    api.shutdown()
    api.server_close()
    drain_by = time.monotonic() + args.ttl + 2.0  # a lease nobody reads ends by its TTL
    while lending.live and time.monotonic() < drain_by:
        time.sleep(0.05)
    say(f"DRAINED {time.time():.3f} leases {lending.live}")
    events = watch.close()
    with lending.lock:
        result = {"role": "prefill", "identity": node.name, "api": api.server_address[1], "lent": lending.lent,
                  "refused": lending.refused, "released": dict(lending.released),
                  "leases_left": len(lending.leases), "registry_ready": ready, "events": events}
    result["ok"] = ready and result["leases_left"] == 0
    emit(args, result)
    node.close()
    registry.close()
    node.backend.close()
    return 0 if result["ok"] else 1


# ------------------------------------------------------------------- decode
class ApiError(Exception):
    """The prefill's API answered something other than 200."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status


def post_prefill(api: str, context: ssl.SSLContext, request: str, tokens: int, timeout: float) -> dict:
    host, port = api.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), context=context, timeout=timeout)
    try:
        conn.request("POST", "/prefill", json.dumps({"request": request, "tokens": tokens}),
                     {"Content-Type": "application/json"})
        reply = conn.getresponse()
        text = reply.read(MAX_BODY).decode("utf-8", "replace")
        if reply.status != 200:
            raise ApiError(reply.status, text)
        return json.loads(text)
    finally:
        conn.close()


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Environment: KVLEND_CA, KVLEND_CERT, KVLEND_KEY name the cluster CA "
                                       "certificate, this rank's certificate (its identity) and its key.")
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--etcd", required=True, metavar="HOST:PORT,...", help="etcd client endpoints")
    p.add_argument("--prefix", default="/kvlend/loopback", help="the cluster's registry prefix")
    p.add_argument("--registry-ttl", type=float, default=2.0, help="seconds a dead rank's record outlives it")
    p.add_argument("--registry-timeout", type=float, default=1.0, help="deadline of each etcd call (s)")
    p.add_argument("--host", default="127.0.0.1", help="prefill: address to listen on (control and API)")
    p.add_argument("--port", type=int, default=47000, help="prefill: control port")
    p.add_argument("--api-port", type=int, default=47001, help="prefill: HTTPS API port")
    p.add_argument("--prefills", type=int, default=1, help="decode: prefills to discover before the first request")
    p.add_argument("--concurrency", type=int, default=4, help="decode: requests in flight")
    p.add_argument("--requests", type=int, default=16, help="decode: requests to serve (0: until --stop-file)")
    p.add_argument("--stop-file", help="decode: start no request once this file exists; prefill: stop serving")
    p.add_argument("--pause", type=float, default=0.0, help="decode: seconds each worker waits between requests")
    p.add_argument("--serve", type=float, default=300.0, help="seconds to serve at most")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens-per-page", type=int, default=16)
    p.add_argument("--pool-pages", type=int, default=256, help="prefill pages per pool")
    p.add_argument("--tokens", type=int, default=256, help="tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="registry, discovery and handshake deadline (s)")
    p.add_argument("--transfer-timeout", type=float, default=10.0, help="one request's deadline, API and fetch (s)")
    p.add_argument("--ttl", type=float, default=10.0, help="lease lifetime without a heartbeat (s)")
    p.add_argument("--report", help="write the JSON result to this file too")
    args = p.parse_args(argv)
    credentials = Credentials.from_env()
    logging.basicConfig(level=os.environ.get("KVLEND_LOG", "WARNING"),
                        format=f"{credentials.identity} %(levelname)s %(name)s: %(message)s")
    return (run_prefill if args.role == "prefill" else run_decode)(args, credentials)


if __name__ == "__main__":
    sys.exit(run_rank(main, "cluster_rank"))
