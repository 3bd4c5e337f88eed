"""RankRecord (strict registry records) and ClusterView (the live ranks, from etcd snapshots and events).

Pure: no etcd, no network, no clock.  The view is driven by a simulated etcd
store (a dict and a revision counter) in a hypothesis state machine, and
checked against what the store held at the view's revision.
"""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlend.cluster import JOINED, LEFT, UPDATED, Change, ClusterView, RankRecord, ranks_prefix, record_key
from kvlend.cluster.records import (
    _FIELDS,
    MAX_CAPACITY,
    MAX_LOAD,
    MAX_RECORD_BYTES,
    RECORD_VERSION,
    ROLES,
    layout_digest,
)
from kvlend.core.layout import PageLayout, layout_from_pools
from kvlend.core.negotiate import negotiate
from kvlend.errors import ConfigError, KvlendError, RegistryError
from tests.support.profiles import examples

pytestmark = pytest.mark.unit

PREFIX = "/kvlend/test"
RANKS = PREFIX + "/ranks/"


# ------------------------------------------------------------------ layouts
def pools_layout(*, pages=8, heads=2, tpp=4, head_dim=8, dtype=np.uint16, kept=4096,
                 windows=None, sinks=0) -> PageLayout:
    """A one-layer split K/V layout from numpy pools shaped (pages, heads, tokens_per_page, head_dim)."""
    k = [np.zeros((pages, heads, tpp, head_dim), dtype=dtype)]
    v = [np.zeros((pages, heads, tpp, head_dim), dtype=dtype)]
    return layout_from_pools(k=k, v=v, kept_window=kept, windows=windows, sinks=sinks)


LOCAL = pools_layout()  # the reader: a decode rank
SAME = pools_layout(pages=32)  # capacities do not count: same layout id, identity plan
BIGGER_PAGES = pools_layout(tpp=8)  # a mapped plan: one remote page fills two local pages
WIDE_HEADS = pools_layout(head_dim=16)  # head dimension differs: refused
OTHER_DTYPE = pools_layout(head_dim=4, dtype=np.float32)  # same bytes per head, other element type: refused
GOOD_LAYOUTS = (SAME, BIGGER_PAGES)
BAD_LAYOUTS = (WIDE_HEADS, OTHER_DTYPE)
ALL_LAYOUTS = GOOD_LAYOUTS + BAD_LAYOUTS


def negotiates(local: PageLayout, remote: PageLayout | None) -> bool:
    """The uncached truth ``compatible`` must agree with."""
    if remote is None:
        return False
    try:
        negotiate(local, remote)
    except KvlendError:
        return False
    return True


def test_the_fixture_layouts_negotiate_as_the_tests_assume():
    assert SAME.layout_id == LOCAL.layout_id
    assert BIGGER_PAGES.layout_id != LOCAL.layout_id
    assert negotiate(LOCAL, SAME).kind == "identity"
    assert negotiate(LOCAL, BIGGER_PAGES).kind == "mapped"
    for bad in BAD_LAYOUTS:
        assert bad.layout_id != LOCAL.layout_id
        with pytest.raises(KvlendError):
            negotiate(LOCAL, bad)


# ------------------------------------------------------------------ records
def key(identity: str) -> bytes:
    return (RANKS + identity).encode()


def rec(identity="p0", role="prefill", host="10.0.0.1", port=7000, layout=None, **kw) -> RankRecord:
    if layout is None:
        layout = b"" if role == "router" else SAME.encode()
    elif isinstance(layout, PageLayout):
        layout = layout.encode()
    return RankRecord(identity, role, host, port, layout=layout, **kw)


def view_of(*records: RankRecord, revision: int = 1) -> ClusterView:
    view = new_view()
    changes = view.reset(revision, [(key(r.identity), r.encode()) for r in records])
    assert sorted(c.identity for c in view.ranks()) == sorted(r.identity for r in records)
    assert all(c.kind == JOINED for c in changes) and len(changes) == len(records)
    return view


