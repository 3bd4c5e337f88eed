"""What the ``test_sessions_*`` files share: their configs and the questions they ask a world's ends.

Those files drive ``PrefillSession`` and ``DecodeSession`` together over
``kvlend.testing.World``, one scenario per test with the clock in its hands.
"""

from __future__ import annotations

from kvlend.errors import KvlendError
from kvlend.protocol.config import NodeConfig
from kvlend.protocol.ticket import Ticket

# A ticket's reads wait for the claim's answer here (read_ahead off): these files test that answer's every
# outcome before anything is read; reads going out with the claim (the default) are test_read_ahead.py's.
CFG = NodeConfig(ttl=5.0, heartbeat=1.0, handshake_timeout=3.0, transfer_timeout=20.0, cancel_grace=2.0,
                 chunk_pages=4, read_ahead=False)
EPS_T = 0.01  # just past a deadline
LONG = NodeConfig(ttl=5.0, heartbeat=1.0, handshake_timeout=3.0, transfer_timeout=1e6, cancel_grace=2.0,
                  chunk_pages=4, read_ahead=False)


def locked(prefill) -> int:
    return prefill.lender.locks.locked_pages()


def live(prefill, lease) -> bool:
    """Whether ``lease`` (a Lease, or a Ticket's) is live on the prefill."""
    try:
        prefill.lender.get(lease.lease if isinstance(lease, Ticket) else lease.id, prefill.now)
        return True
    except KvlendError:
        return False


def confirm(world) -> None:
    """One tick with no time passing: the heartbeat a pushed offer asked for goes out and its renewal comes back.

    Only then do a pushed fetch's reads count for the bound before the done ack.
    """
    world.tick()


def assert_clean(d, reads: int = 0):
    """No fetch, no tracked request and (once the pending actions ran) no read posted: the start left nothing."""
    d.world.pump()
    assert d.session.in_flight == 0
    assert d.session.tracker.stats.requests == 0 and d.session.tracker.stats.pending == 0
    assert len(d.backend.reads) == reads
