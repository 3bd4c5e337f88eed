"""fetchplan: what a fetch reads, checked token by token against the two layouts.

Random pairs of layouts (page ratios 1, 2 and 4 both ways; kept windows,
declared windows and sinks on both sides, the remote lending at least what
the local groups read, as ``negotiate`` demands), random positions, resume
bounds and chunk sizes.  The reference works in tokens: a local page is
delivered when the remote pages read hold every one of its tokens below
``num_tokens``.  The chunks then go through ``plan_reads`` with destination
tables of exactly ``destination_pages`` entries and through the tracker.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvlend.core.fetchplan import destination_pages, needed_pages, skip_below, split_chunks
from kvlend.core.layout import (
    BufferDesc,
    HeadGeometry,
    LayerIdentity,
    LayerKind,
    MemoryKind,
    MemoryRegion,
    PageLayout,
    Role,
)
from kvlend.core.negotiate import TransferPlan, negotiate
from kvlend.core.pages import GroupPages
from kvlend.core.plan import plan_reads
from kvlend.core.tracker import DeliveryTracker
from kvlend.errors import PageRangeError
from tests.support.profiles import examples

pytestmark = pytest.mark.unit

MAX_TOKENS = 400
RATIOS = [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1)]  # (local, remote) multiples of a base page size


def layout(prefix: str, tpp: int, kept: int, window: int | None, sinks: int, state: bool) -> PageLayout:
    """Layer 0 in group "full", layer 1 in "swa" (``window``, ``sinks``), layer 99 recurrent in "ssm"."""
    pages = MAX_TOKENS // tpp + 8
    regions, buffers = [], []
    for layer, group in ((0, "full"), (1, "swa")):
        page = tpp * 2
        regions.append(MemoryRegion(f"{prefix}L{layer}", MemoryKind.DEVICE, 0, 2 * page * pages, 2 * page, pages))
        for i, role in enumerate((Role.K, Role.V)):
            buffers.append(BufferDesc(
                f"{prefix}L{layer}.{role.value}", f"{prefix}L{layer}", i * page, page,
                LayerIdentity(layer, LayerKind.ATTENTION, role), prefix + group, HeadGeometry(1, 2),
                window if group == "swa" else None, sinks if group == "swa" else 0))
    if state:
        regions.append(MemoryRegion(f"{prefix}state", MemoryKind.DEVICE, 0, 8 * 4, 8, 4))
        buffers.append(BufferDesc(f"{prefix}S", f"{prefix}state", 0, 8,
                                  LayerIdentity(99, LayerKind.RECURRENT, Role.STATE), prefix + "ssm"))
    return PageLayout(tuple(regions), tuple(buffers), tpp, kept, "bfloat16")


@st.composite
def plans(draw) -> TransferPlan:
    """A local layout, and a remote one lending at least what it reads (see negotiate's module doc)."""
    base = draw(st.sampled_from([1, 2, 4, 8]))
    ratio = draw(st.sampled_from(RATIOS))
    tl, tr = base * ratio[0], base * ratio[1]
    state = draw(st.booleans())
    local = layout("d.", tl, draw(st.integers(1, 96)), draw(st.none() | st.integers(-1, 80)),
                   draw(st.integers(0, 4)), state)
    slack = max(0, tl - tr)
    kept = local.kept_window + slack + draw(st.integers(0, 20))
    window = local.groups["d.swa"].read_window + slack + draw(st.integers(0, 20))
    sinks = -(-local.groups["d.swa"].sinks * tl // tr) + draw(st.integers(0, 2))
    remote = layout("p.", tr, kept, draw(st.sampled_from([window, None])), sinks, state)
    return negotiate(local, remote)


def lease(plan: TransferPlan, num_tokens: int) -> dict[str, GroupPages]:
    """What the lender lends: per remote group the pages a decoder at ``num_tokens`` reads, slot = page."""
    out = {}
    for name, g in plan.remote.groups.items():
        rows = g.pages_read(num_tokens, plan.remote.tokens_per_page)
        out[name] = GroupPages(rows, rows)
    return out


def tokens(pages, tpp: int, num_tokens: int) -> np.ndarray:
    """Mask of the tokens below ``num_tokens`` that token ``pages`` hold."""
    mask = np.zeros((MAX_TOKENS // tpp + 8, tpp), dtype=bool)
    mask[np.asarray(pages, dtype=np.int64)] = True
    return mask.reshape(-1)[:num_tokens]


def whole(pages, tpp: int, held: np.ndarray, num_tokens: int) -> list[int]:
    """The ``pages`` every one of whose tokens below ``num_tokens`` ``held`` has."""
    return [p for p in pages if held[p * tpp:min((p + 1) * tpp, num_tokens)].all()]


def attention_groups(plan: TransferPlan):
    for rg, lg in plan.group_map.items():
        if not plan.local.groups[lg].recurrent:
            yield rg, lg


@st.composite
def fetches(draw):
    plan = draw(plans())
    n = draw(st.integers(1, MAX_TOKENS))
    offer = lease(plan, n)
    full = draw(st.booleans())
    if not full:  # a partial offer: a local page counts only if it is held whole
        offer = {rg: gp.select(np.array(draw(st.lists(st.booleans(), min_size=len(gp), max_size=len(gp))),
                                        dtype=bool)) for rg, gp in offer.items()}
    return plan, n, offer, full, draw(st.integers(0, n)), draw(st.integers(1, 4))


SETTINGS = settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(plans(), st.integers(1, MAX_TOKENS))
def test_a_whole_lease_delivers_exactly_what_the_local_groups_read(plan, n):
    needed = needed_pages(plan, lease(plan, n), n)
    assert set(needed) == set(plan.local.groups)
    for name, group in plan.local.groups.items():
        np.testing.assert_array_equal(needed[name], group.pages_read(n, plan.local.tokens_per_page))


@SETTINGS
@given(fetches())
def test_needed_pages_are_read_by_the_local_group_and_held_whole(fetch):
    plan, n, offer, _full, _bound, _chunk = fetch
    tl, tr = plan.local.tokens_per_page, plan.remote.tokens_per_page
    needed = needed_pages(plan, offer, n)
    for rg, lg in attention_groups(plan):
        reads = plan.local.groups[lg].pages_read(n, tl)
        assert needed[lg].tolist() == whole(reads.tolist(), tl, tokens(offer[rg].token_pages, tr, n), n)


@SETTINGS
@given(fetches())
def test_resume_and_chunks_partition_the_needed_pages_in_whole_pages(fetch):
    plan, n, offer, full, bound, chunk_pages = fetch
    needed = needed_pages(plan, offer, n)
    check_chunks(plan, n, offer, needed, {}, split_chunks(plan, offer, n, chunk_pages), 0, chunk_pages, full)
    rest, kept = skip_below(plan, offer, n, bound)
    check_chunks(plan, n, offer, needed, kept, split_chunks(plan, rest, n, chunk_pages), bound, chunk_pages, full)


def check_chunks(plan, n, offer, needed, kept, chunks, bound, chunk_pages, full):
    """``kept`` and the chunks' local pages partition ``needed``; every chunk reads whole pages of one span."""
    tl, tr = plan.local.tokens_per_page, plan.remote.tokens_per_page
    span = chunk_pages * max(tl, tr)
    recurrent = {rg for rg in plan.group_map if plan.remote.groups[rg].recurrent}
    for remote, _ in chunks[:-1]:
        assert not recurrent & set(remote), "recurrent state goes in the last chunk"
    for rg, lg in plan.group_map.items():
        parts = [(r[rg].token_pages, loc[lg]) for r, loc in chunks if rg in r]
        local = [kept[lg]] if lg in kept else []
        local += [loc for _, loc in parts]
        flat = np.concatenate(local) if local else np.zeros(0, dtype=np.int64)
        assert sorted(flat.tolist()) == needed[lg].tolist(), "kept and chunks partition the needed pages"
        if rg in recurrent:
            continue
        for p in kept.get(lg, []):
            assert (p + 1) * tl <= bound, "a page skipped on resume lies wholly below the bound"
        read = np.concatenate([r for r, _ in parts]) if parts else np.zeros(0, dtype=np.int64)
        assert np.unique(read).size == read.size and set(read.tolist()) <= set(offer[rg].token_pages.tolist())
        for r, loc in parts:
            assert np.unique(r * tr // span).size == 1, "a chunk stays inside one span of whole pages"
            held = tokens(r, tr, n)
            assert whole(loc.tolist(), tl, held, n) == loc.tolist(), "the chunk holds its local pages whole"
            touched = [p for p in range(-(-n // tl)) if held[p * tl:(p + 1) * tl].any()]
            assert set(touched) & set(needed[lg].tolist()) == set(loc.tolist()), \
                "a chunk writes no page another chunk or the resume delivers"
            mine = tokens(loc, tl, n)
            for q in r.tolist():
                assert (tokens([q], tr, n) & mine).any(), "every page read holds tokens of a page it delivers"
    tracker = DeliveryTracker(plan.local)
    tracker.begin("r", n, needed)
    for i, (_, loc) in enumerate(([({}, kept)] if kept else []) + chunks):
        tracker.post("r", i, loc)
        tracker.done("r", i)
    assert tracker.complete("r")
    if full:
        assert tracker.bound("r") == n


@SETTINGS
@given(fetches())
def test_destination_tables_of_exactly_destination_pages_entries_suffice(fetch):
    plan, n, offer, full, bound, chunk_pages = fetch
    counts = destination_pages(plan, n)
    assert destination_pages(plan, n, offer) == counts if full else \
        all(v <= counts[k] for k, v in destination_pages(plan, n, offer).items())
    tl, tr = plan.local.tokens_per_page, plan.remote.tokens_per_page
    pages = -(-n // tr) * (tr // tl) if tr > tl else -(-n // tl)  # whole remote pages, in local pages
    assert counts == {name: 1 if g.recurrent else pages for name, g in plan.local.groups.items()}
    for sizes in (counts, destination_pages(plan, n, offer)):
        dst = {name: np.arange(count) for name, count in sizes.items()}
        rest, _ = skip_below(plan, offer, n, bound)
        for src, _ in split_chunks(plan, rest, n, chunk_pages):
            plan_reads(plan, src, dst)
    if full:  # one entry fewer and the read of the last page is refused
        for _, lg in attention_groups(plan):
            short = {name: np.arange(count - (name == lg)) for name, count in counts.items()}
            with pytest.raises(PageRangeError):
                for src, _ in split_chunks(plan, offer, n, chunk_pages):
                    plan_reads(plan, src, short)


def test_big_remote_pages_land_whole_past_num_tokens():
    plan = negotiate(layout("d.", 16, 4096, 64, 1, False), layout("p.", 64, 4096, 64, 1, False))
    assert destination_pages(plan, 100) == {"d.full": 8, "d.swa": 8}  # two 64-token pages as eight of 16
    offer = lease(plan, 100)
    ((remote, local),) = split_chunks(plan, offer, 100, 4)
    # swa at 100 reads sink page 0 and tokens 32..99: pages 2..6 of 16, in remote pages 0 and 1 of 64.
    assert {k: v.tolist() for k, v in local.items()} == {"d.full": list(range(7)), "d.swa": [0, 2, 3, 4, 5, 6]}
    assert remote["p.swa"].token_pages.tolist() == [0, 1]
    plan_reads(plan, remote, {name: np.arange(8) for name in local})
    with pytest.raises(PageRangeError, match="beyond dst"):  # ceil(100 / 16) entries are not enough
        plan_reads(plan, remote, {name: np.arange(7) for name in local})


def test_a_remote_lending_more_is_read_only_where_the_local_group_reads():
    # The remote keeps and lends a 256-token window; the local group reads 64 tokens and one sink page.
    plan = negotiate(layout("d.", 16, 4096, 64, 1, False), layout("p.", 16, 4096, 256, 2, False))
    offer = lease(plan, 400)
    assert offer["p.swa"].token_pages.tolist() == [0, 1, *range(9, 25)]
    needed = needed_pages(plan, offer, 400)
    assert needed["d.swa"].tolist() == [0, *range(21, 25)]
    (chunk,) = [r for r, _ in split_chunks(plan, offer, 400, 64)]
    assert chunk["p.swa"].token_pages.tolist() == [0, *range(21, 25)]
    tracker = DeliveryTracker(plan.local)
    tracker.begin("r", 400, needed)
    with pytest.raises(PageRangeError, match="not needed"):  # what the filter keeps out
        tracker.post("r", 0, {"d.swa": offer["p.swa"].token_pages})


def test_resume_skips_whole_spans_only():
    # Local pages of 32 from remote pages of 16: a bound of 48 is inside local page 1, so remote page 2
    # (tokens 32..47) is read again with page 3 rather than leave local page 1 half read.
    plan = negotiate(layout("d.", 32, 4096, None, 0, False), layout("p.", 16, 4096 + 16, None, 0, False))
    rest, kept = skip_below(plan, lease(plan, 100), 100, 48)
    assert {k: v.tolist() for k, v in kept.items()} == {"d.full": [0], "d.swa": [0]}
    assert rest["p.full"].token_pages.tolist() == rest["p.swa"].token_pages.tolist() == [2, 3, 4, 5, 6]
