"""The sans-IO ``Connection``: framing over a channel the shell authenticated, two ends fed each other's bytes.

No sockets and no clock.  TLS 1.3 (tested in ``test_tls``) gives the peer's
identity, integrity and order; the connection's own contract is that it
takes no bytes and sends nothing until ``authenticate`` names the peer, is
authenticated exactly once, frames every message both ways whatever the
split of the byte stream, and refuses oversized or malformed frames.
"""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvlend.errors import PeerProtocolError, ProtocolError, UsageError
from kvlend.protocol.codes import Code
from kvlend.protocol.connection import AUTH_TIMEOUT, Connection
from kvlend.protocol.wire import MAX_FRAME_BYTES, PROTOCOL_VERSION, Bye, Handshake, Heartbeat, encode_frame
from tests.support.profiles import examples
from tests.support.wire import LID, SAMPLES, decode_all, wire_bytes

pytestmark = pytest.mark.unit

NOW = 1000.0
FEW = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ helpers
def authenticated(identity: str) -> Connection:
    conn = Connection(NOW)
    conn.authenticate(identity)
    return conn


def pair() -> tuple[Connection, Connection]:
    """The decode's and the prefill's ends, each told who the other is."""
    return authenticated("prefill-0"), authenticated("decode-0")


def pump(a: Connection, b: Connection) -> tuple[list, list]:
    """Move bytes both ways until neither has any to send; the messages each side received."""
    got_a, got_b = [], []
    while True:
        to_b, to_a = a.data_to_send(), b.data_to_send()
        if not to_a and not to_b:
            return got_a, got_b
        if to_b:
            got_b += b.receive(to_b)
        if to_a:
            got_a += a.receive(to_a)


def cut(data: bytes, points: list[int]) -> list[bytes]:
    points = sorted({p for p in points if 0 < p < len(data)})
    return [data[i:j] for i, j in zip([0, *points], [*points, len(data)])]


# ------------------------------------------------------- before authenticate
def test_a_new_connection_knows_no_peer_and_has_a_handshake_deadline():
    conn = Connection(NOW)
    assert not conn.ready and conn.peer is None
    assert conn.deadline == NOW + AUTH_TIMEOUT
    assert Connection(12.5, timeout=0.25).deadline == 12.75
    assert conn.data_to_send() == b""  # nothing of its own to say: TLS opens the channel


@pytest.mark.parametrize("data", [b"\x00\x00\x00\x05hello", encode_frame(Bye(Code.OK, "early")), b"\x16\x03\x01"],
                         ids=["junk", "a-valid-frame", "a-tls-record-header"])
def test_bytes_before_authenticate_are_refused(data):
    conn = Connection(NOW)
    with pytest.raises(PeerProtocolError, match="before the peer was authenticated"):
        conn.receive(data)
    assert not conn.ready and conn.data_to_send() == b""
    conn.authenticate("decode-0")  # nothing of the refused bytes was kept
    assert conn.receive(encode_frame(Bye(Code.OK, "after"))) == [Bye(Code.OK, "after")]


def test_send_before_authenticate_raises_and_queues_nothing():
    conn = Connection(NOW)
    with pytest.raises(UsageError, match="before the peer is authenticated"):
        conn.send(Bye(Code.OK, "too early"))
    assert conn.data_to_send() == b""


@pytest.mark.parametrize("identity", ["", None, b"decode-0", 7])
def test_an_empty_or_non_string_identity_is_refused(identity):
    conn = Connection(NOW)
    with pytest.raises(UsageError, match="non-empty string"):
        conn.authenticate(identity)
    assert not conn.ready and conn.peer is None
    with pytest.raises(PeerProtocolError):
        conn.receive(encode_frame(Bye(Code.OK, "still refused")))


@pytest.mark.parametrize("again", ["decode-0", "decode-1"], ids=["same", "other"])
def test_authenticate_twice_is_refused_and_keeps_the_first_identity(again):
    conn = authenticated("decode-0")
    with pytest.raises(UsageError, match="already authenticated as 'decode-0'"):
        conn.authenticate(again)
    assert conn.ready and conn.peer == "decode-0"


# --------------------------------------------------------------- honest use
def test_authenticate_names_the_peer_and_opens_the_channel():
    decode_end, prefill_end = pair()
    assert decode_end.peer == "prefill-0" and prefill_end.peer == "decode-0"
    assert decode_end.ready and prefill_end.ready
    assert decode_end.data_to_send() == prefill_end.data_to_send() == b""


def test_every_message_crosses_both_ways_in_order():
    a, b = pair()
    for m in SAMPLES:
        a.send(m)
        b.send(m)
    got_a, got_b = pump(a, b)
    for got in (got_a, got_b):
        assert [type(m) for m in got] == [type(m) for m in SAMPLES]
        assert [wire_bytes(m) for m in got] == [wire_bytes(m) for m in SAMPLES]


