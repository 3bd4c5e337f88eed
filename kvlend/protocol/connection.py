"""One control connection, sans-IO: framing over a channel the shell has authenticated.

The shell runs TLS 1.3 under it with both ranks' certificates and says who
the peer is (``authenticate``) once the handshake verified its certificate.
Until then the connection takes no bytes and sends nothing; the session
gives it ``AUTH_TIMEOUT`` to get there.  It never touches a socket or a clock.
"""

from __future__ import annotations

from ..errors import ProtocolError
from .wire import FrameDecoder, Message, encode_frame

AUTH_TIMEOUT = 5.0  # seconds a connection may take to complete the TLS handshake


class Connection:
    """Framing of one connection; ``peer`` is the other side's verified identity once ``ready``."""

    def __init__(self, now: float, timeout: float = AUTH_TIMEOUT) -> None:
        self.deadline = now + timeout  # for the handshake; meaningless once ready
        self.peer: str | None = None
        self.ready = False
        self._out = bytearray()
        self._decoder = FrameDecoder()

    def authenticate(self, identity: str) -> None:
        """The channel proved the peer holds a certificate for ``identity``."""
        if self.ready:
            raise ProtocolError(f"connection already authenticated as {self.peer!r}")
        if not isinstance(identity, str) or not identity:
            raise ProtocolError(f"peer identity must be a non-empty string, got {identity!r}")
        self.peer, self.ready = identity, True

    def send(self, message: Message) -> None:
        """Queue ``message`` (only once ready)."""
        if not self.ready:
            raise ProtocolError(f"cannot send {message.TYPE} before the peer is authenticated")
        self._out += encode_frame(message)

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def receive(self, data: bytes) -> list[Message]:
        """Feed received (decrypted) bytes; the messages they complete."""
        if not self.ready:
            raise ProtocolError(f"{len(data)} bytes arrived before the peer was authenticated")
        self._decoder.feed(data)
        out = []
        while (message := self._decoder.next_message()) is not None:
            out.append(message)
        return out
