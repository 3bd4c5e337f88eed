"""PageLayout v3: an immutable description of a rank's KV pools.

A layout says where every (layer, role) buffer lives inside the page slots of
its memory regions, how many tokens a page holds and what the bytes mean.
Two layouts with equal ``layout_id`` can copy page bytes 1:1.  Everything is
validated at construction, so a layout that exists is a layout that makes
sense; ``encode``/``decode`` round-trip it through msgpack exactly.
"""

from __future__ import annotations

import hashlib
import reprlib
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Any, Iterable, Mapping, Sequence

import msgpack
import numpy as np

from ..errors import LayoutError

LAYOUT_VERSION = 3

# Caps for decoding a peer's bytes: refuse before allocating for a claim.
MAX_ENCODED_BYTES = 4 << 20
MAX_REGIONS = 4096
MAX_BUFFERS = 16384
MAX_NAME_LEN = 256
MAX_SCOPE_LEN = 65535
MAX_INT = (1 << 63) - 1


class MemoryKind(str, Enum):
    HOST = "HOST"
    DEVICE = "DEVICE"


class LayerKind(str, Enum):
    ATTENTION = "ATTENTION"
    RECURRENT = "RECURRENT"


class Role(str, Enum):
    K = "K"
    V = "V"
    KV = "KV"
    STATE = "STATE"
    CONV = "CONV"


class HeadOrder(str, Enum):
    HND = "HND"  # head-major inside a page: [heads, tokens, head_bytes]
    NHD = "NHD"  # token-major inside a page: [tokens, heads, head_bytes]


class Sharding(str, Enum):
    INDEXED = "INDEXED"  # heads split across tensor-parallel ranks
    REPLICATED = "REPLICATED"  # every rank holds the same bytes


class SelectionMode(str, Enum):
    ALL = "ALL"
    NAMED = "NAMED"


_ATTENTION_ROLES = {Role.K, Role.V, Role.KV}
_RECURRENT_ROLES = {Role.STATE, Role.CONV}


# Error messages quote a peer's values; keep the quote short and never recurse
# through deep nesting (repr of a 1000-deep list raises RecursionError).
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlevel = 3


def _show(value: Any) -> str:
    return _REPR.repr(value)


def _fail(where: str, msg: str) -> LayoutError:
    return LayoutError(f"{where}: {msg}")


def _check_int(where: str, value: Any, *, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, f"must be an int, got {type(value).__name__} {_show(value)}")
    if value < minimum or value > MAX_INT:
        raise _fail(where, f"must be in [{minimum}, 2**63), got {value}")


def _check_name(where: str, value: Any, max_len: int = MAX_NAME_LEN) -> None:
    if not isinstance(value, str) or not value:
        raise _fail(where, f"must be a non-empty str, got {_show(value)}")
    if len(value) > max_len:
        raise _fail(where, f"longer than {max_len} characters ({len(value)})")


def _check_enum(where: str, value: Any, enum: type[Enum]) -> None:
    if not isinstance(value, enum):
        raise _fail(where, f"must be a {enum.__name__}, got {_show(value)}")


@dataclass(frozen=True)
class MemoryRegion:
    """A registered pool: ``num_pages`` slots of ``page_stride`` bytes.

    ``address`` is local data (sent to the peer with backend metadata); it is
    not part of the layout's identity.
    """

    name: str
    kind: MemoryKind
    device_id: int
    size: int
    page_stride: int
    num_pages: int
    address: int = 0

    def __post_init__(self) -> None:
        where = f"region {_show(self.name)}"
        _check_name(f"{where}.name", self.name)
        _check_enum(f"{where}.kind", self.kind, MemoryKind)
        _check_int(f"{where}.device_id", self.device_id)
        _check_int(f"{where}.size", self.size, minimum=1)
        _check_int(f"{where}.page_stride", self.page_stride, minimum=1)
        _check_int(f"{where}.num_pages", self.num_pages, minimum=1)
        _check_int(f"{where}.address", self.address)
        if self.page_stride * self.num_pages > self.size:
            raise _fail(
                f"{where}.size",
                f"{self.size} bytes cannot hold {self.num_pages} pages of stride {self.page_stride}",
            )

    def page_address(self, ordinals: np.ndarray) -> np.ndarray:
        return self.address + np.asarray(ordinals, dtype=np.uint64) * np.uint64(self.page_stride)


