"""Chaos over ``UCX_TLS=tcp``: two prefill processes, one decode with many fetches in flight.

``run`` (the driver, what ``scripts/chaos`` and ``tests/test_chaos.py`` start) spawns two
``fault_ranks prefill`` ranks and one ``decode`` rank of this module, then for ``--seconds``
SIGKILLs and restarts the prefills, or SIGSTOPs one for 1-10 s, at random.  The decode keeps
``--inflight`` fetches going (a share of them cancelled, a few of 8-16 MiB), and checks:

* a fetch reported done holds the prefill's bytes, every one (the prefills scribble over a
  lease's pages the moment it ends, so a late or stale read shows);
* a fetch reported failed failed with a ``KvlendError`` within its deadline, and its
  destination is not written after that (it is marked and checked again ``HOLD`` s later);
* at the end every fetch started has finished, within its deadline.

The driver adds: no process died that was not killed, and each prefill, stopped after the
decode, ends holding no lease.  It prints one summary line per run (requests served, failures by
type, resets) and exits non-zero on any violation.  Run as ``scripts/chaos --seconds 60 --runs 10``.
The decode answers ``report`` on stdin with its counts so far (``test_chaos`` waits on them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import numpy as np

from kvlend.errors import KvlendError, PeerLost, TransferTimeout
from kvlend.runtime import DecodeNode, NodeConfig
from kvlend.security.credentials import Credentials
from kvlend.testing.kvcache import SENTINEL, TPP, FreeList, group_layers, make_layout, make_pools, slots

from .agents import nixl
from .fault_ranks import Stdin, emit, verify

PAGES = 3072  # per layer pool, both sides
HEAD_DIM = 256  # 8 KiB slots: a full-attention token page is 16 KiB over its two layers
BIG_TOKENS = 4096  # 2048..4096 tokens: 8-16 MiB (512-1024 pages of the full-attention group)
TTL, BEAT, DEADLINE, GRACE = 3.0, 0.5, 8.0, 2.0
SLACK = 3.0  # a loaded host's lag between a deadline and the rank seeing the fetch end
HOLD = 2.0  # seconds a failed fetch's destination stays marked before it is checked and reused
FAILED = 0x5A  # what a failed fetch's destination holds while it is held
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def config(deadline: float = DEADLINE) -> NodeConfig:
    return NodeConfig(ttl=TTL, heartbeat=BEAT, chunk_pages=64, handshake_timeout=DEADLINE,
                      transfer_timeout=deadline, cancel_grace=GRACE)


# --------------------------------------------------------------------- decode
class Checker:
    """The decode's fetches in flight, the destinations it holds, and what went wrong."""

    def __init__(self, node: DecodeNode, layout, pools, rng) -> None:
        self.node, self.layout, self.pools, self.rng = node, layout, pools, rng
        self.deadline = node.config.transfer_timeout
        self.free = {name: FreeList(PAGES, rng) for name in layout.groups}
        self.flight: dict[int, tuple] = {}  # fetch id -> (handle, table, offer, started, cancel at)
        self.held: list[tuple[float, dict]] = []  # (check at, table) of failed fetches
        self.stats = {k: 0 for k in ("started", "served", "bytes", "failed", "cancelled", "declined", "refused", "big")}
        self.kinds: dict[str, int] = {}
        self.violations: list[str] = []

    def violation(self, text: str) -> None:
        self.violations.append(text)
        if len(self.violations) <= 20:
            emit(ev="violation", text=text[:400])

    def start(self, link, offer, cancel_share: float) -> None:
        n_pages = -(-offer.num_tokens // TPP)
        if min(len(f.free) for f in self.free.values()) < n_pages:
            self.node.decline(link, offer, "no room")
            self.stats["declined"] += 1
            return
        table = {name: self.free[name].alloc(n_pages) for name in self.layout.groups}
        self.mark(table, SENTINEL)
        now = time.monotonic()
        try:
            handle = self.node.start_fetch(offer, table, link=link)
        except PeerLost:  # its link closed since the offer came: refused before anything was posted
            self.free_table(table)
            self.stats["refused"] += 1
            return
        cancel = now + self.rng.random() * 0.05 if self.rng.random() < cancel_share else None
        self.flight[handle.id] = (handle, table, offer, now, cancel)
        self.stats["started"] += 1
        self.stats["big"] += n_pages >= 512

    def mark(self, table: dict, value: int) -> None:
        for name, t in table.items():
            for layer in group_layers(self.layout, name):
                slots(self.pools[layer])[t] = value

    def turn(self) -> None:
        now = time.monotonic()
        for fid, (handle, _, _, _, cancel) in list(self.flight.items()):
            if cancel is not None and now >= cancel:
                handle.cancel()
                self.stats["cancelled"] += 1
                self.flight[fid] = self.flight[fid][:4] + (None,)
        for handle in self.node.finished():
            self.finish(handle, time.monotonic())
        while self.held and self.held[0][0] <= now:
            self.release(self.held.pop(0)[1])

    def finish(self, handle, now: float) -> None:
        _, table, offer, started, _ = self.flight.pop(handle.id)
        took = now - started
        if handle.ok:
            if not verify(self.layout, self.pools, offer, table):
                self.violation(f"fetch {handle.id} ({offer.request}) done with wrong bytes")
            self.stats["served"] += 1
            self.stats["bytes"] += handle.result().bytes
            self.free_table(table)
            return
        error = handle.error
        self.stats["failed"] += 1
        self.kinds[type(error).__name__] = self.kinds.get(type(error).__name__, 0) + 1
        if not isinstance(error, KvlendError):
            self.violation(f"fetch {handle.id} failed untyped: {error!r}")
        if took > self.deadline + GRACE + SLACK:
            self.violation(f"fetch {handle.id} failed after {took:.1f} s (deadline {self.deadline} s): {error}")
        self.mark(table, FAILED)
        self.held.append((now + HOLD, table))

    def release(self, table: dict) -> None:
        """A failed fetch's destination, ``HOLD`` s after its failure: still as marked, then reused."""
        for name, t in table.items():
            for layer in group_layers(self.layout, name):
                if not (slots(self.pools[layer])[t] == FAILED).all():
                    self.violation(f"a failed fetch's destination (group {name}, layer {layer}) was written "
                                   "after its failure was reported")
        self.free_table(table)

    def free_table(self, table: dict) -> None:
        for name, t in table.items():
            self.free[name].release(t)

    def drain(self, deadline: float) -> None:
        """Start nothing more; every fetch in flight must finish by its own deadline."""
        end = time.monotonic() + deadline + GRACE + SLACK
        while self.flight and time.monotonic() < end:
            self.turn()
            time.sleep(0.01)
        for handle, _, offer, started, _ in self.flight.values():
            self.violation(f"fetch {handle.id} ({offer.request}) never finished: {handle!r}, "
                           f"started {time.monotonic() - started:.1f} s ago")
        while self.held:
            check_at, table = self.held.pop(0)
            time.sleep(max(0.0, check_at - time.monotonic()))
            self.release(table)


def run_decode(args) -> int:
    pools = make_pools(PAGES, head_dim=HEAD_DIM)
    layout = make_layout(pools)
    rng = np.random.default_rng(args.seed)
    node = DecodeNode(layout, nixl(f"decode{args.gen}"), Credentials.from_env(), config=config(args.deadline))
    node.start()
    checker = Checker(node, layout, pools, rng)
    stdin = Stdin()

    def connect(host: str, port: int) -> None:  # off the main loop: a stopped prefill stalls a handshake
        try:
            node.connect(host, port)
            emit(ev="connected", port=port)
        except KvlendError as exc:
            emit(ev="connect_failed", port=port, error=str(exc)[:200])

    try:
        while (cmd := stdin.line()) != "stop":
            if cmd == "report":
                emit(ev="report", resets=node.backend.resets, healthy=node.healthy, **checker.stats)
            if cmd and cmd.startswith("connect "):
                _, host, port = cmd.split()
                threading.Thread(target=connect, args=(host, int(port)), daemon=True).start()
            checker.turn()
            if len(checker.flight) >= args.inflight or not node.links:
                time.sleep(0.002)
                continue
            try:
                link, offer = node.next_offer(0.01)
            except (TransferTimeout, PeerLost):
                continue
            checker.start(link, offer, args.cancel)
        checker.drain(args.deadline)
        emit(ev="decode_end", violations=len(checker.violations), kinds=checker.kinds, healthy=node.healthy,
             resets=node.backend.resets, **checker.stats)
    finally:
        node.close()
        node.backend.close()
    return 0


# --------------------------------------------------------------------- driver
def prefill_args(gen: int) -> list[str]:
    return ["--gen", str(gen), "--seed", str(gen), "--ttl", str(TTL), "--heartbeat", str(BEAT), "--chunk-pages",
            "64", "--deadline", str(DEADLINE), "--window", "40", "--pages", str(PAGES), "--head-dim",
            str(HEAD_DIM), "--max-tokens", "64", "--big", "0.004", "--big-tokens", str(BIG_TOKENS)]


def chaos(seconds: float, seed: int, inflight: int = 48, cancel: float = 0.05, stops: float = 0.5,
          log=print) -> dict:
    """One run; its summary, with ``violations`` (empty when every check held).

    ``stops``: the share of chaos events that SIGSTOP a prefill for 1-10 s rather than SIGKILL it.
    """
    saved = {name: os.environ.get(name) for name in TCP}
    os.environ.update(TCP)  # the children inherit it; this process's own agents must not
    try:
        return _chaos(seconds, seed, inflight, cancel, stops, log)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _chaos(seconds: float, seed: int, inflight: int, cancel: float, stops: float, log) -> dict:
    from .ranks import Rank

    rng = np.random.default_rng(seed)
    violations: list[str] = []
    gen = [0]
    events = {"kill": 0, "stop": 0}

    def start_prefill() -> Rank:
        gen[0] += 1
        rank = Rank(f"prefill{gen[0]}", "prefill", *prefill_args(seed * 100 + gen[0]))
        rank.listening(60.0)
        return rank

    def drain(rank: Rank) -> list[dict]:
        out = []
        while rank.proc.poll() is None and rank.ready():
            try:
                event = rank.next_event(0.5)
            except AssertionError:
                break
            if event is not None:
                out.append(event)
        return out

    prefills = [start_prefill(), start_prefill()]
    gen[0] += 1
    decode = Rank(f"decode{gen[0]}", "decode", "--gen", str(seed * 100 + gen[0]), "--seed", str(seed),
                  "--inflight", str(inflight), "--cancel", str(cancel), module="chaos_ranks")
    decode_events: list[dict] = []
    stopped: dict[int, float] = {}  # prefill index -> when to SIGCONT it
    try:
        for p in prefills:
            decode.send("connect %s %d" % p.address)
        start = time.monotonic()
        next_chaos = start + rng.uniform(1.0, 3.0)
        while time.monotonic() - start < seconds:
            now = time.monotonic()
            decode_events += drain(decode)
            for p in prefills:
                drain(p)
            for i, p in enumerate(prefills):
                if p.proc.poll() is not None:
                    violations.append(f"prefill {i} died unkilled: rc {p.proc.returncode}")
                    prefills[i] = start_prefill()
                    decode.send("connect %s %d" % prefills[i].address)
                    stopped.pop(i, None)
                elif i in stopped and now >= stopped[i]:
                    os.kill(p.proc.pid, signal.SIGCONT)
                    del stopped[i]
                    decode.send("connect %s %d" % p.address)  # a no-op if its link survived
            if decode.proc.poll() is not None:
                violations.append(f"the decode died unkilled: rc {decode.proc.returncode}")
                break
            if now >= next_chaos:
                next_chaos = now + rng.uniform(1.0, 4.0)
                i = int(rng.integers(len(prefills)))
                if i in stopped:
                    continue
                if rng.random() < 1.0 - stops:
                    events["kill"] += 1
                    prefills[i].kill()
                    prefills[i] = start_prefill()
                    decode.send("connect %s %d" % prefills[i].address)
                else:
                    events["stop"] += 1
                    os.kill(prefills[i].proc.pid, signal.SIGSTOP)
                    stopped[i] = now + rng.uniform(1.0, 10.0)
            time.sleep(0.05)
        chaos_s = time.monotonic() - start
        for i in list(stopped):
            os.kill(prefills[i].proc.pid, signal.SIGCONT)
        decode.send("stop")
        end = time.monotonic() + DEADLINE + GRACE + SLACK + 30.0
        summary = None
        while summary is None and time.monotonic() < end and decode.proc.poll() is None:
            for event in drain(decode):
                decode_events.append(event)
                if event["ev"] == "decode_end":
                    summary = event
            time.sleep(0.05)
        drain_s = time.monotonic() - start - chaos_s
        if summary is None:
            violations.append(f"the decode never reported its end (rc {decode.proc.poll()})")
            summary = {}
        decode.finish(30.0)
        for i, p in enumerate(prefills):  # the decode's sockets closed under them: they must end cleanly
            try:
                p.send("stop")
                end = p.event("prefill_end", 30.0)
            except (AssertionError, BrokenPipeError):
                violations.append(f"prefill {i} died unkilled: rc {p.proc.poll()}")
                continue
            if end["locked"] or end["active"]:
                violations.append(f"prefill {i} ended holding leases: {end}")
            p.finish(30.0)  # SIGKILLed (rc -9) if it does not exit by then
            if p.proc.returncode != 0:
                violations.append(f"prefill {i} exited with rc {p.proc.returncode} after its end")
    finally:
        for rank in (decode, *prefills):
            rank.kill()
    violations += [e["text"] for e in decode_events if e["ev"] == "violation"]
    out = {"seconds": round(chaos_s, 1), "drain_seconds": round(drain_s, 1), **events, **summary,
           "violations": violations}
    log(f"chaos seed {seed}: {json.dumps(out)}")
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["run", "decode"])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gen", type=int, default=0)
    p.add_argument("--deadline", type=float, default=DEADLINE, help="decode: seconds a fetch may take")
    p.add_argument("--inflight", type=int, default=48, help="fetches the decode keeps in flight")
    p.add_argument("--cancel", type=float, default=0.05, help="share of fetches cancelled soon after they start")
    p.add_argument("--stops", type=float, default=0.5, help="share of chaos events that SIGSTOP rather than SIGKILL")
    args = p.parse_args()
    if args.mode == "decode":
        return run_decode(args)
    failed = 0
    for run in range(args.runs):
        failed += bool(chaos(args.seconds, args.seed + run, args.inflight, args.cancel, args.stops)["violations"])
    print(f"chaos: {args.runs - failed} of {args.runs} runs held")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
