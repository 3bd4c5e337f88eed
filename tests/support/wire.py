"""Messages and frames built by hand: one sample of every message, canonical bytes to compare them,
hostile payloads, and a ticket's text form as any client could send it."""

from __future__ import annotations

import base64
import random
import struct

import msgpack
import numpy as np

from kvlend.core.layout import RowSelection
from kvlend.core.pages import GroupPages
from kvlend.protocol.codes import Code
from kvlend.protocol.ticket import TEXT_PREFIX, TICKET_VERSION
from kvlend.protocol.wire import (
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
)

LID, LID2 = bytes(range(16)), bytes(range(16, 32))


def lease(selection=RowSelection.all(), meta=None, n_full=4) -> LeaseOffer:
    return LeaseOffer(
        id=LID, request="req-1", num_tokens=300,
        pages={
            "full": GroupPages(np.arange(n_full) * 3, np.arange(n_full)[::-1] + 7),
            "mamba": GroupPages(np.array([0]), np.array([42])),
            "swa": GroupPages(np.array([], dtype=np.int64), np.array([], dtype=np.int64)),
        },
        selection=selection, ttl=2.5, meta=meta or {},
    )


META = {"first_token": 17, "logprobs": [1, -2, 2**63 - 1], "note": "x", "f": 0.5, "flag": True,
        "none": None, "raw": b"\x00\xff"}
OFFER = Offer(lease())
BIG_OFFER = Offer(lease(RowSelection.named("L0.K", "L0.V"), META, n_full=5000))
SAMPLES = [
    Handshake(b"layout-bytes", "nixl", b"\x00agent-metadata"),
    OFFER,
    BIG_OFFER,
    Heartbeat((LID, LID2)),
    Heartbeat(()),
    Heartbeat((LID,), (LID2,)),
    Renewed((LID,)),
    Done(LID, 300),
    DoneAck(LID, Code.OK, ""),
    DoneAck(LID2, Code.LEASE_EXPIRED, "LeaseExpired: gone"),
    Abort(LID, Code.CANCELLED, "decode gave up"),
    Claim(LID2),
    Claim(LID, bytes(range(32))),  # bound to the claimer's prompt
    Bye(Code.OK, "shutdown"),
    Offer(LeaseOffer(LID2, "req-2", 300, {"full": GroupPages(np.arange(2), np.array([5, 9]))}, RowSelection.all(),
                     2.5, ready=40)),  # progressive: 2 pages of 16 tokens committed so far
    Extend(LID2, 72, {"full": GroupPages(np.array([2, 3]), np.array([1, 0]))}),
    Extend(LID2, 299, {}, {"first": 17}),
    Extend(LID2, 300, {}),  # final, nothing more to read
]


def wire_bytes(m) -> bytes:
    """A canonical byte form for comparing messages (LeaseOffer has no ==; NaN != NaN)."""
    return msgpack.packb(m.to_wire(), use_bin_type=True)


def decode_all(data: bytes) -> list:
    dec = FrameDecoder()
    dec.feed(data)
    out = []
    while (m := dec.next_message()) is not None:
        out.append(m)
    return out


def nested_empty_maps(arrays: int, maps: int = 240) -> bytes:
    """The hostile payload of issue 22: an array of ``arrays`` arrays of ``maps`` empty maps (tiny on the wire,
    a dict each once built)."""
    inner = b"\xdc" + struct.pack(">H", maps) + b"\x80" * maps
    return b"\xdc" + struct.pack(">H", arrays) + inner * arrays


LEASE = bytes(range(16))
GOOD = dict(lease=LEASE, host="prefill-0.pool.example", port=5555, prefill="prefill-0", num_tokens=40,
            layout_id="ab" * 32)


def wire_text(**fields) -> str:
    """A ticket's text form built by hand, as a client could send it (nothing checked on the way)."""
    f = {**GOOD, **fields}
    data = msgpack.packb([TICKET_VERSION, f["lease"], f["host"], f["port"], f["prefill"], f["num_tokens"],
                          f["layout_id"], None], use_bin_type=True)
    return TEXT_PREFIX + base64.urlsafe_b64encode(data).rstrip(b"=").decode()


