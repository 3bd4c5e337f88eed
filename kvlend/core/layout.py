"""PageLayout v3: an immutable description of a rank's KV pools.

A layout says where every (layer, role) buffer lives inside the page slots of
its memory regions, how many tokens a page holds and what the bytes mean.
Two layouts with equal ``layout_id`` can copy page bytes 1:1.  Everything is
validated at construction, so a layout that exists is a layout that makes
sense; ``encode``/``decode`` round-trip it through msgpack exactly.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Iterable, Mapping, Sequence

import msgpack

from ..errors import LayoutError
from .arrays import array_info
from .layout_checks import (
    MAX_BUFFERS,
    MAX_ENCODED_BYTES,
    MAX_REGIONS,
    MAX_SCOPE_LEN,
    check_int,
    check_name,
    fail,
    show,
)
from .layout_codec import buffer_from_dict, buffer_to_dict, capped_list, exact_fields, region_from_dict
from .layout_parts import (
    BufferDesc,
    HeadGeometry,
    HeadOrder,
    LayerGroup,
    LayerIdentity,
    LayerKind,
    MemoryKind,
    MemoryRegion,
    ReplicaRank,
    Role,
    RowSelection,
    SelectionMode,
    Sharding,
)

__all__ = [
    "LAYOUT_VERSION", "MAX_ENCODED_BYTES", "BufferDesc", "HeadGeometry", "HeadOrder", "LayerGroup", "LayerIdentity",
    "LayerKind", "MemoryKind", "MemoryRegion", "PageLayout", "ReplicaRank", "Role", "RowSelection", "SelectionMode",
    "Sharding", "array_info", "layout_from_pools",
]

LAYOUT_VERSION = 3

_show = show  # kvlend.protocol.wire quotes a peer's values with it


@dataclass(frozen=True)
class PageLayout:
    """All KV pools of one rank (PageLayout wire version 3; docs/design.md says how they are used)."""

    regions: tuple[MemoryRegion, ...]
    buffers: tuple[BufferDesc, ...]
    tokens_per_page: int
    kept_window: int
    dtype: str
    scope: str = ""
    replica: ReplicaRank = field(default_factory=ReplicaRank)

    def __post_init__(self) -> None:
        check_int("tokens_per_page", self.tokens_per_page, minimum=1)
        check_int("kept_window", self.kept_window, minimum=1)
        check_name("dtype", self.dtype, 64)
        if not isinstance(self.scope, str) or len(self.scope) > MAX_SCOPE_LEN:
            got = f"{len(self.scope)} characters" if isinstance(self.scope, str) else type(self.scope).__name__
            raise fail("scope", f"must be a str of at most {MAX_SCOPE_LEN} characters, got {got}")
        if not isinstance(self.replica, ReplicaRank):
            raise fail("replica", f"must be a ReplicaRank, got {show(self.replica)}")
        for attr, kind, cap in (("regions", MemoryRegion, MAX_REGIONS), ("buffers", BufferDesc, MAX_BUFFERS)):
            items = getattr(self, attr)
            if not isinstance(items, tuple):
                raise fail(attr, f"must be a tuple, got {type(items).__name__}")
            if not items:
                raise fail(attr, "must not be empty")
            if len(items) > cap:
                raise fail(attr, f"{len(items)} entries exceed the cap of {cap}")
            for item in items:
                if not isinstance(item, kind):
                    raise fail(attr, f"entries must be {kind.__name__}, got {show(item)}")
            names = [x.name for x in items]
            if len(set(names)) != len(names):
                dup = sorted(n for n, count in Counter(names).items() if count > 1)
                raise fail(attr, f"duplicate names {dup}")
        self._validate_buffers()

    def _validate_buffers(self) -> None:
        regions = {r.name: r for r in self.regions}
        seen_keys: dict[tuple[int, str], str] = {}
        group_kinds: dict[str, LayerKind] = {}
        spans: dict[str, list[tuple[int, int, str, str]]] = {}
        for b in self.buffers:
            where = f"buffer {b.name!r}"
            region = regions.get(b.region)
            if region is None:
                raise fail(f"{where}.region", f"names no region ({b.region!r}; have {sorted(regions)})")
            if b.offset + b.page_bytes > region.page_stride:
                raise fail(
                    f"{where}.offset",
                    f"offset {b.offset} + page_bytes {b.page_bytes} exceeds the page stride "
                    f"{region.page_stride} of region {region.name!r}",
                )
            key = b.identity.key
            if key in seen_keys:
                raise fail(f"{where}.identity", f"(layer, role) {key} is also buffer {seen_keys[key]!r}")
            seen_keys[key] = b.name
            kind = group_kinds.setdefault(b.group, b.identity.kind)
            if kind is not b.identity.kind:
                raise fail(f"{where}.group", f"group {b.group!r} mixes {kind.value} and {b.identity.kind.value} layers")
            if b.geometry is not None:
                if b.recurrent:
                    expect = b.geometry.heads * b.geometry.bytes_per_head
                    per = "per state row"
                else:
                    factor = 2 if b.identity.role is Role.KV else 1
                    expect = factor * b.geometry.heads * b.geometry.bytes_per_head * self.tokens_per_page
                    per = f"x tokens_per_page {self.tokens_per_page}" + (" x 2 (K and V)" if factor == 2 else "")
                if expect != b.page_bytes:
                    raise fail(
                        f"{where}.geometry",
                        f"heads {b.geometry.heads} x bytes_per_head {b.geometry.bytes_per_head} {per} "
                        f"= {expect}, but page_bytes is {b.page_bytes}",
                    )
            spans.setdefault(b.region, []).append((b.offset, b.offset + b.page_bytes, b.group, b.name))
        for region_name, items in spans.items():
            _check_overlaps(region_name, items)

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
            "buffers": [buffer_to_dict(b) for b in self.buffers],
        }

    def encode(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    def without_addresses(self) -> PageLayout:
        """This layout with every region's address 0 (same ``layout_id``): what a peer that never reads
        our memory may see of it."""
        return replace(self, regions=tuple(replace(r, address=0) for r in self.regions))

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
        d = exact_fields(obj, "layout", {"version", "tokens_per_page", "kept_window", "dtype", "scope",
                                    "replica", "regions", "buffers"})
        if type(d["version"]) is not int or d["version"] != LAYOUT_VERSION:
            raise LayoutError(f"layout.version: expected {LAYOUT_VERSION}, got {show(d['version'])}")
        rep = exact_fields(d["replica"], "replica", {"tp_size", "tp_rank", "pp_size", "pp_rank"})
        regions = capped_list(d["regions"], "regions", MAX_REGIONS)
        buffers = capped_list(d["buffers"], "buffers", MAX_BUFFERS)
        try:
            return cls(
                regions=tuple(region_from_dict(r) for r in regions),
                buffers=tuple(buffer_from_dict(b) for b in buffers),
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



def _check_overlaps(region: str, spans: list[tuple[int, int, str, str]]) -> None:
    """Buffers of one group must not share a region's bytes; buffers of different groups may: one
    pool serving several groups (vLLM's hybrid allocator, where a recurrent state block lies in the
    first bytes of an attention page), where a slot belongs to one group at a time, so its page locks
    cover every group that uses it."""
    spans.sort(key=lambda span: (span[2], span[0], span[1]))  # by group, then start and end
    reach = None  # the span of this group reaching furthest so far
    for s1, e1, g1, n1 in spans:
        if reach is not None and reach[2] == g1 and s1 < reach[1]:
            s0, e0, _, n0 = reach
            raise fail(f"buffer {n1!r}.offset", f"bytes [{s1}, {e1}) overlap buffer {n0!r} [{s0}, {e0}) "
                       f"of the same group {g1!r} in region {region!r} (only different groups may share bytes)")
        if reach is None or reach[2] != g1 or e1 >= reach[1]:
            reach = (s1, e1, g1, n1)


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
                expect = ("[num_pages, 2, heads, tokens_per_page, head_dim]" if combined
                          else "[num_pages, heads, tokens_per_page, head_dim]")
                raise LayoutError(f"layer {layer}: tensor shape {shape} is not {expect}")
            if 0 in shape:
                raise LayoutError(f"layer {layer}: tensor shape {shape} has an empty dimension")
            num_pages, heads, tpp, head_dim = shape[0], shape[-3], shape[-2], shape[-1]
            tpps.add(tpp)
            dtypes.add(info.dtype)
            stride = info.nbytes // num_pages
            role_name = "kv" if combined else ("k", "v")[t_index]
            region = f"L{layer}.{role_name}"
            regions.append(MemoryRegion(region, info.kind, info.device_id, info.nbytes, stride, num_pages,
                                        info.address))
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
