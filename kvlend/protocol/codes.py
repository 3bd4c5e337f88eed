"""Why a lease, a done or a link ended, on the wire: a ``Code`` and a free-text detail.

``Abort``, ``DoneAck`` and ``Bye`` carry a code (what the receiver acts on) and a
detail (what a person reads: the sender's error, class name and message).  This
module is the one place that maps exceptions to codes (``code_of``, sending) and
codes to exceptions (``lease_error`` and ``link_error``, receiving); nothing parses
the detail.
"""

from __future__ import annotations

from enum import IntEnum

from ..errors import (
    AuthError,
    KvlendError,
    LayoutError,
    LayoutMismatch,
    LeaseDenied,
    LeaseError,
    LeaseExpired,
    LeaseUnknown,
    PeerProtocolError,
    PromptMismatch,
    ProtocolError,
    QuotaExceeded,
    TransferCancelled,
    TransferTimeout,
)

_DETAIL = 4000  # characters of a detail sent to a peer


class Code(IntEnum):
    """What ended a lease or a link, as a ``Abort``, ``DoneAck`` or ``Bye`` says it."""

    OK = 0  # a done acknowledged in time; a Bye that closes in order
    LEASE_UNKNOWN = 1  # never lent, released, or long gone
    LEASE_EXPIRED = 2  # outlived its TTL (its pages may have been reused)
    LEASE_DENIED = 3  # not the sender's peer's: offered to another, or a ticket's nobody claimed
    PROMPT_MISMATCH = 4  # lent for another prompt than the claim's digest
    QUOTA_EXCEEDED = 5  # a configured limit (see ``Quotas``) refused it
    AUTH = 6  # authentication failed: a certificate, or an identity already connected
    PROTOCOL = 7  # the receiver broke the protocol (malformed, unexpected, out of time)
    LAYOUT = 8  # a layout is invalid, or the two cannot exchange bytes
    TIMEOUT = 9  # a deadline passed
    CANCELLED = 10  # the reader will not read it (cancelled, declined, given back)
    FAILED = 11  # anything else: a read failed, a backend error, a bug

    def __str__(self) -> str:
        return self.name.lower()


# Exception type -> code; ``code_of`` walks an error's MRO, so the most derived listed class wins.
_CODES: dict[type, Code] = {
    PromptMismatch: Code.PROMPT_MISMATCH, LeaseDenied: Code.LEASE_DENIED, LeaseExpired: Code.LEASE_EXPIRED,
    LeaseUnknown: Code.LEASE_UNKNOWN, QuotaExceeded: Code.QUOTA_EXCEEDED, AuthError: Code.AUTH,
    ProtocolError: Code.PROTOCOL, LayoutMismatch: Code.LAYOUT, LayoutError: Code.LAYOUT,
    TransferTimeout: Code.TIMEOUT, TransferCancelled: Code.CANCELLED,
}
# Code -> the exception a receiver raises for it, where a message alone can build one.
_ERRORS: dict[Code, type[KvlendError]] = {
    Code.LEASE_UNKNOWN: LeaseUnknown, Code.LEASE_EXPIRED: LeaseExpired, Code.LEASE_DENIED: LeaseDenied,
    Code.PROMPT_MISMATCH: PromptMismatch, Code.AUTH: AuthError, Code.PROTOCOL: PeerProtocolError,
    Code.TIMEOUT: TransferTimeout, Code.CANCELLED: TransferCancelled,
}


def code_of(error: BaseException) -> Code:
    """The code that tells a peer about ``error``."""
    for cls in type(error).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return Code.FAILED


def detail_of(error: BaseException) -> str:
    """The detail that goes with ``code_of(error)``: its class and message, cut to what a frame carries."""
    return f"{type(error).__name__}: {error}"[:_DETAIL]


def lease_error(code: Code, message: str) -> LeaseError:
    """What a refused claim, a withdrawn lease or a refused done raises: the lease error ``code`` names,
    ``LeaseUnknown`` for any other code (a quota, say: the lease is not ours to read either way)."""
    cls = _ERRORS.get(code)
    return (cls if cls is not None and issubclass(cls, LeaseError) else LeaseUnknown)(message)


def link_error(code: Code, message: str) -> ProtocolError:
    """What a handshake the peer refused (its ``Bye``) raises: ``AuthError`` for ``AUTH``, else
    ``PeerProtocolError``."""
    return (AuthError if code is Code.AUTH else PeerProtocolError)(message)

