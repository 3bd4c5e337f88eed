"""RankRecord: strict registry records, their round trip, their limits and hostile bytes.

Pure: no etcd, no network, no clock.  Every field is checked on decode; whatever bytes or JSON a
writer puts under a rank key, decoding gives a record or a ``RegistryError``, nothing else.  The
view that holds records: ``test_cluster_view.py``; compatible, pick and the router: ``test_cluster_pick.py``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvlend.cluster import ClusterView, RankRecord, ranks_prefix, record_key
from kvlend.cluster.records import _FIELDS, MAX_CAPACITY, MAX_LOAD, MAX_RECORD_BYTES, RECORD_VERSION, layout_digest
from kvlend.core.layout import PageLayout, layout_from_pools
from kvlend.errors import ConfigError, RegistryError
from tests.support.cluster_view import LAYOUTS, PREFIX, RANKS, SAME, as_bytes, decoded, rec, records, valid_body
from tests.support.profiles import examples

pytestmark = pytest.mark.unit


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
