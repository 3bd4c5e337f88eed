"""PageLocks: refcounted page locks per region, validated before any change."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvlend.core.layout import BufferDesc, LayerIdentity, LayerKind, MemoryKind, MemoryRegion, PageLayout, Role
from kvlend.core.locks import PageLocks
from kvlend.errors import KvlendError, PageRangeError
from tests.support.profiles import examples

pytestmark = pytest.mark.unit


def _layout() -> PageLayout:
    regions = (
        MemoryRegion("dev", MemoryKind.DEVICE, 0, 128 * 10, 128, 10),
        MemoryRegion("host", MemoryKind.HOST, 0, 128 * 4, 128, 4),
    )
    buffers = (
        BufferDesc("L0.K", "dev", 0, 64, LayerIdentity(0, LayerKind.ATTENTION, Role.K)),
        BufferDesc("L0.V", "dev", 64, 64, LayerIdentity(0, LayerKind.ATTENTION, Role.V)),
        BufferDesc("L1.KV", "host", 0, 128, LayerIdentity(1, LayerKind.ATTENTION, Role.KV)),
    )
    return PageLayout(regions, buffers, tokens_per_page=16, kept_window=1024, dtype="bfloat16")


def test_lock_counts_duplicates_and_unlock_restores():
    locks = PageLocks(_layout())
    locks.lock("dev", np.array([1, 2, 2, 7]))
    assert locks.refcounts("dev").tolist() == [0, 1, 2, 0, 0, 0, 0, 1, 0, 0]
    assert locks.locked_pages("dev") == 3
    assert locks.locked_pages("host") == 0
    assert locks.locked_pages() == 3
    assert locks.is_locked("dev", 2) and not locks.is_locked("dev", 3)
    assert locks.can_evict("dev", np.array([0, 1, 2, 3, 7])).tolist() == [True, False, False, True, False]
    locks.unlock("dev", np.array([2, 7]))
    assert locks.refcounts("dev").tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert locks.locked_pages() == 2
    locks.unlock("dev", [1, 2])
    assert locks.locked_pages() == 0
    assert np.all(locks.can_evict("dev", np.arange(10)))


def test_regions_are_independent():
    locks = PageLocks(_layout())
    locks.lock("host", np.array([3]))
    assert locks.is_locked("host", 3)
    assert not locks.is_locked("dev", 3)
    assert locks.locked_pages() == 1


def test_empty_ordinals_are_a_no_op():
    locks = PageLocks(_layout())
    locks.lock("dev", [])
    locks.unlock("dev", np.zeros(0, dtype=np.int64))
    assert locks.locked_pages() == 0
    assert locks.can_evict("dev", []).shape == (0,)


def test_accepts_any_integer_dtype():
    locks = PageLocks(_layout())
    locks.lock("dev", np.array([9], dtype=np.uint8))
    locks.lock("dev", np.array([9], dtype=np.int16))
    assert locks.refcounts("dev")[9] == 2


@pytest.mark.parametrize(
    "region, ordinals, match",
    [
        ("nope", [0], "no region 'nope'"),
        (None, [0], "no region None"),
        ("dev", [10], "ordinal 10 is outside region 'dev' of 10 pages"),
        ("dev", [-1], "ordinal -1 is outside"),
        ("host", [4], "outside region 'host' of 4 pages"),
        ("dev", [[1, 2]], "must be 1-D"),
        ("dev", 3, "must be 1-D"),
        ("dev", [1.0], "must be integers"),
        ("dev", [True], "must be integers"),
        ("dev", [2**70], "must be integers"),
        ("dev", [[1], [1, 2]], "not an integer array"),
    ],
)
def test_bad_arguments_raise_and_change_nothing(region, ordinals, match):
    locks = PageLocks(_layout())
    locks.lock("dev", [5])
    for call in (locks.lock, locks.unlock, locks.can_evict):
        with pytest.raises(PageRangeError, match=match):
            call(region, ordinals)
    assert locks.refcounts("dev").tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 0, 0]
    assert locks.locked_pages() == 1


def test_unlock_below_zero_changes_nothing():
    locks = PageLocks(_layout())
    locks.lock("dev", [1, 2])
    with pytest.raises(PageRangeError, match="unlock of page 2 in region 'dev' 2 time"):
        locks.unlock("dev", [1, 2, 2])
    with pytest.raises(PageRangeError, match="page 3 .* holds 0 lock"):
        locks.unlock("dev", [1, 3])
    assert locks.refcounts("dev")[[1, 2]].tolist() == [1, 1]
    assert locks.locked_pages() == 2


def test_count_overflow_is_refused():
    locks = PageLocks(_layout())
    locks.lock("dev", np.zeros(2, dtype=np.int64))
    locks._counts["dev"][0] = np.iinfo(np.int32).max - 1  # reach the cap without 2**31 calls
    with pytest.raises(PageRangeError, match="exceed"):
        locks.lock("dev", [0, 0])
    assert locks.refcounts("dev")[0] == np.iinfo(np.int32).max - 1


def test_point_queries_validate():
    locks = PageLocks(_layout())
    with pytest.raises(PageRangeError):
        locks.is_locked("dev", 10)
    with pytest.raises(PageRangeError):
        locks.is_locked("dev", 1.5)
    with pytest.raises(KvlendError):
        locks.locked_pages("nope")
    with pytest.raises(PageRangeError):
        locks.refcounts("nope")


def test_refcounts_is_a_read_only_copy():
    locks = PageLocks(_layout())
    counts = locks.refcounts("dev")
    with pytest.raises(ValueError):
        counts[0] = 5
    locks.lock("dev", [0])
    assert counts[0] == 0 and locks.refcounts("dev")[0] == 1


_ops = st.lists(
    st.tuples(st.booleans(), st.sampled_from(["dev", "host"]), st.lists(st.integers(0, 9), max_size=6)),
    max_size=30,
)


@settings(max_examples=examples(80), deadline=None)
@given(_ops)
def test_random_lock_unlock_matches_a_multiset_model(ops):
    layout = _layout()
    locks = PageLocks(layout)
    model = {r.name: Counter() for r in layout.regions}
    sizes = {r.name: r.num_pages for r in layout.regions}
    for is_lock, region, pages in ops:
        want = Counter(pages)
        in_range = all(p < sizes[region] for p in pages)
        ok = in_range and (is_lock or all(model[region][p] >= c for p, c in want.items()))
        if not ok:
            with pytest.raises(PageRangeError):
                (locks.lock if is_lock else locks.unlock)(region, np.array(pages, dtype=np.int64))
        elif is_lock:
            locks.lock(region, np.array(pages, dtype=np.int64))
            model[region].update(want)
        else:
            locks.unlock(region, np.array(pages, dtype=np.int64))
            model[region].subtract(want)
        for name, size in sizes.items():
            expect = [model[name][p] for p in range(size)]
            assert locks.refcounts(name).tolist() == expect
            assert locks.locked_pages(name) == sum(1 for c in expect if c > 0)
            assert locks.can_evict(name, np.arange(size)).tolist() == [c == 0 for c in expect]
