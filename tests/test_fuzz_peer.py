"""Every decoder of peer bytes, fuzzed: over 100,000 seeded hostile inputs in total.

``PageLayout.decode`` (a peer's handshake layout), ``FrameDecoder`` (bytes
out of the TLS stream, fed in random pieces), ``message_from_wire`` (the
decoded msgpack object) and ``LeaseOffer.from_wire`` (an offer's pages,
selection and meta).  Each input either decodes to something valid or
raises a ``KvlendError`` subclass: never another exception, never a hang
(``hang_guard``), and a claimed size never allocates what it claims
(``tracemalloc`` peaks on huge-claim inputs).  Mutations reuse the seeds
and mutators of ``test_wire`` and ``test_layout_fuzz``.

The TLS channel too: garbage before the handshake (random bytes, mutated
and truncated real ClientHellos and server flights, records claiming huge
lengths) to a ``TlsChannel`` in memory and to a real ``PrefillNode``, and
hostile frames inside an authenticated TLS stream to a real ``PrefillNode``,
which drops or answers each and keeps serving its honest decode byte-exact.
"""

from __future__ import annotations

import copy
import logging
import random
import socket
import struct
import tracemalloc
from collections import Counter

import msgpack
import numpy as np
import pytest

import kvlend.protocol.prefill
from kvlend.core.layout import PageLayout
from kvlend.errors import AuthError, KvlendError, LayoutError, PeerLost, PeerProtocolError, TransferTimeout
from kvlend.protocol.wire import (
    MESSAGES,
    PROTOCOL_VERSION,
    Abort,
    Claim,
    Done,
    FrameDecoder,
    Handshake,
    Heartbeat,
    LeaseOffer,
    Offer,
    encode_frame,
    message_from_wire,
)
from kvlend.runtime.tls import TlsChannel
from kvlend.testing.kvcache import prefill_request
from tests.support import layout_fuzz as lf, wire as tw
from tests.support.certs import creds
from tests.support.nodes import (
    DEADLINE,
    DST_PAGES,
    SRC_PAGES,
    fetch_and_verify,
    free_lists,
    read_until_eof,
    rig,
    wait_until,
)
from tests.support.raw_peer import RawDecode

GUARD_S = 120  # only turns a hang into a failure
PEAK_LIMIT = 8 << 20  # bytes; the claims below are of gigabytes


def _expect_kvlend(fn, data, counts: Counter, round_: int) -> object:
    try:
        out = fn(data)
    except KvlendError as exc:
        counts[type(exc).__name__] += 1
        assert len(str(exc)) < 5000
        return None
    except Exception as exc:  # the bug this test exists to find
        pytest.fail(f"round {round_}: {type(exc).__name__}: {exc} for input {repr(data)[:200]}")
    counts["ok"] += 1
    return out


# ------------------------------------------------------------------- layouts
@pytest.mark.unit
def test_layout_decode_30k():
    rng = random.Random(0x7F01)
    makers = (lf.mutate_bytes, lf.mutate_bytes, lf.mutate_structure, lf.mutate_structure, lf.huge_claim_inside_a_layout)
    counts: Counter = Counter()
    with lf.hang_guard(GUARD_S):
        for i in range(30_000):
            lay = _expect_kvlend(PageLayout.decode, rng.choice(makers)(rng), counts, i)
            if lay is not None:
                assert PageLayout.decode(lay.encode()) == lay
    assert sum(counts.values()) == 30_000
    assert set(counts) <= {"ok", "LayoutError"}, counts
    assert counts["LayoutError"] > 20_000, counts


# -------------------------------------------------------------------- frames
def _feed_in_pieces(rng: random.Random):
    def run(data: bytes) -> list:
        dec = FrameDecoder()
        out, i = [], 0
        while i < len(data):
            step = rng.choice((1, 3, 7, 64, len(data)))
            dec.feed(data[i:i + step])
            i += step
            while (m := dec.next_message()) is not None:
                out.append(m)
        return out
    return run


def _session(rng: random.Random) -> bytes:
    """A run of valid frames in sequence, as one session sends them."""
    msgs = rng.sample(tw.SAMPLES, rng.randrange(1, 5))
    return b"".join(map(encode_frame, msgs))


