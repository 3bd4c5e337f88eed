"""The etcd registry (``Registry``) and the local members it is tested on (``EtcdMembers``), against real etcd.

Every test runs real ``etcd`` processes (one member, or three for failover
and quorum loss) and talks to them through ``Registry`` and, where a test
needs a writer that is not a ``Registry`` (a foreign or broken rank), a plain
``aetcd`` client.  Each test uses a prefix of its own, so the tests sharing
the module's single member never see each other's records.  Deadlines are
liveness bounds the design promises (a dead rank leaves within its TTL plus
etcd's expiry tick; degraded within a probe period plus one call deadline),
never performance claims.

This file: arguments, one member, a killed rank's liveness.  Snapshot then watch, hostile
writers: ``test_registry_watch.py``; etcd's own security, no etcd, three members, ``EtcdMembers``:
``test_registry_etcd.py``; shared helpers and fixtures: ``tests/support/registry.py``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from kvlend.cluster.records import RankRecord, record_key
from kvlend.cluster.registry import Registry
from kvlend.cluster.view import JOINED, LEFT, UPDATED
from kvlend.errors import ConfigError, RegistryError
from kvlend.security.certs import save_rank
from tests.support import registry as shared
from tests.support.etcd import Raw
from tests.support.registry import (
    AUTHORITY,
    LAYOUT,
    LAYOUT_BYTES,
    ROOT,
    TTL,
    WAIT,
    Changes,
    creds,
    prefill,
    publish,
    timed,
    wait_until,
)

pytestmark = pytest.mark.system

# The etcd fixtures this module uses (pytest finds them here by name).
etcd1, prefix, registries = shared.etcd1, shared.prefix, shared.registries


# ----------------------------------------------------------------- arguments
@pytest.mark.parametrize("endpoints, kw, words", [
    ("127.0.0.1:2379", {}, "non-empty list"),
    ([], {}, "non-empty list"),
    (("127.0.0.1",), {}, "host:port"),
    (["127.0.0.1:2379", "localhost"], {}, "host:port"),
    ([":2379"], {}, "host:port"),
    (["127.0.0.1:0"], {}, "host:port"),
    (["127.0.0.1:70000"], {}, "host:port"),
    (["127.0.0.1:port"], {}, "host:port"),
    (["127.0.0.1:2379"], {"ttl": 0.5}, "ttl"),
    (["127.0.0.1:2379"], {"ttl": 0}, "ttl"),
    (["127.0.0.1:2379"], {"ttl": True}, "ttl"),
    (["127.0.0.1:2379"], {"timeout": 0}, "timeout"),
    (["127.0.0.1:2379"], {"timeout": -1.0}, "timeout"),
    (["127.0.0.1:2379"], {"update_interval": -0.1}, "update_interval"),
    (["127.0.0.1:2379"], {"username": "root"}, "username and password"),
    (["127.0.0.1:2379"], {"password": "pw"}, "username and password"),
    (["127.0.0.1:2379"], {"cert_file": "c.pem"}, "cert_file and key_file"),
    (["127.0.0.1:2379"], {"cert_file": "c.pem", "key_file": "k.pem"}, "with ca_file"),
    (["127.0.0.1:2379"], {"ca_file": "/nonexistent/ca.pem"}, "ca_file '/nonexistent/ca.pem'"),
])
def test_bad_arguments_raise_registry_error(endpoints, kw, words):
    with pytest.raises(RegistryError, match=words):
        Registry(endpoints, "/kvlend/args", cluster_ca=AUTHORITY.cert_pem, **kw)


def test_bad_prefix_is_refused():
    """A prefix with a trailing slash would put records where no reader of the right prefix looks."""
    with pytest.raises(ConfigError, match="prefix"):
        Registry(["127.0.0.1:2379"], "/kvlend/bad/", cluster_ca=AUTHORITY.cert_pem)


# ----------------------------------------------------------------- one member
def test_publisher_record_reaches_a_watcher(etcd1, prefix, registries):
    """publish before start, the watcher's JOINED carries the record, other prefixes stay out."""
    pub = registries(etcd1, prefix)
    record = prefill("p0", meta={"api": "http://127.0.0.1:8000"})
    publish(pub, record)  # before start: kept and put once connected
    pub.start()
    watcher = registries(etcd1, prefix)
    seen = Changes()
    watcher.add_listener(seen)
    watcher.start()
    assert watcher.ready(WAIT)
    assert watcher.wait_for(lambda v: v.get("p0") is not None, WAIT)
    assert watcher.get("p0") == record
    assert watcher.ranks() == [record] and watcher.ranks("prefill") == [record] and watcher.ranks("decode") == []
    assert watcher.compatible(LAYOUT) == [record]
    assert watcher.pick(LAYOUT) == record
    assert seen.wait(lambda s: s.of("p0", JOINED))
    assert seen.of("p0", JOINED)[0].record == record
    # a rank of another cluster (another prefix, even one that extends this one) never shows
    other = registries(etcd1, prefix + "x").start()
    publish(other, prefill("stranger"))
    assert other.wait_for(lambda v: v.get("stranger") is not None, WAIT)
    time.sleep(0.3)
    assert watcher.get("stranger") is None and [r.identity for r in watcher.ranks()] == ["p0"]
    status = watcher.status()
    assert status["ready"] and not status["degraded"] and status["endpoint"] == etcd1.endpoints[0]
    assert [r["identity"] for r in status["ranks"]] == ["p0"] and status["ranks"][0]["meta"] == dict(record.meta)
    assert pub.status()["published"] and not watcher.status()["published"]


