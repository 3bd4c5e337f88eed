"""Tickets: a lease made portable, for a router to carry from prefill to decode.

A prefill lends before it knows its reader and exports a ``Ticket``: the
lease id (the capability), the prefill's control endpoint and identity,
the token count and the prefill's layout id.  Any authenticated decode
redeems it (``Claim`` over a link it opens once and reuses), with the digest
of the very prompt its lease was lent for when it was lent with one
(``core.prompt``): a ticket alone, seen in a log or on the wire, reads nothing.  Bytes are
msgpack; the text form (for JSON such as vLLM's ``kv_transfer_params``) is
``kvl1.`` plus unpadded base64url.  Decoding a peer's ticket is strict and
never trusts a length it has not checked.

A small lease of every row (the prefill layout's full selection), not bound
to a prompt, also carries its page table (``pages``, int32 rows):
a decode that has a link to the prefill then reads at once, with the claim
in flight, instead of waiting for the claim's answer; what it reads counts
only once that answer confirms the same pages (see ``DecodeSession``).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import msgpack
import numpy as np

from ..core.lender import LEASE_ID_BYTES
from ..core.pages import GroupPages
from ..core.text import printable
from ..errors import UsageError

TICKET_VERSION = 2  # 2: the page table of a small lease
TEXT_PREFIX = "kvl1."
MAX_TICKET_BYTES = 2048
MAX_TICKET_ROWS = 192  # page-table rows a ticket carries at most (int32 pairs: 1.5 KiB)
_MAX_GROUPS = 16
_MAX_HOST = 253  # a DNS name's length, without a trailing dot (RFC 1035)
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")  # RFC 1123: 1..63 characters
_MAX_NAME = 256


@dataclass(frozen=True)
class Ticket:
    lease: bytes
    host: str
    port: int
    prefill: str  # the prefill rank's name on the control channel
    num_tokens: int
    layout_id: str  # the prefill's layout id: a decode can check compatibility before connecting
    pages: Mapping[str, GroupPages] | None = field(default=None, compare=False)  # the lease's, if small

    def __post_init__(self) -> None:
        if not isinstance(self.lease, bytes) or len(self.lease) != LEASE_ID_BYTES:
            raise UsageError(f"ticket.lease: expected {LEASE_ID_BYTES} bytes")
        for name, value, cap in (("prefill", self.prefill, _MAX_NAME), ("layout_id", self.layout_id, 64)):
            if not isinstance(value, str) or not 0 < len(value) <= cap:
                raise UsageError(f"ticket.{name}: expected a str of 1..{cap} characters")
        problem = host_problem(self.host)
        if problem is not None:
            raise UsageError(f"ticket.host: expected an IP address or a DNS name: {problem}")
        for name, number, low, high in (("port", self.port, 1, 65535), ("num_tokens", self.num_tokens, 1, 1 << 40)):
            if isinstance(number, bool) or not isinstance(number, int) or not low <= number <= high:
                raise UsageError(f"ticket.{name}: expected an int in [{low}, {high}]")
        if self.pages is not None:
            pages = self.pages
            ok = isinstance(pages, Mapping) and 0 < len(pages) <= _MAX_GROUPS and all(
                isinstance(g, str) and 0 < len(g) <= _MAX_NAME and isinstance(gp, GroupPages)
                for g, gp in pages.items())
            if not ok or sum(len(gp) for gp in pages.values()) > MAX_TICKET_ROWS or not all(
                    gp.ordinals.max(initial=0) < 1 << 31 and gp.token_pages.max(initial=0) < 1 << 31
                    for gp in pages.values()):
                raise UsageError(f"ticket.pages: expected 1..{_MAX_GROUPS} named groups of GroupPages, "
                                    f"{MAX_TICKET_ROWS} rows at most, each below 2**31")

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.host, self.port

    def encode(self) -> bytes:
        pages = None if self.pages is None else {
            g: [gp.token_pages.astype("<i4").tobytes(), gp.ordinals.astype("<i4").tobytes()]
            for g, gp in self.pages.items()}
        return msgpack.packb([TICKET_VERSION, self.lease, self.host, self.port, self.prefill,
                              self.num_tokens, self.layout_id, pages], use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> Ticket:
        if not isinstance(data, (bytes, bytearray)) or not 0 < len(data) <= MAX_TICKET_BYTES:
            raise UsageError(f"ticket: expected 1..{MAX_TICKET_BYTES} bytes")
        try:
            obj = msgpack.unpackb(bytes(data), raw=False, max_str_len=_MAX_NAME, max_bin_len=8 * MAX_TICKET_ROWS,
                                  max_array_len=16, max_map_len=_MAX_GROUPS, max_ext_len=0)
        except Exception as exc:
            raise UsageError(f"ticket: not valid msgpack ({type(exc).__name__})") from None
        if not isinstance(obj, list) or len(obj) != 8 or obj[0] != TICKET_VERSION or type(obj[0]) is not int:
            raise UsageError(f"ticket: expected [version {TICKET_VERSION}, lease, host, port, prefill, "
                                "num_tokens, layout_id, pages]")
        lease, host, port, prefill, num_tokens, layout_id = obj[1:7]
        return cls(lease, host, port, prefill, num_tokens, layout_id, pages=None if obj[7] is None else _pages(obj[7]))

    def with_pages(self, pages: Mapping[str, GroupPages]) -> Ticket:
        """This ticket carrying ``pages`` when they are few enough (``MAX_TICKET_ROWS``), else as it is."""
        try:
            return replace(self, pages=dict(pages))
        except UsageError:  # too many rows (or slots past int32): the claim's answer brings them
            return self

    def to_text(self) -> str:
        return TEXT_PREFIX + base64.urlsafe_b64encode(self.encode()).rstrip(b"=").decode("ascii")

    @classmethod
    def from_text(cls, text: str) -> Ticket:
        if not isinstance(text, str) or not text.startswith(TEXT_PREFIX) or len(text) > 2 * MAX_TICKET_BYTES:
            raise UsageError(f"ticket text: expected {TEXT_PREFIX!r} followed by base64url")
        body = text[len(TEXT_PREFIX):]
        try:
            data = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (binascii.Error, ValueError):
            raise UsageError("ticket text: not base64url") from None
        return cls.decode(data)


def host_problem(host: Any) -> str | None:
    """What makes ``host`` neither an IP literal nor a DNS name by the RFC 1123 rules (None: it is one), so a
    ticket's host reaches the resolver only as a name it can look up."""
    if not isinstance(host, str):
        return f"got a {type(host).__name__}"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host  # a fully qualified name may end with a dot
    if not 0 < len(name) <= _MAX_HOST:
        return f"{len(name)} characters, not 1..{_MAX_HOST}"
    if not name.isascii():
        return f"'{printable(host)}' is not ASCII (write an internationalized name in its xn-- form)"
    labels = name.split(".")
    for label in labels:
        if not _LABEL.fullmatch(label):
            return (f"label '{printable(label)}' of '{printable(host)}': expected 1..63 letters, digits or hyphens, "
                    "neither first nor last a hyphen")
    if labels[-1].isdigit():
        return f"'{printable(host)}' is not an IP address, and a name's last label is never all digits"
    return None


def _pages(v: Any) -> dict[str, GroupPages]:
    """A ticket's ``{group: [token_pages, ordinals]}`` (little-endian int32), checked like an offer's."""
    if not isinstance(v, dict) or not 0 < len(v) <= _MAX_GROUPS:
        raise UsageError(f"ticket.pages: expected a map of 1..{_MAX_GROUPS} groups")
    out = {}
    for g, arrays in v.items():
        if not isinstance(g, str) or not isinstance(arrays, list) or len(arrays) != 2 \
                or not all(isinstance(a, bytes) and len(a) % 4 == 0 for a in arrays):
            raise UsageError("ticket.pages: expected group -> [token_pages, ordinals] as int32 bytes")
        try:
            out[g] = GroupPages(*(np.frombuffer(a, dtype="<i4").astype(np.int64) for a in arrays))
        except Exception as exc:
            raise UsageError(f"ticket.pages[{g!r}]: {exc}") from None
    return out
