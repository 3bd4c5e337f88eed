"""The TCP read window: bytes of reads in flight per (reader agent, prefill), kept below the socket buffering.

Why (docs/faults.md, "UCX purges queued GET answers"): over tcp a read is a GET the prefill
answers in software; an answer that finds the socket full waits inside UCX, and UCX crashes the
prefill when it purges such answers after the reader's socket closes.  An answer waits only once
the reader's receive buffer, the prefill's send buffer and UCX's small send buffer are all full, so
a reader that never has more bytes in flight to one prefill than the smaller of the two pinned
socket buffers never makes one wait, whatever it does next: stop reading, die, or close.

Pure: the sizes come in as numbers, and ``ReadWindow`` is fed posts and ends.  The backend pins
the buffers (``UCX_TCP_SNDBUF``/``UCX_TCP_RCVBUF``) and the session holds back reads the window
does not admit yet.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Hashable, Mapping, Sequence

import numpy as np

from ..errors import ConfigError
from .reads import ReadBatch

DEFAULT_BUFFER = 4 << 20  # bytes per socket buffer kvlend pins unless UCX_TCP_SNDBUF/RCVBUF say otherwise
MIN_BUFFER = 128 << 10  # below this the window would serialise reads (and UCX's own 8 KiB tx buffer matters)
_UNITS = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(name: str, text: str) -> int:
    """A UCX memory size (``4194304``, ``4m``, ``512K``, ``4MB``) in bytes; ``auto``/``inf`` refused."""
    raw = text.strip().lower().removesuffix("b") or "0"
    unit = _UNITS.get(raw[-1], None)
    digits = raw[:-1] if unit else raw
    if not digits.isdigit():
        raise ConfigError(f"{name}={text!r}: kvlend's tcp read window needs the socket buffer pinned to a "
                          "size (bytes, or with a k/m/g suffix), not left to autotuning")
    return int(digits) * (unit or 1)


def pinned_buffers(env: Mapping[str, str], rmem_max: int, wmem_max: int) -> tuple[int, int]:
    """(send, receive) socket buffer bytes to pin: ``UCX_TCP_SNDBUF``/``RCVBUF`` from ``env``, else
    ``DEFAULT_BUFFER`` capped at the host's limits; ``ConfigError`` where the host cannot give them.

    The kernel silently caps ``SO_SNDBUF``/``SO_RCVBUF`` at ``net.core.wmem_max``/``rmem_max``, so a
    size above them would leave the window larger than the buffers.
    """
    out = []
    for var, limit, sysctl in (("UCX_TCP_SNDBUF", wmem_max, "net.core.wmem_max"),
                               ("UCX_TCP_RCVBUF", rmem_max, "net.core.rmem_max")):
        text = env.get(var)
        size = min(DEFAULT_BUFFER, limit) if text is None else parse_size(var, text)
        if size > limit:
            raise ConfigError(f"{var}={text} exceeds this host's {sysctl} ({limit}): the kernel would cap the "
                              f"socket buffer, so kvlend's tcp read window would be wrong; raise {sysctl} "
                              f"(sysctl -w {sysctl}={size}) or lower {var}")
        if size < MIN_BUFFER:
            why = f"{var}={text}" if text is not None else f"this host's {sysctl} ({limit})"
            raise ConfigError(f"{why} is below {MIN_BUFFER} bytes: kvlend's tcp read window would serialise "
                              f"reads; raise {sysctl} (sysctl -w {sysctl}={DEFAULT_BUFFER}) or set {var}")
        out.append(size)
    return out[0], out[1]


def window_bytes(sndbuf: int, rcvbuf: int) -> int:
    """Bytes of reads one reader may have in flight to one prefill: the smaller pinned buffer.

    Either buffer alone holds about that much data (the kernel doubles the size asked for, to pay
    for packet overhead), so the two together hold twice the window.  Measured with 4 MiB buffers
    (docs/faults.md): 8 MiB in flight queued nothing in UCX, 16 MiB did.
    """
    return min(sndbuf, rcvbuf)


class ReadWindow:
    """Per key, reads posted and not yet terminal, their bytes kept at most ``limit``; the rest wait.

    ``submit`` says whether a read may be posted now; one that may not waits, in order behind
    the reads of its key submitted earlier, until ``admit`` hands it out (after ``end`` freed
    room).  A read larger than ``limit`` is posted alone.  ``limit`` None: no window, every
    read is posted at once.
    """

    def __init__(self, limit: int | None) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
            raise ConfigError(f"read window must be a positive number of bytes or None, got {limit!r}")
        self.limit = limit
        self._flying: dict[Hashable, int] = {}  # key -> bytes posted, not ended
        self._posted: dict[bytes, tuple[Hashable, int]] = {}
        self._queued: OrderedDict[Hashable, deque[tuple[bytes, int]]] = OrderedDict()
        self._where: dict[bytes, Hashable] = {}  # queued tag -> key

    def submit(self, key: Hashable, tag: bytes, nbytes: int) -> bool:
        """Whether ``tag`` may be posted now (then it counts as in flight); else it waits."""
        if tag in self._posted or tag in self._where:
            raise ValueError(f"read {tag!r} submitted twice")
        if self.limit is None or (key not in self._queued and self._fits(key, nbytes)):
            self._count(key, tag, nbytes)
            return True
        self._queued.setdefault(key, deque()).append((tag, nbytes))
        self._where[tag] = key
        return False

    def waiting(self, tag: bytes) -> bool:
        """Whether ``tag`` waits for room (submitted, not admitted yet)."""
        return tag in self._where

    def end(self, tag: bytes) -> None:
        """``tag`` is terminal (posted) or withdrawn (waiting); unknown tags are ignored."""
        posted = self._posted.pop(tag, None)
        if posted is not None:
            key, nbytes = posted
            left = self._flying[key] - nbytes
            if left:
                self._flying[key] = left
            else:
                del self._flying[key]
            return
        key = self._where.pop(tag, None)
        if key is not None:
            queue = self._queued[key]
            queue.remove(next(item for item in queue if item[0] == tag))
            if not queue:
                del self._queued[key]

    def admit(self) -> list[bytes]:
        """Waiting reads that fit now, in submission order per key (counted as in flight): post them."""
        out = []
        for key in list(self._queued):
            queue = self._queued[key]
            while queue and self._fits(key, queue[0][1]):
                tag, nbytes = queue.popleft()
                del self._where[tag]
                self._count(key, tag, nbytes)
                out.append(tag)
            if not queue:
                del self._queued[key]
        return out

    def in_flight(self, key: Hashable) -> int:
        """Bytes of ``key``'s reads posted and not ended."""
        return self._flying.get(key, 0)

    def _fits(self, key: Hashable, nbytes: int) -> bool:
        flying = self._flying.get(key, 0)
        return flying == 0 or self.limit is None or flying + nbytes <= self.limit

    def _count(self, key: Hashable, tag: bytes, nbytes: int) -> None:
        self._posted[tag] = (key, nbytes)
        self._flying[key] = self._flying.get(key, 0) + nbytes


