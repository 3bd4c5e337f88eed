"""``Sockets``: non-blocking TCP connections by id over real loopback sockets.

Both ends live in this thread and are pumped in turn; every wait has a
deadline, so a lost event fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import resource
import socket
import threading
import time

import pytest

from kvlend.errors import ConfigError
from kvlend.runtime.sockets import READ_BYTES, Sockets

pytestmark = pytest.mark.unit

DEADLINE = 10.0  # a guard, not an expectation: anything that takes this long has hung
HOST = "127.0.0.1"


class Events:
    """Everything a ``Sockets`` reported, accumulated across polls."""

    def __init__(self) -> None:
        self.accepted: list[socket.socket] = []
        self.up: list[int] = []
        self.data: dict[int, bytearray] = {}
        self.chunks: dict[int, int] = {}
        self.gone: dict[int, str] = {}

    def add(self, result) -> None:
        accepted, up, data, gone = result
        self.accepted += accepted
        self.up += up
        for conn, chunk in data:
            assert chunk, "poll reported an empty chunk as data"
            self.data.setdefault(conn, bytearray()).extend(chunk)
            self.chunks[conn] = self.chunks.get(conn, 0) + 1
        for conn, why in gone:
            assert conn not in self.gone, f"connection {conn} reported gone twice"
            self.gone[conn] = why


def pump(ends: dict[Sockets, Events], done, what: str, deadline: float = DEADLINE) -> None:
    """Poll every end in turn until ``done()``; fail after ``deadline`` s."""
    end = time.monotonic() + deadline
    while not done():
        assert time.monotonic() < end, f"{what}: not within {deadline} s"
        for s, ev in ends.items():
            ev.add(s.poll(0.005))


@pytest.fixture
def both():
    server, client = Sockets(), Sockets()
    yield server, client
    for s in (server, client):
        s.close_all()


def connect_pair(server: Sockets, client: Sockets, sid: int = 7, cid: int = 1):
    """Listen, connect and adopt: (server events, client events, port)."""
    host, port = server.listen(HOST, 0)
    assert host == HOST and port > 0
    sev, cev = Events(), Events()
    assert client.connect(cid, HOST, port) is None
    assert cid in client
    pump({server: sev, client: cev}, lambda: sev.accepted and cid in cev.up, "connect and accept")
    assert len(sev.accepted) == 1
    server.adopt(sid, sev.accepted.pop())
    assert sid in server
    return sev, cev, port


def dead_port() -> int:
    sock = socket.create_server((HOST, 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


# ---------------------------------------------------------------- honest use
def test_connect_accept_and_data_both_ways(both):
    server, client = both
    sev, cev, _ = connect_pair(server, client)
    ends = {server: sev, client: cev}
    client.send(1, b"hello from the client")
    pump(ends, lambda: bytes(sev.data.get(7, b"")) == b"hello from the client", "client -> server")
    server.send(7, b"and back")
    pump(ends, lambda: bytes(cev.data.get(1, b"")) == b"and back", "server -> client")
    assert not sev.gone and not cev.gone
    assert client.pending_output(1) == server.pending_output(7) == 0


def test_a_loopback_peer_is_on_this_host_and_an_unknown_connection_is_not(both):
    """What decides whether a link's reads may go over shared memory (no tcp read window) instead of tcp."""
    server, client = both
    connect_pair(server, client)
    assert client.same_host(1) and server.same_host(7)
    assert not client.same_host(99)


def test_data_sent_while_connecting_is_delivered_once_up(both):
    server, client = both
    _, port = server.listen(HOST, 0)
    sev, cev = Events(), Events()
    assert client.connect(1, HOST, port) is None
    client.send(1, b"queued before the connect completed")
    pump({server: sev, client: cev}, lambda: sev.accepted, "accept")
    server.adopt(7, sev.accepted.pop())
    pump({server: sev, client: cev}, lambda: bytes(sev.data.get(7, b"")) == b"queued before the connect completed",
         "queued data")
    assert cev.up == [1]


