"""What one authenticated peer may cost a prefill: its share of a loop turn, its wasted messages, its handshakes.

Pure: fed ``now`` and what happened, it says what to do (how much of a peer to
read this turn, whether to drop it, whether an identity may handshake now).

- **A share of each turn**, counted in messages and in work (``work_of``: a
  heartbeat costs the ids it names), so one busy peer cannot hold the node's
  lock for long; what it sent beyond its share waits for the next turn.
- **Wasted messages** (a claim of an id nobody lent that cannot wait, an empty
  heartbeat: nothing an honest decode sends) are *strikes*.  From its first
  strike a peer is throttled to ``throttled_messages`` a turn; past
  ``max_strikes`` it is dropped.  One strike is forgiven every
  ``strike_forgiven`` seconds, so a rare honest refusal never adds up.
- **Handshakes per identity.** An identity dropped for cause, or that
  connected more than ``RECONNECTS`` times at once (it regains one connection
  per backoff: ``handshake_backoff``, then its latest), may not connect again
  before a backoff that starts at ``handshake_backoff`` and doubles each time,
  up to ``max_handshake_backoff``; one whose handshake
  needed a negotiation not cached may not ask for another before such a
  backoff either.  A backoff falls back to its start once the identity kept
  quiet that long.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import QuotaExceeded
from .wire import Heartbeat, Message

MAX_IDENTITIES = 4096  # identities whose backoff is remembered (the oldest is forgotten past it)
RECONNECTS = 4  # connections one identity may make at once; one more is allowed per backoff (its latest one)


def work_of(message: Message) -> int:
    """What handling ``message`` costs, in lookups: a heartbeat one per id it names, anything else one."""
    return max(1, len(message.leases)) if isinstance(message, Heartbeat) else 1


@dataclass(frozen=True)
class Share:
    """What one peer's turn may take: at most ``messages`` messages, ending after the one that reaches ``work``
    (at least one message a turn, so nothing is stuck; one message's work is capped by its own quota)."""

    messages: int
    work: int


@dataclass
class Strikes:
    """One peer's wasted messages: a count that one is forgiven from every ``forgiven`` s."""

    allowance: int
    forgiven: float
    count: float = 0.0
    at: float = -math.inf  # when ``count`` was last brought up to date

    def _decay(self, now: float) -> None:
        if self.count and now > self.at:
            self.count = max(0.0, self.count - (now - self.at) / self.forgiven)
        self.at = max(self.at, now)

    def strike(self, now: float) -> bool:
        """One more wasted message; True once they passed the allowance (drop the peer)."""
        self._decay(now)
        self.count += 1
        return self.count > self.allowance

    def throttled(self, now: float) -> bool:
        """Whether any strike is still held against it."""
        self._decay(now)
        return self.count > 0


@dataclass
class _Backoff:
    until: float  # no handshake (or new negotiation) before then
    step: float  # the next backoff's length
    length: float  # this one's


class Handshakes:
    """Per identity: when it may handshake again, and when it may cost a new negotiation."""

    def __init__(self, backoff: float, max_backoff: float, remember: int = MAX_IDENTITIES) -> None:
        self._first, self._max, self._remember = backoff, max_backoff, remember
        self._dropped: OrderedDict[str, _Backoff] = OrderedDict()  # dropped for cause: no handshake at all
        self._negotiated: OrderedDict[str, _Backoff] = OrderedDict()  # ran a negotiation not cached
        self._connects: OrderedDict[str, tuple[float, float]] = OrderedDict()  # connections it may make at once, when

    def admit(self, identity: str, now: float, charge: bool = True) -> None:
        """``QuotaExceeded`` if ``identity`` was dropped for cause and its backoff has not passed, or (``charge``:
        this is a connection of it) if it connected more than ``RECONNECTS`` times in as many backoffs, which
        starts a backoff too."""
        ban = self._dropped.get(identity)
        if ban is not None and now < ban.until:
            raise _early(f"{identity!r} was dropped for cause; it connected again", ban, now)
        if not charge:
            return
        tokens, at = self._connects.pop(identity, (float(RECONNECTS), now))
        tokens = min(float(RECONNECTS), tokens + (now - at) / self._period(identity, now))
        if tokens < 1:
            step = self.dropped(identity, now)
            self._connects[identity] = (1.0, now + step)  # one connection once the backoff passes
            raise QuotaExceeded("handshake_backoff", f"{RECONNECTS + 1} connections", f"{RECONNECTS}",
                                f"{identity!r} reconnects too often (it may again in {step:.3g} s):")
        self._connects[identity] = (tokens - 1, now)
        while len(self._connects) > self._remember:
            self._connects.popitem(last=False)

    def _period(self, identity: str, now: float) -> float:
        """How often ``identity`` regains a connection: once per its latest backoff (one a cycle, however
        long), or ``handshake_backoff`` once that is forgotten."""
        ban = self._dropped.get(identity)
        return self._first if ban is None or now >= ban.until + self._max else ban.length

    def left(self, identity: str, now: float) -> float:
        """Seconds before ``identity`` may connect again (0: it may now)."""
        ban = self._dropped.get(identity)
        return 0.0 if ban is None else max(0.0, ban.until - now)

    def dropped(self, identity: str, now: float) -> float:
        """``identity`` was dropped for cause: its next backoff starts now; its length."""
        return self._push(self._dropped, identity, now)

    def may_negotiate(self, identity: str, now: float) -> None:
        """``QuotaExceeded`` unless ``identity`` may cost a negotiation not cached; charges it when it may."""
        seen = self._negotiated.get(identity)
        if seen is not None and now < seen.until:
            raise _early(f"{identity!r} asked for a layout negotiation not cached", seen, now)
        self._push(self._negotiated, identity, now)

    def _push(self, table: OrderedDict[str, _Backoff], identity: str, now: float) -> float:
        old = table.pop(identity, None)
        step = self._first if old is None or now >= old.until + self._max else old.step
        table[identity] = _Backoff(now + step, min(self._max, step * 2), step)
        while len(table) > self._remember:
            table.popitem(last=False)
        return step


def _early(what: str, backoff: _Backoff, now: float) -> QuotaExceeded:
    return QuotaExceeded("handshake_backoff", f"{backoff.until - now:.3g} s", "0 s",
                         f"{what} too soon: the time left of its backoff,")
