"""plan_reads(): descriptors move the right bytes, coalesced to the fewest runs, inputs checked first.

The property test builds random pairs of layouts over real numpy pools, applies
the planner's descriptors as byte copies and compares the result with a
reference that copies (head, token) blocks page by page from first principles.
Short leases take the list path (``core.plan_lists``); the property test runs each
case down both paths.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvlend.core import plan_lists
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
    RowSelection,
    SelectionMode,
    Sharding,
    layout_from_pools,
)
from kvlend.core.negotiate import Piece, TransferPlan, negotiate
from kvlend.core.pages import GroupPages
from kvlend.core.plan import _spec, plan_reads
from kvlend.errors import LayoutError, LayoutMismatch, PageRangeError
from tests.support.profiles import examples

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------ pools
class Pools:
    """Numpy arrays backing layout regions; descriptors are applied to them as bounds-checked copies."""

    def __init__(self) -> None:
        self.arrays: dict[int, tuple[np.ndarray, MemoryRegion]] = {}

    def region(self, name, kind, device_id, stride, num_pages, rng) -> MemoryRegion:
        arr = rng.integers(0, 256, stride * num_pages, dtype=np.uint8)
        region = MemoryRegion(name, kind, device_id, arr.nbytes, stride, num_pages, arr.ctypes.data)
        self.arrays[region.address] = (arr, region)
        return region

    def locate(self, address: int, length: int, kind: MemoryKind, device_id: int) -> tuple[np.ndarray, int]:
        for base, (arr, region) in self.arrays.items():
            if base <= address < base + arr.nbytes:
                assert address + length <= base + arr.nbytes, "descriptor runs past its region"
                assert (region.kind, region.device_id) == (kind, device_id)
                return arr, address - base
        raise AssertionError(f"address {address:#x} is in no region")

    def array(self, region: MemoryRegion) -> np.ndarray:
        return self.arrays[region.address][0]


def apply(batches, remote: Pools, local: Pools) -> None:
    """Copy every descriptor; no local byte may be written twice."""
    written = {base: np.zeros(arr.size, dtype=bool) for base, (arr, _) in local.arrays.items()}
    for batch in batches:
        assert batch.count > 0
        for (sa, n, sd), (da, n2, dd) in zip(batch.remote.tolist(), batch.local.tolist()):
            assert n == n2 and n > 0
            src, so = remote.locate(sa, n, batch.remote_kind, sd)
            dst, do = local.locate(da, n, batch.local_kind, dd)
            mask = written[dst.ctypes.data]
            assert not mask[do:do + n].any(), "a local byte is written twice"
            mask[do:do + n] = True
            dst[do:do + n] = src[so:so + n]


# -------------------------------------------------------------- reference
def blocks(arr: np.ndarray, region: MemoryRegion, slot: int, buf: BufferDesc, tokens: int) -> np.ndarray:
    """A buffer's page as a writable (parts, heads, tokens, bytes) view."""
    parts = 2 if buf.identity.role is Role.KV else 1
    g = buf.geometry
    heads, per = (g.heads, g.bytes_per_head) if g else (1, buf.page_bytes // (parts * tokens))
    start = slot * region.page_stride + buf.offset
    page = arr[start:start + buf.page_bytes]
    if g is not None and g.order is HeadOrder.NHD:
        return page.reshape(parts, tokens, heads, per).transpose(0, 2, 1, 3)
    return page.reshape(parts, heads, tokens, per)


def head_range(layout: PageLayout, buf: BufferDesc) -> tuple[int, int]:
    g = buf.geometry
    if g is None:
        return 0, 1
    if g.sharding is Sharding.REPLICATED:
        return 0, g.heads
    return layout.replica.tp_rank * g.heads, (layout.replica.tp_rank + 1) * g.heads


def reference_copy(local: PageLayout, lpools: Pools, remote: PageLayout, rpools: Pools,
                   src: dict, dst: dict, selection: RowSelection, first_source: bool) -> None:
    """What the reads must do, derived from (head, token) coordinates, page by page."""
    remote_by_key = {b.identity.key: b for b in remote.buffers}
    names = None if selection.mode is SelectionMode.ALL else set(selection.names)
    for lb in local.buffers:
        rb = remote_by_key[lb.identity.key]
        if names is not None and rb.name not in names:
            continue
        if rb.geometry and rb.geometry.sharding is Sharding.REPLICATED and not first_source:
            continue
        tr, tl = (1, 1) if lb.recurrent else (remote.tokens_per_page, local.tokens_per_page)
        lregion, rregion = local.region(lb.region), remote.region(rb.region)
        (r0, r1), (l0, l1) = head_range(remote, rb), head_range(local, lb)
        h0, h1 = max(r0, l0), min(r1, l1)
        pages = src[rb.group]
        table = dst[lb.group]
        for p, slot in zip(pages.token_pages.tolist(), pages.ordinals.tolist()):
            rview = blocks(rpools.array(rregion), rregion, slot, rb, tr)
            t0, t1 = p * tr, (p + 1) * tr
            for q in range(t0 // tl, (t1 - 1) // tl + 1):
                lview = blocks(lpools.array(lregion), lregion, int(table[q]), lb, tl)
                a, b = max(t0, q * tl), min(t1, (q + 1) * tl)
                lview[:, h0 - l0:h1 - l0, a - q * tl:b - q * tl] = rview[:, h0 - r0:h1 - r0, a - t0:b - t0]
    if local.layout_id == remote.layout_id and names is None:
        # Identity plans copy whole slots (padding too) of regions that hold a single group.
        for lregion in local.regions:
            members = [b for b in local.buffers if b.region == lregion.name]
            if len({b.group for b in members}) != 1:
                continue
            rb = remote_by_key[members[0].identity.key]
            rregion = remote.region(rb.region)
            larr, rarr, stride = lpools.array(lregion), rpools.array(rregion), lregion.page_stride
            pages, table = src[rb.group], dst[members[0].group]
            for p, slot in zip(pages.token_pages.tolist(), pages.ordinals.tolist()):
                q = int(table[p])
                larr[q * stride:(q + 1) * stride] = rarr[slot * stride:(slot + 1) * stride]


def naive_descriptors(plan: TransferPlan, src: dict, dst: dict, selection: RowSelection) -> dict:
    """Un-coalesced per-page pieces in plan order, merged by a plain loop: the expected output."""
    names = None if selection.mode is SelectionMode.ALL else set(selection.names)
    streams: dict[tuple, list[list[int]]] = {}
    for pair in plan.pairs:
        rr, lr = plan.remote.region(pair.remote_region), plan.local.region(pair.local_region)
        if names is None:
            pieces = [Piece("", 0, 0, rr.page_stride)] if pair.whole_slot else list(pair.pieces)
        else:
            pieces = [p for p in pair.pieces if p.buffer in names]
        m, s = pair.remote_per_local, pair.local_per_remote
        pages, table = src[pair.remote_group], dst[pair.local_group]
        out = streams.setdefault((rr.kind, lr.kind), [])
        for tp, slot in zip(pages.token_pages.tolist(), pages.ordinals.tolist()):
            for p in sorted((p for p in pieces if m == 1 or p.sub == tp % m), key=lambda p: p.src_offset):
                q = (tp // m) * s + (p.sub if s > 1 else 0)
                row = [rr.address + slot * rr.page_stride + p.src_offset,
                       lr.address + int(table[q]) * lr.page_stride + p.dst_offset, p.length,
                       rr.device_id, lr.device_id]
                last = out[-1] if out else None
                if last and last[3:] == row[3:] and last[0] + last[2] == row[0] and last[1] + last[2] == row[1]:
                    last[2] += row[2]
                else:
                    out.append(row)
    return streams


def check_against_naive(batches, plan, src, dst, selection) -> None:
    want = naive_descriptors(plan, src, dst, selection)
    got = {(b.remote_kind, b.local_kind): b for b in batches}
    assert set(got) == {k for k, rows in want.items() if rows}
    for kinds, batch in got.items():
        rows = np.array(want[kinds], dtype=np.uint64)
        assert batch.count == len(rows)
        np.testing.assert_array_equal(batch.remote, rows[:, [0, 2, 3]])
        np.testing.assert_array_equal(batch.local, rows[:, [1, 2, 4]])


# ------------------------------------------------------------ random layouts
@dataclass(frozen=True)
class Model:
    heads: int  # total KV heads
    bph: int
    order: HeadOrder
    combined: bool  # one KV buffer per layer instead of K and V
    shardings: tuple[Sharding, ...]  # per attention layer
    geometry: bool
    state: bool  # one recurrent layer
    window_layers: frozenset[int]  # attention layers in the second group


@dataclass(frozen=True)
class Side:
    tpp: int
    tp: int
    rank: int
    packing: str  # per_layer | per_buffer | one_region
    pad: int
    flip: bool  # V before K inside a slot
    names: str  # region/group name prefix
    kinds: tuple[MemoryKind, ...]  # cycled over regions
    num_pages: int


def build(model: Model, side: Side, rng, pools: Pools) -> PageLayout:
    regions, buffers = [], []
    slack = 4 if side.names == "p." else 0  # the prefill lends enough window for decode pages up to 4 tokens bigger
    roles = (Role.KV,) if model.combined else ((Role.V, Role.K) if side.flip else (Role.K, Role.V))
    items = []  # (layer, role, page_bytes, geometry, group)
    for layer, sharding in enumerate(model.shardings):
        heads = model.heads if sharding is Sharding.REPLICATED else model.heads // side.tp
        geometry = HeadGeometry(heads, model.bph, model.order, sharding) if model.geometry else None
        group = f"{side.names}{'swa' if layer in model.window_layers else 'full'}"
        for role in roles:
            parts = 2 if role is Role.KV else 1
            items.append((layer, role, parts * heads * side.tpp * model.bph, geometry, group))
    chunks = {"per_layer": lambda it: it[0], "per_buffer": lambda it: (it[0], it[1]), "one_region": lambda it: 0}
    by_region: dict = {}
    for it in items:
        by_region.setdefault(chunks[side.packing](it), []).append(it)
    for index, members in enumerate(by_region.values()):
        name = f"{side.names}r{index}"
        offset = 0
        for layer, role, page_bytes, geometry, group in members:
            buffers.append(BufferDesc(f"{side.names}L{layer}.{role.value}", name, offset, page_bytes,
                                      LayerIdentity(layer, LayerKind.ATTENTION, role), group, geometry,
                                      window=256 + slack if layer in model.window_layers else None))
            offset += page_bytes + side.pad
        kind = side.kinds[index % len(side.kinds)]
        regions.append(pools.region(name, kind, index % 2, offset, side.num_pages, rng))
    if model.state:
        heads = 4 // side.tp
        row = heads * 3
        regions.append(pools.region(f"{side.names}state", side.kinds[0], 0, row, 3, rng))
        buffers.append(BufferDesc(f"{side.names}S", f"{side.names}state", 0, row,
                                  LayerIdentity(50, LayerKind.RECURRENT, Role.STATE), f"{side.names}ssm",
                                  HeadGeometry(heads, 3, HeadOrder.HND, Sharding.INDEXED)))
    return PageLayout(tuple(regions), tuple(buffers), side.tpp, 4096, "bfloat16", "model",
                      ReplicaRank(side.tp, side.rank))


TP_PAIRS = [(1, 1), (1, 1), (2, 2), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]  # (decode, prefill)


@st.composite
def scenarios(draw):
    identical = draw(st.booleans())
    tp_l, tp_r = (1, 1) if identical else draw(st.sampled_from(TP_PAIRS))
    order = HeadOrder.HND if tp_l != tp_r else draw(st.sampled_from(list(HeadOrder)))
    layers = draw(st.integers(1, 3))
    model = Model(
        heads=4, bph=draw(st.sampled_from([1, 2, 3])), order=order, combined=draw(st.booleans()),
        shardings=tuple(draw(st.lists(st.sampled_from(list(Sharding)), min_size=layers, max_size=layers))),
        geometry=tp_l != tp_r or draw(st.booleans()), state=draw(st.booleans()),
        window_layers=frozenset(draw(st.sets(st.integers(0, layers - 1)))),
    )
    tpp_r = draw(st.sampled_from([1, 2, 4]))
    tpp_l = tpp_r if identical or draw(st.booleans()) else draw(st.sampled_from([1, 2, 4]))
    n_remote = draw(st.integers(1, 10))  # remote token pages of the request
    n_local = -(-n_remote * tpp_r // tpp_l)
    kinds = st.lists(st.sampled_from([MemoryKind.DEVICE, MemoryKind.DEVICE, MemoryKind.HOST]),
                     min_size=1, max_size=3).map(tuple)

    def side(tpp, tp, rank, names, num_pages, template=None):
        if template is not None:
            return dataclasses.replace(template, names=names, num_pages=num_pages, kinds=draw(kinds))
        return Side(tpp, tp, rank, draw(st.sampled_from(["per_layer", "per_buffer", "one_region"])),
                    draw(st.sampled_from([0, 0, 5])), draw(st.booleans()), names, draw(kinds), num_pages)

    rank_l = draw(st.integers(0, tp_l - 1))
    remote = side(tpp_r, tp_r, 0, "p.", n_remote + draw(st.integers(0, 3)))
    local = side(tpp_l, tp_l, rank_l, "d.", n_local + draw(st.integers(0, 3)), remote if identical else None)
    first = rank_l * tp_r // tp_l
    sources = [dataclasses.replace(remote, rank=r) for r in range(first, first + max(1, tp_r // tp_l))]
    return model, local, sources, n_remote, n_local, draw(st.randoms(use_true_random=False))


def pick(rnd, population: list[int], k: int, keep_order: bool) -> list[int]:
    chosen = rnd.sample(population, k)
    return sorted(chosen) if keep_order else chosen


@contextlib.contextmanager
def list_path(on: bool):
    """Short leases down plan_lists' path (on) or the vectorised one (off)."""
    saved = plan_lists.SMALL_PAGES
    plan_lists.SMALL_PAGES = saved if on else -1
    try:
        yield
    finally:
        plan_lists.SMALL_PAGES = saved


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.booleans())
def test_reads_match_a_page_by_page_reference(scenario, lists):
    with list_path(lists):
        _reads_match_a_page_by_page_reference(scenario)


def _reads_match_a_page_by_page_reference(scenario):
    model, local_side, source_sides, n_remote, n_local, rnd = scenario
    rng = np.random.default_rng(rnd.getrandbits(32))
    lpools = Pools()
    local = build(model, local_side, rng, lpools)
    want = Pools()
    want.arrays = {k: (arr.copy(), r) for k, (arr, r) in lpools.arrays.items()}
    dst = {}
    for name, group in local.groups.items():
        count = 1 if group.recurrent else n_local
        num_pages = min(local.region(b.region).num_pages for b in group.buffers)
        dst[name] = np.array(pick(rnd, list(range(num_pages)), count, rnd.random() < 0.5), dtype=np.int64)
    selected_names = None
    for index, side in enumerate(source_sides):
        rpools = Pools()
        remote = build(model, side, rng, rpools)
        src = {}
        for name, group in remote.groups.items():
            num_pages = min(remote.region(b.region).num_pages for b in group.buffers)
            tokens = [0] if group.recurrent else list(range(n_remote))
            shape = rnd.choice(["all", "tail", "subset"])  # a windowed lease holds a tail of the pages
            if shape == "tail":
                tokens = tokens[rnd.randint(0, len(tokens)):]
            elif shape == "subset":
                tokens = sorted(rnd.sample(tokens, rnd.randint(0, len(tokens))))
            src[name] = GroupPages(tokens, pick(rnd, list(range(num_pages)), len(tokens), rnd.random() < 0.5))
        if selected_names is None:  # every source rank gets the same selection; HOST needs NAMED
            host = any(r.kind is MemoryKind.HOST for r in remote.regions)
            names = [b.name for b in remote.buffers]
            selected_names = rnd.sample(names, rnd.randint(1, len(names))) if host or rnd.random() < 0.5 else ()
        selection = RowSelection.named(*selected_names) if selected_names else RowSelection.all()
        indexed = model.state or Sharding.INDEXED in model.shardings
        if index > 0 and not indexed:  # replicated-only: only the first source rank has anything to send
            with pytest.raises(LayoutMismatch, match="exchanges nothing"):
                negotiate(local, remote)
            continue
        plan = negotiate(local, remote)
        assert plan.kind == ("identity" if local.layout_id == remote.layout_id else "mapped")
        batches = plan_reads(plan, src, dst, selection)
        check_against_naive(batches, plan, src, dst, selection)
        apply(batches, rpools, lpools)
        reference_copy(local, want, remote, rpools, src, dst, selection, first_source=index == 0)
    for base, (arr, _) in lpools.arrays.items():
        np.testing.assert_array_equal(arr, want.arrays[base][0])


# ------------------------------------------------------------------ examples
def device(layout: PageLayout) -> PageLayout:
    """The same pools, declared as device memory (ALL selections need it)."""
    return dataclasses.replace(layout, regions=tuple(
        dataclasses.replace(r, kind=MemoryKind.DEVICE) for r in layout.regions))


def pools(n_layers=2, num_pages=16, heads=4, tpp=4, head_dim=2):
    rng = np.random.default_rng(1)
    return [rng.integers(0, 256, (num_pages, 2, heads, tpp, head_dim), dtype=np.uint8) for _ in range(n_layers)]


def _pools_of(arrays) -> Pools:
    p = Pools()
    for i, arr in enumerate(arrays):
        region = MemoryRegion(f"L{i}.kv", MemoryKind.DEVICE, 0, arr.nbytes, arr.nbytes // arr.shape[0],
                              arr.shape[0], arr.ctypes.data)
        p.arrays[region.address] = (arr.reshape(-1), region)
    return p


def test_identity_all_is_one_descriptor_per_contiguous_run_per_region():
    rpools, lpools = pools(), pools()
    plan = negotiate(device(layout_from_pools(kv=lpools, kept_window=64)),
                     device(layout_from_pools(kv=rpools, kept_window=64)))
    src = {"full": GroupPages([0, 1, 2, 3, 4, 5], [3, 4, 5, 9, 10, 0])}
    dst = {"full": np.array([7, 8, 9, 10, 11, 2, 1])}  # 7 pages: the local table may be longer
    (batch,) = plan_reads(plan, src, dst)
    stride = rpools[0][0].nbytes
    # runs: pages 0-2 (slots 3,4,5 -> 7,8,9), page 3-4 (9,10 -> 10,11), page 5 (0 -> 2): 3 per region
    assert batch.count == 6
    first = rpools[0].ctypes.data
    assert batch.remote[:3].tolist() == [[first + 3 * stride, 3 * stride, 0], [first + 9 * stride, 2 * stride, 0],
                                         [first, stride, 0]]
    assert batch.local[0].tolist() == [lpools[0].ctypes.data + 7 * stride, 3 * stride, 0]
    apply([batch], _pools_of(rpools), _pools_of(lpools))
    np.testing.assert_array_equal(lpools[1][[7, 8, 9, 10, 11, 2]], rpools[1][[3, 4, 5, 9, 10, 0]])


@pytest.mark.parametrize("pages", [1, 2, plan_lists.SMALL_PAGES, plan_lists.SMALL_PAGES + 1])
@pytest.mark.parametrize("lists", [True, False])
def test_both_paths_give_the_fewest_runs_at_the_list_paths_limit(pages, lists):
    rpools, lpools = pools(num_pages=2 * pages + 2), pools(num_pages=2 * pages + 2)
    plan = negotiate(device(layout_from_pools(kv=lpools, kept_window=1 << 20)),
                     device(layout_from_pools(kv=rpools, kept_window=1 << 20)))
    rng = np.random.default_rng(pages)
    src = {"full": GroupPages(range(pages), rng.permutation(2 * pages + 2)[:pages])}
    dst = {"full": np.sort(rng.permutation(2 * pages + 2)[:pages])}
    with list_path(lists):
        batches = plan_reads(plan, src, dst)
        taken = plan_lists.small_reads(plan, _spec(plan, RowSelection.all()), src, dst) is not None
    assert taken == (lists and pages <= plan_lists.SMALL_PAGES)
    check_against_naive(batches, plan, src, dst, RowSelection.all())
    apply(batches, _pools_of(rpools), _pools_of(lpools))
    for remote, local in zip(rpools, lpools):
        np.testing.assert_array_equal(local[dst["full"]], remote[src["full"].ordinals])


def test_named_rows_copy_only_those_buffers():
    rpools, lpools = pools(n_layers=1), pools(n_layers=1)
    remote = layout_from_pools(kv=rpools, kept_window=64)  # HOST: NAMED rows only
    plan = negotiate(layout_from_pools(kv=lpools, kept_window=64), remote)
    with pytest.raises(LayoutError, match="HOST"):
        plan_reads(plan, {"full": GroupPages([0], [0])}, {"full": np.array([0])})
    src, dst = {"full": GroupPages([0, 1], [4, 5])}, {"full": np.array([2, 3])}
    (batch,) = plan_reads(plan, src, dst, RowSelection.named("L0.V"))
    assert (batch.remote_kind, batch.local_kind) == (MemoryKind.HOST, MemoryKind.HOST)
    half = rpools[0][0, 0].nbytes
    # V of slots 4 and 5 is not contiguous (K of slot 5 sits between): two runs.
    assert batch.remote[:, :2].tolist() == [[rpools[0].ctypes.data + 4 * 2 * half + half, half],
                                            [rpools[0].ctypes.data + 5 * 2 * half + half, half]]
    (both,) = plan_reads(plan, src, dst, RowSelection.named("L0.V", "L0.K"))
    assert both.count == 1 and both.nbytes == 4 * half


def test_pairs_in_one_region_merge_across_the_boundary():
    # Two groups share one region: K of group "a" then V of group "b" in each slot.
    layout = device(layout_from_pools(kv=pools(n_layers=1), kept_window=64))
    k, v = layout.buffers
    layout = dataclasses.replace(layout, buffers=(dataclasses.replace(k, group="a"), dataclasses.replace(v, group="b")))
    plan = negotiate(layout, layout)
    assert [p.whole_slot for p in plan.pairs] == [False, False]
    src = {"a": GroupPages([0], [2]), "b": GroupPages([0], [2])}
    (batch,) = plan_reads(plan, src, {"a": np.array([5]), "b": np.array([5])})
    assert batch.count == 1 and batch.nbytes == layout.regions[0].page_stride


def test_whole_remote_slots_into_part_of_local_slots_do_not_join():
    rng = np.random.default_rng(2)
    k, v = (rng.integers(0, 256, (8, 4, 4, 2), dtype=np.uint8) for _ in range(2))
    kv = np.zeros((8, 2, 4, 4, 2), dtype=np.uint8)
    split = device(layout_from_pools(k=[k], v=[v], kept_window=64))
    together = device(layout_from_pools(kv=[kv], kept_window=64))
    src, dst = {"full": GroupPages([0, 1, 2], [0, 1, 2])}, {"full": np.array([0, 1, 2])}
    for local, remote in ((together, split), (split, together)):
        plan = negotiate(local, remote)
        assert plan.kind == "mapped"
        (batch,) = plan_reads(plan, src, dst)
        assert batch.count == 6  # K and V of each page land apart on the combined side
    (batch,) = plan_reads(negotiate(together, split), src, dst)
    remote_pools = Pools()
    for region, arr in zip(split.regions, (k, v)):
        remote_pools.arrays[region.address] = (arr.reshape(-1), region)
    local_pools = Pools()
    local_pools.arrays[together.regions[0].address] = (kv.reshape(-1), together.regions[0])
    apply([batch], remote_pools, local_pools)
    np.testing.assert_array_equal(kv[:3, 0], k[:3])
    np.testing.assert_array_equal(kv[:3, 1], v[:3])


def test_batches_are_split_by_memory_kind():
    model = Model(4, 2, HeadOrder.HND, False, (Sharding.INDEXED,) * 2, True, True, frozenset())
    side = Side(4, 1, 0, "per_layer", 0, False, "", (MemoryKind.DEVICE, MemoryKind.HOST), 8)
    rng = np.random.default_rng(0)
    remote, local = build(model, side, rng, Pools()), build(model, side, rng, Pools())
    plan = negotiate(local, remote)
    src = {"full": GroupPages([0, 1], [0, 1]), "ssm": GroupPages([0], [2])}
    dst = {"full": np.array([0, 1]), "ssm": np.array([1])}
    batches = plan_reads(plan, src, dst, RowSelection.named(*[b.name for b in remote.buffers]))
    assert [(b.remote_kind, b.local_kind) for b in batches] == [(MemoryKind.DEVICE, MemoryKind.DEVICE),
                                                                (MemoryKind.HOST, MemoryKind.HOST)]
    assert sum(b.count for b in batches) == 3  # L0 region, state row, L1 region


def test_empty_lease_group_reads_nothing():
    plan = negotiate(device(layout_from_pools(kv=pools(), kept_window=64)),
                     device(layout_from_pools(kv=pools(), kept_window=64)))
    assert plan_reads(plan, {"full": GroupPages([], [])}, {"full": np.array([], dtype=np.int64)}) == []


# --------------------------------------------------------------- validation
@pytest.fixture
def identity_plan():
    return negotiate(device(layout_from_pools(kv=pools(), kept_window=64)),
                     device(layout_from_pools(kv=pools(), kept_window=64)))


@pytest.mark.parametrize("src, dst, error, message", [
    ({"nope": GroupPages([0], [0])}, {"full": np.array([0])}, LayoutError, "unknown groups \\['nope'\\]"),
    ({"full": GroupPages([0], [0])}, {"nope": np.array([0])}, LayoutError, "unknown groups"),
    ({"full": GroupPages([0], [0])}, {}, LayoutError, "no page table for local group 'full'"),
    ({"full": [0]}, {"full": np.array([0])}, LayoutError, "expected GroupPages"),
    ({"full": GroupPages([0], [16])}, {"full": np.array([0])}, PageRangeError, "slot 16 is outside region 'L0.kv'"),
    ({"full": GroupPages([0], [0])}, {"full": np.array([16])}, PageRangeError, "slot 16 is outside"),
    ({"full": GroupPages([0], [0])}, {"full": np.array([-1])}, PageRangeError, "slot -1"),
    ({"full": GroupPages([0, 3], [0, 1])}, {"full": np.array([0, 1])}, PageRangeError, "beyond dst\\['full'\\] of 2"),
    ({"full": GroupPages([0], [0])}, {"full": np.array([[0]])}, PageRangeError, "dst\\['full'\\]: must be 1-D"),
    ({"full": GroupPages([0], [0])}, {"full": np.array([0.0])}, PageRangeError, "dst\\['full'\\]: must be integers"),
])
def test_bad_inputs_are_refused_with_a_clear_message(identity_plan, src, dst, error, message):
    with pytest.raises(error, match=message):
        plan_reads(identity_plan, src, dst)


def test_groups_left_out_of_src_read_nothing(identity_plan):
    assert plan_reads(identity_plan, {}, {}) == []
    assert plan_reads(identity_plan, {}, {"full": np.array([0])}) == []


def test_pages_not_read_are_not_inspected(identity_plan):
    (batch,) = plan_reads(identity_plan, {"full": GroupPages([1], [0])}, {"full": np.array([-1, 3, -1])})
    assert batch.count == 2


def test_selection_of_buffers_the_plan_does_not_read(identity_plan):
    with pytest.raises(LayoutError, match="no buffer 'L9.K'"):
        plan_reads(identity_plan, {"full": GroupPages([0], [0])}, {"full": np.array([0])}, RowSelection.named("L9.K"))
    local = device(layout_from_pools(kv=pools(n_layers=1), kept_window=64, replica=ReplicaRank(1, 0, 2, 0)))
    remote = device(layout_from_pools(kv=pools(n_layers=2), kept_window=64, layer_ids=[0, 1],
                                      replica=ReplicaRank(1, 0, 1, 0)))
    plan = negotiate(local, remote)
    with pytest.raises(LayoutError, match="no local counterpart"):
        plan_reads(plan, {"full": GroupPages([0], [0])}, {"full": np.array([0])}, RowSelection.named("L1.K"))


def test_recurrent_groups_have_one_row():
    model = Model(4, 2, HeadOrder.HND, False, (Sharding.INDEXED,), True, True, frozenset())
    side = Side(4, 1, 0, "per_layer", 0, False, "", (MemoryKind.DEVICE,), 8)
    rng = np.random.default_rng(0)
    plan = negotiate(build(model, side, rng, Pools()), build(model, side, rng, Pools()))
    ok = {"full": GroupPages([0], [0]), "ssm": GroupPages([0], [1])}
    assert sum(b.count for b in plan_reads(plan, ok, {"full": np.array([0]), "ssm": np.array([2])})) == 2
    with pytest.raises(PageRangeError, match="one row"):
        plan_reads(plan, ok, {"full": np.array([0]), "ssm": np.array([1, 2])})
    with pytest.raises(PageRangeError, match="token page 0 only"):
        plan_reads(plan, {**ok, "ssm": GroupPages([1], [1])}, {"full": np.array([0]), "ssm": np.array([2])})
