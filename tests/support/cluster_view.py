"""What the ``test_cluster_*`` view and record files share: the test layouts, records and a view knowing them.

``LOCAL`` is the reader (a decode rank); the other layouts negotiate with it (``GOOD_LAYOUTS``) or are
refused (``BAD_LAYOUTS``).  ``new_view`` knows every test layout by digest, as if the registry had
fetched them from etcd; ``records`` draws valid records (hypothesis).
"""

from __future__ import annotations

import json

import numpy as np
from hypothesis import strategies as st

from kvlend.cluster import JOINED, ClusterView, RankRecord
from kvlend.cluster.records import MAX_CAPACITY, MAX_LOAD, ROLES, layout_digest
from kvlend.core.layout import PageLayout, layout_from_pools
from kvlend.core.negotiate import negotiate
from kvlend.errors import KvlendError, RegistryError

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
