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

from .errors import AuthError, KvlendError, PeerLost, ProtocolError, TransferTimeout
from .wire import NONCE_BYTES, FrameDecoder, Hello, HelloAck, HelloConfirm, Message, encode_frame, session_key

log = logging.getLogger(__name__)

SECRET_ENV = "KVLEND_SECRET"
SECRET_FILE_ENV = "KVLEND_SECRET_FILE"
DEFAULT_HOST = "127.0.0.1"
HELLO_TIMEOUT = 5.0


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
    except OSError as exc:
        raise PeerLost(f"cannot connect to {host}:{port}: {exc}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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


class Listener:
    """Accepts decode ranks; a peer that fails the hello is dropped.

    One without the secret learns nothing: a forged ``Hello`` gets no answer,
    and a replayed one gets a ``HelloAck`` it cannot use, then the drop.
    """

    def __init__(self, secret: bytes, name: str, host: str = DEFAULT_HOST, port: int = 0) -> None:
        self.secret = secret
        self.name = name
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.sock.setblocking(False)
        self.host, self.port = self.sock.getsockname()[:2]

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self, timeout: float = 0.0) -> Channel | None:
        """An authenticated channel, or None if nobody (honest) arrived within ``timeout``."""
        if not _readable(self.sock, timeout):
            return None
        try:
            sock, addr = self.sock.accept()
        except (BlockingIOError, ConnectionAbortedError):
            return None
        deadline = time.monotonic() + HELLO_TIMEOUT
        where = f"{addr[0]}:{addr[1]}"
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            channel = Channel(sock, where, send_key=b"", recv_key=self.secret)
        except OSError as exc:
            log.warning("control: dropped %s before the handshake: %s", where, exc)
            sock.close()
            return None
        try:
            hello = channel.recv(max(0.0, deadline - time.monotonic()))
            if not isinstance(hello, Hello):
                raise ProtocolError(f"expected hello, got {hello.TYPE}")
            nonce = secrets.token_bytes(NONCE_BYTES)
            channel.rekey(_ack_key(self.secret, hello.nonce), self.secret)
            channel.send(HelloAck(self.name, nonce), timeout=max(0.0, deadline - time.monotonic()))
            # Only a peer holding the secret can send this, so a replayed Hello gets no channel.
            channel.rekey(session_key(self.secret, hello.nonce, nonce, "server"),
                          session_key(self.secret, hello.nonce, nonce, "client"))
            confirm = channel.recv(max(0.0, deadline - time.monotonic()))
            if not isinstance(confirm, HelloConfirm):
                raise ProtocolError(f"expected hello_confirm, got {confirm.TYPE}")
        except KvlendError as exc:
            log.warning("control: dropped %s before the handshake: %s", where, exc)
            channel.close()
            return None
        channel.peer = hello.peer
        log.info("control: %s authenticated as %r", where, hello.peer)
        return channel

    def close(self) -> None:
        self.sock.close()
