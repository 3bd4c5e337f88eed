"""``runtime.membership``: a node's record in the cluster registry, kept apart from its loop, over a
registry stand-in: alone, then behind real nodes (the real registry, over etcd, is the system tier's
``test_cluster_nodes``)."""

from __future__ import annotations

import pytest

from kvlend.cluster.view import JOINED, LEFT, Change
from kvlend.runtime import DecodeNode, PrefillNode
from kvlend.runtime.membership import Membership
from kvlend.testing.kvcache import make_layout, make_pools, prefill_request
from tests.support.agents import nixl
from tests.support.certs import creds
from tests.support.nodes import DEADLINE, DECODE_CONFIG, DST_PAGES, SRC_PAGES, free_lists, wait_until


class _Registry:
    """What ``Membership`` uses of a ``Registry``, recorded."""

    def __init__(self) -> None:
        self.published = None
        self.signed_by: list[str] = []
        self.updates: list[dict] = []
        self.listeners: list = []

    def publish(self, record, credentials) -> None:
        self.published = record
        self.signed_by.append(credentials)

    def update(self, **fields) -> None:
        self.updates.append(fields)

    def withdraw(self) -> None:
        self.published = None

    def add_listener(self, listener) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener) -> None:
        self.listeners.remove(listener)

    def ranks(self, role: str) -> list:
        return []

    def change(self, *changes: Change) -> None:
        """On the registry's thread: tell every listener."""
        for listener in self.listeners:
            listener(list(changes))


def _member(load=lambda: 0, acts=None):
    registry, woken, acted = _Registry(), [], []

    def act(change: Change) -> bool:
        acted.append(change)
        return (acts or {}).get(change.record, False)

    member = Membership(registry, lambda: woken.append(1), load=load,
                        watches=lambda change: change.kind == LEFT, act=act)
    member.join("record", "old credentials")
    return member, registry, woken, acted


@pytest.mark.unit
def test_joining_publishes_the_signed_record_and_follows_the_registry():
    member, registry, _, _ = _member()
    assert registry.published == "record" and registry.signed_by == ["old credentials"]
    assert len(registry.listeners) == 1


@pytest.mark.unit
def test_watched_changes_wait_for_the_loops_turn_and_wake_it():
    member, registry, woken, acted = _member(acts={"b": True})
    registry.change(Change(JOINED, "x"))  # not watched: the loop is not even woken
    assert woken == [] and acted == []
    registry.change(Change(LEFT, "a"), Change(JOINED, "y"), Change(LEFT, "b"))
    assert woken == [1] and acted == []  # nothing acts on the registry's thread
    assert member.turn(healthy=True) is True  # one act left the session actions to perform
    assert [c.record for c in acted] == ["a", "b"]
    assert member.turn(healthy=True) is False


@pytest.mark.unit
def test_the_load_goes_out_when_it_moves_and_the_health_once():
    load = [0]
    member, registry, _, _ = _member(load=lambda: load[0])
    member.turn(healthy=True)
    assert registry.updates == []
    load[0] = 3
    member.turn(healthy=True)
    member.turn(healthy=True)
    assert registry.updates == [{"load": 3}]
    member.turn(healthy=False)
    member.turn(healthy=True)  # it never turns back
    member.turn(healthy=False)
    assert registry.updates == [{"load": 3}, {"healthy": False}]


@pytest.mark.unit
def test_reloaded_credentials_sign_the_record_anew_until_it_left():
    member, registry, _, _ = _member()
    member.renewed("new credentials")
    assert registry.published == "record" and registry.signed_by == ["old credentials", "new credentials"]
    member.leave()
    assert registry.published is None and registry.listeners == []
    member.renewed("newer credentials")
    assert registry.signed_by == ["old credentials", "new credentials"]


@pytest.mark.nixl
def test_nodes_publish_their_load_and_a_prefill_releases_a_departed_decodes_leases():
    """A prefill's record carries its endpoint and load; a decode whose record left while connected
    keeps its leases until its link drops, then they are released."""
    registry, decode_registry, released = _Registry(), _Registry(), []
    src, dst = make_pools(SRC_PAGES), make_pools(DST_PAGES)
    prefill = PrefillNode(make_layout(src), nixl("prefill"), creds("prefill", "prefill"), registry=registry,
                          on_release=lambda lease, reason: released.append((lease.request, reason)))
    decode = None
    try:
        prefill.start()
        assert prefill.registry is registry
        record = registry.published
        assert (record.identity, record.role, record.port, record.load) == ("prefill", "prefill", prefill.port, 0)
        decode = DecodeNode(make_layout(dst), nixl("decode"), creds("decode", "decode"), config=DECODE_CONFIG,
                            registry=decode_registry)
        assert (decode_registry.published.role, decode_registry.published.port) == ("decode", 0)
        decode.connect(*prefill.address)
        prefill.wait_for_peer(DEADLINE)
        tables = prefill_request(prefill.layout, src, free_lists(prefill.layout, SRC_PAGES, 1), 40, seed=1)
        prefill.offer("decode", "r1", 40, tables, prefill.layout.full_selection())
        wait_until(lambda: {"load": 1} in registry.updates, "the prefill's load was not published")
        registry.change(Change(LEFT, decode_registry.published))  # the decode's record lapsed; its link lives
        wait_until(lambda: "decode" in prefill._departed, "the prefill's loop did not take the departure")
        assert released == []
        decode.close()
        decode.backend.close()
        decode = None
        wait_until(lambda: released == [("r1", "released")], "the departed decode's lease was not released")
        wait_until(lambda: registry.updates[-1] == {"load": 0}, "the prefill's load did not fall back")
    finally:
        if decode is not None:
            decode.close()
            decode.backend.close()
        prefill.close()
        prefill.backend.close()
    assert registry.published is None and registry.listeners == []  # closing withdrew the record
