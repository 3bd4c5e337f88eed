"""The ranks of ``test_flood_budget``: a prefill engine in a process of its own that times its ``lend()``, and an
authenticated decode (the flooder) in another, flooding it one of four ways.

Imports nothing that loads NIXL at module level (spawned children import it).  The prefill's layout has 4
layers of 512 heads at 1 token per page, so a decode claiming 64 tokens per page costs a negotiation at the
default ``max_pieces`` (4 x K, V x 64 x 512 = 262,144 pieces: about half a second of Python).
"""

from __future__ import annotations

import logging
import multiprocessing
import secrets
import socket
import ssl
import tempfile
import threading
import time

import numpy as np

LAYERS, HEADS, PAGES, TOKENS = 4, 512, 256, 40
COSTLY_TPP = 64  # the flooder's tokens per page in a costly handshake (ours: 1)
GAP = 0.002  # seconds between the engine's lends (it lends between its steps)
LENT_DEADLINE = 120.0  # seconds ``lent`` waits for the engine's lends to be done
BURST = 1 << 20  # bytes of frames a flooder writes at once
KINDS = ("claims", "refused_heartbeats", "empty_heartbeats", "costly_handshakes")


def queued() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux schedstat): what a busy host's
    other processes took from it, not what the node's locks and loop did."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def pools(pages: int, tpp: int = 1) -> list[np.ndarray]:
    return [np.zeros((pages, 2, HEADS, tpp, 1), dtype=np.uint16) for _ in range(LAYERS)]


def layout(p: list[np.ndarray]):
    from kvlend.core.layout import layout_from_pools

    return layout_from_pools(kv=p, kept_window=1 << 20)


def table(lay) -> dict[str, np.ndarray]:
    return {name: np.arange(TOKENS) for name in lay.groups}


def rank_env(ca, identity: str, role: str, directory: str) -> dict[str, str]:
    from kvlend.security.certs import save_rank

    return save_rank(ca.issue(identity, role), directory)


# ------------------------------------------------------------------ prefill
class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def prefill_main(conn, env: dict) -> None:
    """Serve until ``stop``: ``tickets`` lends that many leases for the honest decode; ``lend`` starts the engine
    lending (and releasing) every ``GAP`` s that many times, ``lent`` waits for those (``LENT_DEADLINE`` at most)
    and answers each lend's seconds, less those its thread waited for a CPU (``queued``); ``logs`` answers
    the ``kvlend.session`` lines (INFO and up) since the last ``logs``."""
    from kvlend.runtime import PrefillNode
    from kvlend.security.credentials import Credentials
    from kvlend.transport import load_backend

    lines = _Lines()
    session_log = logging.getLogger("kvlend.session")
    session_log.setLevel(logging.INFO)
    session_log.addHandler(lines)
    lay = layout(pools(PAGES))
    node = PrefillNode(lay, load_backend("nixl", name=f"flood-prefill-{secrets.token_hex(4)}"),
                       Credentials.from_env(env))
    node.start()
    conn.send(node.address)
    pages = table(lay)
    stop, took, engine = threading.Event(), [], None

    def lend(count: int) -> None:
        i = 0
        while i < count and not stop.is_set():
            i += 1
            start, waited = time.perf_counter(), queued()
            ticket = node.lend(f"engine-{i}", TOKENS, pages, lay.full_selection())
            took.append(time.perf_counter() - start - (queued() - waited))
            node.release(ticket.lease)
            time.sleep(GAP)

    try:
        while conn.poll(120.0):
            command, *args = conn.recv()
            if command == "stop":
                return
            if command == "tickets":
                conn.send([node.lend(f"honest-{secrets.token_hex(4)}", TOKENS, pages, lay.full_selection()).to_text()
                           for _ in range(args[0])])
            elif command == "lend":
                stop.clear()
                took.clear()
                engine = threading.Thread(target=lend, args=(args[0],), daemon=True)
                engine.start()
                conn.send("lending")
            elif command == "lent":
                engine.join(LENT_DEADLINE)
                stop.set()
                engine.join(30.0)
                conn.send(list(took))
            elif command == "logs":
                conn.send(list(lines.lines))
                lines.lines.clear()
    finally:
        node.close()
        node.backend.close()


