"""Every decoder of peer bytes, fuzzed: over 100,000 seeded hostile inputs in total.

``PageLayout.decode`` (a peer's handshake layout), ``FrameDecoder`` (bytes
off the control socket, fed in random pieces), ``message_from_wire`` (the
decoded msgpack object) and ``LeaseOffer.from_wire`` (an offer's pages,
selection and meta).  Each input either decodes to something valid or
raises a ``KvlendError`` subclass: never another exception, never a hang
(``hang_guard``), and a claimed size never allocates what it claims
(``tracemalloc`` peaks on huge-claim inputs).  Mutations reuse the seeds
and mutators of ``test_wire`` and ``test_layout_fuzz``.
"""

from __future__ import annotations

import copy
import random
import struct
import tracemalloc
from collections import Counter

import msgpack
import numpy as np
import pytest
import test_layout_fuzz as lf
import test_wire as tw

from kvlend.errors import KvlendError, LayoutError, ProtocolError
from kvlend.core.layout import PageLayout
from kvlend.protocol.wire import PROTOCOL_VERSION, FrameDecoder, LeaseOffer, Offer, encode_frame, message_from_wire

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
def _feed_in_pieces(rng: random.Random, key: bytes):
    def run(data: bytes) -> list:
        dec = FrameDecoder(key)
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
    return b"".join(encode_frame(tw.KEY, seq, m) for seq, m in enumerate(msgs))


def test_frame_decoder_40k_fed_in_random_pieces():
    rng = random.Random(0x7F02)
    run = _feed_in_pieces(rng, tw.KEY)
    payloads = [msgpack.packb([PROTOCOL_VERSION, 0, m.to_wire()], use_bin_type=True) for m in tw.SAMPLES]
    counts: Counter = Counter()
    with lf.hang_guard(GUARD_S):
        for i in range(40_000):
            kind = i % 4
            if kind == 0:  # a mutated session: MAC, length and sequence failures
                data = tw._mutate(rng, _session(rng))
            elif kind == 1:  # mutated payload under a valid MAC: msgpack and schema failures
                data = tw.framed(tw.KEY, tw._mutate(rng, rng.choice(payloads)))
            elif kind == 2:  # valid msgpack of the wrong shape, or a wrong version/sequence
                body = tw._wrong_shape(rng, rng.choice(tw.SAMPLES))
                head = [PROTOCOL_VERSION, 0] if rng.random() < 0.8 else [tw._random_value(rng), tw._random_value(rng)]
                data = tw.framed(tw.KEY, msgpack.packb(head + [body], use_bin_type=True))
            else:  # a valid frame, then one of a later session (replay) or under another key
                other = encode_frame(tw.OTHER_KEY if rng.random() < 0.5 else tw.KEY, rng.randrange(3),
                                     rng.choice(tw.SAMPLES))
                data = encode_frame(tw.KEY, 0, rng.choice(tw.SAMPLES)) + other
            _expect_kvlend(run, data, counts, i)
    assert set(counts) <= {"ok", "ProtocolError", "AuthError"}, counts
    assert counts["AuthError"] > 5_000 and counts["ProtocolError"] > 5_000 and counts["ok"] > 100, counts


# ------------------------------------------------------ messages and offers
def test_message_from_wire_20k():
    rng = random.Random(0x7F03)
    counts: Counter = Counter()
    with lf.hang_guard(GUARD_S):
        for i in range(20_000):
            if i % 2:
                obj = tw._wrong_shape(rng, rng.choice(tw.SAMPLES))
            else:
                obj = tw._random_value(rng)
                if isinstance(obj, dict) and rng.random() < 0.7:
                    obj["t"] = rng.choice(sorted(tw.MESSAGES))
            _expect_kvlend(message_from_wire, obj, counts, i)
    assert set(counts) <= {"ok", "ProtocolError"}, counts
    assert counts["ProtocolError"] > 15_000, counts


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
            offer[rng.choice(sorted(offer))] = tw._random_value(rng)
    return offer


def test_lease_offer_from_wire_20k():
    rng = random.Random(0x7F04)
    counts: Counter = Counter()
    with lf.hang_guard(GUARD_S):
        for i in range(20_000):
            offer = _expect_kvlend(LeaseOffer.from_wire, _mutate_offer(rng), counts, i)
            if offer is not None:  # whatever is accepted round-trips through a real frame
                (msg,) = tw.decode_all(encode_frame(tw.KEY, 0, Offer(offer)))
                assert msg.lease.id == offer.id and set(msg.lease.pages) == set(offer.pages)
    assert set(counts) <= {"ok", "ProtocolError"}, counts
    assert counts["ProtocolError"] > 15_000 and counts["ok"] > 0, counts


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


@pytest.mark.parametrize("claim", HUGE, ids=lambda c: c[:6].hex())
def test_huge_claims_allocate_nothing_like_their_claim(claim):
    """Inputs are built first; only decoding is traced, and it stays far below any claimed size."""
    in_frame = tw.framed(tw.KEY, b"\x93\x01\x00" + tw._raw_map([("t", msgpack.packb("offer")), ("lease", claim)]))
    near_cap = struct.pack(">I", 16 << 20) + claim

    def every_decoder():
        with pytest.raises(LayoutError):
            PageLayout.decode(claim)
        with pytest.raises(LayoutError):
            PageLayout.decode(b"\x81\xa7version" + claim)
        dec = FrameDecoder(tw.KEY)
        dec.feed(near_cap)
        assert dec.next_message() is None
        with pytest.raises(ProtocolError):
            tw.decode_all(in_frame)
        with pytest.raises(ProtocolError):
            message_from_wire(MANY_IDS)
        with pytest.raises(ProtocolError):
            LeaseOffer.from_wire(BIG_PAGES)

    assert _peak(every_decoder) < PEAK_LIMIT


def test_a_frame_claiming_the_cap_holds_only_what_arrived():
    def feed():
        dec = FrameDecoder(tw.KEY)
        dec.feed(struct.pack(">I", 16 << 20))
        for _ in range(64):
            dec.feed(b"\x00" * 1024)
            assert dec.next_message() is None
    assert _peak(feed) < 1 << 20  # 64 KiB arrived of a claimed 16 MiB
