"""One exception tree: every failure kvlend reports is a ``KvlendError``.

Callers catch ``KvlendError`` to handle anything kvlend raises; the subclass
says what went wrong and the message names the offending field or value.
"""


class KvlendError(Exception):
    """Base class of every error kvlend raises on purpose."""

    # Set on the error a fetch fails with (``Fetch.error``): its request and safe-resume bound.
    request: str
    bound: int


class LayoutError(KvlendError, ValueError):
    """A PageLayout (or its encoding) is invalid."""


class LayoutMismatch(KvlendError):
    """Two layouts cannot exchange bytes; ``fields`` lists every difference.

    Each entry is ``(field, local_value, remote_value, reason)``.
    """

    def __init__(self, fields):
        self.fields = tuple(fields)
        lines = [f"{f}: local={lv!r} remote={rv!r} ({why})" for f, lv, rv, why in self.fields]
        super().__init__("layouts cannot be mapped: " + "; ".join(lines))


class ConfigError(KvlendError, ValueError):
    """A setting is invalid or cannot be applied (a bad option, a port in use)."""


class PageRangeError(KvlendError, ValueError):
    """A page ordinal, token count or page table is out of range."""


class LeaseError(KvlendError):
    """Base class of lease failures."""


class LeaseUnknown(LeaseError, KeyError):
    """No lease has this id (never granted, or released)."""

    def __str__(self):  # KeyError quotes its argument; we want the message.
        return str(self.args[0]) if self.args else ""


class LeaseExpired(LeaseError):
    """The lease outlived its TTL; its pages may have been reused."""


class LeaseDenied(LeaseError):
    """The lease is not this peer's: offered to another, a ticket's it has not claimed, or one it never got."""


class PromptMismatch(LeaseDenied):
    """A claim's prompt digest is not the one its lease was lent for: the KV belongs to another prompt."""


class TrackerError(KvlendError):
    """The delivery tracker was told about an unknown request or chunk, or one settled twice."""


class ProtocolError(KvlendError):
    """The control protocol was broken: by this rank's caller (``UsageError``) or by its peer
    (``PeerProtocolError``).  Catch a subclass; this base is never raised itself."""


class UsageError(ProtocolError, ValueError):
    """The caller asked a session for something the protocol does not allow (an unknown or busy lease,
    a malformed ticket, an argument of the wrong type); nothing changed, and every link stays up."""


class PeerProtocolError(ProtocolError):
    """The peer sent a malformed, oversized, unexpected or hostile message.

    Raised while a link's messages are handled, it closes that link; as a fetch's error, the
    prefill's answer for that lease broke the protocol (the link stays).
    """


class AuthError(ProtocolError):
    """A peer, or this rank's own credentials, failed authentication (TLS, certificates, identities)."""


class BackendError(KvlendError):
    """The transfer backend failed, or no such backend is installed."""


class PeerLost(BackendError):
    """The remote peer disconnected or died."""


class TransferTimeout(KvlendError, TimeoutError):
    """A wait hit its deadline."""


class TransferCancelled(KvlendError):
    """A read was cancelled before it completed."""


class IncompleteFetch(KvlendError):
    """Every read of a fetch landed, but they cover fewer tokens than the lease: ``.bound`` says how many."""


class QuotaExceeded(KvlendError):
    """A request went past a configured limit; refused before anything changed.

    ``limit`` names the limit (a ``kvlend.protocol.config.Quotas`` field, such
    as ``max_leases_per_peer``), ``value`` is what the request would have
    needed and ``cap`` the limit's configured value.
    """

    def __init__(self, limit: str, value, cap, what: str = "") -> None:
        self.limit, self.value, self.cap = limit, value, cap
        self._what = what
        super().__init__(f"{limit}: {what + ' ' if what else ''}{value} exceeds the cap of {cap}")

    def __reduce__(self):  # copy and pickle rebuild it from its fields, not from its message
        return type(self), (self.limit, self.value, self.cap, self._what)


class LeaseLifetimeExceeded(QuotaExceeded, LeaseExpired):
    """A renewal would keep a lease past lend time + ``max_lease_lifetime``: refused, so the
    lease expires on schedule (no later than that) however often it is renewed."""


class NegotiationLimit(QuotaExceeded, LayoutMismatch):
    """Mapping the two layouts would cost more than a negotiation may compute (page ratio, pieces).

    Both a ``QuotaExceeded`` (``limit``, ``value``, ``cap``) and a ``LayoutMismatch``
    whose one field names what was too large.
    """

    def __init__(self, limit: str, value, cap, field: str, local_value, remote_value, what: str = "") -> None:
        self.limit, self.value, self.cap = limit, value, cap
        self._what = what
        LayoutMismatch.__init__(self, [(field, local_value, remote_value,
                                        f"{limit}: {what + ' ' if what else ''}{value} exceeds the cap of {cap}")])

    def __reduce__(self):
        (field, local_value, remote_value, _), = self.fields
        return type(self), (self.limit, self.value, self.cap, field, local_value, remote_value, self._what)


class RegistryError(KvlendError):
    """A rank record is malformed, or the cluster registry (etcd) could not be reached in time."""
