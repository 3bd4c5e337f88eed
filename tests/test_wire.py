"""Control-protocol frames and messages, sans-IO: round trips, caps, schema checks, fuzz.

Frames travel inside TLS 1.3 (``runtime.tls``), which gives integrity, order
and the peer's identity; what is left to check here is that the decoder
never lets a malformed frame through as a message and never allocates for
a claimed size.
"""

import random
import struct
import tracemalloc
from collections import Counter

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvlend.core.layout import RowSelection
from kvlend.core.pages import GroupPages
from kvlend.errors import PeerProtocolError, ProtocolError
from kvlend.protocol.codes import Code
from kvlend.protocol.frame_walk import MAX_FRAME_CONTAINERS, MAX_FRAME_DEPTH
from kvlend.protocol.wire import (
    MAX_FRAME_BYTES,
    MESSAGES,
    PROTOCOL_VERSION,
    Abort,
    Bye,
    Claim,
    Done,
    DoneAck,
    Extend,
    FrameDecoder,
    Handshake,
    Heartbeat,
    LeaseOffer,
    Offer,
    Renewed,
    encode_frame,
    message_from_wire,
)
from tests.support.profiles import examples
from tests.support.wire import (
    BIG_OFFER,
    HEAD,
    HUGE_CLAIMS,
    LID,
    META,
    OFFER,
    SAMPLES,
    decode_all,
    framed,
    lease,
    mutate,
    nested_empty_maps,
    random_value,
    raw_map,
    wire_bytes,
    wrong_shape,
)

pytestmark = pytest.mark.unit


SMALL = [m for m in SAMPLES if m is not BIG_OFFER]  # for byte-at-a-time loops: O(n^2) in the frame size


# ------------------------------------------------------------------ round trips
def test_samples_cover_every_message_type():
    assert {type(m) for m in SAMPLES} == set(MESSAGES.values())


def test_every_message_round_trips_in_one_feed():
    stream = b"".join(encode_frame(m) for m in SAMPLES)
    got = decode_all(stream)
    assert [type(m) for m in got] == [type(m) for m in SAMPLES]
    assert [wire_bytes(m) for m in got] == [wire_bytes(m) for m in SAMPLES]
    simple = [(a, b) for a, b in zip(SAMPLES, got) if not isinstance(a, (Offer, Extend))]  # hold GroupPages (no ==)
    assert all(a == b for a, b in simple)


def test_every_message_round_trips_byte_by_byte():
    dec = FrameDecoder()
    for m in SMALL:
        frame = encode_frame(m)
        for j, byte in enumerate(frame):
            assert dec.need() == (4 - j if j < 4 else len(frame) - j)
            assert dec.next_message() is None
            dec.feed(bytes([byte]))
        assert dec.need() == 0
        got = dec.next_message()
        assert type(got) is type(m) and wire_bytes(got) == wire_bytes(m)
        assert dec.next_message() is None and dec.need() == 4


def test_random_chunking_and_a_split_trailing_frame():
    rng = random.Random(7)
    stream = b"".join(encode_frame(m) for m in SAMPLES)
    dec, got, pos = FrameDecoder(), [], 0
    while pos < len(stream):
        step = rng.choice([1, 2, 3, 5, 31, 32, 33, 4096, 70000])
        dec.feed(stream[pos:pos + step])
        pos += step
        while (m := dec.next_message()) is not None:
            got.append(m)
    assert [wire_bytes(m) for m in got] == [wire_bytes(m) for m in SAMPLES]


def test_offer_arrays_selection_and_meta_survive():
    offer = BIG_OFFER.lease
    (got,) = decode_all(encode_frame(BIG_OFFER))
    back = got.lease
    assert back.id == LID and back.request == "req-1" and back.num_tokens == 300 and back.ttl == 2.5
    assert set(back.pages) == {"full", "mamba", "swa"}
    for g, p in offer.pages.items():
        assert back.pages[g].token_pages.dtype == np.int64
        np.testing.assert_array_equal(back.pages[g].token_pages, p.token_pages)
        np.testing.assert_array_equal(back.pages[g].ordinals, p.ordinals)
    assert len(back.pages["full"]) == 5000 and len(back.pages["swa"]) == 0
    assert back.selection == RowSelection.named("L0.K", "L0.V")
    assert back.meta == META
    (got_all,) = decode_all(encode_frame(OFFER))
    assert got_all.lease.selection == RowSelection.all() and got_all.lease.meta == {}


