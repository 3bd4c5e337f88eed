"""Progressive lending (issue 17), pure core: ``Lender.lend`` with ``LendOptions(ready=...)``, ``Lender.extend`` and
``DeliveryTracker.need`` as a lease grows chunk by chunk while prefill still computes.

No NIXL, no I/O: every expectation is recomputed here from ``LayerGroup.pages_read`` (what a
decoder at the final position reads) restricted to the pages wholly below ``ready``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvlend.core.layout import (
    BufferDesc,
    LayerIdentity,
    LayerKind,
    MemoryKind,
    MemoryRegion,
    PageLayout,
    Role,
    RowSelection,
)
from kvlend.core.lender import Lease, LeaseLimits, Lender, LendOptions
from kvlend.core.tracker import DeliveryTracker
from kvlend.errors import (
    KvlendError,
    LeaseError,
    LeaseExpired,
    LeaseUnknown,
    PageRangeError,
    QuotaExceeded,
    TrackerError,
)
from tests.support.profiles import examples
from tests.support.reference import reference_bound

pytestmark = pytest.mark.unit

ATT, REC = LayerKind.ATTENTION, LayerKind.RECURRENT
ALL = RowSelection.all()


# ------------------------------------------------------------------ helpers
def layout(groups=("full", "swa", "ssm"), tpp=4, window=8, sinks=1, pages=64, states=8, host=False,
           kept=4096) -> PageLayout:
    """Any mix of a full group, a windowed group with sinks and a recurrent group (STATE + CONV);
    ``host`` adds a HOST-tier layer to the full group (same page table)."""
    dev = MemoryKind.DEVICE
    regions, buffers = [], []
    if "full" in groups:
        regions.append(MemoryRegion("full", dev, 0, 256 * pages, 256, pages))
        buffers += [BufferDesc("L0.K", "full", 0, 128, LayerIdentity(0, ATT, Role.K), group="full"),
                    BufferDesc("L0.V", "full", 128, 128, LayerIdentity(0, ATT, Role.V), group="full")]
    if "swa" in groups:
        regions.append(MemoryRegion("swa", dev, 0, 256 * pages, 256, pages))
        buffers += [BufferDesc(f"L1.{r.value}", "swa", i * 128, 128, LayerIdentity(1, ATT, r), group="swa",
                               window=window, sinks=sinks) for i, r in enumerate((Role.K, Role.V))]
    if "ssm" in groups:
        regions.append(MemoryRegion("ssm", dev, 0, 256 * states, 256, states))
        buffers += [BufferDesc("L2.state", "ssm", 0, 192, LayerIdentity(2, REC, Role.STATE), group="ssm"),
                    BufferDesc("L2.conv", "ssm", 192, 64, LayerIdentity(2, REC, Role.CONV), group="ssm")]
    if host:
        regions.append(MemoryRegion("host", MemoryKind.HOST, 0, 256 * pages, 256, pages))
        buffers += [BufferDesc("L3.KV", "host", 0, 256, LayerIdentity(3, ATT, Role.KV), group="full")]
    return PageLayout(tuple(regions), tuple(buffers), tokens_per_page=tpp, kept_window=kept, dtype="bfloat16")


def ids():
    counter = itertools.count(1)
    return lambda n: next(counter).to_bytes(n, "big")


def held(lender: Lender) -> dict[str, list[int]]:
    return {r.name: lender.locks.refcounts(r.name).tolist() for r in lender.layout.regions}


def zero(lender: Lender) -> bool:
    return all(not any(v) for v in held(lender).values())


def lent_groups(lay: PageLayout, sel: RowSelection) -> set[str]:
    names = {b.name for b in lay.selected_buffers(sel)}
    return {g for g, grp in lay.groups.items() if any(b.name in names for b in grp.buffers)}


def expected_rows(lay: PageLayout, group: str, n: int, ready: int) -> list[int]:
    """Rows of ``group`` a lease at ``ready`` of ``n`` tokens holds: what a decoder at ``n`` reads,
    complete pages only (``(p + 1) * tpp <= ready``), recurrent state only once final."""
    g, tpp = lay.groups[group], lay.tokens_per_page
    rows = g.pages_read(n, tpp).tolist()
    if ready == n:
        return rows
    if g.recurrent:
        return []
    return [p for p in rows if (p + 1) * tpp <= ready]


def expected_pages(lay, sel, n, ready, final) -> dict[str, tuple[list[int], list[int]]]:
    out = {}
    for g in lent_groups(lay, sel):
        rows = expected_rows(lay, g, n, ready)
        out[g] = (rows, [int(final[g][p]) for p in rows])
    return out


def pages_of(pages) -> dict[str, tuple[list[int], list[int]]]:
    return {g: (gp.token_pages.tolist(), gp.ordinals.tolist()) for g, gp in pages.items()}


def restrict(pages: dict, lay: PageLayout, n: int, ready: int) -> dict:
    """A one-shot (final) lease's rows restricted to the complete pages below ``ready``."""
    if ready == n:
        return pages
    tpp = lay.tokens_per_page
    out = {}
    for g, (rows, ords) in pages.items():
        keep = [] if lay.groups[g].recurrent else [i for i, p in enumerate(rows) if (p + 1) * tpp <= ready]
        out[g] = ([rows[i] for i in keep], [ords[i] for i in keep])
    return out


def expected_counts(lay: PageLayout, leases) -> dict[str, list[int]]:
    """Lock counts: per live lease, one lock per (region, slot) of a lent row (slots distinct per table)."""
    counts = {r.name: np.zeros(r.num_pages, dtype=np.int64) for r in lay.regions}
    for sel, pages in leases:
        names = {b.name for b in lay.selected_buffers(sel)}
        for g, (_, ords) in pages.items():
            for region in {b.region for b in lay.groups[g].buffers if b.name in names}:
                np.add.at(counts[region], np.unique(np.array(ords, dtype=np.int64)), 1)
    return {k: v.tolist() for k, v in counts.items()}


