"""The control channel's defences at node level, over real NIXL agents (UCX on DRAM) and loopback TCP.

A started ``PrefillNode`` faces decodes without a certificate of its
cluster, a silent TCP client, clients stalling in (or skipping) the TLS
handshake and a decode presenting a live peer's identity; each is refused
with a typed error while an honest decode connects and reads a lease
byte-exact.
"""

from __future__ import annotations

import contextlib
import socket
import time

import numpy as np
import pytest

import kvlend.protocol.prefill
from kvlend.errors import AuthError, KvlendError, PeerLost, ProtocolError, TransferTimeout
from kvlend.protocol.wire import Handshake, encode_frame
from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode
from kvlend.runtime.tls import TlsChannel
from kvlend.security.certs import Authority
from kvlend.security.credentials import Credentials
from kvlend.testing.kvcache import FreeList, group_layers, make_layout, make_pools, pattern, prefill_request, slots
from tests.support.agents import nixl
from tests.support.certs import CA, creds
from tests.support.nodes import read_until_eof, wait_until

pytestmark = pytest.mark.nixl

DEADLINE = 10.0  # seconds any single wait may take before the test fails
PAGES = 64
TOKENS = 40  # 10 token pages
CONFIG = NodeConfig(handshake_timeout=5.0, transfer_timeout=DEADLINE)


@contextlib.contextmanager
def prefill_node():
    src = make_pools(PAGES)
    node = PrefillNode(make_layout(src, windowed=False), nixl("prefill"), creds("prefill-0", "prefill"))
    try:
        node.start()
        yield node, src
    finally:
        node.close()
        node.backend.close()


@contextlib.contextmanager
def decode_node(credentials: Credentials):
    dst = make_pools(PAGES)
    node = DecodeNode(make_layout(dst, windowed=False), nixl(credentials.identity), credentials, config=CONFIG)
    try:
        yield node, dst
    finally:
        node.close()
        node.backend.close()


