"""Control protocol between a prefill and a decode rank, sans-IO.

The channel is TLS 1.3 with both ranks' certificates (``runtime.tls``), so
confidentiality, integrity, order and the peer's identity come from it.
Inside it, frames are ``u32 length | payload``; the payload is msgpack
``[protocol version, message]``.

``FrameDecoder`` is fed bytes and returns messages (the h11 style); it never
allocates for a claimed length before checking it against the cap, walks a
payload's structure against ``MAX_FRAME_DEPTH``, ``MAX_FRAME_CONTAINERS`` and
``MAX_FRAME_ELEMENTS`` before msgpack builds any object of it (so a frame
costs memory and time a small multiple of its size, whatever it nests), and
any malformed input is a ``PeerProtocolError``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, Callable, ClassVar, Mapping

import msgpack
import numpy as np

from ..core.layout import (  # _show: a short, non-recursive repr of a peer's value
    PageLayout,
    RowSelection,
    SelectionMode,
    _show,
)
from ..core.lender import LEASE_ID_BYTES
from ..core.pages import GroupPages
from ..core.prompt import PROMPT_DIGEST_BYTES
from ..errors import KvlendError, PeerProtocolError, UsageError
from .codes import Code, code_of, detail_of

# 2: inside TLS, no MAC or sequence numbers; 3: progressive leases; 4: Claim.digest; 5: Abort, DoneAck and Bye
# carry a refusal code and a detail
PROTOCOL_VERSION = 6  # 6: Heartbeat.done, leases read in their lifetime, released unanswered
MAX_FRAME_BYTES = 16 << 20
MAX_GROUP_PAGES = 1 << 22
# What one frame's payload may hold, checked as it is walked: far above any message (an offer nests 5 deep and
# holds a container per group; a heartbeat's ids, a selection's names or meta's lists are its bulk).
MAX_FRAME_DEPTH = 16  # containers open at once
MAX_FRAME_CONTAINERS = 4096  # arrays and maps
MAX_FRAME_ELEMENTS = 1 << 19  # their items, a map entry counting 2
_LEN = struct.Struct(">I")
_INT64 = (-(1 << 63), 1 << 63)

# ------------------------------------------------------------------ messages
@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[str] = ""
    # field name -> checker(value, where) returning the parsed value
    SCHEMA: ClassVar[Mapping[str, Any]] = {}

    def to_wire(self) -> dict:
        out = {"t": self.TYPE}
        for f in fields(self):
            out[f.name] = _to_wire_value(getattr(self, f.name))
        return out


def _to_wire_value(v: Any) -> Any:
    if isinstance(v, LeaseOffer):
        return v.to_wire()
    if isinstance(v, Code):
        return int(v)
    if isinstance(v, tuple):
        return list(v)
    return v


def _typed(kind: type[Any], name: str, max_len: int | None = None,
           exact_len: int | None = None) -> Callable[[Any, str], Any]:
    def check(v: Any, where: str) -> Any:
        if isinstance(v, bool) and kind is not bool or not isinstance(v, kind):
            raise PeerProtocolError(f"{where}: expected {name}, got {type(v).__name__}")
        if exact_len is not None and len(v) != exact_len:
            raise PeerProtocolError(f"{where}: expected {exact_len} bytes, got {len(v)}")
        if max_len is not None and len(v) > max_len:
            raise PeerProtocolError(f"{where}: {len(v)} exceeds the cap of {max_len}")
        if kind is int and not _INT64[0] <= v < _INT64[1]:
            raise PeerProtocolError(f"{where}: integer {v} out of range")
        return v
    return check


_str = _typed(str, "str", 4096)
_int = _typed(int, "int")
_bytes = _typed(bytes, "bytes", MAX_FRAME_BYTES)
_lease_id = _typed(bytes, "lease id", exact_len=LEASE_ID_BYTES)


def _code(v: Any, where: str) -> Code:
    if not _is_int64(v) or not 0 <= v <= max(Code):
        raise PeerProtocolError(f"{where}: expected a code in [0, {int(max(Code))}], got {_show(v)}")
    return Code(v)


def _float(v: Any, where: str) -> float:
    ok = isinstance(v, float) and math.isfinite(v) or (
        isinstance(v, int) and not isinstance(v, bool) and _INT64[0] <= v < _INT64[1])
    if not ok:
        raise PeerProtocolError(f"{where}: expected a finite number, got {_show(v)}")
    return float(v)


def _is_int64(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and _INT64[0] <= x < _INT64[1]


def _digest(v: Any, where: str) -> bytes:
    if not isinstance(v, bytes) or len(v) not in (0, PROMPT_DIGEST_BYTES):
        raise PeerProtocolError(f"{where}: expected {PROMPT_DIGEST_BYTES} bytes, or none")
    return v


def _lease_ids(v: Any, where: str) -> tuple[bytes, ...]:
    if not isinstance(v, list) or len(v) > 65536:
        raise PeerProtocolError(f"{where}: expected a list of lease ids")
    return tuple(_lease_id(x, f"{where}[]") for x in v)


MAX_META = 64  # entries in an offer's meta (an extension's included)


def _map(v: Any, where: str) -> dict:
    if not isinstance(v, dict) or len(v) > MAX_META:
        raise PeerProtocolError(f"{where}: expected a map of at most {MAX_META} entries")
    for k, x in v.items():
        _str(k, f"{where} key")
        scalar = isinstance(x, (str, float, bool, bytes, type(None))) or _is_int64(x)
        if not scalar and not (isinstance(x, list) and len(x) <= 1 << 20 and all(map(_is_int64, x))):
            raise PeerProtocolError(f"{where}[{_show(k)}]: values must be scalars or lists of int64")
    return v


@dataclass(frozen=True, eq=False)
class LeaseOffer:
    """What the decode side needs to read a lease: pages per (prefill) group, selection, TTL.

    ``meta`` carries the engine's own small per-request data (first token, ...).
    ``ready``: tokens the prefill had committed (None: ``num_tokens``, final); a
    progressive lease's later pages come in ``Extend`` messages.
    """

    id: bytes
    request: str
    num_tokens: int
    pages: Mapping[str, GroupPages]
    selection: RowSelection
    ttl: float
    meta: Mapping[str, Any] = field(default_factory=dict)
    # None (left out): num_tokens. __post_init__ sets it, so every reader sees an int.
    ready: int = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.ready is None:
            object.__setattr__(self, "ready", self.num_tokens)

    @property
    def final(self) -> bool:
        return self.ready == self.num_tokens

    def extended(self, ready: int, added: Mapping[str, GroupPages], meta: Mapping[str, Any]) -> LeaseOffer:
        """This offer grown by an ``Extend``: ``added`` rows merged in, ``ready`` advanced, ``meta`` updated."""
        pages = dict(self.pages)
        for group, more in added.items():
            pages[group] = merge_pages(pages[group], more) if group in pages else more
        return LeaseOffer(self.id, self.request, self.num_tokens, pages, self.selection, self.ttl,
                          {**self.meta, **meta}, ready)

    def to_wire(self) -> dict:
        return {
            "id": self.id, "request": self.request, "num_tokens": self.num_tokens,
            "pages": _pages_to_wire(self.pages),
            "selection": [self.selection.mode.value, list(self.selection.names)],
            "ttl": self.ttl, "meta": dict(self.meta), "ready": self.ready,
        }

    @classmethod
    def from_wire(cls, v: Any, where: str = "offer.lease") -> LeaseOffer:
        d = _exact(v, where, {"id", "request", "num_tokens", "pages", "selection", "ttl", "meta", "ready"})
        pages = _group_pages(d["pages"], f"{where}.pages", allow_empty=False)
        sel = d["selection"]
        if not isinstance(sel, list) or len(sel) != 2 or not isinstance(sel[1], list) or len(sel[1]) > 65536:
            raise PeerProtocolError(f"{where}.selection: expected [mode, names]")
        try:
            selection = RowSelection(SelectionMode(sel[0]), tuple(sel[1]))
        except Exception as exc:
            raise PeerProtocolError(f"{where}.selection: {exc}") from None
        num_tokens = _int(d["num_tokens"], f"{where}.num_tokens")
        ttl = _float(d["ttl"], f"{where}.ttl")
        if num_tokens <= 0 or ttl <= 0:
            raise PeerProtocolError(f"{where}: num_tokens and ttl must be positive")
        ready = _int(d["ready"], f"{where}.ready")
        if not 0 <= ready <= num_tokens:
            raise PeerProtocolError(f"{where}.ready: {ready} is outside [0, num_tokens {num_tokens}]")
        return cls(
            id=_lease_id(d["id"], f"{where}.id"), request=_str(d["request"], f"{where}.request"),
            num_tokens=num_tokens, pages=pages, selection=selection, ttl=ttl,
            meta=_map(d["meta"], f"{where}.meta"), ready=ready,
        )


def _pages_to_wire(pages: Mapping[str, GroupPages]) -> dict:
    return {g: [p.token_pages.astype("<i8").tobytes(), p.ordinals.astype("<i8").tobytes()] for g, p in pages.items()}


def _group_pages(v: Any, where: str, allow_empty: bool = True) -> dict[str, GroupPages]:
    """A peer's ``{group: [token_pages, ordinals]}``, each pair checked as ``GroupPages`` checks it."""
    if not isinstance(v, dict) or not (0 if allow_empty else 1) <= len(v) <= 256:
        raise PeerProtocolError(f"{where}: expected a map of {0 if allow_empty else 1}..256 groups")
    pages = {}
    for g, arrays in v.items():
        _str(g, f"{where} key")
        if not isinstance(arrays, list) or len(arrays) != 2:
            raise PeerProtocolError(f"{where}[{g!r}]: expected [token_pages, ordinals]")
        tp, od = (_int64_array(a, f"{where}[{g!r}]") for a in arrays)
        try:
            pages[g] = GroupPages(tp, od)
        except Exception as exc:
            raise PeerProtocolError(f"{where}[{g!r}]: {exc}") from None
    return pages