@dataclass(frozen=True)
class LayerIdentity:
    """Which model layer a buffer belongs to (global id, same under any split)."""

    layer: int
    kind: LayerKind
    role: Role

    def __post_init__(self) -> None:
        where = f"layer {_show(self.layer)}"
        _check_int(f"{where}.layer", self.layer)
        _check_enum(f"{where}.kind", self.kind, LayerKind)
        _check_enum(f"{where}.role", self.role, Role)
        allowed = _ATTENTION_ROLES if self.kind is LayerKind.ATTENTION else _RECURRENT_ROLES
        if self.role not in allowed:
            raise _fail(f"{where}.role", f"{self.role.value} is not a role of a {self.kind.value} layer")

    @property
    def key(self) -> tuple[int, str]:
        return (self.layer, self.role.value)


@dataclass(frozen=True)
class HeadGeometry:
    """Head split of a buffer: ``heads`` local heads of ``bytes_per_head`` bytes per token."""

    heads: int
    bytes_per_head: int
    order: HeadOrder = HeadOrder.HND
    sharding: Sharding = Sharding.INDEXED

    def __post_init__(self) -> None:
        _check_int("geometry.heads", self.heads, minimum=1)
        _check_int("geometry.bytes_per_head", self.bytes_per_head, minimum=1)
        _check_enum("geometry.order", self.order, HeadOrder)
        _check_enum("geometry.sharding", self.sharding, Sharding)


@dataclass(frozen=True)
class BufferDesc:
    """One (layer, role) buffer: ``page_bytes`` at ``offset`` inside each slot of ``region``.

    ``group`` names the layer group: buffers of one group share a page table
    (one slot ordinal per token page; one slot per request for recurrent state).
    ``window`` is the declared attention window in tokens (None: full) and
    ``sinks`` the number of leading pages a windowed layer always reads.
    """

    name: str
    region: str
    offset: int
    page_bytes: int
    identity: LayerIdentity
    group: str = "default"
    geometry: HeadGeometry | None = None
    window: int | None = None
    sinks: int = 0

    def __post_init__(self) -> None:
        where = f"buffer {_show(self.name)}"
        _check_name(f"{where}.name", self.name)
        _check_name(f"{where}.region", self.region)
        _check_name(f"{where}.group", self.group)
        _check_int(f"{where}.offset", self.offset)
        _check_int(f"{where}.page_bytes", self.page_bytes, minimum=1)
        if not isinstance(self.identity, LayerIdentity):
            raise _fail(f"{where}.identity", f"must be a LayerIdentity, got {_show(self.identity)}")
        if self.geometry is not None and not isinstance(self.geometry, HeadGeometry):
            raise _fail(f"{where}.geometry", f"must be a HeadGeometry or None, got {_show(self.geometry)}")
        if self.window is not None:
            if isinstance(self.window, bool) or not isinstance(self.window, int) or abs(self.window) > MAX_INT:
                raise _fail(f"{where}.window", f"must be an int or None, got {_show(self.window)}")
        _check_int(f"{where}.sinks", self.sinks)

    @property
    def recurrent(self) -> bool:
        return self.identity.kind is LayerKind.RECURRENT


