"""Hypothesis strategies for PageLayouts, valid by construction.

``layouts()`` draws a whole rank's layout: HOST/DEVICE regions with padded
page slots, attention layers (K+V or combined KV) and recurrent layers (STATE,
CONV) in named groups, declared windows and sinks, optional head geometry and
a tensor/pipeline-parallel rank; regions and buffers come in shuffled order.
Its keyword arguments narrow the draw for tests that need, say, DEVICE-only
pools or geometry on every buffer.
"""

from __future__ import annotations

from hypothesis import strategies as st

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

DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "int8")
ATTENTION_GROUPS = ("full", "swa", "local")
RECURRENT_GROUPS = ("mamba", "ssm")


@st.composite
def replicas(draw, max_tp: int = 8, max_pp: int = 4) -> ReplicaRank:
    tp = draw(st.integers(1, max_tp))
    pp = draw(st.integers(1, max_pp))
    return ReplicaRank(tp, draw(st.integers(0, tp - 1)), pp, draw(st.integers(0, pp - 1)))


@st.composite
def layouts(
    draw,
    *,
    max_layers: int = 6,
    max_regions: int = 3,
    memory_kinds: tuple[MemoryKind, ...] = (MemoryKind.HOST, MemoryKind.DEVICE),
    recurrent: bool = True,
    with_geometry: st.SearchStrategy[bool] = st.booleans(),
    heads: st.SearchStrategy[int] = st.integers(1, 8),
    bytes_per_head: st.SearchStrategy[int] = st.sampled_from((2, 16, 64, 256)),
    orders: st.SearchStrategy[HeadOrder] = st.sampled_from(HeadOrder),
    shardings: st.SearchStrategy[Sharding] = st.sampled_from(Sharding),
    tokens_per_page: st.SearchStrategy[int] = st.sampled_from((1, 2, 4, 16, 32)),
    dtypes: st.SearchStrategy[str] = st.sampled_from(DTYPES),
    replica: st.SearchStrategy[ReplicaRank] = replicas(),
) -> PageLayout:
    tpp = draw(tokens_per_page)
    layer_ids = draw(st.lists(st.integers(0, 127), min_size=1, max_size=max_layers, unique=True))
    kinds = st.sampled_from(LayerKind) if recurrent else st.just(LayerKind.ATTENTION)
    specs = []  # (name, page_bytes, identity, group, geometry, window, sinks)
    for layer in layer_ids:
        kind = draw(kinds)
        if kind is LayerKind.ATTENTION:
            roles = draw(st.sampled_from(((Role.K, Role.V), (Role.KV,))))
            group = draw(st.sampled_from(ATTENTION_GROUPS))
            window = draw(st.none() | st.integers(-8, 1 << 17))
            sinks = 0 if window is None else draw(st.integers(0, 4))
        else:
            roles = draw(st.sampled_from(((Role.STATE, Role.CONV), (Role.STATE,))))
            group, window, sinks = draw(st.sampled_from(RECURRENT_GROUPS)), None, 0
        for role in roles:
            geometry = None
            if draw(with_geometry):
                geometry = HeadGeometry(draw(heads), draw(bytes_per_head), draw(orders), draw(shardings))
                per_page = 1 if kind is LayerKind.RECURRENT else tpp * (2 if role is Role.KV else 1)
                page_bytes = geometry.heads * geometry.bytes_per_head * per_page
            else:
                page_bytes = draw(st.integers(1, 4096))
            specs.append((f"L{layer}.{role.value}", page_bytes, LayerIdentity(layer, kind, role),
                          group, geometry, window, sinks))

    n_regions = draw(st.integers(1, max_regions))
    placement = [draw(st.integers(0, n_regions - 1)) for _ in specs]
    regions, buffers = [], []
    for index in sorted(set(placement)):
        name = f"pool{index}"
        cursor = 0
        for spec, where in zip(specs, placement):
            if where != index:
                continue
            offset = cursor + draw(st.integers(0, 64))
            buffers.append(BufferDesc(spec[0], name, offset, spec[1], *spec[2:]))
            cursor = offset + spec[1]
        stride = cursor + draw(st.integers(0, 64))
        num_pages = draw(st.integers(1, 64))
        regions.append(MemoryRegion(
            name, draw(st.sampled_from(memory_kinds)), draw(st.integers(0, 7)),
            stride * num_pages + draw(st.integers(0, 4096)), stride, num_pages, draw(st.integers(0, 1 << 48)),
        ))
    return PageLayout(
        regions=tuple(draw(st.permutations(regions))),
        buffers=tuple(draw(st.permutations(buffers))),
        tokens_per_page=tpp,
        kept_window=draw(st.integers(1, 1 << 20)),
        dtype=draw(dtypes),
        scope=draw(st.text(max_size=12)),
        replica=draw(replica),
    )
