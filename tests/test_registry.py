"""The etcd registry (``Registry``) and the local members it is tested on (``EtcdMembers``), against real etcd.

Every test runs real ``etcd`` processes (one member, or three for failover
and quorum loss) and talks to them through ``Registry`` and, where a test
needs a writer that is not a ``Registry`` (a foreign or broken rank), a plain
``aetcd`` client.  Each test uses a prefix of its own, so the tests sharing
the module's single member never see each other's records.  Deadlines are
liveness bounds the design promises (a dead rank leaves within its TTL plus
etcd's expiry tick; degraded within a probe period plus one call deadline),
never performance claims.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aetcd
import pytest

from kvlend.cluster.etcd_members import EtcdMembers
from kvlend.cluster.records import RankRecord, layout_digest, layout_key, ranks_prefix, record_key
from kvlend.cluster.registry import Registry, etcd_security_from_env
from kvlend.cluster.signing import RecordSigner
from kvlend.cluster.view import JOINED, LEFT, UPDATED, Change
from kvlend.errors import ConfigError, RegistryError
from kvlend.ports import spare_port
from kvlend.security.certs import Authority, save_rank
from kvlend.security.credentials import Credentials
from kvlend.testing.kvcache import make_layout, make_pools
from tests.support.etcd import Raw

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]
TTL, TIMEOUT = 2, 1.0  # short lease and call deadline keep the file fast
WAIT = 5.0  # the most any "it shows up" wait may take
LAYOUT = make_layout(make_pools(8))
LAYOUT_BYTES = LAYOUT.encode()
LAYOUTS = {layout_digest(LAYOUT_BYTES): LAYOUT_BYTES}
AUTHORITY = Authority.create()  # the cluster CA: it signs etcd's certificate and every rank's


@functools.lru_cache(maxsize=None)
def creds(identity: str, role: str) -> Credentials:
    return AUTHORITY.issue(identity, role)


def publish(registry: Registry, record: RankRecord) -> None:
    """Publish as the rank itself would: signed with its own certificate."""
    registry.publish(record, creds(record.identity, record.role))


def signed(record: RankRecord) -> bytes:
    """The value the rank itself would put (for a writer that is no ``Registry``)."""
    return RecordSigner(creds(record.identity, record.role)).sign(record)


# ----------------------------------------------------------------- helpers
def prefill(identity: str, port: int = 5000, **fields) -> RankRecord:
    return RankRecord(identity, "prefill", "127.0.0.1", port, layout=LAYOUT_BYTES, capacity=4, **fields)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(pid, 0); EtcdMembers reaps what it kills, so any process here is a leak
    return False


def etcd_pids(members: EtcdMembers) -> list[int]:
    return [p.pid for p in members.procs if p is not None and p.poll() is None]




class Changes:
    """A listener that keeps every batch it is handed (it runs on the registry thread: quick, never blocks)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.batches: list[list[Change]] = []

    def __call__(self, changes: list[Change]) -> None:
        with self.cond:
            self.batches.append(list(changes))
            self.cond.notify_all()

    def all(self) -> list[Change]:
        with self.cond:
            return [c for batch in self.batches for c in batch]

    def of(self, identity: str, kind: str | None = None) -> list[Change]:
        return [c for c in self.all() if c.record.identity == identity and (kind is None or c.kind == kind)]

    def wait(self, predicate, timeout: float = WAIT) -> bool:
        """The registry notifies its condition before it calls listeners: wait on what the listener saw."""
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self), timeout)


def timed(fn, *args, **kwargs):
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - t0


def wait_until(predicate, timeout: float, step: float = 0.02) -> float | None:
    """Seconds until ``predicate()`` held, or None if it did not within ``timeout``."""
    t0 = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(step)


# ----------------------------------------------------------------- fixtures
def _close_members(members: EtcdMembers) -> None:
    pids = [p.pid for p in members.procs if p is not None]
    members.close()
    leaked = [pid for pid in pids if not _pid_gone(pid)]
    assert not leaked, f"EtcdMembers.close() left etcd processes {leaked}"


@pytest.fixture(scope="module")
def etcd1():
    members = EtcdMembers(1, authority=AUTHORITY)
    try:
        yield members
    finally:
        _close_members(members)


@pytest.fixture
def etcd3():
    members = EtcdMembers(3, authority=AUTHORITY)
    try:
        yield members
    finally:
        _close_members(members)


