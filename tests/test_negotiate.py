"""negotiate(): identity and mapped plans, and every refusal naming its field."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvlend.core.negotiate as negotiate_mod
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
    layout_from_pools,
)
from kvlend.core.negotiate import IDENTITY, MAPPED, MAX_PAGE_RATIO, MAX_PIECES, Piece, negotiate
from kvlend.errors import LayoutMismatch, NegotiationLimit, QuotaExceeded
from tests.support.profiles import examples

pytestmark = pytest.mark.unit

BPH = 8  # bytes per head and token


def attention(*, layers=(0, 1), heads=4, tpp=16, order=HeadOrder.HND, tp=(1, 0), pp=(1, 0), dtype="bfloat16",
              scope="model", sharding=Sharding.INDEXED, bph=BPH, pad=0, num_pages=8, group="full",
              window=None, sinks=0, kept=4096, prefix="") -> PageLayout:
    """One region per layer holding K then V (then ``pad`` bytes) in each slot."""
    page = heads * tpp * bph
    regions, buffers = [], []
    for layer in layers:
        stride = 2 * page + pad
        name = f"{prefix}L{layer}"
        regions.append(MemoryRegion(name, MemoryKind.DEVICE, 0, stride * num_pages, stride, num_pages, 1 << 30))
        for i, role in enumerate((Role.K, Role.V)):
            buffers.append(BufferDesc(
                f"{prefix}L{layer}.{role.value}", name, i * page, page,
                LayerIdentity(layer, LayerKind.ATTENTION, role), group,
                HeadGeometry(heads, bph, order, sharding), window, sinks))
    return PageLayout(tuple(regions), tuple(buffers), tpp, kept, dtype, scope,
                      ReplicaRank(tp[0], tp[1], pp[0], pp[1]))


def with_state(layout: PageLayout, *, heads=4, bph=16, rows=4, sharding=Sharding.INDEXED) -> PageLayout:
    """Add one recurrent layer (id 99) whose state row is ``heads x bph`` bytes."""
    row = heads * bph
    region = MemoryRegion("state", MemoryKind.DEVICE, 0, row * rows, row, rows, 1 << 31)
    buf = BufferDesc("S99", "state", 0, row, LayerIdentity(99, LayerKind.RECURRENT, Role.STATE), "mamba",
                     HeadGeometry(heads, bph, HeadOrder.HND, sharding))
    return dataclasses.replace(layout, regions=layout.regions + (region,), buffers=layout.buffers + (buf,))


def fields(exc: LayoutMismatch) -> list[str]:
    return [f for f, *_ in exc.fields]


# ------------------------------------------------------------------ identity
def test_equal_layouts_give_an_identity_plan_of_whole_slots():
    pools = [np.zeros((6, 2, 4, 16, 8), dtype=np.uint8) for _ in range(3)]
    other = [np.zeros((9, 2, 4, 16, 8), dtype=np.uint8) for _ in range(3)]
    remote = layout_from_pools(kv=pools, kept_window=4096)
    local = layout_from_pools(kv=other, kept_window=1024)  # other capacity, addresses, a smaller kept window
    plan = negotiate(local, remote)
    assert plan.kind == IDENTITY and plan.local_id == plan.remote_id
    assert dict(plan.group_map) == {"full": "full"}
    assert len(plan.pairs) == 3 and all(p.whole_slot for p in plan.pairs)
    pair = plan.pairs[0]
    assert (pair.remote_region, pair.local_region) == ("L0.kv", "L0.kv")
    half = 4 * 16 * 8
    assert pair.pieces == (Piece("L0.K", 0, 0, half), Piece("L0.V", half, half, half))
    assert "identity plan" in plan.summary()


def test_names_capacities_and_a_smaller_local_window_never_block():
    remote = attention(group="full", window=None, num_pages=8)
    local = attention(group="g0", window=512, num_pages=3, prefix="dec.")
    plan = negotiate(local, remote)
    assert plan.kind == IDENTITY
    assert dict(plan.group_map) == {"full": "g0"}
    assert {(p.remote_region, p.local_region) for p in plan.pairs} == {("L0", "dec.L0"), ("L1", "dec.L1")}


def test_identity_with_two_groups_in_one_region_copies_per_buffer():
    layout = attention(layers=(0,))
    regrouped = dataclasses.replace(layout, buffers=(
        layout.buffers[0], dataclasses.replace(layout.buffers[1], group="other")))
    plan = negotiate(regrouped, regrouped)
    assert plan.kind == IDENTITY
    assert sorted((p.remote_group, p.whole_slot) for p in plan.pairs) == [("full", False), ("other", False)]


# ------------------------------------------------------------ tensor parallel
def test_tp1_to_tp2_reads_the_head_slice_of_each_part():
    remote = attention(heads=4)
    for rank in (0, 1):
        plan = negotiate(attention(heads=2, tp=(2, rank)), remote)
        assert plan.kind == MAPPED
        run = 2 * 16 * BPH  # two heads of 16 tokens: one contiguous run in HND
        k_src, v_src = rank * run, 4 * 16 * BPH + rank * run
        assert plan.pairs[0].pieces == (Piece("L0.K", k_src, 0, run), Piece("L0.V", v_src, run, run))


def test_tp2_to_tp1_lands_each_prefill_rank_at_its_heads():
    local = attention(heads=4)
    run = 2 * 16 * BPH
    for rank in (0, 1):
        plan = negotiate(local, attention(heads=2, tp=(2, rank)))
        assert plan.pairs[0].pieces == (Piece("L0.K", 0, rank * run, run),
                                        Piece("L0.V", run, 4 * 16 * BPH + rank * run, run))


def test_replicated_buffers_come_from_the_first_source_rank_only():
    def layout(heads, tp):
        base = attention(layers=(0,), heads=heads, tp=tp)
        return with_state(base, heads=2, sharding=Sharding.REPLICATED)

    local = layout(4, (1, 0))
    first, second = negotiate(local, layout(2, (2, 0))), negotiate(local, layout(2, (2, 1)))
    assert "S99" in {p.buffer for pair in first.pairs for p in pair.pieces}
    assert first.read_elsewhere == ()
    assert "S99" not in {p.buffer for pair in second.pairs for p in pair.pieces}
    assert second.read_elsewhere == ("S99",)
    assert "another prefill rank" in second.summary()


def test_recurrent_state_head_slices_follow_tp():
    local = with_state(attention(layers=(0,), heads=2, tp=(2, 1)), heads=2, bph=16)
    remote = with_state(attention(layers=(0,), heads=4), heads=4, bph=16)
    plan = negotiate(local, remote)
    (state,) = [p for p in plan.pairs if p.remote_group == "mamba"]
    assert state.pieces == (Piece("S99", 2 * 16, 0, 2 * 16),)


def test_a_prefill_rank_holding_none_of_the_heads_is_refused():
    with pytest.raises(LayoutMismatch) as err:
        negotiate(attention(heads=2, tp=(2, 0)), attention(heads=1, tp=(4, 2)))
    assert fields(err.value) == ["replica.tp_rank"]


def test_equal_tp_with_different_ranks_is_refused():
    with pytest.raises(LayoutMismatch) as err:
        negotiate(attention(heads=2, tp=(2, 0)), attention(heads=2, tp=(2, 1)))
    assert fields(err.value) == ["replica.tp_rank"]


def test_all_replicated_pair_that_exchanges_nothing_is_refused():
    local = attention(heads=4, sharding=Sharding.REPLICATED)
    negotiate(local, attention(heads=4, tp=(2, 0), sharding=Sharding.REPLICATED))
    with pytest.raises(LayoutMismatch) as err:
        negotiate(local, attention(heads=4, tp=(2, 1), sharding=Sharding.REPLICATED))
    assert fields(err.value) == ["replica.tp_rank"]
    assert "exchanges nothing" in str(err.value)


def test_nhd_across_tp_is_refused_naming_geometry_order():
    with pytest.raises(LayoutMismatch) as err:
        negotiate(attention(heads=2, tp=(2, 0), order=HeadOrder.NHD), attention(heads=4, order=HeadOrder.NHD))
    assert set(fields(err.value)) == {f"buffer({layer},{role}).geometry.order" for layer in (0, 1) for role in "KV"}
    assert "HND" in str(err.value)


def test_non_integer_tp_factor_is_refused():
    with pytest.raises(LayoutMismatch) as err:
        negotiate(attention(heads=4, tp=(3, 0)), attention(heads=6, tp=(2, 0)))
    assert "replica.tp_size" in fields(err.value)


def test_total_heads_must_match_across_tp():
    with pytest.raises(LayoutMismatch) as err:
        negotiate(attention(heads=4, tp=(2, 0)), attention(heads=4, tp=(1, 0)))
    assert "buffer(0,K).geometry.heads" in fields(err.value)


# ------------------------------------------------------------- page sizes
@pytest.mark.parametrize("order", [HeadOrder.HND, HeadOrder.NHD])
def test_big_remote_pages_split_into_small_local_pages(order):
    plan = negotiate(attention(layers=(0,), heads=2, tpp=16, order=order),
                     attention(layers=(0,), heads=2, tpp=32, order=order))
    pair = plan.pairs[0]
    assert (pair.remote_per_local, pair.local_per_remote) == (1, 2)
    k = [p for p in pair.pieces if p.buffer == "L0.K"]
    if order is HeadOrder.HND:  # one run per head per small page
        assert k == [Piece("L0.K", (h * 32 + j * 16) * BPH, h * 16 * BPH, 16 * BPH, j)
                     for j in range(2) for h in range(2)]
    else:  # a small page is a contiguous part of the big one
        assert k == [Piece("L0.K", j * 16 * 2 * BPH, 0, 16 * 2 * BPH, j) for j in range(2)]


@pytest.mark.parametrize("order", [HeadOrder.HND, HeadOrder.NHD])
def test_small_remote_pages_fill_big_local_pages(order):
    # A big local page starts its window up to 32 - 16 tokens earlier: the remote keeps that much more.
    plan = negotiate(attention(layers=(0,), heads=2, tpp=32, order=order),
                     attention(layers=(0,), heads=2, tpp=16, order=order, kept=4096 + 16))
    pair = plan.pairs[0]
    assert (pair.remote_per_local, pair.local_per_remote) == (2, 1)
    k = [p for p in pair.pieces if p.buffer == "L0.K"]
    if order is HeadOrder.HND:
        assert k == [Piece("L0.K", h * 16 * BPH, (h * 32 + q * 16) * BPH, 16 * BPH, q)
                     for q in range(2) for h in range(2)]
    else:
        assert k == [Piece("L0.K", 0, q * 16 * 2 * BPH, 16 * 2 * BPH, q) for q in range(2)]


def test_recurrent_state_is_copied_whole_whatever_the_page_size():
    plan = negotiate(with_state(attention(tpp=16)), with_state(attention(tpp=32)))
    (state,) = [p for p in plan.pairs if p.remote_group == "mamba"]
    assert (state.remote_per_local, state.local_per_remote) == (1, 1)
    assert state.pieces == (Piece("S99", 0, 0, 4 * 16),)


def test_non_integer_page_factor_is_refused():
    with pytest.raises(LayoutMismatch) as err:
        negotiate(attention(tpp=16), attention(tpp=24))
    assert fields(err.value) == ["tokens_per_page"]


def test_geometry_free_buffers_map_page_sizes_by_bytes_per_token():
    def opaque(tpp, per_token):
        layout = attention(layers=(0,), tpp=tpp)
        buffers = tuple(dataclasses.replace(b, geometry=None, page_bytes=per_token * tpp, offset=i * per_token * tpp)
                        for i, b in enumerate(layout.buffers))
        stride = 2 * per_token * tpp
        region = dataclasses.replace(layout.regions[0], page_stride=stride, size=stride * 8)
        return dataclasses.replace(layout, regions=(region,), buffers=buffers)

    plan = negotiate(opaque(16, 64), opaque(32, 64))
    assert [p for p in plan.pairs[0].pieces if p.buffer == "L0.K"] == [
        Piece("L0.K", j * 16 * 64, 0, 16 * 64, j) for j in range(2)]
    with pytest.raises(LayoutMismatch) as err:
        negotiate(opaque(16, 64), opaque(32, 32))
    assert "buffer(0,K).page_bytes" in fields(err.value)


# ------------------------------------------------------------------ refusals
def test_every_difference_is_listed_at_once():
    with pytest.raises(LayoutMismatch) as err:
        negotiate(attention(dtype="bfloat16", scope="a", bph=8), attention(dtype="float16", scope="b", bph=16))
    got = fields(err.value)
    assert got[:2] == ["dtype", "scope"]
    assert {f"buffer({layer},{role}).geometry.bytes_per_head" for layer in (0, 1) for role in "KV"} <= set(got)
    entry = dict((f, (lv, rv)) for f, lv, rv, _ in err.value.fields)
    assert entry["dtype"] == ("bfloat16", "float16")
    assert "bfloat16" in str(err.value) and "float16" in str(err.value)


def test_a_refusal_names_only_what_differs():
    """Only the dtype and the block size differ (issue 22, finding 9): nothing blames the model, the weights,
    the quantization or the head dimension."""
    scope = "vllm/cpu/avx512/{}/bs{}/blocks/model-0123abcd"
    local = attention(dtype="bfloat16", scope=scope.format("bfloat16", 16), bph=8)
    remote = attention(dtype="float32", scope=scope.format("float32", 32), tpp=32, bph=16)
    with pytest.raises(LayoutMismatch) as err:
        negotiate(local, remote)
    why = {f: reason for f, _, _, reason in err.value.fields}
    assert why["dtype"] == "element types differ"
    assert why["scope"] == "the engines differ in 'bfloat16' vs 'float32', 'bs16' vs 'bs32': the bytes would mean " \
                           "something else"
    assert {reason for f, reason in why.items() if f.endswith("bytes_per_head")} == {"element types differ"}
    for blamed in ("model", "weights", "quantization", "head dimension"):
        assert blamed not in str(err.value).replace("model-0123abcd", "")
    with pytest.raises(LayoutMismatch, match=r"scope: .* \(the engines' scopes differ: "):
        negotiate(attention(scope="llama-8b"), attention(scope="llama-70b"))


def test_missing_buffers_are_refused_both_ways_when_pp_matches():
    with pytest.raises(LayoutMismatch) as err:
        negotiate(attention(layers=(0, 1)), attention(layers=(0, 2)))
    assert sorted(fields(err.value)) == ["buffer(1,K)", "buffer(1,V)", "buffer(2,K)", "buffer(2,V)"]


def test_other_roles_of_a_layer_are_named():
    local = attention(layers=(0,))
    kv = BufferDesc("L0.KV", "L0", 0, 2 * 4 * 16 * BPH, LayerIdentity(0, LayerKind.ATTENTION, Role.KV),
                    "full", HeadGeometry(4, BPH))
    with pytest.raises(LayoutMismatch) as err:
        negotiate(local, dataclasses.replace(local, buffers=(kv,)))
    assert "buffer(0,K).identity.role" in fields(err.value)


def test_sharding_and_geometry_presence_must_agree():
    with pytest.raises(LayoutMismatch) as err:
        negotiate(attention(sharding=Sharding.REPLICATED), attention())
    assert "buffer(0,K).geometry.sharding" in fields(err.value)
    layout = attention(layers=(0,))
    bare = dataclasses.replace(layout, buffers=tuple(dataclasses.replace(b, geometry=None) for b in layout.buffers))
    with pytest.raises(LayoutMismatch) as err:
        negotiate(bare, layout)
    assert fields(err.value) == ["buffer(0,K).geometry", "buffer(0,V).geometry"]


def test_groups_must_correspond_one_to_one():
    remote = attention()
    split = dataclasses.replace(remote, buffers=tuple(
        dataclasses.replace(b, group=f"g{b.identity.layer}") for b in remote.buffers))
    for local, other in ((split, remote), (remote, split)):
        with pytest.raises(LayoutMismatch) as err:
            negotiate(local, other)
        assert set(fields(err.value)) == {"buffer(1,K).group", "buffer(1,V).group"}


# ---------------------------------------------------------- pipeline parallel
def test_pipeline_sizes_differ_plan_covers_the_intersection():
    local = attention(layers=(0, 1, 2, 3), pp=(2, 0))
    remote = attention(layers=(0, 1), pp=(4, 0))
    plan = negotiate(local, remote)
    assert plan.kind == MAPPED and plan.uncovered == (2, 3)
    assert {p.local_region for p in plan.pairs} == {"L0", "L1"}
    assert "uncovered local layers: [2, 3]" in plan.summary()
    with pytest.raises(LayoutMismatch) as err:
        negotiate(local, attention(layers=(6, 7), pp=(4, 3)))
    assert fields(err.value) == ["replica.pp_rank"]


# ------------------------------------------------------- what each side reads
def swa(*, tpp=16, window=64, sinks=1, kept=4096, **kw) -> PageLayout:
    return attention(layers=(0,), heads=1, tpp=tpp, window=window, sinks=sinks, kept=kept, group="swa", **kw)


def test_a_remote_that_lends_more_than_the_local_group_reads_is_mapped():
    local = swa(window=64, sinks=1, kept=1024)
    negotiate(local, swa(window=128, sinks=2, kept=4096))
    negotiate(local, swa(window=None, sinks=1))  # a full remote group lends its whole kept window
    negotiate(swa(tpp=16, window=64, sinks=2), swa(tpp=32, window=64, sinks=1))  # 32 sink tokens either way


def test_a_larger_local_window_is_refused_naming_read_window():
    with pytest.raises(LayoutMismatch) as err:
        negotiate(swa(window=128), swa(window=64))
    ((name, lv, rv, why),) = err.value.fields
    assert (name, lv, rv) == ("groups['swa'].read_window", 128, 64)
    assert "needs at least 128" in why


def test_big_local_pages_need_a_remote_window_longer_by_the_page_difference():
    # At 112 tokens a 64-token window starts in local page 1 (token 32) but at remote page 3 (token 48):
    # the remote must lend 32 - 16 tokens more.
    with pytest.raises(LayoutMismatch) as err:
        negotiate(swa(tpp=32, window=64, sinks=0), swa(tpp=16, window=79, sinks=0))
    assert fields(err.value) == ["groups['swa'].read_window"]
    assert "in pages of 32 from pages of 16 needs at least 80" in str(err.value)
    negotiate(swa(tpp=32, window=64, sinks=0), swa(tpp=16, window=80, sinks=0))


def test_more_local_sink_tokens_are_refused_naming_sinks():
    with pytest.raises(LayoutMismatch) as err:
        negotiate(swa(sinks=2), swa(sinks=1))
    assert [(f, lv, rv) for f, lv, rv, _ in err.value.fields] == [("groups['swa'].sinks", 2, 1)]
    with pytest.raises(LayoutMismatch) as err:  # one page either side, but 32 tokens against 16
        negotiate(swa(tpp=32, window=64, sinks=1), swa(tpp=16, window=80, sinks=1))
    assert fields(err.value) == ["groups['swa'].sinks"]
    assert "(32 tokens)" in str(err.value) and "(16 tokens)" in str(err.value)


def test_a_full_remote_group_covers_any_local_reads_since_leases_stay_inside_the_kept_window():
    negotiate(attention(kept=4096), attention(kept=2048))  # the lender refuses num_tokens > 2048
    negotiate(attention(tpp=32), attention(tpp=16))  # bigger local pages: still every page from 0
    negotiate(swa(window=1024), swa(window=4096, kept=512))  # clamped to its kept window: lends every page


def test_every_read_difference_is_listed_at_once():
    def two_groups(kept, window, sinks, dtype="bfloat16"):
        """Layer 0 in group "full", layer 1 in group "swa"."""
        layout = attention(kept=kept, window=window, sinks=sinks, dtype=dtype)
        return dataclasses.replace(layout, buffers=tuple(
            dataclasses.replace(b, group="full", window=None, sinks=0) if b.identity.layer == 0
            else dataclasses.replace(b, group="swa") for b in layout.buffers))

    with pytest.raises(LayoutMismatch) as err:
        negotiate(two_groups(4096, 128, 2), two_groups(1024, 64, 1, dtype="float16"))
    assert fields(err.value) == ["dtype", "groups['swa'].read_window", "groups['swa'].sinks"]


def test_recurrent_groups_have_no_window_to_check():
    negotiate(with_state(attention(layers=(0,))), with_state(attention(layers=(0,))))


def _lent_tokens(group, position, tpp) -> np.ndarray:
    """Which tokens below ``position`` the pages a decoder at ``position`` reads hold."""
    pages = -(-position // tpp)
    held = np.zeros((pages, tpp), dtype=bool)
    held[group.pages_read(position, tpp)] = True
    return held.reshape(-1)[:position]


def _covered(local, remote, position) -> bool:
    """From first principles: every page the local group reads is whole among the remote's lent tokens."""
    tl, tr = local.tokens_per_page, remote.tokens_per_page
    lent = _lent_tokens(remote.groups["swa"], position, tr)
    pages = -(-position // tl)
    whole = np.ones(pages * tl, dtype=bool)
    whole[:position] = lent
    return bool(whole.reshape(pages, tl).all(axis=1)[local.groups["swa"].pages_read(position, tl)].all())


RATIOS = [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1)]  # (local, remote) multiples of a base page size


