"""Control channel over real sockets on 127.0.0.1: hello, authentication, hostile and silent peers.

Every blocking call has a deadline, and calls that could hang run on a
``Background`` thread that fails the test instead of hanging it.
"""

import logging
import os
import random
import resource
import select
import socket
import struct
import threading
import time

import pytest
from test_wire import LID, SAMPLES, wire_bytes

from kvlend import control
from kvlend.control import SECRET_ENV, SECRET_FILE_ENV, Listener, connect, generate_secret, load_secret
from kvlend.errors import AuthError, KvlendError, PeerLost, ProtocolError, TransferTimeout
from kvlend.wire import MAX_FRAME_BYTES, Bye, Handshake, Heartbeat, Hello, HelloAck, encode_frame

SECRET = bytes(range(32))
WRONG = bytes(range(1, 33))
HANG = 10.0  # a guard, not an expectation: anything that takes this long has hung


class Background:
    """Runs ``fn`` on a daemon thread; ``result()`` re-raises its error, or fails if it hung."""

    def __init__(self, fn, *args, **kwargs) -> None:
        self._out = {}

        def run():
            try:
                self._out["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the test thread by result()
                self._out["error"] = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self, timeout: float = HANG):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "background call hung"
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


def open_pair(listener, port=None, name="decode-0"):
    server = Background(listener.accept, HANG)
    client = connect("127.0.0.1", port or listener.port, SECRET, name, timeout=HANG)
    channel = server.result()
    assert channel is not None
    return client, channel


@pytest.fixture
def listener():
    lst = Listener(SECRET, "prefill-0")
    yield lst
    lst.close()


@pytest.fixture
def pair(listener):
    client, server = open_pair(listener)
    yield client, server
    client.close()
    server.close()


@pytest.fixture
def quick_hello(monkeypatch):
    monkeypatch.setattr(control, "HELLO_TIMEOUT", 0.3)


def raw_socket(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG)
    sock.settimeout(HANG)
    return sock


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


def read_raw_frames(sock: socket.socket, count: int) -> list[bytes]:
    """Whole frames straight off a channel's socket, bypassing its decoder."""
    sock.settimeout(HANG)
    try:
        def exact(n):
            out = b""
            while len(out) < n:
                chunk = sock.recv(n - len(out))
                assert chunk, "peer closed mid-frame"
                out += chunk
            return out
        frames = []
        for _ in range(count):
            head = exact(4)
            frames.append(head + exact(struct.unpack(">I", head)[0]))
        return frames
    finally:
        sock.setblocking(False)


def split_frames(data: bytes) -> list[bytes]:
    frames, i = [], 0
    while i < len(data):
        n = struct.unpack_from(">I", data, i)[0]
        frames.append(bytes(data[i:i + 4 + n]))
        i += 4 + n
    return frames


class Proxy:
    """Forwards one TCP connection to ``port`` and records the bytes each way (a wiretap)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.c2s, self.s2c = bytearray(), bytearray()
        self._run = Background(self._forward, port)

    def _forward(self, port: int) -> None:
        self.sock.settimeout(HANG)
        down, _ = self.sock.accept()
        up = socket.create_connection(("127.0.0.1", port), timeout=HANG)
        ends = {down: (up, self.c2s), up: (down, self.s2c)}
        deadline = time.monotonic() + HANG
        with down, up:
            while time.monotonic() < deadline:
                ready, _, _ = select.select(list(ends), [], [], 0.05)
                for s in ready:
                    dst, record = ends[s]
                    data = s.recv(65536)
                    if not data:
                        return
                    record += data
                    dst.sendall(data)

    def finish(self) -> None:
        self._run.result()
        self.sock.close()


# ------------------------------------------------------------------ honest use
def test_pair_exchanges_every_message_both_ways(pair):
    client, server = pair
    assert client.peer == "prefill-0" and server.peer == "decode-0"
    for m in SAMPLES:
        client.send(m)
        got = server.recv(HANG)
        assert type(got) is type(m) and wire_bytes(got) == wire_bytes(m)
        server.send(m)
        got = client.recv(HANG)
        assert type(got) is type(m) and wire_bytes(got) == wire_bytes(m)


def test_queued_messages_come_out_in_order_then_poll_is_empty(pair):
    client, server = pair
    for i in range(50):
        client.send(Bye(str(i)))
    assert [server.recv(HANG).reason for _ in range(50)] == [str(i) for i in range(50)]
    assert server.poll(0.0) is None


def test_a_large_frame_crosses_in_pieces(pair):
    client, server = pair
    big = Handshake(bytes(range(256)) * 40000, "nixl", b"m" * 1000)  # ~10 MB
    sender = Background(client.send, big, HANG)
    got = server.recv(HANG)
    sender.result()
    assert got == big


def test_listener_serves_sessions_one_after_another(listener):
    for name in ("decode-0", "decode-1", "decode-0"):
        client, server = open_pair(listener, name=name)
        assert server.peer == name
        client.send(Bye(name))
        assert server.recv(HANG) == Bye(name)
        client.close()
        server.close()


def test_accept_with_nobody_waiting_returns_none(listener):
    assert listener.accept(0.0) is None
    assert listener.accept(0.05) is None


def test_channels_work_on_descriptors_above_1023(listener):
    """``select`` fails on fds >= FD_SETSIZE; a process running UCX and CUDA easily has that many."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        high = Listener(SECRET, "prefill-high")
        client, server = open_pair(high)
        assert min(high.fileno(), client.fileno(), server.fileno()) > 1023
        client.send(Bye("high"))
        assert server.recv(HANG) == Bye("high")
        server.send(Heartbeat((LID,)))
        assert client.recv(HANG) == Heartbeat((LID,))
        for c in (client, server, high):
            c.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_close_is_idempotent_and_a_closed_channel_raises_peer_lost(pair):
    client, _ = pair
    client.close()
    client.close()
    with pytest.raises(PeerLost):
        client.send(Bye("x"))
    with pytest.raises(PeerLost):
        client.recv(0.1)


