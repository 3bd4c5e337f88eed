"""Discovery in the runtime: prefill and decode nodes in a real etcd registry, over real NIXL agents and TLS.

Every node publishes its record through its own ``Registry`` (one single-member
etcd per module, one prefix per test).  The tests check what the records say
(endpoint, layout, load following the lender's leases), that the ``Router``
spreads requests by load, and what the nodes do when the registry changes:
a ticket whose prefill left fails at once without dialling, a prefill
leaving closes the links to it (its fetch in flight fails typed), a decode
leaving has its leases released long before their TTL, and a dead etcd
leaves the known prefills serving.  Every byte fetched is checked.
"""

from __future__ import annotations

import json
import secrets
import socket
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvlend.cluster.etcd_members import EtcdMembers
from kvlend.cluster.records import RankRecord, record_key
from kvlend.cluster.registry import Registry
from kvlend.cluster.router import Router
from kvlend.core.lender import LEASE_ID_BYTES
from kvlend.errors import ConfigError, LeaseUnknown, PeerLost, RegistryError
from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode, Ticket
from tests.support.agents import nixl
from tests.support.certs import creds
from tests.support.etcd import Raw
from tests.support.kvcache import (
    SENTINEL,
    TPP,
    FreeList,
    group_layers,
    make_layout,
    make_pools,
    pattern,
    prefill_request,
    slots,
)
from tests.support.nodes import wait_until

pytestmark = pytest.mark.system

DEADLINE = 10.0  # seconds any single wait may take before the test fails
PAGES = 256
TOKENS = 20  # 5 token pages a request
LEASE_TTL = 30.0  # long: a lease released early is released by the registry, not by its TTL
PREFILL_CONFIG = NodeConfig(ttl=LEASE_TTL)
DECODE_CONFIG = NodeConfig(ttl=LEASE_TTL, handshake_timeout=DEADLINE, transfer_timeout=DEADLINE)


@pytest.fixture(scope="module")
def etcd():
    with EtcdMembers(1) as members:
        yield members


@dataclass
class Member:
    node: PrefillNode | DecodeNode
    registry: Registry
    pools: list[np.ndarray]
    free: dict[str, FreeList]
    released: list[tuple[str, str]] = field(default_factory=list)  # (request, reason), prefills only

    @property
    def name(self) -> str:
        return self.node.name

    def stop(self) -> None:
        """Close the node, then its registry (the record leaves when the registry closes)."""
        if not self.node._closed:
            self.node.close()
            self.node.backend.close()
        self.registry.close()


class Cluster:
    """Nodes of one test, each with its own registry; ``close`` stops them all, decodes first."""

    def __init__(self, endpoints: list[str], timeout: float = 1.0) -> None:
        self.endpoints = endpoints
        self.prefix = f"/kvlend/t{secrets.token_hex(4)}"
        self.timeout = timeout
        self.members: list[Member] = []
        self.rng = np.random.default_rng(11)

    def _registry(self) -> Registry:
        return Registry(self.endpoints, self.prefix, ttl=2, timeout=self.timeout, update_interval=0.05).start()

    def _member(self, build, pools) -> Member:
        registry = self._registry()
        try:
            member = build(registry)
        except BaseException:
            registry.close()
            raise
        member.pools = pools
        member.free = {g: FreeList(PAGES, self.rng) for g in member.node.layout.groups}
        self.members.append(member)
        return member

    def prefill(self, identity: str, config: NodeConfig = PREFILL_CONFIG) -> Member:
        pools = make_pools(PAGES)

        def build(registry):
            released: list[tuple[str, str]] = []
            node = PrefillNode(make_layout(pools), nixl(identity), creds(identity, "prefill"), config=config,
                               registry=registry,
                               on_release=lambda lease, reason: released.append((lease.request, reason)))
            node.start()
            return Member(node, registry, pools, {}, released)

        return self._member(build, pools)

    def decode(self, identity: str) -> Member:
        pools = make_pools(PAGES)

        def build(registry):
            node = DecodeNode(make_layout(pools), nixl(identity), creds(identity, "decode"), config=DECODE_CONFIG,
                              registry=registry)
            node.start()
            return Member(node, registry, pools, {})

        return self._member(build, pools)

    def close(self) -> None:
        for member in sorted(self.members, key=lambda m: isinstance(m.node, PrefillNode)):
            member.stop()