@pytest.fixture
def prefix() -> str:
    return f"/kvlend/t{secrets.token_hex(4)}"


@pytest.fixture
def registries():
    """A factory of (unstarted) ``Registry``; every one is closed, and its thread gone, when the test ends."""
    made: list[Registry] = []

    def make(etcd, prefix, **kw) -> Registry:
        """``etcd``: members (their client certificate, unless ``kw`` names etcd's TLS) or endpoints."""
        endpoints = etcd
        if isinstance(etcd, EtcdMembers):
            endpoints = etcd.endpoints
            if etcd.client_tls and not {"ca_file", "etcd_credentials"} & set(kw):
                kw.update(etcd.client_tls)
        kw.setdefault("cluster_ca", AUTHORITY.cert_pem)
        kw.setdefault("ttl", TTL)
        kw.setdefault("timeout", TIMEOUT)
        reg = Registry(endpoints, prefix, **kw)
        made.append(reg)
        return reg

    yield make
    for reg in made:
        reg.close()
    alive = [reg for reg in made if reg._thread is not None and reg._thread.is_alive()]
    for reg in alive:  # a thread still in its last etcd call: give it the rest of its deadline
        reg._thread.join(3 * reg.timeout)
    assert not [reg for reg in made if reg._thread is not None and reg._thread.is_alive()], \
        "a registry thread outlived close()"


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


# ----------------------------------------------------------------- snapshot, then watch
def test_records_written_while_the_watcher_starts_are_all_seen(etcd1, prefix, registries):
    """A foreign writer keeps putting records before, during and after the watcher's snapshot: none is missed,
    none counted twice (each JOINED exactly once), whether it came in the snapshot or the watch."""
    raw = Raw(etcd1)
    for round_ in range(3):
        written: list[str] = []
        started, stop = threading.Event(), threading.Event()
        failed: list[BaseException] = []

        async def write(client):
            await client.put(layout_key(prefix, prefill("x").layout_digest).encode(), LAYOUT_BYTES)
            i = 0
            while not stop.is_set() and i < 400:
                identity = f"r{round_}-{i:03d}"
                await client.put(record_key(prefix, identity).encode(), signed(prefill(identity, load=i % 7)))
                written.append(identity)
                i += 1
                if i == 5:
                    started.set()
                await asyncio.sleep(0.002)

        def writer():
            try:
                raw.run(write, timeout=20)
            except BaseException as exc:  # noqa: BLE001 -- reported on the test thread
                failed.append(exc)
            finally:
                started.set()

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        assert started.wait(WAIT)
        watcher = registries(etcd1, prefix)
        seen = Changes()
        watcher.add_listener(seen)
        watcher.start()
        assert watcher.ready(WAIT)
        at_ready = len(written)
        wait_until(lambda: len(written) >= at_ready + 20, WAIT)  # some more come after the snapshot
        stop.set()
        thread.join(WAIT)
        assert not thread.is_alive() and not failed, failed
        mine = {i for i in written}
        assert watcher.wait_for(lambda v: mine <= {r.identity for r in v.ranks()}, WAIT), \
            f"missing {sorted(mine - {r.identity for r in watcher.ranks()})}"
        assert seen.wait(lambda s: mine <= {c.record.identity for c in s.all() if c.kind == JOINED})
        joined = [c.record.identity for c in seen.all() if c.kind == JOINED and c.record.identity in mine]
        assert sorted(joined) == sorted(mine), "a record was counted twice"
        assert not [c for c in seen.all() if c.kind == LEFT]
        first = {c.record.identity for c in seen.batches[0]} & mine
        assert 5 <= len(first) < len(mine), "the snapshot should have caught the writer mid-way"
        assert not watcher.status()["rejected"] and not watcher.degraded
        watcher.close()