@settings(max_examples=examples(300), deadline=None)
@given(base=st.sampled_from([1, 2, 4, 8]), ratio=st.sampled_from(RATIOS),
       windows=st.tuples(*[st.none() | st.integers(-1, 80)] * 2), sinks=st.tuples(*[st.integers(0, 4)] * 2),
       kept=st.tuples(*[st.integers(1, 96)] * 2))
def test_a_plan_exists_exactly_when_every_position_is_covered(base, ratio, windows, sinks, kept):
    tl, tr = base * ratio[0], base * ratio[1]
    local = swa(tpp=tl, window=windows[0], sinks=sinks[0], kept=kept[0])
    remote = swa(tpp=tr, window=windows[1], sinks=sinks[1], kept=kept[1])
    # Past both windows and sinks by a page of each size, what is read repeats every max(tl, tr) tokens.
    reach = max(kept) + max(s * t for s, t in zip(sinks, (tl, tr))) + 2 * max(tl, tr)
    uncovered = [n for n in range(1, 4 * reach) if not _covered(local, remote, n)]
    lendable = remote.kept_window  # the lender never lends past it
    full = remote.groups["swa"].read_window >= remote.kept_window  # lends every page of any lease
    try:
        negotiate(local, remote)
    except LayoutMismatch as err:
        assert not full and uncovered, f"refused although every position is covered: {err}"
        assert set(fields(err)) <= {"groups['swa'].read_window", "groups['swa'].sinks"}
    else:
        bad = [n for n in uncovered if n <= lendable]
        assert not bad, f"planned although positions {bad[:5]} are not covered"
        assert full or not uncovered


