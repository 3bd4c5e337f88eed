"""Lender: leases, page locks, expiry and the errors a late caller gets."""

import itertools
from types import MappingProxyType

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
from kvlend.core.locks import PageLocks
from kvlend.core.prompt import prompt_digest
from kvlend.errors import (
    KvlendError,
    LayoutError,
    LeaseDenied,
    LeaseError,
    LeaseExpired,
    LeaseLifetimeExceeded,
    LeaseUnknown,
    PageRangeError,
    PromptMismatch,
    QuotaExceeded,
)
from tests.support.profiles import examples

pytestmark = pytest.mark.unit

ATT, REC = LayerKind.ATTENTION, LayerKind.RECURRENT
ALL = RowSelection.all()


def hybrid(tpp=32, pages=64, states=8, host=True, window=64, sinks=1) -> PageLayout:
    """Full group (+ a HOST-tier layer when ``host``), windowed group with sinks, recurrent group."""
    dev = MemoryKind.DEVICE
    regions = [
        MemoryRegion("full", dev, 0, 256 * pages, 256, pages),
        MemoryRegion("swa", dev, 0, 256 * pages, 256, pages),
        MemoryRegion("ssm", dev, 0, 256 * states, 256, states),
    ]
    buffers = [
        BufferDesc("L0.K", "full", 0, 128, LayerIdentity(0, ATT, Role.K), group="full"),
        BufferDesc("L0.V", "full", 128, 128, LayerIdentity(0, ATT, Role.V), group="full"),
        BufferDesc("L1.K", "swa", 0, 128, LayerIdentity(1, ATT, Role.K), group="swa", window=window, sinks=sinks),
        BufferDesc("L1.V", "swa", 128, 128, LayerIdentity(1, ATT, Role.V), group="swa", window=window, sinks=sinks),
        BufferDesc("L2.state", "ssm", 0, 192, LayerIdentity(2, REC, Role.STATE), group="ssm"),
        BufferDesc("L2.conv", "ssm", 192, 64, LayerIdentity(2, REC, Role.CONV), group="ssm"),
    ]
    if host:  # a host-tier layer of the full group: same page table, fewer slots
        regions.append(MemoryRegion("host", MemoryKind.HOST, 0, 256 * (pages // 4), 256, pages // 4))
        buffers += [
            BufferDesc("L3.K", "host", 0, 128, LayerIdentity(3, ATT, Role.K), group="full"),
            BufferDesc("L3.V", "host", 128, 128, LayerIdentity(3, ATT, Role.V), group="full"),
        ]
    return PageLayout(tuple(regions), tuple(buffers), tokens_per_page=tpp, kept_window=4096, dtype="bfloat16")


def ids():
    counter = itertools.count(1)
    return lambda n: next(counter).to_bytes(n, "big")


def tables(n_tokens=161, tpp=32, offset=0, state=3):
    n = -(-n_tokens // tpp)
    return {
        "full": np.arange(n) + offset,
        "swa": np.arange(n) + 10 + offset,
        "ssm": np.array([state]),
    }


def held(lender: Lender) -> dict:
    return {r.name: lender.locks.refcounts(r.name).copy() for r in lender.layout.regions}


# ------------------------------------------------------------------ lending
def test_lend_all_covers_what_a_decoder_reads_and_locks_it():
    layout = hybrid(host=False)
    lender = Lender(layout, new_id=ids())
    lease = lender.lend("req-1", 161, tables(), ALL, now=100.0, ttl=5.0, peer="decode-0")
    assert isinstance(lease, Lease)
    assert lease.id == (1).to_bytes(16, "big") and lease.hex == lease.id.hex()
    assert (lease.request, lease.num_tokens, lease.peer) == ("req-1", 161, "decode-0")
    assert lease.ttl == 5.0 and lease.expires_at == 105.0
    assert lease.pages["full"].token_pages.tolist() == [0, 1, 2, 3, 4, 5]
    assert lease.pages["full"].ordinals.tolist() == [0, 1, 2, 3, 4, 5]
    # window 64 at position 161 with 32 tokens per page: pages 3, 4, 5 plus sink page 0
    assert lease.pages["swa"].token_pages.tolist() == [0, 3, 4, 5]
    assert lease.pages["swa"].ordinals.tolist() == [10, 13, 14, 15]
    assert lease.pages["ssm"].token_pages.tolist() == [0]
    assert lease.pages["ssm"].ordinals.tolist() == [3]
    assert lease.num_pages == 6 + 4 + 1
    locks = lender.locks
    assert np.flatnonzero(locks.refcounts("full")).tolist() == [0, 1, 2, 3, 4, 5]
    assert np.flatnonzero(locks.refcounts("swa")).tolist() == [10, 13, 14, 15]
    assert np.flatnonzero(locks.refcounts("ssm")).tolist() == [3]
    assert locks.locked_pages() == 11
    assert lender.active_leases == 1
    assert not locks.can_evict("swa", np.array([13]))[0]
    assert locks.can_evict("swa", np.array([11, 12])).tolist() == [True, True]  # stale: evictable


def test_stale_rows_of_a_windowed_group_may_be_unpaged():
    lender = Lender(hybrid(host=False))
    t = tables()
    t["swa"][[1, 2]] = -1  # released by the cache manager once out of the window
    lease = lender.lend("r", 161, t, ALL, now=0, ttl=1)
    assert lease.pages["swa"].ordinals.tolist() == [10, 13, 14, 15]


def test_lease_is_immutable():
    lease = Lender(hybrid(host=False)).lend("r", 40, tables(40), ALL, now=0, ttl=1)
    assert isinstance(lease.pages, MappingProxyType)
    with pytest.raises(TypeError):
        lease.pages["full"] = None
    with pytest.raises(ValueError):
        lease.pages["full"].ordinals[0] = 7
    with pytest.raises(AttributeError):
        lease.expires_at = 9.0
    assert hash(lease) == hash(lease.id)


def test_host_region_refuses_all_rows():
    lender = Lender(hybrid(host=True))
    with pytest.raises(LayoutError, match="HOST regions \\['host'\\] support only NAMED"):
        lender.lend("r", 161, tables(), ALL, now=0, ttl=1)
    assert lender.active_leases == 0 and lender.locks.locked_pages() == 0
    lease = lender.lend("r", 161, tables(), RowSelection.named("L3.K"), now=0, ttl=1)
    assert lease.pages["full"].ordinals.tolist() == [0, 1, 2, 3, 4, 5]


def test_named_selection_locks_only_the_named_buffers_regions():
    lender = Lender(hybrid(host=True))
    lease = lender.lend("a", 161, tables(), RowSelection.named("L0.K", "L0.V"), now=0, ttl=1)
    assert set(lease.pages) == {"full"}  # groups without a named buffer are not lent
    assert lender.locks.locked_pages("full") == 6
    assert lender.locks.locked_pages("host") == 0
    assert lender.locks.locked_pages() == 6
    # both buffers live in region "full": each page is locked once per lease
    assert lender.locks.refcounts("full").max() == 1
    lender.lend("b", 161, tables(), RowSelection.named("L3.V", "L2.conv"), now=0, ttl=1)
    assert lender.locks.locked_pages("host") == 6
    assert np.flatnonzero(lender.locks.refcounts("ssm")).tolist() == [3]
    assert lender.locks.refcounts("full").max() == 1


def test_overlapping_leases_stack_locks():
    lender = Lender(hybrid(host=False))
    a = lender.lend("a", 161, tables(), ALL, now=0, ttl=10)
    b = lender.lend("b", 64, tables(64), ALL, now=0, ttl=10)
    assert lender.locks.refcounts("full")[:6].tolist() == [2, 2, 1, 1, 1, 1]
    lender.release(a.id)
    assert lender.locks.refcounts("full")[:6].tolist() == [1, 1, 0, 0, 0, 0]
    lender.release(b.id)
    assert lender.locks.locked_pages() == 0


@pytest.mark.parametrize("group, row, value, region", [
    ("full", 5, 64, "full"),
    ("full", 0, -1, "full"),
    ("swa", 4, 999, "swa"),
    ("swa", 0, -5, "swa"),  # the sink row is lent
    ("ssm", 0, 8, "ssm"),
])
def test_out_of_range_page_raises_and_locks_nothing(group, row, value, region):
    lender = Lender(hybrid(host=False))
    t = tables()
    t[group][row] = value
    with pytest.raises(PageRangeError, match=f"pages\\['{group}'\\].*slot {value}, outside region '{region}'"):
        lender.lend("r", 161, t, ALL, now=0, ttl=1)
    assert lender.locks.locked_pages() == 0
    assert lender.active_leases == 0


def test_ordinal_checked_against_every_selected_region_of_the_group():
    lender = Lender(hybrid(host=True))  # full: 64 slots, host: 16
    t = tables()
    t["full"][5] = 20
    lender.lend("ok", 161, t, RowSelection.named("L0.K"), now=0, ttl=1)
    before = held(lender)
    with pytest.raises(PageRangeError, match="slot 20, outside region 'host' of 16 pages"):
        lender.lend("bad", 161, t, RowSelection.named("L0.K", "L3.K"), now=0, ttl=1)
    assert all(np.array_equal(before[k], v) for k, v in held(lender).items())
    assert lender.active_leases == 1


_GOOD = dict(request="r", num_tokens=161, selection=ALL, now=0.0, ttl=1.0, peer=None)


@pytest.mark.parametrize("change, error, match", [
    ({"request": ""}, LeaseError, "request: must be a non-empty str"),
    ({"request": 7}, LeaseError, "request"),
    ({"num_tokens": 0}, PageRangeError, "num_tokens: must be an int > 0"),
    ({"num_tokens": -3}, PageRangeError, "num_tokens"),
    ({"num_tokens": True}, PageRangeError, "num_tokens"),
    ({"num_tokens": 161.0}, PageRangeError, "num_tokens"),
    ({"num_tokens": 10**6}, PageRangeError, "num_tokens: 1000000 exceeds the layout's kept window"),
    ({"num_tokens": 200}, PageRangeError, "pages\\['full'\\]: expected 7 entries, got shape \\(6,\\)"),
    ({"selection": "ALL"}, LayoutError, "selection: must be a RowSelection"),
    ({"selection": RowSelection.named("nope")}, LayoutError, "no buffer 'nope'"),
    ({"ttl": 0}, LeaseError, "ttl: must be > 0"),
    ({"ttl": -1.0}, LeaseError, "ttl"),
    ({"ttl": float("nan")}, LeaseError, "ttl: must be a finite number"),
    ({"ttl": 1e308, "now": 1e308}, LeaseError, "finite now \\+ ttl"),
    ({"ttl": True}, LeaseError, "ttl"),
    ({"now": float("inf")}, LeaseError, "now: must be a finite number"),
    ({"now": "0"}, LeaseError, "now"),
    ({"now": 10**400}, LeaseError, "now"),
    ({"peer": ""}, LeaseError, "peer: must be None or a non-empty str"),
    ({"peer": 3}, LeaseError, "peer"),
])
def test_bad_arguments_raise_before_anything_changes(change, error, match):
    lender = Lender(hybrid(host=False))
    with pytest.raises(error, match=match):
        lender.lend(pages=tables(), **{**_GOOD, **change})
    assert lender.active_leases == 0 and lender.locks.locked_pages() == 0


@pytest.mark.parametrize("mutate, match", [
    (lambda t: t.pop("ssm"), "missing groups \\['ssm'\\]"),
    (lambda t: t.update(extra=np.arange(1)), "unknown groups \\['extra'\\]"),
    (lambda t: t.update(ssm=np.array([1, 2])), "pages\\['ssm'\\]: expected 1 entries"),
    (lambda t: t.update(full=np.arange(6.0)), "pages\\['full'\\]: must be integers"),
    (lambda t: t.update(full=np.arange(6).reshape(2, 3)), "pages\\['full'\\]: expected 6 entries"),
    (lambda t: t.update(full=[[0], [1, 2]]), "pages\\['full'\\]: not an integer array"),
    (lambda t: t.update(full=np.array([0, 1, 2, 3, 4, 2**63], dtype=np.uint64)), "out of range"),
])
def test_bad_page_tables_raise_before_anything_changes(mutate, match):
    lender = Lender(hybrid(host=False))
    t = tables()
    mutate(t)
    with pytest.raises(PageRangeError, match=match):
        lender.lend("r", 161, t, ALL, now=0, ttl=1)
    with pytest.raises(PageRangeError, match="must be a mapping"):
        lender.lend("r", 161, [t["full"]], ALL, now=0, ttl=1)
    assert lender.active_leases == 0 and lender.locks.locked_pages() == 0


def test_one_live_lease_per_request_and_peer():
    lender = Lender(hybrid(host=False))
    first = lender.lend("r", 161, tables(), ALL, now=0, ttl=10, peer="d0")
    with pytest.raises(LeaseError, match=f"already has live lease {first.hex} for peer 'd0'"):
        lender.lend("r", 161, tables(), ALL, now=5, ttl=10, peer="d0")
    assert lender.active_leases == 1 and lender.locks.refcounts("full").max() == 1
    other = lender.lend("r", 161, tables(), ALL, now=5, ttl=10, peer="d1")  # another decode rank
    lender.release(first.id)
    again = lender.lend("r", 161, tables(), ALL, now=6, ttl=10, peer="d0")
    # past its expiry (not yet swept) a lease no longer blocks a new one
    lender.lend("r", 161, tables(), ALL, now=16.5, ttl=10, peer="d1")
    assert lender.active_leases == 3
    assert [x.id for x in lender.expire(16)] == [other.id]
    lender.release(again.id)
    assert lender.active_leases == 1


def test_lease_ids_are_random_128_bit_by_default():
    lender = Lender(hybrid(host=False))
    a = lender.lend("a", 10, tables(10), ALL, now=0, ttl=1)
    b = lender.lend("b", 10, tables(10), ALL, now=0, ttl=1)
    assert len(a.id) == 16 and len(b.id) == 16 and a.id != b.id


@pytest.mark.parametrize("make", [lambda n: b"short", lambda n: "x" * n])
def test_bad_id_generator_is_refused_before_locking(make):
    lender = Lender(hybrid(host=False), new_id=make)
    with pytest.raises(LeaseError, match="new_id: must return 16 bytes"):
        lender.lend("r", 10, tables(10), ALL, now=0, ttl=1)
    assert lender.locks.locked_pages() == 0


def test_repeated_id_is_refused_even_after_release():
    lender = Lender(hybrid(host=False), new_id=lambda n: b"\x01" * n)
    lease = lender.lend("a", 10, tables(10), ALL, now=0, ttl=1)
    with pytest.raises(LeaseError, match="repeated lease id"):
        lender.lend("b", 10, tables(10), ALL, now=0, ttl=1)
    lender.release(lease.id)
    with pytest.raises(LeaseError, match="repeated lease id"):
        lender.lend("b", 10, tables(10), ALL, now=0, ttl=1)
    assert lender.locks.locked_pages() == 0


# ---------------------------------------------------------------- lifetime
def test_expire_drops_locks_strictly_after_expiry():
    lender = Lender(hybrid(host=False))
    a = lender.lend("a", 161, tables(), ALL, now=0, ttl=10)
    b = lender.lend("b", 64, tables(64, offset=30), ALL, now=5, ttl=10)
    assert lender.expire(10.0) == []  # exactly at the expiry: still live
    assert lender.get(a.id, 10.0) == a
    expired = lender.expire(10.5)
    assert [x.id for x in expired] == [a.id]
    assert np.flatnonzero(lender.locks.refcounts("full")).tolist() == [30, 31]
    assert [x.id for x in lender.expire(100)] == [b.id]
    assert lender.locks.locked_pages() == 0 and lender.active_leases == 0
    assert lender.expire(200) == []


def test_expire_returns_oldest_first():
    lender = Lender(hybrid(host=False))
    leases = [lender.lend(f"r{i}", 10, tables(10), ALL, now=0, ttl=ttl) for i, ttl in enumerate([3, 1, 2])]
    assert [x.request for x in lender.expire(5)] == ["r1", "r2", "r0"]
    assert all(lender.release(x.id) is None for x in leases)


def test_renewed_lease_is_not_expired():
    lender = Lender(hybrid(host=False))
    lease = lender.lend("r", 161, tables(), ALL, now=0, ttl=10)
    renewed = lender.renew(lease.id, 9.0)
    assert renewed.id == lease.id and renewed.expires_at == 19.0
    assert renewed.pages is lease.pages
    assert lender.expire(15) == [] and lender.expire(19) == []
    assert lender.get(lease.id, 19).expires_at == 19.0
    # an earlier 'now' never shortens a lease
    assert lender.renew(lease.id, 2.0).expires_at == 19.0
    assert [x.id for x in lender.expire(19.5)] == [lease.id]
    assert lender.locks.locked_pages() == 0


def test_a_caller_that_never_sweeps_keeps_the_expiry_heap_bounded_and_expiry_exact():
    lender = Lender(hybrid(host=False))
    kept = lender.lend("kept", 161, tables(), ALL, now=0, ttl=1000)
    for i in range(2000):  # lend and release (and renew the kept one) without ever calling expire
        lender.release(lender.lend(f"r{i}", 161, tables(), ALL, now=i * 0.1, ttl=10).id)
        lender.renew(kept.id, i * 0.1)
    assert len(lender._deadlines) <= 2 * lender.active_leases + 65
    assert lender.next_expiry() == pytest.approx(199.9 + 1000)
    assert lender.expire(1199.9) == [] and [x.id for x in lender.expire(1200)] == [kept.id]


def test_renew_past_expiry_is_refused_and_changes_nothing():
    lender = Lender(hybrid(host=False))
    lease = lender.lend("r", 161, tables(), ALL, now=0, ttl=10)
    with pytest.raises(LeaseExpired, match=f"lease {lease.hex} expired at 10.0"):
        lender.renew(lease.id, 10.001)
    assert lender.active_leases == 1 and lender.locks.locked_pages() == 11
    assert [x.id for x in lender.expire(11)] == [lease.id]
    with pytest.raises(LeaseExpired):
        lender.renew(lease.id, 11)


def test_double_release_is_harmless():
    lender = Lender(hybrid(host=False))
    lease = lender.lend("r", 161, tables(), ALL, now=0, ttl=10)
    other = lender.lend("o", 161, tables(), ALL, now=0, ttl=10)
    assert lender.release(lease.id) == lease
    assert lender.release(lease.id) is None
    assert lender.release(lease.id) is None
    assert lender.active_leases == 1
    assert lender.locks.refcounts("full")[:6].tolist() == [1] * 6  # other's locks untouched
    assert lender.get(other.id, 1) == other


def test_release_of_an_expired_lease_is_harmless():
    lender = Lender(hybrid(host=False))
    lease = lender.lend("r", 161, tables(), ALL, now=0, ttl=1)
    lender.expire(2)
    assert lender.release(lease.id) is None
    assert lender.locks.locked_pages() == 0


def test_release_past_expiry_before_the_sweep_drops_locks_once():
    lender = Lender(hybrid(host=False))
    lease = lender.lend("r", 161, tables(), ALL, now=0, ttl=1)
    assert lender.release(lease.id) == lease
    assert lender.expire(5) == []
    assert lender.locks.locked_pages() == 0


def test_a_held_release_keeps_the_locks_until_settled_or_expired():
    """A lease released under a reader is over for everything but its page locks (issue 22, finding 5)."""
    lender = Lender(hybrid(host=False))
    a = lender.lend("a", 161, tables(), ALL, now=0, ttl=10, peer="d0")
    b = lender.lend("b", 64, tables(64, offset=40), ALL, now=0, ttl=10, peer="d0")
    lender.renew(b.id, 5)  # b now expires at 15
    locked = held(lender)
    lender.offered(a.id, reader=1)
    lender.offered(b.id, reader=1)
    assert lender.release(a.id) == a and lender.release(b.id).id == b.id
    assert lender.release(a.id) is None  # ended, and harmlessly so
    assert all(np.array_equal(held(lender)[r], locked[r]) for r in locked)  # nothing can be evicted yet
    assert lender.active_leases == 2 and lender.usage("d0") == (0, 0) and lender.leases_of("d0") == []
    with pytest.raises(LeaseUnknown, match="was released"):
        lender.check_read(a.id, "d0", 1)
    with pytest.raises(LeaseUnknown):
        lender.renew(b.id, 1)
    again = lender.lend("a", 161, tables(), ALL, now=1, ttl=20, peer="d0")  # lent again: its locks stack
    assert lender.settle(a.id) == a and lender.settle(a.id) is None
    assert lender.expire(14) == [] and lender.active_leases == 2  # b's hold ends at its own expiry, 15
    assert [x.id for x in lender.expire(16)] == [b.id] and lender.settle(b.id) is None
    lender.release(again.id)
    assert lender.active_leases == 0 and lender.locks.locked_pages() == 0


def test_a_held_lease_id_is_never_forgotten_nor_lent_again():
    lender = Lender(hybrid(host=False), remember=0)  # ended ids are forgotten at once; held ones are not
    lease = lender.lend("r", 161, tables(), ALL, now=0, ttl=10, peer="d0", options=LendOptions(lease_id=b"\x07" * 16))
    lender.offered(lease.id, reader=1)
    lender.release(lease.id)
    assert lender.known(lease.id) and lender.release(lease.id) is None
    with pytest.raises(LeaseError, match="repeated lease id"):
        lender.lend("r", 161, tables(), ALL, now=1, ttl=10, peer="d0", options=LendOptions(lease_id=lease.id))
    assert lender.settle(lease.id) == lease and not lender.known(lease.id)


def test_never_granted_or_malformed_ids_are_unknown():
    lender = Lender(hybrid(host=False))
    with pytest.raises(LeaseUnknown, match="never granted"):
        lender.release(b"\x00" * 16)
    with pytest.raises(LeaseUnknown, match="never granted"):
        lender.get(b"\x00" * 16, 0)
    for bad in (b"\x00" * 15, "00" * 16, None, 5):
        with pytest.raises(LeaseUnknown, match="lease id: must be 16 bytes"):
            lender.release(bad)
        with pytest.raises(LeaseUnknown):
            lender.get(bad, 0)
        with pytest.raises(LeaseUnknown):
            lender.renew(bad, 0)


def test_get_tells_released_from_expired():
    lender = Lender(hybrid(host=False))
    released = lender.lend("a", 161, tables(), ALL, now=0, ttl=10)
    expired = lender.lend("b", 161, tables(), ALL, now=0, ttl=1)
    lender.release(released.id)
    with pytest.raises(LeaseExpired, match="expired at 1.0"):  # past expiry, not yet swept
        lender.get(expired.id, 2)
    lender.expire(2)
    with pytest.raises(LeaseUnknown, match="was released"):
        lender.get(released.id, 2)
    with pytest.raises(LeaseExpired, match=f"lease {expired.hex} expired"):
        lender.get(expired.id, 2)
    with pytest.raises(LeaseExpired):
        lender.check_read(expired.id, None, 2)
    with pytest.raises(LeaseUnknown):
        lender.check_read(released.id, None, 2)


def test_memory_of_ended_leases_is_bounded():
    lender = Lender(hybrid(host=False), remember=2)
    leases = [lender.lend(f"r{i}", 10, tables(10), ALL, now=0, ttl=1) for i in range(3)]
    for lease in leases:
        lender.release(lease.id)
    with pytest.raises(LeaseUnknown, match="never granted \\(or is long gone\\)"):
        lender.release(leases[0].id)
    assert lender.release(leases[1].id) is None and lender.release(leases[2].id) is None
    with pytest.raises(LeaseError, match="remember"):
        Lender(hybrid(host=False), remember=-1)


def test_check_read_only_for_the_offered_peer():
    lender = Lender(hybrid(host=False))
    bound = lender.lend("a", 161, tables(), ALL, now=0, ttl=10, peer="d0")
    anyone = lender.lend("b", 161, tables(), ALL, now=0, ttl=10)
    assert lender.check_read(bound.id, "d0", 1) == bound
    with pytest.raises(LeaseDenied, match=f"lease {bound.hex} is not offered to peer 'd1'"):
        lender.check_read(bound.id, "d1", 1)
    with pytest.raises(LeaseDenied):
        lender.check_read(bound.id, None, 1)
    assert lender.check_read(anyone.id, "d1", 1) == anyone
    assert lender.check_read(anyone.id, None, 1) == anyone
    with pytest.raises(LeaseError, match="peer"):
        lender.check_read(bound.id, "", 1)
    with pytest.raises(LeaseExpired):
        lender.check_read(bound.id, "d0", 10.5)


def test_leases_of_and_release_peer():
    lender = Lender(hybrid(host=False))
    a = lender.lend("a", 161, tables(), ALL, now=0, ttl=10, peer="dead")
    b = lender.lend("b", 64, tables(64, offset=40), ALL, now=0, ttl=10, peer="dead")
    c = lender.lend("c", 64, tables(64, offset=20), ALL, now=0, ttl=10, peer="alive")
    assert {x.id for x in lender.leases_of("dead")} == {a.id, b.id}
    assert [x.id for x in lender.leases_of("alive")] == [c.id]
    assert lender.leases_of("nobody") == []
    assert {x.id for x in lender.release_peer("dead")} == {a.id, b.id}
    assert lender.release_peer("dead") == []
    assert lender.active_leases == 1
    assert np.flatnonzero(lender.locks.refcounts("full")).tolist() == [20, 21]
    with pytest.raises(LeaseUnknown, match="was released"):
        lender.get(a.id, 1)


def test_shared_locks_tell_the_cache_manager_what_not_to_evict():
    layout = hybrid(host=False)
    locks = PageLocks(layout)
    lender = Lender(layout, locks=locks)
    lease = lender.lend("r", 161, tables(), ALL, now=0, ttl=10)
    assert locks.can_evict("full", np.arange(8)).tolist() == [False] * 6 + [True] * 2
    lender.release(lease.id)
    assert locks.can_evict("full", np.arange(8)).all()
    with pytest.raises(LayoutError, match="locks: must be PageLocks over the same regions"):
        Lender(layout, locks=PageLocks(hybrid(host=False, pages=32)))
    with pytest.raises(LayoutError):
        Lender(layout, locks=object())


def test_every_error_is_a_kvlend_error():
    for cls in (LeaseError, LeaseExpired, LeaseUnknown, LeaseDenied, PageRangeError, LayoutError):
        assert issubclass(cls, KvlendError)
    assert issubclass(LeaseDenied, LeaseError)


# --------------------------------------------------------------- properties
_SELECTIONS = [ALL, RowSelection.named("L0.K"), RowSelection.named("L1.V", "L2.state"), RowSelection.named("L2.conv")]
_op = st.one_of(
    st.tuples(st.just("lend"), st.integers(0, 3), st.sampled_from([None, "d0", "d1"]), st.integers(1, 40),
              st.lists(st.integers(0, 11), min_size=11, max_size=11), st.integers(0, 3), st.integers(1, 6)),
    st.tuples(st.just("renew"), st.integers(0, 20)),
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(st.just("expire")),
    st.tuples(st.just("tick"), st.integers(1, 4)),
    st.tuples(st.just("drop_peer"), st.sampled_from([None, "d0", "d1"])),
)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(_op, max_size=40))
def test_random_lifecycles_keep_locks_equal_to_the_sum_over_live_leases(ops):
    tpp = 4
    layout = hybrid(tpp=tpp, pages=12, states=4, host=False, window=8, sinks=1)
    lender = Lender(layout, new_id=ids())
    live: dict[bytes, Lease] = {}
    granted: list[bytes] = []
    touched: dict[bytes, float] = {}  # lease id -> time of its lend or last renew
    now = 0.0
    for op in ops:
        kind = op[0]
        if kind == "lend":
            _, req, peer, n, raw, sel, ttl = op
            pages = -(-n // tpp)
            t = {"full": np.array(raw[:pages]), "swa": np.array(raw[::-1][:pages]), "ssm": np.array([raw[0] % 4])}
            dup = any(x.request == f"r{req}" and x.peer == peer and now <= x.expires_at for x in live.values())
            if dup:
                with pytest.raises(LeaseError):
                    lender.lend(f"r{req}", n, t, _SELECTIONS[sel], now, ttl, peer)
            else:
                lease = lender.lend(f"r{req}", n, t, _SELECTIONS[sel], now, ttl, peer)
                live[lease.id] = lease
                granted.append(lease.id)
                touched[lease.id] = now
        elif kind in ("renew", "release") and granted:
            lease_id = granted[op[1] % len(granted)]
            if kind == "release":
                out = lender.release(lease_id)
                assert (out is not None) == (lease_id in live)
                live.pop(lease_id, None)
            elif lease_id in live and now <= live[lease_id].expires_at:
                live[lease_id] = lender.renew(lease_id, now)
                touched[lease_id] = now
            else:
                with pytest.raises((LeaseExpired, LeaseUnknown)):
                    lender.renew(lease_id, now)
        elif kind == "expire":
            gone = lender.expire(now)
            assert {x.id for x in gone} == {i for i, x in live.items() if x.expires_at < now}
            for x in gone:
                assert touched[x.id] + x.ttl < now  # renewed within its TTL: never expired
                del live[x.id]
        elif kind == "tick":
            now += op[1]
        elif kind == "drop_peer":
            out = lender.release_peer(op[1])
            assert {x.id for x in out} == {i for i, x in live.items() if x.peer == op[1]}
            for x in out:
                del live[x.id]
        assert lender.active_leases == len(live)
        expect = {r.name: np.zeros(r.num_pages, dtype=np.int64) for r in layout.regions}
        for lease in live.values():
            selected = {b.name for b in layout.selected_buffers(lease.selection)}
            for group, gp in lease.pages.items():
                regions = {b.region for b in layout.groups[group].buffers if b.name in selected}
                for region in regions:
                    np.add.at(expect[region], np.unique(gp.ordinals), 1)
        for region, counts in expect.items():
            assert lender.locks.refcounts(region).tolist() == counts.tolist()


# ------------------------------------------------------------------- limits
def test_a_lease_is_never_renewed_past_its_max_lifetime():
    lender = Lender(hybrid(host=False))
    lease = lender.lend("r", 161, tables(), ALL, now=100.0, ttl=10, limits=LeaseLimits(max_lease_lifetime=25))
    assert (lease.lent_at, lease.expires_at, lease.ends_by) == (100.0, 110.0, 125.0)
    assert lender.renew(lease.id, 109).expires_at == 119
    assert lender.renew(lease.id, 115).expires_at == 125  # exactly at the cap
    before = held(lender)
    with pytest.raises(LeaseLifetimeExceeded) as info:
        lender.renew(lease.id, 115.5)
    exc = info.value
    assert isinstance(exc, LeaseExpired) and isinstance(exc, QuotaExceeded)
    assert (exc.limit, exc.value, exc.cap) == ("max_lease_lifetime", 25.5, 25.0)
    assert f"lease {lease.hex} lent at 100.0 would live until 125.5" in str(exc)
    assert lender.get(lease.id, 115.5).expires_at == 125  # unchanged
    assert all((held(lender)[r] == before[r]).all() for r in before)
    # Renewed as often as asked, it still ends at lend time + the lifetime.
    for t in np.arange(116, 125, 0.5):
        with pytest.raises(LeaseLifetimeExceeded):
            lender.renew(lease.id, float(t))
    assert lender.expire(125) == [] and [x.id for x in lender.expire(125.01)] == [lease.id]
    with pytest.raises(LeaseExpired):
        lender.renew(lease.id, 125.01)


def test_a_ttl_longer_than_the_lifetime_is_refused():
    lender = Lender(hybrid(host=False))
    with pytest.raises(QuotaExceeded, match="max_lease_lifetime: a lease ttl of 30.0 exceeds the cap of 20"):
        lender.lend("r", 161, tables(), ALL, now=0, ttl=30, limits=LeaseLimits(max_lease_lifetime=20))
    assert lender.active_leases == 0 and lender.locks.locked_pages() == 0


def test_num_tokens_past_the_cap_is_refused_before_anything_changes():
    lender = Lender(hybrid(host=False))
    with pytest.raises(QuotaExceeded) as info:
        lender.lend("r", 161, tables(), ALL, now=0, ttl=5, limits=LeaseLimits(max_num_tokens=160))
    assert (info.value.limit, info.value.value, info.value.cap) == ("max_num_tokens", 161, 160)
    assert lender.active_leases == 0 and lender.locks.locked_pages() == 0
    lender.lend("r", 160, tables(160), ALL, now=0, ttl=5, limits=LeaseLimits(max_num_tokens=160))


def test_per_peer_lease_and_page_quotas_count_lent_and_bound_leases():
    lender = Lender(hybrid(host=False), new_id=ids())
    two = LeaseLimits(max_leases_per_peer=2)
    a = lender.lend("a", 161, tables(), ALL, 0, 10, peer="d0", limits=two)
    t = lender.lend("t", 64, tables(64, offset=30), ALL, 0, 10, limits=two)  # a ticket: nobody's yet
    assert lender.usage("d0") == (1, a.num_pages) and lender.usage(None) == (1, t.num_pages)
    lender.lend("b", 10, tables(10, offset=40), ALL, 0, 10, peer="d0", limits=two)
    before = held(lender)
    with pytest.raises(QuotaExceeded) as info:
        lender.lend("c", 10, tables(10, offset=40), ALL, 0, 10, peer="d0", limits=two)
    assert (info.value.limit, info.value.value, info.value.cap) == ("max_leases_per_peer", 3, 2)
    for claim in (lender.bind, lender.claim):
        with pytest.raises(QuotaExceeded, match="max_leases_per_peer: peer 'd0' would hold live leases: 3"):
            claim(t.id, "d0", 1, limits=two)
    assert lender.get(t.id, 1).peer is None and lender.get(t.id, 1).expires_at == 10  # not bound, not renewed
    assert all((held(lender)[r] == before[r]).all() for r in before)
    lender.lend("c", 10, tables(10, offset=40), ALL, 0, 10, peer="d1", limits=two)  # another peer has its own
    lender.release(a.id)
    assert lender.claim(t.id, "d0", 1, limits=two).peer == "d0"
    assert lender.usage(None) == (0, 0) and lender.usage("d0")[0] == 2
    # Pages: the lease's rows summed over groups.
    pages = LeaseLimits(max_locked_pages_per_peer=a.num_pages)
    lender.lend("a", 161, tables(), ALL, 0, 10, peer="d2", limits=pages)
    with pytest.raises(QuotaExceeded) as info:
        lender.lend("x", 1, tables(1), ALL, 0, 10, peer="d2", limits=pages)
    assert (info.value.limit, info.value.value) == ("max_locked_pages_per_peer", a.num_pages + 3)
    assert lender.usage("d2") == (1, a.num_pages)


def test_leases_past_expiry_do_not_count_against_a_quota_even_before_the_sweep():
    lender = Lender(hybrid(host=False), new_id=ids())
    one = LeaseLimits(max_leases_per_peer=1)
    lender.lend("a", 161, tables(), ALL, 0, 10, peer="d0", limits=one)
    with pytest.raises(QuotaExceeded):
        lender.lend("b", 10, tables(10), ALL, 10, 10, peer="d0", limits=one)  # at its expiry: still live
    lender.lend("b", 10, tables(10), ALL, 10.5, 10, peer="d0", limits=one)
    assert lender.usage("d0")[0] == 2  # both hold locks until the sweep
    assert [x.request for x in lender.expire(10.5)] == ["a"] and lender.usage("d0")[0] == 1


def test_a_claim_past_the_lifetime_changes_nothing():
    lender = Lender(hybrid(host=False), new_id=ids())
    t = lender.lend("t", 161, tables(), ALL, 0, 10, limits=LeaseLimits(max_lease_lifetime=12))
    with pytest.raises(LeaseLifetimeExceeded):
        lender.claim(t.id, "d0", 5)  # would renew it to 15 > 12
    assert lender.get(t.id, 5) == t and lender.usage(None) == (1, t.num_pages) and lender.usage("d0") == (0, 0)
    claimed = lender.claim(t.id, "d0", 2)
    assert (claimed.peer, claimed.expires_at) == ("d0", 12)
    assert lender.claim(t.id, "d0", 2) == claimed  # a repeated claim by its peer is harmless


def test_a_short_ttl_ticket_lease_waits_for_its_claim_then_lives_its_ttl_from_it():
    """``wait``: a ticket's lease outlives its ttl until claimed; the claim sets the expiry from then, even
    earlier; renewals from there on never shorten it; a lease pushed to a peer never waits."""
    lender = Lender(hybrid(host=False), new_id=ids())
    t = lender.lend("t", 161, tables(), ALL, 0, 1.0, wait=30.0, options=LendOptions(ready=0))
    assert (t.ttl, t.expires_at) == (1.0, 30.0)
    assert lender.expire(20.0) == []
    claimed = lender.claim(t.id, "d0", 2.0)
    assert claimed.expires_at == 3.0 and lender.next_expiry() == 3.0
    assert lender.renew(t.id, 2.5).expires_at == 3.5
    assert [x.id for x in lender.expire(3.6)] == [t.id]
    pushed = lender.lend("p", 10, tables(10), ALL, 0, 1.0, peer="d1", wait=30.0)
    assert pushed.expires_at == 1.0
    with pytest.raises(QuotaExceeded):  # what it may wait counts against the lifetime cap like a ttl
        lender.lend("q", 10, tables(10), ALL, 0, 1.0, wait=30.0, limits=LeaseLimits(max_lease_lifetime=12))


def test_a_lease_lent_for_a_prompt_is_claimed_only_with_its_digest_and_a_refusal_changes_nothing():
    lender = Lender(hybrid(host=False), new_id=ids())
    mine = prompt_digest(range(161))
    t = lender.lend("t", 161, tables(), ALL, 0, 10, options=LendOptions(prompt_digest=mine))
    for other in (None, b"", prompt_digest(range(1, 162)), prompt_digest(range(161), context=b"lora-a")):
        with pytest.raises(PromptMismatch):
            lender.claim(t.id, "d0", 5, prompt_digest=other)
        assert lender.get(t.id, 5) == t and lender.usage("d0") == (0, 0)  # not bound, not renewed
    assert isinstance(PromptMismatch("x"), LeaseDenied)  # a decode that maps refusals by base class still refuses
    claimed = lender.claim(t.id, "d0", 5, prompt_digest=mine)
    assert (claimed.peer, claimed.expires_at, claimed.prompt_digest) == ("d0", 15, mine)
    with pytest.raises(PromptMismatch):  # bound to d0 now: its own claim still needs the prompt
        lender.claim(t.id, "d0", 6)


def test_a_prompt_digest_covers_every_token_id_and_the_context():
    base = prompt_digest([1, 2, 3])
    assert len(base) == 32 and base == prompt_digest(np.array([1, 2, 3], dtype=np.int32))
    others = {prompt_digest(ids) for ids in ([1, 2], [1, 2, 3, 0], [3, 2, 1], [1, 2, 3 + (1 << 32)], [])}
    others.add(prompt_digest([1, 2, 3], context=b"img:ab"))
    assert base not in others and len(others) == 6
    for bad in ([1.5], [[1, 2]], ["a"], [1 << 64]):
        with pytest.raises(PageRangeError):
            prompt_digest(bad)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lend", "bind", "release", "expire", "tick"]),
                          st.sampled_from([None, "d0", "d1"]), st.integers(1, 30), st.integers(0, 20)),
                max_size=40))
def test_random_lifecycles_keep_usage_equal_to_live_leases_and_within_quota(ops):
    tpp = 4
    layout = hybrid(tpp=tpp, pages=12, states=4, host=False, window=8, sinks=1)
    lender = Lender(layout, new_id=ids())
    limits = LeaseLimits(max_leases_per_peer=3, max_locked_pages_per_peer=10)
    live: dict[bytes, Lease] = {}
    granted: list[bytes] = []
    now = 0.0
    for i, (kind, peer, n, pick) in enumerate(ops):
        if kind == "lend":
            pages = -(-n // tpp)
            t = {"full": np.arange(pages) % 12, "swa": np.arange(pages)[::-1] % 12, "ssm": np.array([pick % 4])}
            mine = [x for x in live.values() if x.peer == peer and now <= x.expires_at]
            try:
                lease = lender.lend(f"r{i}", n, t, ALL, now, 3, peer, limits=limits)
            except QuotaExceeded as exc:
                assert peer is not None
                if exc.limit == "max_leases_per_peer":
                    assert exc.value == len(mine) + 1 > 3
                else:
                    assert exc.limit == "max_locked_pages_per_peer" and len(mine) + 1 <= 3
                    assert exc.value > 10 and exc.value > sum(x.num_pages for x in mine)
            else:
                live[lease.id] = lease
                granted.append(lease.id)
                if peer is not None:
                    assert len(mine) + 1 <= 3 and sum(x.num_pages for x in mine) + lease.num_pages <= 10
        elif kind == "bind" and granted and peer is not None:
            lease_id = granted[pick % len(granted)]
            try:
                live[lease_id] = lender.bind(lease_id, peer, now, limits=limits)
            except (QuotaExceeded, LeaseError):
                pass
        elif kind == "release" and granted:
            lender.release(granted[pick % len(granted)])
            live.pop(granted[pick % len(granted)], None)
        elif kind == "expire":
            for x in lender.expire(now):
                del live[x.id]
        elif kind == "tick":
            now += pick % 3
        for who in (None, "d0", "d1"):
            mine = [x for x in live.values() if x.peer == who]
            assert lender.usage(who) == (len(mine), sum(x.num_pages for x in mine))
            if who is not None:
                fresh = [x for x in lender.leases_of(who) if now <= x.expires_at]
                assert len(fresh) <= 3 and sum(x.num_pages for x in fresh) <= 10
