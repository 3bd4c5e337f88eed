"""Run in .venv-vllm: every attention backend's KV cache, built on CPU as vLLM's GPU runner builds it, and
kvlend's description of it checked byte for byte; prints one JSON line.

For each backend vLLM offers (imported one by one: some need a GPU build), each KV cache layout it takes and
two block sizes, the two-layer cache comes from vLLM's own code: the backend's spec
(``customize_attention_spec``), the engine core's placement (``get_kv_cache_config_from_groups``), the kernel
block size (``select_common_block_size``, not split for block-outermost layouts, as
``prepare_kernel_block_sizes`` does) and the worker's strided views (``allocate_kv_cache``).  Each element gets
its own value through vLLM's logical view; then, for every block of every layer, the bytes at the addresses
kvlend's layout names (region address + page * page stride + buffer offset) must be exactly that block's values,
each (head, token) cell where the buffer's head geometry (if any) puts it, and moving those bytes into another
cache of the same shape must give, through vLLM's view and the K/V split the kernels use, the same block there.
A layout kvlend refuses is reported with its reason; a wrong description is a problem.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
import vllm
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, KVCacheLayout, MLAAttentionSpec
from vllm.v1.worker.utils import allocate_kv_cache, customize_attention_spec, select_common_block_size

from kvlend.core.layout import HeadOrder
from kvlend.errors import LayoutError
from kvlend_vllm.layout import layout_from_kv_caches

BLOCKS, HEADS, HEAD_SIZE = 6, 2, 8
BLOCK_SIZES = (16, 128)  # 128: above most kernels' fixed block sizes, so vLLM splits blocks where it would
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def spec_of(backend, block_size: int):
    if backend.is_mla():
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16,
                                cache_dtype_str="auto")
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                                 dtype=torch.bfloat16)
    return customize_attention_spec(backend, spec)


def allocate(spec, layout: KVCacheLayout, kernel_block_size: int) -> dict[str, torch.Tensor]:
    engine = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout, num_gpu_blocks_override=BLOCKS,
                                     prefix_cache_retention_interval=None),
        attention_config=SimpleNamespace(hisparse_config=None))
    config = get_kv_cache_config_from_groups(engine, [KVCacheGroupSpec(list(NAMES), spec)], 1 << 30)
    return allocate_kv_cache(config, torch.device("cpu"), layout, [kernel_block_size])


def raw_bytes(views: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The whole allocation behind ``views`` as uint8, and its address."""
    storage = next(iter(views.values())).untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage), storage.data_ptr()


def page_values(raw: torch.Tensor, base: int, lay, buffer, page: int) -> torch.Tensor:
    region = lay.region(buffer.region)
    start = region.address - base + page * region.page_stride + buffer.offset
    return raw[start:start + buffer.page_bytes]


