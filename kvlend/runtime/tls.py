"""TLS for one connection over memory buffers: ciphertext from and to the socket, plaintext to the session.

``ssl.SSLObject`` on a pair of ``MemoryBIO``: the shell's loop feeds it what
the socket read and sends what it produced, outside the session's lock, so
handshakes never hold up serving.  The channel reports the peer's verified
identity once the handshake is done and its certificate's role is one this
side serves (a decode-role certificate never reaches a decode's session as a
prefill), and when its certificate expires; until
then nothing reaches the session.
"""

from __future__ import annotations

import ssl

from ..errors import AuthError, UsageError
from ..security.credentials import check_role, peer_identity, peer_role

READ_CHUNK = 1 << 16


class TlsChannel:
    """One side of a mutually authenticated TLS 1.3 connection."""

    def __init__(self, context: ssl.SSLContext, server: bool, roles: tuple[str, ...]) -> None:
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._roles = roles  # the certificate roles a peer may hold
        self._tls = context.wrap_bio(self._in, self._out, server_side=server)
        self.identity: str | None = None  # the peer's, once the handshake completed
        self.expires: float | None = None  # when the peer's certificate expires (wall clock, epoch seconds)
        self.peer_closed = False  # the peer sent close_notify: nothing more will come

    @property
    def authenticated(self) -> bool:
        return self.identity is not None

    def start(self) -> None:
        """Begin the handshake (the client's ClientHello lands in ``data_to_send``)."""
        self._handshake()

    def receive(self, data: bytes) -> bytes:
        """Feed ciphertext; the plaintext it completes (up to a close_notify: then ``peer_closed``).

        ``AuthError`` if the peer fails TLS: a bad certificate, a tampered record, not TLS at all.
        """
        self._in.write(data)
        if self.identity is None and not self._handshake():
            return b""
        out = bytearray()
        while True:
            try:
                chunk = self._tls.read(READ_CHUNK)
            except ssl.SSLWantReadError:
                return bytes(out)
            except ssl.SSLError as exc:
                raise AuthError(f"TLS: {_reason(exc)}") from None
            if not chunk:  # close_notify (a want-read would have raised)
                self.peer_closed = True
                return bytes(out)
            out += chunk

    def send(self, plaintext: bytes) -> None:
        """Encrypt ``plaintext`` into ``data_to_send`` (the session sends nothing before the handshake)."""
        if self.identity is None:
            raise UsageError("cannot send before the TLS handshake completed")
        try:
            self._tls.write(plaintext)
        except ssl.SSLError as exc:
            raise AuthError(f"TLS: {_reason(exc)}") from None

    def close(self) -> None:
        """Queue a close_notify (best effort: the socket closes right after)."""
        try:
            self._tls.unwrap()
        except ssl.SSLError:
            pass  # it waits for the peer's close_notify, which nobody will read

    def data_to_send(self) -> bytes:
        return self._out.read()

    def _handshake(self) -> bool:
        try:
            self._tls.do_handshake()
        except ssl.SSLWantReadError:
            return False
        except ssl.SSLError as exc:
            raise AuthError(f"TLS handshake failed: {_reason(exc)}") from None
        cert = self._tls.getpeercert()
        identity = peer_identity(cert)
        check_role(identity, peer_role(cert), self._roles, "connect here")
        self.identity = identity
        self.expires = ssl.cert_time_to_seconds(cert["notAfter"])
        return True


def _reason(exc: ssl.SSLError) -> str:
    reason = exc.reason or type(exc).__name__
    verify = getattr(exc, "verify_message", None)  # why the peer's certificate was refused
    return f"{reason} ({verify})" if verify else reason
