"""What the ``test_registry*`` files share: the cluster CA, signed records, a change listener, the etcd fixtures.

The fixtures start real ``etcd`` members (``etcd1``: one per test module; ``etcd3``: three, per test)
and make ``Registry`` objects that are closed, their threads gone, when a test ends.  A test module
names the fixtures it uses (``etcd1 = shared.etcd1``): pytest finds a fixture by its name in the module.
"""

from __future__ import annotations

import functools
import os
import secrets
import threading
import time
from pathlib import Path

import pytest

from kvlend.cluster.etcd_members import EtcdMembers
from kvlend.cluster.records import RankRecord, layout_digest
from kvlend.cluster.registry import Registry
from kvlend.cluster.signing import RecordSigner
from kvlend.cluster.view import Change
from kvlend.security.certs import Authority
from kvlend.security.credentials import Credentials
from kvlend.testing.kvcache import make_layout, make_pools

ROOT = Path(__file__).resolve().parents[2]  # the repository
TTL, TIMEOUT = 2, 1.0  # short lease and call deadline keep the files fast
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


def pid_gone(pid: int) -> bool:
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
    leaked = [pid for pid in pids if not pid_gone(pid)]
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