def test_publish_after_start_and_one_identity_per_registry(etcd1, prefix, registries):
    pub = registries(etcd1, prefix).start()
    assert pub.ready(WAIT)
    with pytest.raises(RegistryError, match="nothing published"):
        pub.update(load=1)
    publish(pub, RankRecord("d0", "decode", "127.0.0.1", 0, layout=LAYOUT_BYTES))
    assert pub.wait_for(lambda v: v.get("d0") is not None, WAIT)
    with pytest.raises(RegistryError, match="'d0'.*'d1'"):
        publish(pub, RankRecord("d1", "decode", "127.0.0.1", 0, layout=LAYOUT_BYTES))
    with pytest.raises(RegistryError, match="RankRecord"):
        pub.publish({"identity": "d0"}, creds("d0", "decode"))
    with pytest.raises(RegistryError, match="already started"):
        pub.start()
    # the same identity again, with new fields, replaces the record
    publish(pub, RankRecord("d0", "decode", "127.0.0.1", 0, layout=LAYOUT_BYTES, capacity=9))
    assert pub.wait_for(lambda v: v.get("d0").capacity == 9, WAIT)
    assert pub.get("d1") is None


def test_update_bursts_are_coalesced_and_the_last_value_arrives(etcd1, prefix, registries):
    pub = registries(etcd1, prefix, update_interval=0.25)
    publish(pub, prefill("p0"))
    pub.start()
    watcher = registries(etcd1, prefix)
    seen = Changes()
    watcher.add_listener(seen)
    watcher.start()
    assert watcher.wait_for(lambda v: v.get("p0") is not None, WAIT)
    raw = Raw(etcd1)
    version0 = raw.get(record_key(prefix, "p0")).version
    t0 = time.monotonic()
    for load in range(1, 101):
        pub.update(load=load)
    burst = time.monotonic() - t0
    assert watcher.wait_for(lambda v: v.get("p0").load == 100, WAIT)
    assert seen.wait(lambda s: any(c.record.load == 100 for c in s.of("p0", UPDATED)))
    time.sleep(0.6)  # anything still queued would land by now
    puts = raw.get(record_key(prefix, "p0")).version - version0
    updates = seen.of("p0", UPDATED)
    allowed = 2 + int(burst / 0.25) + 1  # one put per update interval the burst spanned, and the last
    assert 1 <= puts <= allowed, f"{puts} puts for 100 updates in {burst:.3f} s (at most {allowed})"
    assert len(updates) == puts and updates[-1].record.load == 100
    assert [c.record.load for c in updates] == sorted(c.record.load for c in updates)  # never goes back
    # an update that changes nothing puts nothing
    pub.update(load=100)
    time.sleep(0.4)
    assert raw.get(record_key(prefix, "p0")).version - version0 == puts


def test_close_removes_the_record_at_once(etcd1, prefix, registries):
    """A clean shutdown revokes its lease: the record goes now, not a TTL (10 s here) later."""
    pub = registries(etcd1, prefix, ttl=10)
    publish(pub, prefill("p0"))
    pub.start()
    watcher = registries(etcd1, prefix)
    seen = Changes()
    watcher.add_listener(seen)
    watcher.start()
    assert watcher.wait_for(lambda v: v.get("p0") is not None, WAIT)
    _, took = timed(pub.close)
    assert took < 2.0, f"close() took {took:.2f} s"
    gone = wait_until(lambda: watcher.get("p0") is None, 2.0)
    assert gone is not None and took + gone < 2.0, f"record still there {took + (gone or 2.0):.2f} s after close"
    assert seen.wait(lambda s: s.of("p0", LEFT))
    assert Raw(etcd1).get(record_key(prefix, "p0")) is None
    pub.close()  # idempotent


def test_lost_lease_is_granted_again_and_the_record_republished(etcd1, prefix, registries):
    """Someone revokes the rank's lease (or it ran out): the next refresh notices and puts the record again."""
    pub = registries(etcd1, prefix)
    publish(pub, prefill("p0", load=2))
    pub.start()
    watcher = registries(etcd1, prefix)
    seen = Changes()
    watcher.add_listener(seen)
    watcher.start()
    assert watcher.wait_for(lambda v: v.get("p0") is not None, WAIT)
    raw = Raw(etcd1)
    lease = raw.get(record_key(prefix, "p0")).lease
    assert lease and raw.lease_alive(lease)
    raw.revoke(lease)
    assert seen.wait(lambda s: s.of("p0", LEFT))
    back = wait_until(lambda: watcher.get("p0") is not None, TTL + 2)
    assert back is not None, "the record was not published again after its lease was lost"
    kv = raw.get(record_key(prefix, "p0"))
    assert kv.lease not in (0, lease) and raw.lease_alive(kv.lease)
    assert watcher.get("p0").load == 2


