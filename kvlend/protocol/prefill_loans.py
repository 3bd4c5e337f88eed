"""A prefill session's leases beside the lender's records: one state each (``states.LOAN``), changed only
by ``Loans.to``, which keeps the indexes by state and by the connection a waiting claim came on."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import states
from .states import LoanEvent, LoanState


@dataclass(eq=False)
class Loan:
    """What a prefill session knows of a lease beside the lender's record."""

    state: LoanState | None = None  # changed only by ``Loans.to``
    meta: Mapping[str, Any] = field(default_factory=dict)  # lent or offered: the engine's data its offer carries
    reader: int | None = None  # offered or held: the connection its offer went out on; waiting: the claim's
    deadline: float = math.inf  # waiting: when claim_wait runs out
    digest: bytes = b""  # waiting: the claim's prompt digest


_KEEPS = {LoanState.WAITING: {"reader", "deadline", "digest"}, LoanState.LENT: {"meta"},
          LoanState.OFFERED: {"meta", "reader"}, LoanState.HELD: {"reader"}, LoanState.GONE: set()}
_CLEARED: dict[str, Any] = {"meta": {}, "reader": None, "deadline": math.inf, "digest": b""}


class Loans:
    """Every lease a prefill session tracks, by id and by state."""

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

    def lent(self, lease_id: bytes) -> Loan | None:
        """Its loan if this session lent it and it is live: lent or offered."""
        loan = self.all.get(lease_id)
        return loan if loan is not None and loan.state in (LoanState.LENT, LoanState.OFFERED) else None

    def waiting_on(self, conn: int) -> list[bytes]:
        """The claims connection ``conn`` made that wait for their lend."""
        return list(self._waiting_on.get(conn, ()))

    def waiting_count(self, conn: int) -> int:
        return len(self._waiting_on.get(conn, ()))

    def to(self, lease_id: bytes, event: LoanEvent, **data: Any) -> Loan:
        """The one place a loan's state changes: checked against ``states.LOAN``; what the new state does not
        hold is cleared, ``data`` set, and the indexes follow (a loan ``gone`` is forgotten)."""
        loan = self.all.get(lease_id) or Loan()
        before, after = loan.state, states.transition("loan", loan.state, event)
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
