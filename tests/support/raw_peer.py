"""A decode rank by hand: a real TLS socket and a real ``Connection``, sending whatever a test says.

For refusal tests that need a peer holding a certificate of the cluster to
send what no ``DecodeNode`` would (another decode's lease ids, hostile frames).
The socket blocks: the handshake completes in the constructor.
"""

from __future__ import annotations

import socket
import ssl
import time

from kvlend.errors import AuthError, PeerLost, TransferTimeout
from kvlend.protocol.connection import Connection
from kvlend.protocol.wire import Handshake, Message
from kvlend.security.credentials import Credentials, peer_identity


class RawDecode:
    def __init__(self, address: tuple[str, int], credentials: Credentials, timeout: float = 10.0) -> None:
        sock = socket.create_connection(address, timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as a node's: no 40 ms waits on small frames
        try:
            self.sock = credentials.context(server=False).wrap_socket(sock)
        except ssl.SSLError as exc:
            sock.close()
            raise AuthError(f"TLS handshake failed: {exc.reason}") from None
        except BaseException:
            sock.close()
            raise
        self.conn = Connection(time.monotonic())
        self.conn.authenticate(peer_identity(self.sock.getpeercert()))
        self._inbox: list[Message] = []

    @property
    def peer(self) -> str:
        """The prefill's identity, as its certificate names it."""
        return self.conn.peer

    def handshake(self, layout, timeout: float = 10.0) -> Handshake:
        self.send(Handshake(layout.encode(), "nixl", b"raw-peer-metadata"))
        reply = self.recv(timeout)
        assert isinstance(reply, Handshake), reply
        return reply

    def send(self, *messages: Message) -> None:
        for m in messages:
            self.conn.send(m)
        self.send_bytes(self.conn.data_to_send())

    def send_bytes(self, data: bytes) -> None:
        """Plaintext inside the TLS stream, framed or not."""
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise PeerLost(f"prefill hung up: {exc}") from None

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
        except ssl.SSLError as exc:  # an alert: the prefill refused something of the TLS session
            raise AuthError(f"TLS: {exc.reason}") from None
        except OSError as exc:
            raise PeerLost(f"prefill hung up: {exc}") from None
        if not data:
            raise PeerLost("prefill hung up")
        self._inbox.extend(self.conn.receive(data))

    def __enter__(self) -> RawDecode:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()
