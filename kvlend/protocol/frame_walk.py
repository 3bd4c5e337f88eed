"""A frame payload's msgpack structure, walked without building it, against what one frame may hold.

``wire`` walks a payload before msgspec builds anything of it (a small one only when it is refused, to name the
limit it breaks), so a frame costs memory and time a small multiple of its size, whatever it nests.
"""

from __future__ import annotations

from ..errors import PeerProtocolError

# What one frame's payload may hold, checked as it is walked: far above any message (an offer nests 5 deep and
# holds a container per group; a heartbeat's ids, a selection's names or meta's lists are its bulk).
MAX_FRAME_DEPTH = 16  # containers open at once
MAX_FRAME_CONTAINERS = 4096  # arrays and maps
MAX_FRAME_ELEMENTS = 1 << 19  # their items, a map entry counting 2


def _scalar_sizes() -> tuple[list[int], list[int]]:
    """Per msgpack type byte: (bytes of a fixed-size scalar, or 0) and (bytes of a str/bin length field, or 0)."""
    fixed, length = [0] * 256, [0] * 256
    for b in (*range(0x00, 0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3):  # fixints, nil, false, true
        fixed[b] = 1
    for b in range(0xA0, 0xC0):  # fixstr
        fixed[b] = 1 + (b & 0x1F)
    for b, size in ((0xCA, 5), (0xCB, 9), (0xCC, 2), (0xCD, 3), (0xCE, 5), (0xCF, 9),
                    (0xD0, 2), (0xD1, 3), (0xD2, 5), (0xD3, 9)):
        fixed[b] = size
    for b, size in ((0xC4, 1), (0xC5, 2), (0xC6, 4), (0xD9, 1), (0xDA, 2), (0xDB, 4)):  # bin and str 8/16/32
        length[b] = size
    return fixed, length


_FIXED, _LENGTH = _scalar_sizes()
_ONE_BYTE = bytes(b for b in range(256) if _FIXED[b] == 1)  # scalars that are their type byte alone
_CONTAINER = {**{b: (b & 0x0F, 1) for b in range(0x90, 0xA0)}, **{b: (b & 0x0F, 2) for b in range(0x80, 0x90)},
              0xDC: (-2, 1), 0xDD: (-4, 1), 0xDE: (-2, 2), 0xDF: (-4, 2)}  # count (or -bytes of it), items per


def check_structure(payload: bytes) -> None:
    """Walk ``payload``'s msgpack structure without building it; ``PeerProtocolError`` naming the limit as soon as
    it nests deeper than ``MAX_FRAME_DEPTH``, opens more than ``MAX_FRAME_CONTAINERS`` containers or declares
    more than ``MAX_FRAME_ELEMENTS`` items, or holds a type no message uses (ext, reserved).

    A container whose items are alike scalars (a heartbeat's ids, a list of small ints) is passed in one step.
    """
    end, pos = len(payload), 0
    stack: list[int] = []  # items left in each enclosing container
    left, fresh = 1, False  # items left in the current one; whether none of them was walked yet
    containers = elements = 0
    while True:
        while not left:
            if not stack:
                return  # trailing bytes, if any, are msgpack's to refuse
            left, fresh = stack.pop(), False
        if pos >= end:
            raise PeerProtocolError("frame payload is not valid msgpack: truncated")
        b = payload[pos]
        size = _FIXED[b]
        if size or _LENGTH[b]:
            head = 1 + _LENGTH[b]
            if not size:
                size = head + int.from_bytes(payload[pos + 1: pos + head], "big")
            if fresh and left > 1:
                run = _alike(payload, pos, size, head, left)
                if run:
                    pos, left = pos + run, 0
                    continue
            pos, left, fresh = pos + size, left - 1, False
            continue
        shape = _CONTAINER.get(b)
        if shape is None:
            raise PeerProtocolError(f"frame payload holds msgpack type 0x{b:02x}, which no message uses")
        count, per = shape
        pos += 1
        if count < 0:
            count, pos = int.from_bytes(payload[pos: pos - count], "big"), pos - count
        containers += 1
        elements += count * per
        if len(stack) >= MAX_FRAME_DEPTH:
            raise PeerProtocolError(f"frame nests containers deeper than MAX_FRAME_DEPTH {MAX_FRAME_DEPTH}")
        if containers > MAX_FRAME_CONTAINERS:
            raise PeerProtocolError(
                f"frame holds more than MAX_FRAME_CONTAINERS {MAX_FRAME_CONTAINERS} arrays and maps")
        if elements > MAX_FRAME_ELEMENTS:
            raise PeerProtocolError(f"frame holds more than MAX_FRAME_ELEMENTS {MAX_FRAME_ELEMENTS} items")
        stack.append(left - 1)
        left, fresh = count * per, True


def _alike(payload: bytes, pos: int, size: int, head: int, count: int) -> int:
    """Bytes of ``count`` scalars at ``pos`` if each is ``size`` bytes with the first's ``head`` (so the same
    type and length), or if all are one-byte scalars; else 0."""
    run = payload[pos: pos + size * count]
    if len(run) != size * count:
        return 0
    if size == 1:
        return 0 if run.translate(None, _ONE_BYTE) else size * count
    first = run[:head]
    return size * count if all(run[i::size] == first[i: i + 1] * count for i in range(head)) else 0