identities = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}", fullmatch=True)
ENCODED_LAYOUTS = tuple(lay.encode() for lay in ALL_LAYOUTS)
LAYOUTS = {layout_digest(data): data for data in ENCODED_LAYOUTS}  # what a reader has fetched from etcd


def new_view() -> ClusterView:
    """A view that knows every test layout by digest (as if the registry had fetched them)."""
    view = ClusterView(PREFIX)
    for digest, data in LAYOUTS.items():
        view.learn_layout(digest, data)
    return view


@st.composite
def records(draw, identity=identities, role=st.sampled_from(ROLES)) -> RankRecord:
    role = draw(role)
    tp_size = draw(st.integers(1, 1 << 16))
    pp_size = draw(st.integers(1, 1 << 16))
    return RankRecord(
        identity=draw(identity), role=role, host=draw(st.text(min_size=1, max_size=255)),
        port=draw(st.integers(1 if role == "prefill" else 0, 65535)),
        layout=b"" if role == "router" else draw(st.sampled_from(ENCODED_LAYOUTS)),
        tp_size=tp_size, tp_rank=draw(st.integers(0, tp_size - 1)),
        pp_size=pp_size, pp_rank=draw(st.integers(0, pp_size - 1)),
        capacity=draw(st.integers(1, MAX_CAPACITY)), load=draw(st.integers(0, MAX_LOAD)), healthy=draw(st.booleans()),
        meta=draw(st.dictionaries(st.text(min_size=1, max_size=64), st.text(max_size=64), max_size=16)),
    )


@settings(max_examples=examples(150), deadline=None)
@given(records())
def test_record_round_trips(record):
    data = record.encode()
    assert isinstance(data, bytes) and 0 < len(data) <= MAX_RECORD_BYTES
    back = RankRecord.decode(data, LAYOUTS)
    assert back == record
    assert dict(back.meta) == dict(record.meta) and back.layout == record.layout
    assert back.encode() == data  # canonical: sorted keys, no whitespace
    assert RankRecord.decode(bytearray(data), LAYOUTS) == record
    assert json.loads(data)["version"] == RECORD_VERSION
    if record.role == "router":
        assert back.page_layout is None and back.layout_id == ""
    else:
        assert back.layout_id == PageLayout.decode(record.layout).layout_id
    assert back.endpoint == (record.host, record.port)
    assert back.utilisation == record.load / record.capacity
    assert hash(back) == hash(record)


def test_record_meta_is_read_only_and_a_copy():
    meta = {"api": "http://x:8000"}
    r = rec(meta=meta)
    meta["api"] = "changed"
    assert r.meta["api"] == "http://x:8000"
    with pytest.raises(TypeError):
        r.meta["api"] = "y"  # type: ignore[index]


def test_a_record_whose_encoding_is_over_the_cap_refuses_to_encode():
    wide = "\U0001F600"  # JSON escapes it as a surrogate pair: 12 bytes a character
    meta = {f"{i:02d}" + wide * 62: wide * 256 for i in range(16)}
    pools = [np.zeros((2, 1, 4, 2), dtype=np.uint8) for _ in range(4)]
    layout = layout_from_pools(k=pools, v=pools, kept_window=64)  # a few layers: a few hundred bytes more
    r = rec(host=wide * 255, meta=meta, layout=layout)
    assert len(r.host) == 255 and all(len(k) == 64 and len(v) == 256 for k, v in r.meta.items())
    with pytest.raises(RegistryError, match="over the cap"):
        r.encode()


_GARBAGE_LAYOUT = b"\x93\x01\x02\x03 not a layout"

