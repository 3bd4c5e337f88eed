"""``Membership``: a node's place in the cluster registry, apart from its loop.

The node's record is published (signed with the rank's certificate), signed anew when the
credentials are reloaded, kept current (load, health) from the loop's turn and withdrawn on
close.  Registry changes arrive on the registry's thread: the ones the node ``watches`` are
queued there (never under the node's lock) and the loop is woken; the loop's turn then ``act``s on
them.  The caller owns the registry (it starts it and closes it after the node).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..cluster.records import RankRecord
from ..cluster.view import Change
from ..protocol.config import NodeConfig
from ..security.credentials import Credentials

if TYPE_CHECKING:
    from ..cluster.registry import Registry


def rank_record(name: str, role: str, host: str, port: int, layout, config: NodeConfig, capacity: int | None,
                meta: Mapping[str, Any] | None) -> RankRecord:
    """Rank ``name``'s record (``capacity`` default: the per-peer lease quota), checked before anything starts."""
    replica = layout.replica
    return RankRecord(name, role, host, port, layout.encode(), replica.tp_size, replica.tp_rank,
                      replica.pp_size, replica.pp_rank,
                      capacity if capacity is not None else config.quotas.max_leases_per_peer, 0, meta or {})


class Membership:
    """One node's record in ``registry`` and the changes it acts on.

    ``wake()``: wake the node's loop; ``load()``: the load to publish (read on the loop's turn).
    ``watches(change)`` (registry thread) picks the changes to queue; ``act(change)`` (loop's turn)
    acts on one and says whether the node's session has actions to perform.
    """

    def __init__(self, registry: Registry, wake: Callable[[], None], *, load: Callable[[], int],
                 watches: Callable[[Change], bool] = lambda change: False,
                 act: Callable[[Change], bool] = lambda change: False) -> None:
        self.registry = registry
        self._wake, self._load_now = wake, load
        self._watches, self._act = watches, act
        self._changes: deque[Change] = deque()  # for the loop (appended on the registry thread)
        self._load = 0  # the load last handed to the registry
        self._healthy = True  # the health last handed to the registry

    def join(self, record: RankRecord, credentials: Credentials) -> None:
        """Publish ``record``, signed with ``credentials`` (refused if the registry publishes another
        rank), and follow the changes."""
        self.registry.publish(record, credentials)
        self.registry.add_listener(self._on_changes)

    def renewed(self, credentials: Credentials) -> None:
        """The rank's credentials were reloaded: its record (if still published) is signed with them."""
        if self.registry.published is not None:
            self.registry.publish(self.registry.published, credentials)

    def leave(self) -> None:
        """Stop following the registry and withdraw the record (the caller still owns the registry)."""
        self.registry.remove_listener(self._on_changes)
        self.registry.withdraw()

    def _on_changes(self, changes: list[Change]) -> None:
        """On the registry thread: queue the changes the node acts on and wake its loop."""
        mine = [c for c in changes if self._watches(c)]
        if mine:
            self._changes.extend(mine)
            self._wake()

    def turn(self, healthy: bool) -> bool:
        """On the loop's turn: act on the queued changes, and publish the load and the node's health
        (once unhealthy, for good) if they moved.  Whether an action left the session something to perform."""
        acted = False
        while self._changes:
            acted |= self._act(self._changes.popleft())
        load = self._load_now()
        if load != self._load:
            self._load = load
            self.registry.update(load=load)  # the registry coalesces a burst into one put
        if self._healthy and not healthy:  # it never turns back
            self._healthy = False
            self.registry.update(healthy=False)  # routers stop sending here
        return acted
