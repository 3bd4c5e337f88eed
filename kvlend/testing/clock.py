"""A clock that moves only when the test moves it.

kvlend reads lease time from a ``clock`` callable (``PrefillNode(clock=)``,
``DecodeNode(clock=)``, ``Router(clock=)``); the sessions take ``now`` as an
argument.  A ``FakeClock`` is both: call it, or read ``now``.  Nothing waits
on it, so a test of a lease's TTL, a heartbeat or a cool-down takes no
wall-clock time and never races the host's load.
"""

from __future__ import annotations


class FakeClock:
    """Seconds, starting at ``start``, that change only through ``advance`` or by setting ``now``."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move forward ``seconds`` (never back: set ``now`` to step the clock backwards); the new time."""
        if not seconds >= 0:
            raise ValueError(f"a clock advances by zero or more seconds, not {seconds!r}")
        self.now += seconds
        return self.now

    def __repr__(self) -> str:
        return f"FakeClock(now={self.now!r})"
