"""``Router``: which prefill gets the next request, from the registry's records, for examples and engines.

The records' ``load`` lags by an update interval (and a put), so a burst of
requests routed from records alone would all land on the same prefill.
The router also counts what it routed itself and has not yet heard finish,
and picks the compatible prefill with the least (published load + routed
here) per unit of capacity (``ClusterView.pick``).  Call ``finished`` once
a request's prefill leg is over (its ticket in hand: from then on its lease
shows in the prefill's own record), or let ``route`` do it.

Retry policy (``route``): a request whose prefill fails with a typed error
that another prefill may not share (``RETRY_ON``: it died or left, its lease
went, it timed out, it was full) is sent to the next pick, excluding every
prefill that failed it, up to ``attempts`` prefills in all; any other error
(a bad argument, a layout bug) is raised at once, since another prefill
would fail it the same way.  A prefill lost (``PeerLost``) is also skipped
by every pick for a cool-down (``failed``): until its record leaves, it would
look idle.  Thread-safe: one lock around the counts.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, TypeVar

from ..core.layout import PageLayout
from ..errors import ConfigError, LeaseError, PeerLost, QuotaExceeded, RegistryError, TransferTimeout
from .records import RankRecord

if TYPE_CHECKING:
    from .registry import Registry

T = TypeVar("T")
RETRY_ON: tuple[type[BaseException], ...] = (PeerLost, LeaseError, TransferTimeout, QuotaExceeded)


class Router:
    """Picks prefills whose layout ``layout`` (the decode's: the reader's) can read, by room left."""

    def __init__(self, registry: Registry, layout: PageLayout, *, cooldown: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.layout = layout
        self.cooldown = registry.ttl if cooldown is None else float(cooldown)
        self._clock = clock
        self._lock = threading.Lock()
        self._routed: dict[str, int] = {}  # identity -> requests picked here and not yet finished
        self._failed: dict[str, float] = {}  # identity -> until when it is not picked

    def pick(self, exclude: Iterable[str] = ()) -> RankRecord:
        """The compatible prefill with the most room, counted as routed to until ``finished``.

        Prefills that ``failed`` within the cool-down are skipped.  ``RegistryError`` if no live
        prefill (outside ``exclude``) is compatible.  On a degraded registry it picks among the
        prefills last known.
        """
        with self._lock:  # pick and count at once: concurrent picks see each other
            now = self._clock()
            for identity in [i for i, until in self._failed.items() if until <= now]:
                del self._failed[identity]
            record = self.registry.pick(self.layout, self._routed, {*exclude, *self._failed})
            self._routed[record.identity] = self._routed.get(record.identity, 0) + 1
            return record

    def finished(self, identity: str) -> None:
        """A request routed to ``identity`` no longer needs counting here (a no-op if none is)."""
        with self._lock:
            left = self._routed.get(identity, 0) - 1
            if left > 0:
                self._routed[identity] = left
            else:
                self._routed.pop(identity, None)

    def failed(self, identity: str) -> None:
        """``identity`` failed a request in a way another request would share (it died, or its link
        did): skip it for ``cooldown`` seconds (default the registry's TTL, by which a dead rank's
        record has left).  A dead prefill fails at once, so its routed count stays at zero and it
        would otherwise look like the least loaded until its record goes."""
        with self._lock:
            self._failed[identity] = self._clock() + self.cooldown

    @property
    def routed(self) -> dict[str, int]:
        """Requests picked and not yet finished, per prefill identity (a copy)."""
        with self._lock:
            return dict(self._routed)

    def route(self, fn: Callable[[RankRecord], T], attempts: int = 2,
              retry_on: tuple[type[BaseException], ...] = RETRY_ON) -> T:
        """``fn(prefill)`` for the best prefill; on a ``retry_on`` failure, again on the next best.

        Each pick is ``finished`` when ``fn`` returns or raises.  After ``attempts`` failures, or when
        no other compatible prefill is left, the last failure is raised (the registry's refusal
        chained to it).
        """
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ConfigError(f"route: attempts must be an int >= 1, got {attempts!r}")
        failed: list[str] = []
        last: BaseException | None = None
        for _ in range(attempts):
            try:
                record = self.pick(exclude=failed)
            except RegistryError as exc:
                if last is None:
                    raise
                raise last from exc
            try:
                return fn(record)
            except retry_on as exc:
                last = exc
                failed.append(record.identity)
                if isinstance(exc, PeerLost):
                    self.failed(record.identity)
            finally:
                self.finished(record.identity)
        assert last is not None
        raise last