def test_a_frame_is_a_length_then_msgpack_version_and_message():
    frame = encode_frame(Bye(Code.OK, "x"))
    assert frame == framed(msgpack.packb([PROTOCOL_VERSION, {"t": "bye", "code": 0, "detail": "x"}], use_bin_type=True))
    assert PROTOCOL_VERSION == 6


def test_every_frame_is_the_bytes_msgpack_makes_of_its_map():
    """msgspec encodes each message as msgpack would its ``to_wire`` map: same keys, order and encodings."""
    for m in SAMPLES:
        assert encode_frame(m) == framed(msgpack.packb([PROTOCOL_VERSION, m.to_wire()], use_bin_type=True)), m.TYPE


# ------------------------------------------------------------ malformed bits
def test_flipped_header_bits_never_decode():
    frame = encode_frame(Done(LID, 5))
    for pos in range(4):
        for bit in range(8):
            bad = bytearray(frame)
            bad[pos] ^= 1 << bit
            dec = FrameDecoder()
            try:
                dec.feed(bytes(bad))
                assert dec.next_message() is None  # a longer claim just waits for more bytes
            except ProtocolError:
                pass


def test_a_flipped_payload_bit_is_refused_or_decodes_to_a_valid_message():
    """TLS rejects a tampered record before the decoder sees it; the decoder's own part is that
    whatever bytes reach it are refused or become a message that passed every schema check."""
    for m in (Done(LID, 5), OFFER, Handshake(b"layout-bytes", "nixl", b"meta")):
        frame = encode_frame(m)
        outcomes = Counter()
        for pos in range(4, len(frame)):
            for bit in range(8):
                bad = bytearray(frame)
                bad[pos] ^= 1 << bit
                try:
                    got = decode_all(bytes(bad))
                except ProtocolError:
                    outcomes["refused"] += 1
                    continue
                (back,) = got
                assert decode_all(encode_frame(back))[0].TYPE == back.TYPE  # valid: it travels again
                outcomes["valid"] += 1
        assert outcomes["refused"] > 0, (m.TYPE, outcomes)


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5, 7, 0, True, 6.0, "6", None, -1, 2**64 - 1])
def test_the_version_must_be_exactly_six(version):
    with pytest.raises(ProtocolError, match="protocol version"):
        decode_all(framed(msgpack.packb([version, Bye(Code.OK, "x").to_wire()], use_bin_type=True)))
    assert decode_all(framed(msgpack.packb([PROTOCOL_VERSION, Bye(Code.OK, "x").to_wire()]))) == [Bye(Code.OK, "x")]


@pytest.mark.parametrize("old", [
    [3, {"t": "claim", "lease": LID}],  # version 4 added Claim.digest
    [4, {"t": "abort", "lease": LID, "reason": "LeaseExpired: gone"}],  # version 5: codes, not reason strings
    [4, {"t": "bye", "reason": "shutdown"}],
    [5, {"t": "heartbeat", "leases": [LID]}],  # version 6: Heartbeat.done, released unanswered
    [5, {"t": "done", "lease": LID, "bound": 5}],  # a frame version 6 reads alike is refused all the same
])
def test_an_older_peers_frame_is_refused_naming_both_versions(old):
    """A peer of an older release is told which versions differ, not a field error."""
    with pytest.raises(PeerProtocolError, match=f"peer speaks kvlend protocol version {old[0]}, this rank speaks 6: "
                                                "run the same kvlend release on both sides"):
        decode_all(framed(msgpack.packb(old, use_bin_type=True)))