@dataclass(frozen=True)
class ReplicaRank:
    """Where this rank sits in the engine's parallel grid."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0

    def __post_init__(self) -> None:
        for axis in ("tp", "pp"):
            size, rank = getattr(self, f"{axis}_size"), getattr(self, f"{axis}_rank")
            _check_int(f"replica.{axis}_size", size, minimum=1)
            _check_int(f"replica.{axis}_rank", rank)
            if rank >= size:
                raise _fail(f"replica.{axis}_rank", f"{rank} must be < {axis}_size {size}")


@dataclass(frozen=True)
class RowSelection:
    """Which rows of a lease are read: every byte of each page slot (ALL) or named buffers."""

    mode: SelectionMode = SelectionMode.ALL
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_enum("selection.mode", self.mode, SelectionMode)
        if not isinstance(self.names, tuple):
            raise _fail("selection.names", f"must be a tuple, got {type(self.names).__name__}")
        for n in self.names:
            _check_name("selection.names[]", n)
        if self.mode is SelectionMode.ALL and self.names:
            raise _fail("selection.names", "ALL selection takes no names")
        if self.mode is SelectionMode.NAMED and not self.names:
            raise _fail("selection.names", "NAMED selection needs at least one buffer name")
        if len(set(self.names)) != len(self.names):
            raise _fail("selection.names", f"duplicate names in {self.names}")

    @classmethod
    def all(cls) -> RowSelection:
        return cls()

    @classmethod
    def named(cls, *names: str) -> RowSelection:
        return cls(SelectionMode.NAMED, tuple(names))


@dataclass(frozen=True)
class LayerGroup:
    """Buffers sharing one page table, with the window they read."""

    name: str
    kind: LayerKind
    buffers: tuple[BufferDesc, ...]
    read_window: int  # tokens; equals the kept window for full attention
    sinks: int  # pages

    @property
    def recurrent(self) -> bool:
        return self.kind is LayerKind.RECURRENT

    def pages_read(self, position: int, tokens_per_page: int) -> np.ndarray:
        """Token-page indices a decoder at ``position`` reads (sorted, unique).

        Recurrent state is one row (index 0), whatever the position.
        """
        if self.recurrent:
            return np.zeros(1, dtype=np.int64)
        if position <= 0:
            return np.zeros(0, dtype=np.int64)
        end = -(-position // tokens_per_page)
        start = max(0, position - self.read_window) // tokens_per_page
        window = np.arange(start, end, dtype=np.int64)
        if not self.sinks or not start:  # full attention: one range
            return window
        sinks = np.arange(min(self.sinks, start), dtype=np.int64)
        return np.concatenate([sinks, window])


@dataclass(frozen=True)
class PageLayout:
    """All KV pools of one rank; see DESIGN.md (PageLayout wire version 3)."""

    regions: tuple[MemoryRegion, ...]
    buffers: tuple[BufferDesc, ...]
    tokens_per_page: int
    kept_window: int
    dtype: str
    scope: str = ""
    replica: ReplicaRank = field(default_factory=ReplicaRank)

    def __post_init__(self) -> None:
        _check_int("tokens_per_page", self.tokens_per_page, minimum=1)
        _check_int("kept_window", self.kept_window, minimum=1)
        _check_name("dtype", self.dtype, 64)
        if not isinstance(self.scope, str) or len(self.scope) > MAX_SCOPE_LEN:
            got = f"{len(self.scope)} characters" if isinstance(self.scope, str) else type(self.scope).__name__
            raise _fail("scope", f"must be a str of at most {MAX_SCOPE_LEN} characters, got {got}")
        if not isinstance(self.replica, ReplicaRank):
            raise _fail("replica", f"must be a ReplicaRank, got {_show(self.replica)}")
        for attr, kind, cap in (("regions", MemoryRegion, MAX_REGIONS), ("buffers", BufferDesc, MAX_BUFFERS)):
            items = getattr(self, attr)
            if not isinstance(items, tuple):
                raise _fail(attr, f"must be a tuple, got {type(items).__name__}")
            if not items:
                raise _fail(attr, "must not be empty")
            if len(items) > cap:
                raise _fail(attr, f"{len(items)} entries exceed the cap of {cap}")
            for item in items:
                if not isinstance(item, kind):
                    raise _fail(attr, f"entries must be {kind.__name__}, got {_show(item)}")
            names = [x.name for x in items]
            if len(set(names)) != len(names):
                dup = sorted(n for n, count in Counter(names).items() if count > 1)
                raise _fail(attr, f"duplicate names {dup}")
        self._validate_buffers()

    def _validate_buffers(self) -> None:
        regions = {r.name: r for r in self.regions}
        seen_keys: dict[tuple[int, str], str] = {}
        group_kinds: dict[str, LayerKind] = {}
        spans: dict[str, list[tuple[int, int, str]]] = {}
        for b in self.buffers:
            where = f"buffer {b.name!r}"
            region = regions.get(b.region)
            if region is None:
                raise _fail(f"{where}.region", f"names no region ({b.region!r}; have {sorted(regions)})")
            if b.offset + b.page_bytes > region.page_stride:
                raise _fail(
                    f"{where}.offset",
                    f"offset {b.offset} + page_bytes {b.page_bytes} exceeds the page stride "
                    f"{region.page_stride} of region {region.name!r}",
                )
            key = b.identity.key
            if key in seen_keys:
                raise _fail(f"{where}.identity", f"(layer, role) {key} is also buffer {seen_keys[key]!r}")
            seen_keys[key] = b.name
            kind = group_kinds.setdefault(b.group, b.identity.kind)
            if kind is not b.identity.kind:
                raise _fail(f"{where}.group", f"group {b.group!r} mixes {kind.value} and {b.identity.kind.value} layers")
            if b.geometry is not None:
                if b.recurrent:
                    expect = b.geometry.heads * b.geometry.bytes_per_head
                    per = "per state row"
                else:
                    factor = 2 if b.identity.role is Role.KV else 1
                    expect = factor * b.geometry.heads * b.geometry.bytes_per_head * self.tokens_per_page
                    per = f"x tokens_per_page {self.tokens_per_page}" + (" x 2 (K and V)" if factor == 2 else "")
                if expect != b.page_bytes:
                    raise _fail(
                        f"{where}.geometry",
                        f"heads {b.geometry.heads} x bytes_per_head {b.geometry.bytes_per_head} {per} "
                        f"= {expect}, but page_bytes is {b.page_bytes}",
                    )
            spans.setdefault(b.region, []).append((b.offset, b.offset + b.page_bytes, b.name))
        for region_name, items in spans.items():
            items.sort()
            for (s0, e0, n0), (s1, _e1, n1) in zip(items, items[1:]):
                if s1 < e0:
                    raise _fail(f"buffer {n1!r}.offset", f"bytes [{s1}, ...) overlap buffer {n0!r} [{s0}, {e0}) in region {region_name!r}")

    # ----------------------------------------------------------------- views
    @cached_property
    def region_map(self) -> Mapping[str, MemoryRegion]:
        return {r.name: r for r in self.regions}

    @cached_property
    def buffer_map(self) -> Mapping[str, BufferDesc]:
        return {b.name: b for b in self.buffers}

    def region(self, name: str) -> MemoryRegion:
        try:
            return self.region_map[name]
        except KeyError:
            raise LayoutError(f"no region {name!r}; have {sorted(self.region_map)}") from None

    def buffer(self, name: str) -> BufferDesc:
        try:
            return self.buffer_map[name]
        except KeyError:
            raise LayoutError(f"no buffer {name!r}; have {sorted(self.buffer_map)}") from None

    def clamp_window(self, declared: int | None) -> int:
        """A declared window clamped to the kept window; None or <= 0 means the kept window."""
        if declared is None or declared <= 0:
            return self.kept_window
        return min(declared, self.kept_window)

    @cached_property
    def groups(self) -> Mapping[str, LayerGroup]:
        members: dict[str, list[BufferDesc]] = {}
        for b in self.buffers:
            members.setdefault(b.group, []).append(b)
        return {
            name: LayerGroup(
                name=name,
                kind=bs[0].identity.kind,
                buffers=tuple(bs),
                read_window=max(self.clamp_window(b.window) for b in bs),
                sinks=max(b.sinks for b in bs),
            )
            for name, bs in members.items()
        }

    def check_selection(self, selection: RowSelection) -> None:
        """Refuse a selection this layout cannot serve (HOST regions need NAMED rows)."""
        if selection.mode is SelectionMode.ALL:
            host = [r.name for r in self.regions if r.kind is MemoryKind.HOST]
            if host:
                raise LayoutError(f"selection ALL: HOST regions {host} support only NAMED rows")
        else:
            for n in selection.names:
                self.buffer(n)

    def full_selection(self) -> RowSelection:
        """Every row of a lease: ALL where every region is DEVICE, else every buffer by name."""
        if all(r.kind is MemoryKind.DEVICE for r in self.regions):
            return RowSelection.all()
        return RowSelection.named(*(b.name for b in self.buffers))

    def selected_buffers(self, selection: RowSelection) -> tuple[BufferDesc, ...]:
        self.check_selection(selection)
        if selection.mode is SelectionMode.ALL:
            return self.buffers
        return tuple(self.buffer_map[n] for n in selection.names)

    # -------------------------------------------------------------- identity
    @cached_property
    def layout_id(self) -> str:
        """SHA-256 of what decides byte compatibility; see ``canonical_identity``."""
        blob = msgpack.packb(self.canonical_identity(), use_bin_type=True)
        return hashlib.sha256(blob).hexdigest()

    def canonical_identity(self) -> list:
        """Declaration order, names, addresses and capacities do not count.

        Regions and groups are numbered by their smallest (layer, role) so
        that local naming cannot change the id.
        """
        keyed = sorted(self.buffers, key=lambda b: b.identity.key)
        region_rank: dict[str, int] = {}
        group_rank: dict[str, int] = {}
        for b in keyed:
            region_rank.setdefault(b.region, len(region_rank))
            group_rank.setdefault(b.group, len(group_rank))
        rows = []
        for b in keyed:
            g = b.geometry
            rows.append([
                b.identity.layer, b.identity.kind.value, b.identity.role.value,
                region_rank[b.region], self.region_map[b.region].page_stride,
                group_rank[b.group], b.offset, b.page_bytes,
                None if g is None else [g.heads, g.bytes_per_head, g.order.value, g.sharding.value],
            ])
        return [
            "kvlend.PageLayout", LAYOUT_VERSION, self.tokens_per_page, self.dtype, self.scope,
            [self.replica.tp_size, self.replica.tp_rank], rows,
        ]

    # -------------------------------------------------------------- encoding
    def to_dict(self) -> dict:
        return {
            "version": LAYOUT_VERSION,
            "tokens_per_page": self.tokens_per_page,
            "kept_window": self.kept_window,
            "dtype": self.dtype,
            "scope": self.scope,
            "replica": {
                "tp_size": self.replica.tp_size, "tp_rank": self.replica.tp_rank,
                "pp_size": self.replica.pp_size, "pp_rank": self.replica.pp_rank,
            },
            "regions": [
                {"name": r.name, "kind": r.kind.value, "device_id": r.device_id, "size": r.size,
                 "page_stride": r.page_stride, "num_pages": r.num_pages, "address": r.address}
                for r in self.regions
            ],
            "buffers": [_buffer_to_dict(b) for b in self.buffers],
        }

    def encode(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> PageLayout:
        """Strictly decode a peer's bytes; anything malformed is a ``LayoutError``."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise LayoutError(f"layout encoding must be bytes, got {type(data).__name__}")
        if len(data) > MAX_ENCODED_BYTES:
            raise LayoutError(f"layout encoding of {len(data)} bytes exceeds the cap of {MAX_ENCODED_BYTES}")
        try:
            obj = msgpack.unpackb(
                bytes(data), raw=False, strict_map_key=True, use_list=True,
                max_str_len=MAX_SCOPE_LEN, max_bin_len=0, max_ext_len=0,
                max_array_len=MAX_BUFFERS, max_map_len=16,
            )
        except Exception as exc:  # msgpack raises a zoo of types on bad input
            raise LayoutError(f"layout encoding is not valid msgpack: {type(exc).__name__}: {exc}") from None
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls, obj: Any) -> PageLayout:
        d = _fields(obj, "layout", {"version", "tokens_per_page", "kept_window", "dtype", "scope",
                                    "replica", "regions", "buffers"})
        if type(d["version"]) is not int or d["version"] != LAYOUT_VERSION:
            raise LayoutError(f"layout.version: expected {LAYOUT_VERSION}, got {_show(d['version'])}")
        rep = _fields(d["replica"], "replica", {"tp_size", "tp_rank", "pp_size", "pp_rank"})
        regions = _list(d["regions"], "regions", MAX_REGIONS)
        buffers = _list(d["buffers"], "buffers", MAX_BUFFERS)
        try:
            return cls(
                regions=tuple(_region_from_dict(r) for r in regions),
                buffers=tuple(_buffer_from_dict(b) for b in buffers),
                tokens_per_page=d["tokens_per_page"],
                kept_window=d["kept_window"],
                dtype=d["dtype"],
                scope=d["scope"],
                replica=ReplicaRank(**rep),
            )
        except LayoutError:
            raise
        except (TypeError, ValueError) as exc:
            raise LayoutError(f"layout: {exc}") from None