def test_a_live_ranks_record_deleted_by_hand_comes_back(etcd1, prefix, registries):
    """``publish`` keeps the record published: if someone deletes it (``etcdctl del --prefix`` to clean up,
    say) while the rank and its lease live on, the rank must put it back, or it stays invisible for good."""
    pub = registries(etcd1, prefix)
    publish(pub, prefill("p0"))
    pub.start()
    watcher = registries(etcd1, prefix).start()
    assert watcher.wait_for(lambda v: v.get("p0") is not None, WAIT)
    Raw(etcd1).run(lambda c: c.delete(record_key(prefix, "p0").encode()))
    assert watcher.wait_for(lambda v: v.get("p0") is None, WAIT)
    assert watcher.wait_for(lambda v: v.get("p0") is not None, TTL + 2), \
        f"the live rank's deleted record was never put back (publisher status: {pub.status()})"


def test_bad_updates_raise_and_a_failing_listener_hurts_no_one(etcd1, prefix, registries):
    pub = registries(etcd1, prefix)
    publish(pub, prefill("p0", load=1))
    pub.start()
    watcher = registries(etcd1, prefix)

    def broken(changes):
        raise RuntimeError("a listener bug")

    seen = Changes()
    watcher.add_listener(broken)
    watcher.add_listener(seen)
    watcher.start()
    assert seen.wait(lambda s: s.of("p0", JOINED))
    with pytest.raises(RegistryError, match="load"):
        pub.update(load=-1)
    with pytest.raises(RegistryError, match="capacity"):
        pub.update(capacity=0)
    pub.update(load=2)
    assert seen.wait(lambda s: [c.record.load for c in s.of("p0", UPDATED)] == [2])
    watcher.remove_listener(seen)
    watcher.remove_listener(seen)  # not there any more: no error
    pub.update(load=3)
    assert watcher.wait_for(lambda v: v.get("p0").load == 3, WAIT)
    time.sleep(0.1)
    assert [c.record.load for c in seen.of("p0", UPDATED)] == [2] and not watcher.degraded


# ----------------------------------------------------------------- liveness
CHILD = r"""
import sys, time
from kvlend.cluster.registry import Registry
from kvlend.cluster.records import RankRecord
from kvlend.security.credentials import Credentials
endpoints, prefix, ttl = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3])
creds = Credentials.load(*sys.argv[4:7])  # its rank certificate: for etcd and for its record
reg = Registry(endpoints, prefix, cluster_ca=creds.ca_pem, etcd_credentials=creds, ttl=ttl, timeout=1).start()
reg.publish(RankRecord("victim", "router", "127.0.0.1", 0, capacity=8, load=1), creds)
reg.update(load=5)
if not reg.wait_for(lambda v: v.get("victim") is not None and v.get("victim").load == 5, 10):
    sys.exit(3)
print("published", flush=True)
time.sleep(60)  # the parent SIGKILLs it long before
"""


def test_a_killed_rank_leaves_within_its_ttl(etcd1, prefix, registries, tmp_path):
    watcher = registries(etcd1, prefix)
    seen = Changes()
    watcher.add_listener(seen)
    watcher.start()
    assert watcher.ready(WAIT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    files = save_rank(creds("victim", "router"), str(tmp_path / "victim"))
    child = subprocess.Popen([sys.executable, "-c", CHILD, ",".join(etcd1.endpoints), prefix, str(TTL),
                              files["KVLEND_CA"], files["KVLEND_CERT"], files["KVLEND_KEY"]],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env,
                             start_new_session=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 20.0)
        line = child.stdout.readline() if ready else b""
        if line.strip() != b"published":
            child.kill()
            pytest.fail(f"the publisher child did not come up: {line!r} {child.communicate(timeout=5)[1][-2000:]!r}")
        assert watcher.wait_for(lambda v: v.get("victim") is not None and v.get("victim").load == 5, WAIT)
        last = watcher.get("victim")
        os.killpg(child.pid, signal.SIGKILL)
        t0 = time.monotonic()
        child.wait(5)
        left = watcher.wait_for(lambda v: v.get("victim") is None, TTL + 4)
        took = time.monotonic() - t0
        assert left and took <= TTL + 2, f"a SIGKILLed rank stayed {took:.2f} s (ttl {TTL} s + 2 s allowed)"
        assert seen.wait(lambda s: s.of("victim", LEFT))
        assert [c.record for c in seen.of("victim", LEFT)] == [last]
        assert not watcher.degraded
        print(f"SIGKILLed rank left after {took:.2f} s (ttl {TTL} s)")
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(5)
        child.stdout.close()
        child.stderr.close()
