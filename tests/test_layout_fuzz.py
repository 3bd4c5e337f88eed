"""Decoding a peer's layout bytes: hostile input raises LayoutError, nothing else, and never hangs.

A seeded loop mutates valid encodings (bit flips, truncation, insertion,
deletion, splicing, msgpack headers that claim huge sizes, structurally valid
msgpack with wrong types, missing or unknown fields); hypothesis adds random
bytes, random msgpack values and field-level mutations of generated layouts.
Whatever decodes must be a valid layout that round-trips.
"""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from kvlend.core.layout import (
    PageLayout,
)
from kvlend.errors import LayoutError
from tests.support.layout_fuzz import (
    ENUM_STRINGS,
    FIELDS,
    HANG_GUARD_S,
    HUGE_CLAIMS,
    SEED_DICTS,
    SEEDS,
    containers,
    decode_or_layout_error,
    hang_guard,
    huge_claim_inside_a_layout,
    mutate_bytes,
    mutate_structure,
    seed_layouts,
)
from tests.support.profiles import examples
from tests.support.strategies import layouts

pytestmark = pytest.mark.unit

ROUNDS = 10_000
def test_seed_encodings_decode():
    for data, lay in zip(SEEDS, seed_layouts()):
        assert PageLayout.decode(data) == lay


def test_ten_thousand_hostile_encodings_raise_only_layout_error():
    rng = random.Random(0x6B766C)
    makers = (mutate_bytes, mutate_bytes, mutate_bytes, mutate_structure, mutate_structure, huge_claim_inside_a_layout)
    decoded, messages = 0, set()
    with hang_guard(HANG_GUARD_S):
        for i in range(ROUNDS):
            data = rng.choice(makers)(rng)
            try:
                lay = PageLayout.decode(data)
            except LayoutError as exc:
                messages.add(str(exc).split(":")[0])
                continue
            except Exception as exc:
                pytest.fail(f"round {i}: {type(exc).__name__}: {exc} for input {data[:120].hex()}...")
            assert PageLayout.decode(lay.encode()) == lay
            decoded += 1
    # Most inputs are refused, for many different reasons (the fuzz reaches deep validation).
    assert decoded < ROUNDS // 4
    assert len(messages) > 30, sorted(messages)


@pytest.mark.parametrize("claim", HUGE_CLAIMS)
def test_huge_size_claims_are_refused(claim):
    with pytest.raises(LayoutError, match="not valid msgpack"):
        PageLayout.decode(claim)
    body = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in SEED_DICTS[0].items() if k != "buffers")
    with pytest.raises(LayoutError, match="not valid msgpack"):
        PageLayout.decode(b"\x88" + body + msgpack.packb("buffers") + claim)


def test_deeply_nested_values_are_refused_without_recursion_error():
    nested = []
    for _ in range(1000):
        nested = [nested]
    for field in ("dtype", "version", "tokens_per_page", "scope"):
        with pytest.raises(LayoutError, match=rf"^{field}|layout\.{field}"):
            PageLayout.decode(msgpack.packb({**SEED_DICTS[0], field: nested}))


def test_wrong_types_missing_and_unknown_fields_name_the_field():
    d = SEED_DICTS[1]
    cases = [
        ({**d, "tokens_per_page": "16"}, r"tokens_per_page: must be an int, got str '16'"),
        ({**d, "kept_window": 2**64 - 1}, r"kept_window: must be in \[1, 2\*\*63\), got 18446744073709551615"),
        ({k: v for k, v in d.items() if k != "dtype"}, r"layout: missing fields \['dtype'\], unknown fields \[\]"),
        ({**d, "colour": 1}, r"layout: missing fields \[\], unknown fields \['colour'\]"),
        ({**d, "regions": {}}, "regions: expected a list, got dict"),
        ({**d, "regions": [[]]}, "region: expected a map, got list"),
        ({**d, "regions": [{**d["regions"][0], "kind": "GPU"}]},
         r"region\.kind: 'GPU' is not one of \['HOST', 'DEVICE'\]"),
        ({**d, "buffers": [{**d["buffers"][0], "role": ["K"]}]}, r"buffer\.role: \['K'\] is not one of"),
        ({**d, "buffers": [{**d["buffers"][0], "window": 1.5}]},
         r"buffer 'a'\.window: must be an int or None, got 1\.5"),
        ({**d, "replica": {"tp_size": 1}}, r"replica: missing fields \['pp_rank', 'pp_size', 'tp_rank'\]"),
        ([d], "layout: expected a map, got list"),
    ]
    for obj, message in cases:
        with pytest.raises(LayoutError, match=message):
            PageLayout.decode(msgpack.packb(obj))


def test_many_duplicate_buffer_names_are_refused():
    d = SEED_DICTS[1]
    buffers = [{**d["buffers"][0], "layer": i} for i in range(16384)]
    with pytest.raises(LayoutError, match=r"buffers: duplicate names \['a'\]"):
        PageLayout.decode(msgpack.packb({**d, "buffers": buffers}))
    with pytest.raises(LayoutError, match="not valid msgpack"):
        PageLayout.decode(msgpack.packb({**d, "buffers": buffers + buffers[:1]}))  # over the array cap


# ------------------------------------------------------------- hypothesis
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=10) | st.sampled_from(ENUM_STRINGS + FIELDS),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), children, max_size=6),
    max_leaves=30,
)


@settings(max_examples=examples(150), deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes(data):
    decode_or_layout_error(data)


@settings(max_examples=examples(150), deadline=None)
@given(msgpack_values)
def test_random_msgpack_values(obj):
    assert decode_or_layout_error(msgpack.packb(obj)) is None


@settings(max_examples=examples(100), deadline=None)
@given(layouts(), st.data())
def test_field_mutations_of_generated_layouts(lay, data):
    obj = lay.to_dict()
    target = data.draw(st.sampled_from(containers(obj, [])))
    if isinstance(target, dict):
        key = data.draw(st.sampled_from(sorted(target)))
        if data.draw(st.booleans()):
            del target[key]
            assert decode_or_layout_error(msgpack.packb(obj)) is None
            return
        target[key] = data.draw(msgpack_values)
    else:
        target[data.draw(st.integers(0, len(target) - 1))] = data.draw(msgpack_values)
    decode_or_layout_error(msgpack.packb(obj))