def merge_pages(a: GroupPages, b: GroupPages) -> GroupPages:
    """Rows of ``a`` and then ``b``; ``PeerProtocolError`` unless ``b`` only adds token pages ``a`` lacks."""
    tokens = np.concatenate([a.token_pages, b.token_pages])
    order = np.argsort(tokens, kind="stable")
    try:
        return GroupPages(tokens[order], np.concatenate([a.ordinals, b.ordinals])[order])
    except Exception as exc:  # a token page given twice
        raise PeerProtocolError(f"extension repeats rows already lent: {exc}") from None


def _int64_array(v: Any, where: str) -> np.ndarray:
    if not isinstance(v, bytes) or len(v) % 8 or len(v) > 8 * MAX_GROUP_PAGES:
        raise PeerProtocolError(f"{where}: expected little-endian int64 bytes")
    return np.frombuffer(v, dtype="<i8").astype(np.int64)


def check_offer(request: Any, meta: Any) -> dict:
    """The checks the decode side applies to an offer's request id and meta, for the lender
    to apply before it lends: an offer the peer would refuse must not take page locks (``UsageError``)."""
    try:
        _str(request, "offer.request")
        return _map(dict(meta) if isinstance(meta, Mapping) else meta, "offer.meta")
    except PeerProtocolError as exc:
        raise UsageError(str(exc)) from None


