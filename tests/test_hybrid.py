"""Hybrid models end to end: sliding-window and recurrent layers, and a HOST tier.

Two-process runs of the example pair check every request's generated tokens
against the single-process reference and recompute from the workload what
the pair must have moved: only the read window (plus sinks) of windowed
layers and one state row per recurrent layer.  In-process tests show the
window is real (stale pages do not matter, in-window pages do).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvlend.core.layout import LayerKind, MemoryKind, Role, SelectionMode
from kvlend.core.lender import Lender
from kvlend.demo import toy_engine as te
from tests.support.example_pair import expected_bytes, pair

HYBRID = te.preset("hybrid")
NEW_TOKENS = 8


@pytest.mark.unit
def test_hybrid_layout_describes_windows_and_state():
    cache = te.PagedKVCache(HYBRID, 8, state_slots=3)
    layout = cache.layout()
    groups = layout.groups
    assert set(groups) == {"swa", "ssm", "full"}
    assert (groups["swa"].read_window, groups["swa"].sinks) == (64, 1)
    assert groups["full"].read_window == HYBRID.max_context
    assert groups["ssm"].kind is LayerKind.RECURRENT
    assert sorted(b.identity.role for b in groups["ssm"].buffers) == [Role.CONV, Role.STATE]
    state = layout.region("L1.state")
    assert state.num_pages == 3 and state.page_stride == 4 * sum(HYBRID.state_floats)
    assert state.address == cache.state_pool(1).data_ptr()
    # Sinks are declared in tokens: 16 tokens are one 16-token page and still one 32-token page.
    assert te.PagedKVCache(dataclasses.replace(HYBRID, tokens_per_page=32), 2).layout().groups["swa"].sinks == 1
    assert layout.scope == dataclasses.replace(HYBRID, tokens_per_page=32).scope


@pytest.mark.unit
def test_windowed_lease_lends_only_the_window_at_4k_tokens():
    config = te.preset("hybrid", max_context=8192)
    n, tpp = 4096, config.tokens_per_page
    cache = te.PagedKVCache(config, n // tpp, scatter=False)
    layout = cache.layout()
    row = 2 * config.kv_heads * tpp * config.head_dim * 4  # K|V page of one layer, float32
    state = 4 * sum(config.state_floats)
    # Every page: one full and two windowed layers, plus the state row.
    assert te.lent_bytes(layout, n, windowed=False) == 3 * (n // tpp) * row + state
    # Windowed layers read pages [(n - 64) // tpp, n // tpp) and the sink page.
    window_pages = len(range((n - 64) // tpp, n // tpp)) + 1
    assert te.lent_bytes(layout, n) == (n // tpp) * row + 2 * window_pages * row + state
    # The lender lends exactly that.
    table, slot = cache.alloc(n // tpp), cache.alloc_state()
    lease = Lender(layout).lend("r", n, cache.group_tables(table, slot), layout.full_selection(), 0.0, 5.0)
    lent = sum(len(lease.pages[g.name]) * sum(b.page_bytes for b in g.buffers) for g in layout.groups.values())
    assert lent == te.lent_bytes(layout, n) < te.lent_bytes(layout, n, windowed=False)


@pytest.mark.unit
def test_window_is_real_stale_pages_do_not_matter_window_pages_do():
    model = te.ToyModel(HYBRID)
    prompt = te.make_prompts(1, 5, 200, 200, HYBRID.vocab)[0]
    reference = te.generate_reference(model, prompt, NEW_TOKENS)
    cache = te.PagedKVCache(HYBRID, 32)
    slot = cache.alloc_state()
    table, first = te.prefill(model, cache, prompt, slot)
    lease = Lender(cache.layout()).lend("r", len(prompt), cache.group_tables(table, slot),
                                        cache.layout().full_selection(), 0.0, 5.0)
    window = set(lease.pages["swa"].token_pages.tolist())
    stale = [p for p in range(table.size) if p not in window]
    swa = [i for i, layer in enumerate(HYBRID.attention_layers) if HYBRID.kinds[layer] == "swa"]
    saved = [t.clone() for t in cache.tensors]
    states = [s.clone() for s in cache.states]

    def run(pages) -> list[int]:
        for t, s in zip(cache.tensors, saved):
            t.copy_(s)
        for t, s in zip(cache.states, states):
            t.copy_(s)
        for i in swa:
            cache.tensors[i][table[pages]] = torch.randn(cache.tensors[i][table[pages]].shape) * 4
        return te.decode(model, cache, table, len(prompt), first, NEW_TOKENS, slot)

    assert stale and run([]) == reference
    assert run(stale) == reference
    assert run(sorted(window)[-2:]) != reference


@pytest.mark.unit
def test_recurrent_state_is_one_slot_and_must_be_given():
    model = te.ToyModel(HYBRID)
    cache = te.PagedKVCache(HYBRID, 8, state_slots=1)
    with pytest.raises(te.PageRangeError, match="state slot"):
        te.prefill(model, cache, [1, 2, 3])
    slot = cache.alloc_state()
    with pytest.raises(te.PageRangeError, match="all 1 state slots"):
        cache.alloc_state()
    table, first = te.prefill(model, cache, [1, 2, 3], slot)
    assert cache.group_tables(table, slot)["ssm"].tolist() == [slot]
    # A state captured at another position gives other tokens: it is valid only whole and exact.
    reference = te.generate_reference(model, [1, 2, 3], NEW_TOKENS)
    assert te.decode(model, cache, table, 3, first, NEW_TOKENS, slot) == reference
    assert te.decode(model, cache, table, 3, first, NEW_TOKENS, slot) != reference  # slot advanced by decoding
    with pytest.raises(te.ToyEngineError, match="no recurrent layer"):
        te.PagedKVCache(te.preset("tiny"), 4).check_state(0)


@pytest.mark.system
def test_pair_hybrid_lends_windows_and_state_and_verifies():
    report = pair("--model", "hybrid", "--requests", "10", "--max-len", "400")
    lent, full = expected_bytes(HYBRID, 10, 400)
    assert (report["bytes"], report["bytes_full"]) == (lent, full)
    assert report["bytes"] < 0.8 * report["bytes_full"]
    assert report["model"] == "hybrid" and report["plan"] == "identity"


@pytest.mark.unit
def test_host_tier_layout_mixes_regions_in_one_named_lease():
    cache = te.PagedKVCache(HYBRID, 16, host_layers=(0,))
    layout = cache.layout()
    assert layout.region("L0.kv").kind is MemoryKind.HOST
    assert layout.region("L3.kv").kind is MemoryKind.HOST  # DEVICE only for a cache on a GPU
    selection = layout.full_selection()
    assert selection.mode is SelectionMode.NAMED
    slot = cache.alloc_state()
    table = cache.alloc(4)
    lease = Lender(layout).lend("r", 64, cache.group_tables(table, slot), selection, 0.0, 5.0)
    regions = {b.region for g in lease.pages for b in layout.groups[g].buffers}
    assert regions == {"L0.kv", "L2.kv", "L3.kv", "L1.state"}
    with pytest.raises(te.ToyEngineError, match="not attention layers"):
        te.PagedKVCache(HYBRID, 4, host_layers=(1,))


@pytest.mark.system
def test_pair_host_tier_decode_output_is_identical():
    report = pair("--model", "hybrid", "--host-layers", "2", "--requests", "8", "--max-len", "300")
    assert (report["bytes"], report["bytes_full"]) == expected_bytes(HYBRID, 8, 300, host_layers=(0, 2))