# ------------------------------------------------------- what negotiate computes
def refused_with_peak(local: PageLayout, remote: PageLayout) -> tuple[NegotiationLimit, int]:
    """The limit ``negotiate`` refuses with, and the peak bytes it allocated first.

    Memory, not a clock, shows that the refusal came before the work: it holds on a busy host.
    """
    tracemalloc.start()
    try:
        with pytest.raises(NegotiationLimit) as err:
            negotiate(local, remote)
        return err.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_enormous_page_ratio_is_refused_before_any_work():
    """A peer claiming 2^20 times our tokens per page: ~6 s and 776 MiB under the prefill's lock without the cap."""
    small = attention(tpp=16)
    big = attention(tpp=16 << 20, num_pages=1)
    for local, remote in ((big, small), (small, big)):
        exc, peak = refused_with_peak(local, remote)
        assert peak < 1 << 20, f"{peak / 2**20:.1f} MiB allocated while refusing"
        assert (exc.limit, exc.value, exc.cap) == ("max_page_ratio", 1 << 20, MAX_PAGE_RATIO)
        assert isinstance(exc, QuotaExceeded) and isinstance(exc, LayoutMismatch)
        assert fields(exc) == ["tokens_per_page"]
        assert "max_page_ratio: a tokens-per-page ratio of 1048576 exceeds the cap of 64" in str(exc)


