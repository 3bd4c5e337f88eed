"""Control protocol between a prefill and a decode rank, sans-IO.

The channel is TLS 1.3 with both ranks' certificates (``runtime.tls``), so
confidentiality, integrity, order and the peer's identity come from it.
Inside it, frames are ``u32 length | payload``; the payload is msgpack
``[protocol version, message]``, each message a map whose ``t`` names its type.

``FrameDecoder`` is fed bytes and returns messages (the h11 style); it never
allocates for a claimed length before checking it against the cap, walks a
payload's structure against ``MAX_FRAME_DEPTH``, ``MAX_FRAME_CONTAINERS`` and
``MAX_FRAME_ELEMENTS`` before anything is built of it (so a frame costs memory
and time a small multiple of its size, whatever it nests), decodes it with
msgspec into typed structs, checked in C as they are built, and any malformed
input is a ``PeerProtocolError`` naming what is wrong.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field
from functools import cached_property
from typing import Annotated, Any, ClassVar, Mapping, Union

import msgpack
import msgspec
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
from .frame_walk import MAX_FRAME_CONTAINERS, check_structure

# 2: inside TLS, no MAC or sequence numbers; 3: progressive leases; 4: Claim.digest; 5: Abort, DoneAck and Bye
# carry a refusal code and a detail
PROTOCOL_VERSION = 6  # 6: Heartbeat.done, leases read in their lifetime, released unanswered
MAX_FRAME_BYTES = 16 << 20
MAX_GROUP_PAGES = 1 << 22
_LEN = struct.Struct(">I")
_INT64 = (-(1 << 63), 1 << 63)

# ------------------------------------------------------------------ field types
# Checked by msgspec in C as a frame is decoded: a value of another type or past these bounds is refused,
# its field named, before its message is built.
_Int64 = Annotated[int, msgspec.Meta(ge=_INT64[0], le=_INT64[1] - 1)]
_Str = Annotated[str, msgspec.Meta(max_length=4096)]
_Blob = Annotated[bytes, msgspec.Meta(max_length=MAX_FRAME_BYTES)]
_LeaseId = Annotated[bytes, msgspec.Meta(min_length=LEASE_ID_BYTES, max_length=LEASE_ID_BYTES)]
_LeaseIds = Annotated[tuple[_LeaseId, ...], msgspec.Meta(max_length=65536)]
_Digest = Annotated[bytes, msgspec.Meta(max_length=PROMPT_DIGEST_BYTES)]  # and exactly that long, or empty


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise PeerProtocolError(f"{where}: expected str, got {type(v).__name__}")
    if len(v) > 4096:
        raise PeerProtocolError(f"{where}: {len(v)} exceeds the cap of 4096")
    return v


def _is_int64(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and _INT64[0] <= x < _INT64[1]


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


# ------------------------------------------------------------------ messages
class _Tagged(msgspec.Struct, frozen=True, tag_field="t", forbid_unknown_fields=True):
    """A map on the wire whose ``t`` names its type; a field missing or unknown is refused."""

    def _admit(self) -> Message:
        """What a peer sent, checked beyond its fields' types, as the message it is (``PeerProtocolError``)."""
        raise NotImplementedError


class Message(_Tagged, frozen=True):
    TYPE: ClassVar[str] = ""

    def to_wire(self) -> dict:
        return {"t": self.TYPE, **{name: _to_wire_value(getattr(self, name)) for name in self.__struct_fields__}}

    def _admit(self) -> Message:
        return self


def _to_wire_value(v: Any) -> Any:
    if isinstance(v, LeaseOffer):
        return v.to_wire()
    if isinstance(v, Code):
        return int(v)
    if isinstance(v, tuple):
        return list(v)
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
        """A peer's offer map (as ``to_wire`` gives it), checked field by field (``PeerProtocolError``)."""
        try:
            received = msgspec.convert(v, _LeaseWire)
        except msgspec.ValidationError as exc:
            raise _refusal(exc, where, v) from None
        return received.admit(where)


