"""vLLM's registered KV tensors described exactly as a kvlend ``PageLayout``.

Pure: it reads shapes, strides, element sizes and addresses (from torch
tensors or anything with the same four methods) and imports neither vLLM
nor torch, so it is tested without an engine.

vLLM 0.32 gives every attention backend the same logical per-layer cache,
``[blocks, heads, tokens, content]`` (RFC #42082), a strided view of one
int8 allocation: ``content`` is K then V of one (head, token) cell
(``head_size + head_size_v`` elements), or one latent vector for MLA (one
"head", no V), or a backend's packed bytes (quantised caches).  The resolved
``KVCacheLayout`` (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC) only permutes
the strides.  So:

- A block of one layer is one ``Role.HEAD_KV`` page: each head's K and V
  together, ``heads x tokens x content`` in the block's head order.  On GPU
  backends K and V interleave cell by cell; vLLM's CPU kernel keeps a head's
  K rows then its V rows inside the head's run (``cpu_attn.py`` views a
  block as ``[heads, 2 x tokens, head_size]``).  Either way a head's bytes are
  its own, so a tensor-parallel peer may read a head slice of a head-major
  block, while nothing splits a block by tokens (negotiation refuses it).
  What the bytes mean (block size, cache layout, kernel) is in the scope.
- The page must be one run of bytes: heads, tokens and content dense in some
  order (head- or token-major).  LHBNC and, with more than one layer, BHLNC
  put blocks or other layers between one block's heads; they are refused.
- Layer-outermost layouts (LB..) give each layer its own region; with a
  block-outermost layout (BL..) the layers' pages sit side by side in each
  block, so they share one region whose page is the whole packed block.
- Kernel blocks (vLLM splits a block into smaller ones for a kernel) are
  grouped back: a page is one of vLLM's blocks, whatever the kernel's.  Such
  a page holds its heads once per kernel block, so it has no head geometry:
  it moves whole, and a tensor-parallel mapping is refused.
- Heads are ``INDEXED`` (each TP rank holds its slice) unless the model has
  fewer KV heads than TP ranks or one latent (MLA), which every rank holds
  whole: ``REPLICATED``.
- Each of vLLM's KV cache groups is a kvlend group with its own page table
  (vLLM's block ids for that group), and a sliding-window group declares its
  window.  Under vLLM's hybrid allocator layers of different groups share one
  tensor (a block belongs to one group at a time): their buffers lie on the
  same bytes, which a layout allows across groups only.
- A Mamba2 layer's cache (a ``MambaSpec`` group) is one state block per
  request, ``[blocks, 1, 1, state bytes]`` padded to the attention page: the
  conv state, then the SSM state ``(heads, head_dim, d_state)``.  Both become
  buffers of a recurrent group, the padding none.  The SSM state is split by
  heads under tensor parallelism; the conv state, when stored channel-major
  (vLLM's ``DS`` layout), is three runs of channels sharded apart: x by heads
  (``CONV``), B and C by SSM groups, or held whole by every rank when the
  model has one group (``CONV_B``, ``CONV_C``).  Stored token-major (``SD``)
  the conv state has no split and moves whole.  A short conv (LFM2) has a
  conv state alone, its channels split evenly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
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
    ReplicaRank,
    Role,
    Sharding,
)
from kvlend.errors import LayoutError

GROUP = "full"  # the group of a model with one KV cache group: vLLM's block table is the page table


@dataclass(frozen=True)
class StateShape:
    """A recurrent layer's state block, per rank: the conv state's shape (``conv_first``: ``(channels,
    rows)``, vLLM's DS; else ``(rows, channels)``) and, for Mamba2, the SSM state's ``(heads, head_dim,
    d_state)`` (None: a short conv, LFM2's, whose conv state is all there is), with element sizes;
    ``groups``: a Mamba2 model's SSM groups (B and C channels are split by them, or held whole by every
    rank when there is one); ``dtypes``: the states' element types, by name."""

    conv: tuple[int, int]
    ssm: tuple[int, int, int] | None
    conv_elt: int
    ssm_elt: int
    conv_first: bool
    groups: int
    dtypes: tuple[str, ...] = ()

    @property
    def conv_bytes(self) -> int:
        return self.conv[0] * self.conv[1] * self.conv_elt

    @property
    def nbytes(self) -> int:
        return self.conv_bytes + (0 if self.ssm is None else self.ssm[0] * self.ssm[1] * self.ssm[2] * self.ssm_elt)

    def channels(self) -> tuple[int, int]:
        """(x channels, B channels) per rank of a Mamba2 conv state: x | B | C, x being heads x head_dim."""
        channels = self.conv[0] if self.conv_first else self.conv[1]
        heads, head_dim, d_state = self.ssm
        x = heads * head_dim
        b, odd = divmod(channels - x, 2)
        if odd or b <= 0 or b % d_state:
            raise LayoutError(f"Mamba2 state: {channels} conv channels are not {heads} heads x {head_dim} "
                              f"(x) plus B and C of whole groups of {d_state} (shapes {self.conv}, {self.ssm})")
        return x, b


@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV cache groups: its kvlend group name and window (tokens; None: full attention),
    or the state block of its recurrent layers (``state``)."""

    name: str
    window: int | None = None
    state: StateShape | None = None


def layer_index(name: str) -> int:
    """The layer number in a vLLM layer name such as ``model.layers.3.self_attn.attn``."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    raise LayoutError(f"kv cache {name!r}: no layer number in the name")


@dataclass(frozen=True)
class _Pages:
    """One layer's blocks: ``num`` pages of ``page_bytes`` at ``address + i * stride``."""

    layer: int
    address: int
    stride: int
    page_bytes: int
    num: int
    heads: tuple[int, int, HeadOrder] | None  # (heads, bytes per head and token, order); None: kernel blocks


def layout_from_kv_caches(kv_caches: Mapping[str, Any], *, block_size: int, dtype: str, scope: str,
                          device_id: int = 0, on_device: bool = False, tp_size: int = 1, tp_rank: int = 0,
                          replicated: bool = False, groups: Mapping[str, CacheGroup] | None = None) -> PageLayout:
    """The ``PageLayout`` of ``kv_caches`` (``register_kv_caches``' argument), layers in layer order.

    ``tp_size``/``tp_rank``: this worker's place in the engine's tensor-parallel group; ``replicated``:
    every rank holds the same heads (fewer KV heads than ranks, or MLA).  ``groups``: each layer's KV
    cache group (default: one full-attention group, ``GROUP``).
    """
    if not kv_caches:
        raise LayoutError("kv_caches: no KV cache tensors to describe")
    pages: list[_Pages] = []
    group_of: dict[int, CacheGroup] = {}
    for name, t in sorted(kv_caches.items(), key=lambda it: layer_index(it[0])):
        group = CacheGroup(GROUP) if groups is None else groups.get(name)
        p = _pages(name, t, block_size) if group is None or group.state is None else _state_pages(name, t, group.state)
        same = [q for q in pages if (q.address, q.stride, q.page_bytes) == (p.address, p.stride, p.page_bytes)]
        # A layer that reuses another's cache (vLLM's cross-layer KV sharing: in no group, or in the
        # other's) moves with it; one in another group (the hybrid allocator's shared tensors) has pages
        # of its own on the same bytes.
        if any(group is None or group_of[q.layer] == group for q in same):
            continue
        if group is None:
            raise LayoutError(f"kv cache {name!r}: in no KV cache group (the groups name {sorted(groups)})")
        pages.append(p)
        group_of[p.layer] = group
    for p in pages[1:]:
        if p.num != pages[0].num:
            raise LayoutError(f"kv cache of layer {p.layer}: {p.num} blocks, other layers have {pages[0].num}")
    kind = MemoryKind.DEVICE if on_device else MemoryKind.HOST
    regions: list[MemoryRegion] = []
    buffers: list[BufferDesc] = []
    members: dict[str, list[int]] = {}
    for p in pages:
        home = next((r for r in regions if r.page_stride == p.stride
                     and 0 <= p.address - r.address and p.address - r.address + p.page_bytes <= r.page_stride), None)
        if home is None:
            home = MemoryRegion(f"L{p.layer}", kind, device_id, p.num * p.stride, p.stride, p.num, p.address)
            regions.append(home)
        members.setdefault(home.name, []).append(p.layer)
        group = group_of[p.layer]
        if group.state is not None:
            buffers += _state_buffers(p.layer, home.name, p.address - home.address, group)
            continue
        geometry = None if p.heads is None else HeadGeometry(
            p.heads[0], p.heads[1], p.heads[2], Sharding.REPLICATED if replicated else Sharding.INDEXED)
        buffers.append(BufferDesc(f"L{p.layer}.kv", home.name, p.address - home.address, p.page_bytes,
                                  LayerIdentity(p.layer, LayerKind.ATTENTION, Role.HEAD_KV),
                                  group=group.name, geometry=geometry, window=group.window))
    # A region the layers share (block-outermost layouts) is named after all of them.
    names = {r.name: (r.name if len(members[r.name]) == 1 else f"L{members[r.name][0]}-L{members[r.name][-1]}")
             for r in regions}
    regions = [MemoryRegion(names[r.name], r.kind, r.device_id, r.size, r.page_stride, r.num_pages, r.address)
               for r in regions]
    buffers = [BufferDesc(b.name, names[b.region], b.offset, b.page_bytes, b.identity, group=b.group,
                          geometry=b.geometry, window=b.window) for b in buffers]
    return PageLayout(tuple(regions), tuple(buffers), block_size, block_size * pages[0].num, dtype, scope,
                      ReplicaRank(tp_size, tp_rank))


def _state_pages(name: str, t: Any, state: StateShape) -> _Pages:
    """Where one recurrent layer's state blocks lie: ``[blocks, 1, 1, bytes]`` views, each block's state
    (conv then SSM) at its start and the padding after it."""
    shape, elt = tuple(t.shape), t.element_size()
    stride = tuple(s * elt for s in t.stride())
    if len(shape) != 4 or shape[1:3] != (1, 1) or 0 in shape or shape[3] * elt < state.nbytes:
        raise LayoutError(f"kv cache {name!r}: shape {list(shape)} is not a Mamba2 state block of "
                          f"{state.nbytes} bytes ([blocks, 1, 1, bytes])")
    if shape[3] > 1 and stride[3] != elt:
        raise LayoutError(f"kv cache {name!r}: a state block is not one run of bytes (byte strides {list(stride)})")
    if stride[0] < state.nbytes:
        raise LayoutError(f"kv cache {name!r}: state blocks {stride[0]} bytes apart overlap their "
                          f"{state.nbytes} bytes of state")
    return _Pages(layer_index(name), t.data_ptr(), stride[0], state.nbytes, shape[0], None)


def _state_buffers(layer: int, region: str, offset: int, group: CacheGroup) -> list[BufferDesc]:
    """A recurrent layer's buffers in its state block: the conv state (whole, or where stored
    channel-major x | B | C for Mamba2, its channels for a short conv), then a Mamba2 SSM state split
    by heads."""
    state = group.state
    rows = state.conv[1] if state.conv_first else state.conv[0]

    def buffer(suffix: str, at: int, nbytes: int, role: Role, geometry: HeadGeometry | None) -> BufferDesc:
        return BufferDesc(f"L{layer}.{suffix}", region, offset + at, nbytes,
                          LayerIdentity(layer, LayerKind.RECURRENT, role), group=group.name, geometry=geometry)

    if state.ssm is None:  # a short conv: channels split evenly between tensor-parallel ranks
        geometry = HeadGeometry(state.conv[0], rows * state.conv_elt) if state.conv_first else None
        return [buffer("conv", 0, state.conv_bytes, Role.CONV, geometry)]
    heads, head_dim, d_state = state.ssm
    if state.conv_first:
        x, b = state.channels()
        row = rows * state.conv_elt  # one channel's bytes
        shared = Sharding.REPLICATED if state.groups == 1 else Sharding.INDEXED
        conv = [buffer("conv_x", 0, x * row, Role.CONV, HeadGeometry(heads, head_dim * row)),
                buffer("conv_b", x * row, b * row, Role.CONV_B,
                       HeadGeometry(b // d_state, d_state * row, sharding=shared)),
                buffer("conv_c", (x + b) * row, b * row, Role.CONV_C,
                       HeadGeometry(b // d_state, d_state * row, sharding=shared))]
    else:
        conv = [buffer("conv", 0, state.conv_bytes, Role.CONV, None)]
    ssm_head = head_dim * d_state * state.ssm_elt
    return conv + [buffer("ssm", state.conv_bytes, heads * ssm_head, Role.STATE, HeadGeometry(heads, ssm_head))]


def _pages(name: str, t: Any, block_size: int) -> _Pages:
    """Where one layer's blocks lie, or why kvlend cannot say it exactly."""
    layer = layer_index(name)
    shape, elt = tuple(t.shape), t.element_size()
    stride = tuple(s * elt for s in t.stride())
    if len(shape) != 4 or 0 in shape:
        raise LayoutError(f"kv cache {name!r}: shape {list(shape)} is not vLLM's [blocks, heads, tokens, content]")
    blocks, heads, tokens, content = shape
    if tokens != block_size and (tokens > block_size or block_size % tokens or blocks % (block_size // tokens)):
        raise LayoutError(f"kv cache {name!r}: {tokens} tokens per block do not make up vLLM's blocks of "
                          f"{block_size} (shape {list(shape)})")
    page = heads * tokens * content * elt
    run = elt
    for size, step in sorted(((n, s) for n, s in zip(shape[1:], stride[1:]) if n > 1), key=lambda d: d[1]):
        if step != run:
            raise LayoutError(f"kv cache {name!r}: a block's heads, tokens and content are not one run of bytes "
                              f"(shape {list(shape)}, byte strides {list(stride)}): other blocks or layers lie "
                              f"between its heads (vLLM layout LHBNC or BHLNC), which a kvlend page cannot say")
        run *= size
    if stride[0] < page:
        raise LayoutError(f"kv cache {name!r}: blocks {stride[0]} bytes apart overlap their {page}-byte pages")
    ratio = block_size // tokens
    if ratio > 1 and stride[0] != page:
        raise LayoutError(f"kv cache {name!r}: {ratio} kernel blocks of {tokens} tokens are not one run of bytes "
                          f"(stride {stride[0]}, page {page}): vLLM's block is not one page")
    order = HeadOrder.HND if heads == 1 or stride[1] > stride[2] else HeadOrder.NHD
    cells = content == 1 or stride[3] == elt  # a (head, token) cell's content is one run
    geometry = (heads, content * elt, order) if ratio == 1 and cells else None
    return _Pages(layer, t.data_ptr(), stride[0] * ratio, page * ratio, blocks // ratio, geometry)


def model_digest(hf_config: Mapping[str, Any]) -> str:
    """A short digest of the model's architecture: two engines whose KV bytes mean the same agree on it.

    The path a model was loaded from is left out (hosts differ); the weights are not hashed
    (too slow for real models), so the same architecture on other weights is not caught here.
    """
    kept = {k: v for k, v in hf_config.items() if k not in ("_name_or_path", "transformers_version")}
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def scope_of(*, platform: str, kernel: str, dtype: str, block_size: int, cache_layout: str, model: str,
             state: str = "") -> str:
    """What must match for a block to mean the same on both engines, in one comparable string
    (``state``: how a recurrent model stores its state, when it has one)."""
    scope = f"vllm/{platform}/{kernel}/{dtype}/bs{block_size}/{cache_layout}/model-{model}"
    return f"{scope}/{state}" if state else scope


def state_scope(state: StateShape) -> str:
    """The scope part of a recurrent model: the conv layout and the states' element types (their shapes,
    split by tensor parallelism, are the buffers')."""
    return "-".join(("state", "DS" if state.conv_first else "SD", *state.dtypes))