PAYLOADS = [msgpack.packb([PROTOCOL_VERSION, m.to_wire()], use_bin_type=True) for m in tw.SAMPLES]


def hostile_frames(rng: random.Random, i: int) -> bytes:
    """Input ``i`` of the frame fuzz: four kinds in turn, each reaching another layer of the decoder."""
    kind = i % 4
    if kind == 0:  # a mutated session: length, msgpack and schema failures
        return tw.mutate(rng, _session(rng))
    if kind == 1:  # a mutated payload, framed right: msgpack and schema failures
        return tw.framed(tw.mutate(rng, rng.choice(PAYLOADS)))
    if kind == 2:  # valid msgpack of the wrong shape, or a wrong version
        body = tw.wrong_shape(rng, rng.choice(tw.SAMPLES))
        head = [PROTOCOL_VERSION] if rng.random() < 0.8 else [tw.random_value(rng)]
        return tw.framed(msgpack.packb(head + [body], use_bin_type=True))
    # Two valid sessions spliced at random points: a header whose body is another frame's tail.
    a, b = _session(rng), _session(rng)
    return a[:rng.randrange(len(a) + 1)] + b[rng.randrange(len(b) + 1):]


@pytest.mark.unit
def test_frame_decoder_40k_fed_in_random_pieces():
    rng = random.Random(0x7F02)
    run = _feed_in_pieces(rng)
    counts: Counter = Counter()
    with lf.hang_guard(GUARD_S):
        for i in range(40_000):
            _expect_kvlend(run, hostile_frames(rng, i), counts, i)
    assert set(counts) <= {"ok", "PeerProtocolError"}, counts
    assert counts["PeerProtocolError"] > 25_000 and counts["ok"] > 1_000, counts


# ------------------------------------------------------ messages and offers
@pytest.mark.unit
def test_message_from_wire_20k():
    rng = random.Random(0x7F03)
    counts: Counter = Counter()
    with lf.hang_guard(GUARD_S):
        for i in range(20_000):
            if i % 2:
                obj = tw.wrong_shape(rng, rng.choice(tw.SAMPLES))
            else:
                obj = tw.random_value(rng)
                if isinstance(obj, dict) and rng.random() < 0.7:
                    obj["t"] = rng.choice(sorted(MESSAGES))
            _expect_kvlend(message_from_wire, obj, counts, i)
    assert set(counts) <= {"ok", "PeerProtocolError"}, counts
    assert counts["PeerProtocolError"] > 15_000, counts


def _i64(values) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def _mutate_offer(rng: random.Random) -> dict:
    offer = copy.deepcopy(rng.choice([tw.lease(), tw.lease(n_full=300)]).to_wire())
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(9)
        group = rng.choice(sorted(offer["pages"])) if isinstance(offer.get("pages"), dict) and offer["pages"] else None
        arrays = offer["pages"][group] if group else None
        if op == 0 and isinstance(arrays, list) and len(arrays) == 2 and all(isinstance(a, bytes) for a in arrays):
            tp, od = arrays  # token pages and ordinals of different lengths, or misaligned bytes
            offer["pages"][group] = [tp, od[: max(0, len(od) - 8 * rng.randrange(1, 3))] + b"\x00" * rng.randrange(8)]
        elif op == 1 and group:  # negative, unsorted, duplicated or enormous page numbers
            n = rng.randrange(1, 6)
            tp = [rng.choice((-1, 0, 5, 3, 2**62, -(2**63), 2**63 - 1)) for _ in range(n)]
            offer["pages"][group] = [_i64(tp), _i64([rng.choice((0, -7, 2**40)) for _ in range(n)])]
        elif op == 2 and group:  # a byte string claiming (by length) huge arrays: refused, not allocated
            offer["pages"][group] = [b"\x00" * rng.choice((8, 16, 8 * 4097)), rng.choice((b"", b"\x01" * 9))]
        elif op == 3:
            offer["pages"] = rng.choice(({}, {f"g{i}": [b"", b""] for i in range(257)}, [], None, {"": [b"", b""]}))
        elif op == 4:
            offer["selection"] = rng.choice((["ALL", []], ["NAMED", []], ["NAMED", ["x"] * 3], ["all", []],
                                             ["NAMED", [1, 2]], ["ALL"], "ALL", ["NAMED", ["a"] * 70000]))
        elif op == 5:
            offer["meta"] = rng.choice(({"k": [1] * 10}, {"k": {"nested": 1}}, {str(i): i for i in range(65)},
                                        {1: 2}, {"k": [2**64]}, {"k": [True]}, {"x" * 5000: 1}, []))
        elif op == 6:
            key = rng.choice(("num_tokens", "ttl", "id", "request"))
            offer[key] = rng.choice((0, -1, 2**63, float("nan"), float("inf"), True, b"\x00" * 15, "x" * 5000, None))
        elif op == 7:
            key = rng.choice(sorted(offer))
            if rng.random() < 0.5:
                del offer[key]
            else:
                offer["extra"] = 1
        else:
            offer[rng.choice(sorted(offer))] = tw.random_value(rng)
    return offer


