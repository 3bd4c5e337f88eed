"""Decoding a peer's layout bytes: hostile input raises LayoutError, nothing else, and never hangs.

A seeded loop mutates valid encodings (bit flips, truncation, insertion,
deletion, splicing, msgpack headers that claim huge sizes, structurally valid
msgpack with wrong types, missing or unknown fields); hypothesis adds random
bytes, random msgpack values and field-level mutations of generated layouts.
Whatever decodes must be a valid layout that round-trips.
"""

from __future__ import annotations

import contextlib
import copy
import random
import signal

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlend.errors import LayoutError
from kvlend.core.layout import (
    BufferDesc, HeadGeometry, LayerIdentity, LayerKind, MemoryKind, MemoryRegion, PageLayout,
    ReplicaRank, Role,
)
from strategies import layouts

ROUNDS = 10_000
HANG_GUARD_S = 120  # far above the ~2 s the loop takes; only turns a hang into a failure

FIELDS = ("version", "tokens_per_page", "kept_window", "dtype", "scope", "replica", "regions", "buffers",
          "name", "kind", "device_id", "size", "page_stride", "num_pages", "address", "region", "offset",
          "page_bytes", "layer", "role", "group", "geometry", "window", "sinks", "heads", "bytes_per_head",
          "order", "sharding", "tp_size", "tp_rank", "pp_size", "pp_rank")
ENUM_STRINGS = ("HOST", "DEVICE", "ATTENTION", "RECURRENT", "K", "V", "KV", "STATE", "CONV", "HND", "NHD",
                "INDEXED", "REPLICATED", "host", "")
INTS = (0, 1, -1, 2, 3, 16, 255, 256, 65535, 2**31, 2**32, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63))

# msgpack headers that claim far more than the input holds.
HUGE_CLAIMS = (
    b"\xdf\xff\xff\xff\xff",                     # map32 of 2**32 - 1 entries
    b"\xdd" + (10**9).to_bytes(4, "big"),        # array32 of 10**9 entries
    b"\xdb\xff\xff\xff\xff",                     # str32 of 4 GiB
    b"\xc6\xff\xff\xff\xff",                     # bin32 of 4 GiB
    b"\xc9\x7f\xff\xff\xff\x01",                 # ext32 of 2 GiB
    b"\xde\xff\xff",                             # map16 of 65535 entries
    b"\xdc\xff\xff",                             # array16 of 65535 entries
    b"\xdd" + (16384).to_bytes(4, "big"),        # array32 just under the buffer cap, then nothing
)
INTERESTING = HUGE_CLAIMS + (b"\xc0", b"\xc1", b"\xc2", b"\xc3", b"\x90", b"\x80", b"\xa0", b"\xff", b"\x00",
                             b"\xcf" + b"\xff" * 8, b"\xd3\x80" + b"\x00" * 7, b"\xcb\x7f\xf8" + b"\x00" * 6,
                             b"\xd4\xff\x00", b"\xd6\xff\x00\x00\x00\x00")


def _seed_layouts() -> list[PageLayout]:
    kv = 2 * 4 * 8  # heads 2, bytes_per_head 4, 8 tokens per page
    dense = PageLayout(
        regions=tuple(MemoryRegion(f"L{i}.kv", MemoryKind.DEVICE, 0, 2 * kv * 8, 2 * kv, 8, 4096 * i) for i in range(4)),
        buffers=tuple(
            BufferDesc(f"L{i}.{role.value}", f"L{i}.kv", j * kv, kv, LayerIdentity(i, LayerKind.ATTENTION, role),
                       "full", HeadGeometry(2, 4))
            for i in range(4) for j, role in enumerate((Role.K, Role.V))
        ),
        tokens_per_page=8, kept_window=1024, dtype="bfloat16", scope="toy", replica=ReplicaRank(2, 1),
    )
    hybrid = PageLayout(
        regions=(MemoryRegion("attn", MemoryKind.DEVICE, 1, 4096, 512, 8, 1 << 40),
                 MemoryRegion("swa", MemoryKind.HOST, 0, 2048, 256, 8),
                 MemoryRegion("ssm", MemoryKind.DEVICE, 1, 4096, 1024, 4)),
        buffers=(BufferDesc("a", "attn", 0, 512, LayerIdentity(0, LayerKind.ATTENTION, Role.KV), "full"),
                 BufferDesc("w", "swa", 0, 128, LayerIdentity(2, LayerKind.ATTENTION, Role.K), "swa", window=64, sinks=1),
                 BufferDesc("x", "swa", 128, 128, LayerIdentity(2, LayerKind.ATTENTION, Role.V), "swa", window=64, sinks=1),
                 BufferDesc("s", "ssm", 0, 768, LayerIdentity(1, LayerKind.RECURRENT, Role.STATE), "mamba", HeadGeometry(48, 16)),
                 BufferDesc("c", "ssm", 768, 96, LayerIdentity(1, LayerKind.RECURRENT, Role.CONV), "mamba")),
        tokens_per_page=4, kept_window=256, dtype="float16", scope="", replica=ReplicaRank(pp_size=2, pp_rank=1),
    )
    return [dense, hybrid]


