"""A fetch: one lease being read into the engine's pages, and the arithmetic of its reads.

``Fetch`` is what ``DecodeSession`` hands the engine (read its fields; the session changes
them, its state only through ``move``).  ``plan_work`` turns an offer into
the chunks to post, before anything changes, so a bad destination table fails first.
"""

from __future__ import annotations

import builtins
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ..core.fetchplan import destination_pages, needed_pages, rows_read, skip_below, split_chunks
from ..core.negotiate import TransferPlan
from ..core.pages import int_array
from ..core.plan import plan_reads
from ..core.reads import ReadBatch
from ..errors import ConfigError, KvlendError, PageRangeError
from . import states
from .states import TERMINAL, FetchEvent, FetchState
from .ticket import Ticket
from .wire import LeaseOffer


@dataclass(eq=False)
class Fetch:
    """One lease being read into ``dst``.  Read its fields; the session changes them."""

    id: int
    link: int
    lease: bytes
    num_tokens: int
    dst: Mapping[str, Any]
    resume_from: int
    started: float
    deadline: float
    request: str = ""  # known once the offer is
    offer: LeaseOffer | None = None
    bound: int = 0  # safe-resume bound so far, in tokens
    error: KvlendError | None = None
    bytes: int = 0
    descriptors: int = 0
    finished: float | None = None
    tags: set = field(default_factory=set)  # reads posted and not yet terminal
    sure_until: float = -math.inf  # reads landing before this count for the bound without the ack
    claimed_at: float | None = None
    granted_at: float | None = None  # the claim answered, or a held offer taken: the lease is this fetch's
    posted: float | None = None  # reads posted (all chunks at once)
    first_landed_at: float | None = None  # the first read landed
    landed: float | None = None  # every read landed (before the done ack)
    usable_at: float | None = None  # finished for the engine: its pages hold verified KV
    acked_at: float | None = None  # the prefill answered its done
    final_at: float | None = None  # its offer became final (a progressive lease: the prefill's last extend)
    early_bytes: int = 0  # bytes posted before that: read while the prefill still computed
    quiet_by: float = math.inf  # CANCELLING: tear the link down if reads are still in flight then
    read_rows: dict = field(default_factory=dict)  # remote group -> token pages read or skipped so far
    ticket: Ticket | None = None  # redeemed from this ticket (its page table lets reads start with the claim)
    confirmed: bool = True  # False while reads posted from the ticket's pages await the claim's answer
    prompt_digest: builtins.bytes = b""  # what its claim carries: the digest of the prompt it reads for (empty: none)
    _state: FetchState | None = field(default=None, repr=False)  # changed only by ``move``

    @property
    def state(self) -> FetchState:
        assert self._state is not None  # moved on creation (``Fetches.new``)
        return self._state

    @property
    def done(self) -> bool:
        return self._state in TERMINAL

    @property
    def quiet(self) -> bool:
        """Nothing posted for this fetch can still write into ``dst``."""
        return not self.tags

    @property
    def seconds(self) -> float:
        return (self.finished if self.finished is not None else self.started) - self.started

    @property
    def read_seconds(self) -> float | None:
        """Posting the reads to the last landing: the data movement alone, without claim or ack."""
        return None if self.posted is None or self.landed is None else self.landed - self.posted

    @property
    def key(self) -> str:
        return f"fetch-{self.id}"


PHASES = ("claim->grant", "grant->landed", "landed->usable", "usable->acked")


def phases(fetch: Fetch) -> dict[str, float | None]:
    """Where a fetch's time went, in seconds (None: a step not reached, or none: a pushed offer has no claim).

    ``grant->landed`` counts from the later of the two: reads posted ahead of the claim's answer may
    land before it, and then only the wait for the answer is left.
    """
    landed = None if fetch.landed is None or fetch.granted_at is None else max(fetch.landed, fetch.granted_at)
    marks = (fetch.claimed_at, fetch.granted_at, landed, fetch.usable_at, fetch.acked_at)
    return {name: None if start is None or end is None else end - start
            for name, start, end in zip(PHASES, marks, marks[1:])}


def move(fetch: Fetch, event: FetchEvent) -> None:
    """The one place a fetch's state changes: checked against ``states.FETCH``."""
    fetch._state = states.transition("fetch", fetch._state, event)


# plan_work's result: the chunks (the descriptors of each, and the local pages they deliver), the local pages
# skipped below resume_from, the local pages the tracker waits for, and the remote rows read.
Work = tuple[list[tuple[list[ReadBatch], dict[str, np.ndarray]]], dict[str, np.ndarray], dict[str, np.ndarray],
             dict[str, np.ndarray]]


def plan_work(plan: TransferPlan, offer: LeaseOffer, dst: Mapping[str, Any], resume_from: int, chunk_pages: int,
              done_rows: Mapping[str, np.ndarray] | None = None) -> Work:
    """Every chunk's descriptors and local pages, what the tracker waits for, and the remote rows
    this reads; of a grown offer, only rows not read (or skipped) before (``done_rows``)."""
    given = offer.pages if not done_rows else {
        rg: gp.select(~np.isin(gp.token_pages, done_rows[rg])) if rg in done_rows else gp
        for rg, gp in offer.pages.items()}
    # From token 0 nothing is skipped (split_chunks keeps only the pages worth reading itself).
    pages, kept = skip_below(plan, given, offer.num_tokens, resume_from) if resume_from else (given, {})
    chunks = [(plan_reads(plan, src, dst, offer.selection), local)
              for src, local in split_chunks(plan, pages, offer.num_tokens, chunk_pages)]
    needed = needed_pages(plan, given, offer.num_tokens)
    read = rows_read(plan, given, offer.num_tokens)
    if done_rows:
        read = {rg: np.union1d(done_rows.get(rg, read[rg][:0]), rows) for rg, rows in read.items()}
    return chunks, kept, needed, read


def check_destination(plan: TransferPlan, dst: Any, num_tokens: int) -> None:
    """Refuse a destination table that cannot hold a lease of ``num_tokens`` (before anything is sent)."""
    if not isinstance(dst, Mapping) or set(dst) != set(plan.local.groups):
        have = sorted(map(str, dst)) if isinstance(dst, Mapping) else type(dst).__name__
        raise PageRangeError(f"dst: must map every local group {sorted(plan.local.groups)}, got {have}")
    for group, need in destination_pages(plan, num_tokens).items():
        table = int_array(f"dst[{group!r}]", dst[group])
        if table.size < need:
            raise PageRangeError(f"dst[{group!r}]: {table.size} entries, a lease of {num_tokens} tokens needs {need}")


def clone_error(error: KvlendError) -> KvlendError:
    """A copy of ``error`` (its fields too), so each fetch carries its own ``.request`` and ``.bound``."""
    clone = error.__class__.__new__(error.__class__)
    clone.__dict__.update(error.__dict__)
    clone.args = error.args
    return clone


def nbytes(batches: list[ReadBatch]) -> int:
    return sum(b.nbytes for b in batches)


def resume_point(resume_from: Any, num_tokens: int) -> int:
    if isinstance(resume_from, bool) or not isinstance(resume_from, (int, np.integer)) \
            or not 0 <= resume_from <= num_tokens:
        raise PageRangeError(f"resume_from: must be an int in [0, {num_tokens}], got {resume_from!r}")
    return int(resume_from)


def timeout_arg(value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"timeout: must be a positive number of seconds, got {value!r}")
    return float(value)
