"""vLLM's registered KV tensors described exactly as a kvlend ``PageLayout``.

Pure: it reads shapes, strides, element sizes and addresses (from torch
tensors or anything with the same four methods) and imports neither vLLM
nor torch, so it is tested without an engine.

Two shapes of per-layer cache tensor are understood:

- **CPU_ATTN** (vLLM's CPU backend): ``[blocks, kv_heads, block_size, 2*head_size]``.
  Inside each (block, head) slab K is stored transposed (``[head_size, block_size]``)
  and V token-major, and the kernel that wrote it depends on the ISA.  So a
  block is one opaque ``Role.KV`` page: whole blocks move exactly, and any
  transfer that would split a block by heads or tokens is refused by
  negotiation (no head geometry; the block size and kernel are in the scope).
- **Split K/V planes** (the GPU backends, ``[2, blocks, block_size, kv_heads, head_size]``):
  one region per plane and layer, ``Role.K``/``Role.V`` pages with token-major
  (``NHD``) head geometry, which kvlend can slice by heads.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from kvlend.core.layout import (
    BufferDesc,
    HeadGeometry,
    HeadOrder,
    LayerIdentity,
    LayerKind,
    MemoryKind,
    MemoryRegion,
    PageLayout,
    Role,
)
from kvlend.errors import LayoutError

GROUP = "full"  # one attention group: vLLM's block table is the page table


def layer_index(name: str) -> int:
    """The layer number in a vLLM layer name such as ``model.layers.3.self_attn.attn``."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    raise LayoutError(f"kv cache {name!r}: no layer number in the name")


def layout_from_kv_caches(kv_caches: Mapping[str, Any], *, block_size: int, dtype: str, scope: str,
                          device_id: int = 0, on_device: bool = False) -> PageLayout:
    """The ``PageLayout`` of ``kv_caches`` (``register_kv_caches``' argument), layers in layer order."""
    if not kv_caches:
        raise LayoutError("kv_caches: no KV cache tensors to describe")
    kind = MemoryKind.DEVICE if on_device else MemoryKind.HOST
    regions: list[MemoryRegion] = []
    buffers: list[BufferDesc] = []
    blocks = None
    for name, t in sorted(kv_caches.items(), key=lambda item: layer_index(item[0])):
        layer = layer_index(name)
        shape, stride, elt = tuple(t.shape), tuple(t.stride()), t.element_size()
        if len(shape) == 4 and shape[2] == block_size:
            num, heads, _, width = shape
            _check_contiguous(name, shape, stride)
            page = stride[0] * elt
            regions.append(MemoryRegion(f"L{layer}", kind, device_id, num * page, page, num, t.data_ptr()))
            buffers.append(BufferDesc(f"L{layer}.kv", f"L{layer}", 0, page,
                                      LayerIdentity(layer, LayerKind.ATTENTION, Role.KV), group=GROUP))
        elif len(shape) == 5 and shape[0] == 2 and shape[2] == block_size:
            _, num, _, heads, head_size = shape
            _check_contiguous(name, shape, stride)
            page = stride[1] * elt
            geometry = HeadGeometry(heads, head_size * elt, HeadOrder.NHD)
            for plane, role in enumerate((Role.K, Role.V)):
                region = f"L{layer}.{role.value}"
                regions.append(MemoryRegion(region, kind, device_id, num * page, page, num,
                                            t.data_ptr() + plane * stride[0] * elt))
                buffers.append(BufferDesc(region, region, 0, page, LayerIdentity(layer, LayerKind.ATTENTION, role),
                                          group=GROUP, geometry=geometry))
        else:
            raise LayoutError(f"kv cache {name!r}: shape {list(shape)} is neither [blocks, heads, {block_size}, "
                              f"2*head] (CPU) nor [2, blocks, {block_size}, heads, head] (split K/V)")
        if blocks is not None and num != blocks:
            raise LayoutError(f"kv cache {name!r}: {num} blocks, other layers have {blocks}")
        blocks = num
    return PageLayout(tuple(regions), tuple(buffers), block_size, block_size * blocks, dtype, scope)


def _check_contiguous(name: str, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
    want, step = [], 1
    for size in reversed(shape):
        want.append(step)
        step *= size
    if tuple(reversed(want)) != stride:
        raise LayoutError(f"kv cache {name!r}: strides {list(stride)} are not contiguous for shape {list(shape)}")


def model_digest(hf_config: Mapping[str, Any]) -> str:
    """A short digest of the model's architecture: two engines whose KV bytes mean the same agree on it.

    The path a model was loaded from is left out (hosts differ); the weights are not hashed
    (too slow for real models), so the same architecture on other weights is not caught here.
    """
    kept = {k: v for k, v in hf_config.items() if k not in ("_name_or_path", "transformers_version")}
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def scope_of(*, platform: str, kernel: str, dtype: str, block_size: int, cache_layout: str, model: str) -> str:
    """What must match for a block to mean the same on both engines, in one comparable string."""
    return f"vllm/{platform}/{kernel}/{dtype}/bs{block_size}/{cache_layout}/model-{model}"