INVALID_FIELDS = [
    ("identity", dict(identity="")),
    ("identity", dict(identity="has space")),
    ("identity", dict(identity="a/b")),
    ("identity", dict(identity="-leading")),
    ("identity", dict(identity="x" * 65)),
    ("identity", dict(identity=7)),
    ("role", dict(role="lender")),
    ("role", dict(role="PREFILL")),
    ("role", dict(role=None)),
    ("host", dict(host="")),
    ("host", dict(host="h" * 256)),
    ("host", dict(host=None)),
    ("host", dict(host=b"10.0.0.1")),
    ("port", dict(port=-1)),
    ("port", dict(port=65536)),
    ("port", dict(port=True)),
    ("port", dict(port=7000.0)),
    ("port", dict(port="7000")),
    ("port", dict(port=0)),  # a prefill must publish the port decodes dial
    ("tp_size", dict(tp_size=0)),
    ("tp_size", dict(tp_size=True)),
    ("tp_size", dict(tp_size=(1 << 16) + 1)),
    ("pp_size", dict(pp_size=0)),
    ("tp_rank", dict(tp_rank=-1)),
    ("tp_rank", dict(tp_size=2, tp_rank=2)),
    ("tp_rank", dict(tp_size=1, tp_rank=1)),
    ("pp_rank", dict(pp_size=4, pp_rank=4)),
    ("pp_rank", dict(pp_rank=False)),
    ("capacity", dict(capacity=0)),
    ("capacity", dict(capacity=-3)),
    ("capacity", dict(capacity=True)),
    ("capacity", dict(capacity=MAX_CAPACITY + 1)),
    ("capacity", dict(capacity=1 << 40)),  # it would win every routing pick
    ("load", dict(load=MAX_LOAD + 1)),
    ("load", dict(load=-1)),
    ("load", dict(load=False)),
    ("load", dict(load=1.5)),
    ("layout", dict(layout="text")),
    ("layout", dict(layout=bytearray(SAME.encode()))),
    ("layout", dict(layout=memoryview(SAME.encode()))),
    ("layout", dict(layout=_GARBAGE_LAYOUT)),
    ("layout", dict(role="router", port=0, layout=SAME.encode())),  # a router has no layout
    ("layout", dict(role="prefill", layout=b"")),  # a prefill needs one
    ("layout", dict(role="decode", layout=b"")),
    ("meta", dict(meta={"k": 1})),
    ("meta", dict(meta={1: "v"})),
    ("meta", dict(meta={"": "v"})),
    ("meta", dict(meta={"k" * 65: "v"})),
    ("meta", dict(meta={"k": "v" * 257})),
    ("meta", dict(meta={f"k{i}": "v" for i in range(17)})),
    ("meta", dict(meta=[("k", "v")])),
    ("meta", dict(meta="k=v")),
    ("meta", dict(meta=None)),
]


@pytest.mark.parametrize("field,override", INVALID_FIELDS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID_FIELDS)])
def test_every_invalid_field_is_a_registry_error_naming_it(field, override):
    kw = dict(identity="p0", role="prefill", host="10.0.0.1", port=7000, layout=SAME.encode())
    kw.update(override)
    with pytest.raises(RegistryError, match=field) as info:
        RankRecord(**kw)
    assert field in str(info.value)


def test_the_limits_themselves_are_valid():
    r = rec(identity="a" * 64, host="h" * 255, port=65535, tp_size=1 << 16, tp_rank=(1 << 16) - 1,
            pp_size=3, pp_rank=2, capacity=MAX_CAPACITY, load=MAX_LOAD,
            meta={"k" * 64: "v" * 256, **{f"m{i}": "" for i in range(15)}})
    assert RankRecord.decode(r.encode(), LAYOUTS) == r
    assert rec(role="decode", port=0).port == 0  # a decode that only dials out
    assert rec(role="router", port=0).layout == b""
    assert rec(identity="A1._:@-z").identity == "A1._:@-z"


# ------------------------------------------------------------- hostile bytes
def decoded(data) -> RankRecord | RegistryError:
    """What ``decode`` makes of ``data``: a record or a RegistryError; anything else fails the test."""
    try:
        return RankRecord.decode(data, LAYOUTS)
    except RegistryError as exc:
        return exc


def valid_body(**override) -> dict:
    body = json.loads(rec(meta={"api": "x"}).encode())
    body.update(override)
    return body


def as_bytes(obj) -> bytes:
    return json.dumps(obj).encode()