def test_what_is_sent_is_exactly_the_frames_of_the_messages():
    a, _ = pair()
    a.send(Bye(Code.OK, "one"))
    a.send(Heartbeat((LID,)))
    assert a.data_to_send() == encode_frame(Bye(Code.OK, "one")) + encode_frame(Heartbeat((LID,)))


def test_many_queued_messages_come_out_in_order_from_one_receive():
    a, b = pair()
    for i in range(200):
        a.send(Bye(Code.OK, str(i)))
    data = a.data_to_send()
    assert a.data_to_send() == b""  # taken once
    assert [m.detail for m in b.receive(data)] == [str(i) for i in range(200)]


BIG = Handshake(bytes(range(256)) * 8000, "nixl", b"m" * 1000)  # ~2 MB: many TLS records' worth


@FEW
@given(data=st.data())
def test_any_split_of_either_byte_stream_yields_the_same_messages(data):
    a, b = pair()
    sent = [Bye(Code.OK, "a"), BIG, Heartbeat((LID,)), Bye(Code.OK, "b")]
    for src, dst in ((a, b), (b, a)):
        for m in sent:
            src.send(m)
        stream = src.data_to_send()
        points = data.draw(st.lists(st.integers(0, len(stream)), max_size=30), "stream cuts")
        got = []
        for piece in cut(stream, points):
            got += dst.receive(piece)
        assert got == sent


def test_a_stream_fed_one_byte_at_a_time_yields_the_same_messages():
    a, b = pair()
    a.send(Bye(Code.OK, "slowly"))
    a.send(Heartbeat((LID,)))
    got = []
    for byte in a.data_to_send():
        got += b.receive(bytes([byte]))
    assert got == [Bye(Code.OK, "slowly"), Heartbeat((LID,))]
    assert b.receive(b"") == []


# -------------------------------------------------------------------- caps
def test_an_oversized_length_header_is_refused_at_once():
    _, b = pair()
    with pytest.raises(ProtocolError, match=f"frame length {0xFFFFFFFF} outside"):
        b.receive(b"\xff\xff\xff\xff")  # refused on the header alone: nothing waits for 4 GiB
    _, b = pair()
    assert b.receive(b"\xff\xff") == []
    with pytest.raises(ProtocolError, match="outside"):
        b.receive(b"\xff\xff")


@pytest.mark.parametrize("claim", [MAX_FRAME_BYTES + 1, 0])
def test_a_length_outside_the_cap_is_refused(claim):
    _, b = pair()
    with pytest.raises(ProtocolError, match="outside"):
        b.receive(struct.pack(">I", claim) + b"\x00" * 64)


def test_a_length_at_the_cap_is_buffered_not_refused():
    _, b = pair()
    assert b.receive(struct.pack(">I", MAX_FRAME_BYTES) + b"\x00" * 1000) == []


def test_a_message_too_large_to_frame_is_refused_and_queues_nothing():
    a, b = pair()
    a.send(Bye(Code.OK, "before"))
    with pytest.raises(UsageError, match="exceeds the cap"):
        a.send(Handshake(b"\x00" * MAX_FRAME_BYTES, "nixl", b""))
    a.send(Bye(Code.OK, "after"))
    assert b.receive(a.data_to_send()) == [Bye(Code.OK, "before"), Bye(Code.OK, "after")]


# ------------------------------------------------------------ hostile bytes
JUNK = st.one_of(
    st.binary(min_size=4, max_size=300),  # raw noise: mostly refused by the length header
    st.builds(lambda n, body: struct.pack(">I", n) + body, st.integers(0, 400), st.binary(max_size=300)),
)


@FEW
@given(junk=JUNK)
def test_random_bytes_are_refused_or_wait_never_garbage_messages(junk):
    _, b = pair()
    (n,) = struct.unpack_from(">I", junk)
    if not 0 < n <= MAX_FRAME_BYTES:
        with pytest.raises(ProtocolError, match="outside"):
            b.receive(junk)
        return
    rest = max(0, 4 + n - len(junk))
    if rest > 1 << 16:
        assert b.receive(junk) == []  # waits for the claimed bytes, delivering nothing
        return
    try:
        got = b.receive(junk + b"\x00" * rest)
    except ProtocolError:
        return
    # Noise that happens to be well formed is a message every check passed: it travels again unchanged.
    assert [wire_bytes(m) for m in decode_all(b"".join(map(encode_frame, got)))] == [wire_bytes(m) for m in got]


def test_a_frame_of_another_protocol_version_is_refused():
    _, b = pair()
    payload = msgpack.packb([PROTOCOL_VERSION - 1, 0, Bye(Code.OK, "v1").to_wire()], use_bin_type=True)
    with pytest.raises(ProtocolError, match=r"\[version, message\]"):
        b.receive(struct.pack(">I", len(payload)) + payload)