@pytest.mark.parametrize("big", ["local", "remote"])
def test_the_page_ratio_cap_is_inclusive_and_configurable(big):
    def pair(ratio):
        a, b = attention(tpp=16 * ratio, kept=4096 + 16 * ratio), attention(tpp=16, kept=4096 + 16 * ratio)
        return (a, b) if big == "local" else (b, a)

    assert negotiate(*pair(MAX_PAGE_RATIO)).kind == MAPPED
    with pytest.raises(NegotiationLimit, match="max_page_ratio"):
        negotiate(*pair(2 * MAX_PAGE_RATIO))
    assert negotiate(*pair(4), max_page_ratio=4).kind == MAPPED
    with pytest.raises(NegotiationLimit) as err:
        negotiate(*pair(8), max_page_ratio=4)
    assert (err.value.value, err.value.cap) == (8, 4)
    # A non-integer ratio is refused as before, whatever its size; recurrent-only layouts have no ratio.
    with pytest.raises(LayoutMismatch) as err:
        negotiate(attention(tpp=16 * 1000 + 1), attention(tpp=16))
    assert not isinstance(err.value, NegotiationLimit) and fields(err.value) == ["tokens_per_page"]


def _raw_pieces(monkeypatch, local, remote) -> int:
    """Pieces ``negotiate`` builds before merging, counted as they are built."""
    built = []
    real = negotiate_mod.merge_pieces
    monkeypatch.setattr(negotiate_mod, "merge_pieces", lambda pieces: built.append(len(pieces)) or real(pieces))
    negotiate(local, remote, max_pieces=1 << 30)
    monkeypatch.setattr(negotiate_mod, "merge_pieces", real)
    return sum(built)


