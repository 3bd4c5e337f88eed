"""ClusterView: the live ranks, from etcd snapshots and events.

Pure: no etcd, no network, no clock.  The view is driven by hand, then by a simulated etcd
store (a dict and a revision counter) in a hypothesis state machine, and checked against what
the store held at the view's revision.  Records themselves: ``test_cluster_records.py``; compatible,
pick and the router: ``test_cluster_pick.py``.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlend.cluster import JOINED, LEFT, UPDATED, Change, ClusterView, RankRecord
from kvlend.cluster.records import ROLES, layout_digest
from kvlend.errors import RegistryError
from tests.support.cluster_view import (
    ENCODED_LAYOUTS,
    LOCAL,
    PREFIX,
    RANKS,
    SAME,
    decoded,
    key,
    negotiates,
    new_view,
    pools_layout,
    rec,
    valid_body,
    view_of,
)
from tests.support.profiles import examples

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------ the view, by hand
def test_put_update_identical_put_and_delete():
    view = new_view()
    a = rec("p0", load=1)
    assert view.put(5, key("p0"), a.encode()) == [Change(JOINED, a)]
    assert view.revision == 5 and view.get("p0") == a and view.ranks() == [a]
    assert view.put(6, key("p0"), a.encode()) == []  # identical: nothing to tell
    assert view.revision == 6
    b = rec("p0", load=2)
    assert view.put(7, key("p0"), b.encode()) == [Change(UPDATED, b)]
    assert view.delete(8, key("p0")) == [Change(LEFT, b)]
    assert view.ranks() == [] and view.get("p0") is None
    assert view.delete(9, key("p0")) == []  # already gone


def test_old_and_repeated_events_are_ignored():
    view = new_view()
    a, b = rec("p0", load=1), rec("p0", load=2)
    view.put(10, key("p0"), b.encode())
    assert view.put(9, key("p0"), a.encode()) == [] and view.get("p0") == b
    assert view.put(10, key("p0"), b.encode()) == [] and view.get("p0") == b  # the same event again
    assert view.delete(3, key("p0")) == [] and view.get("p0") == b
    assert view.revision == 10
    view.reset(20, [(key("p0"), a.encode())])
    assert view.put(19, key("p1"), rec("p1").encode()) == []  # before the snapshot: already in it (or not)
    assert view.ranks() == [a]


def test_reset_reports_joined_left_updated_and_takes_the_snapshots_revision():
    view = new_view()
    p0, p1, d0 = rec("p0"), rec("p1"), rec("d0", role="decode", port=0)
    view.reset(4, [(key("p0"), p0.encode()), (key("p1"), p1.encode())])
    p1b = rec("p1", load=3)
    changes = view.reset(9, [(key("p1"), p1b.encode()), (key("d0"), d0.encode())])
    assert sorted((c.kind, c.record.identity) for c in changes) == [(JOINED, "d0"), (LEFT, "p0"), (UPDATED, "p1")]
    assert Change(LEFT, p0) in changes and Change(UPDATED, p1b) in changes
    assert view.ranks() == [d0, p1b] and view.revision == 9
    assert view.reset(9, [(key("p1"), p1b.encode()), (key("d0"), d0.encode())]) == []
    view.reset(2, [])  # an older snapshot (a lagging member): its contents and its revision, so the
    assert view.revision == 2 and view.ranks() == []  # watch after it replays what came since


def test_ranks_filters_by_role_and_sorts_by_identity():
    p1, p0 = rec("p1"), rec("p0")
    d0, r0 = rec("d0", role="decode", port=0), rec("r0", role="router", port=0)
    view = view_of(p1, r0, d0, p0)
    assert view.ranks() == [d0, p0, p1, r0]
    assert view.ranks("prefill") == [p0, p1]
    assert view.ranks("decode") == [d0] and view.ranks("router") == [r0]
    assert view.ranks("nobody") == []


@pytest.mark.parametrize("revision", [-1, True, "3", 2.0, None])
def test_bad_revisions_are_registry_errors(revision):
    view = new_view()
    with pytest.raises(RegistryError, match="revision"):
        view.put(revision, key("p0"), rec().encode())
    with pytest.raises(RegistryError, match="revision"):
        view.delete(revision, key("p0"))
    assert view.ranks() == [] and view.revision == 0


def test_a_reset_with_a_bad_revision_changes_nothing():
    view = view_of(rec("p0"))
    with pytest.raises(RegistryError, match="revision"):
        view.reset(-1, [(key("p1"), rec("p1").encode()), (b"/elsewhere", b"x")])
    # It raised, so the caller got no Changes: the state must be what it was.
    assert [r.identity for r in view.ranks()] == ["p0"] and view.rejected == {} and view.revision == 1


def test_one_revision_may_carry_several_events():
    # etcd gives every key a transaction touches the same revision: ``etcdctl del --prefix`` or one
    # lease revoked with several keys attached is N delete events at ONE revision.  Each key changes
    # at most once per revision, so applying an event at the view's own revision is idempotent.
    view = view_of(rec("p0"), rec("p1"), rec("p2"), revision=5)
    changes = [c for name in ("p0", "p1", "p2") for c in view.delete(6, key(name))]
    assert sorted(c.record.identity for c in changes) == ["p0", "p1", "p2"]
    assert view.ranks() == []


# ------------------------------------------------------------------ rejected keys
@pytest.mark.parametrize("bad_key", [
    b"/kvlend/other/ranks/p0", b"/kvlend/test/ranksp0", b"/kvlend/test/ranks", b"/kvlend/testing/ranks/p0",
    b"/kvlend/tes/ranks/p0", b"kvlend/test/ranks/p0", b"/kvlend/test/ranks/", b"/kvlend/test/ranks/p0/x",
    b"/KVLEND/test/ranks/p0",
])
def test_keys_outside_the_prefix_are_rejected(bad_key):
    value = rec("p0").encode()
    view = new_view()
    assert view.put(1, bad_key, value) == []
    assert view.ranks() == [] and view.get("p0") is None
    assert list(view.rejected) == [bad_key.decode()]
    assert view.delete(2, bad_key) == [] and view.rejected == {}
    view.reset(3, [(bad_key, value)])
    assert view.ranks() == [] and list(view.rejected) == [bad_key.decode()]


def test_a_record_whose_identity_differs_from_its_key_is_rejected():
    view = new_view()
    p0 = rec("p0")
    view.put(1, key("p0"), p0.encode())
    impostor = rec("p1", load=9)
    assert view.put(2, key("p0"), impostor.encode()) == []  # refused: p0 keeps its last valid record
    assert view.ranks() == [p0] and view.get("p1") is None
    assert "p1" in view.rejected[RANKS + "p0"] and "p0" in view.rejected[RANKS + "p0"]
    assert view.put(3, key("p0"), p0.encode()) == []
    assert view.rejected == {}
    view.reset(4, [(key("p2"), impostor.encode())])
    assert view.ranks() == [] and list(view.rejected) == [RANKS + "p2"]


def test_garbage_under_a_rank_key_keeps_the_last_valid_record_and_is_listed():
    view = view_of(rec("p0"))
    assert view.put(2, key("p0"), b"not json") == []  # a live rank's links must not go with its record
    assert view.get("p0") == rec("p0") and "not JSON" in view.rejected[RANKS + "p0"]
    assert view.put(3, key("p1"), b"\x00") == [] and view.get("p1") is None
    assert set(view.rejected) == {RANKS + "p0", RANKS + "p1"}
    liar = rec("p0", capacity=2).encode().replace(b'"capacity":2', b'"capacity":1099511627776')
    assert view.put(4, key("p0"), liar) == [] and view.get("p0") == rec("p0")
    assert "record.capacity" in view.rejected[RANKS + "p0"]
    assert view.reset(5, [(key("p0"), b"not json"), (key("p1"), b"\x00")]) == []  # a snapshot keeps it too
    assert view.get("p0") == rec("p0") and view.pick(LOCAL) == rec("p0")
    assert view.put(6, key("p0"), rec("p0", load=1).encode()) == [Change(UPDATED, rec("p0", load=1))]
    assert set(view.rejected) == {RANKS + "p1"}
    assert view.delete(7, key("p0")) == [Change(LEFT, rec("p0", load=1))]  # a delete is a rank leaving
    assert view.delete(8, key("p1")) == [] and view.rejected == {}


def test_a_rank_whose_key_stays_refused_past_the_grace_leaves():
    view = view_of(rec("p0"), rec("p1"))
    assert view.put(2, key("p0"), b"junk", now=10.0) == [] and view.put(3, key("p0"), b"more junk", now=12.0) == []
    assert view.expire_refused(14.9, grace=5.0) == [] and view.get("p0") == rec("p0")  # since the first refusal
    assert view.expire_refused(15.0, grace=5.0) == [Change(LEFT, rec("p0"))]
    assert view.get("p0") is None and RANKS + "p0" in view.rejected and view.expire_refused(99.0, 5.0) == []
    # put back in time: the clock starts again at the next refusal; a snapshot keeps the first refusal's time
    assert view.put(4, key("p1"), b"junk", now=20.0) == []
    assert view.put(5, key("p1"), rec("p1", load=1).encode(), now=21.0) == [Change(UPDATED, rec("p1", load=1))]
    assert view.expire_refused(40.0, grace=5.0) == []
    assert view.put(6, key("p1"), b"junk", now=41.0) == []
    assert view.reset(7, [(key("p1"), b"junk")], now=44.0) == [] and view.get("p1") == rec("p1", load=1)
    assert view.expire_refused(46.0, grace=5.0) == [Change(LEFT, rec("p1", load=1))]
    assert view.ranks() == []


def test_deeply_nested_json_under_a_rank_key_is_rejected_not_raised():
    view = view_of(rec("p0"))
    bomb = b"[" * 5000 + b"]" * 5000
    assert view.put(2, key("p0"), bomb) == [] and view.get("p0") == rec("p0")
    assert RANKS + "p0" in view.rejected
    assert view.reset(3, [(key("p1"), bomb)]) == [Change(LEFT, rec("p0"))]
    assert list(view.rejected) == [RANKS + "p1"]


def test_a_layout_is_learnt_only_under_its_own_digest():
    view = ClusterView(PREFIX)
    data = SAME.encode()
    with pytest.raises(RegistryError, match="do not hash"):
        view.learn_layout(layout_digest(data), LOCAL.encode() + b"x")
    with pytest.raises(RegistryError, match="expected 1.."):
        view.learn_layout(layout_digest(b""), b"")
    assert view.put(1, key("p0"), rec("p0").encode()) == [] and "not known" in view.rejected[RANKS + "p0"]
    view.learn_layout(layout_digest(data), data)
    assert view.put(2, key("p0"), rec("p0").encode()) == [Change(JOINED, rec("p0"))]



def test_remembered_layouts_are_bounded_but_never_those_in_use_or_kept():
    from kvlend.cluster.view import MAX_LAYOUTS
    view = new_view()
    view.put(1, key("p0"), rec("p0").encode())  # uses SAME
    spare = [pools_layout(pages=p).encode() for p in range(40, 40 + MAX_LAYOUTS)]  # distinct by pages: ids
    batch = {layout_digest(d) for d in spare}
    for data in spare[:-1]:
        view.learn_layout(layout_digest(data), data, keep=batch)  # one snapshot's worth, fetched together
    assert batch - {layout_digest(spare[-1])} <= set(view.layouts) and len(view.layouts) == MAX_LAYOUTS
    with pytest.raises(RegistryError, match="at most"):  # in use or kept: the bound holds, the newcomer waits
        view.learn_layout(layout_digest(spare[-1]), spare[-1], keep=batch)
    view.learn_layout(layout_digest(LOCAL.encode()), LOCAL.encode())  # past the cap: the unused go
    assert set(view.layouts) == {layout_digest(SAME.encode()), layout_digest(LOCAL.encode())}


def test_non_utf8_keys_are_rejected_and_never_ranked():
    bad = b"/kvlend/test/ranks/p\xff0"
    view = new_view()
    assert view.put(1, bad, rec("p0").encode()) == []
    assert view.ranks() == [] and len(view.rejected) == 1
    (name,) = view.rejected
    assert name == repr(bad) and "not under" in view.rejected[name]
    view.reset(2, [(bad, rec("p0").encode()), (key("p1"), rec("p1").encode())])
    assert [r.identity for r in view.ranks()] == ["p1"] and list(view.rejected) == [repr(bad)]


def test_deleting_a_non_utf8_key_clears_its_rejection():
    # ``rejected`` lists the refused keys that are present; once deleted a key has no value to refuse.
    bad = b"\xff\xfe/kvlend/test/ranks/p0"
    view = new_view()
    view.put(1, bad, b"anything")
    assert len(view.rejected) == 1
    view.delete(2, bad)
    assert view.rejected == {}


# ------------------------------------------------------------------ the view, stateful
IDS = ("p0", "p1", "d0", "r0")
OUTSIDE = (b"/kvlend/other/ranks/p0", b"/kvlend/test/ranksp1", b"/kvlend/test/ranks/", b"/kvlend/test/ranks/p0/x",
           b"/kvlend/testing/ranks/d0")
GARBAGE = (b"", b"not json", b"[]", b"{}", b"\xff\xfe", b'{"version":2}',
           json.dumps(valid_body(layout="!!!")).encode(), json.dumps(valid_body(port=0)).encode())


@st.composite
def machine_records(draw, identity):
    role = draw(st.sampled_from(ROLES))
    return RankRecord(identity, role, draw(st.sampled_from(("h1", "h2"))),
                      draw(st.sampled_from((7000, 7001))) if role == "prefill" else 0,
                      layout=b"" if role == "router" else draw(st.sampled_from(ENCODED_LAYOUTS)),
                      capacity=draw(st.integers(1, 3)), load=draw(st.integers(0, 2)),
                      meta=draw(st.sampled_from(({}, {"api": "x"}))))


class Registry(RuleBasedStateMachine):
    """A simulated etcd (a dict, a revision counter, the event log) and a view fed from it."""

    def __init__(self) -> None:
        super().__init__()
        self.view = new_view()
        self.store: dict[bytes, bytes] = {}
        self.meaning: dict[bytes, RankRecord | None] = {}  # what each stored value is: a record, or garbage
        self.history: dict[int, dict[bytes, RankRecord | None]] = {0: {}}  # revision -> meaning then
        self.log: list[tuple[int, str, bytes, bytes | None]] = []  # (revision, op, key, value)
        self.revision = 0
        self.delivered = 0  # index in log of the next event the view has not seen
        self.view_revision = 0
        self.expected: dict[str, RankRecord] = {}  # each rank's last valid record the view was given

    @staticmethod
    def _rank(k: bytes) -> str | None:
        """The identity a key is the rank key of (None for keys outside the ranks)."""
        text = k.decode("utf-8", "replace")
        return text[len(RANKS):] if text.startswith(RANKS) and text[len(RANKS):] in IDS else None

    # -------------------------------------------------------- etcd side
    def _write(self, op: str, k: bytes, value: bytes | None, meaning: RankRecord | None) -> None:
        self.revision += 1
        if op == "put":
            self.store[k], self.meaning[k] = value, meaning
        else:
            del self.store[k], self.meaning[k]
        self.log.append((self.revision, op, k, value))
        self.history[self.revision] = dict(self.meaning)

    @rule(data=st.data(), identity=st.sampled_from(IDS))
    def put_valid(self, data, identity):
        record = data.draw(machine_records(identity))
        self._write("put", key(identity), record.encode(), record)

    @precondition(lambda self: any(m is not None for m in self.meaning.values()))
    @rule(data=st.data())
    def put_same_again(self, data):
        k = data.draw(st.sampled_from(sorted(k for k, m in self.meaning.items() if m is not None)))
        self._write("put", k, self.store[k], self.meaning[k])

    @rule(identity=st.sampled_from(IDS), value=st.sampled_from(GARBAGE) | st.binary(max_size=40))
    def put_garbage(self, identity, value):
        assume(isinstance(decoded(value), RegistryError))
        self._write("put", key(identity), value, None)

    @rule(data=st.data(), identity=st.sampled_from(IDS), other=st.sampled_from(IDS))
    def put_impostor(self, data, identity, other):
        assume(identity != other)
        self._write("put", key(identity), data.draw(machine_records(other)).encode(), None)

    @rule(data=st.data(), k=st.sampled_from(OUTSIDE), identity=st.sampled_from(IDS))
    def put_outside(self, data, k, identity):
        self._write("put", k, data.draw(machine_records(identity)).encode(), None)

    @precondition(lambda self: bool(self.store))
    @rule(data=st.data())
    def delete(self, data):
        self._write("delete", data.draw(st.sampled_from(sorted(self.store))), None, None)

    # -------------------------------------------------------- view side
    def _state(self) -> dict[str, RankRecord]:
        return {r.identity: r for r in self.view.ranks()}

    def _check_changes(self, before: dict[str, RankRecord], changes: list[Change]) -> None:
        after = dict(before)
        seen = set()
        for change in changes:
            assert isinstance(change, Change)
            identity = change.record.identity
            assert identity not in seen, f"two changes for {identity} in one call"
            seen.add(identity)
            if change.kind == JOINED:
                assert identity not in after
                after[identity] = change.record
            elif change.kind == LEFT:
                assert after.get(identity) == change.record  # the last one known
                del after[identity]
            elif change.kind == UPDATED:
                assert identity in after and after[identity] != change.record
                after[identity] = change.record
            else:
                raise AssertionError(f"unknown change kind {change.kind!r}")
        assert after == self._state()

    def _deliver(self, event) -> list[Change]:
        revision, op, k, value = event
        return self.view.put(revision, k, value) if op == "put" else self.view.delete(revision, k)

    def _expect(self, event) -> None:
        """What a fresh event does to the ranks: a valid put sets, a delete removes, garbage changes nothing."""
        revision, op, k, _ = event
        meaning, identity = self.history[revision].get(k), self._rank(k)
        if op == "delete" and identity is not None:
            self.expected.pop(identity, None)
        elif op == "put" and meaning is not None:
            self.expected[meaning.identity] = meaning

    @precondition(lambda self: self.delivered < len(self.log))
    @rule(n=st.integers(1, 4))
    def deliver(self, n):
        for event in self.log[self.delivered:self.delivered + n]:
            before = self._state()
            changes = self._deliver(event)
            self._expect(event)
            self._check_changes(before, changes)
            self.delivered += 1
            self.view_revision = event[0]
            assert self.view.revision == self.view_revision

    @precondition(lambda self: self.view_revision > 0 and self.delivered > 0)
    @rule(data=st.data())
    def redeliver_old(self, data):
        old = [e for e in self.log[:self.delivered] if e[0] <= self.view.revision]
        event = data.draw(st.sampled_from(old))
        before, rejected, revision = self._state(), dict(self.view.rejected), self.view.revision
        assert self._deliver(event) == []
        assert self._state() == before and self.view.rejected == rejected and self.view.revision == revision

    @rule(data=st.data())
    def snapshot(self, data):
        items = data.draw(st.permutations(sorted(self.store.items())))
        before = self._state()
        changes = self.view.reset(self.revision, items)
        kept = {i: r for i, r in self.expected.items() if self.meaning.get(key(i), "absent") is None}
        self.expected = {**kept, **{m.identity: m for m in self.meaning.values() if m is not None}}
        self._check_changes(before, changes)
        self.delivered = len(self.log)  # a watch restarts from revision + 1
        self.view_revision = self.revision

    # -------------------------------------------------------- invariants
    @invariant()
    def view_is_the_store_at_its_revision(self):
        assert self.view.revision == self.view_revision
        then = self.history[self.view_revision]
        valid = self.expected  # the valid records at that revision, and the last valid one under garbage
        assert self.view.ranks() == [valid[i] for i in sorted(valid)]
        for identity in IDS:
            assert self.view.get(identity) == valid.get(identity)
        assert set(self.view.rejected) == {k.decode() for k, m in then.items() if m is None}
        if self.delivered == len(self.log):  # caught up: at least the valid records in the store now
            assert {r.identity for r in self.view.ranks()} >= {m.identity for m in self.meaning.values() if m}

    @invariant()
    def compatible_agrees_with_negotiate(self):
        for role in ("prefill", "decode"):
            truth = [r for r in self.view.ranks(role) if negotiates(LOCAL, r.page_layout)]
            assert self.view.compatible(LOCAL, role) == truth


Registry.TestCase.settings = settings(max_examples=examples(60), stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_registry_stateful = Registry.TestCase
