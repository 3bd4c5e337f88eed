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
- Each lease id has one record (``Loan``, in ``loans``): its state is the
  ``loan`` table's (``core.loans``), moved only by ``Loans.to``.  ``release`` of a
  lease whose offer went out (``offered``) ends a lease that a reader may still be
  reading (the engine revoked it under a fetch): it is over for every purpose but
  its page locks, which stay (``held``) until ``settle`` (the reader is quiet) or
  until its expiry passes (``expire`` returns it then), so no read a reader still
  counts can see a reused page; ``end`` (the reader is done) never holds.
- The lender remembers the last ``remember`` ended ids so that a late call
  gets the right error: ``LeaseExpired`` for an expired lease, ``LeaseUnknown``
  for a released one.
- A lease whose ``peer`` is None may be read by any peer (the id is the
  capability); otherwise only by that peer.
- ``LendOptions`` say how a lease is lent; the lease keeps them.
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
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Callable, Mapping

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
from .lease import (  # Lease, LendOptions, LeaseLimits and the id size are imported from here too
    LEASE_ID_BYTES,
    NO_LIMITS,
    NO_OPTIONS,
    Lease,
    LeaseLimits,
    LendOptions,
    check_id,
    check_peer,
    check_ready,
    check_time,
    show_peer,
)
from .lend_rows import LendRows, all_groups, merged
from .loans import LIVE, Loan, LoanEvent, Loans, LoanState
from .locks import PageLocks
from .pages import GroupPages
from .prompt import check_digest