def test_a_large_payload_crosses_in_pieces_both_ways(both):
    server, client = both
    sev, cev, _ = connect_pair(server, client)
    up = os.urandom(1 << 20) * 24  # 24 MiB: more than the kernel buffers, more than one read
    down = os.urandom(1 << 20) * 5
    client.send(1, up)
    server.send(7, down)
    assert client.pending_output(1) > 0  # the socket could not take it all at once
    pump({server: sev, client: cev}, lambda: len(sev.data.get(7, b"")) >= len(up)
         and len(cev.data.get(1, b"")) >= len(down), "large payloads")
    assert bytes(sev.data[7]) == up and bytes(cev.data[1]) == down
    assert sev.chunks[7] >= len(up) // READ_BYTES  # one read per connection per poll, at most READ_BYTES
    assert client.pending_output(1) == server.pending_output(7) == 0


def test_many_connections_are_kept_apart(both):
    server, client = both
    _, port = server.listen(HOST, 0)
    sev, cev = Events(), Events()
    ids = range(1, 9)
    for i in ids:
        assert client.connect(i, HOST, port) is None
    pump({server: sev, client: cev}, lambda: len(sev.accepted) == len(ids) and len(cev.up) == len(ids), "accepts")
    for n, sock in enumerate(sev.accepted):
        server.adopt(100 + n, sock)
    for i in ids:
        client.send(i, f"conn {i}|".encode() * i)
    pump({server: sev, client: cev}, lambda: sum(map(len, sev.data.values())) == sum(
        len(f"conn {i}|") * i for i in ids), "data from every connection")
    assert sorted(bytes(v) for v in sev.data.values()) == sorted(f"conn {i}|".encode() * i for i in ids)


# -------------------------------------------------------------- failures
def test_connect_to_a_closed_port_is_reported(both):
    _, client = both
    cev = Events()
    error = client.connect(1, HOST, dead_port())
    if error is not None:
        assert "cannot connect" in error
        assert 1 not in client
        return
    pump({client: cev}, lambda: 1 in cev.gone, "connect failure")
    assert "connect failed" in cev.gone[1] and "refused" in cev.gone[1].lower()
    assert 1 not in cev.up and 1 not in client


def test_close_of_an_unknown_id_is_a_no_op(both):
    server, client = both
    client.close(99)
    client.close(99)
    client.send(99, b"to nobody")
    assert client.pending_output(99) == 0 and 99 not in client
    sev, cev, _ = connect_pair(server, client)
    client.close(1)
    client.close(1)  # twice: the second is a no-op
    client.send(1, b"after close")
    assert 1 not in client


def test_a_peer_hanging_up_appears_in_gone(both):
    server, client = both
    sev, cev, _ = connect_pair(server, client)
    client.close(1)
    pump({server: sev, client: cev}, lambda: 7 in sev.gone, "hang-up")
    assert "closed by the peer" in sev.gone[7]
    assert 7 not in server
    assert 1 not in cev.gone  # a connection closed on our side is not reported back to us


def test_a_raw_peer_hanging_up_on_a_connect_appears_in_gone(both):
    _, client = both
    listener = socket.create_server((HOST, 0))
    listener.settimeout(DEADLINE)
    try:
        cev = Events()
        assert client.connect(1, HOST, listener.getsockname()[1]) is None
        peer, _ = listener.accept()
        pump({client: cev}, lambda: 1 in cev.up, "up")
        peer.sendall(b"last words")
        peer.close()
        pump({client: cev}, lambda: 1 in cev.gone, "hang-up")
        assert bytes(cev.data[1]) == b"last words"  # what came before the close is not lost
    finally:
        listener.close()


def test_a_send_the_peer_never_reads_never_blocks(both):
    server, client = both
    connect_pair(server, client)
    t0 = time.monotonic()
    client.send(1, bytes(64 << 20))
    client.poll(0.0)
    assert time.monotonic() - t0 < 2.0
    assert client.pending_output(1) > 0  # buffered here, not pushed by blocking