SEEDS = [lay.encode() for lay in _seed_layouts()]
SEED_DICTS = [lay.to_dict() for lay in _seed_layouts()]


def decode_or_layout_error(data: bytes) -> PageLayout | None:
    """Decode; a success must be a valid layout that round-trips, a failure must be LayoutError."""
    try:
        lay = PageLayout.decode(data)
    except LayoutError:
        return None
    assert PageLayout.decode(lay.encode()) == lay
    return lay


@contextlib.contextmanager
def hang_guard(seconds: int):
    """Fail instead of hanging CI forever (no per-decode timing)."""
    def expired(signum, frame):
        raise AssertionError(f"fuzz loop still running after {seconds} s: a decode hangs")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------- mutations
def random_value(rng: random.Random, depth: int = 0):
    pick = rng.randrange(12 if depth < 3 else 8)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice((True, False))
    if pick in (2, 3):
        return rng.choice(INTS) if rng.random() < 0.7 else rng.randint(-(2**63), 2**64 - 1)
    if pick == 4:
        return rng.choice((0.0, -1.5, 3.0, 16.0, float("nan"), float("inf")))
    if pick == 5:
        return rng.choice(ENUM_STRINGS + FIELDS)
    if pick == 6:
        return "".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.choice((1, 8, 300))))
    if pick == 7:
        return "x" * rng.choice((65, 257, 65536))  # over the dtype, name and msgpack string caps
    if pick == 8:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if pick == 9:
        return {rng.choice(FIELDS): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    if pick == 10:
        nested = []
        for _ in range(rng.randrange(100, 1000)):  # deep, but within msgpack's own nesting limit
            nested = [nested]
        return nested
    return copy.deepcopy(rng.choice(SEED_DICTS)[rng.choice(("regions", "buffers", "replica"))])  # right value, wrong place


def _containers(obj, out, depth=0):
    """Maps and lists of a layout dict, down to the geometry (not into deep junk already placed)."""
    if isinstance(obj, (dict, list)) and depth < 5:
        out.append(obj)
        for child in (obj.values() if isinstance(obj, dict) else obj):
            _containers(child, out, depth + 1)
    return out


def mutate_structure(rng: random.Random) -> bytes:
    """Valid msgpack, invalid layout: a changed, missing, unknown or duplicated field somewhere."""
    obj = msgpack.unpackb(rng.choice(SEEDS), raw=False)
    for _ in range(rng.choice((1, 1, 2, 3))):
        target = rng.choice(_containers(obj, []))
        op = rng.randrange(4)
        if isinstance(target, dict):
            key = rng.choice(list(target)) if target else "version"
            if op == 0:
                target.pop(key, None)
            elif op == 1:
                target[rng.choice(FIELDS + ("extra", "Version"))] = random_value(rng)
            else:
                target[key] = random_value(rng)
        elif target:
            i = rng.randrange(len(target))
            if op == 0:
                del target[i]
            elif op == 1:
                target.append(target[i])
            else:
                target[i] = random_value(rng)
    return msgpack.packb(obj, use_bin_type=True)


def huge_claim_inside_a_layout(rng: random.Random) -> bytes:
    """A well-formed layout map whose last field's value is a header claiming a huge size."""
    d = dict(rng.choice(SEED_DICTS))
    last = rng.choice(list(d))
    value = d.pop(last)
    body = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in d.items())
    return (b"\x88" + body + msgpack.packb(last) + rng.choice(HUGE_CLAIMS)
            + msgpack.packb(value)[: rng.randrange(8)])


def mutate_bytes(rng: random.Random) -> bytes:
    data = bytearray(rng.choice(SEEDS))
    op = rng.randrange(7)
    if op == 0:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif op == 1:
        del data[rng.randrange(len(data)):]
    elif op == 2:
        at = rng.randrange(len(data) + 1)
        data[at:at] = rng.randbytes(rng.randint(1, 16))
    elif op == 3:
        at = rng.randrange(len(data))
        del data[at:at + rng.randint(1, 32)]
    elif op == 4:
        other = rng.choice(SEEDS)
        data = data[: rng.randrange(len(data))] + other[rng.randrange(len(other)):]
    elif op == 5:
        at = rng.randrange(len(data))
        piece = rng.choice(INTERESTING)
        data[at:at + (len(piece) if rng.random() < 0.5 else 0)] = piece
    else:
        data = bytearray(rng.randbytes(rng.randrange(300)))
    return bytes(data)


def test_seed_encodings_decode():
    for data, lay in zip(SEEDS, _seed_layouts()):
        assert PageLayout.decode(data) == lay