def test_garbage_under_the_ranks_prefix_is_rejected(etcd1, prefix, registries):
    raw = Raw(etcd1)
    ranks = ranks_prefix(prefix)
    good = prefill("good")
    raw.put(ranks + "junk", b"not json")
    raw.put(ranks + "liar", signed(prefill("someone-else")))  # the key and the record disagree
    raw.put(ranks + "old", b'{"version": 0}')
    other_layout = make_layout(make_pools(16, layers=2)).encode()
    raw.put(ranks + "nolayout", signed(RankRecord("nolayout", "prefill", "127.0.0.1", 5001, layout=other_layout)))
    raw.put_record(prefix, good, signed(good))
    watcher = registries(etcd1, prefix)
    seen = Changes()
    watcher.add_listener(seen)
    watcher.start()
    assert watcher.ready(WAIT)
    assert watcher.ranks() == [good]
    assert set(watcher.view.rejected) == {ranks + k for k in ("junk", "liar", "old", "nolayout")}
    assert "not JSON" in watcher.view.rejected[ranks + "junk"]
    assert "someone-else" in watcher.view.rejected[ranks + "liar"]
    assert "not known" in watcher.view.rejected[ranks + "nolayout"]  # names a layout nobody stored
    # garbage arriving through the watch lands in rejected too; over a live rank it changes nothing
    raw.put(ranks + "late", b"\xff\xfe")
    raw.put(record_key(prefix, "good"), b"{}")
    assert watcher.wait_for(lambda v: ranks + "late" in v.rejected and ranks + "good" in v.rejected, WAIT)
    assert watcher.ranks() == [good] and watcher.pick(LAYOUT) == good
    assert [c.record.identity for c in seen.all()] == ["good"]  # joined once, never left
    assert set(watcher.status()["rejected"]) == {ranks + k for k in ("junk", "liar", "old", "nolayout", "late",
                                                                     "good")}
    # a capacity changed after signing is refused the same way, and a valid update is taken again
    raw.put(record_key(prefix, "good"), signed(prefill("good")).replace(b'"capacity":4', b'"capacity":65536'))
    assert watcher.wait_for(lambda v: "signature" in v.rejected.get(ranks + "good", ""), WAIT)
    assert watcher.get("good") == good
    raw.put(record_key(prefix, "good"), signed(prefill("good", load=3)))
    assert watcher.wait_for(lambda v: v.get("good") == prefill("good", load=3) and ranks + "good" not in v.rejected,
                            WAIT)
    # a stored layout that does not hash to its name is refused, and the record naming it too
    other = RankRecord("other", "prefill", "127.0.0.1", 5001, layout=other_layout)  # its layout, never stored so far
    raw.put(layout_key(prefix, other.layout_digest), LAYOUT_BYTES)
    raw.put(record_key(prefix, "other"), signed(other))
    assert watcher.wait_for(lambda v: "not known" in v.rejected.get(ranks + "other", ""), WAIT)
    assert watcher.get("other") is None
    # a deleted key is a rank leaving
    raw.run(lambda c: c.delete(record_key(prefix, "good").encode()))
    assert seen.wait(lambda s: s.of("good", LEFT)) and watcher.get("good") is None


def test_a_record_overwritten_by_someone_else_is_put_back(etcd1, prefix, registries):
    pub = registries(etcd1, prefix)
    mine = prefill("p0", load=1)
    publish(pub, mine)
    pub.start()
    watcher = registries(etcd1, prefix).start()
    assert watcher.wait_for(lambda v: v.get("p0") == mine, WAIT)
    raw = Raw(etcd1)
    key = record_key(prefix, "p0")
    for forged in (prefill("p0", port=6666, load=1).encode(), b"garbage"):  # a valid-looking forgery, then junk
        raw.put(key, forged)
        assert wait_until(lambda: (kv := raw.get(key)) is not None and kv.value in pub._mine, WAIT), \
            "the publisher did not put its record back"
        assert raw.get(key).lease != 0 and raw.lease_alive(raw.get(key).lease)  # under its own lease again
        assert watcher.wait_for(lambda v: v.get("p0") == mine and not v.rejected, WAIT)
    pub.update(load=2)  # its own updates are not taken for someone else's
    assert watcher.wait_for(lambda v: v.get("p0") == prefill("p0", load=2), WAIT)
    assert not pub.degraded and pub.status()["published"]


def test_a_dead_ranks_record_overwritten_with_garbage_leaves_after_a_ttl(etcd1, prefix, registries):
    """The garbage took the key off the dead rank's lease: only the grace makes it leave."""
    raw = Raw(etcd1)
    ghost = prefill("ghost")
    raw.put_record(prefix, ghost, signed(ghost))  # no publisher behind it: what a dead rank leaves
    watcher = registries(etcd1, prefix)
    seen = Changes()
    watcher.add_listener(seen)
    watcher.start()
    assert watcher.wait_for(lambda v: v.get("ghost") is not None, WAIT)
    raw.put(record_key(prefix, "ghost"), b"garbage")
    assert watcher.wait_for(lambda v: record_key(prefix, "ghost") in v.rejected, WAIT)
    assert seen.wait(lambda s: s.of("ghost", LEFT), TTL + WAIT), "the ghost never left"
    assert watcher.get("ghost") is None and record_key(prefix, "ghost") in watcher.status()["rejected"]