class _LeaseWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An offer's lease as the wire has it: its pages, selection and meta are checked by ``admit``."""

    id: _LeaseId
    request: _Str
    num_tokens: _Int64
    pages: Any
    selection: Any
    ttl: Union[float, _Int64]
    meta: Any
    ready: _Int64

    def admit(self, where: str) -> LeaseOffer:
        pages = _group_pages(self.pages, f"{where}.pages", allow_empty=False)
        sel = self.selection
        if not isinstance(sel, list) or len(sel) != 2 or not isinstance(sel[1], list) or len(sel[1]) > 65536:
            raise PeerProtocolError(f"{where}.selection: expected [mode, names]")
        try:
            selection = _ALL_ROWS if sel == _ALL_ROWS_WIRE else RowSelection(SelectionMode(sel[0]), tuple(sel[1]))
        except Exception as exc:
            raise PeerProtocolError(f"{where}.selection: {exc}") from None
        ttl = float(self.ttl)
        if not math.isfinite(ttl):
            raise PeerProtocolError(f"{where}.ttl: expected a finite number, got {ttl}")
        if self.num_tokens <= 0 or ttl <= 0:
            raise PeerProtocolError(f"{where}: num_tokens and ttl must be positive")
        if not 0 <= self.ready <= self.num_tokens:
            raise PeerProtocolError(f"{where}.ready: {self.ready} is outside [0, num_tokens {self.num_tokens}]")
        return LeaseOffer(self.id, self.request, self.num_tokens, pages, selection, ttl,
                          _map(self.meta, f"{where}.meta"), self.ready)


_ALL_ROWS, _ALL_ROWS_WIRE = RowSelection.all(), [SelectionMode.ALL.value, []]  # most offers': one value, shared


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
        tp, od = _int64_array(arrays[0]), _int64_array(arrays[1])
        if tp is None or od is None:
            raise PeerProtocolError(f"{where}[{g!r}]: expected little-endian int64 bytes")
        try:
            pages[g] = GroupPages.viewing(tp, od)
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


def _int64_array(v: Any) -> np.ndarray | None:
    """Little-endian int64 bytes as an array, read-only over them; None if ``v`` is not such bytes."""
    if not isinstance(v, bytes) or len(v) % 8 or len(v) > 8 * MAX_GROUP_PAGES:
        return None
    return np.frombuffer(v, dtype="<i8").astype(np.int64, copy=False)


def check_offer(request: Any, meta: Any) -> dict:
    """The checks the decode side applies to an offer's request id and meta, for the lender
    to apply before it lends: an offer the peer would refuse must not take page locks (``UsageError``)."""
    try:
        _str(request, "offer.request")
        return _map(dict(meta) if isinstance(meta, Mapping) else meta, "offer.meta")
    except PeerProtocolError as exc:
        raise UsageError(str(exc)) from None


class Handshake(Message, frozen=True, tag="handshake", dict=True):
    """Each side's encoded PageLayout and transfer-backend metadata."""
    TYPE: ClassVar[str] = "handshake"
    layout: _Blob
    backend: _Str
    metadata: _Blob

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


class Offer(Message, frozen=True, tag="offer"):
    """Prefill -> decode: a lease ready to be read."""
    TYPE: ClassVar[str] = "offer"
    lease: LeaseOffer


class _OfferWire(_Tagged, frozen=True, tag="offer"):
    lease: _LeaseWire

    def _admit(self) -> Offer:
        return Offer(self.lease.admit("offer.lease"))


class Extend(Message, frozen=True, tag="extend"):
    """Prefill -> decode: a progressive lease grew to ``ready`` tokens; ``pages`` are the rows added.

    Final once ``ready`` is the lease's ``num_tokens``; sent only to the peer the lease is bound to,
    after its ``Offer``, so on one ordered channel the decode always knows the lease first.
    ``meta`` updates the offer's (say, the first generated token, known only once prefill is done).
    """
    TYPE: ClassVar[str] = "extend"
    lease: bytes
    ready: int
    pages: Mapping[str, GroupPages]
    meta: Mapping[str, Any] = {}

    def to_wire(self) -> dict:
        return {"t": self.TYPE, "lease": self.lease, "ready": self.ready, "pages": _pages_to_wire(self.pages),
                "meta": dict(self.meta)}