def test_ten_thousand_hostile_encodings_raise_only_layout_error():
    rng = random.Random(0x6B766C)
    makers = (mutate_bytes, mutate_bytes, mutate_bytes, mutate_structure, mutate_structure, huge_claim_inside_a_layout)
    decoded, messages = 0, set()
    with hang_guard(HANG_GUARD_S):
        for i in range(ROUNDS):
            data = rng.choice(makers)(rng)
            try:
                lay = PageLayout.decode(data)
            except LayoutError as exc:
                messages.add(str(exc).split(":")[0])
                continue
            except Exception as exc:
                pytest.fail(f"round {i}: {type(exc).__name__}: {exc} for input {data[:120].hex()}...")
            assert PageLayout.decode(lay.encode()) == lay
            decoded += 1
    # Most inputs are refused, for many different reasons (the fuzz reaches deep validation).
    assert decoded < ROUNDS // 4
    assert len(messages) > 30, sorted(messages)


@pytest.mark.parametrize("claim", HUGE_CLAIMS)
def test_huge_size_claims_are_refused(claim):
    with pytest.raises(LayoutError, match="not valid msgpack"):
        PageLayout.decode(claim)
    body = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in SEED_DICTS[0].items() if k != "buffers")
    with pytest.raises(LayoutError, match="not valid msgpack"):
        PageLayout.decode(b"\x88" + body + msgpack.packb("buffers") + claim)


def test_deeply_nested_values_are_refused_without_recursion_error():
    nested = []
    for _ in range(1000):
        nested = [nested]
    for field in ("dtype", "version", "tokens_per_page", "scope"):
        with pytest.raises(LayoutError, match=rf"^{field}|layout\.{field}"):
            PageLayout.decode(msgpack.packb({**SEED_DICTS[0], field: nested}))


def test_wrong_types_missing_and_unknown_fields_name_the_field():
    d = SEED_DICTS[1]
    cases = [
        ({**d, "tokens_per_page": "16"}, r"tokens_per_page: must be an int, got str '16'"),
        ({**d, "kept_window": 2**64 - 1}, r"kept_window: must be in \[1, 2\*\*63\), got 18446744073709551615"),
        ({k: v for k, v in d.items() if k != "dtype"}, r"layout: missing fields \['dtype'\], unknown fields \[\]"),
        ({**d, "colour": 1}, r"layout: missing fields \[\], unknown fields \['colour'\]"),
        ({**d, "regions": {}}, "regions: expected a list, got dict"),
        ({**d, "regions": [[]]}, "region: expected a map, got list"),
        ({**d, "regions": [{**d["regions"][0], "kind": "GPU"}]}, r"region\.kind: 'GPU' is not one of \['HOST', 'DEVICE'\]"),
        ({**d, "buffers": [{**d["buffers"][0], "role": ["K"]}]}, r"buffer\.role: \['K'\] is not one of"),
        ({**d, "buffers": [{**d["buffers"][0], "window": 1.5}]}, r"buffer 'a'\.window: must be an int or None, got 1\.5"),
        ({**d, "replica": {"tp_size": 1}}, r"replica: missing fields \['pp_rank', 'pp_size', 'tp_rank'\]"),
        ([d], "layout: expected a map, got list"),
    ]
    for obj, message in cases:
        with pytest.raises(LayoutError, match=message):
            PageLayout.decode(msgpack.packb(obj))


def test_many_duplicate_buffer_names_are_refused():
    d = SEED_DICTS[1]
    buffers = [{**d["buffers"][0], "layer": i} for i in range(16384)]
    with pytest.raises(LayoutError, match=r"buffers: duplicate names \['a'\]"):
        PageLayout.decode(msgpack.packb({**d, "buffers": buffers}))
    with pytest.raises(LayoutError, match="not valid msgpack"):
        PageLayout.decode(msgpack.packb({**d, "buffers": buffers + buffers[:1]}))  # over the array cap


# ------------------------------------------------------------- hypothesis
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=10) | st.sampled_from(ENUM_STRINGS + FIELDS),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), children, max_size=6),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes(data):
    decode_or_layout_error(data)


@settings(max_examples=150, deadline=None)
@given(msgpack_values)
def test_random_msgpack_values(obj):
    assert decode_or_layout_error(msgpack.packb(obj)) is None


@settings(max_examples=100, deadline=None)
@given(layouts(), st.data())
def test_field_mutations_of_generated_layouts(lay, data):
    obj = lay.to_dict()
    target = data.draw(st.sampled_from(_containers(obj, [])))
    if isinstance(target, dict):
        key = data.draw(st.sampled_from(sorted(target)))
        if data.draw(st.booleans()):
            del target[key]
            assert decode_or_layout_error(msgpack.packb(obj)) is None
            return
        target[key] = data.draw(msgpack_values)
    else:
        target[data.draw(st.integers(0, len(target) - 1))] = data.draw(msgpack_values)
    decode_or_layout_error(msgpack.packb(obj))
