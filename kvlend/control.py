"""Control channel: authenticated msgpack frames over TCP (the I/O shell of ``wire``).

A decode rank connects to a prefill rank's ``Listener``; both prove they hold
the shared secret in the hello exchange (``Hello``, ``HelloAck``,
``HelloConfirm``) before anything else is sent, and every frame after it is
keyed by a per-session, per-direction key.  Every blocking call takes a
deadline.  Waits use ``poll`` rather than ``select``, which fails on
descriptors above 1023 (common in a process that also runs UCX and CUDA).
Listens on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import secrets
import select
import socket
import time

from .errors import AuthError, ConfigError, KvlendError, PeerLost, ProtocolError, TransferTimeout
from .wire import NONCE_BYTES, FrameDecoder, Hello, HelloAck, HelloConfirm, Message, encode_frame, session_key

log = logging.getLogger(__name__)

SECRET_ENV = "KVLEND_SECRET"
SECRET_FILE_ENV = "KVLEND_SECRET_FILE"
DEFAULT_HOST = "127.0.0.1"
HELLO_TIMEOUT = 5.0
MAX_PENDING_HELLOS = 256  # half-open connections kept; the oldest is dropped beyond this


def generate_secret() -> bytes:
    return secrets.token_bytes(32)


def load_secret(environ=os.environ) -> bytes:
    """The pair's shared secret: ``$KVLEND_SECRET`` (hex) or the file ``$KVLEND_SECRET_FILE``."""
    if environ.get(SECRET_ENV):
        try:
            secret = bytes.fromhex(environ[SECRET_ENV])
        except ValueError:
            raise AuthError(f"${SECRET_ENV} must be hex") from None
    elif environ.get(SECRET_FILE_ENV):
        path = environ[SECRET_FILE_ENV]
        try:
            with open(path, "rb") as f:
                raw = f.read().strip()
        except OSError as exc:
            raise AuthError(f"cannot read ${SECRET_FILE_ENV} {path!r}: {exc.strerror}") from None
        try:
            secret = bytes.fromhex(raw.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            secret = raw
    else:
        raise AuthError(f"no shared secret: set ${SECRET_ENV} (hex) or ${SECRET_FILE_ENV}")
    if len(secret) < 16:
        raise AuthError("the shared secret must be at least 16 bytes")
    return secret


def _ack_key(secret: bytes, client_nonce: bytes) -> bytes:
    # Binds the server's reply to this client's nonce, so an ack cannot be replayed.
    return hmac.new(secret, b"kvlend/hello-ack/v1" + client_nonce, hashlib.sha256).digest()


class Channel:
    """One authenticated connection; ``peer`` is the other side's name."""

    def __init__(self, sock: socket.socket, peer: str, send_key: bytes, recv_key: bytes) -> None:
        self.sock = sock
        self.peer = peer
        self._key = send_key
        self._decoder = FrameDecoder(recv_key)
        self._send_seq = 0
        self.closed = False
        sock.setblocking(False)

    def rekey(self, send_key: bytes, recv_key: bytes | None = None, peer: str | None = None) -> None:
        """Switch keys after the hello exchange; sequence numbers carry on."""
        self._key = send_key
        self._decoder.key = send_key if recv_key is None else recv_key
        self.peer = peer or self.peer

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Message, timeout: float = 10.0) -> None:
        frame = encode_frame(self._key, self._send_seq, message)
        self._send_seq += 1
        _send_all(self.sock, frame, time.monotonic() + timeout, self.peer)

    def recv(self, timeout: float) -> Message:
        """The next message; ``TransferTimeout`` if none arrives within ``timeout`` seconds."""
        message = self.poll(timeout)
        if message is None:
            raise TransferTimeout(f"no message from {self.peer!r} within {timeout:.3g} s")
        return message

    def poll(self, timeout: float = 0.0) -> Message | None:
        """The next message if one is complete within ``timeout`` seconds, else None."""
        deadline = time.monotonic() + timeout
        while True:
            message = self._decoder.next_message()
            if message is not None:
                return message
            remaining = deadline - time.monotonic()
            if not _readable(self.sock, max(0.0, remaining)):
                return None
            self._read_some()
            if remaining <= 0:
                return self._decoder.next_message()

    def _read_some(self) -> None:
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError as exc:
            raise PeerLost(f"control channel to {self.peer!r} failed: {exc}") from None
        if not data:
            raise PeerLost(f"{self.peer!r} closed the control channel")
        self._decoder.feed(data)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


