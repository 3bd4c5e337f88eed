"""The etcd registry against etcd itself: its security, its absence, three members and ``EtcdMembers``.

Real ``etcd`` processes: auth by user and password, TLS from the cluster CA; no etcd at all or a dead
endpoint; a killed leader, a lost quorum and a cut-off publisher on three members (deadlines are the
liveness bounds the design promises); the local members' restart, leader and cleanup.  The rest of the
registry's tests: ``test_registry.py`` and ``test_registry_watch.py``.
"""

from __future__ import annotations

import asyncio
import os
import time

import aetcd
import pytest

from kvlend.cluster.etcd_members import EtcdMembers
from kvlend.cluster.records import RankRecord, record_key
from kvlend.cluster.registry import etcd_security_from_env
from kvlend.cluster.view import LEFT
from kvlend.errors import RegistryError
from kvlend.ports import spare_port
from kvlend.security.certs import Authority, save_rank
from tests.support import registry as shared
from tests.support.etcd import Raw
from tests.support.registry import (
    AUTHORITY,
    LAYOUT,
    LAYOUTS,
    TIMEOUT,
    TTL,
    WAIT,
    Changes,
    creds,
    etcd_pids,
    pid_gone,
    prefill,
    publish,
    signed,
    timed,
    wait_until,
)

pytestmark = pytest.mark.system

# The etcd fixtures this module uses (pytest finds them here by name).
etcd1, etcd3, prefix, registries = shared.etcd1, shared.etcd3, shared.prefix, shared.registries


# ----------------------------------------------------------------- etcd's own security
def enable_auth(etcd: EtcdMembers, prefix: str, user: str, password: str) -> None:
    """etcd auth on: a root user, and ``user`` with read-write on ``prefix``/ only (what etcdctl does)."""
    from aetcd.rpc import rpc_pb2 as pb

    async def go(client):
        auth = aetcd.rpc.AuthStub(client.channel)
        start = f"{prefix}/".encode()
        for request in (pb.AuthUserAddRequest(name="root", password="root-pw"),
                        pb.AuthUserGrantRoleRequest(user="root", role="root"),
                        pb.AuthRoleAddRequest(name="kvlend"),
                        pb.AuthRoleGrantPermissionRequest(name="kvlend", perm=aetcd.rpc.Permission(
                            permType=aetcd.rpc.Permission.READWRITE, key=start,
                            range_end=aetcd.utils.prefix_range_end(start))),
                        pb.AuthUserAddRequest(name=user, password=password),
                        pb.AuthUserGrantRoleRequest(user=user, role="kvlend")):
            method = {pb.AuthUserAddRequest: auth.UserAdd, pb.AuthUserGrantRoleRequest: auth.UserGrantRole,
                      pb.AuthRoleAddRequest: auth.RoleAdd, pb.AuthRoleGrantPermissionRequest: auth.RoleGrantPermission}
            await method[type(request)](request, timeout=2)
        await auth.AuthEnable(pb.AuthEnableRequest(), timeout=2)

    Raw(etcd).run(go)


def test_etcd_auth_user_and_password(registries):
    with EtcdMembers(1, authority=AUTHORITY) as etcd:
        prefix = "/kvlend/auth"
        enable_auth(etcd, prefix, "kvlend", "s3cret")
        pub = registries(etcd, prefix, username="kvlend", password="s3cret")
        publish(pub, prefill("p0"))
        pub.start()
        watcher = registries(etcd, prefix, username="kvlend", password="s3cret").start()
        assert watcher.wait_for(lambda v: v.get("p0") == prefill("p0"), WAIT), watcher.status()
        assert pub.ready(WAIT) and not pub.degraded
        # the probe, a read under the prefix, passes too: nothing degrades over a few probe periods
        assert not watcher.wait_for(lambda v: v.degraded, 3 * TTL / 3 + TIMEOUT) and not pub.degraded
        for kw in ({}, {"username": "kvlend", "password": "wrong"}):
            outsider = registries(etcd, prefix, **kw).start()
            assert not outsider.ready(1.0) and outsider.degraded
            assert outsider.status()["why"], outsider.status()
        pub.close()
        assert watcher.wait_for(lambda v: v.get("p0") is None, WAIT)  # its lease revoked under auth too


