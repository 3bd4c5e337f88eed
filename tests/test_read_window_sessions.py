"""The decode session under a tcp read window, sans-IO (``kvlend.testing``): reads over the
window wait in order, are posted as earlier ones end, none is lost, and a fetch's deadline still applies."""

from __future__ import annotations

import pytest

from kvlend.errors import TransferTimeout
from kvlend.protocol.config import NodeConfig
from kvlend.protocol.decode import FetchState
from kvlend.testing import rig

pytestmark = pytest.mark.unit

CFG = NodeConfig(ttl=5.0, heartbeat=1.0, handshake_timeout=3.0, transfer_timeout=20.0, cancel_grace=2.0,
                 chunk_pages=4)


def flying(d) -> list[int]:
    return [sum(c[3] for c in r.copies) for r in d.backend.in_flight()]


def chunk_bytes() -> int:
    world, p, d, conn = rig(CFG)
    d.fetch_ticket(p.ticket(100, seed=0), seed=0)
    return max(flying(d))


@pytest.mark.parametrize("chunks", [0.3, 1, 3])
def test_many_fetches_stay_within_the_window_and_all_land(chunks):
    """Whole chunks wait for room; a chunk larger than the window goes in pieces, one window at a time, and
    counts for the bound only once its last piece landed."""
    window = int(chunks * chunk_bytes())
    world, p, d, conn = rig(CFG, seed=5, shuffle=True, read_window=window)
    sizes = [1, 3, 4, 17, 40, 63, 64, 65, 100]
    records = [d.fetch_ticket(p.ticket(n, seed=i), seed=i) for i, n in enumerate(sizes)]
    assert d.session.reads_waiting > 0
    order = []
    for _ in range(10_000):
        if not d.session.in_flight:
            break
        assert sum(flying(d)) <= window
        reads = d.backend.in_flight()
        if reads:
            order.append(reads[0].tag)
            d.backend.finish(reads[0].tag)
        world.pump()
    for r, n in zip(records, sizes):
        assert r.fetch.state is FetchState.DONE, r.fetch.error
        assert r.fetch.bound == n
    assert d.session.reads_waiting == 0
    seqs = [tuple(int(x) for x in t.split(b":")[1].split(b".")) for t in order]
    assert seqs == sorted(seqs)  # posted in the order they were planned, a chunk's pieces in theirs
    world.check_locks()


def test_the_deadline_applies_to_reads_still_waiting():
    world, p, d, conn = rig(CFG, read_window=chunk_bytes())
    r = d.fetch_ticket(p.ticket(100, seed=1), seed=1)
    (first,) = d.backend.in_flight()
    assert d.session.reads_waiting > 0
    posted = set(d.backend.reads)
    world.advance(CFG.transfer_timeout + 0.01)
    assert r.fetch.state is FetchState.CANCELLING and first.cancelled
    assert d.session.reads_waiting == 0 and set(d.backend.reads) == posted  # the waiting ones never went out
    d.backend.fail(first.tag)
    world.pump()
    assert r.fetch.state is FetchState.FAILED and isinstance(r.fetch.error, TransferTimeout)
    assert p.ended[-1][1] == "aborted"