_EXPIRED, _RELEASED = "expired", "released"


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
        self.loans = Loans()  # every lease id's one record; the session reads it and moves who reads it
        self._rows = LendRows(layout, locks)
        self._by_key: dict[tuple[str, str | None], bytes] = {}
        self._of_peer: dict[str | None, dict[bytes, int]] = {}  # live lease ids -> pages, per peer (None: tickets)
        self._peer_pages: dict[str | None, int] = {}
        self._ended: OrderedDict[bytes, str] = OrderedDict()
        self._deadlines: list[tuple[float, int, bytes]] = []  # lazy heap; stale entries skipped
        self._seq = 0

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
        options: LendOptions = NO_OPTIONS,
        wait: float | None = None,
    ) -> Lease:
        """Lend what a decoder at ``num_tokens`` reads; validates everything first.

        ``pages[group]`` is the request's page table: one slot ordinal per token
        page (``ceil(num_tokens / tokens_per_page)`` entries), or one entry (the
        state slot) for a recurrent group.  Only rows that are lent are range
        checked, so stale rows of a windowed group may hold -1.  ``limits``: see the module doc.
        ``options`` (``LendOptions``), kept on the lease: ``lease_id`` (default: a fresh random one) lets
        a caller mint the ticket before the lend, as vLLM's scheduler must; it is a capability, so it must
        be as unguessable as ours.  ``ready`` (default ``num_tokens``): lend progressively, while prefill
        still computes. Only the pages wholly below ``ready`` tokens are lent (recurrent state only at
        ``num_tokens``); rows past it may hold -1, and ``extend`` lends the rest as chunks are committed.
        ``prompt_digest``: a claim must then carry it.  ``meta``: the offer's, kept in the lease's record.
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
        if not isinstance(options, LendOptions):
            raise LeaseError(f"options: must be a LendOptions, got {type(options).__name__}")
        targets = self._rows.targets(selection)
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
        check_digest(options.prompt_digest)
        ready = check_ready(options.ready, num_tokens, 0)
        lent, slots = self._rows.plan(num_tokens, pages, targets, ready)
        num_pages = sum(len(g) for g in lent.values())
        self._check_quota(peer, num_pages, now, limits)
        key = (request, peer)
        other = self._live_lease(self._by_key.get(key, b""))
        if other is not None and now <= other.expires_at:
            raise LeaseError(
                f"request {request!r} already has live lease {other.hex} for peer {peer!r}; "
                "release it first"
            )
        lease_id = options.lease_id
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
            lent_at=now, ends_by=now + limits.max_lease_lifetime, ready=ready, options=options,
        )
        self.loans.to(lease_id, LoanEvent.LEND, lease=lease, locked=(slots,), meta=dict(options.meta))
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
            live = [n for i, n in ids.items() if now <= self._lease(i).expires_at]
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


    def extend(self, lease_id: bytes, ready: int, pages: Mapping[str, Any], now: float,
               limits: LeaseLimits = NO_LIMITS, meta: Mapping[str, Any] | None = None,
               ) -> tuple[Lease, dict[str, GroupPages]]:
        """Lend what prefill has committed up to ``ready`` tokens: the lease grows in place.

        ``pages`` is the request's whole page table as in ``lend`` (rows past ``ready`` may hold -1);
        rows lent before must keep their slots.  Pages newly complete at ``ready`` are locked and
        lent (recurrent state only once ``ready == num_tokens``, which makes the lease final).
        Returns the lease and the rows this call added, per group (empty groups left out), which is
        what a reader needs to hear.  ``ready`` None means ``num_tokens`` (final).  Everything is
        checked (and the peer's page quota) before anything changes; a final or ended lease cannot grow.
        ``meta`` is merged into the engine data its record keeps for its offer.
        """
        lease = self.get(lease_id, now)
        if lease.final:
            raise LeaseError(f"lease {lease.hex} is final: every page of its {lease.num_tokens} tokens is lent")
        ready = check_ready(ready, lease.num_tokens, lease.ready + 1)
        if not isinstance(limits, LeaseLimits):
            raise LeaseError(f"limits: must be a LeaseLimits, got {type(limits).__name__}")
        targets = self._rows.targets(lease.selection)
        added, slots = self._rows.plan(lease.num_tokens, pages, targets, ready, before=all_groups(self.layout, lease))
        more = sum(len(g) for g in added.values())
        if lease.peer is not None and more:
            self._check_quota(lease.peer, more, now, limits, grows=True)
        self.locks.lock_slots(slots)
        grown_pages = {name: merged(gp, added.get(name)) for name, gp in lease.pages.items()}
        grown_pages.update((name, gp) for name, gp in added.items() if name not in grown_pages)
        grown = replace(lease, ready=ready, pages=MappingProxyType(grown_pages))
        loan = self.loans.all[lease_id]
        loan.lease, loan.locked = grown, loan.locked + (slots,)
        if meta:
            loan.meta = {**loan.meta, **meta}
        self._of_peer[lease.peer][lease_id] += more
        self._peer_pages[lease.peer] += more
        return grown, {name: gp for name, gp in added.items() if len(gp)}

    def get(self, lease_id: bytes, now: float) -> Lease:
        """The live lease; ``LeaseExpired`` past its expiry, ``LeaseUnknown`` if released or never granted."""
        check_id(lease_id)
        now = check_time("now", now)
        lease = self._live_lease(lease_id)
        if lease is not None:
            if now > lease.expires_at:
                raise LeaseExpired(f"lease {lease_id.hex()} expired at {lease.expires_at} (now {now})")
            return lease
        ended = self._ended.get(lease_id)
        if ended == _EXPIRED:
            raise LeaseExpired(f"lease {lease_id.hex()} expired")
        if ended == _RELEASED:
            raise LeaseUnknown(f"lease {lease_id.hex()} was released")
        raise LeaseUnknown(f"lease {lease_id.hex()} was never granted (or is long gone)")

    def known(self, lease_id: bytes) -> bool:
        """Whether ``lease_id`` is live, held or remembered as ended (not merely never granted)."""
        return self.loans.locking(lease_id) is not None or lease_id in self._ended

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
        other = self._live_lease(self._by_key.get((lease.request, peer), b""))
        if other is not None and now <= other.expires_at:
            raise LeaseError(f"request {lease.request!r} already has live lease {other.hex} for peer {peer!r}")
        self._check_quota(peer, lease.num_pages, now, limits)

    def _bind(self, lease: Lease, peer: str) -> Lease:
        bound = replace(lease, peer=peer)
        self.loans.all[lease.id].lease = bound
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
        self.loans.all[lease.id].lease = renewed
        self._push(renewed)
        return renewed

    def offered(self, lease_id: bytes, reader: int | None) -> None:
        """The live lease's offer went out on connection ``reader``: extensions follow it, and a release
        holds its pages until that reader is quiet (``settle``, ``quiet``) or it expires."""
        self.loans.to(lease_id, LoanEvent.OFFER, reader=reader)

    def release(self, lease_id: bytes) -> Lease | None:
        """End a lease (the engine revoked it); None if it had already ended (harmless).

        Its locks go at once, unless its offer went out: its reader may still be reading it, so they stay
        until ``settle`` or its expiry (see the module doc); it is ended for everything else at once.
        """
        return self._finish(lease_id, LoanEvent.RELEASE)

    def end(self, lease_id: bytes) -> Lease | None:
        """End a lease whose reader is done with it (or never got it): its locks go at once; None if it
        had already ended."""
        return self._finish(lease_id, LoanEvent.END)

    def _finish(self, lease_id: bytes, event: LoanEvent) -> Lease | None:
        check_id(lease_id)
        if self.loans.live(lease_id) is not None:
            return self._end(lease_id, _RELEASED, event)
        if lease_id in self._ended or self.loans.locking(lease_id) is not None:
            return None
        raise LeaseUnknown(f"lease {lease_id.hex()} was never granted (or is long gone)")

    def settle(self, lease_id: bytes) -> Lease | None:
        """The reader of a lease released under it is quiet: drop its locks; None if none are held."""
        loan = self.loans.get(lease_id)
        if loan is None or loan.state is not LoanState.HELD:
            return None
        return self._unlock(lease_id, LoanEvent.SETTLE)

    def quiet(self, reader: int) -> list[Lease]:
        """Connection ``reader`` counts no read any more (its reader said goodbye): the leases held for it
        are settled (returned), those offered on it are as if never offered."""
        settled = [self._unlock(i, LoanEvent.SETTLE) for i in self.loans.read_by(LoanState.HELD, reader)]
        for lease_id in self.loans.read_by(LoanState.OFFERED, reader):
            self.loans.to(lease_id, LoanEvent.BYE)
        return settled

    def _unlock(self, lease_id: bytes, event: LoanEvent) -> Lease:
        """A held lease's record goes (``event``), and its locks with it."""
        loan = self.loans.all[lease_id]
        lease, locked = loan.lease, loan.locked
        assert lease is not None  # held
        self.loans.to(lease_id, event)
        for slots in locked:
            self.locks.unlock_slots(slots)
        return lease

    def expire(self, now: float) -> list[Lease]:
        """End every lease whose expiry is strictly before ``now``, oldest first; a held lease past
        its expiry is settled and listed too (its caller knows it released it)."""
        return [loan.lease for loan in self.expire_loans(now) if loan.lease is not None]

    def expire_loans(self, now: float) -> list[Loan]:
        """As ``expire``, each lease's record as it was before it expired (lent, offered or held)."""
        now = check_time("now", now)
        out = []
        while self._deadlines and self._deadlines[0][0] < now:
            entry = heapq.heappop(self._deadlines)
            if not self._current(entry):
                continue
            lease_id = entry[2]
            loan = self.loans.all[lease_id]
            out.append(replace(loan))
            if loan.state is LoanState.HELD:
                self._unlock(lease_id, LoanEvent.EXPIRE)
            else:
                self._end(lease_id, _EXPIRED, LoanEvent.EXPIRE)
        return out

    def leases_of(self, peer: str | None) -> list[Lease]:
        """Live leases offered to ``peer``."""
        peer = check_peer(peer)
        leases = (loan.lease for loan in self.loans.all.values() if loan.state in LIVE)
        return [lease for lease in leases if lease is not None and lease.peer == peer]

    def release_peer(self, peer: str | None) -> list[Lease]:
        """End every lease offered to ``peer`` (it died or disconnected), holding none."""
        return [self._end(lease.id, _RELEASED, LoanEvent.END) for lease in self.leases_of(peer)]

    @property
    def active_leases(self) -> int:
        """Leases holding locks (including any past expiry that ``expire`` has not yet ended, and
        released ones held for their reader)."""
        return len(self.loans.all) - len(self.loans.waiting)

    # ------------------------------------------------------------- helpers
    def _push(self, lease: Lease) -> None:
        self._seq += 1
        heapq.heappush(self._deadlines, (lease.expires_at, self._seq, lease.id))
        if len(self._deadlines) > 2 * self.active_leases + 64:  # a caller that never calls expire: drop stale
            self._deadlines = [e for e in self._deadlines if self._current(e)]
            heapq.heapify(self._deadlines)

    def _current(self, entry: tuple[float, int, bytes]) -> bool:
        """Whether a deadline entry is still a lease's expiry (not one released or renewed since)."""
        loan = self.loans.locking(entry[2])
        return loan is not None and loan.lease is not None and loan.lease.expires_at == entry[0]

    def _live_lease(self, lease_id: bytes) -> Lease | None:
        """The lease if it is live (lent or offered), even past its expiry."""
        loan = self.loans.live(lease_id)
        return None if loan is None else loan.lease

    def _lease(self, lease_id: bytes) -> Lease:
        """The live lease ``lease_id`` (it must be)."""
        lease = self._live_lease(lease_id)
        assert lease is not None
        return lease

    def _end(self, lease_id: bytes, why: str, event: LoanEvent) -> Lease:
        """End a live lease by ``event``: its locks go, unless the move holds it for its reader."""
        loan = self.loans.all[lease_id]
        lease, locked = loan.lease, loan.locked
        assert lease is not None  # live
        if self.loans.to(lease_id, event).state is not LoanState.HELD:
            for slots in locked:
                self.locks.unlock_slots(slots)
        key = (lease.request, lease.peer)
        if self._by_key.get(key) == lease_id:
            del self._by_key[key]
        self._uncount(lease.peer, lease_id)
        self._ended[lease_id] = why
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
        return lease