def _wait(sock: socket.socket, events: int, timeout: float) -> bool:
    """Whether ``sock`` is ready for ``events`` (or in error) within ``timeout`` seconds."""
    poller = select.poll()
    try:
        poller.register(sock, events)
        return bool(poller.poll(max(0, math.ceil(timeout * 1000))))
    except (OSError, ValueError) as exc:
        raise PeerLost(f"control socket unusable: {exc}") from None


def wait_readable(waitables, timeout: float) -> None:
    """Sleep until any of ``waitables`` (objects with ``fileno``) is readable, or ``timeout``."""
    poller = select.poll()
    try:
        for w in waitables:
            poller.register(w, select.POLLIN)
        poller.poll(max(0, math.ceil(timeout * 1000)))
    except (OSError, ValueError):
        pass  # a channel closed under us; its next read says so


def _readable(sock: socket.socket, timeout: float) -> bool:
    return _wait(sock, select.POLLIN, timeout)


def _send_all(sock: socket.socket, data: bytes, deadline: float, peer: str) -> None:
    view = memoryview(data)
    while view:
        try:
            n = sock.send(view)
            view = view[n:]
            continue
        except BlockingIOError:
            pass
        except OSError as exc:
            raise PeerLost(f"control channel to {peer!r} failed: {exc}") from None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeout(f"sending to {peer!r} did not finish in time")
        _wait(sock, select.POLLOUT, remaining)