HOSTILE = [
    ("expected 1..", b""),
    ("expected 1..", "{}"),  # text, not bytes
    ("expected 1..", None),
    ("expected 1..", memoryview(rec().encode())),
    ("expected 1..", b" " * (MAX_RECORD_BYTES + 1)),
    ("expected 1..", rec().encode() + b" " * MAX_RECORD_BYTES),  # valid JSON, but over the cap
    ("not JSON", b"\xff\xfe\x00garbage"),
    ("not JSON", b"{"),
    ("not JSON", b"{'version': 1}"),
    ("not JSON", b"\x80" * 10),
    ("not JSON", rec().encode()[:-1]),
    ("version", b"[1, 2]"),
    ("version", b"\"text\""),
    ("version", b"null"),
    ("version", b"42"),
    ("version", as_bytes([valid_body()])),
    ("version", as_bytes(valid_body(version=1))),  # a layout carried whole: an older rank
    ("version", as_bytes(valid_body(version=4))),
    ("version", as_bytes(valid_body(version=2))),  # unsigned: a rank before records were signed
    ("version", as_bytes(valid_body(version=0))),
    ("version", as_bytes(valid_body(version="2"))),
    ("version", as_bytes(valid_body(version=None))),
    ("version", as_bytes({k: v for k, v in valid_body().items() if k != "version"})),
    ("record.layout: expected a layout digest", as_bytes(valid_body(layout=5))),
    ("record.layout: expected a layout digest", as_bytes(valid_body(layout=None))),
    ("record.layout: expected a layout digest", as_bytes(valid_body(layout=list(SAME.encode())))),
    ("not known", as_bytes(valid_body(layout="!!!!"))),
    ("not known", as_bytes(valid_body(layout=layout_digest(_GARBAGE_LAYOUT)))),  # never fetched
    ("not known", as_bytes(valid_body(layout=layout_digest(SAME.encode()).upper()))),
    ("record.layout", as_bytes(valid_body(role="router"))),  # router carrying a layout
    ("record.capacity", as_bytes(valid_body(capacity=1 << 40))),
    ("record.load", as_bytes(valid_body(load=1 << 40))),
    ("record.identity", as_bytes(valid_body(identity=17))),
    ("record.identity", as_bytes(valid_body(identity="a b"))),
    ("record.role", as_bytes(valid_body(role=["prefill"]))),
    ("record.host", as_bytes(valid_body(host=None))),
    ("record.host", as_bytes(valid_body(host=""))),
    ("record.port", as_bytes(valid_body(port="7000"))),
    ("record.port", as_bytes(valid_body(port=7000.5))),
    ("record.port", as_bytes(valid_body(port=True))),
    ("record.port", as_bytes(valid_body(port=1 << 70))),
    ("record.capacity", as_bytes(valid_body(capacity=0))),
    ("record.load", as_bytes(valid_body(load=-1))),
    ("tp_rank", as_bytes(valid_body(tp_rank=1))),
    ("record.meta", as_bytes(valid_body(meta=["api", "x"]))),
    ("record.meta", as_bytes(valid_body(meta={"api": 1}))),
    ("record.meta", as_bytes(valid_body(meta=None))),
    ("record.load", b'{"version":3,"identity":"p0","role":"prefill","host":"h","port":1,"layout":"'
     + layout_digest(SAME.encode()).encode() + b'","tp_size":1,"tp_rank":0,"pp_size":1,"pp_rank":0,'
     b'"capacity":1,"load":NaN,"healthy":true,"meta":{}}'),
    ("record.healthy", as_bytes(valid_body(healthy=1))),
    ("record.healthy", as_bytes(valid_body(healthy="yes"))),
]


@pytest.mark.parametrize("why,data", HOSTILE, ids=[f"{i}" for i in range(len(HOSTILE))])
def test_hostile_bytes_are_a_registry_error(why, data):
    with pytest.raises(RegistryError) as info:
        RankRecord.decode(data, LAYOUTS)
    assert why in str(info.value)


@pytest.mark.parametrize("missing", _FIELDS)
def test_every_missing_field_is_a_registry_error(missing):
    body = valid_body()
    del body[missing]
    with pytest.raises(RegistryError, match="version" if missing == "version" else f"missing fields \\['{missing}'\\]"):
        RankRecord.decode(as_bytes(body), LAYOUTS)