@pytest.mark.parametrize("digest", [b"\x00" * 31, b"\x00" * 33, "ab" * 16, None, 7])
def test_a_claims_digest_is_32_bytes_or_empty(digest):
    payload = msgpack.packb([PROTOCOL_VERSION, {"t": "claim", "lease": LID, "digest": digest}], use_bin_type=True)
    with pytest.raises(ProtocolError, match="claim.digest"):
        decode_all(framed(payload))
    assert decode_all(encode_frame(Claim(LID))) == [Claim(LID, b"")]


def test_a_version_1_frame_is_refused():
    """Version 1 framed ``[1, sequence, message]`` and appended a MAC: neither fits version 3."""
    payload = msgpack.packb([1, 0, Bye(Code.OK, "x").to_wire()], use_bin_type=True)
    with pytest.raises(ProtocolError, match=r"\[version, message\]"):
        decode_all(framed(payload))
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode_all(framed(payload + b"\x00" * 32))


# ----------------------------------------------------------- caps and lengths
@pytest.mark.parametrize("claim", [0xFFFFFFFF, MAX_FRAME_BYTES + 1, 1 << 31, 0])
def test_bad_length_header_raises_on_the_fourth_byte_without_allocating(claim):
    head = struct.pack(">I", claim)
    dec = FrameDecoder()
    dec.feed(head[:3])
    assert dec.next_message() is None
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=f"frame length {claim} outside"):
            dec.feed(head[3:])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_length_is_checked_before_the_body_arrives_even_in_one_feed():
    with pytest.raises(ProtocolError, match="outside"):
        FrameDecoder().feed(b"\xff\xff\xff\xff" + b"\x00" * 100)


def test_a_one_byte_frame_is_refused_as_msgpack_not_waited_on():
    with pytest.raises(ProtocolError, match="msgpack|version"):
        decode_all(struct.pack(">I", 1) + b"\xc1")


def test_decoder_honours_a_smaller_cap():
    frame = encode_frame(Bye(Code.OK, "x" * 200))
    with pytest.raises(ProtocolError, match="outside"):
        FrameDecoder(max_frame=100).feed(frame)
    assert decode_all(frame) == [Bye(Code.OK, "x" * 200)]


def test_the_cap_is_exact():
    overhead = len(msgpack.packb([PROTOCOL_VERSION, Handshake(b"", "b", b"").to_wire()], use_bin_type=True))
    room = MAX_FRAME_BYTES - overhead - 3  # an empty bin has a 2-byte header, a large one 5
    fits = Handshake(b"\x00" * room, "b", b"")
    frame = encode_frame(fits)
    assert len(frame) == 4 + MAX_FRAME_BYTES
    assert isinstance(decode_all(frame)[0], Handshake)
    with pytest.raises(ProtocolError, match="exceeds the cap"):
        encode_frame(Handshake(b"\x00" * (room + 1), "b", b""))


def test_truncated_frames_stay_incomplete():
    frame = encode_frame(OFFER)
    for cut in range(len(frame)):
        dec = FrameDecoder()
        dec.feed(frame[:cut])
        assert dec.next_message() is None and dec.need() == (4 - cut if cut < 4 else len(frame) - cut)


# --------------------------------------------------------------- schema checks
def wire(m) -> dict:
    return m.to_wire()


def offer_wire(**changes) -> dict:
    d = wire(Offer(lease()))
    lw = d["lease"]
    for k, v in changes.items():
        if v is KeyError:
            del lw[k]
        else:
            lw[k] = v
    return d


DEEP = []
for _ in range(1000):
    DEEP = [DEEP]