@pytest.fixture
def cluster(etcd):
    c = Cluster(etcd.endpoints)
    try:
        yield c
    finally:
        c.close()


def sees(member: Member, *identities: str) -> None:
    """Wait until ``member``'s registry lists every one of ``identities``."""
    assert member.registry.wait_for(lambda v: all(v.get(i) is not None for i in identities), DEADLINE), \
        f"{member.name} does not see {identities}: {member.registry.status()}"


def load_of(member: Member, identity: str, load: int) -> None:
    """Wait until ``member``'s registry shows ``identity`` with ``load``."""
    assert member.registry.wait_for(lambda v: v.get(identity) is not None and v.get(identity).load == load,
                                    DEADLINE), f"{identity} not at load {load}: {member.registry.get(identity)}"


def lend(prefill: Member, request: str, seed: int) -> Ticket:
    tables = prefill_request(prefill.node.layout, prefill.pools, prefill.free, TOKENS, seed)
    return prefill.node.lend(request, TOKENS, tables, prefill.node.layout.full_selection(), meta={"seed": seed})


def destination(decode: Member) -> dict[str, np.ndarray]:
    n_pages = -(-TOKENS // TPP)
    dst = {g: decode.free[g].alloc(n_pages) for g in decode.node.layout.groups}
    for group, table in dst.items():
        for layer in group_layers(decode.node.layout, group):
            slots(decode.pools[layer])[table] = SENTINEL
    return dst


def fetch_verified(decode: Member, ticket: Ticket, seed: int) -> None:
    """Fetch ``ticket`` into fresh pages and check every lent byte against the prefill's seed."""
    layout = decode.node.layout
    dst = destination(decode)
    try:
        result = decode.node.start_fetch(ticket, dst).wait(DEADLINE)
        assert result.bound == TOKENS
        n_pages = -(-TOKENS // TPP)
        for group, table in dst.items():
            rows = layout.groups[group].pages_read(TOKENS, TPP)
            for layer in group_layers(layout, group):
                got = slots(decode.pools[layer])[table[rows]]
                np.testing.assert_array_equal(got, pattern(seed, layer, n_pages, got.shape[1])[rows],
                                              err_msg=f"layer {layer} of seed {seed}")
    finally:
        for group, table in dst.items():
            decode.free[group].release(table)


def leases_of(prefill: Member, identity: str) -> int:
    with prefill.node._lock:
        return len(prefill.node.lender.leases_of(identity))


# ------------------------------------------------------------------ records
def test_nodes_publish_their_records_and_the_router_spreads_requests_by_load(cluster):
    a, b = cluster.prefill("prefill-a"), cluster.prefill("prefill-b")
    d = cluster.decode("decode-a")
    sees(d, a.name, b.name, d.name)
    for p in (a, b):
        record = d.registry.get(p.name)
        assert (record.role, record.endpoint) == ("prefill", (p.node.advertise, p.node.port))
        assert record.layout == p.node.layout.encode() and record.layout_id == p.node.layout.layout_id
        assert (record.tp_size, record.tp_rank, record.pp_size, record.pp_rank) == (1, 0, 1, 0)
        assert record.capacity == PREFILL_CONFIG.quotas.max_leases_per_peer and record.load == 0
    mine = d.registry.get(d.name)
    assert (mine.role, mine.host, mine.port, mine.layout) == ("decode", socket.gethostname(), 0,
                                                             d.node.layout.encode())
    assert [r.identity for r in d.node.compatible_prefills()] == [a.name, b.name]
    sees(a, d.name)
    assert [r.identity for r in a.node.live_decodes()] == [d.name]  # a prefill sees which decodes are alive

    tickets = [lend(a, f"held-{i}", i) for i in range(3)]  # a holds three leases: b has more room
    load_of(d, a.name, 3)
    router = Router(d.registry, d.node.layout)
    picks = [router.pick().identity for _ in range(6)]
    assert picks[:3] == [b.name] * 3, picks  # b's routed count catches up with a's published load first
    assert picks.count(b.name) > picks.count(a.name), picks
    assert router.routed == {a.name: picks.count(a.name), b.name: picks.count(b.name)}
    for identity in picks:
        router.finished(identity)
    assert router.routed == {}
    assert router.pick(exclude=[b.name]).identity == a.name
    router.finished(a.name)

    tried = []

    def first_fails(record):
        tried.append(record.identity)
        if record.identity == b.name:
            raise PeerLost(f"{record.identity} died")
        return record.identity

    assert router.route(first_fails) == a.name and tried == [b.name, a.name]  # retried on the other prefill
    assert router.routed == {}
    tried.clear()

    def always(error):
        def fn(record):
            tried.append(record.identity)
            raise error(record.identity)
        return fn

    with pytest.raises(ConfigError):  # not the prefill's fault: raised at once, not retried
        router.route(always(ConfigError))
    assert len(tried) == 1
    tried.clear()
    with pytest.raises(PeerLost) as info:  # every compatible prefill failed: the last failure, the refusal chained
        router.route(always(PeerLost), attempts=3)
    # b was lost above: it sits out its cool-down (a dead prefill looks idle until its record leaves)
    assert tried == [a.name] and isinstance(info.value.__cause__, RegistryError)
    assert router.routed == {}
    for ticket in tickets:
        a.node.release(ticket.lease)
    load_of(d, a.name, 0)


def test_load_in_the_records_follows_the_leases(cluster):
    p, d = cluster.prefill("prefill-a"), cluster.decode("decode-a")
    sees(d, p.name)
    tickets = [lend(p, f"r{i}", 100 + i) for i in range(3)]
    load_of(d, p.name, 3)
    assert p.node.lender.active_leases == 3
    fetch_verified(d, tickets[0], 100)  # done: released on the decode's done
    load_of(d, p.name, 2)
    p.node.release(tickets[1].lease)  # the engine cancels one
    load_of(d, p.name, 1)
    fetch_verified(d, tickets[2], 102)
    load_of(d, p.name, 0)
    assert p.node.lender.active_leases == 0
    assert sorted(p.released) == [("r0", "done"), ("r1", "released"), ("r2", "done")]


# --------------------------------------------------------------- departures
def test_a_ticket_whose_prefill_left_fails_at_once_without_dialling(cluster):
    a, b = cluster.prefill("prefill-a"), cluster.prefill("prefill-b")
    d = cluster.decode("decode-a")
    sees(d, a.name, b.name)
    gone = lend(b, "orphan", 1)
    fetch_verified(d, lend(a, "warm", 2), 2)  # a link to a is open
    b.stop()
    assert d.registry.wait_for(lambda v: v.get(b.name) is None, DEADLINE), "b's record did not leave"
    links = set(d.node.session.links)
    with pytest.raises(PeerLost, match="not in the cluster registry") as info:
        d.node.start_fetch(gone, destination(d))
    assert info.value.bound == 0 and b.name in str(info.value)
    with pytest.raises(PeerLost, match="not in the cluster registry"):
        d.node.claim(gone)
    ghost = Ticket(secrets.token_bytes(LEASE_ID_BYTES), "127.0.0.1", 9, "prefill-ghost", TOKENS, gone.layout_id)
    with pytest.raises(PeerLost, match="prefill-ghost"):
        d.node.start_fetch(ghost, destination(d))
    assert set(d.node.session.links) == links and d.node.in_flight == 0  # nothing dialled, nothing started
    # a ticket naming a at another endpoint goes over the link that authenticated as a: a answers for it
    moved = Ticket(secrets.token_bytes(LEASE_ID_BYTES), a.node.advertise, a.node.port % 65535 + 1, a.name, TOKENS,
                   a.node.layout.layout_id)
    with pytest.raises(LeaseUnknown, match="refused lease"):
        d.node.start_fetch(moved, destination(d)).wait(DEADLINE)
    assert set(d.node.session.links) == links  # nothing dialled
    fetch_verified(d, lend(a, "still", 3), 3)  # the live prefill's tickets still pass


def test_a_prefill_leaving_the_registry_closes_its_links_and_fails_the_fetch_in_flight(cluster):
    p = cluster.prefill("prefill-a", NodeConfig(ttl=LEASE_TTL, claim_wait=20.0))
    d = cluster.decode("decode-a")
    sees(d, p.name)
    d.node.connect(*p.node.address)
    # a ticket minted before its lend: the claim waits on the prefill, so the fetch stays in flight
    early = Ticket(secrets.token_bytes(LEASE_ID_BYTES), p.node.advertise, p.node.port, p.name, TOKENS,
                   p.node.layout.layout_id)
    handle = d.node.start_fetch(early, destination(d))

    def waiting() -> bool:
        with p.node._lock:
            return early.lease in p.node.session._waiting

    wait_until(waiting, "the claim did not reach the prefill")
    load_of(p, d.name, 1)  # the decode's record counts its fetch in flight
    p.registry.close()  # the prefill's record leaves; the prefill itself still serves
    with pytest.raises(PeerLost, match="left the cluster registry"):
        handle.wait(DEADLINE)
    assert handle.quiet and not handle.ok and d.node.links == []
    wait_until(lambda: not p.node.ready_peers(), "the prefill did not see the decode go")
    with pytest.raises(PeerLost, match="not in the cluster registry"):  # and nothing of it is redeemed
        d.node.start_fetch(lend(p, "late", 4), destination(d))
    load_of(d, d.name, 0)


def test_a_decode_leaving_the_registry_has_its_leases_released_before_their_ttl(cluster):
    p = cluster.prefill("prefill-a")
    d1, d2 = cluster.decode("decode-1"), cluster.decode("decode-2")
    sees(p, d1.name, d2.name)
    sees(d1, p.name)
    sees(d2, p.name)
    for i, d in enumerate((d1, d2)):
        for j in range(2):
            d.node.claim(lend(p, f"{d.name}-{j}", 10 * i + j))  # bound to the decode, heartbeated by it
    wait_until(lambda: leases_of(p, d1.name) == 2 and leases_of(p, d2.name) == 2, "claims not bound")

    # d1 shuts down: its link goes and closing the node withdraws its record, so the leases go now,
    # not at their TTL (30 s)
    d1.node.close()
    d1.node.backend.close()
    assert p.registry.wait_for(lambda v: v.get(d1.name) is None, DEADLINE)
    # whichever path ends them first (the link's goodbye or the record's departure), never their TTL;
    # the engine hears of it (on_release) once the pages are unlocked, after the lease left the lender
    def decode_1s_ends():
        return sorted((r, why) for r, why in list(p.released) if r.startswith("decode-1"))

    wait_until(lambda: len(decode_1s_ends()) == 2, "decode-1's leases not released", deadline=5.0)
    assert leases_of(p, d1.name) == 0
    ended = decode_1s_ends()
    assert [r for r, _ in ended] == ["decode-1-0", "decode-1-1"]
    assert all(why in ("released", "aborted") for _, why in ended), ended

    # d2's record leaves while it is still connected (it lost etcd, say): alive, so its leases stay ...
    d2.registry.close()
    assert p.registry.wait_for(lambda v: v.get(d2.name) is None, DEADLINE)
    wait_until(lambda: d2.name in p.node._departed, "the prefill's loop did not take the departure")
    assert leases_of(p, d2.name) == 2 and d2.name in p.node.ready_peers()
    d2.node.close()  # ... until its link drops
    d2.node.backend.close()
    wait_until(lambda: leases_of(p, d2.name) == 0 and p.node.lender.locks.locked_pages() == 0,
               "decode-2's leases not released", deadline=5.0)
    assert p.node.lender.active_leases == 0
    load_of(p, p.name, 0)


# ----------------------------------------------------------------- records not to be trusted
def test_garbage_over_a_prefills_record_leaves_the_live_link_and_the_record_is_put_back(cluster):
    a = cluster.prefill("prefill-a")
    d = cluster.decode("decode-a")
    sees(d, a.name)
    fetch_verified(d, lend(a, "before", 1), 1)
    (link,) = d.node.links
    key = record_key(cluster.prefix, a.name)
    raw = Raw(cluster.endpoints[0])
    liar = {**json.loads(a.registry.get(a.name).encode()), "capacity": 1 << 40}  # would win every routing pick
    for junk in (b"garbage", json.dumps(liar).encode()):
        raw.put(key, junk)  # someone else's write over a's record: a puts its own back
        wait_until(lambda: raw.get(key).value != junk, "a did not put its record back")
        back = raw.get(key)
        assert back.lease != 0 and d.registry.wait_for(lambda v: v.revision >= back.mod_revision, DEADLINE)
        assert key not in d.registry.status()["rejected"]
        assert RankRecord.decode(back.value, d.registry.view.layouts) == d.registry.get(a.name)
    assert [lk.id for lk in d.node.links] == [link.id]  # the link never went
    fetch_verified(d, lend(a, "after", 2), 2)
    assert d.registry.get(a.name).capacity == a.registry.get(a.name).capacity


def test_a_record_moving_its_endpoint_breaks_no_valid_ticket(cluster):
    a = cluster.prefill("prefill-a")
    d1, d2 = cluster.decode("decode-1"), cluster.decode("decode-2")
    sees(d1, a.name)
    fetch_verified(d1, lend(a, "warm", 1), 1)  # d1 has a link to a; d2 has none
    real = a.node.port
    a.registry.update(port=real % 65535 + 1)  # the record says another port (a rebind, a proxy, a forger)
    for d in (d1, d2):
        assert d.registry.wait_for(lambda v: v.get(a.name) is not None and v.get(a.name).port != real, DEADLINE)
    fetch_verified(d1, lend(a, "live-link", 2), 2)  # the ticket goes over the link authenticated as a
    assert [(lk.host, lk.port) for lk in d1.node.links] == [(a.node.advertise, real)]
    # a new connection dials what the record says: here a stale ticket, and a record back at the real port
    a.registry.update(port=real)
    assert d2.registry.wait_for(lambda v: v.get(a.name).port == real, DEADLINE)
    stale = lend(a, "stale", 3)
    fetch_verified(d2, Ticket(stale.lease, stale.host, real % 65535 + 1, stale.prefill, stale.num_tokens,
                              stale.layout_id, stale.pages), 3)
    assert [(lk.host, lk.port) for lk in d2.node.links] == [(a.node.advertise, real)]


# ----------------------------------------------------------------- outages
def test_a_degraded_registry_leaves_the_known_prefills_serving():
    with EtcdMembers(1) as etcd:
        cluster = Cluster(etcd.endpoints, timeout=0.5)
        try:
            a, b = cluster.prefill("prefill-a"), cluster.prefill("prefill-b")
            d = cluster.decode("decode-a")
            sees(d, a.name, b.name)
            fetch_verified(d, lend(a, "before", 1), 1)  # a linked; b known only from its record
            etcd.kill(0)
            wait_until(lambda: d.registry.degraded and a.registry.degraded, "the registry did not degrade")
            assert [r.identity for r in d.node.compatible_prefills()] == [a.name, b.name]  # still known
            fetch_verified(d, lend(a, "during-a", 2), 2)
            fetch_verified(d, lend(b, "during-b", 3), 3)  # a first link, dialled from the ticket
            assert a.node.lender.active_leases == b.node.lender.active_leases == 0
        finally:
            cluster.close()


def test_a_node_whose_backend_turned_unhealthy_says_so_in_its_record(cluster):
    p = cluster.prefill("prefill-a")
    d = cluster.decode("decode-sick")
    assert p.registry.wait_for(lambda v: v.get(d.name) is not None and v.get(d.name).healthy, DEADLINE)
    d.node.backend._orphans += 1  # what a reset whose old agent outlived it leaves (kvlend_orphaned_agents_total)
    assert not d.node.healthy
    assert p.registry.wait_for(lambda v: v.get(d.name) is not None and not v.get(d.name).healthy, DEADLINE)
    row = next(r for r in p.registry.status()["ranks"] if r["identity"] == d.name)
    assert row["healthy"] is False  # what `kvlend cluster status` prints as UNHEALTHY