def pieces(batches: Sequence[ReadBatch], limit: int) -> list[list[ReadBatch]]:
    """``batches`` cut into consecutive pieces of at most ``limit`` bytes each, a descriptor longer than
    what is left of a piece split across pieces: what a read larger than the window is posted as, one
    piece at a time, so no read ever has more than the window in flight."""
    out: list[list[ReadBatch]] = []
    current: list[ReadBatch] = []
    size = 0
    for batch in batches:
        remote: list[tuple[int, int, int]] = []
        local: list[tuple[int, int, int]] = []
        for (r_addr, length, r_dev), (l_addr, _, l_dev) in zip(batch.remote.tolist(), batch.local.tolist()):
            done = 0
            while done < length:
                take = min(length - done, limit - size)
                remote.append((r_addr + done, take, r_dev))
                local.append((l_addr + done, take, l_dev))
                done, size = done + take, size + take
                if size == limit:
                    current.append(_batch(batch, remote, local))
                    out.append(current)
                    current, remote, local, size = [], [], [], 0
        if remote:
            current.append(_batch(batch, remote, local))
    if current:
        out.append(current)
    return out


def _batch(like: ReadBatch, remote: list, local: list) -> ReadBatch:
    return ReadBatch._planned(like.remote_kind, like.local_kind, np.array(remote, dtype=np.uint64).reshape(-1, 3),
                              np.array(local, dtype=np.uint64).reshape(-1, 3))