def _buffer_to_dict(b: BufferDesc) -> dict:
    g = b.geometry
    return {
        "name": b.name, "region": b.region, "offset": b.offset, "page_bytes": b.page_bytes,
        "layer": b.identity.layer, "kind": b.identity.kind.value, "role": b.identity.role.value,
        "group": b.group,
        "geometry": None if g is None else {
            "heads": g.heads, "bytes_per_head": g.bytes_per_head,
            "order": g.order.value, "sharding": g.sharding.value,
        },
        "window": b.window, "sinks": b.sinks,
    }


def _fields(obj: Any, where: str, keys: set[str]) -> dict:
    if not isinstance(obj, dict):
        raise LayoutError(f"{where}: expected a map, got {type(obj).__name__}")
    have = set(obj)
    if have != keys:
        missing, unknown = sorted(keys - have), sorted(map(str, have - keys))
        raise LayoutError(f"{where}: missing fields {missing}, unknown fields {unknown}")
    return obj


def _list(obj: Any, where: str, cap: int) -> list:
    if not isinstance(obj, list):
        raise LayoutError(f"{where}: expected a list, got {type(obj).__name__}")
    if len(obj) > cap:
        raise LayoutError(f"{where}: {len(obj)} entries exceed the cap of {cap}")
    return obj


