"""The decode's fetches (``Fetches``, the one owner of each fetch's state): their reads, posted within
the read window, their completions, deadlines, failures and ends.

A failure first cancels the reads still in flight and waits until the backend reports each one
terminal: only then is the fetch ``failed`` and ``Abort`` sent, so neither side reuses pages a late
read could still write.  Closing a link is the session's (``close_link``, called back here when a
read fails with ``PeerLost`` or a cancelled fetch's reads will not go quiet).
"""

from __future__ import annotations

import heapq
import logging
from typing import Any, Callable, Iterator, Mapping

from ..core.negotiate import TransferPlan
from ..core.tcpwindow import ReadWindow, pieces
from ..core.text import printable
from ..core.tracker import DeliveryTracker
from ..errors import KvlendError, PeerLost, TransferCancelled, TransferTimeout, UsageError
from .actions import Cancel, FetchFinished, Post, Queue
from .config import NodeConfig
from .decode_link import Links, PrefillLink
from .fetch import Fetch, Work, clone_error, move, nbytes, plan_work
from .states import TERMINAL, FetchEvent, FetchState, LeaseEvent, LinkState
from .wire import Abort, Done, LeaseOffer

log = logging.getLogger("kvlend.session")

CloseLink = Callable[[int, KvlendError, float], None]


