"""Non-blocking TCP connections by id, with output buffers: the byte-moving half of the shell (TLS sits above).

Nothing here blocks: connects complete in the background, writes go to a
per-connection buffer drained as the socket takes it, and ``poll`` waits on
every socket at once (``poll(2)``, not ``select``, which fails on
descriptors above 1023, common in a process that also runs UCX and CUDA).
A wake-up pipe lets another thread cut a wait short.
"""

from __future__ import annotations

import errno
import math
import os
import select
import socket
from dataclasses import dataclass, field

from ..errors import ConfigError

READ_BYTES = 1 << 20  # per connection per poll, so one busy peer cannot starve the rest
HANDSHAKE_READ_BYTES = 16 << 10  # ... until it authenticated: a TLS record is at most 16 KiB + 256
_IN = select.POLLIN | select.POLLPRI
_BAD = select.POLLERR | select.POLLHUP | select.POLLNVAL


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    connecting: bool = False
    out: bytearray = field(default_factory=bytearray)
    read_bytes: int = HANDSHAKE_READ_BYTES


class Sockets:
    """Connections keyed by the session's ids; ``poll`` reports what happened to them."""

    def __init__(self) -> None:
        self._conns: dict[int, _Conn] = {}
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

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
        """Start connecting; an error message if it failed at once."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
        except Exception as exc:  # not only OSError: a name IDNA cannot encode raises UnicodeError
            return f"cannot connect to {host}:{port}: {type(exc).__name__}: {exc}"
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        code = sock.connect_ex(address)
        if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            sock.close()
            return f"cannot connect to {host}:{port}: {os.strerror(code)}"
        self._conns[conn] = _Conn(sock, connecting=code != 0)
        return None

    def adopt(self, conn: int, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conns[conn] = _Conn(sock)

    # ---------------------------------------------------------------- output
    def send(self, conn: int, data: bytes) -> None:
        c = self._conns.get(conn)
        if c is not None:
            c.out += data
            self._flush(conn, c)

    def close(self, conn: int) -> None:
        """Close after flushing what is buffered, if the socket takes it now; otherwise drop it."""
        c = self._conns.get(conn)
        if c is None:
            return
        if c.out and not c.connecting:
            self._flush(conn, c)
        self._drop(conn)

    def wake(self) -> None:
        """Cut another thread's ``poll`` short."""
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

    def pending_output(self, conn: int) -> int:
        c = self._conns.get(conn)
        return len(c.out) if c is not None else 0

    # ----------------------------------------------------------------- input
    def poll(self, timeout: float) -> tuple[list[socket.socket], list[int], list[tuple[int, bytes]], list[tuple[int, str]]]:
        """Wait up to ``timeout`` s; returns (accepted sockets, connections now up, data received, closed ones).

        Each closed entry carries why; its connection is already forgotten.
        """
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if self._listener is not None:
            poller.register(self._listener, select.POLLIN)
        fds = {}
        for conn, c in self._conns.items():
            events = _IN | (select.POLLOUT if c.connecting or c.out else 0)
            poller.register(c.sock, events)
            fds[c.sock.fileno()] = conn
        ready = poller.poll(max(0, math.ceil(timeout * 1000)))
        accepted, up, data, gone = [], [], [], []
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
        return conn in self._conns

    def close_all(self) -> None:
        for conn in list(self._conns):
            self.close(conn)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
