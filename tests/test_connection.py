"""The sans-IO ``Connection``: hello, key schedule and framing, two ends fed each other's bytes in memory.

No sockets and no clock: a client and a server are handed each other's
output, so every security property of the control channel (authentication,
replay, reflection, ordering, caps, hostile bytes) is checked exactly and fast.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from test_wire import LID, SAMPLES, wire_bytes

from kvlend.errors import AuthError, ProtocolError
from kvlend.protocol.connection import HELLO_FRAME_BYTES, HELLO_TIMEOUT, Connection, ack_key
from kvlend.protocol.wire import (
    MAC_BYTES, MAX_FRAME_BYTES, NONCE_BYTES, Bye, FrameDecoder, Handshake, Heartbeat, Hello, HelloAck,
    HelloConfirm, encode_frame, session_key,
)

SECRET = bytes(range(32))
WRONG = bytes(range(1, 33))
NOW = 1000.0
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ helpers
def client(secret: bytes = SECRET, name: str = "decode-0") -> Connection:
    return Connection("client", secret, name, NOW)


def server(secret: bytes = SECRET, name: str = "prefill-0") -> Connection:
    return Connection("server", secret, name, NOW)


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


def pair(name: str = "decode-0") -> tuple[Connection, Connection]:
    c, s = client(name=name), server()
    assert pump(c, s) == ([], [])  # the hello frames never come out as messages
    assert c.ready and s.ready
    return c, s


def split_frames(data: bytes) -> list[bytes]:
    frames, i = [], 0
    while i < len(data):
        n = struct.unpack_from(">I", data, i)[0]
        frames.append(bytes(data[i:i + 4 + n]))
        i += 4 + n
    assert i == len(data)
    return frames


def decode_one(key: bytes, frame: bytes, seq: int = 0):
    dec = FrameDecoder(key)
    dec.expected_seq = seq
    dec.feed(frame)
    return dec.next_message()


def transcript(messages=(Bye("session one"), Heartbeat((LID,)))) -> tuple[list[bytes], list[bytes]]:
    """A whole honest session as raw frames: (client -> server, server -> client)."""
    c, s = client(), server()
    c2s, s2c = [], []
    hello = c.data_to_send()
    c2s.append(hello)
    s.receive(hello)
    ack = s.data_to_send()
    s2c.append(ack)
    c.receive(ack)
    for m in messages:
        c.send(m)
    rest = c.data_to_send()
    assert s.receive(rest) == list(messages)
    return split_frames(hello) + split_frames(rest), split_frames(ack)


def hello_from(name: str = "replayer", nonce: bytes = b"\x07" * NONCE_BYTES, key: bytes = SECRET) -> bytes:
    return encode_frame(key, 0, Hello(name, nonce))


def cut(data: bytes, points: list[int]) -> list[bytes]:
    points = sorted({p for p in points if 0 < p < len(data)})
    return [data[i:j] for i, j in zip([0, *points], [*points, len(data)])]


# --------------------------------------------------------------- honest use
def test_hello_completes_and_each_side_learns_the_others_name():
    c, s = pair()
    assert c.peer == "prefill-0" and s.peer == "decode-0"
    assert c.role == "client" and s.role == "server"
    assert c.data_to_send() == s.data_to_send() == b""


def test_the_hello_takes_exactly_three_frames():
    c, s = client(), server()
    hello = c.data_to_send()
    assert len(split_frames(hello)) == 1 and not c.ready
    assert s.receive(hello) == [] and not s.ready
    ack = s.data_to_send()
    assert len(split_frames(ack)) == 1
    assert c.receive(ack) == [] and c.ready
    confirm = c.data_to_send()
    assert len(split_frames(confirm)) == 1
    assert s.receive(confirm) == [] and s.ready


def test_every_message_crosses_both_ways_in_order():
    c, s = pair()
    for m in SAMPLES:
        c.send(m)
        s.send(m)
    got_c, got_s = pump(c, s)
    for got in (got_c, got_s):
        assert [type(m) for m in got] == [type(m) for m in SAMPLES]
        assert [wire_bytes(m) for m in got] == [wire_bytes(m) for m in SAMPLES]


def test_many_queued_messages_come_out_in_order_from_one_receive():
    c, s = pair()
    for i in range(200):
        c.send(Bye(str(i)))
    data = c.data_to_send()
    assert c.data_to_send() == b""  # taken once
    assert [m.reason for m in s.receive(data)] == [str(i) for i in range(200)]


def test_the_confirm_and_first_messages_may_arrive_with_the_hello_exchange_in_one_chunk():
    c, s = client(), server()
    s.receive(c.data_to_send())
    c.receive(s.data_to_send())
    c.send(Bye("right behind the confirm"))
    assert s.receive(c.data_to_send()) == [Bye("right behind the confirm")]
    assert s.ready


BIG = Handshake(bytes(range(256)) * 8000, "nixl", b"m" * 1000)  # ~2 MB: many socket reads' worth


@FEW
@given(data=st.data())
def test_any_split_of_either_byte_stream_yields_the_same_messages(data):
    c, s = client(), server()
    hello = c.data_to_send()
    for piece in cut(hello, data.draw(st.lists(st.integers(0, len(hello)), max_size=8), "hello cuts")):
        assert s.receive(piece) == []
    ack = s.data_to_send()
    for piece in cut(ack, data.draw(st.lists(st.integers(0, len(ack)), max_size=8), "ack cuts")):
        assert c.receive(piece) == []
    sent = [Bye("a"), BIG, Heartbeat((LID,)), Bye("b")]
    for src, dst in ((c, s), (s, c)):  # the client's stream opens with the confirm
        for m in sent:
            src.send(m)
        stream = src.data_to_send()
        points = data.draw(st.lists(st.integers(0, len(stream)), max_size=30), "stream cuts")
        got = []
        for piece in cut(stream, points):
            got += dst.receive(piece)
        assert got == sent
    assert s.ready and c.ready


def test_a_stream_fed_one_byte_at_a_time_yields_the_same_messages():
    c, s = client(), server()
    for b in c.data_to_send():
        assert s.receive(bytes([b])) == []
    for b in s.data_to_send():
        assert c.receive(bytes([b])) == []
    c.send(Bye("slowly"))
    c.send(Heartbeat((LID,)))
    got = []
    for b in c.data_to_send():
        got += s.receive(bytes([b]))
    assert got == [Bye("slowly"), Heartbeat((LID,))]


# ------------------------------------------------------------ construction
def test_deadline_is_now_plus_timeout():
    assert Connection("client", SECRET, "d", 12.5, timeout=0.25).deadline == 12.75
    assert Connection("server", SECRET, "p", 3.0).deadline == 3.0 + HELLO_TIMEOUT


def test_an_unknown_role_is_refused():
    with pytest.raises(ProtocolError, match="role"):
        Connection("peer", SECRET, "x", NOW)


@pytest.mark.parametrize("make", [client, server], ids=["client", "server"])
def test_send_before_ready_raises_and_queues_nothing(make):
    conn = make()
    before = conn.data_to_send()
    with pytest.raises(ProtocolError, match="before the hello"):
        conn.send(Bye("too early"))
    assert conn.data_to_send() == b""
    assert len(split_frames(before)) == (1 if conn.role == "client" else 0)


def test_send_before_the_server_saw_the_confirm_raises():
    c, s = client(), server()
    s.receive(c.data_to_send())
    with pytest.raises(ProtocolError, match="before the hello"):
        s.send(Bye("ack sent, confirm not yet seen"))


# ------------------------------------------------------- wrong or no secret
def test_wrong_secret_fails_on_both_sides_before_any_message():
    # The server refuses a hello keyed by another secret, and answers nothing.
    c, s = client(WRONG), server(SECRET)
    with pytest.raises(AuthError, match="failed authentication"):
        s.receive(c.data_to_send())
    assert s.data_to_send() == b"" and not s.ready

    # The client refuses an ack from a server holding another secret, even one that
    # saw the client's nonce (a man in the middle re-keying the hello for it).
    c, s = client(SECRET), server(WRONG)
    hello = decode_one(SECRET, c.data_to_send())
    assert s.receive(hello_from(hello.peer, hello.nonce, key=WRONG)) == []
    with pytest.raises(AuthError, match="failed authentication"):
        c.receive(s.data_to_send())
    assert not c.ready and c.peer is None
    assert c.data_to_send() == b""  # no confirm


def test_a_forged_hello_gets_no_reply():
    s = server()
    with pytest.raises(AuthError, match="failed authentication"):
        s.receive(hello_from("intruder", key=WRONG))
    assert s.data_to_send() == b""
    assert not s.ready


def test_the_only_reply_to_a_replayed_hello_is_an_ack_useless_without_the_secret():
    """A valid Hello (replayed) is answered, but only by a HelloAck keyed by the nonce-bound ack key."""
    s = server()
    nonce = b"\x07" * NONCE_BYTES
    assert s.receive(hello_from("replayer", nonce)) == []
    reply = s.data_to_send()
    assert len(split_frames(reply)) == 1
    ack = decode_one(ack_key(SECRET, nonce), reply)
    assert isinstance(ack, HelloAck) and ack.peer == "prefill-0" and len(ack.nonce) == NONCE_BYTES
    with pytest.raises(AuthError):  # not keyed by the bare secret: it cannot pass as anyone's hello
        decode_one(SECRET, reply)
    # Without the secret the replayer cannot produce the confirm: nothing it can compute is accepted.
    for key in (b"", WRONG, ack_key(WRONG, nonce), session_key(WRONG, nonce, ack.nonce, "client"),
                ack_key(SECRET, nonce)):
        probe = server()
        probe.receive(hello_from("replayer", nonce))
        probe.data_to_send()
        with pytest.raises(AuthError):
            probe.receive(encode_frame(key, 1, HelloConfirm()))
        assert not probe.ready
    # Reflecting the ack itself back is no confirm either.
    with pytest.raises(AuthError):
        s.receive(reply)
    assert not s.ready


def test_a_replayed_hello_alone_never_makes_the_server_ready():
    hello = transcript()[0][0]
    s = server()
    assert s.receive(hello) == []
    assert not s.ready
    assert len(split_frames(s.data_to_send())) == 1
    assert s.receive(b"") == [] and not s.ready
    with pytest.raises(ProtocolError):  # a second copy of the hello is no confirm
        s.receive(hello)
    assert not s.ready


@pytest.mark.parametrize("first", [
    HelloAck("confused", b"\x07" * NONCE_BYTES), HelloConfirm(), Handshake(b"l", "nixl", b"m"), Bye("hi"),
], ids=lambda m: m.TYPE)
def test_a_first_frame_other_than_hello_is_refused_by_the_server(first):
    s = server()
    with pytest.raises(ProtocolError, match="expected hello, got") as info:
        s.receive(encode_frame(SECRET, 0, first))
    assert not isinstance(info.value, AuthError)  # keyed right: refused for what it is
    assert s.data_to_send() == b"" and not s.ready


@pytest.mark.parametrize("first", [
    Hello("confused", b"\x07" * NONCE_BYTES), HelloConfirm(), Bye("hi"),
], ids=lambda m: m.TYPE)
def test_a_first_frame_other_than_hello_ack_is_refused_by_the_client(first):
    c = client()
    hello = decode_one(SECRET, c.data_to_send())
    with pytest.raises(ProtocolError, match="expected hello_ack, got"):
        c.receive(encode_frame(ack_key(SECRET, hello.nonce), 0, first))
    assert not c.ready and c.data_to_send() == b""


def test_an_ack_keyed_for_another_nonce_or_the_bare_secret_is_refused():
    other_ack = transcript()[1][0]  # a real ack, from another session
    for ack in (other_ack,
                encode_frame(ack_key(SECRET, b"\x05" * NONCE_BYTES), 0, HelloAck("impostor", b"\x05" * 16)),
                encode_frame(SECRET, 0, HelloAck("impostor", b"\x05" * 16))):
        c = client()
        c.data_to_send()
        with pytest.raises(AuthError, match="failed authentication"):
            c.receive(ack)
        assert not c.ready and c.peer is None and c.data_to_send() == b""


def test_a_frame_other_than_the_confirm_after_the_ack_is_refused():
    c = client()
    hello = decode_one(SECRET, c.data_to_send())
    s = server()
    s.receive(hello_from(hello.peer, hello.nonce))
    ack = decode_one(ack_key(SECRET, hello.nonce), s.data_to_send())
    key = session_key(SECRET, hello.nonce, ack.nonce, "client")
    with pytest.raises(ProtocolError, match="expected hello_confirm, got bye"):
        s.receive(encode_frame(key, 1, Bye("skipping the confirm")))
    assert not s.ready


def test_junk_instead_of_the_confirm_gives_no_ready_server():
    s = server()
    s.receive(hello_from("half", b"\x09" * NONCE_BYTES))
    assert len(split_frames(s.data_to_send())) == 1  # only the ack
    with pytest.raises(AuthError):
        s.receive(struct.pack(">I", 40) + b"\xaa" * 40)
    assert not s.ready and s.data_to_send() == b""


# ------------------------------------------------------ replay and reflection
def test_frames_replayed_from_another_session_are_auth_errors():
    c2s, _ = transcript()
    assert len(c2s) == 4  # hello, hello_confirm, bye, heartbeat

    # Into a live session, at the very sequence number it expects next (2 after the hello).
    for frame in c2s[1:]:
        _, live = pair()
        with pytest.raises(AuthError, match="failed authentication"):
            live.receive(frame)
    c, live = pair()
    c.send(Bye("live"))
    assert live.receive(c.data_to_send()) == [Bye("live")]
    with pytest.raises(AuthError, match="failed authentication"):
        live.receive(c2s[3])  # seq 3, the one it now expects

    # The whole session replayed to a fresh server: the hello is answered, but no session results.
    fresh = server()
    with pytest.raises(AuthError, match="failed authentication"):
        fresh.receive(b"".join(c2s))
    assert not fresh.ready
    assert len(split_frames(fresh.data_to_send())) == 1  # the ack, which the replayer cannot use

    # And the server's frames of that session replayed to a fresh client.
    _, s2c = transcript()
    fresh_client = client()
    with pytest.raises(AuthError):
        fresh_client.receive(s2c[0])
    assert not fresh_client.ready


def test_a_frame_reflected_back_to_its_sender_fails():
    c, s = pair()
    s.send(Bye("first"))
    s.send(Bye("second"))  # same sequence number as the client's next frame
    _, second = split_frames(s.data_to_send())
    with pytest.raises(AuthError, match="failed authentication"):
        s.receive(second)

    c, s = pair()
    c.send(Bye("mine"))
    with pytest.raises(AuthError, match="failed authentication"):
        c.receive(c.data_to_send())


def test_a_replayed_frame_within_the_session_fails():
    c, s = pair()
    c.send(Bye("once"))
    frame = c.data_to_send()
    assert s.receive(frame) == [Bye("once")]
    with pytest.raises(AuthError, match="sequence"):
        s.receive(frame)


def test_a_skipped_sequence_number_fails():
    c, s = pair()
    c.send(Bye("in order"))
    assert s.receive(c.data_to_send()) == [Bye("in order")]
    c._send_seq += 1
    c.send(Bye("skipped one"))
    with pytest.raises(AuthError, match="sequence"):
        s.receive(c.data_to_send())


def test_reordered_frames_fail():
    c, s = pair()
    c.send(Bye("one"))
    c.send(Bye("two"))
    one, two = split_frames(c.data_to_send())
    with pytest.raises(AuthError, match="sequence"):
        s.receive(two + one)


def test_a_flipped_mac_bit_fails():
    c, s = pair()
    c.send(Bye("crafted"))
    good = c.data_to_send()
    c._send_seq -= 1
    c.send(Bye("crafted"))
    bad = bytearray(c.data_to_send())
    assert bytes(bad) == good
    bad[-1] ^= 0x01
    with pytest.raises(AuthError, match="failed authentication"):  # one bit breaks it ...
        s.receive(bytes(bad))
    c2, s2 = pair()
    c2.send(Bye("crafted"))
    assert s2.receive(c2.data_to_send()) == [Bye("crafted")]  # ... where the frame itself was right


@FEW
@given(st.data())
def test_no_single_bit_flip_anywhere_in_a_frame_passes(data):
    c, s = pair()
    c.send(Heartbeat((LID,)))
    frame = bytearray(c.data_to_send())
    bit = data.draw(st.integers(0, 8 * len(frame) - 1), "bit")
    frame[bit // 8] ^= 1 << (bit % 8)
    try:
        got = s.receive(bytes(frame))
    except ProtocolError:
        return
    assert got == []  # a length flipped upward: still waiting for bytes, nothing delivered
    assert bit < 32


# ------------------------------------------------------------ hostile bytes
@pytest.mark.parametrize("ready", [False, True], ids=["before-hello", "after-hello"])
def test_an_oversized_length_header_is_refused_at_once(ready):
    s = pair()[1] if ready else server()
    with pytest.raises(ProtocolError, match=f"frame length {0xFFFFFFFF} outside"):
        s.receive(b"\xff\xff\xff\xff")  # refused on the header alone: nothing waits for 4 GiB
    s = pair()[1] if ready else server()
    assert s.receive(b"\xff\xff") == []
    with pytest.raises(ProtocolError, match="outside"):
        s.receive(b"\xff\xff")


def test_a_length_just_over_the_cap_is_refused():
    _, s = pair()
    with pytest.raises(ProtocolError, match="outside"):
        s.receive(struct.pack(">I", MAX_FRAME_BYTES + 1) + b"\x00" * 64)


def test_a_length_too_short_to_hold_a_mac_is_refused():
    _, s = pair()
    with pytest.raises(ProtocolError, match="outside"):
        s.receive(struct.pack(">I", MAC_BYTES) + b"\x00" * MAC_BYTES)


@pytest.mark.parametrize("make", [server, client])
def test_before_the_hello_completes_frames_are_capped_at_a_few_kib(make):
    """A peer that has proved nothing gets no megabyte buffers: 256 of them cost at most a few MiB."""
    c = make()
    with pytest.raises(ProtocolError, match="outside"):
        c.receive(struct.pack(">I", HELLO_FRAME_BYTES + 1))
    assert make().receive(struct.pack(">I", HELLO_FRAME_BYTES) + b"\x00" * 10) == []


def test_a_length_at_the_cap_is_buffered_not_refused():
    _, s = pair()
    assert s.receive(struct.pack(">I", MAX_FRAME_BYTES) + b"\x00" * 1000) == []


@FEW
@given(body=st.binary(min_size=MAC_BYTES + 1, max_size=400))
def test_a_plausible_frame_of_random_bytes_after_the_hello_is_an_auth_error(body):
    _, s = pair()
    with pytest.raises(AuthError):
        s.receive(struct.pack(">I", len(body)) + body)
    assert s.data_to_send() == b""


JUNK = st.one_of(
    st.binary(min_size=4, max_size=300),  # raw noise: mostly refused by the length header
    st.builds(lambda n, body: struct.pack(">I", n) + body, st.integers(0, 400), st.binary(max_size=300)),
)


@FEW
@given(junk=JUNK, before=st.booleans())
def test_random_bytes_are_protocol_errors_never_messages(junk, before):
    s = server() if before else pair()[1]
    (n,) = struct.unpack_from(">I", junk)
    if not MAC_BYTES < n <= MAX_FRAME_BYTES:
        with pytest.raises(ProtocolError, match="outside"):
            s.receive(junk)
        return
    rest = max(0, 4 + n - len(junk))
    if rest > 1 << 16:
        assert s.receive(junk) == []  # waits for the claimed bytes, delivering nothing
        return
    with pytest.raises(ProtocolError):
        s.receive(junk + b"\x00" * rest)
    if before:
        assert not s.ready and s.data_to_send() == b""


@FEW
@given(junk=st.binary(min_size=1, max_size=300))
def test_random_bytes_to_a_fresh_client_never_make_it_ready(junk):
    c = client()
    c.data_to_send()
    try:
        assert c.receive(junk) == []
    except ProtocolError:
        pass
    assert not c.ready and c.data_to_send() == b""
