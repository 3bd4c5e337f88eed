"""An agent taken out of service after reads on it would not stop: drained, not dropped.

Over tcp a prefill that was stopped answers the GETs it owes when it resumes.  Closing the
reader's agent while such answers may still come makes UCX abort or crash the prefill
(docs/faults.md), so a retired agent is progressed until every read posted on it is terminal,
and closed only then.  While it drains, late answers land in the reads' destinations, so their
Completions (the caller's signal that a destination may be reused) wait for the drain too: the
pages stay quarantined.  A drain that does not end by ``until`` stops (the agent is never
progressed again, so nothing more lands), the Completions go out, and the handles are kept for
the drain at close.  Retiring stops reads only where they land while progressed (``progressed_only``).
"""

from __future__ import annotations

import os

from kvlend.transport import Completion

from .calls import Read, quietly, release

# UCX transports whose READs land only while the reader's worker is progressed (tcp: a GET is
# emulated with messages) or inside transfer() (CPU copies); RDMA NICs and GPU copy engines write on their own.
PROGRESSED_TLS = frozenset(("tcp", "cma", "sm", "shm", "self", "posix", "sysv", "xpmem"))


class Retired:
    """A retired agent, the reads still posted on it (by tag), and until when it is drained."""

    def __init__(self, agent, reads: dict[bytes, Read], until: float) -> None:
        self.agent = agent
        self.reads = reads
        self.until = until
        self.reported = not reads  # the reads' Completions went out

    @property
    def drained(self) -> bool:
        return not any(any(r.live) for r in self.reads.values())

    def drain(self) -> bool:
        """Progress the agent once and ask NIXL about each live handle; whether all are terminal."""
        quietly(self.agent.get_new_notifs)
        for read in self.reads.values():
            for i, handle in enumerate(read.handles):
                if read.live[i]:
                    try:
                        read.live[i] = self.agent.check_xfer_state(handle) == "PROC"
                    except Exception:  # NotFound after a disconnect, or an error status: terminal
                        read.live[i] = False
        return self.drained

    def report(self) -> list[Completion]:
        """The reads' Completions (each with the error it failed with), once."""
        if self.reported:
            return []
        self.reported = True
        return [Completion(tag, read.error) for tag, read in self.reads.items()]

    def release(self) -> None:
        """Release every handle (they hold the agent, which must go before it is destroyed)."""
        for read in self.reads.values():
            release(read.handles)
            read.handles, read.live = [], []


def progressed_only(progress_thread: bool) -> bool:
    """Whether this process's READs land only while their agent is progressed (or inside ``transfer()``).

    So with NIXL's progress thread off and UCX limited to ``PROGRESSED_TLS``, by ``UCX_TLS`` or
    for want of any RDMA device on this host.
    """
    if progress_thread:
        return False
    tls = os.environ.get("UCX_TLS", "")
    if tls and not tls.startswith("^") and set(tls.split(",")) <= PROGRESSED_TLS:
        return True
    try:
        return not os.listdir("/sys/class/infiniband")
    except OSError:
        return True