def test_unknown_fields_are_ignored_and_whitespace_is_fine():
    body = valid_body(extra={"future": [1, 2]})
    back = RankRecord.decode(json.dumps(body, indent=2).encode(), LAYOUTS)
    assert back == rec(meta={"api": "x"})


@pytest.mark.parametrize("version", [2.0])
def test_a_version_that_only_compares_equal_to_the_current_one_is_refused(version):
    # ``2.0 == 2`` in Python: the record's version check should be as strict as
    # its int fields (and as ``PageLayout``'s own version check), which refuse bools and floats.
    with pytest.raises(RegistryError, match="version"):
        RankRecord.decode(as_bytes(valid_body(version=version)), LAYOUTS)


@pytest.mark.parametrize("depth", [2_000, 8_000])
def test_deeply_nested_json_is_a_registry_error_not_a_crash(depth):
    # Well under MAX_RECORD_BYTES, but json.loads raises RecursionError (not ValueError) on it.
    for data in (b"[" * depth + b"]" * depth, b'{"version":1,"meta":' + b"[" * depth + b"]" * depth + b"}"):
        assert len(data) <= MAX_RECORD_BYTES
        assert isinstance(decoded(data), RegistryError)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=examples(300), deadline=None)
@given(st.binary(min_size=0, max_size=600))
def test_random_bytes_never_raise_anything_but_registry_error(data):
    assert isinstance(decoded(data), RegistryError)


@settings(max_examples=examples(300), deadline=None)
@given(st.dictionaries(st.sampled_from(_FIELDS + ("extra",)), json_values, max_size=len(_FIELDS) + 1),
       st.just(RECORD_VERSION) | json_values)
def test_random_json_objects_never_raise_anything_but_registry_error(obj, version):
    obj["version"] = version
    out = decoded(as_bytes(obj))
    assert isinstance(out, RegistryError)  # no random object is a whole valid record (role, layout, ...)


@settings(max_examples=examples(300), deadline=None)
@given(records(), st.data())
def test_mutated_valid_records_decode_or_raise_registry_error(record, data):
    body = json.loads(record.encode())
    fields = data.draw(st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=4, unique=True))
    for name in fields:
        body[name] = data.draw(json_values | st.sampled_from(["", "prefill", "router", 0, 1, 65536, -1]))
    out = decoded(as_bytes(body))
    if isinstance(out, RankRecord):  # the mutations happened to be valid: it says what the JSON says
        assert body["version"] == RECORD_VERSION
        assert out.identity == body["identity"] and out.role == body["role"] and out.port == body["port"]
        assert out.layout == (LAYOUTS[body["layout"]] if body["layout"] else b"") and dict(out.meta) == body["meta"]
    else:
        assert isinstance(out, RegistryError)


# ------------------------------------------------------------------ keys
def test_ranks_prefix_and_record_key():
    assert ranks_prefix("/kvlend/prod") == "/kvlend/prod/ranks/"
    assert ranks_prefix("/x") == "/x/ranks/"
    assert record_key("/kvlend/prod", "prefill-0") == "/kvlend/prod/ranks/prefill-0"
    assert record_key(PREFIX, "a@b:1") == RANKS + "a@b:1"
    assert ranks_prefix("/" + "a" * 199) == "/" + "a" * 199 + "/ranks/"


@pytest.mark.parametrize("prefix", ["", "/", "kvlend/prod", "/kvlend/prod/", "/" + "a" * 200, None, b"/kvlend", 5])
def test_bad_prefixes_are_config_errors(prefix):
    with pytest.raises(ConfigError, match="registry prefix"):
        ranks_prefix(prefix)
    with pytest.raises(ConfigError):
        record_key(prefix, "p0")
    with pytest.raises(ConfigError):
        ClusterView(prefix)


@pytest.mark.parametrize("identity", ["", "a/b", "../x", "a b", "-x", "x" * 65, None, 3])
def test_record_key_refuses_bad_identities(identity):
    with pytest.raises(ConfigError, match="identity"):
        record_key(PREFIX, identity)


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
