"""The parts a PageLayout is made of: memory regions, (layer, role) buffers and their head geometry,
the rank's place in the parallel grid, row selections and layer groups; each validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from .layout_checks import MAX_INT, check_enum, check_int, check_name, fail, show


class MemoryKind(str, Enum):
    HOST = "HOST"
    DEVICE = "DEVICE"


class LayerKind(str, Enum):
    ATTENTION = "ATTENTION"
    RECURRENT = "RECURRENT"


class Role(str, Enum):
    K = "K"
    V = "V"
    KV = "KV"  # K part then V part, each heads x tokens x bytes_per_head
    # Each head's K and V together, in an order only the engine's kernel knows (vLLM's CPU blocks
    # hold a head's K rows then its V rows): split by heads only, never by tokens.
    HEAD_KV = "HEAD_KV"
    STATE = "STATE"
    CONV = "CONV"  # a conv state whole, or the first of its parts (Mamba2's x channels)
    # The conv state's other parts when each is sharded on its own (Mamba2: B and C channels,
    # split by SSM groups or held whole by every rank, where x is split by heads).
    CONV_B = "CONV_B"
    CONV_C = "CONV_C"


class HeadOrder(str, Enum):
    HND = "HND"  # head-major inside a page: [heads, tokens, head_bytes]
    NHD = "NHD"  # token-major inside a page: [tokens, heads, head_bytes]


class Sharding(str, Enum):
    INDEXED = "INDEXED"  # heads split across tensor-parallel ranks
    REPLICATED = "REPLICATED"  # every rank holds the same bytes


class SelectionMode(str, Enum):
    ALL = "ALL"
    NAMED = "NAMED"


_ATTENTION_ROLES = {Role.K, Role.V, Role.KV, Role.HEAD_KV}
_RECURRENT_ROLES = {Role.STATE, Role.CONV, Role.CONV_B, Role.CONV_C}


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
        where = f"region {show(self.name)}"
        check_name(f"{where}.name", self.name)
        check_enum(f"{where}.kind", self.kind, MemoryKind)
        check_int(f"{where}.device_id", self.device_id)
        check_int(f"{where}.size", self.size, minimum=1)
        check_int(f"{where}.page_stride", self.page_stride, minimum=1)
        check_int(f"{where}.num_pages", self.num_pages, minimum=1)
        check_int(f"{where}.address", self.address)
        if self.page_stride * self.num_pages > self.size:
            raise fail(
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
        where = f"layer {show(self.layer)}"
        check_int(f"{where}.layer", self.layer)
        check_enum(f"{where}.kind", self.kind, LayerKind)
        check_enum(f"{where}.role", self.role, Role)
        allowed = _ATTENTION_ROLES if self.kind is LayerKind.ATTENTION else _RECURRENT_ROLES
        if self.role not in allowed:
            raise fail(f"{where}.role", f"{self.role.value} is not a role of a {self.kind.value} layer")

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
        check_int("geometry.heads", self.heads, minimum=1)
        check_int("geometry.bytes_per_head", self.bytes_per_head, minimum=1)
        check_enum("geometry.order", self.order, HeadOrder)
        check_enum("geometry.sharding", self.sharding, Sharding)


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
        where = f"buffer {show(self.name)}"
        check_name(f"{where}.name", self.name)
        check_name(f"{where}.region", self.region)
        check_name(f"{where}.group", self.group)
        check_int(f"{where}.offset", self.offset)
        check_int(f"{where}.page_bytes", self.page_bytes, minimum=1)
        if not isinstance(self.identity, LayerIdentity):
            raise fail(f"{where}.identity", f"must be a LayerIdentity, got {show(self.identity)}")
        if self.geometry is not None and not isinstance(self.geometry, HeadGeometry):
            raise fail(f"{where}.geometry", f"must be a HeadGeometry or None, got {show(self.geometry)}")
        if self.window is not None:
            if isinstance(self.window, bool) or not isinstance(self.window, int) or abs(self.window) > MAX_INT:
                raise fail(f"{where}.window", f"must be an int or None, got {show(self.window)}")
        check_int(f"{where}.sinks", self.sinks)

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
            check_int(f"replica.{axis}_size", size, minimum=1)
            check_int(f"replica.{axis}_rank", rank)
            if rank >= size:
                raise fail(f"replica.{axis}_rank", f"{rank} must be < {axis}_size {size}")


@dataclass(frozen=True)
class RowSelection:
    """Which rows of a lease are read: every byte of each page slot (ALL) or named buffers."""

    mode: SelectionMode = SelectionMode.ALL
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_enum("selection.mode", self.mode, SelectionMode)
        if not isinstance(self.names, tuple):
            raise fail("selection.names", f"must be a tuple, got {type(self.names).__name__}")
        for n in self.names:
            check_name("selection.names[]", n)
        if self.mode is SelectionMode.ALL and self.names:
            raise fail("selection.names", "ALL selection takes no names")
        if self.mode is SelectionMode.NAMED and not self.names:
            raise fail("selection.names", "NAMED selection needs at least one buffer name")
        if len(set(self.names)) != len(self.names):
            raise fail("selection.names", f"duplicate names in {self.names}")

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
