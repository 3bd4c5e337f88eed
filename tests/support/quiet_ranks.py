"""The two ranks of ``test_quiet_fetch``: spawned processes that run over ``UCX_TLS=tcp``.

Imports nothing that loads NIXL at module level, so a spawned child can set
``UCX_TLS`` before its first agent exists.  A lent token page ``t`` holds
``page_words(t)`` wherever a prefill placed it, so a restarted prefill lends
the same bytes from other slots and the decode can check any page.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import time

import numpy as np

PAGES = 1024  # token pages of 4 tokens: 128 MiB, a few hundred ms over tcp on a 2-vCPU host
HEADS, HEAD_DIM, TPP = 16, 256, 4
TOKENS = PAGES * TPP
SENTINEL = 0xA5
REUSED = np.uint64(0xDEAD)  # what a prefill engine writes into pages it got back
WATCH = 0.3  # seconds the destination must stay unchanged after a fetch reports quiet


def pools(num_pages: int = PAGES) -> list[np.ndarray]:
    return [np.zeros((num_pages, 2, HEADS, TPP, HEAD_DIM), dtype=np.uint16)]


def layout(p: list[np.ndarray]):
    from kvlend.core.layout import layout_from_pools

    return layout_from_pools(kv=p, kept_window=1 << 20)


def page_words(token_pages: np.ndarray, words: int) -> np.ndarray:
    """What token pages hold: distinct uint64 words, cheap to make and to check."""
    base = token_pages.astype(np.uint64)[:, None] * np.uint64(words) + np.arange(words, dtype=np.uint64)[None, :]
    return base * np.uint64(0x9E3779B97F4A7C15) + np.uint64(12345)


def as_words(pool: np.ndarray) -> np.ndarray:
    return pool.view(np.uint64).reshape(pool.shape[0], -1)


# ------------------------------------------------------------------ prefill
def prefill_main(conn, credentials: dict, gen: int) -> None:
    """Serve one pool until ``stop``: ``lend`` answers a ticket's text, ``offer`` pushes a lease to the decode.

    ``release`` releases the last lease as an engine cancelling its request would, and reuses its
    pages (overwrites them with ``REUSED``) the moment ``on_release`` says it may; ``ended`` answers
    with the (request, reason, seconds after the release) of every lease that ended since.
    ``credentials`` is the environment naming this rank's files (``save_rank``).
    """
    from kvlend.runtime import PrefillNode
    from kvlend.security.credentials import Credentials
    from kvlend.transport import load_backend

    p = pools()
    lay = layout(p)
    slot_of = np.random.default_rng(gen).permutation(PAGES)  # token page t lives in slot slot_of[t]
    view = as_words(p[0])
    view[slot_of] = page_words(np.arange(PAGES), view.shape[1])
    ended: list[tuple[str, str, float | None]] = []
    released: dict[bytes, float] = {}  # lease id -> when the engine released it

    def on_release(lease, reason: str) -> None:  # the node's loop thread
        if lease.id in released:
            view[slot_of] = REUSED
        at = released.get(lease.id)
        ended.append((lease.request, reason, None if at is None else time.monotonic() - at))

    node = PrefillNode(lay, load_backend("nixl", name=f"quiet-prefill-{gen}-{os.getpid()}", timeout=60.0),
                       Credentials.from_env(credentials), on_release=on_release)
    node.start()
    conn.send(node.address)
    served, last = 0, None
    try:
        while True:
            if not conn.poll(60.0):
                return
            command = conn.recv()
            if command == "stop":
                return
            if command == "release":
                released[last] = time.monotonic()
                node.release(last)
                conn.send("released")
                continue
            if command == "ended":
                conn.send(list(ended))
                continue
            served += 1
            request = f"req-{gen}-{served}"
            if command == "offer":
                last = node.offer(node.wait_for_peer(30.0), request, TOKENS, {"full": slot_of},
                                  lay.full_selection()).id
                conn.send("offered")
            else:
                ticket = node.lend(request, TOKENS, {"full": slot_of}, lay.full_selection())
                last = ticket.lease
                conn.send(ticket.to_text())
    finally:
        node.close()
        node.backend.close()


class Prefill:
    """A prefill process as the decode side drives it, with a certificate from ``ca`` for ``prefill-<gen>``."""

    def __init__(self, ca, gen: int) -> None:
        from kvlend.security.certs import save_rank

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        with tempfile.TemporaryDirectory(prefix="kvlend-quiet-") as certs:  # read by the time it sends its address
            credentials = save_rank(ca.issue(f"prefill-{gen}", "prefill"), certs)
            self.proc = ctx.Process(target=prefill_main, args=(child, credentials, gen), daemon=True)
            self.proc.start()
            child.close()
            if not self.conn.poll(60.0):
                raise TimeoutError("prefill did not start")
            self.address = self.conn.recv()

    def ticket(self) -> str:
        return self._ask("lend")

    def offer(self) -> None:
        self._ask("offer")

    def release(self) -> None:
        self._ask("release")

    def ended(self) -> list:
        return self._ask("ended")

    def _ask(self, command: str):
        self.conn.send(command)
        if not self.conn.poll(30.0):
            raise TimeoutError(f"prefill did not {command}")
        return self.conn.recv()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10.0)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send("stop")
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10.0)
        if self.proc.is_alive():
            self.kill()


# ------------------------------------------------------------------- decode
def decode_main(conn) -> None:
    """Run both scenarios over tcp and send back one report per scenario."""
    os.environ["UCX_TLS"] = "tcp"  # before any agent exists; the prefills inherit it
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    try:
        conn.send(_scenarios())
    except Exception as exc:  # the test shows what went wrong
        import traceback

        conn.send({"crash": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})


def _scenarios() -> dict:
    from kvlend.runtime import DecodeNode, NodeConfig
    from kvlend.security.certs import Authority
    from kvlend.transport import load_backend

    ca = Authority.create()
    dst = pools()
    view = as_words(dst[0])
    expected = page_words(np.arange(PAGES), view.shape[1])
    table = np.random.default_rng(99).permutation(PAGES)  # decode slot of token page t
    node = DecodeNode(layout(dst), load_backend("nixl", name=f"quiet-decode-{os.getpid()}", timeout=60.0),
                      ca.issue("decode", "decode"), config=NodeConfig(chunk_pages=256, transfer_timeout=30.0))
    node.start()
    reports, prefills = {}, []
    try:
        first = Prefill(ca, 1)
        prefills.append(first)
        node.connect(*first.address)  # a pushed offer: its reads are posted at once, no claim to wait for
        first.offer()
        link, offer = node.next_offer(30.0)
        reports["timeout"] = _fail_then_resume(node, view, table, expected, (offer, link), first,
                                               lambda handle: _past_deadline(node, handle, 0.02), timeout=0.02)
        second = Prefill(ca, 2)
        prefills.append(second)
        # The first prefill, elsewhere in its pool, stands in for the dead one: same bytes, other slots.
        reports["peer_lost"] = _fail_then_resume(node, view, table, expected, second, first,
                                                 lambda handle: _kill_when_reading(node, handle, second), timeout=30.0)
        reports["released"] = _released_under_read(node, view, table, expected, first)  # last: it reuses the pages
    finally:
        node.close()
        node.backend.close()
        for p in prefills:
            p.stop()
    return reports


def _past_deadline(node, handle, timeout: float) -> dict:
    """As the fetch's deadline strikes: its reads must still be in flight for the test to mean anything.

    Over tcp the read window keeps only a window's worth of reads posted, which lands within
    milliseconds of the deadline, so the reads are counted in the last look before the fetch
    left ``reading`` (for ``cancelling``, or ``failed`` where the cancelled reads stopped at once).
    """
    end = time.monotonic() + timeout + 30.0
    before = 0
    while True:
        now = node.backend.in_flight  # read before the state: what a fetch that left "reading" had posted
        state = handle.state.value
        if state not in ("claiming", "reading") or time.monotonic() > end:
            return {"state_after_deadline": state, "reads_in_flight": max(before, now)}
        before = now
        time.sleep(0.0005)


def _kill_when_reading(node, handle, prefill: Prefill) -> dict:
    """SIGKILL the prefill while a read is posted, some 20 ms into the fetch's reads.

    Over tcp the read window posts the next piece once one ended, so the kill waits for a moment
    with one posted rather than striking between two."""
    end = time.monotonic() + 10.0

    def reading() -> bool:
        return handle.state.value == "reading" and node.backend.in_flight > 0

    while not reading() and time.monotonic() < end:
        time.sleep(0.0005)
    time.sleep(0.02)  # let them get going
    while not reading() and time.monotonic() < end:
        time.sleep(0.0005)
    seen = {"state_after_deadline": handle.state.value, "reads_in_flight": node.backend.in_flight}
    prefill.kill()
    return seen


def _fail_then_resume(node, view, table, expected, source, replacement, act, timeout: float) -> dict:
    """Fail a fetch with its reads in flight; watch the destination once quiet; resume into it.

    ``source`` is a prefill (fetch a ticket of it) or a pushed (offer, link).
    """
    view[:] = np.uint64(int.from_bytes(bytes([SENTINEL]) * 8, "little"))
    start = time.monotonic()
    if isinstance(source, Prefill):
        handle = node.start_fetch(source.ticket(), {"full": table}, timeout=timeout)
    else:
        handle = node.start_fetch(source[0], {"full": table}, link=source[1], timeout=timeout)
    seen = act(handle)
    node.wait([handle], 60.0)
    quiet_after = time.monotonic() - start
    error = handle.error
    snapshot = view.copy()
    still_reading = bool((snapshot[table] != expected).any())  # what the failure left unwritten
    time.sleep(WATCH)  # the node's thread keeps progressing NIXL meanwhile
    changed = int((view != snapshot).sum()) * 8
    resumed = node.start_fetch(replacement.ticket(), {"full": table}, resume_from=error.bound if error else 0)
    node.wait([resumed], 60.0)
    return {
        **seen,  # what was in flight when the failure struck
        "error": type(error).__name__ if error else None,
        "quiet": handle.quiet,
        "bound": getattr(error, "bound", None),
        "seconds_to_quiet": quiet_after,
        "left_unwritten": still_reading,
        "changed_after_quiet": changed,
        "resume_error": repr(resumed.error) if resumed.error else None,
        "resumed_from": resumed.result().resumed_from if resumed.ok else None,
        "exact": bool(np.array_equal(view[table], expected)),
    }


class _HeldBack:
    """Holds back what the prefill sends the decode (its Abort, say) until ``deliver``, as a slow network
    would: the decode's reads land meanwhile and count, as they would before the Abort arrived."""

    ENTRIES = ("receive", "deliver")  # how a node hands its session what arrived: bytes, or decoded frames

    def __init__(self, node) -> None:
        self.node = node
        self.stash: list = []  # (entry, its arguments but ``now``)
        self.real = {name: getattr(node.session, name) for name in self.ENTRIES if hasattr(node.session, name)}
        for name in self.real:
            setattr(node.session, name, lambda *args, _name=name: self.stash.append((_name, args[:-1])))

    def deliver(self) -> None:
        with self.node._lock:
            for name, real in self.real.items():
                setattr(self.node.session, name, real)
            for name, args in self.stash:
                self.real[name](*args, self.node.clock())
        self.node._wake()


