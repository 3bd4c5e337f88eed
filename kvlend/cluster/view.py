"""``ClusterView``: the live ranks, rebuilt from an etcd snapshot and its watch events.

Pure: the registry shell feeds it what etcd said (a snapshot at a revision,
then every event after it) and the time; it answers who is alive, who can
exchange bytes with a given layout, and which prefill to send the next
request to.  Every change comes back as a ``Change`` so the shell can drop
links to ranks that left.  Events below the revision already applied are
ignored, and one at it is applied again (etcd gives every key one
transaction touches the same revision; a key changes once per revision,
so applying its event twice changes nothing), so a watch restarted from
``revision + 1`` after a snapshot misses nothing and counts nothing twice.

A record that does not decode (garbage, a lying capacity, a layout nobody
stored) is listed in ``rejected`` and changes nothing: a rank known before
keeps its last valid record, so a bad write over a live rank's key cannot
tear down its links (its publisher notices and puts its record back).  A
delete, which etcd does when the rank's lease ends, makes a rank leave, and
so does a record refused for longer than a grace (``expire_refused``): the
bad write took the key off the rank's lease, and a live publisher would
have put its own back long before.
Layouts are known by digest (``learn_layout``, fed by the shell, which
fetches them from etcd and which this checks against their digest).

With a ``RecordVerifier`` (the registry always passes one) a value counts
only if its rank signed it (``signing``): a forged, unsigned or wrongly
signed one is refused like garbage, and ``wanted_layout`` names no layout
for it, so nobody fetches what it points at.  The layouts kept are bounded:
at most ``MAX_LAYOUTS`` of them and ``MAX_LAYOUT_CACHE_BYTES`` encoded (about
four times that once decoded); past that, the ones no live rank uses go
first, and a layout that still does not fit is refused (its record with it)
until ranks leave.

Health: the shell reports when etcd stops answering (``degraded``) and when
it answers again; the ranks known meanwhile stay known, since a registry
outage is not evidence that any rank died.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction  # exact: floats tie loads near 2**40 apart
from typing import TYPE_CHECKING, Iterable, Mapping

from ..core.layout import PageLayout
from ..core.negotiate import negotiate
from ..errors import KvlendError, RegistryError
from .records import MAX_LAYOUT_BYTES, RankRecord, layout_digest, ranks_prefix, wanted_layout

if TYPE_CHECKING:  # the verifier is handed in: the view itself imports no crypto or TLS
    from .signing import RecordVerifier

JOINED, LEFT, UPDATED = "joined", "left", "updated"
MAX_LAYOUTS = 256  # layouts remembered (each rank's differs: its addresses), live ones first
MAX_LAYOUT_CACHE_BYTES = 32 << 20  # their encodings together: a reader's memory for layouts is ~4x this


@dataclass(frozen=True)
class Change:
    kind: str  # JOINED, LEFT or UPDATED
    record: RankRecord  # the new record (the last one known for LEFT)


class ClusterView:
    """The ranks under one registry prefix, as of ``revision``."""

    def __init__(self, prefix: str, verifier: RecordVerifier | None = None) -> None:
        """``verifier``: checks each value's signature first; without one (the view's own tests) values
        are taken as they are."""
        self.prefix = ranks_prefix(prefix)
        self.verifier = verifier
        self.revision = 0
        self._ranks: dict[str, RankRecord] = {}
        self.rejected: dict[str, str] = {}  # key -> why its value was refused
        self.degraded_since: float | None = None
        self.degraded_why = ""
        self._compatible: dict[tuple[bytes, bytes], bool] = {}  # (local, remote layout encoded) -> negotiates
        self._mine: tuple[PageLayout, bytes] | None = None  # the last local layout asked about, encoded
        self.layouts: dict[str, bytes] = {}  # digest -> layout encoding, checked
        self._refused: dict[str, float] = {}  # identity -> since when its key holds a refused value

    def learn_layout(self, digest: str, data: bytes, keep: Iterable[str] = ()) -> None:
        """Remember the layout named ``digest``: ``RegistryError`` unless ``data`` is what it names and fits.

        Past ``MAX_LAYOUTS`` or ``MAX_LAYOUT_CACHE_BYTES``, the ones no live rank uses are forgotten
        first, except ``keep`` (the others the caller fetched for the same records); the shell fetches
        any again.  One that still does not fit is refused."""
        if not isinstance(data, (bytes, bytearray)) or not 0 < len(data) <= MAX_LAYOUT_BYTES:
            raise RegistryError(f"layout {digest[:16]}: expected 1..{MAX_LAYOUT_BYTES} bytes")
        if layout_digest(bytes(data)) != digest:
            raise RegistryError(f"layout {digest[:16]}: the stored bytes do not hash to their digest")
        if not self.layout_fits(len(data)):
            self.make_room(keep)
            if not self.layout_fits(len(data)):
                raise RegistryError(f"layout {digest[:16]}: {len(self.layouts)} layouts of {self.layout_bytes} "
                                    f"bytes are in use, and this reader keeps at most {MAX_LAYOUTS} or "
                                    f"{MAX_LAYOUT_CACHE_BYTES} bytes")
        self.layouts[digest] = bytes(data)

    @property
    def layout_bytes(self) -> int:
        """The encoded size of the layouts kept."""
        return sum(map(len, self.layouts.values()))

    def layout_fits(self, size: int) -> bool:
        """Whether one more layout of ``size`` bytes fits the bounds as they stand."""
        return len(self.layouts) < MAX_LAYOUTS and self.layout_bytes + size <= MAX_LAYOUT_CACHE_BYTES

    def make_room(self, keep: Iterable[str] = ()) -> bool:
        """Forget the layouts no live rank uses (but ``keep``) if at a bound; whether another one fits now."""
        if not self.layout_fits(1):
            used = {r.layout_digest for r in self._ranks.values()} | set(keep)
            self.layouts = {d: v for d, v in self.layouts.items() if d in used}
        return self.layout_fits(1)

    def wanted_layout(self, value: bytes) -> str | None:
        """The layout digest a value names if it is worth fetching: unknown yet, and its record verified."""
        digest = wanted_layout(value)
        if digest is None or digest in self.layouts:
            return None
        if self.verifier is not None:
            try:
                self.verifier.verify(value)  # kept: the put that follows checks it again from the cache
            except RegistryError:
                return None
        return digest

    # ------------------------------------------------------------- feeding
    def reset(self, revision: int, items: Iterable[tuple[bytes, bytes]], now: float = 0.0) -> list[Change]:
        """Replace everything with a snapshot taken at ``revision``; the changes against what was known."""
        revision = _revision(revision)
        fresh: dict[str, RankRecord] = {}
        refused: dict[str, float] = {}
        self.rejected = {}
        for key, value in items:
            record = self._decode(key, value)
            if record is None:  # unreadable now: the last valid record, if any, still holds
                identity = self._identity(key)
                record = self._ranks.get(identity) if identity else None
                if record is not None:
                    refused[identity] = self._refused.get(identity, now)
            if record is not None:
                fresh[record.identity] = record
        self._refused = refused
        old, self._ranks = self._ranks, fresh
        self.revision = revision  # the watch resumes after it, even from a member that lags
        changes = [Change(LEFT, r) for i, r in old.items() if i not in fresh]
        for identity, record in fresh.items():
            before = old.get(identity)
            if before is None:
                changes.append(Change(JOINED, record))
            elif before != record:
                changes.append(Change(UPDATED, record))
        return changes

    def put(self, revision: int, key: bytes, value: bytes, now: float = 0.0) -> list[Change]:
        """A watch event: ``key`` was written at ``revision`` (seen at ``now``)."""
        if _revision(revision) < self.revision:
            return []
        self.revision = revision
        identity = self._identity(key)
        record = self._decode(key, value)
        before = self._ranks.get(identity) if identity else None
        if record is None:  # refused (listed in ``rejected``): the last valid record still holds
            if before is not None:
                self._refused.setdefault(identity, now)
            return []
        self._refused.pop(record.identity, None)
        self._ranks[record.identity] = record
        if before is None:
            return [Change(JOINED, record)]
        return [Change(UPDATED, record)] if before != record else []

    def delete(self, revision: int, key: bytes) -> list[Change]:
        """A watch event: ``key`` was deleted (lease expired or revoked) at ``revision``."""
        if _revision(revision) < self.revision:
            return []
        self.revision = revision
        self.rejected.pop(_shown(key), None)
        identity = self._identity(key)
        gone = self._ranks.pop(identity, None) if identity else None
        self._refused.pop(identity, None)
        return [Change(LEFT, gone)] if gone is not None else []

    def expire_refused(self, now: float, grace: float) -> list[Change]:
        """Ranks whose key has held a refused value for ``grace`` seconds leave (their key stays rejected)."""
        changes = []
        for identity, since in list(self._refused.items()):
            if now - since >= grace:
                del self._refused[identity]
                changes.append(Change(LEFT, self._ranks.pop(identity)))
        return changes

    def mark_degraded(self, now: float, why: str) -> None:
        if self.degraded_since is None:
            self.degraded_since = now
        self.degraded_why = why

    def mark_healthy(self) -> None:
        self.degraded_since, self.degraded_why = None, ""

    # ------------------------------------------------------------- queries
    @property
    def degraded(self) -> bool:
        return self.degraded_since is not None

    def ranks(self, role: str | None = None) -> list[RankRecord]:
        """Live ranks (of ``role``), by identity."""
        return sorted((r for r in self._ranks.values() if role is None or r.role == role), key=lambda r: r.identity)

    def get(self, identity: str) -> RankRecord | None:
        return self._ranks.get(identity)

    def compatible(self, layout: PageLayout, role: str = "prefill") -> list[RankRecord]:
        """Ranks of ``role`` whose layout ``negotiate`` accepts against ``layout`` (ours, the reader's)."""
        out = []
        if self._mine is None or self._mine[0] is not layout:  # one reader asks again and again (a router)
            self._mine = (layout, layout.encode())  # the id leaves out windows and sinks, which negotiate checks
        mine = self._mine[1]
        for record in self.ranks(role):
            if not record.layout:
                continue  # a router: nothing to exchange
            key = (mine, record.layout)
            ok = self._compatible.get(key)
            if ok is None:
                try:
                    negotiate(layout, record.page_layout)
                    ok = True
                except KvlendError:
                    ok = False
                if len(self._compatible) > 1024:
                    self._compatible.clear()
                self._compatible[key] = ok
            if ok:
                out.append(record)
        return out

    def pick(self, layout: PageLayout, routed: Mapping[str, int] | None = None,
             exclude: Iterable[str] = ()) -> RankRecord:
        """The compatible, healthy prefill with the most room: least (published load + ``routed`` to it
        since) per unit of capacity, ties by identity.  ``routed`` counts what the caller sent that the records may
        not show yet (etcd lags by an update interval).  ``RegistryError`` if none is live."""
        routed = routed or {}
        skip = set(exclude)
        live = [r for r in self.compatible(layout) if r.identity not in skip and r.healthy]
        if not live:
            known = [r.identity + ("" if r.healthy else " (unhealthy)") for r in self.ranks("prefill")]
            raise RegistryError(f"no live, healthy prefill rank is compatible with layout {layout.layout_id[:12]} "
                                f"(live prefills: {known or 'none'}; excluded: {sorted(skip) or 'none'})")
        return min(live, key=lambda r: (Fraction(r.load + routed.get(r.identity, 0), r.capacity), r.identity))

    # ------------------------------------------------------------- helpers
    def _identity(self, key: bytes) -> str | None:
        text = _text(key)
        if text is None or not text.startswith(self.prefix):
            return None
        return text[len(self.prefix):]

    def _decode(self, key: bytes, value: bytes) -> RankRecord | None:
        text = _shown(key)
        identity = self._identity(key)
        try:
            if identity is None:
                raise RegistryError(f"key is not under {self.prefix!r}")
            if self.verifier is not None:
                self.verifier.verify(value)
            record = RankRecord.decode(value, self.layouts)
            if record.identity != identity:
                raise RegistryError(f"record names {record.identity!r}, its key {identity!r}")
        except RegistryError as exc:
            self.rejected[text] = str(exc)
            return None
        self.rejected.pop(text, None)
        return record


def _text(key: bytes) -> str | None:
    try:
        return bytes(key).decode("utf-8")
    except (TypeError, UnicodeDecodeError):
        return None


def _shown(key: bytes) -> str:
    """How ``rejected`` names a key: its text, or its repr when it is not UTF-8."""
    text = _text(key)
    return text if text is not None else repr(key)


def _revision(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RegistryError(f"revision: expected an int >= 0, got {value!r}")
    return value
