"""A decode rank by hand: a real socket and a real ``Connection``, sending whatever a test says.

For refusal tests that need a peer holding the secret to send what no
``DecodeNode`` would (replayed frames, another decode's lease ids).
"""

from __future__ import annotations

import socket
import time

from kvlend.errors import PeerLost, TransferTimeout
from kvlend.protocol.connection import Connection
from kvlend.protocol.wire import Handshake, Message


class RawDecode:
    def __init__(self, address: tuple[str, int], secret: bytes, name: str, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(address, timeout=timeout)
        self.conn = Connection("client", secret, name, time.monotonic())
        self._inbox: list[Message] = []
        self.sock.sendall(self.conn.data_to_send())
        deadline = time.monotonic() + timeout
        while not self.conn.ready:
            self._read(deadline)
        self.sock.sendall(self.conn.data_to_send())  # the hello confirm

    def handshake(self, layout, timeout: float = 10.0) -> Handshake:
        self.send(Handshake(layout.encode(), "nixl", b"raw-peer-metadata"))
        reply = self.recv(timeout)
        assert isinstance(reply, Handshake), reply
        return reply

    def send(self, *messages: Message) -> None:
        for m in messages:
            self.conn.send(m)
        self.sock.sendall(self.conn.data_to_send())

    def recv(self, timeout: float) -> Message:
        deadline = time.monotonic() + timeout
        while not self._inbox:
            self._read(deadline)
        return self._inbox.pop(0)

    def _read(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeout("no message from the prefill in time")
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(1 << 16)
        except socket.timeout:
            raise TransferTimeout("no message from the prefill in time") from None
        except OSError as exc:
            raise PeerLost(f"prefill hung up: {exc}") from None
        if not data:
            raise PeerLost("prefill hung up")
        self._inbox.extend(self.conn.receive(data))

    def __enter__(self) -> RawDecode:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()
