"""A lease's life on the lending side: one record per lease id, its state changed only by ``Loans.to``
against the ``loan`` table, which keeps the indexes by state and by the connection a waiting claim came on.

The ``Lender`` owns the records (``Lender.loans``): it makes the moves that take or drop page locks (lend,
release, settle, end, expire); the prefill session makes those that only say who reads it (wait, offer,
bye, and a waiting claim's timeout or close).  A reader is the session's connection number: opaque here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

from . import tables
from .lease import Lease
from .locks import Slots


class LoanState(str, Enum):
    """A lease id as the lending side knows it."""

    WAITING = "waiting"  # a claim came before the lend: it waits up to claim_wait
    LENT = "lent"  # lent; no reader has its offer
    OFFERED = "offered"  # its offer went out on a connection: extensions follow it, a release waits for that reader
    HELD = "held"  # released under its reader: its pages stay locked until that reader is quiet or it expires
    GONE = "gone"  # forgotten: ended, expired, or its waiting claim timed out or left


class LoanEvent(str, Enum):
    WAIT = "wait"  # a claim of an id not lent yet
    LEND = "lend"  # the engine lends it (answering a waiting claim, if any)
    OFFER = "offer"  # its offer goes out: pushed, or a claim's answer
    BYE = "bye"  # its reader said goodbye: it counts no read made over that connection
    RELEASE = "release"  # the engine releases it
    SETTLE = "settle"  # its reader is quiet (its Done, Abort or Bye)
    END = "end"  # done, aborted, declined, its offer could not be sent, or its peer's leases released
    EXPIRE = "expire"
    TIMEOUT = "timeout"  # claim_wait ran out before the lend
    CLOSE = "close"  # the waiting claim's connection closed


S, E = LoanState, LoanEvent
LOAN: Mapping[tuple[LoanState | None, LoanEvent], LoanState] = {
    (None, E.WAIT): S.WAITING,
    (None, E.LEND): S.LENT,
    (S.WAITING, E.LEND): S.LENT,
    (S.WAITING, E.TIMEOUT): S.GONE,
    (S.WAITING, E.CLOSE): S.GONE,
    (S.LENT, E.OFFER): S.OFFERED,
    (S.OFFERED, E.OFFER): S.OFFERED,  # claimed again: extensions follow the newest offer
    (S.OFFERED, E.BYE): S.LENT,
    (S.LENT, E.RELEASE): S.GONE,  # no reader: its pages go at once
    (S.OFFERED, E.RELEASE): S.HELD,
    (S.HELD, E.SETTLE): S.GONE,
    (S.HELD, E.EXPIRE): S.GONE,
    **{(state, event): S.GONE for state in (S.LENT, S.OFFERED) for event in (E.END, E.EXPIRE)},
}
del S, E
tables.register("loan", LOAN)

LIVE = (LoanState.LENT, LoanState.OFFERED)  # lent and not ended: readable until its expiry


@dataclass(eq=False)
class Loan:
    """Everything the lending side knows of one lease id."""

    state: LoanState | None = None  # changed only by ``Loans.to``
    lease: Lease | None = None  # lent, offered or held: what was lent
    locked: tuple[Slots, ...] = ()  # lent, offered or held: its page-lock slots, one entry per lend or extend
    meta: Mapping[str, Any] = field(default_factory=dict)  # lent or offered: the engine's data its offer carries
    reader: int | None = None  # offered or held: the connection its offer went out on; waiting: the claim's
    deadline: float = math.inf  # waiting: when claim_wait runs out
    digest: bytes = b""  # waiting: the claim's prompt digest


_KEEPS = {LoanState.WAITING: {"reader", "deadline", "digest"}, LoanState.LENT: {"lease", "locked", "meta"},
          LoanState.OFFERED: {"lease", "locked", "meta", "reader"}, LoanState.HELD: {"lease", "locked", "reader"},
          LoanState.GONE: set()}
_CLEARED: dict[str, Any] = {"lease": None, "locked": (), "meta": {}, "reader": None, "deadline": math.inf,
                            "digest": b""}


class Loans:
    """Every lease id the lending side tracks, by id and by state."""

    def __init__(self) -> None:
        self.all: dict[bytes, Loan] = {}
        # state -> {lease id: Loan}, oldest first (waiting claims in deadline order: each is now + claim_wait)
        self.by_state: dict[LoanState, dict[bytes, Loan]] = {state: {} for state in LoanState}
        self.waiting = self.by_state[LoanState.WAITING]  # claims of leases not yet lent
        self._waiting_on: dict[int, dict[bytes, None]] = {}  # connection -> its waiting claims

    def get(self, lease_id: bytes) -> Loan | None:
        return self.all.get(lease_id)

    def state_of(self, lease_id: bytes) -> LoanState | None:
        loan = self.all.get(lease_id)
        return None if loan is None else loan.state

    def live(self, lease_id: bytes) -> Loan | None:
        """Its loan if it is lent and not ended: lent or offered."""
        loan = self.all.get(lease_id)
        return loan if loan is not None and loan.state in LIVE else None

    def locking(self, lease_id: bytes) -> Loan | None:
        """Its loan if it holds page locks: lent, offered or held."""
        loan = self.all.get(lease_id)
        return loan if loan is not None and loan.lease is not None else None

    def read_by(self, state: LoanState, reader: int) -> list[bytes]:
        """The ids in ``state`` (offered or held) whose reader is connection ``reader``."""
        return [i for i, loan in self.by_state[state].items() if loan.reader == reader]

    def waiting_on(self, conn: int) -> list[bytes]:
        """The claims connection ``conn`` made that wait for their lend."""
        return list(self._waiting_on.get(conn, ()))

    def waiting_count(self, conn: int) -> int:
        return len(self._waiting_on.get(conn, ()))

    def to(self, lease_id: bytes, event: LoanEvent, **data: Any) -> Loan:
        """The one place a loan's state changes: checked against the ``loan`` table; what the new state does
        not hold is cleared, ``data`` set, and the indexes follow (a loan ``gone`` is forgotten)."""
        loan = self.all.get(lease_id) or Loan()
        before, after = loan.state, tables.transition("loan", loan.state, event)
        if before is not None:
            del self.by_state[before][lease_id]
        if before is LoanState.WAITING:
            assert loan.reader is not None  # a waiting claim's connection
            on = self._waiting_on[loan.reader]
            del on[lease_id]
            if not on:
                del self._waiting_on[loan.reader]
        loan.state = after
        for name in _CLEARED.keys() - _KEEPS[after]:
            setattr(loan, name, _CLEARED[name])
        for name, value in data.items():
            setattr(loan, name, value)
        if after is LoanState.GONE:
            self.all.pop(lease_id, None)
            return loan
        self.all[lease_id] = self.by_state[after][lease_id] = loan
        if after is LoanState.WAITING:
            assert loan.reader is not None  # a waiting claim's connection
            self._waiting_on.setdefault(loan.reader, {})[lease_id] = None
        return loan
