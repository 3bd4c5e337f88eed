"""Regenerate the example layout files beside this script.

Run ``python examples/layouts/make_layouts.py``; the output is deterministic
(made-up addresses, fixed capacities), so a diff after regenerating means the
layout encoding changed.  Shapes are the published models' configurations (bf16).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvlend.core.layout import (
    BufferDesc,
    HeadGeometry,
    HeadOrder,
    LayerIdentity,
    LayerKind,
    MemoryKind,
    MemoryRegion,
    PageLayout,
    ReplicaRank,
    Role,
    Sharding,
)

HERE = Path(__file__).resolve().parent
BF16 = 2
TOKENS_PER_PAGE = 16
KV_HEADS, HEAD_DIM = 8, 128
KV_PAGE = TOKENS_PER_PAGE * KV_HEADS * HEAD_DIM * BF16  # bytes of K (or V) per page and layer
BASE_ADDRESS = 0x7F00_0000_0000  # made up: addresses are local and not part of layout_id


def _attention_region(layer: int, kind: MemoryKind, num_pages: int, address: int) -> MemoryRegion:
    """One pool per layer with K then V in each slot, as ``layout_from_pools(kv=...)`` makes it."""
    stride = 2 * KV_PAGE
    return MemoryRegion(f"L{layer}.kv", kind, 0, stride * num_pages, stride, num_pages, address)


def _kv_buffers(layer: int, region: str, base: int, group: str,
                window: int | None = None, sinks: int = 0) -> list[BufferDesc]:
    geometry = HeadGeometry(KV_HEADS, HEAD_DIM * BF16, HeadOrder.HND, Sharding.INDEXED)
    return [
        BufferDesc(f"L{layer}.{role.value}", region, base + i * KV_PAGE, KV_PAGE,
                   LayerIdentity(layer, LayerKind.ATTENTION, role), group, geometry, window, sinks)
        for i, role in enumerate((Role.K, Role.V))
    ]


def llama_3_1_8b(num_pages: int = 4096) -> PageLayout:
    """Llama-3.1-8B: 32 full-attention layers, 8 KV heads x 128, 16 tokens per page."""
    regions, buffers = [], []
    for layer in range(32):
        region = _attention_region(layer, MemoryKind.DEVICE, num_pages, BASE_ADDRESS + layer * 2 * KV_PAGE * num_pages)
        regions.append(region)
        buffers += _kv_buffers(layer, region.name, 0, "full")
    return PageLayout(tuple(regions), tuple(buffers), TOKENS_PER_PAGE, kept_window=131072,
                      dtype="bfloat16", scope="meta-llama/Llama-3.1-8B-Instruct bf16", replica=ReplicaRank())


# Jamba-1.5-Mini Mamba layers: d_inner 8192 channels, d_state 16, d_conv 4.
D_INNER, D_STATE, D_CONV = 8192, 16, 4
SSM_ROW = D_INNER * D_STATE * BF16
CONV_ROW = D_INNER * (D_CONV - 1) * BF16


def jamba_hybrid(num_pages: int = 4096, num_requests: int = 256) -> PageLayout:
    """Jamba-1.5-Mini-style hybrid: attention on layers 4, 12, 20, 28; Mamba elsewhere.

    Layers 4 and 20 attend fully (group ``full``, on the device).  Layers 12
    and 28 declare a 4096-token sliding window with one sink page (group
    ``swa``) and live together in one HOST region, so that group can only be
    lent by NAMED rows.  The 28 Mamba layers keep their SSM and conv state in
    one device slot per request (group ``mamba``).
    """
    attention = [layer for layer in range(32) if layer % 8 == 4]
    full, windowed = attention[0::2], attention[1::2]
    regions, buffers = [], []
    address = BASE_ADDRESS
    for layer in full:
        region = _attention_region(layer, MemoryKind.DEVICE, num_pages, address)
        regions.append(region)
        buffers += _kv_buffers(layer, region.name, 0, "full")
        address += region.size
    swa_stride = len(windowed) * 2 * KV_PAGE
    regions.append(MemoryRegion("swa.host", MemoryKind.HOST, 0, swa_stride * num_pages, swa_stride, num_pages,
                                0x5500_0000_0000))
    for i, layer in enumerate(windowed):
        buffers += _kv_buffers(layer, "swa.host", i * 2 * KV_PAGE, "swa", window=4096, sinks=1)
    mamba = [layer for layer in range(32) if layer not in attention]
    state_stride = len(mamba) * (SSM_ROW + CONV_ROW)
    regions.append(MemoryRegion("mamba.state", MemoryKind.DEVICE, 0, state_stride * num_requests, state_stride,
                                num_requests, address))
    for i, layer in enumerate(mamba):
        base = i * (SSM_ROW + CONV_ROW)
        buffers.append(BufferDesc(
            f"L{layer}.STATE", "mamba.state", base, SSM_ROW, LayerIdentity(layer, LayerKind.RECURRENT, Role.STATE),
            "mamba", HeadGeometry(D_INNER, D_STATE * BF16, HeadOrder.HND, Sharding.INDEXED)))
        buffers.append(BufferDesc(
            f"L{layer}.CONV", "mamba.state", base + SSM_ROW, CONV_ROW,
            LayerIdentity(layer, LayerKind.RECURRENT, Role.CONV),
            "mamba", HeadGeometry(D_INNER, (D_CONV - 1) * BF16, HeadOrder.HND, Sharding.INDEXED)))
    return PageLayout(tuple(regions), tuple(buffers), TOKENS_PER_PAGE, kept_window=262144,
                      dtype="bfloat16", scope="ai21labs/AI21-Jamba-1.5-Mini bf16", replica=ReplicaRank())


EXAMPLES = {"llama-3.1-8b.json": llama_3_1_8b, "jamba-hybrid.json": jamba_hybrid}


def render(layout: PageLayout) -> str:
    """The file text: exactly ``to_dict()`` as JSON, one region or buffer per line."""
    fields = []
    for key, value in layout.to_dict().items():
        if isinstance(value, list):
            rows = ",\n".join("    " + json.dumps(row) for row in value)
            fields.append(f"  {json.dumps(key)}: [\n{rows}\n  ]")
        else:
            fields.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


def main() -> None:
    for name, build in EXAMPLES.items():
        (HERE / name).write_text(render(build()))


if __name__ == "__main__":
    main()
