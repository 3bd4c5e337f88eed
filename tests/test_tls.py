"""``TlsChannel`` in memory: two real TLS 1.3 endpoints joined by byte strings, no sockets.

The handshake names each side's identity from its certificate, frames
round-trip, a byte flipped on the way is refused (integrity), nothing can be
sent before the handshake, a close_notify ends the other side in order, and
each side knows when its peer's certificate expires.
"""

from __future__ import annotations

import pytest

from kvlend.errors import AuthError, ProtocolError
from kvlend.runtime.tls import TlsChannel
from tests.support.certs import creds

pytestmark = pytest.mark.unit


def pump(a: TlsChannel, b: TlsChannel, rounds: int = 8) -> bytes:
    """Move bytes both ways until quiet; the plaintext ``b`` received."""
    got = bytearray()
    for _ in range(rounds):
        moved = False
        for src, dst in ((a, b), (b, a)):
            data = src.data_to_send()
            if data:
                moved = True
                text = dst.receive(data)
                if dst is b:
                    got += text
        if not moved:
            break
    return bytes(got)


def pair(server_identity: str = "prefill", client_identity: str = "decode") -> tuple[TlsChannel, TlsChannel]:
    server = TlsChannel(creds(server_identity, "prefill").context(server=True), server=True, roles=("decode",))
    client = TlsChannel(creds(client_identity, "decode").context(server=False), server=False, roles=("prefill",))
    client.start()
    pump(client, server)
    return client, server


def test_the_handshake_names_both_sides_from_their_certificates():
    client, server = pair("prefill-2", "decode-5")
    assert server.authenticated and client.authenticated
    assert server.identity == "decode-5" and client.identity == "prefill-2"
    assert client._tls.version() == "TLSv1.3"


def test_plaintext_round_trips_in_both_directions_and_is_not_on_the_wire():
    client, server = pair()
    message = b"lease 0123456789abcdef and metadata " * 100
    client.send(message)
    wire = client.data_to_send()
    assert message[:32] not in wire and len(wire) > len(message)
    assert server.receive(wire) == message
    server.send(b"ack")
    assert client.receive(server.data_to_send()) == b"ack"


def test_a_byte_flipped_on_the_way_is_refused():
    client, server = pair()
    client.send(b"x" * 200)
    wire = bytearray(client.data_to_send())
    wire[-20] ^= 0x01
    with pytest.raises(AuthError, match="TLS"):
        server.receive(bytes(wire))


def test_nothing_is_sent_before_the_handshake_completes():
    client = TlsChannel(creds("decode", "decode").context(server=False), server=False, roles=("prefill",))
    with pytest.raises(ProtocolError, match="before the TLS handshake"):
        client.send(b"early")
    client.start()
    hello = client.data_to_send()
    assert hello[:1] == b"\x16" and not client.authenticated  # a ClientHello record, nothing else


def test_close_notify_ends_the_peer_in_order_after_its_last_words():
    client, server = pair()
    client.send(b"bye")
    client.close()
    assert server.receive(client.data_to_send()) == b"bye"
    assert server.peer_closed


def test_a_peer_that_speaks_no_tls_is_refused_at_once():
    server = TlsChannel(creds("prefill", "prefill").context(server=True), server=True, roles=("decode",))
    with pytest.raises(AuthError, match="TLS handshake failed"):
        server.receive(b"\x00\x00\x10\x00" + b"kvlend frame of old" * 4)


def test_each_side_knows_when_its_peers_certificate_expires():
    client, server = pair("prefill-2", "decode-5")
    assert client.expires == creds("prefill-2", "prefill").expires.timestamp()
    assert server.expires == creds("decode-5", "decode").expires.timestamp()