def test_etcd_runs_tls_from_the_cluster_ca_and_refuses_a_client_without_a_certificate(etcd1, registries, tmp_path):
    """``EtcdMembers`` starts etcd as production runs it: ranks connect with their rank certificate
    (or the ``KVLEND_ETCD_*`` files), and a client without a certificate from the cluster CA gets nothing."""
    prefix = "/kvlend/tls"
    pub = registries(etcd1.endpoints, prefix, etcd_credentials=creds("p0", "prefill"))
    publish(pub, prefill("p0"))
    pub.start()
    tls = etcd1.client_tls
    env = {"KVLEND_ETCD_CA": tls["ca_file"], "KVLEND_ETCD_CERT": tls["cert_file"],
           "KVLEND_ETCD_KEY": tls["key_file"], "KVLEND_ETCD_USER": ""}  # empty: unset
    assert etcd_security_from_env(env) == tls
    watcher = registries(etcd1.endpoints, prefix, **etcd_security_from_env(env)).start()
    assert watcher.wait_for(lambda v: v.get("p0") == prefill("p0"), WAIT), watcher.status()
    assert pub.ready(WAIT) and not pub.degraded
    stranger = Authority.create("not the cluster CA").issue("p9", "prefill")
    files = save_rank(stranger, str(tmp_path / "stranger"))
    for kw in ({}, {"ca_file": tls["ca_file"]},  # plaintext, or TLS without a client certificate
               {"ca_file": tls["ca_file"], "cert_file": files["KVLEND_CERT"], "key_file": files["KVLEND_KEY"]}):
        outsider = registries(etcd1.endpoints, prefix, **kw).start()  # the last: a certificate from another CA
        assert not outsider.ready(1.0) and outsider.degraded and outsider.get("p0") is None, kw
    with pytest.raises((aetcd.exceptions.ClientError, asyncio.TimeoutError)):
        Raw(etcd1.endpoints[0]).get(record_key(prefix, "p0"))  # a plain client: refused by etcd itself


# ----------------------------------------------------------------- no etcd
def test_no_etcd_at_all_degrades_and_closes_quickly(registries):
    port = spare_port()
    reg = registries([f"127.0.0.1:{port}"], "/kvlend/none")
    publish(reg, prefill("p0"))
    reg.start()
    ready, took = timed(reg.ready, 1.0)
    assert ready is False and 0.9 <= took < 3.0, f"ready(1.0) returned after {took:.2f} s"  # the deadline, not a hang
    assert reg.degraded
    assert reg.wait_for(lambda v: v.degraded, WAIT)
    status = reg.status()
    assert status["degraded"] and not status["ready"] and str(port) in status["why"], status
    assert reg.ranks() == [] and reg.get("p0") is None and not status["published"]
    _, took = timed(reg.close)
    assert took < 3 * TIMEOUT + 0.5, f"close() took {took:.2f} s with no etcd"
    assert not reg._thread.is_alive()


def test_a_dead_endpoint_first_connects_via_the_live_one(etcd1, prefix, registries):
    dead = f"127.0.0.1:{spare_port()}"
    pub = registries([dead, etcd1.endpoints[0]], prefix, ttl=10, **etcd1.client_tls)
    publish(pub, prefill("p0"))
    pub.start()
    assert pub.ready(WAIT)
    assert pub.status()["endpoint"] == etcd1.endpoints[0] and pub.reconnects >= 1
    watcher = registries(etcd1, prefix).start()
    assert watcher.wait_for(lambda v: v.get("p0") is not None, WAIT)
    assert not pub.degraded
    # close revokes through the live endpoint even though the dead one is listed first
    _, took = timed(pub.close)
    assert watcher.wait_for(lambda v: v.get("p0") is None, 2.0), "revoke did not reach the live endpoint"
    assert took < 3 * TIMEOUT


# ----------------------------------------------------------------- three members
def _others(members: EtcdMembers, *skip: int) -> list[int]:
    return [i for i in range(len(members.procs)) if i not in skip]


def test_leader_killed_registries_recover_and_lose_nothing(etcd3, prefix, registries):
    lead = etcd3.leader()
    assert etcd3.alive(lead) and etcd3.healthy(lead)
    # list the leader first, so both registries are connected to the member that dies
    order = [etcd3.endpoints[lead]] + [etcd3.endpoints[i] for i in _others(etcd3, lead)]
    pub = registries(order, prefix, **etcd3.client_tls)
    publish(pub, prefill("p0", load=1))
    pub.start()
    watcher = registries(order, prefix, **etcd3.client_tls)
    seen = Changes()
    watcher.add_listener(seen)
    watcher.start()
    raw = Raw(etcd3, _others(etcd3, lead)[0])
    peers = [prefill(f"peer{i}") for i in range(5)]
    for record in peers:
        raw.put_record(prefix, record, signed(record))
    everyone = {"p0"} | {r.identity for r in peers}
    assert watcher.wait_for(lambda v: {r.identity for r in v.ranks()} == everyone, WAIT)
    assert watcher.status()["endpoint"] == order[0] and pub.status()["endpoint"] == order[0]
    reconnects = watcher.reconnects, pub.reconnects

    etcd3.kill(lead)
    t0 = time.monotonic()
    new = etcd3.leader()
    assert new != lead and etcd3.alive(new)
    pub.update(load=7)
    assert watcher.wait_for(lambda v: v.get("p0") is not None and v.get("p0").load == 7, 6.0), \
        f"an update made after the leader died was not seen: {watcher.status()}"
    took = time.monotonic() - t0
    assert {r.identity for r in watcher.ranks()} == everyone
    assert watcher.reconnects > reconnects[0] and pub.reconnects > reconnects[1]
    assert watcher.status()["endpoint"] != order[0]
    assert not [c for c in seen.all() if c.kind == LEFT], "a rank left over a leader change"
    assert watcher.wait_for(lambda v: not v.degraded, WAIT) and not pub.degraded
    print(f"update seen {took:.2f} s after the leader was killed")
    # the old leader comes back with its data and catches up
    etcd3.start(lead)
    etcd3.wait_healthy([lead], 10)
    back = Raw(etcd3, lead)
    assert wait_until(lambda: RankRecord.decode(back.get(record_key(prefix, "p0")).value, LAYOUTS).load == 7,
                      WAIT) is not None