def connect(host: str, port: int, secret: bytes, name: str, timeout: float = HELLO_TIMEOUT) -> Channel:
    """Connect to a prefill rank's listener and run the hello exchange (decode side)."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as exc:
        raise PeerLost(f"cannot connect to {host}:{port}: {exc}") from None
    nonce = secrets.token_bytes(NONCE_BYTES)
    channel = Channel(sock, f"{host}:{port}", send_key=secret, recv_key=_ack_key(secret, nonce))
    try:
        channel.send(Hello(name, nonce), timeout=max(0.0, deadline - time.monotonic()))
        ack = channel.recv(max(0.0, deadline - time.monotonic()))
        if not isinstance(ack, HelloAck):
            raise ProtocolError(f"expected hello_ack, got {ack.TYPE}")
    except KvlendError:
        channel.close()
        raise
    channel.rekey(session_key(secret, nonce, ack.nonce, "client"),
                  session_key(secret, nonce, ack.nonce, "server"), peer=ack.peer)
    try:
        channel.send(HelloConfirm(), timeout=max(0.0, deadline - time.monotonic()))
    except KvlendError:
        channel.close()
        raise
    return channel


class _PendingHello:
    """A half-open connection working through the hello; advanced without blocking."""

    def __init__(self, channel: Channel, where: str, deadline: float) -> None:
        self.channel = channel
        self.where = where
        self.deadline = deadline
        self.name: str | None = None  # set once a valid Hello arrived; a HelloConfirm is next


class Listener:
    """Accepts decode ranks; a peer that fails the hello is dropped.

    One without the secret learns nothing: a forged ``Hello`` gets no answer,
    and a replayed one gets a ``HelloAck`` it cannot use, then the drop.
    Hellos never block the caller: half-open connections wait in a list, are
    advanced by every ``accept`` as their bytes arrive, and are dropped once
    ``HELLO_TIMEOUT`` passes, so a silent client cannot stall the server.
    """

    def __init__(self, secret: bytes, name: str, host: str = DEFAULT_HOST, port: int = 0) -> None:
        self.secret = secret
        self.name = name
        try:
            self.sock = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self.sock.setblocking(False)
        self.host, self.port = self.sock.getsockname()[:2]
        self._pending: list[_PendingHello] = []
        self._ready: list[Channel] = []

    def fileno(self) -> int:
        return self.sock.fileno()

    def waitables(self) -> list:
        """Everything whose readability means ``accept`` has work: the socket and half-open hellos."""
        return [self] + [p.channel for p in self._pending]

    @property
    def pending(self) -> int:
        """Half-open connections still in the hello."""
        return len(self._pending)

    def accept(self, timeout: float = 0.0) -> Channel | None:
        """An authenticated channel, or None.

        Waits up to ``timeout`` seconds, advancing every half-open hello; it
        returns early with None once every connection it was waiting on was
        dropped (nobody honest is left to wait for).  ``accept(0.0)`` never blocks.
        """
        deadline = time.monotonic() + timeout
        while True:
            dropped = self._advance()
            if self._ready:
                return self._ready.pop(0)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (dropped and not self._pending):
                return None
            if self._pending:
                remaining = min(remaining, max(0.0, min(p.deadline for p in self._pending) - time.monotonic()))
            wait_readable(self.waitables(), remaining)

    def _advance(self) -> bool:
        """Take new connections and progress pending hellos; True if any was dropped."""
        while True:
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, ConnectionAbortedError):
                break
            except OSError as exc:
                log.warning("control: accept failed: %s", exc)
                break
            where = f"{addr[0]}:{addr[1]}"
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                channel = Channel(sock, where, send_key=b"", recv_key=self.secret)
            except OSError as exc:
                log.warning("control: dropped %s before the handshake: %s", where, exc)
                sock.close()
                continue
            self._pending.append(_PendingHello(channel, where, time.monotonic() + HELLO_TIMEOUT))
        dropped = False
        while len(self._pending) > MAX_PENDING_HELLOS:
            oldest = self._pending.pop(0)
            log.warning("control: dropped %s before the handshake: too many pending hellos", oldest.where)
            oldest.channel.close()
            dropped = True
        for p in list(self._pending):
            try:
                done = self._progress(p)
            except KvlendError as exc:
                log.warning("control: dropped %s before the handshake: %s", p.where, exc)
                done = True
                p.channel.close()
                dropped = True
            if done:
                self._pending.remove(p)
                if not p.channel.closed:
                    self._ready.append(p.channel)
        return dropped

    def _progress(self, p: _PendingHello) -> bool:
        """Handle what ``p`` sent so far; True once it is authenticated (or raises to drop it)."""
        while True:
            remaining = p.deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeout(f"no complete hello within {HELLO_TIMEOUT:.3g} s")
            message = p.channel.poll(0.0)
            if message is None:
                return False
            if p.name is None:
                if not isinstance(message, Hello):
                    raise ProtocolError(f"expected hello, got {message.TYPE}")
                nonce = secrets.token_bytes(NONCE_BYTES)
                p.channel.rekey(_ack_key(self.secret, message.nonce), self.secret)
                p.channel.send(HelloAck(self.name, nonce), timeout=remaining)
                # Only a peer holding the secret can send the confirm, so a replayed Hello gets no channel.
                p.channel.rekey(session_key(self.secret, message.nonce, nonce, "server"),
                                session_key(self.secret, message.nonce, nonce, "client"))
                p.name = message.peer
                continue
            if not isinstance(message, HelloConfirm):
                raise ProtocolError(f"expected hello_confirm, got {message.TYPE}")
            p.channel.peer = p.name
            log.info("control: %s authenticated as %r", p.where, p.name)
            return True

    def close(self) -> None:
        for p in self._pending:
            p.channel.close()
        for channel in self._ready:
            channel.close()
        self._pending.clear()
        self._ready.clear()
        self.sock.close()
