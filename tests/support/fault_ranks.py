"""Child processes of the fault and chaos tests: a prefill or a decode rank that can be SIGKILLed.

Each prints ``LISTENING host port`` (prefill) and one JSON object per line,
after ``MARK``, for what happened; the test process reads them, kills ranks at will, and
sends commands on stdin (``connect HOST PORT``, ``stop``).

``prefill``: lends requests whose pages hold ``pattern(seed, ...)`` (the
node tests' toy cache) to every decode that connects, a few at a time, and
scribbles over a lease's pages the moment it ends (done, aborted or expired),
as an engine reusing them would: a reader of an expired lease then sees
garbage, never plausible KV.  ``--resume NAME:SEED:TOKENS`` lends those
requests first (a replacement prefill re-lending what a dead one lent).

``decode``: reads every offer, verifies every byte against the pattern, and
reports ``served``, ``failed``, ``aborted``, ``lost`` (prefill gone mid-fetch,
with the safe bound) and ``resumed`` (a lost request completed from its bound
by another prefill); with ``--chaos`` it declines some offers and sleeps
before some fetches (a few past the TTL).

``toy-prefill``: prefills one toy-engine prompt and lends it; serves until killed.

Run as ``python -m tests.support.fault_ranks MODE ...`` with ``$KVLEND_CA``, ``$KVLEND_CERT`` and ``$KVLEND_KEY``
naming the rank's credentials; its certificate names its identity (the tests issue
``prefill<gen>``, ``decode<gen>`` and ``toy-prefill``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import select
import sys
import time

import numpy as np

from kvlend.errors import KvlendError, PeerLost, TransferTimeout
from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode
from kvlend.security.credentials import Credentials
from kvlend.testing.kvcache import (
    SENTINEL,
    TPP,
    FreeList,
    group_layers,
    make_layout,
    make_pools,
    pattern,
    prefill_request,
    slots,
)

from .agents import nixl

MARK = "@@kvlend "
SRC_PAGES = 512
DST_PAGES = 512


def emit(**event) -> None:
    # Own line, marked: UCX may write to stdout too, without a newline.
    print("\n" + MARK + json.dumps(event), flush=True)


def config(args) -> NodeConfig:
    return NodeConfig(ttl=args.ttl, heartbeat=args.heartbeat, chunk_pages=args.chunk_pages,
                      handshake_timeout=args.deadline, transfer_timeout=args.deadline)


class Stdin:
    """Lines from the parent, without blocking."""

    def __init__(self) -> None:
        self.buf = b""
        self.eof = False

    def line(self, timeout: float = 0.0) -> str | None:
        end = time.monotonic() + timeout
        while b"\n" not in self.buf and not self.eof:
            remaining = end - time.monotonic()
            if not select.select([sys.stdin], [], [], max(0.0, remaining))[0]:
                return None
            data = os.read(sys.stdin.fileno(), 4096)
            self.eof = not data
            self.buf += data
        if b"\n" not in self.buf:
            return "stop" if self.eof else None
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode().strip()


# -------------------------------------------------------------------- prefill
def run_prefill(args) -> int:
    pools = make_pools(args.pages, head_dim=args.head_dim)
    layout = make_layout(pools)
    rng = np.random.default_rng(args.seed)
    free = {name: FreeList(args.pages, rng) for name in layout.groups}
    ended: queue.SimpleQueue = queue.SimpleQueue()
    tables: dict[str, dict[str, np.ndarray]] = {}
    owner: dict[str, str] = {}
    counts = {"done": 0, "aborted": 0, "expired": 0}

    def on_release(lease, reason):  # the node's thread, under its lock: the pages are reused at once
        for name, table in tables.get(lease.request, {}).items():
            for layer in group_layers(layout, name):
                slots(pools[layer])[table[table >= 0]] = 0xEE
        ended.put((lease.request, reason, time.monotonic()))

    node = PrefillNode(layout, nixl(f"prefill{args.gen}"), Credentials.from_env(), config=config(args),
                       on_release=on_release)
    print("\nLISTENING", *node.address, flush=True)
    node.start()
    stdin = Stdin()
    todo = [tuple(r.split(":")) for r in args.resume]
    i = 0
    try:
        while stdin.line(0.002) != "stop":
            while not ended.empty():
                request, reason, at = ended.get()
                counts[reason] += 1
                if args.report_expired and reason == "expired":
                    emit(ev="expired", request=request, t=at)  # CLOCK_MONOTONIC: comparable across processes
                owner.pop(request, None)
                for name, table in tables.pop(request, {}).items():  # gone already if its offer failed
                    free[name].release(table)
            peers = node.ready_peers()
            for peer in peers:
                if sum(o == peer for o in owner.values()) >= args.window:
                    continue
                if todo:
                    request, seed, num_tokens = todo.pop(0)
                    seed, num_tokens = int(seed), int(num_tokens)
                else:
                    request, seed = f"p{args.gen}-{i}", args.gen * 1_000_000 + i
                    num_tokens = int(rng.integers(1, args.max_tokens + 1))
                    if rng.random() < args.big:
                        num_tokens = int(rng.integers(args.big_tokens // 2, args.big_tokens + 1))
                    i += 1
                if min(map(len, free.values())) < -(-num_tokens // TPP):
                    continue
                if args.delay and rng.random() < 0.02:
                    time.sleep(rng.random() * args.delay)
                with node._lock:  # fill and lend atomically against the node's reuse callback
                    tables[request] = prefill_request(layout, pools, free, num_tokens, seed)
                    owner[request] = peer
                    try:
                        node.offer(peer, request, num_tokens, tables[request], layout.full_selection(),
                                   meta={"seed": seed})
                    except KvlendError:  # the decode just went away
                        owner.pop(request)
                        for name, table in tables.pop(request).items():
                            free[name].release(table)
        end = time.monotonic() + args.ttl + 5 * args.heartbeat + 2.0
        while node.lender.active_leases and time.monotonic() < end:
            time.sleep(0.01)
        with node._lock:
            emit(ev="prefill_end", locked=node.lender.locks.locked_pages(), active=node.lender.active_leases,
                 offered=i, **counts)
    finally:
        node.close()
        node.backend.close()
    return 0


# --------------------------------------------------------------------- decode
def verify(layout, dst_pools, offer, table: dict[str, np.ndarray]) -> bool:
    n_pages = -(-offer.num_tokens // TPP)
    for name, t in table.items():
        lent = offer.pages[name].token_pages
        for layer in group_layers(layout, name):
            got = slots(dst_pools[layer])[t]
            want = pattern(offer.meta["seed"], layer, n_pages, got.shape[1])
            if not np.array_equal(got[lent], want[lent]):
                return False
    return True


def run_decode(args) -> int:
    dst_pools = make_pools(DST_PAGES)
    layout = make_layout(dst_pools)
    rng = np.random.default_rng(args.seed)
    free = {name: FreeList(DST_PAGES, rng) for name in layout.groups}
    node = DecodeNode(layout, nixl(f"decode{args.gen}"), Credentials.from_env(), config=config(args))
    host, port = args.connect.rsplit(":", 1)
    node.connect(host, int(port))
    emit(ev="connected")
    stdin = Stdin()
    lost: dict[str, tuple[int, dict]] = {}  # request -> (safe bound, its destination table)
    stats = {k: 0 for k in ("served", "failed", "aborted", "lost", "resumed", "mismatch")}
    slow_hook(node, args)
    armed = node.backend = Armed(node.backend)
    try:
        while True:
            cmd = stdin.line()
            if cmd == "stop":
                break
            if cmd == "arm":
                armed.armed = True
            if not node.links and cmd is None:
                cmd = stdin.line(args.deadline)
                if cmd == "stop":
                    break
            if cmd and cmd.startswith("connect "):
                _, h, p = cmd.split()
                try:
                    node.connect(h, int(p))
                    emit(ev="connected")
                except KvlendError as exc:
                    emit(ev="connect_failed", error=str(exc)[:200])
            if not node.links:
                continue
            try:
                peer, offer = node.next_offer(0.05)
            except TransferTimeout:
                continue
            except PeerLost as exc:
                emit(ev="link_lost", error=str(exc)[:200])
                continue
            resume = lost.pop(offer.request, None)
            if args.chaos and resume is None and rng.random() < 0.03:
                node.decline(peer, offer, "chaos")
                stats["aborted"] += 1
                emit(ev="aborted", request=offer.request)
                continue
            if args.chaos and rng.random() < 0.05:
                time.sleep(rng.random() * 0.05)
            if args.chaos and rng.random() < 0.0005:
                time.sleep(args.ttl * (1.2 + rng.random()))  # outlives this lease and those queued behind it
            n_pages = -(-offer.num_tokens // TPP)
            if resume is None:
                table = {name: free[name].alloc(n_pages) for name in layout.groups}
                for name, t in table.items():
                    for layer in group_layers(layout, name):
                        slots(dst_pools[layer])[t] = SENTINEL
                bound = 0
            else:
                bound, table = resume
            keep = False
            try:
                result = node.fetch(peer, offer, table, resume_from=bound)
            except PeerLost as exc:
                stats["lost"] += 1
                lost[offer.request] = (exc.bound, table)
                keep = True
                emit(ev="lost", request=offer.request, seed=offer.meta["seed"], tokens=offer.num_tokens,
                     bound=exc.bound, error=str(exc)[:200])
            except KvlendError as exc:
                stats["failed"] += 1
                emit(ev="failed", request=offer.request, kind=type(exc).__name__, error=str(exc)[:200])
            else:
                ok = verify(layout, dst_pools, offer, table)
                stats["served" if ok else "mismatch"] += 1
                if resume is not None:
                    stats["resumed"] += 1
                    emit(ev="resumed", request=offer.request, bound=bound, bytes=result.bytes, ok=ok,
                         tokens=offer.num_tokens)
                else:
                    emit(ev="served", request=offer.request, ok=ok, bytes=result.bytes)
            finally:
                if not keep:
                    for name, t in table.items():
                        free[name].release(t)
        emit(ev="decode_end", **stats)
    finally:
        node.close()
        armed.backend.close()
    return 0


def slow_hook(node: DecodeNode, args) -> None:
    """``--slow``: announce the first posted chunk of each fetch and pace the rest (real NIXL underneath)."""
    if not args.slow:
        return
    post = node.backend.post_read
    state = {"posted": 0}

    def paced(peer, batches, tag):
        post(peer, batches, tag)
        state["posted"] += 1
        if state["posted"] == 1:
            emit(ev="mid_transfer")
        time.sleep(args.slow)

    node.backend.post_read = paced


class Armed:
    """Wraps the real backend: once armed, the next fetch stops after its first landed chunk,
    says ``mid_transfer`` and pauses, so the parent can SIGKILL the prefill right then."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.armed = False
        self._stash: list = []

    def post_read(self, peer, batches, tag):
        self.backend.post_read(peer, batches, tag)
        if not self.armed:
            return
        self.armed = False
        end = time.monotonic() + 5.0
        while not any(c.tag == tag for c in self._stash) and time.monotonic() < end:
            self._stash.extend(self.backend.poll())
        emit(ev="mid_transfer")
        time.sleep(0.5)  # well inside the TTL: only the prefill's death can fail this fetch

    def poll(self):
        out, self._stash = self._stash + self.backend.poll(), []
        return out

    def __getattr__(self, name):
        return getattr(self.backend, name)