# ------------------------------------------------------------ wrong or no secret
def test_wrong_secret_fails_both_sides(listener, caplog):
    server = Background(listener.accept, HANG)
    with pytest.raises(KvlendError) as info:
        connect("127.0.0.1", listener.port, WRONG, "intruder", timeout=HANG)
    assert isinstance(info.value, (PeerLost, AuthError, TransferTimeout))
    assert server.result() is None
    assert "failed authentication" in caplog.text


def test_a_forged_hello_is_dropped_before_any_byte_is_sent(listener, caplog):
    server = Background(listener.accept, HANG)
    attacker = raw_socket(listener.port)
    attacker.sendall(encode_frame(WRONG, 0, Hello("intruder", b"\x07" * 16)))
    assert read_until_eof(attacker) == b""
    attacker.close()
    assert server.result() is None
    assert "failed authentication" in caplog.text


def test_a_hello_ack_or_other_first_frame_is_refused(listener):
    server = Background(listener.accept, HANG)
    attacker = raw_socket(listener.port)
    attacker.sendall(encode_frame(SECRET, 0, HelloAck("confused", b"\x07" * 16)))
    assert read_until_eof(attacker) == b""
    attacker.close()
    assert server.result() is None


def test_connect_rejects_an_ack_keyed_for_someone_else():
    """A server that knows the secret but answers with a frame not bound to our nonce."""
    fake = socket.create_server(("127.0.0.1", 0))
    fake.settimeout(HANG)

    def serve():
        conn, _ = fake.accept()
        with conn:
            conn.settimeout(HANG)
            conn.recv(4096)
            conn.sendall(encode_frame(SECRET, 0, HelloAck("impostor", b"\x05" * 16)))
            read_until_eof(conn)

    bg = Background(serve)
    with pytest.raises(AuthError):
        connect("127.0.0.1", fake.getsockname()[1], SECRET, "decode-0", timeout=HANG)
    bg.result()
    fake.close()


# -------------------------------------------------------- replay and reflection
def test_frames_replayed_from_another_session_are_auth_errors(listener, caplog):
    tap = Proxy(listener.port)
    client1, server1 = open_pair(listener, port=tap.port)
    client1.send(Bye("session one"))
    client1.send(Heartbeat((LID,)))
    assert server1.recv(HANG) == Bye("session one")
    assert server1.recv(HANG) == Heartbeat((LID,))
    client1.close()
    tap.finish()
    server1.close()
    captured = split_frames(bytes(tap.c2s))
    assert len(captured) == 4  # hello, hello_confirm, bye, heartbeat

    # Into a live session 2, at the very sequence number session 2 expects next.
    client2, server2 = open_pair(listener)
    client2.sock.sendall(captured[2])
    with pytest.raises(AuthError, match="failed authentication"):
        server2.recv(HANG)
    client2.close()
    server2.close()

    # The whole of session 1 replayed to the listener: the hello is answered, but no channel results.
    caplog.clear()
    server3 = Background(listener.accept, HANG)
    attacker = raw_socket(listener.port)
    attacker.sendall(b"".join(captured))
    answer = read_until_eof(attacker)
    attacker.close()
    assert server3.result() is None
    assert len(split_frames(answer)) == 1  # the hello_ack, which it cannot use
    assert "failed authentication" in caplog.text