def _offer(v: Any, where: str) -> LeaseOffer:
    return LeaseOffer.from_wire(v, where)


@dataclass(frozen=True)
class Handshake(Message):
    """Each side's encoded PageLayout and transfer-backend metadata."""
    TYPE: ClassVar[str] = "handshake"
    SCHEMA: ClassVar = {"layout": _bytes, "backend": _str, "metadata": _bytes}
    layout: bytes
    backend: str
    metadata: bytes

    def page_layout(self) -> PageLayout:
        """The layout it carries, decoded once (``LayoutError`` if malformed, every time): the shell's
        ``FrameReader`` decodes it off the node's lock, so the session's handshake only negotiates."""
        decoded = self._decoded
        if isinstance(decoded, KvlendError):
            raise decoded
        return decoded

    @cached_property
    def _decoded(self) -> PageLayout | KvlendError:
        try:
            return PageLayout.decode(self.layout)
        except KvlendError as exc:
            return exc


@dataclass(frozen=True)
class Offer(Message):
    """Prefill -> decode: a lease ready to be read."""
    TYPE: ClassVar[str] = "offer"
    SCHEMA: ClassVar = {"lease": _offer}
    lease: LeaseOffer


@dataclass(frozen=True)
class Extend(Message):
    """Prefill -> decode: a progressive lease grew to ``ready`` tokens; ``pages`` are the rows added.

    Final once ``ready`` is the lease's ``num_tokens``; sent only to the peer the lease is bound to,
    after its ``Offer``, so on one ordered channel the decode always knows the lease first.
    ``meta`` updates the offer's (say, the first generated token, known only once prefill is done).
    """
    TYPE: ClassVar[str] = "extend"
    SCHEMA: ClassVar = {"lease": _lease_id, "ready": _int, "pages": lambda v, where: _group_pages(v, where),
                        "meta": _map}
    lease: bytes
    ready: int
    pages: Mapping[str, GroupPages]
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict:
        return {"t": self.TYPE, "lease": self.lease, "ready": self.ready, "pages": _pages_to_wire(self.pages),
                "meta": dict(self.meta)}