def _enum(enum: type[Enum], value: Any, where: str):
    # Only strings reach the Enum lookup: its own error message would repr a
    # deeply nested peer value and overflow the stack.
    if isinstance(value, str):
        try:
            return enum(value)
        except ValueError:
            pass
    raise LayoutError(f"{where}: {_show(value)} is not one of {[e.value for e in enum]}")


def _region_from_dict(obj: Any) -> MemoryRegion:
    d = _fields(obj, "region", {"name", "kind", "device_id", "size", "page_stride", "num_pages", "address"})
    return MemoryRegion(
        name=d["name"], kind=_enum(MemoryKind, d["kind"], "region.kind"), device_id=d["device_id"],
        size=d["size"], page_stride=d["page_stride"], num_pages=d["num_pages"], address=d["address"],
    )


def _buffer_from_dict(obj: Any) -> BufferDesc:
    d = _fields(obj, "buffer", {"name", "region", "offset", "page_bytes", "layer", "kind", "role",
                                "group", "geometry", "window", "sinks"})
    geometry = None
    if d["geometry"] is not None:
        g = _fields(d["geometry"], "buffer.geometry", {"heads", "bytes_per_head", "order", "sharding"})
        geometry = HeadGeometry(
            heads=g["heads"], bytes_per_head=g["bytes_per_head"],
            order=_enum(HeadOrder, g["order"], "geometry.order"),
            sharding=_enum(Sharding, g["sharding"], "geometry.sharding"),
        )
    identity = LayerIdentity(
        layer=d["layer"], kind=_enum(LayerKind, d["kind"], "buffer.kind"), role=_enum(Role, d["role"], "buffer.role"),
    )
    return BufferDesc(
        name=d["name"], region=d["region"], offset=d["offset"], page_bytes=d["page_bytes"],
        identity=identity, group=d["group"], geometry=geometry, window=d["window"], sinks=d["sinks"],
    )


