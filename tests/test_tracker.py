"""DeliveryTracker: chunks in flight, done and failed, and the safe-resume bound."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvlend.core.layout import BufferDesc, LayerIdentity, LayerKind, MemoryKind, MemoryRegion, PageLayout, Role
from kvlend.core.tracker import DeliveryTracker, TrackerStats
from kvlend.errors import KvlendError, PageRangeError, TrackerError
from tests.support.profiles import examples
from tests.support.reference import reference_bound

pytestmark = pytest.mark.unit

ATT, REC = LayerKind.ATTENTION, LayerKind.RECURRENT


def layout(groups=("full", "swa", "ssm"), tpp=32, window=64, sinks=1, kept=4096, host=False) -> PageLayout:
    """Any mix of a full group, a windowed group with sinks and a recurrent group (STATE + CONV)."""
    dev = MemoryKind.DEVICE
    regions, buffers = [], []
    if "full" in groups:
        regions.append(MemoryRegion("full", dev, 0, 256 * 64, 256, 64))
        buffers += [BufferDesc("L0.K", "full", 0, 128, LayerIdentity(0, ATT, Role.K), group="full"),
                    BufferDesc("L0.V", "full", 128, 128, LayerIdentity(0, ATT, Role.V), group="full")]
    if "swa" in groups:
        regions.append(MemoryRegion("swa", dev, 0, 256 * 64, 256, 64))
        buffers += [BufferDesc(f"L1.{r.value}", "swa", i * 128, 128, LayerIdentity(1, ATT, r), group="swa",
                               window=window, sinks=sinks) for i, r in enumerate((Role.K, Role.V))]
    if "ssm" in groups:
        regions.append(MemoryRegion("ssm", dev, 0, 256 * 8, 256, 8))
        buffers += [BufferDesc("L2.state", "ssm", 0, 192, LayerIdentity(2, REC, Role.STATE), group="ssm"),
                    BufferDesc("L2.conv", "ssm", 192, 64, LayerIdentity(2, REC, Role.CONV), group="ssm")]
    if host:
        regions.append(MemoryRegion("host", MemoryKind.HOST, 0, 256 * 16, 256, 16))
        buffers += [BufferDesc("L3.KV", "host", 0, 256, LayerIdentity(3, ATT, Role.KV), group="full")]
    return PageLayout(tuple(regions), tuple(buffers), tokens_per_page=tpp, kept_window=kept, dtype="bfloat16")


def deliver(tracker, request, chunk_id, **pages):
    tracker.post(request, chunk_id, {g: np.array(p) for g, p in pages.items()})
    assert tracker.done(request, chunk_id) is True


# -------------------------------------------------------------------- bound
def test_full_attention_bound_is_the_delivered_prefix_and_a_gap_caps_it():
    t = DeliveryTracker(layout(["full"]))
    t.begin("r", 161)  # 6 pages, the last one partial
    assert t.bound("r") == 0
    deliver(t, "r", 1, full=[0, 1, 3, 5])
    assert t.bound("r") == 64  # page 2 missing
    deliver(t, "r", 2, full=[2])
    assert t.bound("r") == 128  # page 4 missing
    assert not t.complete("r")
    deliver(t, "r", 3, full=[4])
    assert t.bound("r") == 161 and t.complete("r")


def test_windowed_group_at_161_needs_only_its_sinks_and_window():
    t = DeliveryTracker(layout(["swa"], tpp=32, window=64, sinks=1))
    t.begin("r", 161)
    with pytest.raises(PageRangeError, match="token page 1 is not needed"):
        t.post("r", 0, {"swa": np.array([1])})
    deliver(t, "r", 1, swa=[3, 4, 5])
    assert t.bound("r") == 0  # the sink page is missing
    assert not t.complete("r")
    deliver(t, "r", 2, swa=[0])
    assert t.bound("r") == 161 and t.complete("r")  # pages 1 and 2 are never needed


def test_windowed_group_without_the_tail_resumes_where_its_window_is_whole():
    t = DeliveryTracker(layout(["swa"], tpp=32, window=64, sinks=1))
    t.begin("r", 161)
    deliver(t, "r", 1, swa=[0, 3, 4])
    # t=160 reads pages 0 (sink), 3, 4; t=161 also needs 5
    assert t.bound("r") == 160


def test_hybrid_bound_combines_groups():
    t = DeliveryTracker(layout())
    t.begin("r", 161)
    deliver(t, "r", 1, full=[0, 1, 2, 3, 4, 5], swa=[0, 3, 4, 5])
    assert t.bound("r") == 0  # recurrent state missing: resume from scratch
    deliver(t, "r", 2, ssm=[0])
    assert t.bound("r") == 161 and t.complete("r")


def test_recurrent_state_counts_only_when_whole_at_the_final_position():
    t = DeliveryTracker(layout())
    t.begin("r", 161)
    deliver(t, "r", 1, ssm=[0], swa=[0, 3, 4, 5], full=[0, 1, 2, 3, 4])
    # the state is valid only at 161, where full attention still lacks page 5
    assert t.bound("r") == 0
    deliver(t, "r", 2, full=[5])
    assert t.bound("r") == 161


def test_recurrent_only_layout():
    t = DeliveryTracker(layout(["ssm"]))
    t.begin("r", 7)
    with pytest.raises(PageRangeError, match="outside \\[0, 1\\)"):
        t.post("r", 1, {"ssm": np.array([1])})
    assert t.bound("r") == 0
    deliver(t, "r", 1, ssm=[0])
    assert t.bound("r") == 7


def test_failed_chunk_does_not_move_the_bound():
    t = DeliveryTracker(layout(["full"]))
    t.begin("r", 128)
    deliver(t, "r", "a", full=[0])
    t.post("r", "b", {"full": np.array([1, 2, 3])})
    err = KvlendError("peer lost")
    assert t.fail("r", "b", err) is True
    assert t.bound("r") == 32
    assert t.failed("r") and t.errors("r") == {"b": err}
    assert t.pending("r") == ()
    deliver(t, "r", "retry", full=[1, 2, 3])  # re-posting the same pages is fine
    assert t.bound("r") == 128 and t.complete("r")
    assert t.failed("r")  # the history stays; the bound is what counts


def test_done_after_done_or_fail_is_refused():
    t = DeliveryTracker(layout(["full"]))
    t.begin("r", 64)
    t.post("r", 1, {"full": np.array([0])})
    t.post("r", 2, {"full": np.array([1])})
    t.done("r", 1)
    t.fail("r", 2)
    for call in (t.done, t.fail):
        for chunk in (1, 2):
            with pytest.raises(TrackerError, match=f"chunk {chunk} of request 'r' was already settled"):
                call("r", chunk)
    with pytest.raises(TrackerError, match="chunk 3 of request 'r' was never posted"):
        t.done("r", 3)
    with pytest.raises(TrackerError, match="chunk 1 of request 'r' was already posted"):
        t.post("r", 1, {"full": np.array([1])})
    assert t.bound("r") == 32 and t.errors("r") == {2: None}


def test_late_completions_of_an_aborted_request_are_ignored():
    t = DeliveryTracker(layout(["full"]))
    t.begin("r", 128)
    for i in range(4):
        t.post("r", i, {"full": np.array([i])})
    t.done("r", 0)
    t.abort("r")
    assert t.aborted("r")
    assert t.done("r", 1) is False
    assert t.fail("r", 2, KvlendError("x")) is False
    assert t.pending("r") == (3,)  # its reads are still in flight: keep the pages
    assert t.bound("r") == 32 and not t.failed("r")
    with pytest.raises(TrackerError, match="was aborted"):
        t.post("r", 9, {"full": np.array([1])})
    t.finish("r")  # allowed with chunks in flight once aborted
    assert t.done("r", 3) is False  # even after it was forgotten
    assert t.fail("r", 3) is False
    assert t.stats == TrackerStats(requests=0, pending=0, done=1, failed=0, ignored=4)
    with pytest.raises(TrackerError, match="not tracked"):
        t.bound("r")
    t.begin("r", 32)  # the id may be reused; the new request is tracked normally
    with pytest.raises(TrackerError, match="never posted"):
        t.done("r", 3)


def test_memory_of_aborted_requests_is_bounded():
    t = DeliveryTracker(layout(["full"]), remember=1)
    for r in ("a", "b"):
        t.begin(r, 32)
        t.post(r, 1, {"full": np.array([0])})
        t.abort(r)
        t.finish(r)
    assert t.done("b", 1) is False
    with pytest.raises(TrackerError, match="request 'a' is not tracked"):
        t.done("a", 1)


def test_finish_refuses_chunks_in_flight_unless_aborted():
    t = DeliveryTracker(layout(["full"]))
    t.begin("r", 64)
    t.post("r", 1, {"full": np.array([0, 1])})
    with pytest.raises(TrackerError, match="1 chunk\\(s\\) in flight; abort it first"):
        t.finish("r")
    t.done("r", 1)
    t.finish("r")
    assert t.stats.requests == 0
    with pytest.raises(TrackerError, match="not tracked"):
        t.done("r", 1)


def test_custom_needed_pages():
    t = DeliveryTracker(layout(["full", "ssm"]))
    # pages 0 and 1 are already local (a prefix hit): only 2..4 and the state are fetched
    t.begin("r", 150, needed={"full": np.array([2, 3, 4]), "ssm": np.array([0])})
    with pytest.raises(PageRangeError, match="token page 0 is not needed"):
        t.post("r", 1, {"full": np.array([0])})
    deliver(t, "r", 1, full=[2, 3, 4], ssm=[0])
    assert t.complete("r")
    assert t.bound("r") == 0  # the bound counts delivered pages only


def test_pending_keeps_posting_order_and_stats_count():
    t = DeliveryTracker(layout(["full"]))
    t.begin("a", 128)
    t.begin("b", 64)
    for c in (5, 2, 9):
        t.post("a", c, {"full": np.array([c % 4])})
    t.post("b", "x", {"full": [0, 1]})
    assert t.pending("a") == (5, 2, 9)
    t.done("a", 2)
    assert t.pending("a") == (5, 9)
    t.fail("b", "x")
    assert t.stats == TrackerStats(requests=2, pending=2, done=1, failed=1, ignored=0)


@pytest.mark.parametrize("call, error, match", [
    (lambda t: t.begin("", 10), TrackerError, "request: must be a non-empty str"),
    (lambda t: t.begin(None, 10), TrackerError, "request"),
    (lambda t: t.begin("r", 0), PageRangeError, "num_tokens: must be an int > 0"),
    (lambda t: t.begin("r", True), PageRangeError, "num_tokens"),
    (lambda t: t.begin("r", 64, needed={"full": [0]}), PageRangeError, "missing \\['ssm'\\]"),
    (lambda t: t.begin("r", 64, needed={"full": [0], "ssm": [0], "x": []}), PageRangeError, "unknown \\['x'\\]"),
    (lambda t: t.begin("r", 64, needed=[0]), PageRangeError, "needed: must map every group"),
    (lambda t: t.begin("r", 64, needed={"full": [2], "ssm": [0]}), PageRangeError,
     "token page 2 is outside \\[0, 2\\)"),
    (lambda t: t.begin("r", 64, needed={"full": [0.5], "ssm": [0]}), PageRangeError, "must be integers"),
    (lambda t: t.begin("r", 64, needed={"full": [[0]], "ssm": [0]}), PageRangeError, "must be 1-D"),
    (lambda t: t.begin("r", 64, needed={"full": [[0], [0, 1]], "ssm": [0]}), PageRangeError, "not an integer array"),
    (lambda t: t.begin("old", 64), TrackerError, "request 'old' is already tracked"),
    (lambda t: t.post("nope", 1, {"full": [0]}), TrackerError, "request 'nope' is not tracked"),
    (lambda t: t.post("old", 1.5, {"full": [0]}), TrackerError, "chunk id: must be an int or a str"),
    (lambda t: t.post("old", True, {"full": [0]}), TrackerError, "chunk id"),
    (lambda t: t.post("old", 1, [0]), PageRangeError, "pages: must be a mapping"),
    (lambda t: t.post("old", 1, {"swa": [0]}), PageRangeError, "unknown groups \\['swa'\\]"),
    (lambda t: t.post("old", 1, {"full": []}), PageRangeError, "chunk 1 of request 'old' names no pages"),
    (lambda t: t.post("old", 1, {"full": [-1]}), PageRangeError, "token page -1 is outside"),
    (lambda t: t.done(7, 1), TrackerError, "request 7 is not tracked"),
    (lambda t: t.abort("nope"), TrackerError, "not tracked"),
    (lambda t: t.complete("nope"), TrackerError, "not tracked"),
    (lambda t: DeliveryTracker(layout(), remember=-1), TrackerError, "remember"),
])
def test_bad_calls_raise_typed_errors_and_change_nothing(call, error, match):
    t = DeliveryTracker(layout(["full", "ssm"]))
    t.begin("old", 64)
    t.post("old", 0, {"full": [0]})
    with pytest.raises(error, match=match):
        call(t)
    assert issubclass(error, KvlendError)
    assert t.pending("old") == (0,)
    assert t.stats == TrackerStats(requests=1, pending=1, done=0, failed=0, ignored=0)


def test_uses_the_local_layout_even_with_host_regions():
    t = DeliveryTracker(layout(["full"], host=True))
    t.begin("r", 33)
    deliver(t, "r", 1, full=[0, 1])
    assert t.bound("r") == 33


# --------------------------------------------------------------- properties


@st.composite
def scenarios(draw):
    groups = draw(st.sampled_from([("full",), ("swa",), ("full", "swa"), ("full", "swa", "ssm"), ("swa", "ssm")]))
    tpp = draw(st.sampled_from([1, 2, 4, 8]))
    lay = layout(groups, tpp=tpp, window=draw(st.integers(-1, 40)), sinks=draw(st.integers(0, 3)),
                 kept=draw(st.integers(1, 60)))
    n = draw(st.integers(1, 60))
    pages = [(name, p) for name, g in lay.groups.items()
             for p in (g.pages_read(n, tpp).tolist())]
    events = draw(st.lists(st.tuples(st.sampled_from(pages), st.sampled_from(["done", "fail"])),
                           max_size=3 * len(pages)) if pages else st.just([]))
    return lay, n, events


@settings(max_examples=examples(150), deadline=None)
@given(scenarios())
def test_bound_matches_a_brute_force_reference_over_random_delivery_orders(scenario):
    lay, n, events = scenario
    t = DeliveryTracker(lay)
    t.begin("r", n)
    delivered = {name: set() for name in lay.groups}
    for i, ((name, page), outcome) in enumerate(events):
        t.post("r", i, {name: np.array([page])})
        getattr(t, outcome)("r", i)
        if outcome == "done":
            delivered[name].add(page)
        assert t.bound("r") == reference_bound(lay, n, delivered)
    needed = {name: set(g.pages_read(n, lay.tokens_per_page).tolist()) for name, g in lay.groups.items()}
    assert t.complete("r") == all(needed[k] <= delivered[k] for k in needed)
    if t.complete("r"):
        assert t.bound("r") == n


@settings(max_examples=examples(60), deadline=None)
@given(st.permutations(list(range(6))), st.integers(1, 6))
def test_bound_never_decreases_as_full_pages_arrive_in_any_order(order, chunk):
    t = DeliveryTracker(layout(["full"]))
    t.begin("r", 161)
    last = 0
    for i in range(0, 6, chunk):
        deliver(t, "r", i, full=order[i:i + chunk])
        b = t.bound("r")
        prefix = next((k for k in range(6) if k not in order[:i + chunk]), 6)
        assert b == min(161, prefix * 32) and b >= last
        last = b
    assert last == 161