def _released_under_read(node, view, table, expected, prefill: Prefill) -> dict:
    """The prefill engine releases a pushed lease while its 128 MiB of reads are in flight, and reuses the
    pages once ``on_release`` allows.  Its Abort is held back until every read landed, so every read
    counts for the bound: the bytes under the bound must still be the lent ones."""
    view[:] = np.uint64(int.from_bytes(bytes([SENTINEL]) * 8, "little"))
    prefill.offer()
    link, offer = node.next_offer(30.0)
    end = time.monotonic() + 30.0
    while True:  # a renewal confirmed the offer: its reads count for the bound without the done ack
        with node._lock:
            if offer.id in node.session._links[link.id].sure:
                break
        if time.monotonic() > end:
            raise TimeoutError("the offer was never renewed")
        time.sleep(0.005)
    held = _HeldBack(node)
    handle = node.start_fetch(offer, {"full": table}, link=link)
    while not node.backend.in_flight and time.monotonic() < end:
        time.sleep(0.001)
    in_flight = node.backend.in_flight
    prefill.release()
    in_flight_after = 0  # still reading once the engine released it (over tcp: a window's worth at a time)
    while handle.state.value == "reading" and time.monotonic() < end + 30.0:
        in_flight_after = max(in_flight_after, node.backend.in_flight)
        time.sleep(0.0005)
    state, bound = handle.state.value, handle.bound
    pages = bound // TPP
    reused = int((view[table[:pages]] != expected[:pages]).sum()) * 8
    held.deliver()
    node.wait([handle], 60.0)
    ended = []
    while not ended and time.monotonic() < end + 60.0:
        ended = [e for e in prefill.ended() if e[0] == offer.request]
        time.sleep(0.01)
    return {
        "reads_in_flight": in_flight,
        "reads_in_flight_after_release": in_flight_after,
        "tokens": offer.num_tokens,
        "state_when_landed": state,
        "bound_when_landed": bound,
        "reused_under_bound": reused,  # bytes under the bound that are not the lent ones
        "error": type(handle.error).__name__ if handle.error else None,
        "bound": handle.bound,
        "ended": ended,
    }