HEAD = b"\x92" + msgpack.packb(PROTOCOL_VERSION)  # a payload's opening: [version, ...


def framed(payload: bytes) -> bytes:
    """A frame around arbitrary payload bytes, so they reach the decoder's checks."""
    return struct.pack(">I", len(payload)) + payload


# ----------------------------------------------------------------------- fuzz
MSGPACK_MARKERS = [
    0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xC5, 0xC6, 0xC7,
    0xC8, 0xC9, 0xCA, 0xCB, 0xCC, 0xCF, 0xD0, 0xD3, 0xD4, 0xD8, 0xD9, 0xDA, 0xDB, 0xDC, 0xDD, 0xDE,
    0xDF, 0xE0, 0xFF,
]
HUGE_CLAIMS = [
    b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
    b"\xc9\xff\xff\xff\xff\x01", b"\xdc\xff\xff", b"\xde\xff\xff", b"\xc5\xff\xff", b"\xda\xff\xff",
    b"\xdd\x00\x01\x00\x00", b"\xdd\x00\x01\x00\x01", b"\xdf\x00\x00\x04\x01", b"\xc6\x01\x00\x00\x00",
    b"\xc6\x00\xff\xff\xff" + b"\x00" * 64, b"\xdc\xff\xff" + b"\xc0" * 100, b"\xde\x04\x00",
    b"\xd8\xff" + b"\x00" * 16, b"\xc7\x0c\xff" + b"\x00" * 12, b"\xd6\xff\x00\x00\x00\x00",
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",
    b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00", b"\x91" * 1000 + b"\xc0", b"\x81" * 600 + b"\xc0",
]


def raw_map(items) -> bytes:
    """A msgpack map whose values are raw (possibly malformed) msgpack bytes."""
    assert len(items) < 16
    return bytes([0x80 | len(items)]) + b"".join(msgpack.packb(k) + v for k, v in items)


def random_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.5:
        return rng.choice([
            None, True, False, 0, -1, 1, 15, 16, 2**31, 2**63 - 1, -2**63, 2**64 - 1, 0.0, -0.0,
            float("nan"), float("inf"), 1e308, "", "x", "ALL", "NAMED", "bye", "é" * 3, "x" * 5000,
            b"", b"\x00" * 15, b"\x00" * 16, b"\x00" * 17, b"\x01" * 8, b"\x00" * 24, LID,
        ])
    if r < 0.75:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["t", "id", "lease", "pages", "x", "meta", "selection", "code", "detail"]
    return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(7)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[min(pos, len(b) - 1)] = rng.choice(MSGPACK_MARKERS)
        elif op == 2:
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif op == 3:
            del b[pos:pos + rng.randrange(1, 9)]
        elif op == 4:
            del b[pos:]
        elif op == 5:
            b[pos:pos] = rng.choice(HUGE_CLAIMS)
        else:
            end = min(len(b), pos + rng.randrange(1, 17))
            b[pos:pos] = b[pos:end]
    return bytes(b)


def wrong_shape(rng: random.Random, m) -> object:
    body = m.to_wire()
    target = body["lease"] if isinstance(m, Offer) and rng.random() < 0.6 else body
    op = rng.randrange(5)
    key = rng.choice(sorted(target))
    if op == 0:
        target[key] = random_value(rng)
    elif op == 1:
        del target[key]
    elif op == 2:
        target[rng.choice(["extra", "t2", "", "id"])] = random_value(rng)
    elif op == 3 and isinstance(m, Offer):
        g = rng.choice(sorted(body["lease"]["pages"]))
        body["lease"]["pages"][g] = rng.choice([
            [random_value(rng), random_value(rng)], random_value(rng),
            [np.array([5, 3], "<i8").tobytes(), np.array([1, 2], "<i8").tobytes()],
            [np.array([0], "<i8").tobytes(), np.array([-7], "<i8").tobytes()],
        ])
    else:
        return random_value(rng)
    return body