class _ExtendWire(_Tagged, frozen=True, tag="extend"):
    lease: _LeaseId
    ready: _Int64
    pages: Any
    meta: Any

    def _admit(self) -> Extend:
        return Extend(self.lease, self.ready, _group_pages(self.pages, "extend.pages"), _map(self.meta, "extend.meta"))


class Heartbeat(Message, frozen=True, tag="heartbeat"):
    """Decode -> prefill: renew ``leases`` (reads still in flight; answered by ``Renewed`` if any), and release
    ``done``: leases read whole while surely valid, their fetches finished (a ``Done`` nobody waits for: unanswered).
    """
    TYPE: ClassVar[str] = "heartbeat"
    leases: _LeaseIds
    done: _LeaseIds = ()


class Renewed(Message, frozen=True, tag="renewed"):
    """Prefill -> decode, answering a heartbeat: these of its leases were renewed when it arrived.

    The decode sent the heartbeat earlier, so each lease stays valid for a TTL
    from then: reads landing before that count for the bound without a done ack.
    """
    TYPE: ClassVar[str] = "renewed"
    leases: _LeaseIds


class Done(Message, frozen=True, tag="done"):
    """Decode -> prefill: reading finished up to ``bound`` tokens; release the lease."""
    TYPE: ClassVar[str] = "done"
    lease: _LeaseId
    bound: _Int64


class DoneAck(Message, frozen=True, tag="done_ack"):
    """Prefill -> decode: whether the lease was still valid when released (``code`` ``OK``), or why not.

    Only an ``ok`` ack lets decode use what it read: a lease that expired may
    have had its pages reused under the reader.
    """
    TYPE: ClassVar[str] = "done_ack"
    lease: _LeaseId
    code: Code
    detail: _Str

    @property
    def ok(self) -> bool:
        return self.code is Code.OK


class Abort(Message, frozen=True, tag="abort"):
    """Either side: stop this lease (decode gives up, or prefill withdraws it or refuses its claim)."""
    TYPE: ClassVar[str] = "abort"
    lease: _LeaseId
    code: Code
    detail: _Str

    @classmethod
    def of(cls, lease: bytes, error: BaseException) -> Abort:
        """The ``Abort`` that tells the peer ``error`` ends ``lease``."""
        return cls(lease, code_of(error), detail_of(error))


class Claim(Message, frozen=True, tag="claim"):
    """Decode -> prefill: redeem a ticket's lease; answered by its ``Offer`` or an ``Abort``.

    The prefill binds the lease to the claiming peer and renews it, so the
    decode knows it stays valid for a TTL from when it sent the claim.
    ``digest``: the prompt digest of the decode's own request (empty: none); a lease
    lent with a digest is refused (``PromptMismatch``) to a claim without the same.
    """
    TYPE: ClassVar[str] = "claim"
    lease: _LeaseId
    digest: _Digest = b""

    def _admit(self) -> Claim:
        if len(self.digest) not in (0, PROMPT_DIGEST_BYTES):
            raise PeerProtocolError(f"claim.digest: expected {PROMPT_DIGEST_BYTES} bytes, or none")
        return self


class Bye(Message, frozen=True, tag="bye"):
    """Closing the link: in order (``OK``), or refusing the peer (the handshake's refusals)."""
    TYPE: ClassVar[str] = "bye"
    code: Code
    detail: _Str


MESSAGES: dict[str, type[Message]] = {
    m.TYPE: m for m in (Handshake, Offer, Extend, Heartbeat, Renewed, Done, DoneAck, Abort, Claim, Bye)
}
# What a peer's message is decoded as: the message itself, or for an offer and an extension the wire's form,
# whose pages, selection and meta are checked and built in Python once it is decoded.
_RECEIVED: dict[str, type[_Tagged]] = {**MESSAGES, "offer": _OfferWire, "extend": _ExtendWire}


class _Frame(msgspec.Struct, frozen=True, array_like=True):
    version: int
    message: Union[Handshake, _OfferWire, _ExtendWire, Heartbeat, Renewed, Done, DoneAck, Abort, Claim, Bye]


