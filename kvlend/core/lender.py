"""Leases on a request's pages: lend, renew, release, expire.

The lender is pure: it is told the time, never reads a clock.  A lease pins
the pages a decoder at position ``num_tokens`` reads (page locks), so the
cache manager cannot reuse them while a peer may still be reading; it ends by
``release`` (the peer said Done) or by ``expire`` (the peer went quiet past
its TTL).  Lease ids are 128-bit random capabilities.

Decisions:

- One live lease per (request, peer): a second ``lend`` raises ``LeaseError``
  until the first is released or past its expiry, so a retry cannot leak locks.
- ``release`` is idempotent: an id already released or expired returns None;
  an id never granted (or no longer remembered) raises ``LeaseUnknown``.
- ``release(..., hold=True)`` ends a lease that a reader may still be reading
  (the engine revoked it under a fetch): it is over for every purpose but its
  page locks, which stay until ``settle`` (the reader is quiet) or until its
  expiry passes (``expire`` returns it then), so no read a reader still counts
  can see a reused page.
- The lender remembers the last ``remember`` ended ids so that a late call
  gets the right error: ``LeaseExpired`` for an expired lease, ``LeaseUnknown``
  for a released one.
- A lease whose ``peer`` is None may be read by any peer (the id is the
  capability); otherwise only by that peer.
- A lease lent with a ``prompt_digest`` (``core.prompt``) is claimed only with
  the same digest (``PromptMismatch`` otherwise, nothing changed): the id alone,
  which travels in clear through HTTP, then reads nothing.  A lease lent without
  one is bound to no prompt (engines whose tickets never leave trusted hands).
- A NAMED selection lends only the groups that hold a named buffer; every group
  must still be given a page table.
- ``LeaseLimits`` (default: none) caps what one lend or bind may take, each refused
  with a ``QuotaExceeded`` naming the limit before anything changes: tokens per
  lease, live leases and locked pages per peer (counted when the lease is lent
  to a peer, or bound to one), and a lease's whole lifetime: it never expires
  later than lend time + ``max_lease_lifetime``; a renewal that would push it
  past that is refused (``LeaseLifetimeExceeded``) and leaves it as it was.
  Leases past their expiry that ``expire`` has not yet ended do not count
  against a peer's quota.
"""

from __future__ import annotations

import heapq
import hmac
import math
import secrets
from collections import OrderedDict
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import (
    LayoutError,
    LeaseDenied,
    LeaseError,
    LeaseExpired,
    LeaseLifetimeExceeded,
    LeaseUnknown,
    PageRangeError,
    PromptMismatch,
    QuotaExceeded,
)
from .layout import PageLayout, RowSelection
from .lease import (  # Lease, LeaseLimits and the id size are imported from here too
    LEASE_ID_BYTES,
    NO_LIMITS,
    Lease,
    LeaseLimits,
    check_id,
    check_peer,
    check_ready,
    check_time,
    show_peer,
)
from .locks import PageLocks, Slots
from .pages import GroupPages, int_array
from .prompt import check_digest

_EXPIRED, _RELEASED = "expired", "released"
_SELECTION_CACHE = 64  # distinct selections whose per-group regions are kept


@dataclass(frozen=True)
class _Loan:
    lease: Lease
    locked: tuple[Slots, ...]  # the page-lock slots this lease holds, one entry per lend or extend, validated then


