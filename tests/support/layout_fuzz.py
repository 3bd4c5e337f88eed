"""Hostile encodings of a ``PageLayout``: field mutations of valid layouts, huge size claims, byte
mutations; and a guard that turns a hanging decode into a failure."""

from __future__ import annotations

import contextlib
import copy
import random
import signal

import msgpack

from kvlend.core.layout import (
    BufferDesc,
    HeadGeometry,
    LayerIdentity,
    LayerKind,
    MemoryKind,
    MemoryRegion,
    PageLayout,
    ReplicaRank,
    Role,
)
from kvlend.errors import LayoutError

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


def seed_layouts() -> list[PageLayout]:
    kv = 2 * 4 * 8  # heads 2, bytes_per_head 4, 8 tokens per page
    dense = PageLayout(
        regions=tuple(MemoryRegion(f"L{i}.kv", MemoryKind.DEVICE, 0, 2 * kv * 8, 2 * kv, 8, 4096 * i)
                      for i in range(4)),
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
                 BufferDesc("w", "swa", 0, 128, LayerIdentity(2, LayerKind.ATTENTION, Role.K), "swa",
                            window=64, sinks=1),
                 BufferDesc("x", "swa", 128, 128, LayerIdentity(2, LayerKind.ATTENTION, Role.V), "swa",
                            window=64, sinks=1),
                 BufferDesc("s", "ssm", 0, 768, LayerIdentity(1, LayerKind.RECURRENT, Role.STATE), "mamba",
                            HeadGeometry(48, 16)),
                 BufferDesc("c", "ssm", 768, 96, LayerIdentity(1, LayerKind.RECURRENT, Role.CONV), "mamba")),
        tokens_per_page=4, kept_window=256, dtype="float16", scope="", replica=ReplicaRank(pp_size=2, pp_rank=1),
    )
    return [dense, hybrid]


SEEDS = [lay.encode() for lay in seed_layouts()]
SEED_DICTS = [lay.to_dict() for lay in seed_layouts()]


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
    # right value, wrong place
    return copy.deepcopy(rng.choice(SEED_DICTS)[rng.choice(("regions", "buffers", "replica"))])


def containers(obj, out, depth=0):
    """Maps and lists of a layout dict, down to the geometry (not into deep junk already placed)."""
    if isinstance(obj, (dict, list)) and depth < 5:
        out.append(obj)
        for child in (obj.values() if isinstance(obj, dict) else obj):
            containers(child, out, depth + 1)
    return out


def mutate_structure(rng: random.Random) -> bytes:
    """Valid msgpack, invalid layout: a changed, missing, unknown or duplicated field somewhere."""
    obj = msgpack.unpackb(rng.choice(SEEDS), raw=False)
    for _ in range(rng.choice((1, 1, 2, 3))):
        target = rng.choice(containers(obj, []))
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
