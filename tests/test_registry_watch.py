"""The etcd registry, snapshot then watch: what a reader sees of records written around its start.

Against a real one-member ``etcd``: records written while the watcher starts are all seen; garbage,
overwritten and forged records are rejected or put back; a fresh registry reads 240 ranks in pages and
fetches each layout once, and forged records naming large layouts cost it nothing it fetches.  The rest
of the registry's tests: ``test_registry.py`` and ``test_registry_etcd.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest

from kvlend.cluster.records import RankRecord, layout_digest, layout_key, ranks_prefix, record_key
from kvlend.cluster.view import JOINED, LEFT
from kvlend.testing.kvcache import make_layout, make_pools
from tests.support import registry as shared
from tests.support.etcd import Raw
from tests.support.registry import LAYOUT, LAYOUT_BYTES, TTL, WAIT, Changes, prefill, publish, signed, wait_until

pytestmark = pytest.mark.system

# The etcd fixtures this module uses (pytest finds them here by name).
etcd1, prefix, registries = shared.etcd1, shared.prefix, shared.registries


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