_DECODER = msgspec.msgpack.Decoder(_Frame)
_ENCODER = msgspec.msgpack.Encoder()
# A payload up to this long is decoded without the structure walk first: it cannot hold more containers or items
# than the limits allow, what msgspec builds of it is a small multiple of its size, and the walk still runs
# (naming a limit first, as it would have) when it is refused.
_UNWALKED_BYTES = MAX_FRAME_CONTAINERS
_AT = re.compile(r"(.*?)(?: - at `\$(.*)`)?", re.S)
_FIELDS = re.compile(r"Object (missing required|contains unknown) field `(.*)`", re.S)


def _refusal(exc: msgspec.ValidationError, where: str, obj: Any) -> PeerProtocolError:
    """msgspec's refusal of ``obj`` (a message or an offer's lease, ``where``) in kvlend's words: the field, why."""
    match = _AT.fullmatch(str(exc))
    text, path = (match[1], match[2] or "") if match else (str(exc), "")
    fields = _FIELDS.fullmatch(text)
    if fields:
        text = f"fields {'lack' if fields[1] == 'missing required' else 'include unknown'} {_show(fields[2])}"
    elif path == ".code" and isinstance(obj, dict):  # the refusal codes, whose numbers msgspec does not say
        text = f"expected a code in [0, {int(max(Code))}], got {_show(obj.get('code'))}"
    else:
        text = text[:1].lower() + text[1:].replace("`object`", "map").replace("`array`", "list").replace("`", "")
    return PeerProtocolError(f"{where}{path}: {text}")


def message_from_wire(obj: Any) -> Message:
    """A decoded msgpack object as the message it is, or a ``PeerProtocolError`` naming what is wrong."""
    if not isinstance(obj, dict) or "t" not in obj:
        raise PeerProtocolError("message: expected a map with a type field 't'")
    kind = _RECEIVED.get(obj["t"]) if isinstance(obj["t"], str) else None
    if kind is None:
        raise PeerProtocolError(f"message: unknown type {_show(obj['t'])}")
    try:
        received = msgspec.convert(obj, kind)
    except msgspec.ValidationError as exc:
        raise _refusal(exc, obj["t"], obj) from None
    return received._admit()


def decode_payload(payload: bytes) -> Message:
    """A frame's payload as its message, checked in C as msgspec decodes it; ``PeerProtocolError`` naming the
    limit, the msgpack fault, the version or the field that refuses it (``_explain``)."""
    walked = len(payload) > _UNWALKED_BYTES
    if walked:
        check_structure(payload)
    try:
        frame = _DECODER.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        frame = None
    if frame is None or frame.version != PROTOCOL_VERSION:
        raise _explain(payload, walked)
    try:
        return frame.message._admit()
    except PeerProtocolError:
        if not walked:
            check_structure(payload)
        raise


def _explain(payload: bytes, walked: bool) -> PeerProtocolError:
    """Why ``payload`` is refused, checked in the order a peer's mistake is best told: its structure, msgpack,
    the ``[version, message]`` shape, the version, then the message's fields."""
    if not walked:
        check_structure(payload)
    try:
        obj = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, use_list=True,
            max_str_len=1 << 16, max_bin_len=MAX_FRAME_BYTES, max_array_len=1 << 16,
            max_map_len=1 << 10, max_ext_len=0,
        )
    except Exception as exc:
        return PeerProtocolError(f"frame payload is not valid msgpack: {type(exc).__name__}")
    if not isinstance(obj, list) or len(obj) != 2:
        return PeerProtocolError("frame payload must be [version, message]")
    version, body = obj
    if type(version) is not int or version != PROTOCOL_VERSION:
        return PeerProtocolError(f"peer speaks kvlend protocol version {_show(version)}, this rank speaks "
                                 f"{PROTOCOL_VERSION}: run the same kvlend release on both sides")
    message_from_wire(body)  # raises naming the field
    return PeerProtocolError(f"frame payload is not a message msgspec accepts: {_show(body)}")


# -------------------------------------------------------------------- frames
def encode_frame(message: Message) -> bytes:
    body = message.to_wire() if isinstance(message, (Offer, Extend)) else message
    payload = _ENCODER.encode((PROTOCOL_VERSION, body))
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
        return decode_payload(payload)
