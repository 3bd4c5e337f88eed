"""The clock lease time runs on, on both ends: one that keeps counting while the host is suspended.

A lease's TTL bounds how long a prefill keeps pages locked for a reader that went quiet, and how
long a decode counts its reads as landing under a live lease.  ``time.monotonic`` stops while a
Linux host is suspended: a prefill resumed from a suspend would keep leases past their life, and
a decode resumed from one would count reads that landed after its prefill, which kept counting,
expired the lease and reused the pages.  ``CLOCK_BOOTTIME`` counts the time spent suspended;
where there is none, ``time.monotonic``.
"""

from __future__ import annotations

import functools
import time
from typing import Callable


def _boottime() -> Callable[[], float]:
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    if clock is not None:
        try:
            time.clock_gettime(clock)
            return functools.partial(time.clock_gettime, clock)
        except OSError:  # a kernel without it
            pass
    return time.monotonic


lease_clock: Callable[[], float] = _boottime()
"""Seconds, never going back: what both nodes read ``now`` from by default."""
