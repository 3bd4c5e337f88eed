"""Non-blocking TCP connections by id, with output buffers: the byte-moving half of the shell (TLS sits above).

Nothing here blocks: a host name is looked up on a worker thread (an IP
literal needs no lookup), connects complete in the background, writes go to
a per-connection buffer drained as the socket takes it, and ``poll`` waits
on every socket at once (``poll(2)``, not ``select``, which fails on
descriptors above 1023, common in a process that also runs UCX and CUDA).
A wake-up pipe lets another thread cut a wait short, and a lookup's worker
wakes the loop when it is done.

A peer that does not read what it is sent is not read either: past
``pause_output`` bytes buffered for it, its input waits in the kernel until
the buffer drains (so a request it pipelines cannot add replies), and past
``max_output`` bytes, or backed up for longer than ``output_timeout`` s, its
connection is dropped.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..errors import ConfigError

READ_BYTES = 1 << 20  # per connection per poll, so one busy peer cannot starve the rest
HANDSHAKE_READ_BYTES = 16 << 10  # ... until it authenticated: a TLS record is at most 16 KiB + 256
LOOKUP_TIMEOUT = 5.0  # seconds a host name lookup may take before its connect fails
MAX_LOOKUPS = 16  # lookups running at once (a thread each, a stuck one included); more fail at once
_IN = select.POLLIN | select.POLLPRI
_BAD = select.POLLERR | select.POLLHUP | select.POLLNVAL


def resolve(host: str, port: int) -> tuple:
    """``host:port``'s first stream address, as ``getaddrinfo`` gives it (blocks: runs on a lookup's thread)."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    connecting: bool = False
    out: bytearray = field(default_factory=bytearray)
    read_bytes: int = HANDSHAKE_READ_BYTES
    backed_up: float | None = None  # since when ``out`` holds more than the pause threshold (not read meanwhile)
    held: bool = False  # what it sent already waits to be handled: leave the rest in the kernel


@dataclass(eq=False)
class _Lookup:
    """A connect waiting for its host name: the worker fills ``info`` or ``error``."""

    conn: int
    host: str
    port: int
    deadline: float
    out: bytearray = field(default_factory=bytearray)  # sent before it is connected
    info: tuple | None = None
    error: str | None = None


