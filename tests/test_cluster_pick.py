"""ClusterView.compatible and pick (which prefills a decode may read from, and which one), degraded, the router.

Pure: no etcd, no network, no clock.  ``compatible`` is checked against an uncached ``negotiate``
and ``pick`` against a model.  Records: ``test_cluster_records.py``; the view: ``test_cluster_view.py``.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from kvlend.cluster import JOINED, UPDATED, ClusterView, RankRecord
from kvlend.cluster.records import layout_digest
from kvlend.core.negotiate import negotiate
from kvlend.errors import KvlendError, RegistryError
from tests.support.cluster_view import (
    BAD_LAYOUTS,
    BIGGER_PAGES,
    ENCODED_LAYOUTS,
    LAYOUTS,
    LOCAL,
    OTHER_DTYPE,
    SAME,
    WIDE_HEADS,
    key,
    negotiates,
    new_view,
    pools_layout,
    rec,
    view_of,
)
from tests.support.profiles import examples

pytestmark = pytest.mark.unit


def test_the_fixture_layouts_negotiate_as_the_tests_assume():
    assert SAME.layout_id == LOCAL.layout_id
    assert BIGGER_PAGES.layout_id != LOCAL.layout_id
    assert negotiate(LOCAL, SAME).kind == "identity"
    assert negotiate(LOCAL, BIGGER_PAGES).kind == "mapped"
    for bad in BAD_LAYOUTS:
        assert bad.layout_id != LOCAL.layout_id
        with pytest.raises(KvlendError):
            negotiate(LOCAL, bad)


# ------------------------------------------------------------------ compatible and pick
def test_compatible_keeps_negotiating_prefills_only():
    p_same, p_big = rec("p-same", layout=SAME), rec("p-big", layout=BIGGER_PAGES)
    p_wide, p_dtype = rec("p-wide", layout=WIDE_HEADS), rec("p-dtype", layout=OTHER_DTYPE)
    d_same = rec("d-same", role="decode", port=0, layout=SAME)
    r0 = rec("r0", role="router", port=0)
    view = view_of(p_wide, p_same, d_same, p_dtype, p_big, r0)
    assert view.compatible(LOCAL) == [p_big, p_same]
    assert view.compatible(LOCAL, "decode") == [d_same]
    assert view.compatible(WIDE_HEADS) == [p_wide]
    assert view.compatible(LOCAL) == [p_big, p_same]  # the cached answers are the same answers


def test_compatible_for_routers_is_empty_not_a_crash():
    view = view_of(rec("r0", role="router", port=0))
    assert view.compatible(LOCAL, "router") == []


def test_compatible_drops_a_rank_whose_new_layout_does_not_negotiate():
    view = new_view()
    view.put(1, key("p0"), rec("p0", layout=SAME).encode())
    assert [r.identity for r in view.compatible(LOCAL)] == ["p0"]
    assert view.pick(LOCAL).identity == "p0"
    for revision, layout in enumerate((OTHER_DTYPE, WIDE_HEADS), start=2):
        changes = view.put(revision, key("p0"), rec("p0", layout=layout).encode())
        assert [c.kind for c in changes] == [UPDATED]
        assert view.compatible(LOCAL) == []
        with pytest.raises(RegistryError, match="p0"):
            view.pick(LOCAL)
    view.put(9, key("p0"), rec("p0", layout=BIGGER_PAGES).encode())
    assert [r.identity for r in view.compatible(LOCAL)] == ["p0"]


def test_compatible_is_not_fooled_by_layouts_that_differ_only_in_what_the_id_leaves_out():
    # The layout id covers the page bytes, not the read windows; negotiate checks both, so the
    # cache must not answer for one layout with what it learned about another of the same id.
    local = pools_layout(windows={0: 64})
    wide = pools_layout(windows={0: 128})  # lends more than the reader reads: fine
    narrow = pools_layout(windows={0: 32})  # lends less: refused
    assert local.layout_id == wide.layout_id == narrow.layout_id
    assert negotiates(local, wide) and not negotiates(local, narrow)
    view = new_view()
    for layout in (wide, narrow):
        view.learn_layout(layout_digest(layout.encode()), layout.encode())
    view.put(1, key("p0"), rec("p0", layout=wide).encode())
    assert [r.identity for r in view.compatible(local)] == ["p0"]
    view.put(2, key("p0"), rec("p0", layout=narrow).encode())
    assert view.compatible(local) == []
    fresh = new_view()
    fresh.learn_layout(layout_digest(narrow.encode()), narrow.encode())
    fresh.put(1, key("p1"), rec("p1", layout=narrow).encode())
    assert fresh.compatible(local) == [] and fresh.get("p1") is not None


def test_pick_least_utilised_with_routed_and_ties_by_identity():
    a = rec("a", load=2, capacity=4)  # 0.5
    b = rec("b", load=1, capacity=4)  # 0.25
    c = rec("c", load=1, capacity=2)  # 0.5
    view = view_of(c, a, b)
    assert view.pick(LOCAL).identity == "b"
    assert view.pick(LOCAL, routed={"b": 1}).identity == "a"  # b at 0.5 too: a, b, c tie, a wins
    assert view.pick(LOCAL, routed={"b": 1, "a": 1}).identity == "b"  # a 0.75, b 0.5, c 0.5
    assert view.pick(LOCAL, exclude=["b"]).identity == "a"
    assert view.pick(LOCAL, exclude={"a", "b"}).identity == "c"
    assert view.pick(LOCAL, routed={"zzz": 100}).identity == "b"  # routing to unknown ranks counts for nothing
    assert view.pick(LOCAL, exclude=iter(["b"])).identity == "a"  # any iterable


def test_pick_never_sends_to_incompatible_prefills_or_other_roles():
    idle_wrong = rec("a-wrong", layout=OTHER_DTYPE, load=0, capacity=100)
    idle_decode = rec("a-decode", role="decode", port=0, layout=SAME, load=0, capacity=100)
    busy = rec("z-busy", layout=BIGGER_PAGES, load=99, capacity=1)
    view = view_of(idle_wrong, idle_decode, busy, rec("r0", role="router", port=0))
    assert view.pick(LOCAL) == busy


def test_pick_never_sends_to_an_unhealthy_prefill_and_says_why_none_is_left():
    sick = rec("a-sick", load=0, capacity=100, healthy=False)  # idle, but its backend could not reset safely
    view = view_of(sick, rec("b-busy", load=9, capacity=10))
    assert view.pick(LOCAL).identity == "b-busy"
    assert RankRecord.decode(sick.encode(), LAYOUTS).healthy is False  # it travels
    with pytest.raises(RegistryError, match=r"'a-sick \(unhealthy\)'"):
        view.pick(LOCAL, exclude=["b-busy"])


def test_pick_errors_name_the_live_prefills():
    empty = new_view()
    with pytest.raises(RegistryError, match="live prefills: none") as info:
        empty.pick(LOCAL)
    assert LOCAL.layout_id[:12] in str(info.value) and "excluded: none" in str(info.value)
    view = view_of(rec("p-wide", layout=WIDE_HEADS), rec("p-dtype", layout=OTHER_DTYPE),
                   rec("d0", role="decode", port=0, layout=SAME))
    with pytest.raises(RegistryError) as info:
        view.pick(LOCAL)
    assert "'p-dtype'" in str(info.value) and "'p-wide'" in str(info.value) and "'d0'" not in str(info.value)
    view = view_of(rec("p0"), rec("p1"))
    with pytest.raises(RegistryError) as info:
        view.pick(LOCAL, exclude=["p1", "p0"])
    message = str(info.value)
    assert "live prefills: ['p0', 'p1']" in message and "excluded: ['p0', 'p1']" in message


@st.composite
def clusters(draw):
    names = draw(st.lists(st.sampled_from([f"p{i}" for i in range(8)]), min_size=0, max_size=8, unique=True))
    records_, routed = [], {}
    for name in names:
        role = draw(st.sampled_from(("prefill", "prefill", "prefill", "decode")))
        records_.append(RankRecord(name, role, "h", 7000, layout=draw(st.sampled_from(ENCODED_LAYOUTS)),
                                   capacity=draw(st.integers(1, 8)), load=draw(st.integers(0, 20)),
                                   healthy=draw(st.sampled_from((True, True, True, False)))))
        if draw(st.booleans()):
            routed[name] = draw(st.integers(0, 10))
    exclude = draw(st.lists(st.sampled_from(names), unique=True)) if names else []
    return records_, routed, exclude


@settings(max_examples=examples(200), deadline=None)
@given(clusters(), st.permutations(range(8)))
def test_pick_matches_a_model(cluster, order):
    records_, routed, exclude = cluster
    view = new_view()
    items = [(key(r.identity), r.encode()) for r in records_]
    view.reset(3, [items[i] for i in order if i < len(items)])
    prefills = sorted((r for r in records_ if r.role == "prefill"), key=lambda r: r.identity)
    candidates = [r for r in prefills
                  if negotiates(LOCAL, r.page_layout) and r.identity not in exclude and r.healthy]
    assert view.compatible(LOCAL) == [r for r in prefills if negotiates(LOCAL, r.page_layout)]
    if not candidates:
        with pytest.raises(RegistryError) as info:
            view.pick(LOCAL, routed, exclude)
        message = str(info.value)
        known = [r.identity + ("" if r.healthy else " (unhealthy)") for r in prefills]
        assert (f"live prefills: {known}" if prefills else "live prefills: none") in message
        for name in exclude:
            assert repr(name) in message
        return
    expected = min(candidates, key=lambda r: (Fraction(r.load + routed.get(r.identity, 0), r.capacity), r.identity))
    got = view.pick(LOCAL, routed, exclude)
    assert got == expected
    assert got.identity not in exclude and got.role == "prefill"


# ------------------------------------------------------------------ degraded
def test_degraded_keeps_the_first_time_updates_why_and_keeps_the_ranks():
    view = view_of(rec("p0"), rec("d0", role="decode", port=0))
    assert not view.degraded and view.degraded_since is None and view.degraded_why == ""
    view.mark_degraded(10.0, "etcd: deadline exceeded")
    assert view.degraded and view.degraded_since == 10.0 and view.degraded_why == "etcd: deadline exceeded"
    view.mark_degraded(25.5, "etcd: connection refused")
    assert view.degraded_since == 10.0 and view.degraded_why == "etcd: connection refused"
    assert [r.identity for r in view.ranks()] == ["d0", "p0"]  # an outage is no evidence a rank died
    assert view.pick(LOCAL).identity == "p0" and view.get("d0") is not None
    assert view.put(2, key("p1"), rec("p1").encode())[0].kind == JOINED  # events still apply
    view.mark_healthy()
    assert not view.degraded and view.degraded_since is None and view.degraded_why == ""
    assert [r.identity for r in view.ranks()] == ["d0", "p0", "p1"]
    view.mark_healthy()  # idempotent
    assert not view.degraded
    view.mark_degraded(40.0, "again")
    assert view.degraded_since == 40.0 and view.degraded_why == "again"


def test_degraded_survives_a_reset():
    view = view_of(rec("p0"))
    view.mark_degraded(0.0, "down")  # 0.0 is a time like any other: still degraded
    assert view.degraded
    view.reset(5, [(key("p1"), rec("p1").encode())])
    assert view.degraded and view.degraded_since == 0.0
    assert [r.identity for r in view.ranks()] == ["p1"]


# ------------------------------------------------------------------ router
class ViewRegistry:
    """What ``Router`` reads of a ``Registry``: its TTL and ``pick``, here over a ``ClusterView`` fed by hand."""

    ttl = 2.0

    def __init__(self, view: ClusterView) -> None:
        self.view = view

    def pick(self, layout, routed=None, exclude=()):
        return self.view.pick(layout, routed, exclude)


def test_router_counts_what_it_routed_and_cools_down_a_failed_prefill():
    from kvlend.cluster import Router
    from kvlend.testing import FakeClock

    view = new_view()
    view.reset(1, [(key("p0"), rec("p0", load=0).encode()), (key("p1"), rec("p1", load=0).encode())])
    clock = FakeClock(100.0)
    router = Router(ViewRegistry(view), LOCAL, clock=clock)
    assert [router.pick().identity for _ in range(4)] == ["p0", "p1", "p0", "p1"]  # its own routed counts spread them
    assert router.routed == {"p0": 2, "p1": 2}
    for identity in ("p0", "p0", "p1", "p1"):
        router.finished(identity)
    assert router.routed == {}
    router.failed("p0")  # died: it fails at once, so it would look idle until its record leaves
    assert {router.pick().identity for _ in range(3)} == {"p1"}
    clock.advance(ViewRegistry.ttl)  # the cool-down (the registry's TTL) is over
    assert router.pick().identity == "p0"
    router.failed("p0"), router.failed("p1")
    with pytest.raises(RegistryError, match="excluded"):
        router.pick()