@pytest.mark.unit
def test_lease_offer_from_wire_20k():
    rng = random.Random(0x7F04)
    counts: Counter = Counter()
    with lf.hang_guard(GUARD_S):
        for i in range(20_000):
            offer = _expect_kvlend(LeaseOffer.from_wire, _mutate_offer(rng), counts, i)
            if offer is not None:  # whatever is accepted round-trips through a real frame
                (msg,) = tw.decode_all(encode_frame(Offer(offer)))
                assert msg.lease.id == offer.id and set(msg.lease.pages) == set(offer.pages)
    assert set(counts) <= {"ok", "PeerProtocolError"}, counts
    assert counts["PeerProtocolError"] > 15_000 and counts["ok"] > 0, counts


# ----------------------------------------------------------- huge claims
HUGE = list(tw.HUGE_CLAIMS) + list(lf.HUGE_CLAIMS)


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


BIG_PAGES = {**tw.lease().to_wire(), "pages": {"full": [b"\x00" * 8 * ((1 << 22) + 1), b""]}}  # over the page cap
MANY_IDS = {"t": "heartbeat", "leases": [b"\x00" * 16] * 70_000}  # over the id-list cap


@pytest.mark.unit
@pytest.mark.parametrize("claim", HUGE, ids=lambda c: c[:6].hex())
def test_huge_claims_allocate_nothing_like_their_claim(claim):
    """Inputs are built first; only decoding is traced, and it stays far below any claimed size."""
    in_frame = tw.framed(tw.HEAD + tw.raw_map([("t", msgpack.packb("offer")), ("lease", claim)]))
    near_cap = struct.pack(">I", 16 << 20) + claim

    def every_decoder():
        with pytest.raises(LayoutError):
            PageLayout.decode(claim)
        with pytest.raises(LayoutError):
            PageLayout.decode(b"\x81\xa7version" + claim)
        dec = FrameDecoder()
        dec.feed(near_cap)
        assert dec.next_message() is None
        with pytest.raises(PeerProtocolError):
            tw.decode_all(in_frame)
        with pytest.raises(PeerProtocolError):
            message_from_wire(MANY_IDS)
        with pytest.raises(PeerProtocolError):
            LeaseOffer.from_wire(BIG_PAGES)

    assert _peak(every_decoder) < PEAK_LIMIT


@pytest.mark.unit
def test_a_frame_claiming_the_cap_holds_only_what_arrived():
    def feed():
        dec = FrameDecoder()
        dec.feed(struct.pack(">I", 16 << 20))
        for _ in range(64):
            dec.feed(b"\x00" * 1024)
            assert dec.next_message() is None
    assert _peak(feed) < 1 << 20  # 64 KiB arrived of a claimed 16 MiB


# ------------------------------------------------------- TLS: before the handshake
TLS_TYPES = (0x14, 0x15, 0x16, 0x17)  # change_cipher_spec, alert, handshake, application_data
TOO_LONG = (1 << 14) + 2048  # a record body OpenSSL refuses on its header: past any TLS version's maximum


def _record(kind: int, body: bytes, version: bytes = b"\x03\x03") -> bytes:
    return bytes([kind]) + version + struct.pack(">H", len(body)) + body


def _records(data: bytes) -> list[int]:
    """The content types of the whole TLS records in ``data`` (a reset may cut the last one short)."""
    types, i = [], 0
    while i + 5 <= len(data):
        types.append(data[i])
        i += 5 + int.from_bytes(data[i + 3:i + 5], "big")
    return types


