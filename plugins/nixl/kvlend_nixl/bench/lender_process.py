"""The lender process: it owns the source pools and a NIXL agent in a process of its own (started
with multiprocessing ``spawn``) and answers the reader's commands over a pipe."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import time

import numpy as np

from kvlend.core.layout import PageLayout
from kvlend.errors import KvlendError

from ..backend import NixlBackend
from ..nixl_build import api
from .peer_engine import PeerEngine
from .pools import GROUP, TPP, descriptor_rows, host_region, make_pools
from .timing import CALL_TIMEOUT, XFER_TIMEOUT, BenchError


def lender_main(conn) -> None:
    """The lender process: owns source pools, answers commands, keeps its agent progressed."""
    backend = NixlBackend(f"bench-lender-{os.getpid()}", timeout=XFER_TIMEOUT)
    agent = backend._agent  # raw NIXL: the target is progressed, and acts on notifications as NixlConnector's
    arrays: list[np.ndarray] = []
    layout: PageLayout | None = None
    staging = np.zeros(0, np.uint8)
    spin = False
    engine = PeerEngine()  # the raw baseline's target: NixlConnector's work per notification
    counted = (0, 0, 0)  # the engine's notifications, requests freed and unknown at the last "notifs"
    cold: list = []  # scenario 4 objects, kept alive until quit
    streamer = None  # scenario 6's PrefillNode
    ticketing: list = []  # scenario 7's PrefillNodes, closed on "close_nodes"
    try:
        while True:
            if conn.poll(0 if spin else 0.0005):
                cmd, arg = conn.recv()
                if cmd == "quit":
                    break
                if cmd == "pools":
                    backend.deregister()
                    arrays = staging = None
                    arrays, layout = make_pools(arg["pages"], arg["layers"], arg["combined"], fill=True)
                    staging = np.zeros(max(arg["staging"], 1), np.uint8)
                    backend.register(list(layout.regions) + [host_region(staging, "staging")])
                    conn.send((layout.encode(), backend.metadata(), staging.ctypes.data))
                elif cmd == "gather":  # host staging baseline: copy the lent pages into one buffer
                    start = time.perf_counter()
                    offset = 0
                    for a in arrays:
                        n = len(arg) * a[0].nbytes
                        out = staging[offset:offset + n].view(a.dtype).reshape((len(arg),) + a.shape[1:])
                        np.take(a, arg, axis=0, out=out)
                        offset += n
                    conn.send(time.perf_counter() - start)
                elif cmd == "tickets":  # scenario 3 through the node: lend the current pools' pages, ticket each
                    cold.append(_ticket_prefill(layout, arg))
                    conn.send(cold[-1][1])
                elif cmd == "node_tickets":  # scenario 7: one more PrefillNode, kept until "close_nodes"
                    ticketing.append(_ticket_prefill(layout, arg))
                    conn.send(ticketing[-1][1])
                elif cmd == "close_nodes":
                    while ticketing:
                        ticketing.pop()[0].close()
                    conn.send(True)
                elif cmd == "stream":  # scenario 6: chunked prefill of one prompt, lent as it goes or at the end
                    if streamer is None:
                        streamer = _stream_prefill(layout, arg)
                        cold.append((streamer,))
                    _stream(streamer, layout, arg, conn)
                elif cmd == "prefill":  # scenario 4: a PrefillNode that offers one lease to its first peer
                    cold.append(_cold_prefill(arg))
                    conn.send(cold[-1][0].address)
                elif cmd == "listener":  # scenario 4 baseline: a raw agent behind NIXL's own listener
                    cold.append(_cold_listener(arg))
                    conn.send(cold[-1][1])
                elif cmd == "spin":
                    spin = bool(arg)
                    conn.send(True)
                elif cmd == "expect":  # the raw baseline's requests, (name, blocks) each, before they are read
                    engine.expect(arg)
                    conn.send(True)
                elif cmd == "notifs":  # seen, freed, unknown since the last call, waiting up to 2 s for ``arg`` seen
                    deadline = time.monotonic() + 2.0
                    while engine.notifications - counted[0] < (arg or 0) and time.monotonic() < deadline:
                        engine.step(agent)
                    now = (engine.notifications, engine.freed, engine.unknown)
                    conn.send({k: a - b for k, a, b in zip(("seen", "freed", "unknown"), now, counted)})
                    counted = now
            engine.step(agent)
    finally:
        for obj in cold + ticketing:
            obj[0].close()
        backend.close()


_NODES = itertools.count()  # agent names: several nodes may live in one lender process


def _ticket_prefill(layout: PageLayout, arg: dict):
    """A started PrefillNode over the lender's current pools, and a ticket for each source table in
    ``arg['requests']`` (locks stack: pages lent by several tickets are locked once per ticket)."""
    from kvlend.runtime import PrefillNode
    from kvlend.security.credentials import Credentials

    node = PrefillNode(layout, NixlBackend(f"bench-node-{os.getpid()}-{next(_NODES)}"),
                       Credentials.from_env(arg["credentials"]))
    node.start()
    selection = layout.full_selection()
    tickets = [node.lend(f"node-{i}", len(src) * TPP, {GROUP: src}, selection).to_text()
               for i, src in enumerate(arg["requests"])]
    return node, tickets


def _stream_prefill(layout: PageLayout, arg: dict):
    """Scenario 6's PrefillNode over the lender's current pools."""
    from kvlend.runtime import PrefillNode
    from kvlend.security.credentials import Credentials

    node = PrefillNode(layout, NixlBackend(f"bench-stream-{os.getpid()}", timeout=XFER_TIMEOUT),
                       Credentials.from_env(arg["credentials"]))
    node.start()
    return node


def _stream(node, layout: PageLayout, arg: dict, conn) -> None:
    """One prompt's chunked prefill, each chunk's compute simulated by a sleep (a GPU's time, which
    leaves the CPU free).  Progressive: lend after the first chunk and send the ticket at once, extend
    after each later chunk; otherwise lend once the last chunk is done.  Sends ("ticket", text), then
    ("last", wall time the last chunk finished)."""
    pages, chunk = arg["pages"], arg["chunk_pages"]
    src = {GROUP: np.arange(pages, dtype=np.int64)}
    tokens, lease = pages * TPP, None
    for done in range(chunk, pages + chunk, chunk):
        time.sleep(arg["compute_s"])
        ready = min(done, pages) * TPP
        if ready == tokens:
            last = time.time()
        if lease is not None:
            node.extend(lease, ready, src)
        elif arg["progressive"] or ready == tokens:
            ticket = node.lend(f"stream-{arg['round']}", tokens, src, layout.full_selection(), ready=ready)
            lease = ticket.lease
            conn.send(("ticket", ticket.to_text()))
    conn.send(("last", last))


def _cold_prefill(arg: dict):
    """A PrefillNode on its own agent; a thread offers ``arg['pages']`` pages once a decode connects."""
    import threading

    from kvlend.runtime import PrefillNode
    from kvlend.security.credentials import Credentials

    arrays, layout = make_pools(arg["pages"], 1, False, fill=True)
    node = PrefillNode(layout, NixlBackend(f"cold-prefill-{os.getpid()}"), Credentials.from_env(arg["credentials"]))
    node.start()

    def offer() -> None:
        try:
            peer = node.wait_for_peer(30.0)
            node.offer(peer, "cold", arg["pages"] * TPP, {GROUP: np.arange(arg["pages"])}, layout.full_selection())
        except KvlendError:
            pass  # the decode side times out and reports it

    threading.Thread(target=offer, daemon=True).start()
    return node, arrays


class _Closer:
    def __init__(self, fn) -> None:
        self.close = fn


def _cold_listener(arg: dict):
    """A raw NIXL agent with its listener on ``arg['port']`` and one stamped buffer."""
    buf = np.arange(arg["bytes"] // 8, dtype=np.uint64)
    agent = api.nixl_agent("cold-listener", api.nixl_agent_config(enable_listen_thread=True, listen_port=arg["port"]))
    reg = agent.register_memory(descriptor_rows(np.array([buf.ctypes.data]), np.array([buf.nbytes])), "DRAM")
    return _Closer(lambda: (agent.deregister_memory(reg), buf)), (agent.name, buf.ctypes.data)


class LenderProcess:
    """The lender process and its pipe; always terminated on exit."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=lender_main, args=(child,), daemon=True, name="kvlend-bench-lender")
        self.proc.start()
        child.close()

    def call(self, cmd: str, arg=None, timeout: float = CALL_TIMEOUT):
        try:
            self.conn.send((cmd, arg))
            deadline = time.monotonic() + timeout
            while not self.conn.poll(0.05):
                if not self.proc.is_alive():
                    raise BenchError(f"lender process died (exit code {self.proc.exitcode}) during {cmd!r}")
                if time.monotonic() > deadline:
                    raise BenchError(f"lender did not answer {cmd!r} within {timeout:g} s")
            return self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
            raise BenchError(f"lender pipe closed during {cmd!r}: {exc}") from None

    def receive(self, what: str, timeout: float = CALL_TIMEOUT):
        """The next message the lender sends on its own (a command answered in several parts)."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.01):
            if not self.proc.is_alive():
                raise BenchError(f"lender process died (exit code {self.proc.exitcode}) before sending {what}")
            if time.monotonic() > deadline:
                raise BenchError(f"lender sent no {what} within {timeout:g} s")
        kind, value = self.conn.recv()
        if kind != what:
            raise BenchError(f"lender sent {kind!r}, expected {what!r}")
        return value

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("quit", None))
                self.proc.join(5)
        except (OSError, ValueError):
            pass
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
