"""Progressive lending (issue 17) under faults: real processes, real NIXL over ``UCX_TLS=tcp``, real TLS.

Every rank is a child process (``tests.support.progressive_rank``) running the toy engine's chunked
prefill (``prefill_chunks``, chunk 256) of one long prompt: the prefill lends it under a ticket
after its first chunk and extends the lease after each later one; the decode redeems the ticket
and reads each extension as it comes.  UCX reads ``UCX_TLS`` when an agent is made, so only the
children get it (this process makes no agent): over tcp a read is really in flight after it is
posted.  The prefill is gated (a chunk runs when the test says ``next``), so a kill lands
mid-stream on purpose rather than by luck.  This process computes what the ranks must end with:
the same model and chunking in one process (the toy model is deterministic), page for page.

- The prefill SIGKILLed mid-stream: the fetch fails typed (``PeerLost`` or ``TransferTimeout``)
  before its deadline with a page-aligned bound past the first chunk and short of the prompt, every
  page below it holding exactly the bytes prefill computed; a fresh prefill lends the prompt again
  and the decode resumes from the bound into the same pages, reading only the rest; the tokens it
  then generates equal ``generate_reference`` token for token.
- The decode SIGKILLed mid-stream: the prefill's page locks (every extension's) drop to 0 within
  TTL + heartbeat + a few seconds while it goes on prefilling; extends past the expiry raise a
  typed error and lock nothing.
- The happy path: the bound advances chunk by chunk, never backwards, and reaches the prompt's
  length only after the final extension; the tokens equal the reference.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import tempfile
import time

import numpy as np
import pytest

from kvlend.demo import toy_engine
from kvlend.security.certs import save_rank
from tests.support.certs import creds
from tests.support.children import child_env, support_module
from tests.support.progressive_rank import MARK

pytestmark = pytest.mark.system


PROMPT_LEN = 2008  # 125.5 pages of 16 tokens: the last page is partial
CHUNK = 256  # 16 pages: every non-final extension ends on a page boundary
NEW_TOKENS = 8
SEED = 0
DEADLINE = 20.0  # the decode's transfer_timeout, and the longest any single wait here lasts
BOOT = 60.0  # a child imports torch and makes a NIXL agent (seconds on a loaded 2-core host)
GRACE = 2.0  # the ranks' cancel_grace
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


class Rank:
    """A ``tests.support.progressive_rank`` child in its own session: JSON events on stdout, commands on stdin.

    Every event read is kept in ``events``; its stderr goes to a file shown when a wait fails.
    ``kill`` SIGKILLs its whole process group.
    """

    def __init__(self, workdir: str, identity: str, mode: str, *args: str) -> None:
        self.name = identity
        self._certs = tempfile.mkdtemp(prefix=f"certs-{identity}-", dir=workdir)
        self.stderr_path = os.path.join(workdir, f"{identity}.stderr")
        env = child_env(**save_rank(creds(identity, mode), self._certs))  # the mode is the role
        env["UCX_TLS"] = TCP["UCX_TLS"]  # whatever this process has: the reads must really be in flight
        env.setdefault("UCX_NET_DEVICES", TCP["UCX_NET_DEVICES"])
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                support_module("progressive_rank", mode, *args),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, bufsize=0, env=env,
                start_new_session=True,
            )
        self.events: list[dict] = []
        self.noise: list[str] = []  # other lines on its stdout
        self._buf = b""

    def _tail(self) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                return f.read()[-3000:].decode(errors="replace")
        except OSError:
            return ""

    def line(self, timeout: float) -> str:
        end = time.monotonic() + timeout
        while b"\n" not in self._buf:
            remaining = end - time.monotonic()
            if remaining <= 0 or not select.select([self.proc.stdout], [], [], remaining)[0]:
                raise AssertionError(f"{self.name} said nothing within {timeout:.3g} s; stderr:\n{self._tail()}")
            data = os.read(self.proc.stdout.fileno(), 65536)
            if not data:
                raise AssertionError(f"{self.name} exited (rc {self.proc.wait(DEADLINE)}); stderr:\n{self._tail()}")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def wait(self, pred, timeout: float, what: str) -> dict:
        """The first event from now on for which ``pred`` holds (every event read is kept)."""
        end = time.monotonic() + timeout
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{self.name}: no {what} within {timeout:.3g} s; last events "
                                     f"{self.events[-5:]}; stderr:\n{self._tail()}")
            try:
                line = self.line(remaining)
            except AssertionError as exc:
                raise AssertionError(f"{self.name}: waiting for {what}: {exc}") from None
            if not line.startswith(MARK):
                if line.strip() and len(self.noise) < 200:
                    self.noise.append(line)  # UCX writes to stdout too
                continue
            event = json.JSONDecoder().raw_decode(line[len(MARK):])[0]
            self.events.append(event)
            if pred(event):
                return event

    def seen(self, want: str, timeout: float = DEADLINE) -> dict:
        """The first ``want`` event already read, else the next one."""
        for event in self.events:
            if event["ev"] == want:
                return event
        return self.event(want, timeout)

    def event(self, want: str, timeout: float = DEADLINE) -> dict:
        return self.wait(lambda e: e["ev"] == want, timeout, f"{want!r} event")

    def bound_at_least(self, tokens: int, timeout: float = DEADLINE) -> dict:
        return self.wait(lambda e: e["ev"] == "bound" and e["bound"] >= tokens, timeout, f"bound >= {tokens}")

    def send(self, text: str) -> None:
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def exited(self, timeout: float) -> int:
        """Wait for a clean exit, reading (and keeping) its last events."""
        end = time.monotonic() + timeout
        try:
            while True:
                self.wait(lambda e: False, max(0.0, end - time.monotonic()), "exit")
        except AssertionError:
            pass
        return self.proc.wait(max(0.1, end - time.monotonic()))

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(DEADLINE)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait
            pass
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


@pytest.fixture
def spawn(tmp_path):
    """Start ranks; every one is SIGKILLed (its process group) when the test ends, however it ends."""
    ranks: list[Rank] = []

    def start(identity: str, mode: str, *args: str) -> Rank:
        rank = Rank(str(tmp_path), identity, mode, *args)
        ranks.append(rank)
        return rank

    try:
        yield start
    finally:
        for rank in ranks:
            rank.kill()


@pytest.fixture(scope="module")
def reference():
    """What the ranks must end with, computed here: the prompt's pages after the same chunked prefill,
    the KV digest, and ``generate_reference``'s tokens."""
    cfg = toy_engine.preset("tiny", seed=SEED)
    model = toy_engine.ToyModel(cfg)
    prompt = toy_engine.make_prompts(1, SEED, PROMPT_LEN, PROMPT_LEN, cfg.vocab)[0]
    cache = toy_engine.PagedKVCache(cfg, -(-PROMPT_LEN // cfg.tokens_per_page), seed=5)
    table, first = toy_engine.prefill(model, cache, prompt, None, CHUNK)
    tokens = toy_engine.generate_reference(model, prompt, NEW_TOKENS, chunk=CHUNK)
    assert tokens[0] == first
    return {
        "cfg": cfg, "cache": cache, "table": table, "tokens": tokens,
        "digest": toy_engine.kv_digest(cache, table, PROMPT_LEN),
        "lease_bytes": toy_engine.lent_bytes(cache.layout(), PROMPT_LEN),
        "page_bytes": sum(cache.page_view(layer).shape[1] for layer in range(len(cache.tensors))),
    }


def rank_args(gen: int, *extra: str, ttl: float = 5.0, heartbeat: float = 0.5) -> tuple[str, ...]:
    return ("--gen", str(gen), "--seed", str(SEED), "--prompt-len", str(PROMPT_LEN), "--chunk", str(CHUNK),
            "--new-tokens", str(NEW_TOKENS), "--ttl", str(ttl), "--heartbeat", str(heartbeat),
            "--deadline", str(DEADLINE), "--cancel-grace", str(GRACE), *extra)


CHUNKS = -(-PROMPT_LEN // CHUNK)  # 8: the first lent with the ticket, 7 extensions


def lend_first_chunk(prefill: Rank, decode: Rank) -> dict:
    """Once both ranks serve, the gated prefill runs its first chunk and lends it: the ticket's TTL
    starts with the decode ready to redeem it at once."""
    prefill.event("ready", BOOT)
    decode.event("ready", BOOT)
    prefill.send("next")
    ticket = prefill.event("ticket")
    assert ticket["ready"] == CHUNK
    decode.send("fetch " + ticket["ticket"])
    return ticket


def pages_below(ref, bound: int) -> np.ndarray:
    cache, tpp = ref["cache"], ref["cfg"].tokens_per_page
    rows = ref["table"][: bound // tpp]
    return np.stack([cache.page_view(layer)[rows] for layer in range(len(cache.tensors))])


# ----------------------------------------------------------- prefill killed mid-stream
def test_prefill_killed_mid_stream_fails_typed_at_a_verified_bound_and_a_resume_matches_the_reference(
        spawn, reference, tmp_path):
    tpp = reference["cfg"].tokens_per_page
    dump = str(tmp_path / "below.npy")
    first = spawn("prog-prefill1", "prefill", *rank_args(1, "--gated"))
    decode = spawn("prog-decode", "decode", *rank_args(0, "--dump", dump))
    lend_first_chunk(first, decode)
    decode.bound_at_least(CHUNK)  # the first chunk was read (and surely valid) while prefill waits
    for _ in range(3):  # three more chunks; the kill follows the third extension at once: its reads may be in flight
        first.send("next")
        extended = first.event("extended")
    assert not extended["final"] and extended["ready"] == 4 * CHUNK
    seen = max(e["bound"] for e in decode.events if e["ev"] == "bound")
    killed = time.monotonic()  # before the signal: kill() also waits for the process to go
    first.kill()

    failed = decode.event("failed", DEADLINE + GRACE + 5.0)
    noticed = failed["t"] - killed  # CLOCK_MONOTONIC: one clock for every process on the host
    assert noticed >= 0, f"the fetch failed {-noticed:.3f} s before the prefill was killed: {failed}"
    bound = failed["bound"]
    assert failed["kind"] in ("PeerLost", "TransferTimeout") and failed["typed"], failed
    assert failed["elapsed"] < DEADLINE, f"the fetch failed only after its deadline: {failed}"
    assert failed["request"] == "prog-0" and failed["quiet"], failed
    assert failed["handle_bound"] == bound, failed
    assert 0 < bound < PROMPT_LEN and bound % tpp == 0, bound
    assert seen <= bound <= extended["ready"], (seen, bound, extended)  # never behind what it reported
    got = np.load(dump)
    want = pages_below(reference, bound)
    assert got.shape == want.shape, (got.shape, want.shape)
    bad = [p for p in range(want.shape[1]) if not np.array_equal(got[:, p], want[:, p])]
    assert not bad, f"pages {bad[:8]} below the bound {bound} differ from what prefill computed"
    print(f"\nprefill killed after its extension to {extended['ready']} tokens: the fetch failed "
          f"{failed['kind']} {noticed * 1e3:.0f} ms later at bound {bound}/{PROMPT_LEN}; {bound // tpp} pages verified")

    # A fresh prefill prefills the prompt again (its pages elsewhere), lending it progressively; the
    # decode resumes into the same destination from the bound, reading only the rest.
    second = spawn("prog-prefill2", "prefill", *rank_args(2))
    again = second.event("ticket", BOOT)
    decode.send("resume " + again["ticket"])
    fetched = decode.event("fetched", DEADLINE + 5.0)
    assert fetched["resumed_from"] == bound and fetched["bound"] == PROMPT_LEN, fetched
    pages_left = -(-PROMPT_LEN // tpp) - bound // tpp
    assert fetched["bytes"] == pages_left * reference["page_bytes"], fetched
    assert fetched["bytes"] < reference["lease_bytes"], (fetched["bytes"], reference["lease_bytes"])
    assert fetched["below_unchanged"] is True, "the resume rewrote pages below its bound"
    assert fetched["meta"].get("first") == reference["tokens"][0], fetched["meta"]
    bounds = [b for _, b in fetched["bounds"]]
    assert bounds == sorted(bounds) and bounds[0] >= bound, bounds
    out = decode.event("tokens")
    assert out["digest"] == reference["digest"], "the prompt's KV differs from a one-process prefill"
    assert out["tokens"] == reference["tokens"], (out["tokens"], reference["tokens"])
    print(f"resume read {pages_left} of {-(-PROMPT_LEN // tpp)} pages ({fetched['bytes']} of "
          f"{reference['lease_bytes']} bytes); {NEW_TOKENS} tokens equal the reference")


# ----------------------------------------------------------- decode killed mid-stream
def test_decode_killed_mid_stream_the_prefill_drops_every_extensions_locks_within_ttl_and_keeps_prefilling(
        spawn, reference):
    ttl, beat = 2.0, 0.5
    prefill = spawn("prog-prefill3", "prefill", *rank_args(3, "--gated", ttl=ttl, heartbeat=beat))
    decode = spawn("prog-decode3", "decode", *rank_args(3, ttl=ttl, heartbeat=beat))
    lend_first_chunk(prefill, decode)
    decode.bound_at_least(CHUNK)
    prefill.send("next")
    prefill.event("extended")
    decode.bound_at_least(2 * CHUNK)  # the decode is reading the stream as it grows
    prefill.send("next")
    prefill.event("extended")
    locked = [e for e in prefill.events if e["ev"] == "locks"]
    assert locked and locked[-1]["locked"] > 0
    killed = time.monotonic()  # before the signal: kill() also waits for the process to go
    decode.kill()

    # The engine goes on: an extension while the lease still lives succeeds (its reader is dead)...
    prefill.send("next")
    after = prefill.wait(lambda e: e["ev"] in ("extended", "extend_failed"), DEADLINE, "the extension after the kill")
    assert after["ev"] == "extended" and after["ready"] == 4 * CHUNK, after
    # ...and every extension's locks drop once the TTL passes with no heartbeat.
    limit = ttl + beat + 3.0
    zero = prefill.wait(lambda e: e["ev"] == "locks" and e["locked"] == 0, max(0.1, killed + limit - time.monotonic()),
                        f"locks dropping to 0 within ttl {ttl} + heartbeat {beat} + 3 s of the kill")
    freed = zero["t"] - killed  # CLOCK_MONOTONIC: one clock for every process on the host
    assert 0 < freed <= limit, freed
    peak = max(e["locked"] for e in prefill.events if e["ev"] == "locks")
    assert peak > locked[-1]["locked"], "the extension after the kill locked nothing"  # it too was dropped
    released = prefill.seen("released", 5.0)  # reported on the loop turn that saw the locks go
    assert released["request"] == "prog-0" and released["reason"] == "expired", released

    # Prefill finishes: every later extend is refused, typed, and locks nothing.
    prefill.send("rest")
    done = prefill.event("prefill_done")
    assert done["chunks"] == CHUNKS and done["extended"] == 3, done
    failures = [e for e in prefill.events if e["ev"] == "extend_failed"]
    assert len(failures) == CHUNKS - 4 and all(e["typed"] for e in failures), failures
    assert {e["kind"] for e in failures} <= {"LeaseExpired", "LeaseUnknown"}, failures
    assert failures[-1]["ready"] == PROMPT_LEN
    prefill.send("stop")
    assert prefill.exited(DEADLINE) == 0
    history = [e["locked"] for e in prefill.events if e["ev"] == "locks"]  # 0 before the lend, then growing
    freed_at = history.index(0, history.index(peak))
    assert history[freed_at:] == [0] * (len(history) - freed_at), f"a refused extend locked pages: {history}"
    print(f"\ndecode killed mid-stream: {peak} locked pages dropped {freed:.2f} s later (ttl {ttl}, heartbeat "
          f"{beat}); {len(failures)} later extends refused {sorted({e['kind'] for e in failures})}")


# ------------------------------------------------------------------- the happy path
def test_a_progressive_fetch_over_tcp_advances_chunk_by_chunk_and_completes_only_after_the_final_extension(
        spawn, reference):
    tpp = reference["cfg"].tokens_per_page
    prefill = spawn("prog-prefill4", "prefill", *rank_args(4, "--gated"))
    decode = spawn("prog-decode4", "decode", *rank_args(4))
    ready, extensions = lend_first_chunk(prefill, decode)["ready"], []
    for _ in range(1, CHUNKS):
        decode.bound_at_least(ready // tpp * tpp)  # this chunk read before the next runs
        prefill.send("next")
        extensions.append(prefill.event("extended"))
        ready = extensions[-1]["ready"]
    assert ready == PROMPT_LEN and extensions[-1]["final"] and not any(e["final"] for e in extensions[:-1])
    fetched = decode.event("fetched", DEADLINE)
    assert fetched["bound"] == PROMPT_LEN and fetched["resumed_from"] == 0, fetched
    assert fetched["bytes"] == reference["lease_bytes"], fetched
    final_at = extensions[-1]["t"]
    bounds = fetched["bounds"]
    values = [b for _, b in bounds]
    assert values == sorted(values), f"the bound went backwards: {values}"
    assert {k * CHUNK for k in range(1, CHUNKS)} <= set(values), values  # one step per chunk
    early = [(t, b) for t, b in bounds if b == PROMPT_LEN and t < final_at]
    assert not early, f"the bound reached {PROMPT_LEN} before the final extension at {final_at}: {early}"
    assert all(b < PROMPT_LEN for t, b in bounds if t < final_at)
    out = decode.event("tokens")
    assert out["digest"] == reference["digest"]
    assert out["tokens"] == reference["tokens"], (out["tokens"], reference["tokens"])
    print(f"\nbound over the stream: {sorted(set(values))}; {NEW_TOKENS} tokens equal the reference")
