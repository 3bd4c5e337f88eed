"""PageLayout: validation rules, read windows, pages_read, layout_from_pools,
and (hypothesis) encoding round trips and what layout_id does and does not see."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

import kvlend.core.layout as layout_module
from kvlend.core.layout import (
    BufferDesc,
    HeadGeometry,
    HeadOrder,
    LayerGroup,
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
from kvlend.errors import KvlendError, LayoutError
from tests.support.profiles import examples
from tests.support.strategies import layouts

pytestmark = pytest.mark.unit

A, R = LayerKind.ATTENTION, LayerKind.RECURRENT
PROPERTY = settings(max_examples=examples(40), deadline=None)


def region(name="r0", kind=MemoryKind.DEVICE, stride=1024, pages=4, size=None, address=0, device_id=0):
    return MemoryRegion(name, kind, device_id, stride * pages if size is None else size, stride, pages, address)


def buf(name="b0", region="r0", offset=0, page_bytes=512, layer=0, kind=A, role=Role.K, group="g",
        geometry=None, window=None, sinks=0):
    return BufferDesc(name, region, offset, page_bytes, LayerIdentity(layer, kind, role), group, geometry, window,
                      sinks)


def make(regions=None, buffers=None, tpp=16, kept=4096, dtype="bfloat16", scope="", replica=ReplicaRank()):
    return PageLayout(
        tuple(regions if regions is not None else [region()]),
        tuple(buffers if buffers is not None else [buf()]),
        tpp, kept, dtype, scope, replica,
    )


# ------------------------------------------------------------- validation
@pytest.mark.parametrize("build, field, value", [
    (lambda: region(size=0), "size", "0"),
    (lambda: region(stride=0, size=10), "page_stride", "0"),
    (lambda: region(pages=0, size=10), "num_pages", "0"),
    (lambda: region(device_id=-1), "device_id", "-1"),
    (lambda: region(address=-5), "address", "-5"),
    (lambda: buf(page_bytes=0), "page_bytes", "0"),
    (lambda: buf(offset=-1), "offset", "-1"),
    (lambda: buf(sinks=-2), "sinks", "-2"),
    (lambda: buf(layer=-3), "layer", "-3"),
    (lambda: HeadGeometry(0, 256), "heads", "0"),
    (lambda: HeadGeometry(8, -256), "bytes_per_head", "-256"),
    (lambda: make(tpp=0), "tokens_per_page", "0"),
    (lambda: make(kept=-1), "kept_window", "-1"),
    (lambda: ReplicaRank(tp_size=0, tp_rank=0), "tp_size", "0"),
    (lambda: ReplicaRank(pp_size=-1, pp_rank=0), "pp_size", "-1"),
    (lambda: make(tpp=True), "tokens_per_page", "True"),
    (lambda: make(tpp=16.0), "tokens_per_page", "16.0"),
    (lambda: region(pages=1 << 63, size=1), "num_pages", str(1 << 63)),
])
def test_sizes_must_be_non_negative_ints_and_positive_where_they_count(build, field, value):
    with pytest.raises(LayoutError) as err:
        build()
    assert field in str(err.value) and value in str(err.value)


def test_region_must_hold_its_pages():
    with pytest.raises(LayoutError, match=r"region 'r0'\.size.*4095 bytes cannot hold 4 pages of stride 1024"):
        region(size=4095)
    assert region(size=4096).size == 4096


def test_buffer_must_fit_inside_its_page_slot():
    with pytest.raises(LayoutError,
                       match=r"buffer 'b0'\.offset.*offset 600 \+ page_bytes 512 exceeds the page stride 1024"):
        make(buffers=[buf(offset=600)])
    assert make(buffers=[buf(offset=512)]).buffers[0].offset == 512  # ends exactly at the stride


def test_buffers_of_one_region_must_not_overlap():
    with pytest.raises(LayoutError, match=r"buffer 'b1'\.offset.*\[511, 1023\) overlap buffer 'b0' \[0, 512\)"):
        make(buffers=[buf("b0"), buf("b1", offset=511, role=Role.V)])
    # Adjacent is fine, and so is the same offset in another region.
    make(buffers=[buf("b0"), buf("b1", offset=512, role=Role.V)])
    make(regions=[region("r0"), region("r1")], buffers=[buf("b0"), buf("b1", region="r1", role=Role.V)])


def test_overlap_is_found_past_a_short_neighbour():
    # b1 sits inside b0; b2 overlaps b0 but not b1: the sweep must still catch b1.
    with pytest.raises(LayoutError, match=r"buffer 'b1'.*overlap buffer 'b0'"):
        make(buffers=[buf("b0", page_bytes=800), buf("b1", offset=100, page_bytes=10, role=Role.V),
                      buf("b2", offset=700, page_bytes=10, role=Role.KV)])


def test_buffers_of_different_groups_may_share_bytes():
    # One pool serving two groups (vLLM's hybrid allocator): a slot belongs to one group at a time.
    shared = make(buffers=[buf("b0", layer=0, group="full"), buf("b1", layer=1, group="swa", window=64)])
    assert set(shared.groups) == {"full", "swa"}
    with pytest.raises(LayoutError, match=r"buffer 'b1'\.offset.*overlap buffer 'b0'.*same group 'g'"):
        make(buffers=[buf("b0", layer=0), buf("b1", layer=1)])
    # A recurrent state block in the first bytes of an attention page (a Mamba layer under vLLM's HMA).
    state = make(buffers=[buf("b0", layer=0, group="full"),
                          buf("b1", layer=1, page_bytes=100, group="ssm", kind=LayerKind.RECURRENT, role=Role.STATE),
                          buf("b2", layer=1, offset=100, page_bytes=50, group="ssm", kind=LayerKind.RECURRENT,
                              role=Role.CONV)])
    assert state.groups["ssm"].recurrent
    with pytest.raises(LayoutError, match=r"buffer 'b2'\.offset.*same group 'swa'"):
        make(buffers=[buf("b0", layer=0, group="full"), buf("b1", layer=1, group="swa"),
                      buf("b2", layer=2, group="swa")])


@pytest.mark.parametrize("role, heads, bph, page_bytes, ok", [
    (Role.K, 2, 16, 2 * 16 * 16, True),
    (Role.V, 2, 16, 2 * 16 * 16 + 1, False),
    (Role.KV, 2, 16, 2 * 2 * 16 * 16, True),
    (Role.KV, 2, 16, 2 * 16 * 16, False),  # KV holds K and V: x2
])
def test_attention_geometry_times_tokens_per_page_is_page_bytes(role, heads, bph, page_bytes, ok):
    b = buf(page_bytes=page_bytes, role=role, geometry=HeadGeometry(heads, bph))
    if ok:
        assert make(regions=[region(stride=2048)], buffers=[b]).tokens_per_page == 16
    else:
        with pytest.raises(LayoutError,
                           match=rf"buffer 'b0'\.geometry.*heads 2 x bytes_per_head 16 .*page_bytes is {page_bytes}"):
            make(regions=[region(stride=2048)], buffers=[b])


def test_recurrent_geometry_is_per_state_row():
    g = HeadGeometry(64, 8)
    make(buffers=[buf(page_bytes=512, kind=R, role=Role.STATE, geometry=g)])
    with pytest.raises(LayoutError, match=r"buffer 'b0'\.geometry.*per state row = 512, but page_bytes is 256"):
        make(buffers=[buf(page_bytes=256, kind=R, role=Role.STATE, geometry=g)])


def test_rank_must_be_below_size():
    with pytest.raises(LayoutError, match=r"replica\.tp_rank: 2 must be < tp_size 2"):
        ReplicaRank(tp_size=2, tp_rank=2)
    with pytest.raises(LayoutError, match=r"replica\.pp_rank: 4 must be < pp_size 4"):
        ReplicaRank(pp_size=4, pp_rank=4)
    assert ReplicaRank(tp_size=2, tp_rank=1).tp_rank == 1


def test_layer_and_role_are_unique():
    with pytest.raises(LayoutError, match=r"buffer 'b1'\.identity.*\(layer, role\) \(7, 'K'\) is also buffer 'b0'"):
        make(buffers=[buf("b0", layer=7), buf("b1", layer=7, offset=512)])


def test_buffer_names_an_existing_region():
    with pytest.raises(LayoutError, match=r"buffer 'b0'\.region.*names no region \('nope'; have \['r0'\]\)"):
        make(buffers=[buf(region="nope")])


@pytest.mark.parametrize("attr, items, message", [
    ("regions", lambda: [region("r0"), region("r0")], r"regions: duplicate names \['r0'\]"),
    ("buffers", lambda: [buf("b0"), buf("b0", offset=512, role=Role.V)], r"buffers: duplicate names \['b0'\]"),
    ("regions", lambda: [], "regions: must not be empty"),
    ("buffers", lambda: [], "buffers: must not be empty"),
])
def test_region_and_buffer_lists(attr, items, message):
    with pytest.raises(LayoutError, match=message):
        make(**{attr: items()})
    lay = make()
    with pytest.raises(LayoutError, match=rf"{attr}: must be a tuple, got list"):
        dataclasses.replace(lay, **{attr: list(getattr(lay, attr))})
    with pytest.raises(LayoutError, match=rf"{attr}: entries must be"):
        dataclasses.replace(lay, **{attr: (object(),)})


def test_names_dtype_and_scope_are_checked():
    with pytest.raises(LayoutError, match=r"region ''\.name: must be a non-empty str, got ''"):
        region(name="")
    with pytest.raises(LayoutError, match=r"buffer 'x{10}.*\.name: longer than 256 characters \(257\)"):
        buf(name="x" * 257)
    with pytest.raises(LayoutError, match=r"dtype: longer than 64 characters \(65\)"):
        make(dtype="f" * 65)
    with pytest.raises(LayoutError, match=r"scope: must be a str of at most 65535 characters, got int"):
        make(scope=5)
    with pytest.raises(LayoutError, match=r"scope: .*got 65536 characters"):
        make(scope="s" * 65536)


def test_host_regions_refuse_all_selection():
    host = make(regions=[region("dev"), region("host", kind=MemoryKind.HOST)],
                buffers=[buf("b0", region="dev"), buf("b1", region="host", role=Role.V)])
    with pytest.raises(LayoutError, match=r"selection ALL: HOST regions \['host'\] support only NAMED rows"):
        host.check_selection(RowSelection.all())
    with pytest.raises(LayoutError, match="selection ALL"):
        host.selected_buffers(RowSelection.all())
    host.check_selection(RowSelection.named("b1"))
    assert [b.name for b in host.selected_buffers(RowSelection.named("b1", "b0"))] == ["b1", "b0"]
    with pytest.raises(LayoutError, match=r"no buffer 'b9'; have \['b0', 'b1'\]"):
        host.check_selection(RowSelection.named("b9"))
    device = make()
    assert device.selected_buffers(RowSelection.all()) == device.buffers


def test_row_selection_rules():
    assert RowSelection.all().mode is SelectionMode.ALL
    with pytest.raises(LayoutError, match="ALL selection takes no names"):
        RowSelection(SelectionMode.ALL, ("a",))
    with pytest.raises(LayoutError, match="NAMED selection needs at least one buffer name"):
        RowSelection.named()
    with pytest.raises(LayoutError, match=r"duplicate names in \('a', 'a'\)"):
        RowSelection.named("a", "a")
    with pytest.raises(LayoutError, match="selection.names: must be a tuple, got list"):
        RowSelection(SelectionMode.NAMED, ["a"])


@pytest.mark.parametrize("kind, role", [(A, Role.STATE), (A, Role.CONV), (R, Role.K), (R, Role.V), (R, Role.KV)])
def test_role_must_suit_the_layer_kind(kind, role):
    with pytest.raises(LayoutError, match=rf"layer 3\.role: {role.value} is not a role of a {kind.value} layer"):
        LayerIdentity(3, kind, role)


def test_enums_are_required():
    with pytest.raises(LayoutError, match=r"region 'r0'\.kind: must be a MemoryKind, got 'DEVICE'"):
        MemoryRegion("r0", "DEVICE", 0, 1024, 1024, 1)
    with pytest.raises(LayoutError, match=r"geometry\.order: must be a HeadOrder, got 'HND'"):
        HeadGeometry(1, 2, "HND")


def test_a_group_cannot_mix_kinds():
    with pytest.raises(LayoutError, match=r"buffer 'b1'\.group: group 'g' mixes ATTENTION and RECURRENT layers"):
        make(buffers=[buf("b0"), buf("b1", offset=512, layer=1, kind=R, role=Role.STATE)])


def test_errors_are_kvlend_errors_and_value_errors():
    with pytest.raises(KvlendError):
        region(size=0)
    with pytest.raises(ValueError):
        region(size=0)


# ------------------------------------------------------------ read window
def test_declared_window_is_clamped_to_the_kept_window():
    lay = make(kept=256, buffers=[buf(window=4096)])
    assert lay.clamp_window(4096) == 256
    assert lay.clamp_window(100) == 100
    assert lay.groups["g"].read_window == 256


@pytest.mark.parametrize("declared", [None, 0, -1, -4096])
def test_missing_or_non_positive_window_means_the_kept_window(declared):
    lay = make(kept=256, buffers=[buf(window=declared)])
    assert lay.clamp_window(declared) == 256
    assert lay.groups["g"].read_window == 256


def test_group_read_window_and_sinks_are_the_max_over_members():
    buffers = [
        buf("a", layer=0, window=100, sinks=2), buf("b", layer=1, offset=512, window=300, sinks=1),
        buf("c", region="r1", layer=2, group="h", window=50),
        buf("d", region="r1", layer=3, offset=512, group="h", window=70),
    ]
    lay = make(regions=[region("r0"), region("r1")], buffers=buffers, kept=4096)
    assert (lay.groups["g"].read_window, lay.groups["g"].sinks) == (300, 2)
    assert (lay.groups["h"].read_window, lay.groups["h"].sinks) == (70, 0)
    assert [b.name for b in lay.groups["g"].buffers] == ["a", "b"]
    # One full-attention member makes the whole group read the kept window.
    full = make(regions=[region("r0")], buffers=[buffers[0], dataclasses.replace(buffers[1], window=None)], kept=4096)
    assert full.groups["g"].read_window == 4096


def test_groups_know_their_kind():
    lay = make(buffers=[buf("a"), buf("s", offset=512, layer=1, kind=R, role=Role.STATE, group="m")])
    assert lay.groups["g"].kind is A and not lay.groups["g"].recurrent
    assert lay.groups["m"].recurrent


# ------------------------------------------------------------- pages_read
def group(read_window, sinks=0, kind=A):
    return LayerGroup("g", kind, (), read_window, sinks)


@pytest.mark.parametrize("position, tpp, window, sinks, expected", [
    (161, 32, 64, 1, [0, 3, 4, 5]),  # the design example
    (0, 32, 64, 1, []),
    (-5, 32, 64, 1, []),
    (1, 32, 64, 1, [0]),
    (32, 32, 64, 0, [0]),
    (33, 32, 64, 0, [0, 1]),
    (64, 32, 32, 0, [1]),  # tokens [32, 64) are page 1 only
    (40, 32, 64, 3, [0, 1]),  # sinks inside the window are not repeated
    (1000, 16, 1 << 20, 0, list(range(63))),  # full attention: every page
    (1000, 16, 160, 2, [0, 1, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62]),
])
def test_pages_read(position, tpp, window, sinks, expected):
    pages = group(window, sinks).pages_read(position, tpp)
    assert pages.dtype == np.int64
    assert pages.tolist() == expected


def test_recurrent_group_reads_one_row_at_any_position():
    for position in (0, 1, 10_000):
        assert group(64, kind=R).pages_read(position, 16).tolist() == [0]


@PROPERTY
@given(position=st.integers(1, 10_000), tpp=st.integers(1, 64), window=st.integers(1, 5000), sinks=st.integers(0, 8))
def test_pages_read_properties(position, tpp, window, sinks):
    pages = group(window, sinks).pages_read(position, tpp).tolist()
    last = (position - 1) // tpp
    assert pages == sorted(set(pages))
    assert pages[-1] == last
    assert pages[0] >= 0
    # Every token of the window [position - window, position) is on a listed page.
    for token in (max(0, position - window), position - 1):
        assert token // tpp in pages
    assert set(range(min(sinks, last + 1))) <= set(pages)
    assert len(pages) <= sinks + -(-window // tpp) + 1


# ------------------------------------------------------- layout_from_pools
def test_from_numpy_kv_pools():
    pools = [np.zeros((4, 2, 2, 16, 8), dtype=np.float16) for _ in range(3)]
    lay = layout_from_pools(pools, kept_window=1024, scope="toy", sinks=9)
    assert lay.tokens_per_page == 16 and lay.dtype == "float16" and lay.scope == "toy"
    assert [r.address for r in lay.regions] == [p.ctypes.data for p in pools]
    for r, p in zip(lay.regions, pools):
        assert (r.kind, r.size, r.num_pages, r.page_stride) == (MemoryKind.HOST, p.nbytes, 4, p.nbytes // 4)
    k, v = lay.buffer("L1.K"), lay.buffer("L1.V")
    assert (k.region, k.offset, k.page_bytes) == ("L1.kv", 0, 2 * 16 * 8 * 2)
    assert (v.region, v.offset, v.page_bytes) == ("L1.kv", 2 * 16 * 8 * 2, 2 * 16 * 8 * 2)
    assert k.geometry == HeadGeometry(2, 16, HeadOrder.HND, Sharding.INDEXED)
    assert (k.window, k.sinks, k.group) == (None, 0, "full")  # sinks apply to windowed layers only
    # Slot p of L1.kv starts at the address numpy computes for pools[1][p].
    assert lay.region("L1.kv").page_address(np.arange(4)).tolist() == [pools[1][p].ctypes.data for p in range(4)]


def test_from_torch_separate_k_and_v_pools():
    k = [torch.zeros(6, 4, 8, 32, dtype=torch.bfloat16) for _ in range(2)]
    v = [torch.zeros(6, 4, 8, 32, dtype=torch.bfloat16) for _ in range(2)]
    lay = layout_from_pools(k=k, v=v, kept_window=512, layer_ids=[10, 11], windows={11: 64}, sinks=1,
                            sharding=Sharding.REPLICATED, replica=ReplicaRank(2, 1))
    assert lay.dtype == "bfloat16" and lay.tokens_per_page == 8
    assert [r.name for r in lay.regions] == ["L10.k", "L10.v", "L11.k", "L11.v"]
    assert [r.address for r in lay.regions] == [t.data_ptr() for pair in zip(k, v) for t in pair]
    assert all(r.kind is MemoryKind.HOST and r.size == 6 * 4 * 8 * 32 * 2 for r in lay.regions)
    b = lay.buffer("L11.V")
    assert (b.region, b.offset, b.page_bytes, b.identity) == ("L11.v", 0, 4 * 8 * 64, LayerIdentity(11, A, Role.V))
    assert b.geometry == HeadGeometry(4, 64, HeadOrder.HND, Sharding.REPLICATED)
    assert (b.window, b.sinks, b.group) == (64, 1, "swa")
    assert lay.groups["swa"].read_window == 64 and lay.groups["full"].read_window == 512
    assert lay.replica == ReplicaRank(2, 1)
    with pytest.raises(LayoutError, match="HOST regions"):
        lay.check_selection(RowSelection.all())


def test_from_torch_kv_pools_with_group_names():
    kv = [torch.zeros(3, 2, 1, 4, 16, dtype=torch.float32) for _ in range(2)]
    lay = layout_from_pools(kv, kept_window=64, tokens_per_page=4, group_of={0: "a", 1: "b"})
    assert [r.address for r in lay.regions] == [t.data_ptr() for t in kv]
    assert set(lay.groups) == {"a", "b"} and lay.dtype == "float32"


def test_pool_layout_id_does_not_depend_on_capacity_or_addresses():
    small = layout_from_pools([np.zeros((2, 2, 2, 4, 8), np.float16)], kept_window=64)
    large = layout_from_pools([np.zeros((9, 2, 2, 4, 8), np.float16)], kept_window=64)
    assert small.layout_id == large.layout_id


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv=[np.zeros((2, 2, 1, 4, 8))], k=[np.zeros((2, 1, 4, 8))]), "either kv"),
    (dict(), "either kv"),
    (dict(k=[np.zeros((2, 1, 4, 8))]), "k and v must both be given"),
    (dict(k=[np.zeros((2, 1, 4, 8))] * 2, v=[np.zeros((2, 1, 4, 8))]), "k and v must both be given"),
    (dict(kv=[]), "no layers given"),
    (dict(kv=[np.zeros((2, 2, 1, 4))]), r"layer 0: tensor shape \(2, 2, 1, 4\) is not \[num_pages, 2, heads"),
    (dict(kv=[np.zeros((2, 3, 1, 4, 8))]), r"tensor shape \(2, 3, 1, 4, 8\) is not"),
    (dict(k=[np.zeros((2, 2, 1, 4, 8))], v=[np.zeros((2, 2, 1, 4, 8))]), r"is not \[num_pages, heads, tokens_per_page"),
    (dict(kv=[np.zeros((0, 2, 1, 4, 8))]), r"layer 0: tensor shape \(0, 2, 1, 4, 8\) has an empty dimension"),
    (dict(kv=[np.zeros((2, 2, 0, 4, 8))]), "has an empty dimension"),
    (dict(kv=[np.zeros((2, 2, 1, 4, 8))], tokens_per_page=8), "tokens_per_page=8 but the tensors hold 4"),
    (dict(kv=[np.zeros((2, 2, 1, 4, 8), np.float16), np.zeros((2, 2, 1, 4, 8), np.float32)]),
     r"share tokens_per_page and dtype, got \[4\] and \['float16', 'float32'\]"),
    (dict(kv=[np.zeros((2, 2, 1, 4, 8)), np.zeros((2, 2, 1, 8, 8))]), r"got \[4, 8\]"),
    (dict(kv=[np.zeros((2, 2, 1, 4, 8))], layer_ids=[0, 1]), "layer_ids has 2 entries for 1 layers"),
    (dict(kv=[np.zeros((2, 2, 1, 8, 4)).transpose(0, 1, 2, 4, 3)]), "must be C-contiguous"),
    (dict(kv=[torch.zeros(2, 2, 1, 8, 4).transpose(3, 4)]), "must be contiguous"),
    (dict(kv=[[[0.0]]]), "numpy array or a torch tensor, got list"),
])
def test_layout_from_pools_rejects_bad_input(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        layout_from_pools(**{"kept_window": 64, **kwargs})


# ------------------------------------------------------------- round trip
def test_decode_rejects_non_bytes_and_oversize():
    with pytest.raises(LayoutError, match="must be bytes, got str"):
        PageLayout.decode("abc")
    with pytest.raises(LayoutError, match="exceeds the cap"):
        PageLayout.decode(b"\x00" * (layout_module.MAX_ENCODED_BYTES + 1))


def test_decode_rejects_other_versions_even_equal_floats():
    d = make().to_dict()
    for version in (2, 4, 3.0, True, "3", None):
        with pytest.raises(LayoutError, match=r"layout\.version: expected 3"):
            PageLayout.from_dict({**d, "version": version})


@PROPERTY
@given(layouts())
def test_encode_decode_round_trip_is_exact(lay):
    back = PageLayout.decode(lay.encode())
    assert back == lay and back.layout_id == lay.layout_id
    assert back.encode() == lay.encode()
    via_json = PageLayout.from_dict(json.loads(json.dumps(lay.to_dict())))
    assert via_json == lay and via_json.layout_id == lay.layout_id


# -------------------------------------------------------------- layout_id
def rebuilt(lay, *, regions=None, buffers=None, **fields):
    """A fresh layout (fresh cached layout_id) with some parts replaced."""
    return dataclasses.replace(
        lay, regions=tuple(lay.regions if regions is None else regions),
        buffers=tuple(lay.buffers if buffers is None else buffers), **fields,
    )


def replace_buffer(lay, name, **changes):
    return rebuilt(lay, buffers=[dataclasses.replace(b, **changes) if b.name == name else b for b in lay.buffers])


def replace_region(lay, name, **changes):
    return rebuilt(lay, regions=[dataclasses.replace(r, **changes) if r.name == name else r for r in lay.regions])


def grown_slot(lay, region_name):
    """The layout with one spare byte at the end of each slot of a region (and the room for it)."""
    r = lay.region(region_name)
    return replace_region(lay, region_name, page_stride=r.page_stride + 1,
                          size=max(r.size, (r.page_stride + 1) * r.num_pages))


def last_buffer(lay, region_name):
    return max((b for b in lay.buffers if b.region == region_name), key=lambda b: b.offset)


@PROPERTY
@given(layouts(), st.data())
def test_layout_id_ignores_declaration_order(lay, data):
    shuffled = rebuilt(lay, regions=data.draw(st.permutations(lay.regions)),
                       buffers=data.draw(st.permutations(lay.buffers)))
    assert shuffled.layout_id == lay.layout_id


@PROPERTY
@given(layouts(), st.data())
def test_layout_id_ignores_addresses_and_capacity(lay, data):
    regions = []
    for r in lay.regions:
        pages = data.draw(st.integers(1, 10_000))
        size = r.page_stride * pages + data.draw(st.integers(0, 1 << 20))
        regions.append(dataclasses.replace(r, address=data.draw(st.integers(0, 1 << 62)), num_pages=pages, size=size))
    assert rebuilt(lay, regions=regions).layout_id == lay.layout_id


@PROPERTY
@given(layouts(), st.data())
def test_layout_id_ignores_names(lay, data):
    def bijection(names, prefix):
        names = sorted(set(names))
        return dict(zip(names, [prefix + n for n in data.draw(st.permutations(names))]))

    rmap = bijection([r.name for r in lay.regions], "R:")
    bmap = bijection([b.name for b in lay.buffers], "B:")
    gmap = bijection([b.group for b in lay.buffers], "G:")
    renamed = rebuilt(
        lay,
        regions=[dataclasses.replace(r, name=rmap[r.name]) for r in lay.regions],
        buffers=[dataclasses.replace(b, name=bmap[b.name], region=rmap[b.region], group=gmap[b.group])
                 for b in lay.buffers],
    )
    assert renamed != lay
    assert renamed.layout_id == lay.layout_id


@PROPERTY
@given(layouts(), st.data())
def test_layout_id_ignores_windows_sinks_and_kept_window(lay, data):
    buffers = [dataclasses.replace(b, window=data.draw(st.none() | st.integers(-10, 1 << 20)),
                                   sinks=data.draw(st.integers(0, 16))) for b in lay.buffers]
    other = rebuilt(lay, buffers=buffers, kept_window=data.draw(st.integers(1, 1 << 20)))
    assert other.layout_id == lay.layout_id


@PROPERTY
@given(layouts(with_geometry=st.just(False)))
def test_layout_id_sees_tokens_per_page(lay):
    assert rebuilt(lay, tokens_per_page=lay.tokens_per_page + 1).layout_id != lay.layout_id


@PROPERTY
@given(layouts(), st.data())
def test_layout_id_sees_a_buffer_offset(lay, data):
    r = data.draw(st.sampled_from(lay.regions))
    roomy = grown_slot(lay, r.name)
    b = last_buffer(roomy, r.name)
    moved = replace_buffer(roomy, b.name, offset=b.offset + 1)
    assert moved.layout_id != roomy.layout_id


@PROPERTY
@given(layouts(), st.data())
def test_layout_id_sees_page_bytes(lay, data):
    r = data.draw(st.sampled_from(lay.regions))
    b = last_buffer(lay, r.name)
    roomy = replace_buffer(grown_slot(lay, r.name), b.name, geometry=None)
    longer = replace_buffer(roomy, b.name, page_bytes=b.page_bytes + 1)
    assert longer.layout_id != roomy.layout_id


@PROPERTY
@given(layouts(with_geometry=st.just(True), bytes_per_head=st.sampled_from((2, 16, 64))), st.data())
def test_layout_id_sees_geometry(lay, data):
    b = data.draw(st.sampled_from(lay.buffers))
    g = b.geometry
    variants = [
        HeadGeometry(g.heads * 2, g.bytes_per_head // 2, g.order, g.sharding),  # same bytes, other split
        dataclasses.replace(g, order=HeadOrder.NHD if g.order is HeadOrder.HND else HeadOrder.HND),
        dataclasses.replace(g, sharding=Sharding.INDEXED if g.sharding is Sharding.REPLICATED else Sharding.REPLICATED),
        None,
    ]
    ids = {replace_buffer(lay, b.name, geometry=v).layout_id for v in variants}
    assert len(ids) == len(variants) and lay.layout_id not in ids


@PROPERTY
@given(layouts(), st.data())
def test_layout_id_sees_role(lay, data):
    taken = {b.identity.key for b in lay.buffers}
    choices = [
        (b, role) for b in lay.buffers
        for role in ((Role.K, Role.V, Role.KV) if b.identity.kind is A else (Role.STATE, Role.CONV))
        if (b.identity.layer, role.value) not in taken
    ]
    assume(choices)
    b, role = data.draw(st.sampled_from(choices))
    plain = replace_buffer(lay, b.name, geometry=None)  # geometry's x2 for KV would refuse the swap
    swapped = replace_buffer(plain, b.name, identity=LayerIdentity(b.identity.layer, b.identity.kind, role))
    assert swapped.layout_id != plain.layout_id


@PROPERTY
@given(layouts(), st.data())
def test_layout_id_sees_layer_id(lay, data):
    b = data.draw(st.sampled_from(lay.buffers))
    fresh = max(x.identity.layer for x in lay.buffers) + 1
    moved = replace_buffer(lay, b.name, identity=dataclasses.replace(b.identity, layer=fresh))
    assert moved.layout_id != lay.layout_id


@PROPERTY
@given(layouts(), st.data())
def test_layout_id_sees_region_page_stride(lay, data):
    r = data.draw(st.sampled_from(lay.regions))
    assert grown_slot(lay, r.name).layout_id != lay.layout_id


@PROPERTY
@given(layouts())
def test_layout_id_sees_dtype_scope_and_tensor_parallel_rank(lay):
    rep = lay.replica
    others = [
        rebuilt(lay, dtype=lay.dtype + "x"),
        rebuilt(lay, scope=lay.scope + "x"),
        rebuilt(lay, replica=dataclasses.replace(rep, tp_size=rep.tp_size + 1)),
        rebuilt(lay, replica=ReplicaRank(max(2, rep.tp_size), (rep.tp_rank + 1) % max(2, rep.tp_size),
                                         rep.pp_size, rep.pp_rank)),
    ]
    ids = {o.layout_id for o in others}
    assert len(ids) == len(others) and lay.layout_id not in ids


def test_layout_id_sees_the_layout_version(monkeypatch):
    lay = make()
    assert lay.canonical_identity()[1] == layout_module.LAYOUT_VERSION == 3
    before = lay.layout_id
    monkeypatch.setattr(layout_module, "LAYOUT_VERSION", 4)
    assert rebuilt(lay).layout_id != before


def test_layout_id_is_a_sha256_hex_digest():
    lid = make().layout_id
    assert len(lid) == 64 and int(lid, 16) >= 0
