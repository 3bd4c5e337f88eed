"""A prefill's negotiations, cached by the ``layout_id`` of the layout a decode sent (its digest of what decides byte
compatibility, addresses left out): a decode reconnecting, or restarted, with a layout already negotiated (or
refused) costs a lookup, however costly its negotiation was.

Pure: the shell may compute one ahead, off the node's lock (``prepare``), and the session takes it under the lock
(``result``); both run on the loop's thread.  Whoever computes a negotiation not cached charges it to the
identity that asked (``Handshakes.may_negotiate``), so one identity cannot make many.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..core.layout import PageLayout
from ..core.negotiate import TransferPlan, negotiate
from ..errors import KvlendError, LayoutMismatch
from .budget import Handshakes
from .config import Quotas
from .wire import Handshake

MAX_CACHED = 64  # layouts whose negotiation is kept (the least recently used goes past it)


@dataclass(frozen=True)
class Negotiated:
    """A plan, and its summary's first line (a walk of every piece: computed once, with the plan)."""

    plan: TransferPlan
    line: str


class Negotiations:
    """``ours`` negotiated against the layouts decodes sent: a plan, or the ``LayoutMismatch`` refusing it."""

    def __init__(self, ours: PageLayout, quotas: Quotas, handshakes: Handshakes, size: int = MAX_CACHED) -> None:
        self.ours, self.quotas, self.handshakes, self.size = ours, quotas, handshakes, size
        self._cache: OrderedDict[str, Negotiated | LayoutMismatch] = OrderedDict()

    def prepare(self, identity: str, message: Handshake, now: float) -> None:
        """Compute ``message``'s negotiation ahead if it is not cached and ``identity`` may cost one now
        (otherwise ``result`` refuses it); never raises."""
        try:
            self.handshakes.admit(identity, now, charge=False)
            self.result(identity, message, now)
        except KvlendError:
            pass

    def result(self, identity: str, message: Handshake, now: float) -> Negotiated:
        """The plan for the decode layout ``message`` carries; ``LayoutMismatch`` (cached too) if it cannot be
        served, ``QuotaExceeded`` (``handshake_backoff``) if it is not cached and ``identity`` may not cost a
        negotiation now, ``LayoutError`` if it is no layout."""
        layout = message.page_layout()  # decoded once, off the lock by the shell's reader
        key = layout.layout_id
        known = self._cache.get(key)
        if known is None:
            self.handshakes.may_negotiate(identity, now)
            known = self._compute(layout)
            self._cache[key] = known
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        if isinstance(known, LayoutMismatch):
            raise known.with_traceback(None)  # the same error each time, its traceback not grown by each raise
        return known

    def _compute(self, layout: PageLayout) -> Negotiated | LayoutMismatch:
        try:
            plan = negotiate(layout, self.ours, max_page_ratio=self.quotas.max_page_ratio,
                             max_pieces=self.quotas.max_pieces)
        except LayoutMismatch as exc:  # NegotiationLimit too
            return exc.with_traceback(None)
        return Negotiated(plan, plan.summary().splitlines()[0])
