"""Tickets: a lease made portable, for a router to carry from prefill to decode.

A prefill lends before it knows its reader and exports a ``Ticket``: the
lease id (the capability), the prefill's control endpoint and identity,
the token count and the prefill's layout id.  Any authenticated decode
redeems it (``Claim`` over a link it opens once and reuses).  Bytes are
msgpack; the text form (for JSON such as vLLM's ``kv_transfer_params``) is
``kvl1.`` plus unpadded base64url.  Decoding a peer's ticket is strict and
never trusts a length it has not checked.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import msgpack

from ..core.lender import LEASE_ID_BYTES
from ..errors import ProtocolError

TICKET_VERSION = 1
TEXT_PREFIX = "kvl1."
MAX_TICKET_BYTES = 1024
_MAX_HOST = 255
_MAX_NAME = 256


@dataclass(frozen=True)
class Ticket:
    lease: bytes
    host: str
    port: int
    prefill: str  # the prefill rank's name on the control channel
    num_tokens: int
    layout_id: str  # the prefill's layout id: a decode can check compatibility before connecting

    def __post_init__(self) -> None:
        if not isinstance(self.lease, bytes) or len(self.lease) != LEASE_ID_BYTES:
            raise ProtocolError(f"ticket.lease: expected {LEASE_ID_BYTES} bytes")
        for name, value, cap in (("host", self.host, _MAX_HOST), ("prefill", self.prefill, _MAX_NAME),
                                 ("layout_id", self.layout_id, 64)):
            if not isinstance(value, str) or not 0 < len(value) <= cap:
                raise ProtocolError(f"ticket.{name}: expected a str of 1..{cap} characters")
        for name, value, low, high in (("port", self.port, 1, 65535), ("num_tokens", self.num_tokens, 1, 1 << 40)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ProtocolError(f"ticket.{name}: expected an int in [{low}, {high}]")

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.host, self.port

    def encode(self) -> bytes:
        return msgpack.packb([TICKET_VERSION, self.lease, self.host, self.port, self.prefill,
                              self.num_tokens, self.layout_id], use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> Ticket:
        if not isinstance(data, (bytes, bytearray)) or not 0 < len(data) <= MAX_TICKET_BYTES:
            raise ProtocolError(f"ticket: expected 1..{MAX_TICKET_BYTES} bytes")
        try:
            obj = msgpack.unpackb(bytes(data), raw=False, max_str_len=_MAX_NAME, max_bin_len=64,
                                  max_array_len=16, max_map_len=0, max_ext_len=0)
        except Exception as exc:
            raise ProtocolError(f"ticket: not valid msgpack ({type(exc).__name__})") from None
        if not isinstance(obj, list) or len(obj) != 7 or obj[0] != TICKET_VERSION or type(obj[0]) is not int:
            raise ProtocolError(f"ticket: expected [version {TICKET_VERSION}, lease, host, port, prefill, "
                                "num_tokens, layout_id]")
        return cls(*obj[1:])

    def to_text(self) -> str:
        return TEXT_PREFIX + base64.urlsafe_b64encode(self.encode()).rstrip(b"=").decode("ascii")

    @classmethod
    def from_text(cls, text: str) -> Ticket:
        if not isinstance(text, str) or not text.startswith(TEXT_PREFIX) or len(text) > 2 * MAX_TICKET_BYTES:
            raise ProtocolError(f"ticket text: expected {TEXT_PREFIX!r} followed by base64url")
        body = text[len(TEXT_PREFIX):]
        try:
            data = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (binascii.Error, ValueError):
            raise ProtocolError("ticket text: not base64url") from None
        return cls.decode(data)