def test_quorum_lost_degrades_keeps_known_ranks_and_recovers(etcd3, prefix, registries):
    """Two of three members die: both registries say degraded within a probe period plus a call deadline, keep
    what they know, answer every query at once; once the members are back, all flows again."""
    pub = registries(etcd3, prefix, ttl=1)  # short: its lease would run out during the outage
    publish(pub, prefill("p0", load=1))
    pub.start()
    bystander = registries(etcd3, prefix, ttl=1)  # closed mid-outage: can't revoke, must expire
    publish(bystander, prefill("gone-soon"))
    bystander.start()
    watcher = registries(etcd3, prefix)
    seen = Changes()
    watcher.add_listener(seen)
    watcher.start()
    raw = Raw(etcd3)
    raw.put_record(prefix, prefill("peer", port=5001), signed(prefill("peer", port=5001)))
    everyone = {"p0", "gone-soon", "peer"}
    assert watcher.wait_for(lambda v: {r.identity for r in v.ranks()} == everyone, WAIT)
    lease_before = raw.get(record_key(prefix, "p0")).lease
    # both are connected to member 0 (the first endpoint): it survives, silent, without a quorum
    assert watcher.status()["endpoint"] == pub.status()["endpoint"] == etcd3.endpoints[0]

    etcd3.kill(1)
    etcd3.kill(2)
    t0 = time.monotonic()
    pub_after = wait_until(lambda: pub.degraded, pub.ttl + TIMEOUT + 2)
    watch_after = wait_until(lambda: watcher.degraded, watcher.ttl + TIMEOUT + 2)
    print(f"degraded after: publisher {pub_after} s, watcher {watch_after} s")
    assert pub_after is not None and pub_after <= pub.ttl + TIMEOUT + 1.0, pub_after
    assert watch_after is not None and time.monotonic() - t0 <= watcher.ttl + TIMEOUT + 1.0, watch_after

    # degraded: known ranks stay known, and no query blocks while the thread keeps failing and reconnecting
    slowest: dict[str, float] = {}
    probe = Changes()
    t_end = time.monotonic() + 2.0
    while time.monotonic() < t_end:
        for name, call in [
            ("degraded", lambda: watcher.degraded), ("ranks", watcher.ranks),
            ("ranks(prefill)", lambda: watcher.ranks("prefill")), ("get", lambda: watcher.get("p0")),
            ("compatible", lambda: watcher.compatible(LAYOUT)), ("pick", lambda: watcher.pick(LAYOUT)),
            ("status", watcher.status), ("pub.status", pub.status), ("pub.degraded", lambda: pub.degraded),
            ("update", lambda: pub.update(load=int(time.monotonic() * 1000) % 50 + 2)),
            ("publish", lambda: publish(pub, pub._record)), ("ready", lambda: watcher.ready(0)),
            ("add_listener", lambda: watcher.add_listener(probe)),
            ("remove_listener", lambda: watcher.remove_listener(probe)),
        ]:
            _, took = timed(call)
            slowest[name] = max(slowest.get(name, 0.0), took)
        assert {r.identity for r in watcher.ranks()} == everyone
        assert watcher.get("p0") is not None and watcher.get("peer") is not None
        time.sleep(0.05)
    assert max(slowest.values()) < 0.25, f"a query blocked while degraded: {slowest}"
    assert not [c for c in seen.all() if c.kind == LEFT], "a known rank was dropped because etcd was out"
    status = watcher.status()
    assert status["degraded"] and status["why"].startswith("etcd 127.0.0.1:") and status["degraded_for_s"] > 0
    assert len(status["ranks"]) == 3
    assert pub.status()["degraded"] and pub.status()["why"]
    _, took = timed(bystander.close)
    assert took < 3 * TIMEOUT + 0.5, f"close() took {took:.2f} s without a quorum"
    time.sleep(max(0.0, 3 * pub.ttl - (time.monotonic() - t0)))  # past the short lease's TTL, twice over

    etcd3.start(1)
    etcd3.start(2)
    etcd3.wait_healthy(range(3), 15)
    t1 = time.monotonic()
    healed = wait_until(lambda: not pub.degraded and not watcher.degraded, 10.0)
    assert healed is not None, f"still degraded after the members came back: {watcher.status()} {pub.status()}"
    assert watcher.status()["why"] == "" and watcher.status()["degraded_for_s"] is None
    pub.update(load=60)  # outside the 2..51 written during the outage
    assert watcher.wait_for(lambda v: v.get("p0") is not None and v.get("p0").load == 60, WAIT), watcher.status()
    kv = raw.get(record_key(prefix, "p0"))
    assert kv is not None and RankRecord.decode(kv.value, LAYOUTS).load == 60 and raw.lease_alive(kv.lease)
    print(f"healed {healed:.2f} s after the members were healthy; p0's lease "
          f"{'kept' if kv.lease == lease_before else 'granted again'}")
    # the bystander could not revoke, so its record outlives it by one TTL after the recovery
    assert watcher.wait_for(lambda v: v.get("gone-soon") is None, bystander.ttl + 3.0)
    assert watcher.get("peer") is not None and watcher.get("p0") is not None
    assert time.monotonic() - t1 < 15