# ------------------------------------------------------------------ flooder
def flood_main(address, env: dict, kind: str, stop, accepted, report) -> None:
    """Flood the prefill at ``address`` as ``kind`` says until ``stop`` is set, reconnecting whenever dropped or
    refused; ``accepted`` counts handshakes the prefill answered.  Sends the outcome counts on ``report``.

    It runs at the lowest CPU priority: in a cluster a flooder runs on a host of its own, so what the test's
    ratios measure is what its messages cost the prefill, not what its own loop takes from a shared CPU."""
    import os

    from kvlend.security.credentials import Credentials

    os.nice(19)

    counts = {"connections": 0, "accepted": 0, "refused": 0, "dropped": 0, "bursts": 0}
    try:
        credentials = Credentials.from_env(env)
        honest, costly = layout(pools(2)), layout(pools(2, COSTLY_TPP))
        while not stop.is_set():
            counts["connections"] += 1
            raw = _connect(address, credentials, costly if kind == "costly_handshakes" else honest)
            if raw is None:
                counts["refused"] += 1
                continue
            counts["accepted"] += 1
            with accepted.get_lock():
                accepted.value += 1
            with raw:
                if kind != "costly_handshakes":  # that one reconnects at once
                    bursts = _flood(raw, kind, stop)
                    counts["bursts"] += bursts
                    counts["dropped"] += not stop.is_set()
    except Exception as exc:  # the test shows it
        counts["crash"] = f"{type(exc).__name__}: {exc}"
    report.send(counts)


def _connect(address, credentials, lay):
    """A handshake with ``lay``: the ``RawDecode`` if the prefill answered with its own, None if it refused."""
    from kvlend.errors import KvlendError
    from kvlend.protocol.wire import Handshake

    from .raw_peer import RawDecode

    try:
        raw = RawDecode(address, credentials)
    except (KvlendError, OSError):
        return None
    try:
        raw.send(Handshake(lay.encode(), "nixl", b"flooder"))
        if isinstance(raw.recv(30.0), Handshake):
            return raw
    except (KvlendError, OSError):
        pass
    raw.sock.close()
    return None


def _flood(raw, kind: str, stop) -> int:
    """Write ``kind``'s bursts until the prefill drops us or ``stop``; the bursts written."""
    from kvlend.protocol.connection import Connection
    from kvlend.protocol.wire import Claim, Heartbeat

    frames = Connection(time.monotonic())
    frames.authenticate(raw.peer)
    if kind == "refused_heartbeats":  # the quiet variant: claim a few ids nobody lent, then name them
        ids = tuple(secrets.token_bytes(16) for _ in range(8))
        raw.send(*(Claim(i) for i in ids))
        message = Heartbeat(ids)
    else:
        message = Claim(secrets.token_bytes(16)) if kind == "claims" else Heartbeat(())
    frames.send(message)
    frame = frames.data_to_send()
    burst = frame * (BURST // len(frame))
    raw.sock.settimeout(0.2)
    bursts = 0
    while not stop.is_set():
        if kind == "claims":  # a new id each time: the ids of a burst repeat, which costs the prefill the same
            burst = _claims(frames)
        if not _write(raw.sock, burst, stop):
            return bursts
        bursts += 1
    return bursts


def _claims(frames) -> bytes:
    from kvlend.protocol.wire import Claim

    one = Claim(secrets.token_bytes(16))
    frames.send(one)
    frame = frames.data_to_send()
    return frame * (BURST // len(frame))


def _write(sock, data: bytes, stop) -> bool:
    """Write all of ``data`` unless ``stop``; False once the prefill hung up."""
    view = memoryview(data)
    while view and not stop.is_set():
        try:
            view = view[sock.send(view[: 1 << 16]):]
        except (socket.timeout, ssl.SSLWantWriteError):
            continue
        except OSError:
            return False
    return True


# ------------------------------------------------------------------ driver
class Ranks:
    """The prefill process and, on demand, a flooder process, with certificates from ``ca``."""

    def __init__(self, ca) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.ca = ca
        self.dir = tempfile.TemporaryDirectory(prefix="kvlend-flood-")
        self.conn, child = self.ctx.Pipe()
        env = rank_env(ca, "prefill", "prefill", self.dir.name)
        self.proc = self.ctx.Process(target=prefill_main, args=(child, env), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60.0):
            raise TimeoutError("the prefill did not start")
        self.address = self.conn.recv()

    def ask(self, *command, timeout: float = 60.0):
        self.conn.send(command)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the prefill did not answer {command[0]}")
        return self.conn.recv()

    def flooder(self, kind: str) -> Flooder:
        return Flooder(self, kind)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(15.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
        self.dir.cleanup()


class Flooder:
    """A flooder process as ``identity`` ``flood-<kind>``; ``stop`` ends it and returns its counts."""

    def __init__(self, ranks: Ranks, kind: str) -> None:
        self.stop_event = ranks.ctx.Event()
        self.accepted = ranks.ctx.Value("i", 0)
        self.report, child = ranks.ctx.Pipe()
        env = rank_env(ranks.ca, f"flood-{kind}", "decode", ranks.dir.name)
        self.proc = ranks.ctx.Process(target=flood_main, daemon=True,
                                      args=(ranks.address, env, kind, self.stop_event, self.accepted, child))
        self.proc.start()
        child.close()

    def stop(self) -> dict:
        self.stop_event.set()
        try:
            counts = self.report.recv() if self.report.poll(30.0) else {"crash": "no report"}
        finally:
            self.proc.join(10.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5.0)
        return counts
