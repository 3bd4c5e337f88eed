"""PageLayout parts to and from plain maps (msgpack's), decoding a peer's maps strictly: exact fields,
capped lists, enum values by name."""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

from ..errors import LayoutError
from .layout_checks import show
from .layout_parts import (
    BufferDesc,
    HeadGeometry,
    HeadOrder,
    LayerIdentity,
    LayerKind,
    MemoryKind,
    MemoryRegion,
    Role,
    Sharding,
)


def buffer_to_dict(b: BufferDesc) -> dict:
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


def exact_fields(obj: Any, where: str, keys: set[str]) -> dict:
    if not isinstance(obj, dict):
        raise LayoutError(f"{where}: expected a map, got {type(obj).__name__}")
    have = set(obj)
    if have != keys:
        missing, unknown = sorted(keys - have), sorted(map(str, have - keys))
        raise LayoutError(f"{where}: missing fields {missing}, unknown fields {unknown}")
    return obj


def capped_list(obj: Any, where: str, cap: int) -> list:
    if not isinstance(obj, list):
        raise LayoutError(f"{where}: expected a list, got {type(obj).__name__}")
    if len(obj) > cap:
        raise LayoutError(f"{where}: {len(obj)} entries exceed the cap of {cap}")
    return obj


_E = TypeVar("_E", bound=Enum)


def parse_enum(enum: type[_E], value: Any, where: str) -> _E:
    # Only strings reach the Enum lookup: its own error message would repr a
    # deeply nested peer value and overflow the stack.
    if isinstance(value, str):
        try:
            return enum(value)
        except ValueError:
            pass
    raise LayoutError(f"{where}: {show(value)} is not one of {[e.value for e in enum]}")


def region_from_dict(obj: Any) -> MemoryRegion:
    d = exact_fields(obj, "region", {"name", "kind", "device_id", "size", "page_stride", "num_pages", "address"})
    return MemoryRegion(
        name=d["name"], kind=parse_enum(MemoryKind, d["kind"], "region.kind"), device_id=d["device_id"],
        size=d["size"], page_stride=d["page_stride"], num_pages=d["num_pages"], address=d["address"],
    )


def buffer_from_dict(obj: Any) -> BufferDesc:
    d = exact_fields(obj, "buffer", {"name", "region", "offset", "page_bytes", "layer", "kind", "role",
                                "group", "geometry", "window", "sinks"})
    geometry = None
    if d["geometry"] is not None:
        g = exact_fields(d["geometry"], "buffer.geometry", {"heads", "bytes_per_head", "order", "sharding"})
        geometry = HeadGeometry(
            heads=g["heads"], bytes_per_head=g["bytes_per_head"],
            order=parse_enum(HeadOrder, g["order"], "geometry.order"),
            sharding=parse_enum(Sharding, g["sharding"], "geometry.sharding"),
        )
    identity = LayerIdentity(
        layer=d["layer"], kind=parse_enum(LayerKind, d["kind"], "buffer.kind"),
        role=parse_enum(Role, d["role"], "buffer.role"),
    )
    return BufferDesc(
        name=d["name"], region=d["region"], offset=d["offset"], page_bytes=d["page_bytes"],
        identity=identity, group=d["group"], geometry=geometry, window=d["window"], sinks=d["sinks"],
    )
