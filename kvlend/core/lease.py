"""What a lease is (the record of what was lent), how it was lent (``LendOptions``), the caps a lend must
fit, and the checks of a lease call's inputs: ids, times, peers and how many tokens are ready."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from ..errors import LeaseError, LeaseUnknown, PageRangeError
from .layout import RowSelection
from .pages import GroupPages

LEASE_ID_BYTES = 16


@dataclass(frozen=True)
class LendOptions:
    """How the engine lends a request's pages, beside which pages: made once where the engine calls
    (``PrefillNode.lend``) and carried unchanged through the session to the lender, which keeps it on the
    lease.  A new option is a field here and code where it is used, nothing in between.

    ``lease_id``: the id of a ticket minted before the lend (default: a fresh random one).
    ``ready``: lend progressively, only the pages wholly below ``ready`` tokens (default: all).
    ``prompt_digest``: ``core.prompt.prompt_digest`` of the request's prompt; a claim must then carry it.
    ``meta``: the engine's small per-request data its offer carries (first token, ...).
    """

    lease_id: bytes | None = None
    ready: int | None = None
    prompt_digest: bytes | None = field(default=None, repr=False)
    meta: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), repr=False)


NO_OPTIONS = LendOptions()


@dataclass(frozen=True)
class Lease:
    """What was lent: per group, the token pages a reader needs and their slot ordinals."""

    id: bytes
    request: str
    num_tokens: int
    pages: Mapping[str, GroupPages]
    selection: RowSelection
    peer: str | None
    ttl: float
    expires_at: float
    lent_at: float = -math.inf
    ends_by: float = math.inf  # lent_at + the lifetime cap: no renewal pushes expires_at past it
    ready: int = 0  # tokens the prefill has committed; the lease is final once ``ready == num_tokens``
    options: LendOptions = field(default=NO_OPTIONS, repr=False)  # as lent

    @property
    def prompt_digest(self) -> bytes | None:
        """A claim must carry the same (None: any)."""
        return self.options.prompt_digest

    def __hash__(self) -> int:
        return hash(self.id)

    @property
    def final(self) -> bool:
        """Every page a reader needs is lent: nothing more will be added (``extend``)."""
        return self.ready == self.num_tokens

    @property
    def hex(self) -> str:
        return self.id.hex()

    @property
    def num_pages(self) -> int:
        """Rows lent, summed over groups."""
        return sum(len(g) for g in self.pages.values())


@dataclass(frozen=True)
class LeaseLimits:
    """Caps a lend or bind must fit (named as the ``Quotas`` fields they come from); default: none."""

    max_leases_per_peer: float = math.inf
    max_locked_pages_per_peer: float = math.inf
    max_lease_lifetime: float = math.inf
    max_num_tokens: float = math.inf


NO_LIMITS = LeaseLimits()


def check_time(where: str, value: Any) -> float:
    try:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:
        ok = False
    if not ok:
        raise LeaseError(f"{where}: must be a finite number of seconds, got {value!r}")
    return float(value)


def check_peer(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise LeaseError(f"peer: must be None or a non-empty str, got {value!r}")
    return value


def show_peer(peer: str) -> str:
    return repr(peer if len(peer) <= 200 else peer[:200] + "...")


def check_id(lease_id: Any) -> None:
    if not isinstance(lease_id, bytes) or len(lease_id) != LEASE_ID_BYTES:
        got = f"{len(lease_id)} bytes" if isinstance(lease_id, bytes) else type(lease_id).__name__
        raise LeaseUnknown(f"lease id: must be {LEASE_ID_BYTES} bytes, got {got}")


def check_ready(value: Any, num_tokens: int, low: int) -> int:
    """``ready`` of a lend (``low`` 0) or an extend (``low``: one past what is lent): an int in
    ``[low, num_tokens]``; None means final."""
    if value is None:
        return num_tokens
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= num_tokens:
        raise PageRangeError(f"ready: must be an int in [{low}, {num_tokens}], got {value!r}")
    return value