class Lender:
    """Grants and ends leases on one layout's pages; holds their page locks."""

    def __init__(
        self,
        layout: PageLayout,
        locks: PageLocks | None = None,
        new_id: Callable[[int], bytes] = secrets.token_bytes,
        remember: int = 65536,
    ) -> None:
        if locks is None:
            locks = PageLocks(layout)
        elif not isinstance(locks, PageLocks) or locks.layout.regions != layout.regions:
            raise LayoutError("locks: must be PageLocks over the same regions as the lender's layout")
        if isinstance(remember, bool) or not isinstance(remember, int) or remember < 0:
            raise LeaseError(f"remember: must be an int >= 0, got {remember!r}")
        self.layout = layout
        self.locks = locks
        self._new_id = new_id
        self._remember = remember
        self._live: dict[bytes, _Loan] = {}
        self._held: dict[bytes, _Loan] = {}  # released under a reader: locked until settled or expired
        self._by_key: dict[tuple[str, str | None], bytes] = {}
        self._of_peer: dict[str | None, dict[bytes, int]] = {}  # live lease ids -> pages, per peer (None: tickets)
        self._peer_pages: dict[str | None, int] = {}
        self._ended: OrderedDict[bytes, str] = OrderedDict()
        self._deadlines: list[tuple[float, int, bytes]] = []  # lazy heap; stale entries skipped
        self._seq = 0
        self._by_selection: dict[RowSelection, dict[str, tuple[tuple[str, ...], int]]] = {}
        self._region_order = {r.name: i for i, r in enumerate(layout.regions)}

    # ------------------------------------------------------------- lending
    def lend(
        self,
        request: str,
        num_tokens: int,
        pages: Mapping[str, Any],
        selection: RowSelection,
        now: float,
        ttl: float,
        peer: str | None = None,
        limits: LeaseLimits = NO_LIMITS,
        lease_id: bytes | None = None,
        ready: int | None = None,
        prompt_digest: bytes | None = None,
        wait: float | None = None,
    ) -> Lease:
        """Lend what a decoder at ``num_tokens`` reads; validates everything first.

        ``pages[group]`` is the request's page table: one slot ordinal per token
        page (``ceil(num_tokens / tokens_per_page)`` entries), or one entry (the
        state slot) for a recurrent group.  Only rows that are lent are range
        checked, so stale rows of a windowed group may hold -1.  ``limits``: see the module doc.
        ``lease_id`` (default: a fresh random one) lets a caller mint the ticket before the lend,
        as vLLM's scheduler must; it is a capability, so it must be as unguessable as ours.
        ``ready`` (default ``num_tokens``): lend progressively, while prefill still computes. Only the
        pages wholly below ``ready`` tokens are lent (recurrent state only at ``num_tokens``); rows
        past it may hold -1, and ``extend`` lends the rest as chunks are committed.
        ``prompt_digest``: ``core.prompt.prompt_digest`` of the request's prompt; a claim must then carry it.
        ``wait`` (default ``ttl``): how long a lease lent to any peer lives until a claim binds it, which
        renews it for ``ttl`` from then, shorter or not: a short ``ttl`` bounds how long a reader that
        ignores the lease's end holds its pages (the engine's wait), not how long a ticket waits.
        """
        if not isinstance(request, str) or not request:
            raise LeaseError(f"request: must be a non-empty str, got {request!r}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
            raise PageRangeError(f"num_tokens: must be an int > 0, got {num_tokens!r}")
        if not isinstance(limits, LeaseLimits):
            raise LeaseError(f"limits: must be a LeaseLimits, got {type(limits).__name__}")
        if num_tokens > limits.max_num_tokens:
            raise QuotaExceeded("max_num_tokens", num_tokens, limits.max_num_tokens, "a lease of num_tokens")
        if num_tokens > self.layout.kept_window:  # readers rely on it: a full group then lends every page
            raise PageRangeError(f"num_tokens: {num_tokens} exceeds the layout's kept window of "
                                 f"{self.layout.kept_window} tokens")
        if not isinstance(selection, RowSelection):
            raise LayoutError(f"selection: must be a RowSelection, got {selection!r}")
        targets = self._targets(selection)
        now = check_time("now", now)
        ttl = check_time("ttl", ttl)
        if ttl <= 0 or not math.isfinite(now + ttl):
            raise LeaseError(f"ttl: must be > 0 with a finite now + ttl, got now={now} ttl={ttl}")
        wait = ttl if wait is None else check_time("wait", wait)
        if wait <= 0 or not math.isfinite(now + wait):
            raise LeaseError(f"wait: must be > 0 with a finite now + wait, got now={now} wait={wait}")
        if max(ttl, wait) > limits.max_lease_lifetime:
            raise QuotaExceeded("max_lease_lifetime", max(ttl, wait), limits.max_lease_lifetime, "a lease ttl of")
        peer = check_peer(peer)
        prompt_digest = check_digest(prompt_digest)
        ready = check_ready(ready, num_tokens, 0)
        lent, slots = self._plan(num_tokens, pages, targets, ready)
        num_pages = sum(len(g) for g in lent.values())
        self._check_quota(peer, num_pages, now, limits)
        key = (request, peer)
        other = self._live.get(self._by_key.get(key, b""))
        if other is not None and now <= other.lease.expires_at:
            raise LeaseError(
                f"request {request!r} already has live lease {other.lease.hex} for peer {peer!r}; "
                "release it first"
            )
        source = "new_id: must return" if lease_id is None else "lease_id: must be"
        if lease_id is None:
            lease_id = self._new_id(LEASE_ID_BYTES)
        if not isinstance(lease_id, bytes) or len(lease_id) != LEASE_ID_BYTES:
            raise LeaseError(f"{source} {LEASE_ID_BYTES} bytes, got {lease_id!r}")
        if self.known(lease_id):
            raise LeaseError(f"{source.split(':')[0]}: repeated lease id {lease_id.hex()}")
        self.locks.lock_slots(slots)
        lease = Lease(
            id=lease_id, request=request, num_tokens=num_tokens, pages=MappingProxyType(lent),
            selection=selection, peer=peer, ttl=ttl, expires_at=now + (ttl if peer is not None else wait),
            lent_at=now, ends_by=now + limits.max_lease_lifetime, ready=ready, prompt_digest=prompt_digest,
        )
        self._live[lease_id] = _Loan(lease, (slots,))
        self._by_key[key] = lease_id
        self._count(peer, lease_id, num_pages)
        self._push(lease)
        return lease

    def _check_quota(self, peer: str | None, num_pages: int, now: float, limits: LeaseLimits,
                     grows: bool = False) -> None:
        """Refuse one more lease of ``num_pages`` for ``peer`` past its lease or page quota
        (``grows``: no new lease, one the peer holds takes ``num_pages`` more)."""
        if peer is None:
            return
        ids = self._of_peer.get(peer, {})
        more = 0 if grows else 1
        leases, pages = len(ids) + more, self._peer_pages.get(peer, 0) + num_pages
        if more and leases > limits.max_leases_per_peer or pages > limits.max_locked_pages_per_peer:
            # Only now look closer: leases past their expiry that no sweep ended yet do not count.
            live = [n for i, n in ids.items() if now <= self._live[i].lease.expires_at]
            leases, pages = len(live) + more, sum(live) + num_pages
        if more and leases > limits.max_leases_per_peer:  # a lease that grows adds no lease
            raise QuotaExceeded("max_leases_per_peer", leases, limits.max_leases_per_peer,
                                f"peer {show_peer(peer)} would hold live leases:")
        if pages > limits.max_locked_pages_per_peer:
            raise QuotaExceeded("max_locked_pages_per_peer", pages, limits.max_locked_pages_per_peer,
                                f"peer {show_peer(peer)} would hold locked pages:")

    def _count(self, peer: str | None, lease_id: bytes, num_pages: int) -> None:
        self._of_peer.setdefault(peer, {})[lease_id] = num_pages
        self._peer_pages[peer] = self._peer_pages.get(peer, 0) + num_pages

    def _uncount(self, peer: str | None, lease_id: bytes) -> None:
        ids = self._of_peer[peer]
        pages = ids.pop(lease_id)
        if ids:
            self._peer_pages[peer] -= pages
        else:
            del self._of_peer[peer], self._peer_pages[peer]

    def usage(self, peer: str | None) -> tuple[int, int]:
        """(leases, pages) held for ``peer`` (None: tickets not yet claimed), including any past
        expiry that ``expire`` has not yet ended."""
        peer = check_peer(peer)
        return len(self._of_peer.get(peer, ())), self._peer_pages.get(peer, 0)

    def _targets(self, selection: RowSelection) -> dict[str, tuple[tuple[str, ...], int]]:
        """Per group, the regions ``selection`` lends from (layout order) and their fewest pages.

        Validates the selection; cached per selection, since a layout is immutable.
        """
        targets = self._by_selection.get(selection)
        if targets is None:
            names = {b.name for b in self.layout.selected_buffers(selection)}
            regions = self.layout.region_map
            targets = {}
            for name, group in self.layout.groups.items():
                used = sorted({b.region for b in group.buffers if b.name in names}, key=self._region_order.__getitem__)
                if used:
                    targets[name] = (tuple(used), min(regions[r].num_pages for r in used))
            if len(self._by_selection) >= _SELECTION_CACHE:
                self._by_selection.clear()
            self._by_selection[selection] = targets
        return targets

    def _plan(
        self, num_tokens: int, pages: Mapping[str, Any], targets: Mapping[str, tuple[tuple[str, ...], int]],
        ready: int, before: Mapping[str, GroupPages] | None = None,
    ) -> tuple[dict[str, GroupPages], Slots]:
        """Validate the page tables; return the rows lent (those complete at ``ready``, less those
        lent ``before``) and the page-lock slots they hold."""
        groups = self.layout.groups
        if type(pages) is not dict and not isinstance(pages, Mapping):
            raise PageRangeError(f"pages: must be a mapping of group name to page table, got {type(pages).__name__}")
        if pages.keys() != groups.keys():
            missing, unknown = sorted(set(groups) - set(pages)), sorted(map(repr, set(pages) - set(groups)))
            raise PageRangeError(f"pages: missing groups {missing}, unknown groups [{', '.join(unknown)}]")
        tpp = self.layout.tokens_per_page
        lent: dict[str, GroupPages] = {}
        uses: list[tuple[tuple[str, ...], np.ndarray]] = []  # (regions, unique slots) per lent group
        for name, group in groups.items():
            table = _table(name, pages[name], 1 if group.recurrent else -(-num_tokens // tpp))
            target = targets.get(name)
            if target is None:
                continue
            rows = group.pages_read(num_tokens, tpp)
            if ready < num_tokens:  # progressive: complete pages only, recurrent state once final
                rows = rows[:0] if group.recurrent else rows[:np.searchsorted(rows, ready // tpp)]
            if before is not None:
                rows = self._new_rows(name, rows, table, before[name])
            ordinals = table[rows]
            used, fewest = target
            unique = _unique(ordinals)
            if unique.size and (unique[0] < 0 or unique[-1] >= fewest):
                self._range_error(name, rows, ordinals, used)
            uses.append((used, unique))
            lent[name] = GroupPages._checked(rows, ordinals)
        if len(uses) == 1:  # one group lent: its regions, in layout order, share its checked slots
            return lent, self.locks._shared_slots(*uses[0])
        per_region: dict[str, list[np.ndarray]] = {}
        for used, unique in uses:
            for r in used:
                per_region.setdefault(r, []).append(unique)
        order = self._region_order
        locked = tuple(
            (r, parts[0] if len(parts) == 1 else _unique(np.concatenate(parts)))
            for r, parts in sorted(per_region.items(), key=lambda item: order[item[0]])
        )
        return lent, self.locks._flatten(locked)

    @staticmethod
    def _new_rows(group: str, rows: np.ndarray, table: np.ndarray, lent: GroupPages) -> np.ndarray:
        """``rows`` not lent yet; ``LeaseError`` if a row already lent is now in another slot."""
        old = np.isin(rows, lent.token_pages, assume_unique=True)
        if old.sum() != len(lent):
            raise LeaseError(f"pages[{group!r}]: the rows already lent are not all still lent at this point")
        moved = np.flatnonzero(table[lent.token_pages] != lent.ordinals)
        if moved.size:
            i = int(moved[0])
            raise LeaseError(f"pages[{group!r}]: token page {int(lent.token_pages[i])} was lent in slot "
                             f"{int(lent.ordinals[i])}, the table now says {int(table[lent.token_pages[i]])}")
        return rows[~old]

    def extend(self, lease_id: bytes, ready: int, pages: Mapping[str, Any], now: float,
               limits: LeaseLimits = NO_LIMITS) -> tuple[Lease, dict[str, GroupPages]]:
        """Lend what prefill has committed up to ``ready`` tokens: the lease grows in place.

        ``pages`` is the request's whole page table as in ``lend`` (rows past ``ready`` may hold -1);
        rows lent before must keep their slots.  Pages newly complete at ``ready`` are locked and
        lent (recurrent state only once ``ready == num_tokens``, which makes the lease final).
        Returns the lease and the rows this call added, per group (empty groups left out), which is
        what a reader needs to hear.  ``ready`` None means ``num_tokens`` (final).  Everything is
        checked (and the peer's page quota) before anything changes; a final or ended lease cannot grow.
        """
        lease = self.get(lease_id, now)
        if lease.final:
            raise LeaseError(f"lease {lease.hex} is final: every page of its {lease.num_tokens} tokens is lent")
        ready = check_ready(ready, lease.num_tokens, lease.ready + 1)
        if not isinstance(limits, LeaseLimits):
            raise LeaseError(f"limits: must be a LeaseLimits, got {type(limits).__name__}")
        targets = self._targets(lease.selection)
        added, slots = self._plan(lease.num_tokens, pages, targets, ready, before=_all_groups(self, lease))
        more = sum(len(g) for g in added.values())
        if lease.peer is not None and more:
            self._check_quota(lease.peer, more, now, limits, grows=True)
        self.locks.lock_slots(slots)
        merged = {name: _merged(gp, added.get(name)) for name, gp in lease.pages.items()}
        merged.update((name, gp) for name, gp in added.items() if name not in merged)
        grown = replace(lease, ready=ready, pages=MappingProxyType(merged))
        loan = self._live[lease_id]
        self._live[lease_id] = _Loan(grown, loan.locked + (slots,))
        self._of_peer[lease.peer][lease_id] += more
        self._peer_pages[lease.peer] += more
        return grown, {name: gp for name, gp in added.items() if len(gp)}

    def _range_error(self, group: str, rows: np.ndarray, ordinals: np.ndarray, used: tuple[str, ...]) -> None:
        """Raise for the first region (by name) and row whose slot is out of range."""
        for region_name in sorted(used):
            size = self.layout.region_map[region_name].num_pages
            bad = np.flatnonzero((ordinals < 0) | (ordinals >= size))
            if bad.size:
                i = int(bad[0])
                raise PageRangeError(
                    f"pages[{group!r}]: token page {int(rows[i])} is in slot {int(ordinals[i])}, "
                    f"outside region {region_name!r} of {size} pages"
                )

    # ------------------------------------------------------------ lifetime
    def get(self, lease_id: bytes, now: float) -> Lease:
        """The live lease; ``LeaseExpired`` past its expiry, ``LeaseUnknown`` if released or never granted."""
        check_id(lease_id)
        now = check_time("now", now)
        loan = self._live.get(lease_id)
        if loan is not None:
            if now > loan.lease.expires_at:
                raise LeaseExpired(f"lease {lease_id.hex()} expired at {loan.lease.expires_at} (now {now})")
            return loan.lease
        ended = self._ended.get(lease_id)
        if ended == _EXPIRED:
            raise LeaseExpired(f"lease {lease_id.hex()} expired")
        if ended == _RELEASED:
            raise LeaseUnknown(f"lease {lease_id.hex()} was released")
        raise LeaseUnknown(f"lease {lease_id.hex()} was never granted (or is long gone)")

    def known(self, lease_id: bytes) -> bool:
        """Whether ``lease_id`` is live, held or remembered as ended (not merely never granted)."""
        return lease_id in self._live or lease_id in self._held or lease_id in self._ended

    def check_read(self, lease_id: bytes, peer: str | None, now: float) -> Lease:
        """The lease, if ``peer`` may read it now: live and offered to this peer (or to any)."""
        peer = check_peer(peer)
        lease = self.get(lease_id, now)
        if lease.peer is not None and lease.peer != peer:
            raise LeaseDenied(f"lease {lease.hex} is not offered to peer {peer!r}")
        return lease

    def bind(self, lease_id: bytes, peer: str, now: float, limits: LeaseLimits = NO_LIMITS) -> Lease:
        """Give a lease lent to any peer (a ticket's) to ``peer``, which alone may read it from now on.

        Checked against ``peer``'s quotas in ``limits`` first (a lease already its own is not counted twice).
        """
        check_peer(peer)
        lease = self.check_read(lease_id, peer, now)
        if lease.peer == peer:
            return lease
        self._check_bind(lease, peer, now, limits)
        return self._bind(lease, peer)

    def claim(self, lease_id: bytes, peer: str, now: float, limits: LeaseLimits = NO_LIMITS,
              prompt_digest: bytes | None = None) -> Lease:
        """``bind`` then ``renew``, every check of both made before either changes anything.

        ``prompt_digest``: the digest of the claimer's own prompt; ``PromptMismatch`` unless it is the
        lease's (a lease lent without one takes any).
        """
        check_peer(peer)
        lease = self.check_read(lease_id, peer, now)
        if lease.prompt_digest is not None and (
                not isinstance(prompt_digest, bytes) or not hmac.compare_digest(prompt_digest, lease.prompt_digest)):
            raise PromptMismatch(f"lease {lease.hex} is bound to its prompt and the claim carries no prompt digest"
                                 if not prompt_digest else
                                 f"lease {lease.hex} holds the KV of another prompt than the claim's (digests differ)")
        expires_at = self._renewal(lease, now, binds=lease.peer is None)
        if lease.peer != peer:
            self._check_bind(lease, peer, now, limits)
            lease = self._bind(lease, peer)
        return self._renew_to(lease, expires_at)

    def _check_bind(self, lease: Lease, peer: str, now: float, limits: LeaseLimits) -> None:
        if not isinstance(limits, LeaseLimits):
            raise LeaseError(f"limits: must be a LeaseLimits, got {type(limits).__name__}")
        other = self._live.get(self._by_key.get((lease.request, peer), b""))
        if other is not None and now <= other.lease.expires_at:
            raise LeaseError(f"request {lease.request!r} already has live lease {other.lease.hex} for peer {peer!r}")
        self._check_quota(peer, lease.num_pages, now, limits)

    def _bind(self, lease: Lease, peer: str) -> Lease:
        bound = replace(lease, peer=peer)
        self._live[lease.id] = replace(self._live[lease.id], lease=bound)
        if self._by_key.get((lease.request, lease.peer)) == lease.id:
            del self._by_key[(lease.request, lease.peer)]
        self._by_key[(lease.request, peer)] = lease.id
        self._uncount(lease.peer, lease.id)
        self._count(peer, lease.id, lease.num_pages)
        return bound

    def next_expiry(self) -> float | None:
        """The earliest expiry among live and held leases, or None."""
        while self._deadlines and not self._current(self._deadlines[0]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def renew(self, lease_id: bytes, now: float) -> Lease:
        """Push the expiry to ``now + ttl`` (never earlier than it was).

        ``LeaseLifetimeExceeded`` (changing nothing) if that is past the lease's ``ends_by``.
        """
        lease = self.get(lease_id, now)
        return self._renew_to(lease, self._renewal(lease, now))

    def _renewal(self, lease: Lease, now: float, binds: bool = False) -> float:
        """The expiry a renewal at ``now`` gives ``lease``, or ``LeaseLifetimeExceeded``.

        ``binds``: the first claim of a lease lent to any peer, which ends its ``wait``: ``now + ttl`` even
        if that is earlier (nobody could read it before, so nobody counted on the wait)."""
        want = float(now) + lease.ttl
        if want > lease.ends_by:
            cap = lease.ends_by - lease.lent_at
            raise LeaseLifetimeExceeded(
                "max_lease_lifetime", want - lease.lent_at, cap,
                f"lease {lease.hex} lent at {lease.lent_at} would live until {want}, a lifetime of")
        return want if binds else max(lease.expires_at, want)

    def _renew_to(self, lease: Lease, expires_at: float) -> Lease:
        if expires_at == lease.expires_at:
            return lease
        renewed = replace(lease, expires_at=expires_at)
        self._live[lease.id] = replace(self._live[lease.id], lease=renewed)
        self._push(renewed)
        return renewed

    def release(self, lease_id: bytes, hold: bool = False) -> Lease | None:
        """End a lease and drop its locks; None if it had already ended (harmless).

        ``hold``: its reader may still be reading it, so its locks stay until ``settle`` or its
        expiry (see the module doc); it is ended for everything else at once.
        """
        check_id(lease_id)
        if lease_id in self._live:
            return self._end(lease_id, _RELEASED, hold)
        if lease_id in self._ended or lease_id in self._held:
            return None
        raise LeaseUnknown(f"lease {lease_id.hex()} was never granted (or is long gone)")

    def settle(self, lease_id: bytes) -> Lease | None:
        """The reader of a lease released with ``hold`` is quiet: drop its locks; None if none are held."""
        loan = self._held.pop(lease_id, None)
        return None if loan is None else self._unlock(loan)

    def _unlock(self, loan: _Loan) -> Lease:
        for slots in loan.locked:
            self.locks.unlock_slots(slots)
        return loan.lease

    def expire(self, now: float) -> list[Lease]:
        """End every lease whose expiry is strictly before ``now``, oldest first; a held lease past
        its expiry is settled and listed too (its caller knows it released it)."""
        now = check_time("now", now)
        out = []
        while self._deadlines and self._deadlines[0][0] < now:
            entry = heapq.heappop(self._deadlines)
            if not self._current(entry):
                continue
            lease_id = entry[2]
            out.append(self._end(lease_id, _EXPIRED) if lease_id in self._live
                       else self._unlock(self._held.pop(lease_id)))  # held (a current entry is live or held)
        return out

    def leases_of(self, peer: str | None) -> list[Lease]:
        """Live leases offered to ``peer``."""
        peer = check_peer(peer)
        return [loan.lease for loan in self._live.values() if loan.lease.peer == peer]

    def release_peer(self, peer: str | None) -> list[Lease]:
        """Release every lease offered to ``peer`` (it died or disconnected)."""
        return [self._end(lease.id, _RELEASED) for lease in self.leases_of(peer)]

    @property
    def active_leases(self) -> int:
        """Leases holding locks (including any past expiry that ``expire`` has not yet ended, and
        released ones held for their reader)."""
        return len(self._live) + len(self._held)

    # ------------------------------------------------------------- helpers
    def _push(self, lease: Lease) -> None:
        self._seq += 1
        heapq.heappush(self._deadlines, (lease.expires_at, self._seq, lease.id))
        if len(self._deadlines) > 2 * self.active_leases + 64:  # a caller that never calls expire: drop stale
            self._deadlines = [e for e in self._deadlines if self._current(e)]
            heapq.heapify(self._deadlines)

    def _current(self, entry: tuple[float, int, bytes]) -> bool:
        """Whether a deadline entry is still a lease's expiry (not one released or renewed since)."""
        loan = self._live.get(entry[2]) or self._held.get(entry[2])
        return loan is not None and loan.lease.expires_at == entry[0]

    def _end(self, lease_id: bytes, why: str, hold: bool = False) -> Lease:
        loan = self._live.pop(lease_id)
        if hold:
            self._held[lease_id] = loan
        else:
            for slots in loan.locked:
                self.locks.unlock_slots(slots)
        key = (loan.lease.request, loan.lease.peer)
        if self._by_key.get(key) == lease_id:
            del self._by_key[key]
        self._uncount(loan.lease.peer, lease_id)
        self._ended[lease_id] = why
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
        return loan.lease


def _table(group: str, value: Any, length: int) -> np.ndarray:
    return int_array(f"pages[{group!r}]", value, length=length)


def _all_groups(lender: Lender, lease: Lease) -> dict[str, GroupPages]:
    """What ``lease`` holds per group of the layout (groups it lends nothing of yet: empty)."""
    empty = GroupPages._checked(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    return {name: lease.pages.get(name, empty) for name in lender.layout.groups}


def _merged(a: GroupPages, b: GroupPages | None) -> GroupPages:
    """The rows of both (disjoint), sorted by token page."""
    if b is None or not len(b):
        return a
    tokens = np.concatenate([a.token_pages, b.token_pages])
    order = np.argsort(tokens, kind="stable")
    return GroupPages._checked(tokens[order], np.concatenate([a.ordinals, b.ordinals])[order])


def _unique(values: np.ndarray) -> np.ndarray:
    """Sorted unique values: ``np.unique`` without its fixed cost (a lease's tables are short)."""
    if values.size < 2:
        return values
    out = np.sort(values)
    keep = np.empty(out.size, dtype=bool)
    keep[0] = True
    np.not_equal(out[1:], out[:-1], out=keep[1:])
    return out if keep.all() else out[keep]