class Fetches(Mapping[int, Fetch]):
    """Every fetch not forgotten, by id (a read-only mapping), and what each has in flight."""

    def __init__(self, name: str, config: NodeConfig, tracker: DeliveryTracker, links: Links, queue: Queue,
                 close_link: CloseLink, read_window: int | None) -> None:
        self._name = name
        self._config = config
        self._tracker = tracker
        self._links = links
        self._queue = queue
        self._close_link = close_link
        self._fetches: dict[int, Fetch] = {}
        self._live: dict[bytes, Fetch] = {}  # fetches not finished, by lease (one at most per lease)
        self._on_link: dict[int, dict[int, Fetch]] = {}  # fetches not finished, by link and id
        self._tags: dict[bytes, tuple[int, int]] = {}  # tag -> (fetch id, chunk)
        self._window = ReadWindow(read_window)  # bytes in flight per link (tcp: core/tcpwindow.py)
        self._held: dict[bytes, Post] = {}  # posts waiting for room in the window, by tag
        self._pieces: dict[int, int] = {}  # chunk (seq) cut into pieces for the window -> pieces not yet landed
        self._timers: list[tuple[float, int]] = []  # (deadline or quiet_by, fetch id): a heap, stale ones skipped
        self._next = self._seq = 0

    def __getitem__(self, fetch_id: int) -> Fetch:
        return self._fetches[fetch_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._fetches)

    def __len__(self) -> int:
        return len(self._fetches)

    def __contains__(self, fetch_id: object) -> bool:  # the dict's, not a try of __getitem__: asked per read
        return fetch_id in self._fetches

    def get(self, fetch_id: int, default: None = None) -> Fetch | None:  # type: ignore[override]
        return self._fetches.get(fetch_id)

    # ------------------------------------------------------------- lookups
    @property
    def running(self) -> int:
        """Fetches not yet finished."""
        return len(self._live)

    def of_lease(self, lease: bytes) -> Fetch | None:
        """The fetch of ``lease`` not yet finished, if any."""
        return self._live.get(lease)

    def on(self, conn: int) -> list[Fetch]:
        """Fetches not finished over link ``conn``."""
        return list(self._on_link.get(conn, {}).values())

    def of(self, conn: int, lease: bytes, state: FetchState) -> Fetch | None:
        """The fetch of ``lease`` on link ``conn`` if it is in ``state`` (one not finished)."""
        fetch = self._live.get(lease)
        return fetch if fetch is not None and fetch.link == conn and fetch.state is state else None

    def waiting(self, link: PrefillLink) -> list[Fetch]:
        """Fetches whose claim waits for ``link`` to be ready (claiming, nothing sent yet), oldest first."""
        return [f for f in self._on_link.get(link.id, {}).values()
                if f.state is FetchState.CLAIMING and f.claimed_at is None]

    def check_not_fetching(self, lease: bytes) -> None:
        if lease in self._live:
            raise UsageError(f"lease {lease.hex()} is already being fetched")

    def forget(self, fetch_id: int) -> None:
        """Drop a finished fetch's record (the engine has taken its result)."""
        fetch = self._fetches.get(fetch_id)
        if fetch is not None and fetch.done:
            del self._fetches[fetch_id]

    # ----------------------------------------------------------- beginning
    def new(self, conn: int, lease: bytes, num_tokens: int, dst: Mapping[str, Any], resume_from: int, now: float,
            timeout: float, start: FetchEvent) -> Fetch:
        self._next += 1
        fetch = Fetch(self._next, conn, lease, num_tokens, dst, resume_from, now, now + timeout, bound=resume_from)
        self._fetches[fetch.id] = fetch
        self._live[lease] = fetch
        self._on_link.setdefault(conn, {})[fetch.id] = fetch
        heapq.heappush(self._timers, (fetch.deadline, fetch.id))
        self.move(fetch, start)
        return fetch

    def move(self, fetch: Fetch, event: FetchEvent) -> None:
        """A fetch's move (``fetch.move``); one that finishes leaves the indexes of fetches not finished."""
        move(fetch, event)
        if fetch.state in TERMINAL:
            self._unindex(fetch)

    def _unindex(self, fetch: Fetch) -> None:
        if self._live.get(fetch.lease) is fetch:
            del self._live[fetch.lease]
        on_link = self._on_link.get(fetch.link)
        if on_link is not None:
            on_link.pop(fetch.id, None)
            if not on_link:
                del self._on_link[fetch.link]

    def work(self, plan: TransferPlan, offer: LeaseOffer, dst: Mapping[str, Any], resume_from: int,
             done_rows: Mapping[str, Any] | None = None) -> Work:
        """``plan_work`` in this session's chunks: computed before any state changes, so a bad table fails first."""
        return plan_work(plan, offer, dst, resume_from, self._config.chunk_pages, done_rows)

    def begin(self, fetch: Fetch, offer: LeaseOffer, work: Work, now: float, created: bool) -> None:
        """Track the fetch and post its chunks; all or nothing.

        On failure everything is undone and the exception propagates; a fetch ``created`` for
        this call is forgotten too (its caller never saw it).
        """
        fetch.offer, fetch.request = offer, offer.request
        try:
            self.post(fetch, work, now, begin=True)
        except BaseException:
            self._forget_tracking(fetch)
            fetch.bytes = fetch.descriptors = 0
            fetch.offer = None
            fetch.read_rows = {}
            if created:
                del self._fetches[fetch.id]
                self._unindex(fetch)
            raise

    def post(self, fetch: Fetch, work: Work, now: float, begin: bool) -> None:
        """Post ``work``'s chunks (tracking the fetch first if ``begin``); the posts are all or nothing."""
        assert fetch.offer is not None  # set by ``begin``
        chunks, kept, needed, read = work
        actions = self._queue.actions
        mark = len(actions)
        tags: list[bytes] = []
        counted = fetch.bytes, fetch.descriptors
        try:
            if begin:
                self._tracker.begin(fetch.key, fetch.offer.num_tokens, needed)
            else:
                self._tracker.need(fetch.key, needed)
            if kept:
                self._seq += 1  # read by an earlier lease, verified then
                self._tracker.post(fetch.key, f"resumed-{self._seq}", kept)
                self._tracker.done(fetch.key, f"resumed-{self._seq}")
            limit = self._window.limit if self._links[fetch.link].windowed else None  # None: no window applies
            for batches, local in chunks:
                self._seq += 1
                self._tracker.post(fetch.key, self._seq, local)
                size = nbytes(batches)
                parts = pieces(batches, limit) if limit is not None and size > limit else [batches]
                if len(parts) > 1:
                    self._pieces[self._seq] = len(parts)
                for i, part in enumerate(parts):
                    tag = f"{self._name}:{self._seq}{f'.{i}' if len(parts) > 1 else ''}".encode()
                    tags.append(tag)
                    post = Post(fetch.link, part, tag)
                    if limit is None or self._window.submit(fetch.link, tag, nbytes(part)):
                        actions.append(post)
                    else:
                        self._held[tag] = post
                    self._tags[tag] = (fetch.id, self._seq)
                fetch.bytes += size
                fetch.descriptors += sum(b.count for b in batches)
        except BaseException:
            del actions[mark:]
            for tag in tags:
                entry = self._tags.pop(tag, None)
                if entry is not None:
                    self._pieces.pop(entry[1], None)
                self._window.end(tag)
                self._held.pop(tag, None)
            fetch.bytes, fetch.descriptors = counted
            raise
        fetch.tags.update(tags)
        fetch.read_rows = read
        if fetch.posted is None:
            fetch.posted = now
        if fetch.final_at is None and fetch.offer.final:
            fetch.final_at, fetch.early_bytes = now, counted[0]
        if now < fetch.sure_until:
            fetch.bound = max(fetch.resume_from, self._tracker.bound(fetch.key))
        self._progress(fetch, now)

    # ------------------------------------------------------------- reads
    def completed(self, tag: bytes, error: KvlendError | None, now: float) -> None:
        """The backend is done with read ``tag`` (terminal: it will not write again)."""
        self._window.end(tag)
        entry = self._tags.pop(tag, None)
        if entry is None:
            return
        fetch = self._fetches.get(entry[0])
        if fetch is None:
            return
        fetch.tags.discard(tag)
        whole = self._whole(entry[1], error)
        if fetch.state is FetchState.READING and whole:
            if error is None:
                if fetch.first_landed_at is None:
                    fetch.first_landed_at = now
                self._tracker.done(fetch.key, entry[1])
                if now < fetch.sure_until:
                    fetch.bound = max(fetch.resume_from, self._tracker.bound(fetch.key))
            else:
                self._tracker.fail(fetch.key, entry[1], error)
                if isinstance(error, PeerLost) and fetch.link in self._links:
                    self._close_link(fetch.link, error, now)
                else:
                    self.fail(fetch, error, now)
        self._progress(fetch, now)

    def _whole(self, seq: int, error: KvlendError | None) -> bool:
        """Whether chunk ``seq`` is settled by this completion: it was posted whole, or this was its last
        piece to land, or the first of its pieces to fail (the others then count for nothing)."""
        left = self._pieces.get(seq)
        if left is None:
            return True
        if error is None and left > 1:
            self._pieces[seq] = left - 1
            return False
        del self._pieces[seq]
        return True

    def admit(self) -> list[Post]:
        """The posts the read window admits now (a fetch failing withdrew its waiting reads first)."""
        return [self._held.pop(tag) for tag in self._window.admit()]

    @property
    def reads_waiting(self) -> int:
        """Reads held back by the tcp read window."""
        return len(self._held)

    # ---------------------------------------------------------------- time
    def tick(self, now: float) -> None:
        """Each fetch whose deadline passed fails; a cancelled one whose reads will not go quiet by its
        ``quiet_by`` has its link torn down."""
        while self._timers and self._timers[0][0] < now:
            fetch = self._fetches.get(heapq.heappop(self._timers)[1])
            if fetch is None or fetch.done:
                continue
            if fetch.state is FetchState.CANCELLING and now > fetch.quiet_by and fetch.link in self._links:
                self._close_link(fetch.link, PeerLost(
                    f"reads of request {fetch.request} still in flight {self._config.cancel_grace:.3g} s after "
                    "cancelling; tearing the link down to stop them"), now)
            elif not fetch.done and fetch.state is not FetchState.CANCELLING and now > fetch.deadline:
                what = "no done ack" if fetch.state is FetchState.ACKING else "reads not finished"
                self.fail(fetch, TransferTimeout(
                    f"request {fetch.request or fetch.lease.hex()}: {what} within "
                    f"{fetch.deadline - fetch.started:.3g} s"), now)

    def next_timer(self) -> float | None:
        """When ``tick`` next has work (None: no timer pending)."""
        timers = self._timers
        while timers and not self._timer_due(*timers[0]):
            heapq.heappop(timers)
        return timers[0][0] if timers else None

    def _timer_due(self, at: float, fetch_id: int) -> bool:
        """Whether ``tick`` has work for this fetch at ``at``: its deadline while it runs, its quiet_by
        while it cancels on a live link (once the link is torn down nothing is left to escalate)."""
        f = self._fetches.get(fetch_id)
        if f is None or f.done:
            return False
        if f.state is FetchState.CANCELLING:
            return at == f.quiet_by and f.link in self._links
        return at == f.deadline

    # ---------------------------------------------------------------- ends
    def _progress(self, fetch: Fetch, now: float) -> None:
        """Move a fetch on once its reads allow: done if they all landed in the lease's life and cover it
        (its ``Done`` rides the link's next heartbeat), else send ``Done`` and wait for the ack; or finish a
        failure when quiet."""
        if fetch.tags:
            return
        if fetch.state is FetchState.READING:
            assert fetch.offer is not None  # reading one
            if not fetch.offer.final:
                return  # a progressive lease: the prefill has more to lend (``Extend``)
            if fetch.landed is None:
                fetch.landed = now
            if not fetch.confirmed:
                return  # read ahead: the claim's answer says whether they count (``confirmed``)
            reader = self._links[fetch.link]
            bound = self._tracker.bound(fetch.key)
            if now < fetch.sure_until and bound == fetch.num_tokens:
                reader.done.append(fetch.lease)  # every read landed in the lease's life: Done is bookkeeping
                self.finish(fetch, FetchEvent.USABLE, None, now)
                return
            self.move(fetch, FetchEvent.LAND)
            assert reader.conn is not None  # a fetch reads over a ready link
            reader.conn.send(Done(fetch.lease, bound))
        elif fetch.state is FetchState.CANCELLING:
            link = self._links.get(fetch.link)
            if link is not None and link.state is LinkState.READY and fetch.offer is not None:
                assert link.conn is not None and fetch.error is not None  # ready; set as it failed
                link.conn.send(Abort.of(fetch.lease, fetch.error))
            self.finish(fetch, FetchEvent.QUIET, fetch.error, now)

    def confirmed(self, fetch: Fetch, now: float) -> None:
        """The claim's answer confirmed reads posted ahead: a fetch whose reads all landed moves on."""
        self._progress(fetch, now)

    def fail(self, fetch: Fetch, error: KvlendError, now: float, tell_prefill: bool = True) -> None:
        """Stop a fetch: cancel what is in flight; it finishes once quiet."""
        if fetch.done or fetch.state is FetchState.CANCELLING:
            return
        link = self._links.get(fetch.link)
        if fetch.state is FetchState.CLAIMING:
            if tell_prefill and link is not None and link.state is LinkState.READY and fetch.claimed_at is not None:
                assert link.conn is not None  # ready
                link.conn.send(Abort.of(fetch.lease, error))
                link.lease_to(fetch.lease, LeaseEvent.ABANDON)
            self.finish(fetch, FetchEvent.FAIL, error, now)
            return
        if not fetch.confirmed and link is not None:
            link.lease_to(fetch.lease, LeaseEvent.ABANDON)  # the claim's answer may still come: not an offer to us
        if fetch.state is FetchState.ACKING:  # every read is terminal; the prefill releases on our done
            self.finish(fetch, FetchEvent.FAIL, error, now)
            return
        fetch.error = error
        self.move(fetch, FetchEvent.FAIL)
        fetch.quiet_by = now + self._config.cancel_grace
        heapq.heappush(self._timers, (fetch.quiet_by, fetch.id))
        self._tracker.abort(fetch.key)
        for tag in sorted(fetch.tags):
            if self._window.waiting(tag):  # never posted: nothing to stop
                self._window.end(tag)
                self._pieces.pop(self._tags[tag][1], None)
                del self._held[tag], self._tags[tag]
                fetch.tags.discard(tag)
            else:
                self._queue.actions.append(Cancel(tag))
        if not tell_prefill:
            fetch.offer = None  # the prefill already ended the lease: no Abort
        self._progress(fetch, now)

    def link_closed(self, conn: int, error: KvlendError, now: float) -> bool:
        """Link ``conn`` closed (it is out of ``Links``): its fetches fail, each with its own copy of ``error``.
        Whether it had any."""
        on_link = list(self._on_link.get(conn, {}).values())
        for fetch in on_link:
            if not fetch.done:
                self.fail(fetch, clone_error(error), now, tell_prefill=False)
        return bool(on_link)

    def finish(self, fetch: Fetch, event: FetchEvent, error: KvlendError | None, now: float) -> None:
        self.move(fetch, event)
        fetch.finished = now
        if error is None:
            fetch.bound = fetch.num_tokens
            fetch.usable_at = now
        else:
            error.request, error.bound = fetch.request, fetch.bound
            level = logging.INFO if isinstance(error, TransferCancelled) else logging.WARNING
            log.log(level, "request %s (lease %s) failed at bound %d: %s", printable(fetch.request or "?"),
                    fetch.lease.hex(), fetch.bound, printable(error))
        fetch.error = error
        self._forget_tracking(fetch)
        self._queue.events.append(FetchFinished(fetch))

    def _forget_tracking(self, fetch: Fetch) -> None:
        try:
            self._tracker.abort(fetch.key)
            self._tracker.finish(fetch.key)
        except KvlendError:
            pass  # never begun