def _handshake_flights() -> tuple[bytes, bytes, bytes]:
    """A real handshake in memory: the decode's ClientHello, the prefill's answer, the decode's Finished."""
    client = TlsChannel(creds("decode", "decode").context(server=False), server=False, roles=("prefill",))
    server = TlsChannel(creds("prefill", "prefill").context(server=True), server=True, roles=("decode",))
    client.start()
    hello = client.data_to_send()
    assert server.receive(hello) == b""
    flight = server.data_to_send()
    assert client.receive(flight) == b"" and client.authenticated
    finish = client.data_to_send()
    assert server.receive(finish) == b"" and server.identity == "decode"
    return hello, flight, finish


def _random_bytes(rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice((1, 3, 5, 40, 300, 4000)))


def _random_record(rng: random.Random) -> bytes:
    version = rng.choice((b"\x03\x01", b"\x03\x03", b"\x03\x04", b"\x02\x00", b"\xff\xff"))
    return _record(rng.choice(TLS_TYPES + (0x00, 0x18, 0xFF)), rng.randbytes(rng.randrange(64)), version)


def _huge_tls_claim(rng: random.Random) -> bytes:
    """A record, or the handshake message in one, claiming more than TLS allows or a server would buffer."""
    if rng.random() < 0.5:
        n = rng.choice((TOO_LONG, 1 << 15, 0xFFFF))
        return bytes([rng.choice(TLS_TYPES)]) + b"\x03\x01" + struct.pack(">H", n) + rng.randbytes(rng.randrange(64))
    claim = rng.choice((1 << 18, 1 << 20, (1 << 24) - 1))  # OpenSSL takes ClientHellos up to 128 KiB
    return _record(0x16, b"\x01" + claim.to_bytes(3, "big") + rng.randbytes(rng.randrange(64)), b"\x03\x01")


def _mutate_tls(rng: random.Random, data: bytes) -> bytes:
    """A TLS stream changed where a parser looks: record and handshake headers, single bits, cuts, splices."""
    b = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(6)
        if op == 0 and len(b) >= 5:  # a record header: content type, version or length
            b[rng.randrange(5)] = rng.choice((0x00, 0x01, 0x03, 0x14, 0x15, 0x16, 0x17, 0x18, 0x7F, 0x80, 0xFF))
        elif op == 1 and len(b) >= 9:  # the handshake message's type or 24-bit length
            b[rng.randrange(5, 9)] = rng.choice((0x00, 0x01, 0x02, 0x7F, 0xFF))
        elif op == 2 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 3 and b:
            pos = rng.randrange(len(b))
            del b[pos:pos + rng.choice((1, 16, len(b)))]
        elif op == 4:
            pos = rng.randrange(len(b) + 1)
            b[pos:pos] = rng.choice((_random_record, _huge_tls_claim))(rng)
        else:
            b = bytearray(tw.mutate(rng, bytes(b)))
    return bytes(b)


def _fragmented(rng: random.Random, hello: bytes) -> bytes:
    """A ClientHello split over records of 1 to 64 bytes: legal, if odd."""
    body, out = hello[5:], b""
    while body:
        n = rng.randrange(1, 65)
        out += _record(0x16, body[:n], hello[1:3])
        body = body[n:]
    return out


def tls_garbage(rng: random.Random, sessions: list, i: int) -> tuple[bytes, str | None]:
    """Input ``i`` for a prefill's TLS server, and what it must do with it (None: wait or refuse)."""
    hello = rng.choice(sessions)[0]
    kind = i % 8
    if kind == 0:
        return _random_bytes(rng), None
    if kind == 1:
        return _random_record(rng), None
    if kind == 2:
        return _mutate_tls(rng, hello), None
    if kind == 3:  # a ClientHello still arriving
        return hello[:rng.randrange(len(hello))], "waits"
    if kind == 4:
        return _huge_tls_claim(rng), "AuthError"
    if kind == 5:
        tail = rng.choice((b"", _random_bytes(rng), _random_record(rng)))
        return _fragmented(rng, hello) + tail, "waits" if not tail else None
    if kind == 6:  # a ClientHello, then garbage or another session's Finished where the client's Finished goes
        _, _, other = rng.choice(sessions)
        return hello + rng.choice((_random_bytes(rng), _random_record(rng), other, _mutate_tls(rng, other))), None
    # A peer speaking plaintext frames (a decode of protocol 1, or no TLS at all).
    return rng.choice((encode_frame(rng.choice(tw.SAMPLES)), hostile_frames(rng, rng.randrange(4)))), None