def test_a_replayed_hello_alone_gets_no_channel(listener, quick_hello):
    tap = Proxy(listener.port)
    client, server = open_pair(listener, port=tap.port)
    client.close()
    tap.finish()
    server.close()
    hello = split_frames(bytes(tap.c2s))[0]
    accepting = Background(listener.accept, HANG)
    attacker = raw_socket(listener.port)
    attacker.sendall(hello)
    read_until_eof(attacker)
    attacker.close()
    assert accepting.result() is None


def test_a_frame_reflected_back_to_its_sender_is_an_auth_error(pair):
    client, server = pair
    server.send(Bye("first"))
    server.send(Bye("second"))  # same sequence number as the client's next frame
    _, second = read_raw_frames(client.sock, 2)
    client.sock.sendall(second)
    with pytest.raises(AuthError, match="failed authentication"):
        server.recv(HANG)


def test_a_skipped_sequence_number_is_an_auth_error(pair):
    client, server = pair
    client.send(Bye("in order"))
    assert server.recv(HANG) == Bye("in order")
    client._send_seq += 1
    client.send(Bye("skipped one"))
    with pytest.raises(AuthError, match="sequence"):
        server.recv(HANG)


def test_a_flipped_mac_bit_is_an_auth_error(pair):
    client, server = pair
    good = encode_frame(client._key, client._send_seq, Bye("crafted"))
    client.sock.sendall(good)
    assert server.recv(HANG) == Bye("crafted")  # the crafting is right ...
    bad = bytearray(encode_frame(client._key, client._send_seq + 1, Bye("crafted")))
    bad[-1] ^= 0x01
    client.sock.sendall(bytes(bad))
    with pytest.raises(AuthError, match="failed authentication"):  # ... and one bit breaks it
        server.recv(HANG)


# ------------------------------------------------------------- hostile bytes
def test_an_oversized_length_header_is_refused_at_once(pair):
    client, server = pair
    client.sock.sendall(b"\xff\xff\xff\xff")
    with pytest.raises(ProtocolError, match=f"frame length {0xFFFFFFFF} outside"):
        server.recv(HANG)


def test_a_length_just_over_the_cap_is_refused(pair):
    client, server = pair
    client.sock.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1) + b"\x00" * 64)
    with pytest.raises(ProtocolError, match="outside"):
        server.recv(HANG)


@pytest.mark.parametrize("keep", [1, 3, 4, 20, -1])
def test_a_frame_cut_off_by_a_close_is_peer_lost(pair, keep):
    client, server = pair
    frame = encode_frame(client._key, client._send_seq, Bye("cut short"))
    client.sock.sendall(frame[:keep])
    client.close()
    with pytest.raises(PeerLost):
        server.recv(HANG)


@pytest.mark.parametrize("seed", range(4))
def test_random_bytes_after_a_valid_hello_are_protocol_errors(pair, seed):
    client, server = pair
    rng = random.Random(seed)
    body = bytes(rng.randrange(256) for _ in range(rng.randrange(33, 300)))
    if seed % 2:  # a plausible length, so the MAC check is what refuses it
        junk = struct.pack(">I", len(body)) + body
    else:  # raw noise: the length header refuses it
        junk = bytes([0xF0 | rng.randrange(16)]) + body
    client.sock.sendall(junk)
    with pytest.raises(ProtocolError) as info:
        server.recv(HANG)
    assert isinstance(info.value, AuthError) == bool(seed % 2)


def test_junk_instead_of_the_hello_confirm_gets_no_channel(listener):
    server = Background(listener.accept, HANG)
    sock = raw_socket(listener.port)
    sock.sendall(encode_frame(SECRET, 0, Hello("half", b"\x09" * 16)))
    sock.sendall(struct.pack(">I", 40) + b"\xaa" * 40)
    assert len(split_frames(read_until_eof(sock))) == 1  # only the ack came back
    sock.close()
    assert server.result() is None


# ---------------------------------------------------------------- silent peers
def test_recv_from_a_silent_peer_times_out(pair):
    client, server = pair
    with pytest.raises(TransferTimeout, match="no message"):
        server.recv(0.2)
    assert client.poll(0.0) is None
    client.send(Bye("still fine"))  # a timeout does not break the channel
    assert server.recv(HANG) == Bye("still fine")