BAD_MESSAGES = [
    ([], "type field"),
    ({"t": "nope"}, "unknown type 'nope'"),
    ({"t": 3}, "unknown type 3"),
    ({"t": DEEP}, "unknown type"),
    ({"t": "bye"}, "bye: fields"),
    ({"t": "bye", "reason": "x"}, "bye: fields"),  # version 4's
    ({"t": "bye", "code": 0, "detail": "x", "extra": 1}, "bye: fields"),
    ({"t": "bye", "code": 0, "detail": b"x"}, "bye.detail: expected str"),
    ({"t": "bye", "code": 0, "detail": "x" * 4097}, "bye.detail: expected str of length <= 4096"),
    ({"t": "bye", "code": max(Code) + 1, "detail": "x"}, "bye.code: expected a code in"),
    ({"t": "bye", "code": -1, "detail": "x"}, "bye.code: expected a code in"),
    ({"t": "bye", "code": True, "detail": "x"}, "bye.code: expected a code in"),
    ({"t": "bye", "code": "lease_expired", "detail": "x"}, "bye.code: expected a code in"),
    ({"t": "hello", "peer": "p", "nonce": b"\x00" * 16}, "unknown type 'hello'"),  # version 1's, gone with TLS
    ({"t": "hello_confirm"}, "unknown type 'hello_confirm'"),
    ({"t": "done", "lease": LID, "bound": True}, "done.bound: expected int"),
    ({"t": "done", "lease": LID, "bound": 2**63}, "done.bound: expected int <= 9223372036854775807"),
    ({"t": "done", "lease": LID, "bound": 1.0}, "done.bound: expected int"),
    ({"t": "done_ack", "lease": LID, "ok": True, "error": ""}, "done_ack: fields"),  # version 4's
    ({"t": "done_ack", "lease": LID, "code": 0.0, "detail": ""}, "done_ack.code: expected a code in"),
    ({"t": "abort", "lease": LID, "reason": "x"}, "abort: fields"),  # version 4's
    ({"t": "heartbeat", "leases": LID}, "heartbeat.leases: expected list, got bytes"),
    ({"t": "heartbeat", "leases": [LID, b"short"]}, "heartbeat.leases[1]: expected bytes of length >= 16"),
    ({"t": "heartbeat", "leases": [LID] * 65537}, "heartbeat.leases: expected list of length <= 65536"),
    ({"t": "heartbeat", "leases": [], "done": [LID, b"short"]}, "heartbeat.done[1]: expected bytes of length >= 16"),
    ({"t": "heartbeat", "leases": [], "done": [LID] * 65537}, "heartbeat.done: expected list of length <= 65536"),
    ({"t": "handshake", "layout": "str", "backend": "b", "metadata": b""}, "handshake.layout"),
    ({"t": "offer", "lease": []}, "offer.lease: expected map, got list"),
    (offer_wire(ttl=KeyError), "offer.lease: fields"),
    (offer_wire(pages={}), "offer.lease.pages: expected a map of 1..256"),
    (offer_wire(pages={str(i): [b"", b""] for i in range(257)}), "1..256"),
    (offer_wire(pages={"g": [b"\x00" * 8]}), "pages['g']: expected [token_pages, ordinals]"),
    (offer_wire(pages={"g": [b"\x00" * 7, b"\x00" * 7]}), "pages['g']: expected little-endian"),
    (offer_wire(pages={"g": [[0], [0]]}), "pages['g']: expected little-endian"),
    (offer_wire(pages={"g": [np.array([0, 1], "<i8").tobytes(), np.array([0], "<i8").tobytes()]}), "differ"),
    (offer_wire(pages={"g": [np.array([1, 1], "<i8").tobytes(), np.array([0, 1], "<i8").tobytes()]}),
     "strictly increasing"),
    (offer_wire(pages={"g": [np.array([0], "<i8").tobytes(), np.array([-1], "<i8").tobytes()]}), "negative"),
    (offer_wire(pages={b"g": [b"", b""]}), "pages key: expected str"),
    (offer_wire(selection=["SOME", []]), "offer.lease.selection"),
    (offer_wire(selection=["NAMED", []]), "needs at least one"),
    (offer_wire(selection=["ALL", ["k"]]), "takes no names"),
    (offer_wire(selection=["NAMED", ["k", "k"]]), "duplicate"),
    (offer_wire(selection=["NAMED", [3]]), "offer.lease.selection"),
    (offer_wire(selection=[DEEP, []]), "offer.lease.selection"),
    (offer_wire(selection="ALL"), "expected [mode, names]"),
    (offer_wire(ttl=0.0), "must be positive"),
    (offer_wire(ttl=float("nan")), "offer.lease.ttl: expected a finite number"),
    (offer_wire(ttl=float("inf")), "offer.lease.ttl"),
    (offer_wire(ttl=10**400), "offer.lease.ttl"),
    (offer_wire(ttl=DEEP), "offer.lease.ttl"),
    (offer_wire(ttl=True), "offer.lease.ttl"),
    (offer_wire(num_tokens=0), "must be positive"),
    (offer_wire(num_tokens=2.0), "offer.lease.num_tokens"),
    (offer_wire(id=b"\x00" * 17), "offer.lease.id"),
    (offer_wire(request=None), "offer.lease.request"),
    (offer_wire(meta={"k": {"nested": 1}}), "offer.lease.meta['k']"),
    (offer_wire(meta={"k": [1, "x"]}), "offer.lease.meta['k']"),
    (offer_wire(meta={"k": [True]}), "offer.lease.meta['k']"),
    (offer_wire(meta={"k": 2**63}), "offer.lease.meta['k']"),
    (offer_wire(meta={"k": [2**64 - 1]}), "offer.lease.meta['k']"),
    (offer_wire(meta={b"k": 1}), "offer.lease.meta key"),
    (offer_wire(meta={str(i): i for i in range(65)}), "at most 64"),
    (offer_wire(meta=[]), "offer.lease.meta"),
]