def hostile_server_flight(rng: random.Random, sessions: list, i: int) -> tuple[bytes, str | None]:
    """What a hostile listener may answer a decode's ClientHello with."""
    _, flight, _ = rng.choice(sessions)
    kind = i % 4
    if kind == 0:
        return rng.choice((_random_bytes, _random_record, _huge_tls_claim))(rng), None
    if kind == 1:  # a real prefill's answer to another ClientHello: it echoes another session id
        return flight, "AuthError"
    if kind == 2:
        return _mutate_tls(rng, flight), None
    return flight[:rng.randrange(len(flight))], None


def _tls_outcome(channel: TlsChannel, data: bytes, rng: random.Random) -> str:
    """Feed ``data`` in random pieces, as the socket would, until the channel refuses it."""
    i = 0
    while i < len(data):
        step = rng.choice((1, 5, 64, 1500, len(data)))
        try:
            out = channel.receive(data[i:i + step])
        except (AuthError, PeerLost) as exc:
            assert len(str(exc)) < 5000
            channel.data_to_send()  # the alert the shell sends before it closes
            return type(exc).__name__
        assert out == b"" and not channel.authenticated, "garbage completed a handshake"
        channel.data_to_send()
        i += step
    return "waits"


@pytest.mark.unit
def test_tls_channel_10k_garbage_before_the_handshake():
    """Each input waits for more or is refused with an ``AuthError``: never another exception,
    never plaintext, never a completed handshake.  One in five plays a hostile listener to a decode."""
    rng = random.Random(0x7F05)
    sessions = [_handshake_flights() for _ in range(3)]
    server_ctx, client_ctx = creds("prefill", "prefill").context(server=True), creds("decode",
                                                                                     "decode").context(server=False)
    counts: Counter = Counter()
    with lf.hang_guard(GUARD_S):
        for i in range(10_000):
            if i % 5 == 4:
                channel = TlsChannel(client_ctx, server=False, roles=("prefill",))
                channel.start()
                channel.data_to_send()
                data, want = hostile_server_flight(rng, sessions, i // 5)
            else:
                channel = TlsChannel(server_ctx, server=True, roles=("decode",))
                data, want = tls_garbage(rng, sessions, i)
            try:
                outcome = _tls_outcome(channel, data, rng)
            except Exception as exc:  # the bug this test exists to find
                pytest.fail(f"round {i}: {type(exc).__name__}: {exc} for input {data[:200]!r}")
            assert want in (None, outcome), f"round {i}: {outcome}, not {want}, for input {data[:200]!r}"
            counts[outcome] += 1
    assert set(counts) <= {"waits", "AuthError"}, counts
    assert counts["AuthError"] > 6000 and counts["waits"] > 1250, counts


@pytest.mark.nixl
def test_a_prefill_node_drops_50_garbage_connections_and_keeps_serving(monkeypatch, caplog):
    """Over real sockets: each garbage connection is closed by the prefill (at once, or at its handshake
    deadline), answered with nothing but TLS records; then an honest fetch is byte-exact."""
    monkeypatch.setattr(kvlend.protocol.prefill, "AUTH_TIMEOUT", 0.5)
    rng = random.Random(0x7F06)
    sessions = [_handshake_flights() for _ in range(2)]
    inputs = [tls_garbage(rng, sessions, i)[0] for i in range(50)]
    with rig() as r:
        for start in range(0, len(inputs), 10):  # ten at a time: under the prefill's cap per source
            batch = []
            for data in inputs[start:start + 10]:
                sock = socket.create_connection(r.prefill.address, timeout=DEADLINE)
                try:
                    sock.sendall(data)
                except OSError:
                    pass  # refused and closed before all of it went
                batch.append(sock)
            for sock in batch:
                with sock:
                    reply = read_until_eof(sock)  # times out, failing the test, if the prefill keeps it open
                assert set(_records(reply)) <= set(TLS_TYPES), reply[:64]
        wait_until(lambda: r.prefill.unauthenticated == 0, "garbage connections dropped")
        assert r.prefill.ready_peers() == [r.peer]
        _serves_byte_exact(r, seed=21)
        with RawDecode(r.prefill.address, creds("late-decode", "decode")) as late:  # and a new decode still gets in
            assert late.peer == "prefill" and isinstance(late.handshake(r.decode.layout), Handshake)
    assert not [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]


def _serves_byte_exact(r, seed: int, num_tokens: int = 40) -> None:
    tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, seed), num_tokens, seed=seed)
    r.prefill.offer(r.peer, f"honest-{seed}", num_tokens, tables, r.layout.full_selection(), meta={"seed": seed})
    link, offer = r.decode.next_offer(DEADLINE)
    result = fetch_and_verify(r.decode, link, offer, r.dst, free_lists(r.decode.layout, DST_PAGES, seed + 1))
    assert result.bound == num_tokens