def test_connect_to_a_listener_that_never_accepts_times_out(listener):
    attempt = Background(connect, "127.0.0.1", listener.port, SECRET, "decode-0", timeout=0.3)
    with pytest.raises(KvlendError) as info:
        attempt.result()
    assert isinstance(info.value, TransferTimeout)


def test_connect_to_a_closed_port_is_peer_lost():
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(PeerLost, match="cannot connect"):
        connect("127.0.0.1", port, SECRET, "decode-0", timeout=HANG)


@pytest.mark.parametrize("send", [b"", b"\x00\x00", encode_frame(SECRET, 0, Hello("slow", b"\x01" * 16))[:-1]],
                         ids=["nothing", "half a header", "all but one byte"])
def test_accept_drops_a_peer_that_stalls_in_the_hello(listener, quick_hello, send):
    server = Background(listener.accept, HANG)
    sock = raw_socket(listener.port)
    sock.sendall(send)
    assert server.result() is None
    assert read_until_eof(sock) == b""
    sock.close()


def test_accept_drops_a_peer_that_hangs_up_at_once(listener):
    server = Background(listener.accept, HANG)
    raw_socket(listener.port).close()
    assert server.result() is None


def test_the_hello_deadline_covers_the_whole_exchange(listener, quick_hello):
    """A peer with the secret that never sends the confirm is dropped after its ack."""
    server = Background(listener.accept, HANG)
    sock = raw_socket(listener.port)
    sock.sendall(encode_frame(SECRET, 0, Hello("stalls", b"\x02" * 16)))
    assert server.result() is None
    assert len(split_frames(read_until_eof(sock))) == 1
    sock.close()


def test_a_send_the_peer_never_reads_times_out(pair):
    client, _ = pair
    with pytest.raises(TransferTimeout, match="did not finish"):
        client.send(Handshake(b"\x00" * (MAX_FRAME_BYTES - 1000), "nixl", b""), timeout=0.2)


def test_a_vanished_peer_is_peer_lost_for_recv_and_send(pair):
    client, server = pair
    client.close()
    with pytest.raises(PeerLost):
        server.recv(HANG)
    with pytest.raises(PeerLost):
        for _ in range(100000):  # the first sends may still fit in the kernel's buffer
            server.send(Bye("anyone there?"))


# ------------------------------------------------------------------- secrets
def test_generate_secret_is_fresh_and_loadable():
    a, b = generate_secret(), generate_secret()
    assert len(a) == 32 and a != b
    assert load_secret({SECRET_ENV: a.hex()}) == a


def test_load_secret_from_hex_env():
    assert load_secret({SECRET_ENV: SECRET.hex()}) == SECRET
    assert load_secret({SECRET_ENV: SECRET.hex().upper()}) == SECRET


def test_load_secret_env_wins_over_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text(WRONG.hex())
    assert load_secret({SECRET_ENV: SECRET.hex(), SECRET_FILE_ENV: str(path)}) == SECRET


def test_load_secret_from_hex_file_with_newline(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET.hex() + "\n")
    assert load_secret({SECRET_FILE_ENV: str(path)}) == SECRET


def test_load_secret_from_raw_file(tmp_path):
    raw = b"\xfe\x00not hex at all\x80\x81" + bytes(range(100, 120))
    path = tmp_path / "secret.bin"
    path.write_bytes(raw)
    assert load_secret({SECRET_FILE_ENV: str(path)}) == raw


@pytest.mark.parametrize("environ, needle", [
    ({}, "no shared secret"),
    ({SECRET_ENV: ""}, "no shared secret"),
    ({SECRET_ENV: "zz" * 32}, "must be hex"),
    ({SECRET_ENV: "ab" * 15}, "at least 16 bytes"),
    ({SECRET_FILE_ENV: "/nonexistent/kvlend-secret"}, "/nonexistent/kvlend-secret"),
])
def test_load_secret_refusals(environ, needle):
    with pytest.raises(AuthError, match=needle):
        load_secret(environ)


def test_load_secret_refuses_a_short_file(tmp_path):
    path = tmp_path / "short"
    path.write_text("ab" * 15)
    with pytest.raises(AuthError, match="at least 16"):
        load_secret({SECRET_FILE_ENV: str(path)})
    path.write_bytes(b"short raw")
    with pytest.raises(AuthError, match="at least 16"):
        load_secret({SECRET_FILE_ENV: str(path)})


def test_load_secret_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET.hex())
    assert load_secret() == SECRET


def test_listener_logs_stay_quiet_for_honest_peers(listener, caplog):
    caplog.set_level(logging.INFO, logger="kvlend.control")
    client, server = open_pair(listener)
    assert "authenticated as 'decode-0'" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    client.close()
    server.close()