@pytest.mark.parametrize("obj, needle", BAD_MESSAGES, ids=range(len(BAD_MESSAGES)))
def test_schema_rejects_with_a_named_field(obj, needle):
    with pytest.raises(ProtocolError) as info:
        message_from_wire(obj)
    assert needle in str(info.value)
    assert len(str(info.value)) < 1000


def test_deeply_nested_values_in_a_frame_are_protocol_errors():
    """msgpack decodes ~1000-deep nesting; quoting it in an error must not recurse."""
    deep = b"\x91" * 1000 + b"\xc0"
    bodies = [
        HEAD + b"\x81\xa1t" + deep,  # message type
        b"\x92" + deep + b"\x81\xa1t\xa3bye",  # version
        HEAD + b"\x82\xa1t\xa3bye\xa6detail" + deep,  # field value
        HEAD + b"\x91" * 5000 + b"\xc0",  # past msgpack's own depth limit
    ]
    for payload in bodies:
        with pytest.raises(ProtocolError) as info:
            decode_all(framed(payload))
        assert len(str(info.value)) < 1000


# ----------------------------------------------------------------------- fuzz
def huge_claim_payloads(claim: bytes) -> tuple[bytes, ...]:
    """Frame payloads carrying ``claim`` where the version, the message and its fields go."""
    return (
        claim, b"\x92" + claim + b"\x81\xa1t\xa3bye", HEAD + claim, HEAD + raw_map([("t", claim)]),
        HEAD + raw_map([("t", msgpack.packb("bye")), ("detail", claim)]),
        HEAD + raw_map([("t", msgpack.packb("offer")), ("lease", claim)]),
        HEAD + raw_map([("t", msgpack.packb("heartbeat")), ("leases", claim)]),
        HEAD + raw_map([("t", msgpack.packb("offer")), ("lease", raw_map(
            [(k, claim if k in ("pages", "meta", "selection") else msgpack.packb(v, use_bin_type=True))
             for k, v in lease().to_wire().items()]))]),
    )


def _classify(counts: Counter, data: bytes) -> None:
    dec = FrameDecoder()
    try:
        dec.feed(data)
        while dec.next_message() is not None:
            counts["ok"] += 1
        counts["incomplete"] += 1
    except ProtocolError as exc:
        assert len(str(exc)) < 2000
        text = str(exc)
        counts["msgpack" if "msgpack" in text else "length" if "frame length" in text else "schema"] += 1


