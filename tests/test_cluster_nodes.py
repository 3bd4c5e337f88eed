"""Discovery in the runtime: prefill and decode nodes in a real etcd registry, over real NIXL agents and TLS.

Every node publishes its record through its own ``Registry`` (one single-member
etcd per module, one prefix per test).  The tests check what the records say
(endpoint, layout, load following the lender's leases), that the ``Router``
spreads requests by load, and what the nodes do when the registry changes:
a ticket whose prefill left fails at once without dialling (unless a live
link authenticated as it), a prefill's record leaving (withdrawn, or
deleted again and again by an etcd writer) stops new routing but closes no
link and fails no fetch, forged records are never routed to, a decode
leaving has its leases released long before their TTL, and a dead etcd
leaves the known prefills serving.  etcd runs TLS from the cluster CA and
each rank connects with its own certificate.  Every byte fetched is checked.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from kvlend.cluster.etcd_members import EtcdMembers
from kvlend.cluster.records import RankRecord, record_key
from kvlend.cluster.registry import Registry
from kvlend.cluster.router import Router
from kvlend.core.lender import LEASE_ID_BYTES
from kvlend.errors import ConfigError, LeaseUnknown, PeerLost, RegistryError
from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode, Ticket
from kvlend.testing.kvcache import (
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
from tests.support.agents import nixl
from tests.support.certs import CA, creds
from tests.support.etcd import Raw
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
    with EtcdMembers(1, authority=CA) as members:  # TLS from the cluster CA; ranks connect with their certificate
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

    def __init__(self, etcd: EtcdMembers, timeout: float = 1.0) -> None:
        self.etcd = etcd
        self.endpoints = etcd.endpoints
        self.prefix = f"/kvlend/t{secrets.token_hex(4)}"
        self.timeout = timeout
        self.members: list[Member] = []
        self.rng = np.random.default_rng(11)

    def _registry(self, identity: str, role: str) -> Registry:
        return Registry(self.endpoints, self.prefix, cluster_ca=CA.cert_pem, etcd_credentials=creds(identity, role),
                        ttl=2, timeout=self.timeout, update_interval=0.05).start()

    def _member(self, build, pools, identity: str, role: str) -> Member:
        registry = self._registry(identity, role)
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

        return self._member(build, pools, identity, "prefill")

    def decode(self, identity: str) -> Member:
        pools = make_pools(PAGES)

        def build(registry):
            node = DecodeNode(make_layout(pools), nixl(identity), creds(identity, "decode"), config=DECODE_CONFIG,
                              registry=registry)
            node.start()
            return Member(node, registry, pools, {})

        return self._member(build, pools, identity, "decode")

    def close(self) -> None:
        for member in sorted(self.members, key=lambda m: isinstance(m.node, PrefillNode)):
            member.stop()


@pytest.fixture
def cluster(etcd):
    c = Cluster(etcd)
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


def test_a_prefill_leaving_the_registry_stops_new_routing_but_closes_no_live_link(cluster):
    """A record that leaves (withdrawn, lapsed, or deleted by any etcd writer) is no evidence that the prefill
    died: the fetch in flight finishes over the link, which stays; only new routing stops."""
    p = cluster.prefill("prefill-a", NodeConfig(ttl=LEASE_TTL, claim_wait=20.0))
    d, d2 = cluster.decode("decode-a"), cluster.decode("decode-b")
    sees(d, p.name)
    sees(d2, p.name)
    d.node.connect(*p.node.address)
    # a ticket minted before its lend: the claim waits on the prefill, so the fetch stays in flight
    early = Ticket(secrets.token_bytes(LEASE_ID_BYTES), p.node.advertise, p.node.port, p.name, TOKENS,
                   p.node.layout.layout_id)
    dst = destination(d)
    handle = d.node.start_fetch(early, dst)

    def waiting() -> bool:
        with p.node._lock:
            return early.lease in p.node.session._waiting

    wait_until(waiting, "the claim did not reach the prefill")
    load_of(p, d.name, 1)  # the decode's record counts its fetch in flight
    (link,) = d.node.links
    record = p.registry.published
    p.registry.withdraw()  # the prefill's record leaves; the prefill itself still serves
    for member in (d, d2):
        assert member.registry.wait_for(lambda v: v.get(p.name) is None, DEADLINE), "the record did not leave"
    with pytest.raises(RegistryError, match="no live"):
        Router(d.registry, d.node.layout).pick()  # new routing to it stops
    tables = prefill_request(p.node.layout, p.pools, p.free, TOKENS, 7)
    p.node.lend("early", TOKENS, tables, p.node.layout.full_selection(), lease_id=early.lease)
    assert handle.wait(DEADLINE).bound == TOKENS  # the fetch in flight finishes over the live link
    for group, table in dst.items():
        d.free[group].release(table)
    fetch_verified(d, lend(p, "after", 8), 8)  # a new ticket rides the link authenticated as p
    assert [lk.id for lk in d.node.links] == [link.id]
    with pytest.raises(PeerLost, match="not in the cluster registry"):  # a decode with no link does not dial
        d2.node.start_fetch(lend(p, "unlinked", 9), destination(d2))
    p.registry.publish(record, p.node.credentials)
    sees(d, p.name)
    assert Router(d.registry, d.node.layout).pick().identity == p.name


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
    raw = Raw(cluster.etcd)
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
    with EtcdMembers(1, authority=CA) as etcd:
        cluster = Cluster(etcd, timeout=0.5)
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
            # protocol 6: each Done rides the decode's next heartbeat, after the fetch is done
            wait_until(lambda: a.node.lender.active_leases == b.node.lender.active_leases == 0,
                       "the prefills did not release the leases read")
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


def test_deleting_a_live_prefills_record_again_and_again_fails_no_fetch_and_closes_no_link(cluster):
    """The filer's attack (14 deletes in 3 s: 11,167 failed fetches against 537 good ones on the old code):
    every fetch still succeeds and the one link stays, while the record keeps coming back (its publisher puts
    it back)."""
    p = cluster.prefill("prefill-a")
    d = cluster.decode("decode-a")
    sees(d, p.name)
    fetch_verified(d, lend(p, "warm", 0), 0)
    (link,) = d.node.links
    raw, key, stop = Raw(cluster.etcd), record_key(cluster.prefix, p.name), threading.Event()
    deletes, absent = [0], []

    def deleter() -> None:
        while not stop.is_set():
            raw.delete(key)
            deletes[0] += 1
            absent.append(d.registry.get(p.name) is None)
            stop.wait(0.02)

    thread = threading.Thread(target=deleter, daemon=True)
    thread.start()
    try:
        for seed in range(1, 31):  # 30 fetches, each after at least one more delete
            before = deletes[0]
            wait_until(lambda: deletes[0] > before, "the deleter made no progress")
            fetch_verified(d, lend(p, f"r{seed}", seed), seed)  # raises on any failed fetch
    finally:
        stop.set()
        thread.join(DEADLINE)
    assert [lk.id for lk in d.node.links] == [link.id] and d.node.session.ready(link.id)
    sees(d, p.name)  # the publisher put it back after each delete
    print(f"{deletes[0]} deletes, {seed} fetches, none failed; decode saw the record absent "
          f"{sum(absent)} times")


def test_forged_records_are_never_routed_to(cluster):
    """Over real etcd: an unsigned record with a huge capacity, a decode's certificate signing a prefill
    record, and a record signed for another identity: the decode and a router see only the real prefill."""
    from kvlend.cluster.signing import RecordSigner

    p = cluster.prefill("prefill-a")
    d = cluster.decode("decode-a")
    sees(d, p.name)
    real = p.registry.published
    raw = Raw(cluster.etcd)
    ghost = RankRecord("ghost", "prefill", "127.0.0.1", 1, layout=real.layout, capacity=65536)
    raw.put_record(cluster.prefix, ghost)  # unsigned
    posing = RankRecord("decode-a", "prefill", "127.0.0.1", 1, layout=real.layout, capacity=65536)
    raw.put(record_key(cluster.prefix, "poser"),
            RecordSigner(creds("decode-a", "decode")).sign(replace(posing, role="decode")).replace(
                b'"identity":"decode-a"', b'"identity":"poser"'))  # a decode's signature, the record altered
    other = RankRecord("other", "prefill", "127.0.0.1", 1, layout=real.layout, capacity=65536)
    raw.put(record_key(cluster.prefix, "other"), RecordSigner(creds("prefill-b", "prefill")).sign(
        replace(other, identity="prefill-b")).replace(b'"identity":"prefill-b"', b'"identity":"other"'))
    rejected = {record_key(cluster.prefix, k) for k in ("ghost", "poser", "other")}
    assert d.registry.wait_for(lambda v: rejected <= set(v.rejected), DEADLINE), d.registry.status()
    router = Router(d.registry, d.node.layout)
    assert {router.pick().identity for _ in range(6)} == {p.name}
    assert [r.identity for r in d.registry.ranks("prefill")] == [p.name] == [r.identity for r in
                                                                             p.registry.ranks("prefill")]
    assert all(d.registry.view.rejected[k] for k in rejected)