def test_a_deep_models_record_is_small_and_its_layout_is_read_once(etcd1, prefix, registries):
    deep = make_layout(make_pools(8, layers=126)).encode()  # a 405B-class depth: 126 layers
    record = RankRecord("deep", "prefill", "127.0.0.1", 5000, layout=deep, capacity=4)
    pub = registries(etcd1, prefix)
    publish(pub, record)
    pub.start()
    watcher = registries(etcd1, prefix).start()
    assert watcher.wait_for(lambda v: v.get("deep") == record, WAIT), watcher.status()
    assert watcher.get("deep").page_layout.encode() == deep and pub.ready(WAIT) and not pub.degraded
    raw = Raw(etcd1)
    stored = raw.get(record_key(prefix, "deep")).value
    assert len(stored) < 1536 and raw.get(layout_key(prefix, record.layout_digest)).value == deep  # with its cert
    print(f"126-layer layout {len(deep)} bytes; its record {len(stored)} bytes")


def test_a_fresh_registry_reads_240_ranks_in_pages(etcd1, prefix, registries):
    """240 ranks, each with its own 32-layer layout (8B-class): over 4 MiB as whole records in one read."""
    ranks = [RankRecord(f"r{i:03d}", "prefill", "127.0.0.1", 5000 + i, capacity=4,
                        layout=make_layout(make_pools(2, layers=32)).encode()) for i in range(240)]

    async def write(client):
        for r in ranks:
            await client.put(layout_key(prefix, r.layout_digest).encode(), r.layout)
            await client.put(record_key(prefix, r.identity).encode(), signed(r))

    Raw(etcd1).run(write, timeout=60)
    assert sum(len(r.layout) for r in ranks) > 3 << 20
    watcher = registries(etcd1, prefix)
    t0 = time.monotonic()
    watcher.start()
    assert watcher.ready(30), watcher.status()
    took = time.monotonic() - t0
    assert watcher.ranks() == ranks and not watcher.status()["rejected"]
    print(f"a fresh registry read 240 ranks and their layouts in {took:.2f} s")


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
        assert not members.alive(0) and not members.healthy(0) and _pid_gone(pids[0])
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
    assert all(_pid_gone(pid) for pid in pids), f"etcd processes left: {[p for p in pids if not _pid_gone(p)]}"
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
    assert all(_pid_gone(pid) for pid in pids)


def test_64_forged_records_naming_distinct_large_layouts_cost_a_reader_nothing_it_fetches(etcd1, prefix,
                                                                                          registries):
    """The filer's 64 records, each naming its own ~1 MiB layout (+269 MiB and 7.3 s per reader before):
    unsigned, none is fetched; the reader's layout memory stays within ``MAX_LAYOUT_CACHE_BYTES`` whatever
    is written (here: 0 bytes), and its Python heap grows by far less than one layout."""
    import tracemalloc

    from kvlend.cluster.view import MAX_LAYOUT_CACHE_BYTES

    raw = Raw(etcd1)
    blob = os.urandom(1000 << 10)

    async def write(client):
        for i in range(64):
            data = blob[:-8] + i.to_bytes(8, "big")  # distinct: each its own digest
            digest = layout_digest(data)
            await client.put(layout_key(prefix, digest).encode(), data)
            forged = signed(prefill("real")).replace(b'"identity":"real"', f'"identity":"f{i}"'.encode())
            body = {**json.loads(forged), "layout": digest, "capacity": 65536}  # a real rank's cert, not its record
            await client.put(record_key(prefix, f"f{i}").encode(), json.dumps(body).encode())
    raw.run(write, timeout=60)
    tracemalloc.start()
    try:
        watcher = registries(etcd1, prefix).start()
        assert watcher.ready(WAIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rejected = watcher.view.rejected
    assert len(rejected) == 64 and all("signed by the prefill certificate of 'real'" in why
                                       for why in rejected.values()), list(rejected.values())[:2]
    assert watcher.view.layouts == {} and watcher.view.layout_bytes == 0 <= MAX_LAYOUT_CACHE_BYTES
    assert peak < len(blob), f"the reader's heap peaked at {peak} bytes"
    print(f"64 forged records, ~1 MiB layouts each: reader fetched 0 layouts, heap peak {peak / 2**20:.2f} MiB")