def test_sending_to_a_vanished_peer_ends_in_gone(both):
    server, client = both
    sev, cev, _ = connect_pair(server, client)
    server.close(7)
    ends = {server: sev, client: cev}

    def gone() -> bool:
        if 1 in client:
            client.send(1, b"anyone there?" * 1000)
        return 1 in cev.gone

    pump(ends, gone, "the vanished peer noticed")
    assert 1 not in client


def test_close_flushes_what_the_socket_takes(both):
    server, client = both
    sev, cev, _ = connect_pair(server, client)
    client.send(1, b"goodbye")
    client.close(1)
    pump({server: sev, client: cev}, lambda: 7 in sev.gone, "close")
    assert bytes(sev.data[7]) == b"goodbye"


def test_listening_on_a_port_in_use_is_a_config_error():
    taken = socket.create_server((HOST, 0))
    s = Sockets()
    try:
        with pytest.raises(ConfigError, match="cannot listen"):
            s.listen(HOST, taken.getsockname()[1])
    finally:
        s.close_all()
        taken.close()


def test_close_all_closes_connections_and_the_listener(both):
    server, client = both
    sev, cev, port = connect_pair(server, client)
    server.close_all()
    assert 7 not in server
    pump({client: cev}, lambda: 1 in cev.gone, "the server closed everything")
    with pytest.raises(OSError):
        socket.create_connection((HOST, port), timeout=DEADLINE).close()


def test_wake_after_close_all_writes_to_no_reused_descriptor():
    """An engine thread may still wake a node that closed (``Shell._wake`` after ``close``, or a second
    ``close``): that must not write into whatever file now has the wake pipe's old number."""
    s = Sockets()
    old = s._wake_w
    s.close_all()
    with pytest.raises(OSError):
        os.fstat(old)  # the number is free ...
    r, w = os.pipe()
    os.dup2(w, old)  # ... and now belongs to someone else's pipe
    try:
        os.set_blocking(r, False)
        try:
            s.wake()
        except OSError:
            pass  # refusing is acceptable; writing into someone else's descriptor is not
        with pytest.raises(BlockingIOError):
            leaked = os.read(r, 16)
            pytest.fail(f"wake() after close_all wrote {leaked!r} into a recycled descriptor {old}")
    finally:
        for fd in {r, w, old}:  # the pipe itself may have got the old number
            os.close(fd)


