"""One control connection, sans-IO: the hello exchange, the key schedule and framing.

Fed the bytes a socket received, it returns the messages they complete and
queues the bytes to send; it never touches a socket or a clock.  The decode
side (``client``) opens with ``Hello``; both sides prove they hold the shared
secret (``Hello``, ``HelloAck``, ``HelloConfirm``) before any other message
passes, and every later frame is keyed by a per-session, per-direction key
(see ``wire``), so a frame replayed from another session, reflected, or out
of order fails authentication.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from ..errors import ProtocolError
from .wire import (
    MAX_FRAME_BYTES, NONCE_BYTES, FrameDecoder, Hello, HelloAck, HelloConfirm, Message, encode_frame, session_key,
)

HELLO_TIMEOUT = 5.0  # seconds a connection may take to authenticate
HELLO_FRAME_BYTES = 4096  # frame cap until authenticated: a hello frame is under 100 bytes


def ack_key(secret: bytes, client_nonce: bytes) -> bytes:
    """Binds the server's reply to this client's nonce, so an ack cannot be replayed."""
    return hmac.new(secret, b"kvlend/hello-ack/v1" + client_nonce, hashlib.sha256).digest()


class Connection:
    """Framing and authentication of one connection; ``peer`` is the other side's name once ``ready``."""

    def __init__(self, role: str, secret: bytes, name: str, now: float, timeout: float = HELLO_TIMEOUT) -> None:
        if role not in ("client", "server"):
            raise ProtocolError(f"role must be 'client' or 'server', got {role!r}")
        self.role = role
        self.name = name
        self.deadline = now + timeout  # for the hello; meaningless once ready
        self.peer: str | None = None
        self.ready = False
        self._secret = secret
        self._out = bytearray()
        self._send_seq = 0
        if role == "client":
            self._nonce = secrets.token_bytes(NONCE_BYTES)
            self._key = secret
            self._decoder = FrameDecoder(ack_key(secret, self._nonce), HELLO_FRAME_BYTES)
            self._frame(Hello(name, self._nonce))
        else:
            self._nonce = b""
            self._key = b""
            self._decoder = FrameDecoder(secret, HELLO_FRAME_BYTES)  # nobody buffers megabytes before proving who they are

    def send(self, message: Message) -> None:
        """Queue ``message`` (only once ready: nothing but the hello passes before)."""
        if not self.ready:
            raise ProtocolError(f"cannot send {message.TYPE} before the hello completed")
        self._frame(message)

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def receive(self, data: bytes) -> list[Message]:
        """Feed received bytes; the messages they complete (hello frames are handled here)."""
        self._decoder.feed(data)
        out = []
        while (message := self._decoder.next_message()) is not None:
            if self.ready:
                out.append(message)
            else:
                self._hello(message)
        return out

    def _frame(self, message: Message) -> None:
        self._out += encode_frame(self._key, self._send_seq, message)
        self._send_seq += 1

    def _hello(self, message: Message) -> None:
        if self.role == "client":
            if not isinstance(message, HelloAck):
                raise ProtocolError(f"expected hello_ack, got {message.TYPE}")
            self._key = session_key(self._secret, self._nonce, message.nonce, "client")
            self._decoder.key = session_key(self._secret, self._nonce, message.nonce, "server")
            self.peer, self.ready = message.peer, True
            self._decoder.max_frame = MAX_FRAME_BYTES
            self._frame(HelloConfirm())
        elif self.peer is None:
            if not isinstance(message, Hello):
                raise ProtocolError(f"expected hello, got {message.TYPE}")
            nonce = secrets.token_bytes(NONCE_BYTES)
            self._key = ack_key(self._secret, message.nonce)
            self._frame(HelloAck(self.name, nonce))
            # Only a peer holding the secret can send the confirm, so a replayed Hello gets no session.
            self._key = session_key(self._secret, message.nonce, nonce, "server")
            self._decoder.key = session_key(self._secret, message.nonce, nonce, "client")
            self.peer = message.peer
        else:
            if not isinstance(message, HelloConfirm):
                raise ProtocolError(f"expected hello_confirm, got {message.TYPE}")
            self.ready = True
            self._decoder.max_frame = MAX_FRAME_BYTES