# ------------------------------------------------------------ from engine pools
@dataclass(frozen=True)
class _ArrayInfo:
    address: int
    nbytes: int
    kind: MemoryKind
    device_id: int
    shape: tuple[int, ...]
    itemsize: int
    dtype: str


def array_info(arr: Any) -> _ArrayInfo:
    """Address, size and placement of a numpy array or torch tensor (CPU or CUDA).

    Duck-typed so the core never imports torch.
    """
    if isinstance(arr, np.ndarray):
        if not arr.flags.c_contiguous:
            raise LayoutError("pool array must be C-contiguous")
        return _ArrayInfo(arr.ctypes.data, arr.nbytes, MemoryKind.HOST, 0, tuple(arr.shape), arr.itemsize, str(arr.dtype))
    if hasattr(arr, "data_ptr") and hasattr(arr, "element_size"):
        if not arr.is_contiguous():
            raise LayoutError("pool tensor must be contiguous")
        dev = arr.device
        kind = MemoryKind.DEVICE if dev.type == "cuda" else MemoryKind.HOST
        return _ArrayInfo(
            arr.data_ptr(), arr.numel() * arr.element_size(), kind, dev.index or 0,
            tuple(arr.shape), arr.element_size(), str(arr.dtype).removeprefix("torch."),
        )
    raise LayoutError(f"pool must be a numpy array or a torch tensor, got {type(arr).__name__}")