# ------------------------------------------------------------ descriptors
def test_descriptors_above_1023_work():
    """``select`` fails on fds >= FD_SETSIZE; a process running UCX and CUDA easily has that many."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1400
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}: cannot open descriptors above 1023")
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            pytest.skip(f"cannot raise RLIMIT_NOFILE to {want}: {exc}")
    filler = []
    server = client = None
    try:
        while len(filler) < 1100:
            filler.append(os.open(os.devnull, os.O_RDONLY))
        server, client = Sockets(), Sockets()
        sev, cev, _ = connect_pair(server, client)
        fds = [server._listener.fileno(), server._conns[7].sock.fileno(), client._conns[1].sock.fileno(),
               server._wake_r, client._wake_r]
        assert min(fds) > 1023, fds
        ends = {server: sev, client: cev}
        client.send(1, b"high")
        pump(ends, lambda: bytes(sev.data.get(7, b"")) == b"high", "client -> server")
        server.send(7, b"higher")
        pump(ends, lambda: bytes(cev.data.get(1, b"")) == b"higher", "server -> client")
        waker = threading.Timer(0.1, client.wake)
        waker.start()
        t0 = time.monotonic()
        client.poll(5.0)
        waker.join(DEADLINE)
        assert time.monotonic() - t0 < 2.0
    finally:
        for s in (server, client):
            if s is not None:
                s.close_all()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ------------------------------------------------------------------- wake
def test_wake_cuts_a_long_poll_short():
    s = Sockets()
    try:
        waker = threading.Timer(0.2, s.wake)
        waker.start()
        t0 = time.monotonic()
        assert s.poll(5.0) == ([], [], [], [])
        elapsed = time.monotonic() - t0
        waker.join(DEADLINE)
        assert elapsed < 2.0, f"poll(5.0) returned after {elapsed:.2f} s despite a wake at 0.2 s"
    finally:
        s.close_all()


def test_a_wake_before_the_poll_is_not_lost_and_is_drained():
    s = Sockets()
    try:
        for _ in range(100_000):  # more than the pipe holds: wake never blocks
            s.wake()
        t0 = time.monotonic()
        s.poll(5.0)
        assert time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        s.poll(0.2)  # drained: this one sleeps its timeout
        assert time.monotonic() - t0 >= 0.1
    finally:
        s.close_all()


def test_poll_with_nothing_to_do_waits_its_timeout():
    s = Sockets()
    try:
        t0 = time.monotonic()
        assert s.poll(0.1) == ([], [], [], [])
        assert 0.05 <= time.monotonic() - t0 < 2.0
        assert s.poll(0.0) == ([], [], [], [])
    finally:
        s.close_all()


# ---------------------------------------------------------- name lookups
def resolver(**by_host):
    """A resolver with a behaviour per host name: an ``Event`` to wait for (then 127.0.0.1), an exception to
    raise, or absent: 127.0.0.1 at once.  Records every name it was asked."""
    asked = []

    def resolve(host, port):
        asked.append(host)
        how = by_host.get(host)
        if isinstance(how, threading.Event):
            how.wait(DEADLINE)
        elif isinstance(how, BaseException):
            raise how
        return socket.getaddrinfo(HOST, port, type=socket.SOCK_STREAM)[0]

    resolve.asked = asked
    return resolve


def test_an_ip_literal_connects_without_a_lookup():
    resolve = resolver()
    server, client = Sockets(), Sockets(resolve=resolve)
    try:
        sev, cev, _ = connect_pair(server, client)
        assert resolve.asked == []
    finally:
        server.close_all()
        client.close_all()


def test_a_slow_lookup_holds_up_no_other_connection_and_connects_once_done():
    slow = threading.Event()
    resolve = resolver(**{"slow.test": slow})
    server, client = Sockets(), Sockets(resolve=resolve)
    try:
        _, port = server.listen(HOST, 0)
        sev, cev = Events(), Events()
        assert client.connect(1, "slow.test", port) is None and 1 in client
        assert client.connect(2, "fast.test", port) is None
        client.send(1, b"queued while looking up")
        pump({server: sev, client: cev}, lambda: 2 in cev.up, "the fast name connects")
        assert 1 not in cev.up and 1 not in cev.gone  # still looking up
        slow.set()
        pump({server: sev, client: cev}, lambda: 1 in cev.up and len(sev.accepted) == 2, "the slow name connects")
        for i, sock in enumerate(sev.accepted):
            server.adopt(10 + i, sock)
        pump({server: sev, client: cev}, lambda: b"queued while looking up" in b"".join(sev.data.values()),
             "what was sent while looking up arrives")
        assert sorted(resolve.asked) == ["fast.test", "slow.test"]
    finally:
        slow.set()
        server.close_all()
        client.close_all()


@pytest.mark.parametrize("error, why", [
    (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), "name lookup failed: gaierror"),
    (UnicodeError("label empty or too long"), "name lookup failed: UnicodeError"),
    (RuntimeError("a resolver bug"), "name lookup failed: RuntimeError: a resolver bug"),
])
def test_a_failed_lookup_is_reported_in_gone(error, why):
    client = Sockets(resolve=resolver(**{"bad.test": error}))
    cev = Events()
    try:
        assert client.connect(1, "bad.test", 9) is None
        pump({client: cev}, lambda: 1 in cev.gone, "the failed lookup reported")
        assert why in cev.gone[1] and "bad.test:9" in cev.gone[1]
        assert 1 not in client
    finally:
        client.close_all()


def test_a_lookup_past_its_deadline_fails_its_connect_and_its_late_answer_is_ignored():
    stuck = threading.Event()
    client = Sockets(resolve=resolver(**{"stuck.test": stuck}), lookup_timeout=0.2)
    cev = Events()
    try:
        assert client.connect(1, "stuck.test", 9) is None
        pump({client: cev}, lambda: 1 in cev.gone, "the overdue lookup reported")
        assert "name lookup took longer than 0.2 s" in cev.gone[1] and 1 not in client
        stuck.set()  # the answer comes late: nothing connects
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            cev.add(client.poll(0.01))
        assert cev.up == [] and 1 not in client
    finally:
        stuck.set()
        client.close_all()


def test_lookups_running_at_once_are_capped_and_a_closed_one_frees_nothing_early():
    from kvlend.runtime.sockets import MAX_LOOKUPS
    stuck = threading.Event()
    client = Sockets(resolve=resolver(**{"stuck.test": stuck}))
    try:
        for conn in range(MAX_LOOKUPS):
            assert client.connect(conn, "stuck.test", 9) is None
        client.close(0)  # its worker still runs: its slot is not free yet
        error = client.connect(99, "stuck.test", 9)
        assert error is not None and f"{MAX_LOOKUPS} host name lookups are running" in error and 99 not in client
        stuck.set()
        cev = Events()
        pump({client: cev}, lambda: client.connect(100, "other.test", dead_port()) is None, "a slot frees")
    finally:
        stuck.set()
        client.close_all()


# ------------------------------------------------------ a peer that never reads
def fill(server: Sockets, sid: int, ev: Events, until, chunk: int = 256 << 10) -> int:
    """Send ``chunk``-byte pieces to a client that never reads until ``until()``; the most ever pending."""
    most = 0
    end = time.monotonic() + DEADLINE
    while not until():
        assert time.monotonic() < end, "the peer's backlog never built up"
        server.send(sid, bytes(chunk))
        most = max(most, server.pending_output(sid))
        ev.add(server.poll(0.001))
    return most


def test_a_peer_whose_output_piles_up_is_not_read_until_it_drains():
    server, client = Sockets(pause_output=64 << 10, max_output=1 << 30), Sockets()
    try:
        sev, cev, _ = connect_pair(server, client)
        fill(server, 7, sev, lambda: server.pending_output(7) > 64 << 10)
        client.send(1, b"a request the server must not read yet")
        for _ in range(50):  # the request sits in the kernel: the server reads nothing while backed up
            sev.add(server.poll(0.002))
        assert 7 not in sev.data
        pump({server: sev, client: cev}, lambda: bytes(sev.data.get(7, b"")) == b"a request the server must not "
             b"read yet", "the client reads, the server drains and then reads")
        assert server.pending_output(7) <= 64 << 10 and 7 not in sev.gone
    finally:
        server.close_all()
        client.close_all()


def test_a_peer_whose_output_passes_the_cap_is_dropped():
    server, client = Sockets(pause_output=64 << 10, max_output=1 << 20), Sockets()
    try:
        sev, _, _ = connect_pair(server, client)
        most = fill(server, 7, sev, lambda: 7 in sev.gone)
        assert most <= 1 << 20
        assert "exceed the cap of 1048576" in sev.gone[7] and 7 not in server
    finally:
        server.close_all()
        client.close_all()


def test_a_peer_backed_up_past_the_output_timeout_is_dropped():
    server, client = Sockets(pause_output=64 << 10, max_output=1 << 30, output_timeout=0.3), Sockets()
    try:
        sev, _, _ = connect_pair(server, client)
        fill(server, 7, sev, lambda: server.pending_output(7) > 64 << 10)
        pump({server: sev}, lambda: 7 in sev.gone, "the stalled peer dropped")
        assert "for more than 0.3 s" in sev.gone[7] and 7 not in server
    finally:
        server.close_all()
        client.close_all()
