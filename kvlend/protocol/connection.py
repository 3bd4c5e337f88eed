"""One control connection, sans-IO: framing over a channel the shell has authenticated.

The shell runs TLS 1.3 under it with both ranks' certificates and says who
the peer is (``authenticate``) once the handshake verified its certificate.
Until then the connection takes no bytes and sends nothing; the session
gives it ``AUTH_TIMEOUT`` to get there.  It never touches a socket or a clock.

Decoding a frame is the costly part of receiving (a walk of its structure, the
objects, a handshake's layout), so it is a ``FrameReader`` of its own: the
shell runs one per connection off the node's lock and hands the session the
messages (``deliver``); in memory, ``Connection.read`` runs it in place.
"""

from __future__ import annotations

import sys

from ..errors import KvlendError, PeerProtocolError, UsageError
from .budget import Share, work_of
from .wire import FrameDecoder, Handshake, Message, encode_frame

AUTH_TIMEOUT = 5.0  # seconds a connection may take to complete the TLS handshake
_WHOLE = Share(sys.maxsize, sys.maxsize)  # no share: decode every frame there is


class Connection:
    """Framing of one connection; ``peer`` is the other side's verified identity once ``ready``."""

    def __init__(self, now: float, timeout: float = AUTH_TIMEOUT) -> None:
        self.deadline = now + timeout  # for the handshake; meaningless once ready
        self.peer: str | None = None
        self.ready = False
        self._out = bytearray()
        self._reader = FrameReader()

    def authenticate(self, identity: str) -> None:
        """The channel proved the peer holds a certificate for ``identity``."""
        if self.ready:
            raise UsageError(f"connection already authenticated as {self.peer!r}")
        if not isinstance(identity, str) or not identity:
            raise UsageError(f"peer identity must be a non-empty string, got {identity!r}")
        self.peer, self.ready = identity, True

    def send(self, message: Message) -> None:
        """Queue ``message`` (only once ready)."""
        if not self.ready:
            raise UsageError(f"cannot send {message.TYPE} before the peer is authenticated")
        self._out += encode_frame(message)

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def receive(self, data: bytes) -> list[Message]:
        """Feed received (decrypted) bytes; the messages they complete (``PeerProtocolError`` for a bad frame)."""
        messages, error = self.read(data)
        if error is not None:
            raise error
        return messages

    def read(self, data: bytes) -> tuple[list[Message], KvlendError | None]:
        """Feed received (decrypted) bytes: the messages they complete, then the error that ended the stream."""
        if not self.ready:
            return [], PeerProtocolError(f"{len(data)} bytes arrived before the peer was authenticated")
        return self._reader.read(data)


class FrameReader:
    """One connection's incoming frames, decoded wherever the caller likes (the shell: off the node's lock).

    The first message's layout is decoded too if it is a ``Handshake`` (the one a session reads; a later one
    is refused without decoding it).  After a bad frame it reads nothing more: the stream is out of step.
    """

    def __init__(self) -> None:
        self._decoder = FrameDecoder()
        self._first = True
        self._error: KvlendError | None = None

    def read(self, data: bytes, share: Share | None = None) -> tuple[list[Message], KvlendError | None]:
        """The messages ``data`` completes, then the error that ended the stream (None while it is well formed).

        ``share``: decode no more than that this time (``budget``); the rest waits, still bytes, for the next call
        (``backlog`` says whether a whole frame waits)."""
        out: list[Message] = []
        share = share or _WHOLE
        work = 0
        if self._error is None:
            try:
                self._decoder.feed(data)
                while len(out) < share.messages and work < share.work:
                    if (message := self._decoder.next_message()) is None:
                        break
                    work += work_of(message)
                    if self._first and isinstance(message, Handshake):
                        try:
                            message.page_layout()
                        except KvlendError:
                            pass  # kept with the message: the session refuses the handshake with it
                    self._first = False
                    out.append(message)
            except KvlendError as exc:
                self._error = exc
        return out, self._error

    @property
    def backlog(self) -> bool:
        """Whether a whole frame waits to be decoded (a share ended the last ``read`` before it)."""
        return self._error is None and self._decoder.ready()