def layout_from_pools(
    kv: Sequence[Any] | None = None,
    *,
    k: Sequence[Any] | None = None,
    v: Sequence[Any] | None = None,
    tokens_per_page: int | None = None,
    kept_window: int,
    scope: str = "",
    replica: ReplicaRank = ReplicaRank(),
    layer_ids: Iterable[int] | None = None,
    windows: Mapping[int, int | None] | None = None,
    sinks: int = 0,
    group_of: Mapping[int, str] | None = None,
    sharding: Sharding = Sharding.INDEXED,
) -> PageLayout:
    """Describe an engine's paged KV pools, taking addresses from the arrays.

    Either ``kv``: one tensor per layer shaped ``[num_pages, 2, heads,
    tokens_per_page, head_dim]`` (K and V in one slot, HND), or ``k`` and
    ``v``: one tensor each per layer shaped ``[num_pages, heads,
    tokens_per_page, head_dim]``.  Each tensor becomes one region; K and V
    become separate buffers so a tensor-parallel peer can read head slices.
    ``windows`` maps a layer id to its declared window; ``group_of`` a layer
    id to a group name (default: ``"full"``, or ``"swa"`` for windowed layers).
    """
    if (kv is None) == (k is None and v is None):
        raise LayoutError("give either kv=[...] or k=[...] and v=[...]")
    if kv is None:
        if k is None or v is None or len(k) != len(v):
            raise LayoutError("k and v must both be given, one tensor per layer each")
        per_layer = [[a, b] for a, b in zip(k, v)]
    else:
        per_layer = [[t] for t in kv]
    if not per_layer:
        raise LayoutError("no layers given")
    ids = list(layer_ids) if layer_ids is not None else list(range(len(per_layer)))
    if len(ids) != len(per_layer):
        raise LayoutError(f"layer_ids has {len(ids)} entries for {len(per_layer)} layers")
    windows = dict(windows or {})
    regions, buffers, dtypes, tpps = [], [], set(), set()
    for layer, tensors in zip(ids, per_layer):
        window = windows.get(layer)
        group = (group_of or {}).get(layer, "full" if window is None else "swa")
        for t_index, tensor in enumerate(tensors):
            info = array_info(tensor)
            combined = kv is not None
            shape = info.shape
            if len(shape) != (5 if combined else 4) or (combined and shape[1] != 2):
                expect = "[num_pages, 2, heads, tokens_per_page, head_dim]" if combined else "[num_pages, heads, tokens_per_page, head_dim]"
                raise LayoutError(f"layer {layer}: tensor shape {shape} is not {expect}")
            if 0 in shape:
                raise LayoutError(f"layer {layer}: tensor shape {shape} has an empty dimension")
            num_pages, heads, tpp, head_dim = shape[0], shape[-3], shape[-2], shape[-1]
            tpps.add(tpp)
            dtypes.add(info.dtype)
            stride = info.nbytes // num_pages
            role_name = "kv" if combined else ("k", "v")[t_index]
            region = f"L{layer}.{role_name}"
            regions.append(MemoryRegion(region, info.kind, info.device_id, info.nbytes, stride, num_pages, info.address))
            geometry = HeadGeometry(heads, head_dim * info.itemsize, HeadOrder.HND, sharding)
            roles = [Role.K, Role.V] if combined else [(Role.K, Role.V)[t_index]]
            part = stride // len(roles)
            for i, role in enumerate(roles):
                buffers.append(BufferDesc(
                    name=f"L{layer}.{role.value}", region=region, offset=i * part, page_bytes=part,
                    identity=LayerIdentity(layer, LayerKind.ATTENTION, role), group=group,
                    geometry=geometry, window=window, sinks=sinks if window is not None else 0,
                ))
    if len(tpps) != 1 or len(dtypes) != 1:
        raise LayoutError(f"all pools must share tokens_per_page and dtype, got {sorted(tpps)} and {sorted(dtypes)}")
    tpp = tpps.pop()
    if tokens_per_page is not None and tokens_per_page != tpp:
        raise LayoutError(f"tokens_per_page={tokens_per_page} but the tensors hold {tpp} tokens per page")
    return PageLayout(tuple(regions), tuple(buffers), tpp, kept_window, dtypes.pop(), scope, replica)