def blocks_of(view: torch.Tensor, block_size: int) -> torch.Tensor:
    """vLLM's view with manager blocks first: [blocks, kernel blocks per block, heads, tokens, content]."""
    return view.unflatten(0, (BLOCKS, block_size // view.shape[2]))


def cells(page: torch.Tensor, geometry) -> torch.Tensor:
    """A page as [heads, tokens, content] by kvlend's head geometry (what a head slice would read)."""
    if geometry.order is HeadOrder.HND:
        return page.view(geometry.heads, -1, geometry.bytes_per_head // 2)
    return page.view(-1, geometry.heads, geometry.bytes_per_head // 2).transpose(0, 1)


def kernel_kv(block: torch.Tensor, mla: bool) -> tuple[torch.Tensor, ...]:
    """What the kernels read of one block: K and V split as FlashAttention/Triton do, or MLA's latent."""
    if mla:
        return (block,)
    return tuple(block.transpose(-3, -2).split(HEAD_SIZE, dim=-1))


def check(backend, layout: KVCacheLayout, block_size: int) -> str:
    """'exact', 'refused: <why>' or 'WRONG: <what>'."""
    try:
        spec = spec_of(backend, block_size)
        kernel = block_size if layout.is_block_outermost else select_common_block_size(block_size, [backend], [spec])
        src, dst = allocate(spec, layout, kernel), allocate(spec, layout, kernel)
    except (ValueError, AssertionError) as exc:
        return f"vllm refuses: {exc}"
    first = src[NAMES[0]]
    if first.element_size() != 2:
        return f"skipped: {first.dtype} elements"
    numel = first.numel()
    for i, name in enumerate(NAMES):  # one distinct int16 per (layer, block, head, token, K/V element)
        src[name].view(torch.int16)[...] = (torch.arange(numel, dtype=torch.int32) + i * numel - 2**15).to(
            torch.int16).reshape(first.shape)
    try:
        lays = [layout_from_kv_caches(c, block_size=block_size, dtype="bfloat16", scope="probe") for c in (src, dst)]
    except LayoutError as exc:
        return f"refused: {exc}"
    (raw_s, base_s), (raw_d, base_d) = raw_bytes(src), raw_bytes(dst)
    moves = {p: (p + 1) % BLOCKS for p in range(BLOCKS - 1)}  # destination block 0 receives nothing
    for buf_s, buf_d in zip(*(lay.buffers for lay in lays)):
        name = NAMES[buf_s.identity.layer]
        want = blocks_of(src[name].view(torch.int16), block_size)
        for p, q in moves.items():
            got = page_values(raw_s, base_s, lays[0], buf_s, p).view(torch.int16)
            if not torch.equal(got.sort().values, want[p].flatten().sort().values):
                return f"WRONG: {buf_s.name} page {p} is not exactly block {p}'s values"
            if buf_s.geometry is not None and not torch.equal(cells(got, buf_s.geometry), want[p][0]):
                return f"WRONG: {buf_s.name} page {p}: a (head, token) cell is not where its head geometry says"
            page_values(raw_d, base_d, lays[1], buf_d, q)[...] = page_values(raw_s, base_s, lays[0], buf_s, p)
    for name in NAMES:
        s, d = (blocks_of(c[name].view(torch.int16), block_size) for c in (src, dst))  # bit patterns, NaNs too
        if d[0].count_nonzero():
            return f"WRONG: {name} block 0 was written"
        for p, q in moves.items():
            for a, b in zip(kernel_kv(s[p], backend.is_mla()), kernel_kv(d[q], backend.is_mla())):
                if not torch.equal(a, b):
                    return f"WRONG: {name} block {p} moved to {q} reads differently"
    return "exact" if kernel == block_size else f"exact, {block_size // kernel} kernel blocks per block"


def main() -> None:
    checked, failed, skipped, supported = {}, {}, {}, {}
    for member in AttentionBackendEnum:
        if member.value is None:
            continue
        try:
            backend = member.get_class()
        except Exception as exc:  # a module that needs a GPU build of torch or a kernel package
            failed[member.name] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        if member.name == "NO_ATTENTION" or backend.is_ssm():
            skipped[member.name] = "no paged KV cache"
            continue
        try:
            layouts = backend.supported_kv_cache_layouts()
        except Exception as exc:
            layouts, supported[member.name] = None, f"asking failed ({type(exc).__name__}): all layouts tried"
        layouts = list(KVCacheLayout) if layouts is None else list(layouts)
        supported.setdefault(member.name, [x.name for x in layouts])
        results = {}
        for layout in layouts:
            for block_size in BLOCK_SIZES:
                try:
                    results[f"{layout.name}/bs{block_size}"] = check(backend, layout, block_size)
                except Exception as exc:
                    results[f"{layout.name}/bs{block_size}"] = f"error: {type(exc).__name__}: {exc}"[:300]
        checked[member.name] = {"mla": backend.is_mla(), "results": results}
    problems = [f"{b}: {k}: {v}" for b, c in checked.items() for k, v in c["results"].items()
                if v.startswith(("WRONG", "error"))]
    print(json.dumps({"vllm": vllm.__version__, "checked": checked, "import_failed": failed, "skipped": skipped,
                      "supported_layouts": supported, "problems": problems}))


if __name__ == "__main__":
    main()