CASES = {
    "identity": (attention(), attention()),
    "hnd split": (attention(tpp=16), attention(tpp=64)),
    "hnd fill": (attention(tpp=64), attention(tpp=16, kept=4096 + 64)),
    "nhd split": (attention(tpp=16, order=HeadOrder.NHD), attention(tpp=64, order=HeadOrder.NHD)),
    "tp slices and pages": (attention(heads=2, tp=(2, 1), tpp=16), attention(heads=4, tpp=32)),
    "state": (with_state(attention(tpp=16)), with_state(attention(tpp=32))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pieces_are_counted_exactly_and_capped_before_any_is_built(monkeypatch, case):
    local, remote = CASES[case]
    count = _raw_pieces(monkeypatch, local, remote)
    assert count > 1
    plan = negotiate(local, remote, max_pieces=count)  # at the cap: planned
    assert plan.pairs
    monkeypatch.setattr(negotiate_mod, "_slices", lambda *a: pytest.fail("built pieces past the cap"))
    with pytest.raises(NegotiationLimit) as err:
        negotiate(local, remote, max_pieces=count - 1)
    assert (err.value.limit, err.value.value, err.value.cap) == ("max_pieces", count, count - 1)
    assert fields(err.value) == ["pieces"]


def test_too_many_pieces_are_refused_fast():
    # 256 layers x K and V x ratio 64 x 32 heads: 2^20 pieces, 4 times the default cap.
    layers = tuple(range(256))
    local, remote = attention(layers=layers, heads=32, tpp=16 * 64), attention(layers=layers, heads=32, tpp=16)
    exc, peak = refused_with_peak(local, remote)
    assert (exc.limit, exc.value, exc.cap) == ("max_pieces", 1 << 20, MAX_PIECES)
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB allocated while refusing"  # 2^20 pieces would take far more


def test_bad_caps_are_refused():
    for kw in ({"max_page_ratio": 0}, {"max_pieces": True}, {"max_pieces": 2.0}):
        with pytest.raises(ValueError):
            negotiate(attention(), attention(), **kw)