def test_fuzz_frames_raise_only_kvlend_errors():
    """>= 20,000 hostile inputs: mutated frames, mutated payloads, wrong shapes, huge claims."""
    rng = random.Random(20240611)
    counts = Counter()
    payloads = [msgpack.packb([PROTOCOL_VERSION, m.to_wire()], use_bin_type=True) for m in SMALL]
    frames = [framed(p) for p in payloads]
    for _ in range(6000):  # raw frame bytes mutated: bad lengths, msgpack and schema failures
        _classify(counts, mutate(rng, rng.choice(frames)))
    for _ in range(9000):  # payload mutated, then framed right: reaches msgpack and the schema
        _classify(counts, framed(mutate(rng, rng.choice(payloads))))
    for _ in range(5000):  # well-formed msgpack of the wrong shape
        body = wrong_shape(rng, rng.choice(SMALL))
        head = [PROTOCOL_VERSION] if rng.random() < 0.9 else [random_value(rng)]
        _classify(counts, framed(msgpack.packb(head + [body], use_bin_type=True)))
    for claim in HUGE_CLAIMS:  # huge claimed sizes in every position of the payload
        for payload in huge_claim_payloads(claim):
            _classify(counts, framed(payload))
    total = sum(counts.values())
    assert total >= 20000, counts
    for outcome in ("ok", "msgpack", "schema", "length"):  # every layer was reached
        assert counts[outcome] > 0, counts


def test_huge_claims_do_not_allocate_what_they_claim():
    tracemalloc.start()
    try:
        for claim in HUGE_CLAIMS:
            for payload in huge_claim_payloads(claim):
                with pytest.raises(ProtocolError):
                    decode_all(framed(payload))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


# ------------------------------------------------------------ structural limits


@pytest.mark.parametrize("payload, limit", [
    (nested_empty_maps(65535), "MAX_FRAME_CONTAINERS"),  # 15 MiB: 1.1 GiB and 19 s to build
    (HEAD + b"\x91" * MAX_FRAME_DEPTH + b"\xc0", "MAX_FRAME_DEPTH"),
    (HEAD + b"\x91" * 900 + b"\xdc\xff\xff", "MAX_FRAME_DEPTH"),  # declared, never sent: still refused
    (HEAD + b"\xdc" + struct.pack(">H", MAX_FRAME_CONTAINERS) + b"\x90" * MAX_FRAME_CONTAINERS,
     "MAX_FRAME_CONTAINERS"),
    (HEAD + b"\x99" + (b"\xdc\xff\xff" + b"\xc0" * 0xFFFF) * 9, "MAX_FRAME_ELEMENTS"),  # 9 x 65,535 nils
], ids=["issue-22-frame", "depth", "declared-depth", "containers", "elements"])
def test_a_frame_over_a_structural_limit_is_refused_naming_it(payload, limit):
    assert len(payload) <= MAX_FRAME_BYTES
    with pytest.raises(ProtocolError, match=limit):
        decode_all(framed(payload))


def test_structure_is_checked_before_anything_is_built():
    """A 0.5 MB frame of 480,000 empty maps built them all first (about 60 bytes each); refused, it builds none."""
    payload = nested_empty_maps(2000)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="MAX_FRAME_CONTAINERS"):
            decode_all(framed(payload))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(payload)


def test_the_largest_messages_stay_within_the_structural_limits():
    """65,536 heartbeat ids and as many done; an offer of 256 groups naming 65,536 rows, 64 meta lists of 4,096 ints."""
    ids = tuple(i.to_bytes(16, "big") for i in range(1 << 16))
    meta = {f"k{i}": list(range(i, i + 4096)) for i in range(64)}
    pages = {f"g{i}": GroupPages(np.arange(64) * 2, np.arange(64)) for i in range(256)}
    names = RowSelection.named(*(f"L{i}" for i in range(1 << 16)))
    offer = Offer(LeaseOffer(LID, "r", 1 << 20, pages, names, 1.0, meta))
    for message in (Heartbeat(ids, ids), Renewed(ids), offer):
        assert wire_bytes(decode_all(encode_frame(message))[0]) == wire_bytes(message)