def final_tables(lay: PageLayout, n: int, perms: dict[str, list[int]], states: int = 8) -> dict[str, np.ndarray]:
    """The request's page tables once prefill is done: distinct slots per group."""
    tpp = lay.tokens_per_page
    out = {}
    for g, grp in lay.groups.items():
        if grp.recurrent:
            out[g] = np.array([perms[g][0] % states])
        else:
            out[g] = np.array(perms[g][:-(-n // tpp)], dtype=np.int64)
    return out


def table_at(lay: PageLayout, final: dict, n: int, ready: int, junk: int = -1) -> dict[str, np.ndarray]:
    """The page table as prefill has it at ``ready``: rows not yet complete hold ``junk``
    (-1 or an out-of-range slot; the lender must neither lend nor range check them), and so do
    a windowed group's stale rows (outside what a decoder at ``n`` reads) and, until final, the
    recurrent state."""
    tpp = lay.tokens_per_page
    out = {}
    for g, grp in lay.groups.items():
        t = final[g].copy()
        if grp.recurrent:
            if ready < n:
                t[:] = junk
        else:
            keep = np.zeros(t.size, dtype=bool)
            keep[grp.pages_read(n, tpp)] = True
            if ready < n:
                keep[ready // tpp:] = False
            t[~keep] = junk
        out[g] = t
    return out


def snapshot(lender: Lender, lease_id: bytes, now: float, peers=(None, "d0", "d1")):
    lease = lender.get(lease_id, now)
    return (held(lender), lease, pages_of(lease.pages), lease.ready, lease.final,
            {p: lender.usage(p) for p in peers}, lender.active_leases, lender.next_expiry())


def same(before, after) -> None:
    assert after[0] == before[0], "lock counts changed"
    assert after[1] is before[1], "the lease was replaced"
    assert after[2:] == before[2:]


# ------------------------------------------------------------- lend(ready)
def test_partial_lend_lends_only_complete_pages_the_final_reader_needs():
    lay = layout(tpp=32, window=64, sinks=1)
    lender = Lender(lay, new_id=ids())
    final = {"full": np.arange(6), "swa": np.arange(6) + 10, "ssm": np.array([3])}
    t = table_at(lay, final, 161, 100)  # pages 0-2 complete, 3 partial
    assert t["full"].tolist() == [0, 1, 2, -1, -1, -1]
    assert t["swa"].tolist() == [10, -1, -1, -1, -1, -1]  # window at 161: sink 0 + pages 3, 4, 5
    assert t["ssm"].tolist() == [-1]
    lease = lender.lend("r", 161, t, ALL, now=0, ttl=10, peer="d0", options=LendOptions(ready=100))
    assert (lease.ready, lease.final, lease.num_tokens) == (100, False, 161)
    assert pages_of(lease.pages) == {"full": ([0, 1, 2], [0, 1, 2]), "swa": ([0], [10]), "ssm": ([], [])}
    assert lease.num_pages == 4 and lender.usage("d0") == (1, 4)
    assert np.flatnonzero(lender.locks.refcounts("full")).tolist() == [0, 1, 2]
    assert np.flatnonzero(lender.locks.refcounts("swa")).tolist() == [10]
    assert lender.locks.locked_pages("ssm") == 0
    # pages 1 and 2 of the windowed group are complete but outside the final window: never lent
    full_t = {**t, "swa": np.arange(6) + 10}
    other = lender.lend("r2", 161, full_t, ALL, now=0, ttl=10, options=LendOptions(ready=100))
    assert pages_of(other.pages)["swa"] == ([0], [10])
    assert lender.locks.refcounts("swa")[[11, 12]].tolist() == [0, 0]


def test_ready_exactly_at_a_page_boundary_includes_that_page():
    lay = layout(["full"], tpp=4)
    lender = Lender(lay)
    final = {"full": np.arange(5) + 7}
    assert pages_of(lender.lend("a", 17, table_at(lay, final, 17, 8), ALL, 0, 1,
                                options=LendOptions(ready=8)).pages) == \
        {"full": ([0, 1], [7, 8])}
    assert pages_of(lender.lend("b", 17, table_at(lay, final, 17, 7), ALL, 0, 1,
                                options=LendOptions(ready=7)).pages) == \
        {"full": ([0], [7])}
    assert pages_of(lender.lend("c", 17, table_at(lay, final, 17, 16), ALL, 0, 1,
                                options=LendOptions(ready=16)).pages) == \
        {"full": ([0, 1, 2, 3], [7, 8, 9, 10])}
    # the last (partial) page only once final
    lease = lender.lend("d", 17, final, ALL, 0, 1, options=LendOptions(ready=17))
    assert lease.final and pages_of(lease.pages) == {"full": ([0, 1, 2, 3, 4], [7, 8, 9, 10, 11])}


def test_ready_zero_lends_nothing_but_creates_the_lease():
    lay = layout()
    lender = Lender(lay, new_id=ids())
    final = final_tables(lay, 30, {g: list(range(64)) for g in lay.groups})
    junk = {g: np.full(t.size, -1) for g, t in final.items()}
    lease = lender.lend("r", 30, junk, ALL, now=5, ttl=10, peer="d1", options=LendOptions(ready=0))
    assert isinstance(lease, Lease) and lease.ready == 0 and not lease.final
    assert lease.num_pages == 0 and set(lease.pages) == {"full", "swa", "ssm"}
    assert all(len(gp) == 0 for gp in lease.pages.values())
    assert zero(lender) and lender.active_leases == 1 and lender.usage("d1") == (1, 0)
    assert lender.check_read(lease.id, "d1", 6) is lease
    # the one live lease per (request, peer) rule holds for a progressive lease too
    with pytest.raises(LeaseError, match="already has live lease"):
        lender.lend("r", 30, junk, ALL, now=6, ttl=10, peer="d1", options=LendOptions(ready=0))
    # straight to final: what a one-shot lend gives
    grown, added = lender.extend(lease.id, 30, final, now=7)
    oneshot = Lender(lay).lend("r", 30, final, ALL, now=0, ttl=1)
    assert grown.final and pages_of(grown.pages) == pages_of(oneshot.pages) == pages_of(added)
    assert held(lender) == expected_counts(lay, [(ALL, pages_of(oneshot.pages))])


def test_default_ready_is_final():
    lay = layout()
    lender = Lender(lay)
    final = final_tables(lay, 21, {g: list(range(64)) for g in lay.groups})
    a = lender.lend("a", 21, final, ALL, 0, 1)
    b = lender.lend("b", 21, final, ALL, 0, 1, options=LendOptions(ready=21))
    assert a.final and b.final and a.ready == b.ready == 21
    assert pages_of(a.pages) == pages_of(b.pages)
    for lease in (a, b):
        with pytest.raises(LeaseError, match="is final"):
            lender.extend(lease.id, 21, final, now=0)


@pytest.mark.parametrize("ready", [-1, 31, True, 1.5, "3"])
def test_lend_refuses_a_bad_ready_and_creates_nothing(ready):
    lay = layout()
    lender = Lender(lay)
    final = final_tables(lay, 30, {g: list(range(64)) for g in lay.groups})
    with pytest.raises(PageRangeError, match="ready"):
        lender.lend("r", 30, final, ALL, 0, 1, peer="d0", options=LendOptions(ready=ready))
    assert zero(lender) and lender.active_leases == 0 and lender.usage("d0") == (0, 0)


def test_lend_with_ready_still_range_checks_only_the_rows_it_lends():
    lay = layout(["full", "swa"], tpp=4, window=8, sinks=1)
    lender = Lender(lay)
    t = {"full": np.array([0, 1, 99, -1, -5]), "swa": np.array([5, -1, -1, -1, -1])}
    lease = lender.lend("r", 20, t, ALL, 0, 1, options=LendOptions(ready=8))  # rows 2.. not complete: never checked
    assert pages_of(lease.pages) == {"full": ([0, 1], [0, 1]), "swa": ([0], [5])}
    with pytest.raises(PageRangeError, match="token page 2 is in slot 99"):
        lender.lend("s", 20, t, ALL, 0, 1, options=LendOptions(ready=12))
    assert lender.active_leases == 1


# ------------------------------------------------------------------ extend
def test_extend_step_by_step_hybrid_example():
    lay = layout(tpp=32, window=64, sinks=1)
    lender = Lender(lay, new_id=ids())
    final = {"full": np.arange(6) + 20, "swa": np.arange(6) + 10, "ssm": np.array([3])}
    lease = lender.lend("r", 161, table_at(lay, final, 161, 40), ALL, 0, 10, peer="d0", options=LendOptions(ready=40))
    assert pages_of(lease.pages) == {"full": ([0], [20]), "swa": ([0], [10]), "ssm": ([], [])}
    lease, added = lender.extend(lease.id, 64, table_at(lay, final, 161, 64), now=1)
    assert pages_of(added) == {"full": ([1], [21])}  # empty groups left out
    lease, added = lender.extend(lease.id, 65, table_at(lay, final, 161, 65), now=1)
    assert added == {} and lease.ready == 65  # no page completed: the lease still moves on
    lease, added = lender.extend(lease.id, 160, table_at(lay, final, 161, 160), now=2)
    assert pages_of(added) == {"full": ([2, 3, 4], [22, 23, 24]), "swa": ([3, 4], [13, 14])}
    assert not lease.final and pages_of(lease.pages)["ssm"] == ([], [])
    lease, added = lender.extend(lease.id, 161, final, now=3)
    assert lease.final
    assert pages_of(added) == {"full": ([5], [25]), "swa": ([5], [15]), "ssm": ([0], [3])}
    assert pages_of(lease.pages) == pages_of(Lender(lay).lend("x", 161, final, ALL, 0, 1).pages)
    assert lender.usage("d0") == (1, 11) and lease.num_pages == 11
    assert lender.get(lease.id, 3) is lease
    assert (lease.expires_at, lease.lent_at, lease.ttl) == (10, 0, 10)  # extend does not renew
    with pytest.raises(LeaseError, match="is final"):
        lender.extend(lease.id, 161, final, now=3)
    lender.release(lease.id)
    assert zero(lender) and lender.usage("d0") == (0, 0)


_GROUPS = [("full",), ("swa",), ("ssm",), ("full", "swa"), ("swa", "ssm"), ("full", "swa", "ssm")]
_BAD = ["none", "stale_ready", "same_ready", "past_end", "moved", "unpaged", "new_out_of_range", "new_unpaged",
        "short_table", "missing_group", "extra_group", "quota", "expired", "bad_limits"]


@st.composite
def progressions(draw):
    groups = draw(st.sampled_from(_GROUPS))
    tpp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    lay = layout(groups, tpp=tpp, window=draw(st.integers(-1, 40)), sinks=draw(st.integers(0, 3)))
    n = draw(st.integers(1, 60))
    names = [b.name for b in lay.buffers]
    sel = draw(st.one_of(st.just(ALL), st.sets(st.sampled_from(names), min_size=1).map(
        lambda s: RowSelection.named(*sorted(s)))))
    readies = sorted(set(draw(st.lists(st.integers(0, n), min_size=1, max_size=10))) | {n})
    perms = {g: draw(st.permutations(range(64))) for g in lay.groups}
    junk = draw(st.sampled_from([-1, 64, 10 ** 9]))
    bad = draw(st.lists(st.sampled_from(_BAD), min_size=len(readies), max_size=len(readies)))
    peer = draw(st.sampled_from([None, "d0"]))
    end = draw(st.sampled_from(["release", "expire", "release_peer"]))
    return lay, n, sel, readies, perms, junk, bad, peer, end


def _bad_extend(lender, lay, lease, kind, n, nxt, final, junk, now):
    """One invalid extend (or None if ``kind`` does not apply here): (call, exception type)."""
    good = table_at(lay, final, n, nxt, junk)
    lent_rows = [(g, p) for g, gp in lease.pages.items() for p in gp.token_pages.tolist()]
    new_rows = [(g, p) for g, (rows, _) in expected_pages(lay, lease.selection, n, nxt, final).items()
                for p in rows if p not in lease.pages[g].token_pages.tolist()]
    call = lambda ready=nxt, pages=good, at=now, limits=None: (  # noqa: E731
        lambda: lender.extend(lease.id, ready, pages, at, **({} if limits is None else {"limits": limits})))
    if kind == "stale_ready" and lease.ready > 0:
        return call(ready=lease.ready - 1), PageRangeError
    if kind == "same_ready":
        return call(ready=lease.ready), PageRangeError
    if kind == "past_end":
        return call(ready=n + 1), PageRangeError
    if kind in ("moved", "unpaged") and lent_rows:
        g, p = lent_rows[len(lent_rows) // 2]
        t = {k: v.copy() for k, v in good.items()}
        t[g][p] = -1 if kind == "unpaged" else (t[g][p] + 1) % 64
        return call(pages=t), LeaseError
    if kind in ("new_out_of_range", "new_unpaged") and new_rows:
        g, p = new_rows[-1]
        t = {k: v.copy() for k, v in good.items()}
        region = min(lay.region_map[b.region].num_pages for b in lay.groups[g].buffers)
        t[g][p] = -1 if kind == "new_unpaged" else region
        return call(pages=t), PageRangeError
    if kind == "short_table":
        g = sorted(lay.groups)[0]
        t = {**good, g: good[g][:-1]} if good[g].size > 1 else {**good, g: np.zeros(2, dtype=np.int64)}
        return call(pages=t), PageRangeError
    if kind == "missing_group":
        return call(pages={k: v for k, v in good.items() if k != sorted(good)[0]}), PageRangeError
    if kind == "extra_group":
        return call(pages={**good, "nope": np.zeros(1, dtype=np.int64)}), PageRangeError
    if kind == "quota" and lease.peer is not None and new_rows:
        have = lender.usage(lease.peer)[1]
        return call(limits=LeaseLimits(max_locked_pages_per_peer=have + len(new_rows) - 1)), QuotaExceeded
    if kind == "expired":
        return call(at=lease.expires_at + 0.5), LeaseExpired
    if kind == "bad_limits":
        return call(limits=object()), LeaseError
    return None


@settings(max_examples=examples(200), deadline=None)
@given(progressions())
def test_extend_grows_the_lease_to_exactly_what_a_one_shot_lend_lends(case):
    lay, n, sel, readies, perms, junk, bad, peer, end = case
    final = final_tables(lay, n, perms)
    oneshot = pages_of(Lender(lay).lend("x", n, final, sel, 0, 1).pages)
    lender = Lender(lay, new_id=ids())
    now = 0.0
    lease = lender.lend("r", n, table_at(lay, final, n, readies[0], junk), sel, now, ttl=100, peer=peer,
                        options=LendOptions(ready=readies[0]))
    stale = {g: sorted(set(range(final[g].size)) - set(grp.pages_read(n, lay.tokens_per_page).tolist()))
             for g, grp in lay.groups.items() if not grp.recurrent}
    steps = [(readies[0], None)]
    for i, nxt in enumerate(readies[1:] + [None]):
        r = lease.ready
        assert r == steps[-1][0] and lease.final == (r == n)
        got = pages_of(lease.pages)
        assert got == expected_pages(lay, sel, n, r, final) == restrict(oneshot, lay, n, r)
        assert lease.num_pages == sum(len(rows) for rows, _ in got.values())
        assert held(lender) == expected_counts(lay, [(sel, got)])
        assert lender.usage(peer) == (1, lease.num_pages)
        for g, rows in stale.items():  # a windowed group's pages outside the final window: never locked
            if g in got:
                assert not set(rows) & set(got[g][0])
                for region in {b.region for b in lay.groups[g].buffers}:
                    assert not lender.locks.refcounts(region)[final[g][rows]].any()
        for g, grp in lay.groups.items():  # recurrent state: only in the final lease
            if grp.recurrent and g in got:
                assert (got[g][0] == [0]) == lease.final
        if nxt is None:
            break
        # an invalid extend first: refused with the right error, nothing changed
        attempt = _bad_extend(lender, lay, lease, bad[i], n, nxt, final, junk, now)
        if attempt is not None:
            before = snapshot(lender, lease.id, now)
            fn, exc = attempt
            with pytest.raises(exc) as info:
                fn()
            assert isinstance(info.value, KvlendError)
            same(before, snapshot(lender, lease.id, now))
        now += 1
        grown, added = lender.extend(lease.id, nxt, table_at(lay, final, n, nxt, junk), now)
        want_before, want_after = expected_pages(lay, sel, n, r, final), expected_pages(lay, sel, n, nxt, final)
        diff = {}
        for g in want_after:
            keep = [i for i, p in enumerate(want_after[g][0]) if p not in want_before[g][0]]
            if keep:
                diff[g] = ([want_after[g][0][i] for i in keep], [want_after[g][1][i] for i in keep])
        assert pages_of(added) == diff
        assert all(len(gp) for gp in added.values())
        for g, grp in lay.groups.items():  # recurrent state arrives in the final extension, and only there
            if grp.recurrent and g in want_after:
                assert (g in added) == (nxt == n)
        assert grown.id == lease.id and grown.ready == nxt and lender.get(lease.id, now) is grown
        assert (grown.expires_at, grown.peer, grown.selection, grown.request) == \
            (lease.expires_at, lease.peer, lease.selection, lease.request)
        lease = grown
        steps.append((nxt, added))
    assert lease.final and pages_of(lease.pages) == oneshot
    # a final lease cannot grow
    before = snapshot(lender, lease.id, now)
    with pytest.raises(LeaseError, match="is final"):
        lender.extend(lease.id, n, final, now)
    same(before, snapshot(lender, lease.id, now))
    # however many extensions, ending the lease leaves every count at zero
    if end == "release":
        assert lender.release(lease.id) is lease and lender.release(lease.id) is None
        err = LeaseUnknown
    elif end == "expire":
        assert lender.expire(lease.expires_at + 1) == [lease]
        err = LeaseExpired
    else:
        assert lender.release_peer(peer) == [lease]
        err = LeaseUnknown
    assert zero(lender) and lender.active_leases == 0 and lender.usage(peer) == (0, 0)
    with pytest.raises(err):
        lender.extend(lease.id, n, final, now)
    assert zero(lender)


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(1, 60), st.sampled_from([1, 2, 4]), st.integers(0, 6), st.booleans())
def test_ending_a_lease_after_k_extensions_unlocks_everything(n, tpp, k, expire):
    lay = layout(tpp=tpp, window=6, sinks=1)
    final = final_tables(lay, n, {g: list(range(64)) for g in lay.groups})
    lender = Lender(lay, new_id=ids())
    readies = sorted({0} | {min(n - 1, (i * n) // (k + 1)) for i in range(1, k + 1)})
    lease = lender.lend("r", n, table_at(lay, final, n, readies[0]), ALL, 0, 5, peer="d0",
                        options=LendOptions(ready=readies[0]))
    for r in readies[1:]:
        if r > lease.ready:
            lease, _ = lender.extend(lease.id, r, table_at(lay, final, n, r), 0)
    other = lender.lend("o", n, final, ALL, 0, 50)  # an overlapping lease stays locked
    only_other = expected_counts(lay, [(ALL, pages_of(other.pages))])
    if expire:
        assert lender.expire(6) == [lease]
    else:
        assert lender.release(lease.id) is lease
    assert held(lender) == only_other and lender.usage("d0") == (0, 0)
    lender.release(other.id)
    assert zero(lender)


def test_extend_errors_on_ended_or_unknown_leases():
    lay = layout()
    lender = Lender(lay, new_id=ids())
    final = final_tables(lay, 40, {g: list(range(64)) for g in lay.groups})
    a = lender.lend("a", 40, table_at(lay, final, 40, 8), ALL, 0, 5, options=LendOptions(ready=8))
    b = lender.lend("b", 40, table_at(lay, final, 40, 8), ALL, 0, 5, options=LendOptions(ready=8))
    lender.release(a.id)
    with pytest.raises(LeaseUnknown, match="released"):
        lender.extend(a.id, 16, table_at(lay, final, 40, 16), 1)
    with pytest.raises(LeaseExpired):  # past its expiry, not yet swept
        lender.extend(b.id, 16, table_at(lay, final, 40, 16), 5.5)
    assert lender.get(b.id, 5) is b
    assert [x.id for x in lender.expire(6)] == [b.id]
    with pytest.raises(LeaseExpired):  # swept
        lender.extend(b.id, 16, table_at(lay, final, 40, 16), 6)
    with pytest.raises(LeaseUnknown, match="never granted"):
        lender.extend(b"\x99" * 16, 16, table_at(lay, final, 40, 16), 6)
    with pytest.raises(LeaseUnknown):
        lender.extend(b"short", 16, table_at(lay, final, 40, 16), 6)
    with pytest.raises(LeaseUnknown):
        lender.extend("not bytes", 16, table_at(lay, final, 40, 16), 6)
    assert zero(lender) and lender.active_leases == 0


@pytest.mark.parametrize("ready", [8, 7, 41, -1, True, 16.0, "16"])
def test_extend_refuses_a_ready_that_does_not_move_forward_within_the_request(ready):
    lay = layout()
    lender = Lender(lay, new_id=ids())
    final = final_tables(lay, 40, {g: list(range(64)) for g in lay.groups})
    lease = lender.lend("a", 40, table_at(lay, final, 40, 8), ALL, 0, 5, peer="d0", options=LendOptions(ready=8))
    before = snapshot(lender, lease.id, 0)
    with pytest.raises(PageRangeError, match="ready"):
        lender.extend(lease.id, ready, final, 0)
    same(before, snapshot(lender, lease.id, 0))


def test_extend_with_ready_none_means_final():
    lay = layout()
    lender = Lender(lay, new_id=ids())
    final = final_tables(lay, 40, {g: list(range(64)) for g in lay.groups})
    lease = lender.lend("a", 40, table_at(lay, final, 40, 8), ALL, 0, 5, options=LendOptions(ready=8))
    lease, _ = lender.extend(lease.id, None, final, 0)  # as ``lend``'s default: ``_ready`` maps None to final
    assert lease.final and pages_of(lease.pages) == pages_of(Lender(lay).lend("x", 40, final, ALL, 0, 1).pages)


def test_extend_refuses_a_lent_row_moved_to_another_slot_and_changes_nothing():
    lay = layout(tpp=4, window=8, sinks=1)
    lender = Lender(lay, new_id=ids())
    final = final_tables(lay, 40, {g: list(range(64)) for g in lay.groups})
    lease = lender.lend("a", 40, table_at(lay, final, 40, 12), ALL, 0, 5, peer="d0", options=LendOptions(ready=12))
    assert pages_of(lease.pages)["full"] == ([0, 1, 2], [0, 1, 2])
    before = snapshot(lender, lease.id, 0)
    t = table_at(lay, final, 40, 24)
    t["full"][1] = 50  # the cache manager moved page 1: the reader would read the wrong slot
    with pytest.raises(LeaseError, match="token page 1 was lent in slot 1, the table now says 50"):
        lender.extend(lease.id, 24, t, 0)
    same(before, snapshot(lender, lease.id, 0))
    t["full"][1] = -1
    with pytest.raises(LeaseError, match="token page 1 was lent in slot 1"):
        lender.extend(lease.id, 24, t, 0)
    same(before, snapshot(lender, lease.id, 0))
    # the swa sink page lent at 12 is moved: refused as well, even though the full group is fine
    t = table_at(lay, final, 40, 40)
    t["swa"][0] = 63
    with pytest.raises(LeaseError, match="pages\\['swa'\\]"):
        lender.extend(lease.id, 40, t, 0)
    same(before, snapshot(lender, lease.id, 0))
    # the real table still works afterwards
    lease, added = lender.extend(lease.id, 40, final, 0)
    assert lease.final and pages_of(lease.pages) == pages_of(Lender(lay).lend("x", 40, final, ALL, 0, 1).pages)


def test_extend_refuses_a_new_row_out_of_range_and_changes_nothing():
    lay = layout(["full", "swa"], tpp=4, window=8, sinks=1, pages=16)
    lender = Lender(lay, new_id=ids())
    final = final_tables(lay, 40, {g: list(range(16)) for g in lay.groups})
    lease = lender.lend("a", 40, table_at(lay, final, 40, 12), ALL, 0, 5, options=LendOptions(ready=12))
    before = snapshot(lender, lease.id, 0)
    for bad in (16, -1, -7, 2 ** 40):
        t = table_at(lay, final, 40, 24)
        t["full"][4] = bad
        with pytest.raises(PageRangeError, match="token page 4"):
            lender.extend(lease.id, 24, t, 0)
        same(before, snapshot(lender, lease.id, 0))
    t = table_at(lay, final, 40, 40)
    t["swa"][9] = 16  # the last window page of the final reader
    with pytest.raises(PageRangeError, match="pages\\['swa'\\]: token page 9 is in slot 16"):
        lender.extend(lease.id, 40, t, 0)
    same(before, snapshot(lender, lease.id, 0))
    with pytest.raises(PageRangeError):
        lender.extend(lease.id, 24, {"full": [[0]], "swa": table_at(lay, final, 40, 24)["swa"]}, 0)
    with pytest.raises(PageRangeError):
        lender.extend(lease.id, 24, [1, 2], 0)
    same(before, snapshot(lender, lease.id, 0))


def test_extend_checks_the_peer_page_quota_before_anything_changes():
    lay = layout(["full"], tpp=4)
    lender = Lender(lay, new_id=ids())
    final = final_tables(lay, 40, {"full": list(range(64))})
    other = lender.lend("o", 12, final_tables(lay, 12, {"full": list(range(20, 64))}), ALL, 0, 50, peer="d0")
    lease = lender.lend("a", 40, table_at(lay, final, 40, 8), ALL, 0, 50, peer="d0", options=LendOptions(ready=8))
    assert lender.usage("d0") == (2, 3 + 2)
    before = snapshot(lender, lease.id, 0)
    with pytest.raises(QuotaExceeded) as info:
        lender.extend(lease.id, 24, table_at(lay, final, 40, 24), 0, limits=LeaseLimits(max_locked_pages_per_peer=8))
    assert (info.value.limit, info.value.value, info.value.cap) == ("max_locked_pages_per_peer", 9, 8)
    same(before, snapshot(lender, lease.id, 0))
    # exactly at the cap: fine; a step that adds no page needs no quota
    lease, added = lender.extend(lease.id, 20, table_at(lay, final, 40, 20), 0,
                                 limits=LeaseLimits(max_locked_pages_per_peer=8))
    assert lender.usage("d0") == (2, 8) and pages_of(added) == {"full": ([2, 3, 4], [2, 3, 4])}
    lease, added = lender.extend(lease.id, 23, table_at(lay, final, 40, 23), 0,
                                 limits=LeaseLimits(max_locked_pages_per_peer=8))
    assert added == {} and lease.ready == 23
    # other limits do not apply to a growth (a lease count, a lifetime cap)
    lease, _ = lender.extend(lease.id, 24, table_at(lay, final, 40, 24), 0,
                             limits=LeaseLimits(max_leases_per_peer=1, max_lease_lifetime=1, max_num_tokens=1))
    # a ticket (peer None) has no page quota
    ticket = lender.lend("t", 40, table_at(lay, final, 40, 4), ALL, 0, 50, options=LendOptions(ready=4))
    ticket, _ = lender.extend(ticket.id, 40, final, 0, limits=LeaseLimits(max_locked_pages_per_peer=0))
    assert lender.usage(None) == (1, 10)
    lender.release(other.id)
    lender.release(lease.id)
    lender.release(ticket.id)
    assert zero(lender)


def test_extend_quota_ignores_a_peers_expired_leases_not_yet_swept_like_lend_does():
    """Module doc of lender.py: "Leases past their expiry that ``expire`` has not yet ended do not
    count against a peer's quota."  ``lend`` honours it; ``extend`` should too."""
    lay = layout(["full"], tpp=4)
    lender = Lender(lay, new_id=ids())
    final = final_tables(lay, 40, {"full": list(range(64))})
    old = lender.lend("old", 20, final_tables(lay, 20, {"full": list(range(40, 64))}), ALL, 0, 1, peer="d0")
    lease = lender.lend("a", 40, table_at(lay, final, 40, 8), ALL, 0, 50, peer="d0", options=LendOptions(ready=8))
    assert lender.usage("d0") == (2, 5 + 2)
    limits = LeaseLimits(max_locked_pages_per_peer=6)
    now = 2.0  # ``old`` is past its expiry (1.0) but nobody called expire yet
    # a fresh lend of 4 pages is accepted: 2 live + 4 = 6 <= 6
    probe = lender.lend("probe", 16, final_tables(lay, 16, {"full": list(range(30, 64))}), ALL, now, 50,
                        peer="d0", limits=limits)
    lender.release(probe.id)
    # growing the live lease by 4 pages (to the same 6 live pages) must be accepted as well
    lease, added = lender.extend(lease.id, 24, table_at(lay, final, 40, 24), now, limits=limits)
    assert pages_of(added) == {"full": ([2, 3, 4, 5], [2, 3, 4, 5])}
    assert old.id in {x.id for x in lender.expire(now)}


# ------------------------------------------------------------- many leases
_SEL_HOST = [RowSelection.named("L0.K", "L0.V", "L1.K", "L1.V", "L2.state", "L2.conv"),
             RowSelection.named("L3.KV", "L1.K"), RowSelection.named("L0.K", "L3.KV"), RowSelection.named("L2.conv"),
             RowSelection.named("L1.V")]
_KINDS = ["lend"] * 3 + ["extend"] * 4 + ["bad_extend", "release", "renew", "expire", "tick", "tick"]
# (kind, pick or request, peer, n, ready or step, selection, ttl or tick, seed); each kind reads what it needs
_op = st.tuples(st.sampled_from(_KINDS), st.integers(0, 20), st.sampled_from([None, "d0", "d1"]), st.integers(1, 60),
                st.integers(0, 60), st.integers(0, len(_SEL_HOST) - 1), st.integers(1, 12), st.integers(0, 2 ** 16))


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(_op, min_size=10, max_size=50))
def test_random_progressive_lifecycles_keep_locks_equal_to_the_sum_over_live_leases(ops):
    tpp, pages, states = 4, 16, 4
    lay = layout(tpp=tpp, window=8, sinks=1, pages=pages, states=states, host=True)
    lender = Lender(lay, new_id=ids())
    live: dict[bytes, dict] = {}  # the model: what each live lease should be
    ended: dict[bytes, type] = {}
    granted: list[bytes] = []
    now = 0.0
    for op in ops:
        kind = op[0]
        if kind == "lend":
            _, req, peer, n, ready, sel, ttl, seed = op
            req, ready, ttl = req % 4, ready % (n + 1), 1 + ttl
            rng = np.random.default_rng(seed)
            final = final_tables(lay, n, {g: rng.permutation(pages).tolist() for g in lay.groups}, states)
            args = (f"r{req}", n, table_at(lay, final, n, ready, junk=int(rng.choice([-1, 99]))), _SEL_HOST[sel],
                    now, ttl, peer)
            if any(m["request"] == f"r{req}" and m["peer"] == peer and now <= m["expires_at"] for m in live.values()):
                with pytest.raises(LeaseError, match="already has live lease"):
                    lender.lend(*args, options=LendOptions(ready=ready))
            else:
                lease = lender.lend(*args, options=LendOptions(ready=ready))
                live[lease.id] = dict(request=f"r{req}", peer=peer, n=n, ready=ready, final=final,
                                      sel=_SEL_HOST[sel], expires_at=now + ttl, ttl=ttl)
                granted.append(lease.id)
        elif kind in ("extend", "bad_extend") and granted:
            lease_id = granted[op[1] % len(granted)]
            m = live.get(lease_id)
            if m is None:
                with pytest.raises(ended[lease_id]):
                    lender.extend(lease_id, 1, {}, now)
            elif now > m["expires_at"]:
                with pytest.raises(LeaseExpired):
                    lender.extend(lease_id, m["n"], m["final"], now)
            elif m["ready"] == m["n"]:
                with pytest.raises(LeaseError, match="is final"):
                    lender.extend(lease_id, m["n"], m["final"], now)
            elif kind == "bad_extend":
                before = snapshot(lender, lease_id, now)
                with pytest.raises(PageRangeError):
                    lender.extend(lease_id, m["ready"] - op[4] % (m["ready"] + 1), m["final"], now)
                same(before, snapshot(lender, lease_id, now))
            else:
                nxt = m["ready"] + 1 + op[4] % (m["n"] - m["ready"])
                old = expected_pages(lay, m["sel"], m["n"], m["ready"], m["final"])
                lease, added = lender.extend(lease_id, nxt, table_at(lay, m["final"], m["n"], nxt), now)
                new = expected_pages(lay, m["sel"], m["n"], nxt, m["final"])
                assert {g: gp.token_pages.tolist() for g, gp in added.items()} == \
                    {g: [p for p in new[g][0] if p not in old[g][0]] for g in new
                     if [p for p in new[g][0] if p not in old[g][0]]}
                m["ready"] = nxt
                assert lease.ready == nxt and lease.final == (nxt == m["n"])
        elif kind == "release" and granted:
            lease_id = granted[op[1] % len(granted)]
            out = lender.release(lease_id)
            assert (out is not None) == (lease_id in live)
            if live.pop(lease_id, None) is not None:
                ended[lease_id] = LeaseUnknown
        elif kind == "renew" and granted:
            lease_id = granted[op[1] % len(granted)]
            m = live.get(lease_id)
            if m is not None and now <= m["expires_at"]:
                lender.renew(lease_id, now)
                m["expires_at"] = max(m["expires_at"], now + m["ttl"])
        elif kind == "expire":
            gone = lender.expire(now)
            assert {x.id for x in gone} == {i for i, m in live.items() if m["expires_at"] < now}
            for x in gone:
                assert x.ready == live[x.id]["ready"]  # the lease as last grown
                del live[x.id]
                ended[x.id] = LeaseExpired
        elif kind == "tick":
            now += 1 + op[6] % 3
        # invariants after every step
        assert lender.active_leases == len(live)
        want = {}
        for lease_id, m in live.items():
            want[lease_id] = expected_pages(lay, m["sel"], m["n"], m["ready"], m["final"])
            lease = lender.loans.all[lease_id].lease
            assert pages_of(lease.pages) == want[lease_id] and lease.ready == m["ready"]
        assert held(lender) == expected_counts(lay, [(live[i]["sel"], want[i]) for i in live])
        for who in (None, "d0", "d1"):
            mine = [i for i, m in live.items() if m["peer"] == who]
            assert lender.usage(who) == (len(mine), sum(len(r) for i in mine for r, _ in want[i].values()))
    for lease_id in list(live):
        lender.release(lease_id)
    assert zero(lender) and all(lender.usage(p) == (0, 0) for p in (None, "d0", "d1"))


# ----------------------------------------------------------------- tracker
def tracker_state(t: DeliveryTracker, request: str):
    r = t._requests[request]
    return ({g: m.tolist() for g, m in r.needed.items()}, {g: m.tolist() for g, m in r.delivered.items()},
            r.missing, t.complete(request), t.bound(request), t.pending(request), t.stats)


@st.composite
def growing(draw):
    groups = draw(st.sampled_from(_GROUPS))
    tpp = draw(st.sampled_from([1, 2, 4, 8]))
    lay = layout(groups, tpp=tpp, window=draw(st.integers(-1, 40)), sinks=draw(st.integers(0, 3)))
    n = draw(st.integers(1, 60))
    readies = sorted(set(draw(st.lists(st.integers(0, n), min_size=1, max_size=8))) | {n})
    ops = draw(st.lists(st.tuples(st.sampled_from(["extend", "post", "post", "done", "done", "fail"]),
                                  st.integers(0, 1000), st.integers(1, 4)), max_size=60))
    return lay, n, readies, ops


@settings(max_examples=examples(200), deadline=None)
@given(growing())
def test_tracker_follows_a_growing_lease(case):
    lay, n, readies, ops = case
    final = final_tables(lay, n, {g: list(range(64)) for g in lay.groups})
    lender = Lender(lay, new_id=ids())
    lease = lender.lend("r", n, table_at(lay, final, n, readies[0]), ALL, 0, 100, options=LendOptions(ready=readies[0]))
    tracker = DeliveryTracker(lay)
    tracker.begin("r", n, {g: gp.token_pages for g, gp in lease.pages.items()})
    needed = {g: set(gp.token_pages.tolist()) for g, gp in lease.pages.items()}
    delivered = {g: set() for g in lay.groups}
    in_flight: dict[int, dict[str, list[int]]] = {}
    posted = {g: set() for g in lay.groups}  # needed pages in flight or delivered
    steps = iter(readies[1:])
    chunk_ids = itertools.count()
    reads: dict = {}

    def check():
        assert tracker.complete("r") == all(needed[g] <= delivered[g] for g in lay.groups)
        assert tracker.bound("r") == reference_bound(lay, n, delivered, reads)
        assert set(tracker.pending("r")) == set(in_flight)

    def extend():
        nonlocal lease
        nxt = next(steps, None)
        if nxt is None:
            return False
        lease, added = lender.extend(lease.id, nxt, table_at(lay, final, n, nxt), 0)
        was = tracker.complete("r")
        tracker.need("r", {g: gp.token_pages for g, gp in added.items()})
        for g, gp in added.items():
            assert not needed[g] & set(gp.token_pages.tolist())
            needed[g] |= set(gp.token_pages.tolist())
        assert tracker.complete("r") == (was and not added)  # fresh pages are never delivered yet
        return True

    def post(pick, size):
        todo = sorted((g, p) for g in lay.groups for p in needed[g] - posted[g])
        if not todo:
            return False
        start = pick % len(todo)
        pages = {}
        for g, p in todo[start:start + size]:
            pages.setdefault(g, []).append(p)
            posted[g].add(p)
        cid = next(chunk_ids)
        tracker.post("r", cid, {g: np.array(ps[::-1]) for g, ps in pages.items()})  # any order
        in_flight[cid] = pages
        return True

    def settle(kind, pick):
        if not in_flight:
            return False
        cid = sorted(in_flight)[pick % len(in_flight)]
        pages = in_flight.pop(cid)
        if kind == "done":
            assert tracker.done("r", cid) is True
            for g, ps in pages.items():
                delivered[g] |= set(ps)
        else:
            assert tracker.fail("r", cid, KvlendError("lost")) is True
            for g, ps in pages.items():
                posted[g] -= set(ps)  # to be posted again
        return True

    check()
    for kind, pick, size in ops:
        if extend() if kind == "extend" else post(pick, size) if kind == "post" else settle(kind, pick):
            check()
    while extend():
        check()
    while post(0, 10 ** 6) or in_flight:
        while settle("done", 0):
            check()
    assert lease.final
    assert needed == {g: set(lay.groups[g].pages_read(n, lay.tokens_per_page).tolist()) for g in lay.groups}
    assert tracker.complete("r") and tracker.bound("r") == n
    tracker.finish("r")


def test_tracker_complete_flips_back_when_the_lease_grows():
    lay = layout(["full", "ssm"], tpp=4)
    t = DeliveryTracker(lay)
    t.begin("r", 10, {"full": [0], "ssm": []})
    assert not t.complete("r") and t.bound("r") == 0
    t.post("r", 1, {"full": [0]})
    assert t.done("r", 1)
    assert t.complete("r") and t.bound("r") == 0  # delivered all that is needed so far; no state yet
    t.need("r", {"full": [1]})
    assert not t.complete("r")
    t.need("r", {"full": [1, 0], "ssm": []})  # already needed / delivered: counted once
    t.post("r", 2, {"full": [1]})
    assert t.done("r", 2) and t.complete("r")
    t.need("r", {"full": [2], "ssm": [0]})
    assert not t.complete("r")
    t.post("r", 3, {"full": [2], "ssm": [0]})
    assert t.bound("r") == 0
    assert t.done("r", 3) and t.complete("r") and t.bound("r") == 10


def test_tracker_need_refuses_bad_pages_and_changes_nothing():
    lay = layout(["full", "swa", "ssm"], tpp=4, window=8, sinks=1)
    t = DeliveryTracker(lay)
    t.begin("r", 20, {"full": [0, 1], "swa": [0], "ssm": []})
    t.post("r", "a", {"full": [0]})
    t.done("r", "a")
    t.post("r", "b", {"swa": [0]})
    before = tracker_state(t, "r")
    bad = [
        {"nope": [0]},
        {"full": [2], "nope": [1]},  # a good group with a bad one: nothing added
        {"full": [5]},  # 20 tokens: pages 0-4
        {"full": [2], "swa": [-1]},
        {"ssm": [1]},
        {"full": [[2]]},
        {"full": [2.0]},
        {"full": ["x"]},
        [("full", [2])],
        None,
    ]
    for pages in bad:
        with pytest.raises(PageRangeError):
            t.need("r", pages)
        assert tracker_state(t, "r") == before, pages
    with pytest.raises(PageRangeError, match="token page 2 is not needed"):
        t.post("r", "c", {"full": [2]})
    with pytest.raises(TrackerError, match="not tracked"):
        t.need("other", {"full": [2]})
    t.need("r", {})  # nothing more: fine
    assert tracker_state(t, "r") == before
    t.abort("r")
    with pytest.raises(TrackerError, match="aborted"):
        t.need("r", {"full": [2]})
    assert t.done("r", "b") is False  # a read in flight lands after the abort: ignored
    t.finish("r")
    with pytest.raises(TrackerError, match="not tracked"):
        t.need("r", {"full": [2]})