def serve_one(prefill: PrefillNode, src, decode: DecodeNode, dst, peer: str, seed: int) -> None:
    """Offer one request to ``peer`` and check every byte ``decode`` read."""
    rng = np.random.default_rng(seed)
    tables = prefill_request(prefill.layout, src, {g: FreeList(PAGES, rng) for g in prefill.layout.groups},
                             TOKENS, seed)
    lease = prefill.offer(peer, f"req-{seed}", TOKENS, tables, prefill.layout.full_selection(), meta={"seed": seed})
    link, offer = decode.next_offer(DEADLINE)
    assert offer.id == lease.id and offer.meta["seed"] == seed
    n_pages = -(-TOKENS // decode.layout.tokens_per_page)
    into = {g: FreeList(PAGES, rng).alloc(n_pages) for g in decode.layout.groups}
    result = decode.fetch(link, offer, into)
    assert result.bound == TOKENS
    for g, table in into.items():
        for layer in group_layers(decode.layout, g):
            got = slots(dst[layer])[table]
            np.testing.assert_array_equal(got, pattern(seed, layer, n_pages, got.shape[1]))


def records(data: bytes) -> list[int]:
    """The content types of the TLS records ``data`` is made of, exactly."""
    types, i = [], 0
    while i < len(data):
        types.append(data[i])
        i += 5 + int.from_bytes(data[i + 3:i + 5], "big")
    assert i == len(data), "not a whole number of TLS records"
    return types


def client_hello() -> bytes:
    """A real decode's first flight."""
    channel = TlsChannel(creds("stalls", "decode").context(server=False), server=False, roles=("prefill",))
    channel.start()
    return channel.data_to_send()


OTHER_CA = Authority.create()
FOREIGN = OTHER_CA.issue("intruder", "decode")


@pytest.mark.parametrize("credentials, why, errors", [
    # Trusts only its own cluster: the decode itself refuses the prefill's certificate.
    (FOREIGN, "CERTIFICATE_VERIFY_FAILED", (AuthError,)),
    # Trusts ours: the prefill refuses its certificate and says so in an alert, which a reset
    # of the closed connection may overtake (PeerLost).
    (Credentials(CA.cert_pem, FOREIGN.cert_pem, FOREIGN.key_pem), "UNKNOWN_CA", (AuthError, PeerLost)),
], ids=["another-cluster", "trusts-ours-with-a-foreign-cert"])
def test_a_decode_without_a_certificate_of_the_cluster_is_refused_and_the_prefill_keeps_serving(
        credentials, why, errors):
    with prefill_node() as (prefill, src):
        with decode_node(credentials) as (intruder, _):
            t0 = time.monotonic()
            with pytest.raises(errors) as info:
                intruder.connect(*prefill.address)
            # Typed, and at once: TLS refuses the certificate, nobody waits for a timeout.
            assert isinstance(info.value, PeerLost) or why in str(info.value), repr(info.value)
            assert time.monotonic() - t0 < CONFIG.handshake_timeout
            assert intruder.links == []
        assert prefill.ready_peers() == []
        with decode_node(creds("decode-0", "decode")) as (honest, dst):
            link = honest.connect(*prefill.address)
            assert link.peer == "prefill-0"
            assert prefill.wait_for_peer(DEADLINE) == "decode-0"
            serve_one(prefill, src, honest, dst, "decode-0", seed=1)


def test_a_silent_client_is_dropped_after_the_handshake_timeout_while_an_honest_decode_connects(monkeypatch):
    timeout = 1.0
    monkeypatch.setattr(kvlend.protocol.prefill, "AUTH_TIMEOUT", timeout)  # what PrefillSession.accept passes
    with prefill_node() as (prefill, src):
        t0 = time.monotonic()
        silent = socket.create_connection(prefill.address, timeout=DEADLINE)  # never sends a ClientHello
        try:
            with decode_node(creds("decode-0", "decode")) as (honest, dst):
                honest.connect(*prefill.address)
                assert prefill.wait_for_peer(DEADLINE) == "decode-0"
                if time.monotonic() - t0 < 0.8 * timeout:  # the honest decode got in while the silent one waited
                    silent.setblocking(False)
                    with pytest.raises(BlockingIOError):
                        silent.recv(1)  # still open, nothing sent to it
                    silent.settimeout(DEADLINE)
                assert read_until_eof(silent) == b""  # dropped without a byte
                assert time.monotonic() - t0 >= timeout - 0.05  # ... and not before its deadline
                assert prefill.ready_peers() == ["decode-0"]
                serve_one(prefill, src, honest, dst, "decode-0", seed=2)
        finally:
            silent.close()


@pytest.mark.parametrize("send, stalls, flight", [
    (b"\x16\x03", True, False),
    ("all but one byte of a ClientHello", True, False),
    ("a whole ClientHello, never the Finished", True, True),
    (b"hello?", False, False),
    ("a plaintext frame", False, False),
], ids=["half-a-record-header", "stalled-hello", "no-finished", "junk", "no-tls"])
def test_a_client_stalling_in_or_skipping_the_tls_handshake_is_dropped(monkeypatch, send, stalls, flight):
    """Stalled: dropped at its deadline, having been sent at most the prefill's own flight
    (ServerHello, then the encrypted rest of its handshake).  Not TLS at all: dropped at once."""
    timeout = 2.0  # long enough that "at once" holds on a busy host
    monkeypatch.setattr(kvlend.protocol.prefill, "AUTH_TIMEOUT", timeout)
    hello = client_hello()
    send = {"all but one byte of a ClientHello": hello[:-1], "a whole ClientHello, never the Finished": hello,
            "a plaintext frame": encode_frame(Handshake(b"layout", "nixl", b"meta"))}.get(send, send)
    with prefill_node() as (prefill, _):
        with socket.create_connection(prefill.address, timeout=DEADLINE) as sock:
            t0 = time.monotonic()
            sock.sendall(send)
            reply = read_until_eof(sock)
            elapsed = time.monotonic() - t0
        assert (timeout - 0.05 <= elapsed < DEADLINE) if stalls else (elapsed < timeout), elapsed
        types = records(reply)
        if flight:
            assert types[0] == 0x16 and set(types) <= {0x14, 0x16, 0x17}, types
        else:
            assert set(types) <= {0x15}, types  # an alert at most: no server flight, no frame
        assert prefill.ready_peers() == []


def test_a_second_decode_presenting_a_live_identity_is_refused_and_the_first_keeps_working():
    with prefill_node() as (prefill, src):
        with decode_node(creds("decode-0", "decode")) as (first, dst):
            first.connect(*prefill.address)
            assert prefill.wait_for_peer(DEADLINE) == "decode-0"
            with decode_node(creds("decode-0", "decode")) as (impostor, _):
                with pytest.raises(KvlendError, match="decode-0") as info:
                    impostor.connect(*prefill.address)
                assert isinstance(info.value, ProtocolError) and not isinstance(info.value, TransferTimeout)
                assert "already connected" in str(info.value)
            assert prefill.ready_peers() == ["decode-0"]
            serve_one(prefill, src, first, dst, "decode-0", seed=3)
        # Once the live one is gone, a restarted decode may take the identity.
        wait_until(lambda: prefill.ready_peers() == [], "the first decode's link dropped")
        with decode_node(creds("decode-0", "decode")) as (restarted, dst):
            restarted.connect(*prefill.address)
            assert prefill.wait_for_peer(DEADLINE) == "decode-0"
            serve_one(prefill, src, restarted, dst, "decode-0", seed=4)
