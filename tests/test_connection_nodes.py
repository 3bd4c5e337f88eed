"""The control channel's defences at node level, over real NIXL agents (UCX on DRAM) and loopback TCP.

A started ``PrefillNode`` faces a decode with the wrong secret, a silent TCP
client and a decode claiming a live peer's name; each is refused with a
typed error while an honest decode connects and reads a lease byte-exact.
"""

from __future__ import annotations

import contextlib
import socket
import time

import numpy as np
import pytest
from conftest import FreeList, group_layers, make_layout, make_pools, nixl, pattern, prefill_request, slots

import kvlend.protocol.prefill
from kvlend.errors import AuthError, KvlendError, PeerLost, ProtocolError, TransferTimeout
from kvlend.protocol.wire import Hello, encode_frame
from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode
from kvlend.runtime.secret import generate_secret

DEADLINE = 10.0  # seconds any single wait may take before the test fails
PAGES = 64
TOKENS = 40  # 10 token pages
CONFIG = NodeConfig(handshake_timeout=5.0, transfer_timeout=DEADLINE)


@contextlib.contextmanager
def prefill_node(secret: bytes):
    src = make_pools(PAGES)
    node = PrefillNode(make_layout(src, windowed=False), nixl("prefill"), secret, name="prefill-0")
    try:
        node.start()
        yield node, src
    finally:
        node.close()
        node.backend.close()


@contextlib.contextmanager
def decode_node(secret: bytes, name: str):
    dst = make_pools(PAGES)
    node = DecodeNode(make_layout(dst, windowed=False), nixl(name), secret, name=name, config=CONFIG)
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


def wait_until(done, what: str, deadline: float = DEADLINE) -> None:
    end = time.monotonic() + deadline
    while not done():
        assert time.monotonic() < end, f"{what}: not within {deadline} s"
        time.sleep(0.01)


def read_until_eof(sock: socket.socket) -> bytes:
    """Everything the peer sends before closing (a reset counts as the close); times out, never hangs."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def test_a_decode_with_the_wrong_secret_is_refused_and_the_prefill_keeps_serving():
    secret = generate_secret()
    with prefill_node(secret) as (prefill, src):
        with decode_node(generate_secret(), "intruder") as (intruder, _):
            t0 = time.monotonic()
            with pytest.raises(KvlendError) as info:
                intruder.connect(*prefill.address)
            # Typed, and at once: the prefill closes on the bad hello, it does not let the intruder time out.
            assert isinstance(info.value, (PeerLost, AuthError)), repr(info.value)
            assert time.monotonic() - t0 < CONFIG.handshake_timeout
        assert prefill.ready_peers() == []
        with decode_node(secret, "decode-0") as (honest, dst):
            link = honest.connect(*prefill.address)
            assert link.peer == "prefill-0"
            assert prefill.wait_for_peer(DEADLINE) == "decode-0"
            serve_one(prefill, src, honest, dst, "decode-0", seed=1)


def test_a_silent_client_is_dropped_after_the_hello_timeout_while_an_honest_decode_connects(monkeypatch):
    timeout = 1.0
    monkeypatch.setattr(kvlend.protocol.prefill, "HELLO_TIMEOUT", timeout)  # what PrefillSession.accept passes
    secret = generate_secret()
    with prefill_node(secret) as (prefill, src):
        t0 = time.monotonic()
        silent = socket.create_connection(prefill.address, timeout=DEADLINE)  # never sends a hello
        try:
            with decode_node(secret, "decode-0") as (honest, dst):
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


@pytest.mark.parametrize("send, replies", [
    (b"\x00\x00", 0),
    (b"hello?", 0),
    ("all but one byte of a hello", 0),
    ("a whole hello, never the confirm", 1),
], ids=["half-a-header", "junk", "stalled-hello", "no-confirm"])
def test_a_client_stalling_in_the_hello_is_dropped_at_its_deadline(monkeypatch, send, replies):
    timeout = 0.3
    monkeypatch.setattr(kvlend.protocol.prefill, "HELLO_TIMEOUT", timeout)
    secret = generate_secret()
    hello = encode_frame(secret, 0, Hello("stalls", b"\x02" * 16))
    send = {"all but one byte of a hello": hello[:-1], "a whole hello, never the confirm": hello}.get(send, send)
    with prefill_node(secret) as (prefill, _):
        with socket.create_connection(prefill.address, timeout=DEADLINE) as sock:
            t0 = time.monotonic()
            sock.sendall(send)
            answer = read_until_eof(sock)
            assert time.monotonic() - t0 < DEADLINE
        frames, i = 0, 0
        while i < len(answer):
            i += 4 + int.from_bytes(answer[i:i + 4], "big")
            frames += 1
        assert i == len(answer) and frames == replies  # the ack, for a hello keyed right; nothing else
        assert prefill.ready_peers() == []


def test_a_second_decode_claiming_a_live_name_is_refused_and_the_first_keeps_working():
    secret = generate_secret()
    with prefill_node(secret) as (prefill, src):
        with decode_node(secret, "decode-0") as (first, dst):
            first.connect(*prefill.address)
            assert prefill.wait_for_peer(DEADLINE) == "decode-0"
            with decode_node(secret, "decode-0") as (impostor, _):
                with pytest.raises(KvlendError, match="decode-0") as info:
                    impostor.connect(*prefill.address)
                assert isinstance(info.value, ProtocolError) and not isinstance(info.value, TransferTimeout)
                assert "already connected" in str(info.value)
            assert prefill.ready_peers() == ["decode-0"]
            serve_one(prefill, src, first, dst, "decode-0", seed=3)
        # Once the live one is gone, a restarted decode may take the name.
        wait_until(lambda: prefill.ready_peers() == [], "the first decode's link dropped")
        with decode_node(secret, "decode-0") as (restarted, dst):
            restarted.connect(*prefill.address)
            assert prefill.wait_for_peer(DEADLINE) == "decode-0"
            serve_one(prefill, src, restarted, dst, "decode-0", seed=4)
