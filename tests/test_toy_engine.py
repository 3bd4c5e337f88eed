"""The toy engine: deterministic, and decode from transferred page bytes equals the reference."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvlend.core.layout import MemoryKind, PageLayout, Role
from kvlend.demo import toy_engine as te
from kvlend.errors import KvlendError, PageRangeError
from tests.support.children import child_env
from tests.support.profiles import examples

TINY = te.preset("tiny")
NEW_TOKENS = 8
# Lengths around page boundaries (16 tokens per page) and a multi-page prompt.
PROMPTS = te.make_prompts(6, seed=7, min_len=1, max_len=150, vocab=TINY.vocab) + [
    list(range(1, 2)), list(range(16)), list(range(3, 20)),
]


@pytest.fixture(scope="module")
def model() -> te.ToyModel:
    return te.ToyModel(TINY)


@pytest.fixture(scope="module")
def references(model) -> list[list[int]]:
    return [te.generate_reference(model, p, NEW_TOKENS) for p in PROMPTS]


def transfer(model, prompt, *, src_seed=1, dst_seed=2, corrupt=None):
    """Prefill into cache A, copy the raw page bytes into other pages of cache B, decode from B.

    ``corrupt=(layer, page_index)`` overwrites that transferred page in B with garbage.
    """
    cfg = model.config
    a = te.PagedKVCache(cfg, 64, seed=src_seed)
    b = te.PagedKVCache(cfg, 96, seed=dst_seed)
    b.alloc(5)  # the destination pool is already partly used
    src, first = te.prefill(model, a, prompt)
    dst = b.alloc(src.size)
    for layer in range(cfg.layers):
        b.page_view(layer)[dst] = a.page_view(layer)[src]
    digest = te.kv_digest(a, src, len(prompt))
    assert te.kv_digest(b, dst, len(prompt)) == digest
    a.free(src)
    for t in a.tensors:  # B must not lean on A's memory
        t.fill_(7.0)
    if corrupt is not None:
        layer, index = corrupt
        garbage = torch.randn(b.tensors[layer][0].shape, generator=torch.Generator().manual_seed(3)) * 8
        b.page_view(layer)[dst[index]] = garbage.to(cfg.torch_dtype).view(torch.uint8).reshape(-1).numpy()
        assert te.kv_digest(b, dst, len(prompt)) != digest
    return src, dst, te.decode(model, b, dst, len(prompt), first, NEW_TOKENS)


@pytest.mark.unit
def test_models_built_apart_are_identical(model, references):
    other = te.ToyModel(te.preset("tiny"))
    assert list(other.weights) == list(model.weights)
    for name, w in model.weights.items():
        assert torch.equal(w, other.weights[name]), name
    assert [te.generate_reference(other, p, NEW_TOKENS) for p in PROMPTS] == references
    reseeded = te.ToyModel(dataclasses.replace(TINY, seed=1))
    assert not torch.equal(reseeded.weights["L0.wk"], model.weights["L0.wk"])
    assert reseeded.config.scope != TINY.scope


@pytest.mark.system
def test_reference_is_identical_in_another_process(references):
    child = (
        "import json, sys, torch; from kvlend.demo import toy_engine as te; "
        "torch.set_num_threads(2); m = te.ToyModel(te.preset('tiny')); "
        "print(json.dumps([te.generate_reference(m, p, int(sys.argv[2])) for p in json.loads(sys.argv[1])]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", child, json.dumps(PROMPTS), str(NEW_TOKENS)],
        capture_output=True, text=True, timeout=120, check=True, env=child_env(),
    )
    assert json.loads(out.stdout) == references


@pytest.mark.unit
def test_reference_is_a_real_generation(references):
    assert all(len(r) == NEW_TOKENS for r in references)
    assert len({tuple(r) for r in references}) == len(references)
    assert all(len(set(r)) > 1 for r in references)


@pytest.mark.unit
def test_decode_from_transferred_scattered_pages_equals_reference(model, references):
    for prompt, reference in zip(PROMPTS, references):
        src, dst, tokens = transfer(model, prompt)
        assert tokens == reference, f"prompt of {len(prompt)} tokens"
        if src.size > 1:
            assert not np.array_equal(src, dst)
    long_src, _, _ = transfer(model, list(range(200)))
    assert np.any(np.diff(long_src) != 1), "prefill pages should not be one contiguous run"


@pytest.mark.unit
def test_llama_shaped_bf16_pages_transfer():
    cfg = te.preset("llama", layers=2)
    llama = te.ToyModel(cfg)
    prompt = te.make_prompts(1, seed=3, min_len=40, max_len=40, vocab=cfg.vocab)[0]
    reference = te.generate_reference(llama, prompt, NEW_TOKENS)
    _, _, tokens = transfer(llama, prompt)
    assert tokens == reference
    _, _, corrupted = transfer(llama, prompt, corrupt=(0, 0))
    assert corrupted != reference


@pytest.mark.unit
def test_one_garbage_page_changes_the_output(model, references):
    changed = 0
    for prompt, reference in list(zip(PROMPTS, references))[:4]:
        *_, tokens = transfer(model, prompt, corrupt=(TINY.layers // 2, 0))
        changed += tokens != reference
    assert changed >= 1


@pytest.mark.unit
def test_pages_in_the_wrong_place_change_the_output(model, references):
    """K is rotated by its place in the table, so swapped pages are caught like corrupt ones."""
    changed = 0
    for prompt, reference in zip(PROMPTS, references):
        if len(prompt) <= 2 * TINY.tokens_per_page:
            continue
        cache = te.PagedKVCache(TINY, 32)
        table, first = te.prefill(model, cache, prompt)
        assert te.decode(model, cache, table, len(prompt), first, NEW_TOKENS) == reference
        swapped = table.copy()
        swapped[[0, 1]] = table[[1, 0]]
        assert te.kv_digest(cache, swapped, len(prompt)) != te.kv_digest(cache, table, len(prompt))
        changed += te.decode(model, cache, swapped, len(prompt), first, NEW_TOKENS) != reference
    assert changed >= 1


@pytest.mark.unit
def test_decode_uses_preallocated_pages_and_returns_its_own(model, references):
    prompt, reference = PROMPTS[0], references[0]
    cache = te.PagedKVCache(TINY, 32)
    table, first = te.prefill(model, cache, prompt)
    spare = cache.alloc(2)
    free_before = cache.num_free
    tokens = te.decode(model, cache, np.concatenate([table, spare]), len(prompt), first, NEW_TOKENS)
    assert tokens == reference
    assert cache.num_free == free_before


@pytest.mark.unit
def test_bad_inputs_are_typed_errors_that_change_nothing(model):
    cache = te.PagedKVCache(TINY, 8)
    table, first = te.prefill(model, cache, list(range(20)))
    free_before = cache.num_free
    with pytest.raises(PageRangeError, match="cannot hold 20 tokens"):
        te.decode(model, cache, table[:1], 20, first, 4)
    with pytest.raises(PageRangeError, match="not allocated"):
        te.decode(model, cache, np.array([table[0], (set(range(8)) - set(table.tolist())).pop()]), 20, first, 4)
    with pytest.raises(te.ToyEngineError, match="outside the vocabulary"):
        te.prefill(model, cache, [1, TINY.vocab])
    with pytest.raises(te.ToyEngineError, match="at least one token"):
        te.prefill(model, cache, [])
    with pytest.raises(PageRangeError, match="requested"):
        te.prefill(model, cache, list(range(200)))
    with pytest.raises(te.ToyEngineError, match="config differs"):
        te.prefill(te.ToyModel(dataclasses.replace(TINY, seed=5)), cache, [1])
    with pytest.raises(te.ToyEngineError, match="max_new_tokens"):
        te.decode(model, cache, table, 20, first, 0)
    assert cache.num_free == free_before
    for bad in (dict(q_heads=6), dict(head_dim=31), dict(dtype="int8"), dict(vocab=0)):
        with pytest.raises(te.ToyEngineError, match=next(iter(bad))):
            dataclasses.replace(TINY, **bad)
    with pytest.raises(KvlendError, match="unknown name"):
        te.preset("gpt5")


@pytest.mark.unit
@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=40), st.integers(0, 3))
def test_allocator_never_hands_out_a_page_twice(ops, seed):
    cache = te.PagedKVCache(TINY, 24, seed=seed)
    held: list[np.ndarray] = []
    for is_alloc, n in ops:
        outstanding = sum(h.size for h in held)
        if is_alloc:
            if n > cache.num_free:
                with pytest.raises(PageRangeError):
                    cache.alloc(n)
                assert cache.num_free == 24 - outstanding
                continue
            pages = cache.alloc(n)
            assert pages.dtype == np.int64 and pages.size == n
            held.append(pages)
            every = np.concatenate(held)
            assert np.unique(every).size == every.size
            assert every.min(initial=0) >= 0 and every.max(initial=0) < 24
        elif held:
            pages = held.pop(n % len(held))
            cache.free(pages)
            if pages.size:
                with pytest.raises(PageRangeError, match="not allocated"):
                    cache.free(pages[:1])
        assert cache.num_free == 24 - sum(h.size for h in held)


@pytest.mark.unit
def test_allocator_scatters_in_runs_and_refuses_bad_frees():
    scattered = te.PagedKVCache(TINY, 64, seed=4).alloc(64)
    assert sorted(scattered.tolist()) == list(range(64))
    steps = np.diff(scattered)
    assert np.any(steps != 1) and np.any(steps == 1)  # scattered, with runs left to coalesce
    ordered = te.PagedKVCache(TINY, 8, scatter=False)
    assert ordered.alloc(8).tolist() == list(range(8))
    cache = te.PagedKVCache(TINY, 8)
    pages = cache.alloc(3)
    for bad, why in (([8], "outside"), ([-1], "outside"), ([pages[0], pages[0]], "duplicate"),
                     ([[pages[0]]], "1-D")):
        with pytest.raises(PageRangeError, match=why):
            cache.free(bad)
    assert cache.num_free == 5


@pytest.mark.unit
def test_layout_describes_the_pools():
    cache = te.PagedKVCache(TINY, 12)
    layout = cache.layout()
    assert [r.address for r in layout.regions] == [t.data_ptr() for t in cache.tensors]
    page_bytes = 2 * TINY.kv_heads * TINY.tokens_per_page * TINY.head_dim * 4
    for region, tensor in zip(layout.regions, cache.tensors):
        assert region.kind is MemoryKind.HOST
        assert region.num_pages == 12 and region.page_stride == page_bytes
        assert region.size == tensor.numel() * tensor.element_size()
        assert region.page_stride == cache.page_view(0).shape[1]
    assert [(b.identity.layer, b.identity.role) for b in layout.buffers] == [
        (layer, role) for layer in range(TINY.layers) for role in (Role.K, Role.V)
    ]
    assert layout.tokens_per_page == TINY.tokens_per_page and layout.dtype == "float32"
    assert layout.scope == TINY.scope and layout.kept_window == TINY.max_context
    assert PageLayout.decode(layout.encode()) == layout
    # Another pool of the same model copies bytes 1:1; another model does not.
    assert te.PagedKVCache(TINY, 40, seed=9).layout().layout_id == layout.layout_id
    llama = te.PagedKVCache(te.preset("llama", layers=1), 2).layout(256)
    assert llama.layout_id != layout.layout_id
    assert llama.dtype == "bfloat16" and llama.kept_window == 256
    assert llama.buffers[0].page_bytes == 32 * 1024  # Llama-3-8B: K of one page and layer