class Sockets:
    """Connections keyed by the session's ids; ``poll`` reports what happened to them.

    ``resolve(host, port)`` looks a host name up (``getaddrinfo``'s first stream entry), on a thread of its
    own, at most ``MAX_LOOKUPS`` at once; one taking longer than ``lookup_timeout`` s fails its connect.
    ``pause_output``, ``max_output`` (bytes) and ``output_timeout`` (s) bound what a peer that reads nothing
    costs (None: no bound).
    """

    def __init__(self, resolve: Callable[[str, int], tuple] = resolve, lookup_timeout: float = LOOKUP_TIMEOUT, *,
                 pause_output: int | None = None, max_output: int | None = None,
                 output_timeout: float | None = None) -> None:
        self._conns: dict[int, _Conn] = {}
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()  # a lookup's worker never writes to the pipe as it closes
        self._resolve = resolve
        self._lookup_timeout = lookup_timeout
        self._lookups: dict[int, _Lookup] = {}  # connects waiting for their host name
        self._looked_up: deque[_Lookup] = deque()  # lookups done, appended by their workers
        self._lookup_slots = threading.BoundedSemaphore(MAX_LOOKUPS)
        self._pause_output = math.inf if pause_output is None else pause_output
        self._max_output = math.inf if max_output is None else max_output
        self._output_timeout = math.inf if output_timeout is None else output_timeout
        self._dropped: list[tuple[int, str]] = []  # dropped outside a poll, reported by the next one

    # --------------------------------------------------------------- set-up
    def listen(self, host: str, port: int) -> tuple[str, int]:
        try:
            sock = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        sock.setblocking(False)
        self._listener = sock
        return sock.getsockname()[:2]

    def connect(self, conn: int, host: str, port: int) -> str | None:
        """Start connecting; an error message if it failed at once.

        An IP literal connects now; a host name is looked up on a worker first (``poll`` reports a failed
        or overdue lookup in its closed list), so a slow resolver never holds up the loop.
        """
        try:
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)[0]
        except socket.gaierror:
            return self._look_up(conn, host, port)
        except Exception as exc:  # not only OSError: a name IDNA cannot encode raises UnicodeError
            return f"cannot connect to {host}:{port}: {type(exc).__name__}: {exc}"
        return self._open(conn, host, port, info)

    def _open(self, conn: int, host: str, port: int, info: tuple, out: bytes = b"") -> str | None:
        try:
            family, kind, proto, _, address = info
            sock = socket.socket(family, kind, proto)
        except Exception as exc:
            return f"cannot connect to {host}:{port}: {type(exc).__name__}: {exc}"
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        code = sock.connect_ex(address)
        if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            sock.close()
            return f"cannot connect to {host}:{port}: {os.strerror(code)}"
        self._conns[conn] = _Conn(sock, connecting=True, out=bytearray(out))  # up once poll sees it writable
        return None

    def _look_up(self, conn: int, host: str, port: int) -> str | None:
        if not self._lookup_slots.acquire(blocking=False):
            return f"cannot connect to {host}:{port}: {MAX_LOOKUPS} host name lookups are running already"
        lookup = self._lookups[conn] = _Lookup(conn, host, port, time.monotonic() + self._lookup_timeout)

        def work() -> None:
            try:
                lookup.info = tuple(self._resolve(host, port))
            except Exception as exc:
                lookup.error = f"{type(exc).__name__}: {exc}"
            finally:
                self._lookup_slots.release()
            self._looked_up.append(lookup)
            self.wake()

        threading.Thread(target=work, name=f"kvlend-lookup-{conn}", daemon=True).start()
        return None

    def _lookups_done(self, now: float, gone: list) -> None:
        """Connect what was looked up; fail the lookups that failed or ran past their deadline."""
        while self._looked_up:
            lookup = self._looked_up.popleft()
            if self._lookups.get(lookup.conn) is not lookup:
                continue  # closed, or failed overdue, meanwhile
            del self._lookups[lookup.conn]
            where = f"{lookup.host}:{lookup.port}"
            error = f"cannot connect to {where}: name lookup failed: {lookup.error}" if lookup.error is not None \
                else self._open(lookup.conn, lookup.host, lookup.port, lookup.info, lookup.out)
            if error is not None:
                gone.append((lookup.conn, error))
        for conn, lookup in list(self._lookups.items()):
            if now >= lookup.deadline:
                del self._lookups[conn]
                gone.append((conn, f"cannot connect to {lookup.host}:{lookup.port}: name lookup took longer than "
                                   f"{self._lookup_timeout:g} s"))

    def adopt(self, conn: int, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conns[conn] = _Conn(sock)

    # ---------------------------------------------------------------- output
    def send(self, conn: int, data: bytes) -> None:
        c = self._conns.get(conn)
        if c is not None:
            c.out += data
            if self._flush(conn, c):
                self._backlog(conn, c, time.monotonic())
        elif conn in self._lookups:
            self._lookups[conn].out += data

    def _backlog(self, conn: int, c: _Conn, now: float) -> None:
        """Track how much ``conn``'s peer left unread: pause its input past the threshold, drop it past the cap."""
        size = len(c.out)
        if size <= self._pause_output:
            c.backed_up = None
        elif size > self._max_output:
            self._drop(conn)
            self._dropped.append((conn, f"the peer does not read: {size} bytes of output pending exceed the cap of "
                                        f"{self._max_output}"))
        elif c.backed_up is None:
            c.backed_up = now

    def close(self, conn: int) -> None:
        """Close after flushing what is buffered, if the socket takes it now; otherwise drop it."""
        self._lookups.pop(conn, None)  # its worker's answer is ignored
        c = self._conns.get(conn)
        if c is None:
            return
        if c.out and not c.connecting:
            self._flush(conn, c)
        self._drop(conn)

    def wake(self) -> None:
        """Cut another thread's ``poll`` short."""
        with self._wake_lock:
            if self._wake_w < 0:
                return  # closed: the number may belong to another file now
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # already awake

    def authenticated(self, conn: int) -> None:
        """``conn``'s peer proved who it is: read it in large chunks from now on."""
        c = self._conns.get(conn)
        if c is not None:
            c.read_bytes = READ_BYTES

    def hold(self, conn: int, held: bool) -> None:
        """Stop reading ``conn`` (``held``) while what it sent waits to be handled, or read it again."""
        c = self._conns.get(conn)
        if c is not None:
            c.held = held

    def same_host(self, conn: int) -> bool:
        """Whether ``conn``'s peer is on this host: a loopback address, or the very address we reach it
        from (False if unknown)."""
        c = self._conns.get(conn)
        try:
            local, peer = c.sock.getsockname()[0], c.sock.getpeername()[0]
        except (AttributeError, OSError, IndexError):
            return False
        return local == peer or ipaddress.ip_address(peer.split("%")[0]).is_loopback

    def pending_output(self, conn: int) -> int:
        c = self._conns.get(conn)
        return len(c.out) if c is not None else 0

    # ----------------------------------------------------------------- input
    def poll(
        self, timeout: float,
    ) -> tuple[list[socket.socket], list[int], list[tuple[int, bytes]], list[tuple[int, str]]]:
        """Wait up to ``timeout`` s; returns (accepted sockets, connections now up, data received, closed ones).

        Each closed entry carries why; its connection is already forgotten.
        """
        accepted, up, data, gone = [], [], [], []
        now = time.monotonic()
        gone += self._dropped
        self._dropped = []
        self._lookups_done(now, gone)
        deadlines = [lookup.deadline for lookup in self._lookups.values()]
        for conn, c in list(self._conns.items()):
            if c.backed_up is None:
                continue
            if now - c.backed_up >= self._output_timeout:
                self._drop(conn)
                gone.append((conn, f"the peer does not read: {len(c.out)} bytes of output pending for more than "
                                   f"{self._output_timeout:g} s"))
            else:
                deadlines.append(c.backed_up + self._output_timeout)
        if deadlines:
            timeout = min(timeout, max(0.0, min(deadlines) - now))
        if gone:
            timeout = 0.0
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if self._listener is not None:
            poller.register(self._listener, select.POLLIN)
        fds = {}
        for conn, c in self._conns.items():
            reading = c.backed_up is None and not c.held
            events = (_IN if reading else 0) | (select.POLLOUT if c.connecting or c.out else 0)
            poller.register(c.sock, events)
            fds[c.sock.fileno()] = conn
        ready = poller.poll(max(0, math.ceil(timeout * 1000)))
        for fd, events in ready:
            if fd == self._wake_r:
                self._drain_wake()
            elif self._listener is not None and fd == self._listener.fileno():
                accepted.extend(self._accept())
            elif fd in fds:
                conn = fds[fd]
                self._ready(conn, events, up, data, gone)
        return accepted, up, data, gone

    def _ready(self, conn: int, events: int, up: list, data: list, gone: list) -> None:
        c = self._conns.get(conn)
        if c is None:
            return  # dropped earlier in this poll
        if c.connecting:
            code = c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                self._drop(conn)
                gone.append((conn, f"connect failed: {os.strerror(code)}"))
                return
            if not events & (select.POLLOUT | _IN):
                return
            c.connecting = False
            up.append(conn)
        if events & select.POLLOUT and c.out:
            if not self._flush(conn, c):
                gone.append((conn, "send failed"))
                return
            self._backlog(conn, c, time.monotonic())
        if events & (_IN | _BAD):
            try:
                chunk = c.sock.recv(c.read_bytes)
            except BlockingIOError:
                return
            except OSError as exc:
                self._drop(conn)
                gone.append((conn, f"receive failed: {exc.strerror or exc}"))
                return
            if not chunk:
                self._drop(conn)
                gone.append((conn, "closed by the peer"))
                return
            data.append((conn, chunk))

    def _flush(self, conn: int, c: _Conn) -> bool:
        if c.connecting:
            return True
        try:
            while c.out:
                n = c.sock.send(c.out)
                del c.out[:n]
        except BlockingIOError:
            pass
        except OSError:
            self._drop(conn)
            return False
        return True

    def _accept(self) -> list[socket.socket]:
        out = []
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, ConnectionAbortedError):
                return out
            except OSError:
                return out
            out.append(sock)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _drop(self, conn: int) -> None:
        c = self._conns.pop(conn, None)
        if c is not None:
            c.sock.close()

    def __contains__(self, conn: int) -> bool:
        return conn in self._conns or conn in self._lookups

    def close_all(self) -> None:
        self._lookups.clear()
        for conn in list(self._conns):
            self.close(conn)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