# ------------------------------------------------------------------ toy prefill
def run_toy_prefill(args) -> int:
    from kvlend.demo import toy_engine

    cfg = toy_engine.preset("tiny", seed=args.seed)
    model = toy_engine.ToyModel(cfg)
    prompt = toy_engine.make_prompts(1, args.seed, args.prompt_len, args.prompt_len, cfg.vocab)[0]
    cache = toy_engine.PagedKVCache(cfg, 2 * -(-args.prompt_len // cfg.tokens_per_page), seed=args.gen)
    layout = cache.layout()
    node = PrefillNode(layout, nixl(f"toy-prefill{args.gen}"), Credentials.from_env(), config=config(args))
    print("\nLISTENING", *node.address, flush=True)
    node.start()
    try:
        peer = node.wait_for_peer(args.deadline)
        table, first = toy_engine.prefill(model, cache, prompt)
        node.offer(peer, "toy-0", len(prompt), {"full": table}, layout.full_selection(),
                   meta={"first": first, "prompt": prompt})
        emit(ev="offered", tokens=len(prompt))
        Stdin().line(args.deadline * 6)  # until the parent says stop (or kills us)
    finally:
        node.close()
        node.backend.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["prefill", "decode", "toy-prefill"])
    p.add_argument("--gen", type=int, default=0, help="generation: keeps names and seeds distinct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttl", type=float, default=1.5)
    p.add_argument("--heartbeat", type=float, default=0.3)
    p.add_argument("--chunk-pages", type=int, default=4)
    p.add_argument("--deadline", type=float, default=10.0)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pages", type=int, default=SRC_PAGES, help="prefill: pages per layer pool")
    p.add_argument("--head-dim", type=int, default=8, help="prefill: page size (a slot is 64 * head_dim bytes)")
    p.add_argument("--big", type=float, default=0.0, help="prefill: share of requests of --big-tokens/2..--big-tokens")
    p.add_argument("--big-tokens", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0, help="prefill: longest random pause before an offer")
    p.add_argument("--report-expired", action="store_true", help="prefill: an event per lease that expired")
    p.add_argument("--resume", action="append", default=[], metavar="NAME:SEED:TOKENS")
    p.add_argument("--connect", metavar="HOST:PORT")
    p.add_argument("--chaos", action="store_true")
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--prompt-len", type=int, default=200)
    args = p.parse_args()
    return {"prefill": run_prefill, "decode": run_decode, "toy-prefill": run_toy_prefill}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
