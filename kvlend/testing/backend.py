"""The in-memory transfer backend: a node's registered pools, found by address, and reads between them.

``Post`` turns descriptors into copies between real numpy pools (addresses are
checked to fall inside the peer's and our own registered pools, then mapped
back to the arrays).  A read stays in flight until the test ends it:
``finish(tag)`` (lands, then reported ok), ``fail(tag)`` (reported with an
error, nothing written) or ``late(tag)`` (lands *after* its fetch decided to
fail, then reported with an error).  ``Cancel`` only marks a read;
``RemovePeer`` makes that peer's reads terminal (``PeerLost``, nothing more
written).  Each read is reported to ``session.completed`` exactly once, and
never writes after it is terminal.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import BackendError, KvlendError, PeerLost, TransferCancelled

if TYPE_CHECKING:
    from .ends import DecodeEnd, PrefillEnd
    from .world import World

KIND = "memory"  # the backend kind both in-memory ends announce in their handshake


class ContractError(AssertionError):
    """A session, or this test transport, broke the contract between sessions and their shell."""


# ------------------------------------------------------------------ memory
class Memory:
    """A node's registered pools, found by address."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = list(arrays)
        spans = sorted((a.ctypes.data, a.nbytes, i) for i, a in enumerate(self.arrays))
        self._starts = [s[0] for s in spans]
        self._spans = spans
        self._flat = [a.view(np.uint8).reshape(-1) for a in self.arrays]

    def locate(self, addr: int, length: int) -> tuple[int, int]:
        """(pool index, byte offset) of ``[addr, addr + length)``, which must lie inside one pool."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or length <= 0:
            raise ContractError(f"descriptor {addr:#x}+{length} is not inside a registered pool")
        start, size, index = self._spans[i]
        if addr + length > start + size:
            raise ContractError(f"descriptor {addr:#x}+{length} runs past the pool at {start:#x} ({size} bytes)")
        return index, addr - start

    def view(self, addr: int, length: int) -> np.ndarray:
        index, off = self.locate(addr, length)
        return self._flat[index][off:off + length]


# ------------------------------------------------------------------ backend
@dataclass(eq=False)
class Read:
    tag: bytes
    conn: int
    copies: list  # (source Memory, src addr, dst addr, length)
    posted: float
    cancelled: bool = False  # Cancel was asked for
    landed: bool = False  # its bytes were written into the destination
    terminal: bool = False  # the backend is done with it (reported, or queued to be)
    reported: bool = False  # session.completed was called for it
    error: KvlendError | None = None


class MemoryBackend:
    """The decode's transfer backend: copies between numpy pools, ended by the test."""

    kind = KIND

    def __init__(self, world: World, owner: DecodeEnd) -> None:
        self.world = world
        self.owner = owner
        self.memory = owner.memory
        self.peers: dict[int, PrefillEnd] = {}
        self.reads: dict[bytes, Read] = {}  # every read posted, by tag
        self.queue: deque[Read] = deque()  # terminal, not yet reported
        self.writes: list[tuple[bytes, int, int, float]] = []  # (tag, dst addr, length, when)
        self.removed: list[int] = []  # RemovePeer, in order

    # ------------------------------------------------------ driven by actions
    def add_peer(self, conn: int, metadata: bytes) -> bool:
        peer = self.world.by_metadata.get(metadata)
        if peer is None or not peer.alive:
            return False
        self.peers[conn] = peer
        return True

    def remove_peer(self, conn: int) -> None:
        self.removed.append(conn)
        self.peers.pop(conn, None)
        for read in self.in_flight():
            if read.conn == conn:
                self._terminal(read, PeerLost(f"backend peer of link {conn} removed"))

    def post(self, conn: int, batches, tag: bytes) -> None:
        if tag in self.reads:
            raise ContractError(f"tag {tag!r} posted twice")
        self.world.on_post(self.owner, tag)
        peer = self.peers.get(conn)
        read = Read(tag, conn, [], self.world.now)
        self.reads[tag] = read
        if peer is None or not peer.alive:  # refused before anything moved (the shell's BackendError)
            self._terminal(read, BackendError(f"link {conn} has no backend peer"))
            return
        for batch in batches:
            for (raddr, rlen, _), (laddr, llen, _) in zip(batch.remote.tolist(), batch.local.tolist()):
                if rlen != llen:
                    raise ContractError(f"descriptor lengths differ: {rlen} != {llen}")
                peer.memory.locate(raddr, rlen)  # inside the prefill's pools
                self.memory.locate(laddr, llen)  # inside ours
                read.copies.append((peer.memory, raddr, laddr, rlen))
        if not read.copies:
            raise ContractError(f"read {tag!r} posted with no descriptors")
        self.world.post_policy(self, read)

    def cancel(self, tag: bytes) -> None:
        read = self.reads.get(tag)
        if read is not None and not read.terminal:
            read.cancelled = True
            self.world.cancel_policy(self, read)

    # ------------------------------------------------------ driven by tests
    def in_flight(self, conn: int | None = None) -> list[Read]:
        return [r for r in self.reads.values() if not r.terminal and (conn is None or r.conn == conn)]

    def land(self, tag: bytes) -> None:
        """Write the read's bytes now (it stays in flight until reported)."""
        read = self.reads[tag]
        if read.terminal:
            raise ContractError(f"read {tag!r} would write after it went terminal")
        if read.landed:
            return
        for _, _, laddr, length in read.copies:
            self.world.on_write(self.owner, read, laddr, length)
        for source, raddr, laddr, length in read.copies:
            self.memory.view(laddr, length)[:] = source.view(raddr, length)
            self.writes.append((tag, laddr, length, self.world.now))
        read.landed = True

    def finish(self, tag: bytes) -> None:
        """The read completes: its bytes land, then it is reported ok."""
        self.land(tag)
        self._terminal(self.reads[tag], None)

    def fail(self, tag: bytes, error: KvlendError | None = None) -> None:
        """The read fails without writing (or after ``land``): reported with ``error``."""
        read = self.reads[tag]
        if error is None:
            error = TransferCancelled(f"read {tag!r} cancelled") if read.cancelled else \
                BackendError(f"read {tag!r} failed")
        self._terminal(read, error)

    def late(self, tag: bytes, error: KvlendError | None = None) -> None:
        """The read writes its bytes anyway, then is reported failed (a cancelled read in UCX)."""
        self.land(tag)
        self.fail(tag, error)

    def _terminal(self, read: Read, error: KvlendError | None) -> None:
        if read.terminal:
            raise ContractError(f"read {read.tag!r} went terminal twice")
        read.terminal, read.error = True, error
        self.queue.append(read)

    def deliver(self) -> bool:
        """Report one terminal read to the session (exactly once)."""
        if not self.queue:
            return False
        read = self.queue.popleft()
        if read.reported:
            raise ContractError(f"read {read.tag!r} reported twice")
        read.reported = True
        self.owner.session.completed(read.tag, read.error, self.world.now)
        return True

    def die(self) -> None:
        """The decode process is gone: nothing it posted writes or reports again."""
        for read in self.in_flight():
            read.terminal = read.reported = True
        self.queue.clear()