# ----------------------------------------------------------------- hypothesis
names = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=12)
ids16 = st.binary(min_size=16, max_size=16)
int64 = st.integers(-(2**63), 2**63 - 1)
meta_values = st.one_of(
    st.none(), st.booleans(), int64, st.floats(), st.text(max_size=20), st.binary(max_size=20),
    st.lists(int64, max_size=5),
)


@st.composite
def group_pages(draw):
    tp = sorted(draw(st.sets(st.integers(0, 10**6), max_size=20)))
    od = draw(st.lists(st.integers(0, 2**40), min_size=len(tp), max_size=len(tp)))
    return GroupPages(np.array(tp, dtype=np.int64), np.array(od, dtype=np.int64))


@st.composite
def lease_offers(draw):
    named = draw(st.booleans())
    sel = RowSelection.named(*draw(st.sets(names, min_size=1, max_size=4))) if named else RowSelection.all()
    return LeaseOffer(
        id=draw(ids16), request=draw(st.text(max_size=30)), num_tokens=draw(st.integers(1, 2**40)),
        pages=draw(st.dictionaries(names, group_pages(), min_size=1, max_size=4)), selection=sel,
        ttl=draw(st.floats(1e-6, 1e6)), meta=draw(st.dictionaries(st.text(max_size=10), meta_values, max_size=5)),
    )


valid_messages = st.one_of(
    st.builds(Handshake, st.binary(max_size=200), st.text(max_size=20), st.binary(max_size=200)),
    st.builds(Offer, lease_offers()), st.builds(Heartbeat, st.lists(ids16, max_size=5).map(tuple),
                                                           st.lists(ids16, max_size=5).map(tuple)),
    st.builds(Renewed, st.lists(ids16, max_size=5).map(tuple)),
    st.builds(Claim, ids16, st.sampled_from([b"", bytes(32)])),
    st.builds(Done, ids16, int64), st.builds(DoneAck, ids16, st.sampled_from(Code), st.text(max_size=40)),
    st.builds(Abort, ids16, st.sampled_from(Code), st.text(max_size=40)),
    st.builds(Bye, st.sampled_from(Code), st.text(max_size=40)),
)


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(valid_messages, min_size=1, max_size=4), st.data())
def test_hypothesis_valid_messages_round_trip(messages, data):
    stream = b"".join(encode_frame(m) for m in messages)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    dec, got = FrameDecoder(), []
    for a, b in zip([0] + cuts, cuts + [len(stream)]):
        dec.feed(stream[a:b])
        while (m := dec.next_message()) is not None:
            got.append(m)
    assert [wire_bytes(m) for m in got] == [wire_bytes(m) for m in messages]


anything = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10), st.binary(max_size=20)),
    lambda c: (st.lists(c, max_size=3)
               | st.dictionaries(st.one_of(st.text(max_size=6), st.binary(max_size=4)), c, max_size=3)),
    max_leaves=12,
)


@st.composite
def message_dicts(draw):
    """Dicts that look like messages: right type, each field valid or garbage, keys dropped or added."""
    valid = draw(valid_messages).to_wire()
    out = {}
    for k, v in valid.items():
        choice = draw(st.integers(0, 5))
        if choice == 0:
            continue
        if choice == 1 and k != "t":
            v = draw(anything)
        if choice == 2 and k == "lease" and isinstance(v, dict):
            v = dict(v)
            v[draw(st.sampled_from(sorted(v)))] = draw(anything)
        out[k] = v
    if draw(st.integers(0, 4)) == 0:
        out[draw(st.text(max_size=5))] = draw(anything)
    return out


@settings(max_examples=examples(300), deadline=None)
@given(st.one_of(message_dicts(), anything))
def test_hypothesis_message_from_wire_accepts_or_raises_protocol_error(obj):
    try:
        m = message_from_wire(obj)
    except ProtocolError as exc:
        assert len(str(exc)) < 2000
        return
    (back,) = decode_all(encode_frame(m))  # whatever is accepted must also travel
    assert type(back) is type(m) and wire_bytes(back) == wire_bytes(m)