@dataclass(frozen=True)
class Heartbeat(Message):
    """Decode -> prefill: renew ``leases`` (reads still in flight; answered by ``Renewed`` if any), and release
    ``done``: leases read whole while surely valid, their fetches finished (a ``Done`` nobody waits for: unanswered).
    """
    TYPE: ClassVar[str] = "heartbeat"
    SCHEMA: ClassVar = {"leases": _lease_ids, "done": _lease_ids}
    leases: tuple[bytes, ...]
    done: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Renewed(Message):
    """Prefill -> decode, answering a heartbeat: these of its leases were renewed when it arrived.

    The decode sent the heartbeat earlier, so each lease stays valid for a TTL
    from then: reads landing before that count for the bound without a done ack.
    """
    TYPE: ClassVar[str] = "renewed"
    SCHEMA: ClassVar = {"leases": _lease_ids}
    leases: tuple[bytes, ...]


@dataclass(frozen=True)
class Done(Message):
    """Decode -> prefill: reading finished up to ``bound`` tokens; release the lease."""
    TYPE: ClassVar[str] = "done"
    SCHEMA: ClassVar = {"lease": _lease_id, "bound": _int}
    lease: bytes
    bound: int


@dataclass(frozen=True)
class DoneAck(Message):
    """Prefill -> decode: whether the lease was still valid when released (``code`` ``OK``), or why not.

    Only an ``ok`` ack lets decode use what it read: a lease that expired may
    have had its pages reused under the reader.
    """
    TYPE: ClassVar[str] = "done_ack"
    SCHEMA: ClassVar = {"lease": _lease_id, "code": _code, "detail": _str}
    lease: bytes
    code: Code
    detail: str

    @property
    def ok(self) -> bool:
        return self.code is Code.OK


@dataclass(frozen=True)
class Abort(Message):
    """Either side: stop this lease (decode gives up, or prefill withdraws it or refuses its claim)."""
    TYPE: ClassVar[str] = "abort"
    SCHEMA: ClassVar = {"lease": _lease_id, "code": _code, "detail": _str}
    lease: bytes
    code: Code
    detail: str

    @classmethod
    def of(cls, lease: bytes, error: BaseException) -> Abort:
        """The ``Abort`` that tells the peer ``error`` ends ``lease``."""
        return cls(lease, code_of(error), detail_of(error))


@dataclass(frozen=True)
class Claim(Message):
    """Decode -> prefill: redeem a ticket's lease; answered by its ``Offer`` or an ``Abort``.

    The prefill binds the lease to the claiming peer and renews it, so the
    decode knows it stays valid for a TTL from when it sent the claim.
    ``digest``: the prompt digest of the decode's own request (empty: none); a lease
    lent with a digest is refused (``PromptMismatch``) to a claim without the same.
    """
    TYPE: ClassVar[str] = "claim"
    SCHEMA: ClassVar = {"lease": _lease_id, "digest": _digest}
    lease: bytes
    digest: bytes = b""