def test_a_publisher_cut_off_has_its_record_expire_then_republishes(etcd3, prefix, registries):
    """The publisher only knows member 0; member 0 dies, the other two keep a quorum: its lease runs out for
    real, the record leaves everyone's view, and when member 0 is back the publisher grants a new lease."""
    pub = registries([etcd3.endpoints[0]], prefix, ttl=1, **etcd3.client_tls)
    publish(pub, prefill("p0", load=3))
    pub.start()
    watcher = registries(etcd3.endpoints[1:], prefix, **etcd3.client_tls)
    seen = Changes()
    watcher.add_listener(seen)
    watcher.start()
    assert watcher.wait_for(lambda v: v.get("p0") is not None, WAIT)
    raw = Raw(etcd3, 1)
    lease = raw.get(record_key(prefix, "p0")).lease
    etcd3.kill(0)
    t0 = time.monotonic()
    assert watcher.wait_for(lambda v: v.get("p0") is None, pub.ttl + 3), "the cut-off rank's lease never ran out"
    print(f"cut-off publisher's record expired after {time.monotonic() - t0:.2f} s")
    assert seen.wait(lambda s: s.of("p0", LEFT)) and not watcher.degraded
    assert wait_until(lambda: pub.degraded, pub.ttl + TIMEOUT + 1) is not None
    pub.update(load=4)
    etcd3.start(0)
    etcd3.wait_healthy([0], 15)
    assert watcher.wait_for(lambda v: v.get("p0") is not None and v.get("p0").load == 4, 10.0), pub.status()
    kv = raw.get(record_key(prefix, "p0"))
    assert kv.lease != lease and raw.lease_alive(kv.lease)
    assert wait_until(lambda: not pub.degraded, WAIT) is not None


# ----------------------------------------------------------------- EtcdMembers
def test_etcd_member_restart_keeps_its_data_and_close_leaves_nothing():
    members = EtcdMembers(1, authority=AUTHORITY)
    pids, workdir = [], members.workdir
    try:
        assert members.alive(0) and members.healthy(0)
        pids += etcd_pids(members)
        raw = Raw(members)
        raw.put("/kvlend/members/k", b"kept")
        members.kill(0)
        assert not members.alive(0) and not members.healthy(0) and pid_gone(pids[0])
        members.kill(0)  # idempotent
        members.start(0)
        members.wait_healthy([0], 10)
        pids += etcd_pids(members)
        assert pids[1] != pids[0]
        members.start(0)  # already running: no second process
        assert etcd_pids(members) == [pids[1]]
        assert raw.get("/kvlend/members/k").value == b"kept"
    finally:
        members.close()
    assert all(pid_gone(pid) for pid in pids), f"etcd processes left: {[p for p in pids if not pid_gone(p)]}"
    assert not os.path.exists(workdir)
    members.close()  # idempotent


def test_etcd_members_leader_is_alive_and_moves_when_killed():
    with pytest.raises(RegistryError, match="1..7"):
        EtcdMembers(0)
    with EtcdMembers(3, authority=AUTHORITY) as members:
        pids = etcd_pids(members)
        assert len(pids) == 3 and len(set(members.endpoints)) == 3
        lead = members.leader()
        assert members.alive(lead) and members.healthy(lead)
        members.kill(lead)
        new = members.leader()
        assert new != lead and members.alive(new)
        assert not members.alive(lead)
    assert all(pid_gone(pid) for pid in pids)