# --------------------------------------------------- TLS: frames inside the stream
PROBE = b"\xfe" * 16  # a lease id no fuzz input names: a claim of it is answered with an Abort
SILENCE = 0.6  # seconds without the probe's answer: the prefill waits inside an incomplete frame (slow hosts: generous)
# What a ready decode may send and be answered (a heartbeat naming a lease it never got drops it instead).
FROM_A_DECODE = [m for m in tw.SAMPLES
                 if isinstance(m, (Heartbeat, Claim, Done, Abort)) and not (isinstance(m, Heartbeat) and m.leases)]


def frames_in_tls(rng: random.Random, i: int) -> bytes:
    """The frame fuzz, one input in five replaced by what a ready decode may send (of leases it does not hold)."""
    if i % 5 == 4:
        return b"".join(encode_frame(rng.choice(FROM_A_DECODE)) for _ in range(rng.randrange(1, 4)))
    return hostile_frames(rng, i)


def _probe(raw: RawDecode, data: bytes, answers) -> str:
    """Send ``data``; whether the prefill ``answered`` the probe in it, ``dropped`` the connection or
    stayed ``silent``.  A malformed frame from the prefill fails the test (``PeerProtocolError``)."""
    try:
        raw.send_bytes(data)
        while not answers(raw.recv(SILENCE)):
            pass
    except (PeerLost, AuthError):
        return "dropped"
    except TransferTimeout:
        return "silent"
    return "answered"


@pytest.mark.nixl
def test_a_prefill_node_survives_400_hostile_frames_inside_tls(caplog):
    """Authenticated decodes (half before their layout exchange, half after) send fuzzed frames, each
    followed by a probe; every one is dropped or answered, and the honest decode still fetches byte-exact."""
    rng = random.Random(0x7F07)
    counts: Counter = Counter()
    with rig() as r, lf.hang_guard(GUARD_S):
        layout = r.decode.layout
        exchange = encode_frame(Handshake(layout.encode(), "nixl", b"fuzz"))
        claim = encode_frame(Claim(PROBE))
        sent = n = 0
        while sent < 400:
            n += 1
            with RawDecode(r.prefill.address, creds(f"fuzz-{n}", "decode")) as raw:
                ready = n % 2 == 0
                if ready:
                    raw.handshake(layout)
                outcome = "answered"
                while outcome == "answered" and sent < 400:
                    data = frames_in_tls(rng, sent)
                    sent += 1
                    if ready:
                        outcome = _probe(raw, data + claim, lambda m: isinstance(m, Abort) and m.lease == PROBE)
                    else:
                        outcome = _probe(raw, data + exchange, lambda m: isinstance(m, Handshake))
                        ready = True
                    counts[outcome] += 1
        wait_until(lambda: r.prefill.ready_peers() == [r.peer], "fuzzing decodes dropped")
        assert r.prefill.unauthenticated == 0 and r.prefill.loop_thread.is_alive()
        _serves_byte_exact(r, seed=31)
    assert not [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]
    print(f"frames inside TLS, over {n} connections: {dict(counts)}")
    assert counts["dropped"] > 150 and counts["answered"] > 40, counts