@dataclass(frozen=True)
class Bye(Message):
    """Closing the link: in order (``OK``), or refusing the peer (the handshake's refusals)."""
    TYPE: ClassVar[str] = "bye"
    SCHEMA: ClassVar = {"code": _code, "detail": _str}
    code: Code
    detail: str


MESSAGES: dict[str, type[Message]] = {
    m.TYPE: m for m in (Handshake, Offer, Extend, Heartbeat, Renewed, Done, DoneAck, Abort, Claim, Bye)
}


def _exact(v: Any, where: str, keys: set[str]) -> dict:
    if not isinstance(v, dict):
        raise PeerProtocolError(f"{where}: expected a map, got {type(v).__name__}")
    if set(v) != keys:
        raise PeerProtocolError(f"{where}: fields {_show(sorted(map(str, v)))} != expected {sorted(keys)}")
    return v


def message_from_wire(obj: Any) -> Message:
    if not isinstance(obj, dict) or "t" not in obj:
        raise PeerProtocolError("message: expected a map with a type field 't'")
    cls = MESSAGES.get(obj["t"]) if isinstance(obj["t"], str) else None
    if cls is None:
        raise PeerProtocolError(f"message: unknown type {_show(obj['t'])}")
    body = _exact(obj, cls.TYPE, set(cls.SCHEMA) | {"t"})
    return cls(**{k: check(body[k], f"{cls.TYPE}.{k}") for k, check in cls.SCHEMA.items()})


# -------------------------------------------------------------------- frames
def encode_frame(message: Message) -> bytes:
    payload = msgpack.packb([PROTOCOL_VERSION, message.to_wire()], use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise UsageError(f"{message.TYPE} frame of {len(payload)} bytes exceeds the cap of {MAX_FRAME_BYTES}")
    return _LEN.pack(len(payload)) + payload


class FrameDecoder:
    """Buffers bytes and yields messages; a frame's claimed length is checked before anything is kept for it."""

    def __init__(self, max_frame: int = MAX_FRAME_BYTES) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) >= 4:
            self._check_length()

    def _check_length(self) -> int:
        (n,) = _LEN.unpack_from(self._buf)
        if n < 1 or n > self.max_frame:
            raise PeerProtocolError(f"frame length {n} outside [1, {self.max_frame}]")
        return n

    def need(self) -> int:
        """Bytes still missing for the next frame (at least 1 when none is complete)."""
        if len(self._buf) < 4:
            return 4 - len(self._buf)
        return max(0, 4 + self._check_length() - len(self._buf))

    def ready(self) -> bool:
        """Whether a whole frame is buffered."""
        return len(self._buf) >= 4 and len(self._buf) >= 4 + _LEN.unpack_from(self._buf)[0]

    def next_message(self) -> Message | None:
        if self.need():
            return None
        n = self._check_length()
        with memoryview(self._buf) as view:  # one copy of the payload, not two
            payload = bytes(view[4: 4 + n])
        del self._buf[: 4 + n]
        check_structure(payload)
        try:
            obj = msgpack.unpackb(
                payload, raw=False, strict_map_key=True, use_list=True,
                max_str_len=1 << 16, max_bin_len=MAX_FRAME_BYTES, max_array_len=1 << 16,
                max_map_len=1 << 10, max_ext_len=0,
            )
        except Exception as exc:
            raise PeerProtocolError(f"frame payload is not valid msgpack: {type(exc).__name__}") from None
        if not isinstance(obj, list) or len(obj) != 2:
            raise PeerProtocolError("frame payload must be [version, message]")
        version, body = obj
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise PeerProtocolError(f"peer speaks kvlend protocol version {_show(version)}, this rank speaks "
                                f"{PROTOCOL_VERSION}: run the same kvlend release on both sides")
        return message_from_wire(body)


# ------------------------------------------------------------ structure walk
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
