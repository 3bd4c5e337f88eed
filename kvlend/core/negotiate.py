"""negotiate(local, remote): how a decode rank reads a prefill rank's pages, or why it cannot.

``local`` is the decode rank (reader, destination) and ``remote`` the prefill
rank (lender, source).  Buffers are matched by ``(layer, role)``.  Equal
layout ids give an *identity* plan (whole page slots copy 1:1); otherwise a
*mapped* plan covers two differences, each by an integer factor:

* tensor-parallel degree, for INDEXED buffers in HND order: a head slice of an
  HND page is one contiguous run per K/V part, so decode rank ``r`` reads its
  heads from the prefill rank(s) holding them.  With more prefill than decode
  ranks, ``negotiate`` is called once per prefill rank and each lands its heads
  at their offset in the decode page.  REPLICATED buffers are read once: only
  in the plan with the *first* source rank, ``r * tp_prefill // tp_decode``;
  the other per-rank plans list them in ``read_elsewhere``.
* tokens per page: a remote page spans ``local_per_remote`` local pages, or
  ``remote_per_local`` remote pages fill one local page.  Recurrent state is
  one row per request and is copied whole whatever the page size.

A ``KV`` buffer holds its K part then its V part, each ``heads x tokens x
bytes_per_head`` in the buffer's head order; a ``HEAD_KV`` buffer holds each
head's K and V together (``bytes_per_head`` counts both, the engine orders
them), so it is split by heads only, never by tokens.  Everything else that differs in
bytes is refused with a ``LayoutMismatch`` naming every field at once: wrong
bytes are worse than no bytes.  Group and region names and capacities never
block a plan.

What each side reads must agree too.  A lease holds the pages a decoder at
``num_tokens`` reads by the *remote* layout (sinks and read window), and the
lender never lends past the remote kept window, so a remote group whose read
window is the whole kept window (full attention) lends every page and covers
anything.  Otherwise the local group must find among the lent pages, whole,
every page it reads by the *local* layout, at every ``num_tokens``.  With
``W``/``S``/``t`` the read window (tokens), sink pages and tokens per page of
each side, that holds exactly when

* ``W_remote - W_local >= max(0, t_local - t_remote)``: a big local page
  starts its window up to ``t_local - t_remote`` tokens before a small
  remote page does (refused as ``groups[name].read_window``), and
* ``S_local * t_local <= S_remote * t_remote``: sink tokens
  (``groups[name].sinks``).

Recurrent groups are one row, read whole.  A lease that holds more than the
local group reads is fine: ``fetchplan`` reads only what the local group needs.

A peer chooses the layout it claims, and a plan's size grows with the page
ratio (and the heads sliced per page), so ``negotiate`` caps what it will
compute: a tokens-per-page ratio above ``max_page_ratio``, or more than
``max_pieces`` pieces (counted from the layouts before any is built, before
merging), is refused at once with a ``NegotiationLimit`` (a ``LayoutMismatch``
and a ``QuotaExceeded`` naming the limit), alone, without the other checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterator, Mapping

from ..errors import LayoutMismatch, NegotiationLimit
from .layout import BufferDesc, HeadOrder, PageLayout, Role, Sharding

IDENTITY = "identity"
MAPPED = "mapped"
MAX_PAGE_RATIO = 64  # tokens-per-page ratio negotiate maps by default (e.g. 1 vs 64, 16 vs 1024)
MAX_PIECES = 1 << 18  # pieces per plan by default: 128 layers x K and V x ratio 64 x 16 heads


@dataclass(frozen=True)
class Piece:
    """Bytes of one remote buffer copied per page: slot offset -> slot offset.

    ``sub`` is the local page inside a remote page's span when
    ``local_per_remote > 1`` (local page = remote page * ratio + sub), the
    phase of the remote pages it applies to when ``remote_per_local > 1``
    (remote page % ratio == sub, local page = remote page // ratio), else 0.
    """

    buffer: str  # remote buffer name: what a NAMED selection picks
    src_offset: int
    dst_offset: int
    length: int
    sub: int = 0


@dataclass(frozen=True)
class RegionPair:
    """What moves from one remote region into one local region for one group pair.

    ``whole_slot`` (identity plans, regions holding one group): an ALL
    selection may copy the whole page stride instead of the pieces.
    """

    remote_region: str
    local_region: str
    remote_group: str
    local_group: str
    remote_per_local: int
    local_per_remote: int
    pieces: tuple[Piece, ...]
    whole_slot: bool = False


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """The result of ``negotiate``: which remote bytes land where in local slots.

    ``group_map`` maps each remote group this plan reads to its local group;
    ``uncovered`` lists local layers no remote buffer supplies (pipeline sizes
    differ); ``read_elsewhere`` the remote REPLICATED buffers another prefill
    rank's plan reads.
    """

    kind: str
    local: PageLayout
    remote: PageLayout
    group_map: Mapping[str, str]
    pairs: tuple[RegionPair, ...]
    uncovered: tuple[int, ...] = ()
    read_elsewhere: tuple[str, ...] = ()

    @property
    def local_id(self) -> str:
        return self.local.layout_id

    @property
    def remote_id(self) -> str:
        return self.remote.layout_id

    def summary(self) -> str:
        lr, rr = self.local.replica, self.remote.replica
        buffers = {p.buffer for pair in self.pairs for p in pair.pieces}
        lines = [
            f"{self.kind} plan: local {self.local_id[:12]} <- remote {self.remote_id[:12]}",
            f"  tp {lr.tp_size} rank {lr.tp_rank} <- tp {rr.tp_size} rank {rr.tp_rank}; "
            f"tokens/page {self.local.tokens_per_page} <- {self.remote.tokens_per_page}",
            f"  {len(buffers)} buffers in {len(self.pairs)} region pairs, "
            f"{sum(len(p.pieces) for p in self.pairs)} pieces",
            "  groups: " + ", ".join(f"{lg} <- {rg}" for rg, lg in self.group_map.items()),
        ]
        if self.uncovered:
            lines.append(f"  uncovered local layers: {list(self.uncovered)}")
        if self.read_elsewhere:
            lines.append(f"  replicated buffers read from another prefill rank: {list(self.read_elsewhere)}")
        return "\n".join(lines)


def negotiate(local: PageLayout, remote: PageLayout, *, max_page_ratio: int = MAX_PAGE_RATIO,
              max_pieces: int = MAX_PIECES) -> TransferPlan:
    """Derive the plan for decode ``local`` reading prefill ``remote``, or raise ``LayoutMismatch``
    (``NegotiationLimit`` past ``max_page_ratio`` or ``max_pieces``: see the module doc)."""
    for name, value in (("max_page_ratio", max_page_ratio), ("max_pieces", max_pieces)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
    return _Negotiation(local, remote, max_page_ratio, max_pieces).plan()


@dataclass
class _Negotiation:
    local: PageLayout
    remote: PageLayout
    max_page_ratio: int = MAX_PAGE_RATIO
    max_pieces: int = MAX_PIECES
    problems: list[tuple[str, object, object, str]] = field(default_factory=list)

    def refuse(self, name: str, local_value: object, remote_value: object, why: str) -> None:
        self.problems.append((name, local_value, remote_value, why))

    def plan(self) -> TransferPlan:
        identity = self.local.layout_id == self.remote.layout_id
        ratio = (1, 1) if identity else self._page_ratio()
        sources = self._tp_sources()
        if not identity:
            if self.local.dtype != self.remote.dtype:
                self.refuse("dtype", self.local.dtype, self.remote.dtype, "element types differ")
            if self.local.scope != self.remote.scope:
                self.refuse("scope", self.local.scope, self.remote.scope,
                            _scopes_differ(self.local.scope, self.remote.scope))
        matched, uncovered, elsewhere = self._match(ratio, sources)
        group_map = self._group_map(matched)
        self._check_reads()
        if not matched and not self.problems:
            lr, rr = self.local.replica, self.remote.replica
            if elsewhere:
                self.refuse("replica.tp_rank", lr.tp_rank, rr.tp_rank,
                            "this pair exchanges nothing: its replicated buffers are read from "
                            f"prefill rank {sources[0]}")
            else:
                self.refuse("replica.pp_rank", lr.pp_rank, rr.pp_rank, "the two ranks hold no layers in common")
        if self.problems:
            raise LayoutMismatch(self.problems)
        count = sum(job.count for _, _, job in matched)
        if count > self.max_pieces:
            raise NegotiationLimit("max_pieces", count, self.max_pieces, "pieces", None, None,
                                   "mapping these layouts needs pieces:")
        built = [(lb, rb, job.build()) for lb, rb, job in matched]
        return TransferPlan(
            kind=IDENTITY if identity else MAPPED, local=self.local, remote=self.remote,
            group_map=MappingProxyType(group_map), pairs=_pairs(self.local, built, ratio, identity),
            uncovered=tuple(sorted(uncovered)), read_elsewhere=tuple(sorted(elsewhere)),
        )

    # ------------------------------------------------------------ global checks
    def _page_ratio(self) -> tuple[int, int]:
        """(remote pages per local page, local pages per remote page); one of them is 1."""
        tl, tr = self.local.tokens_per_page, self.remote.tokens_per_page
        if tl == tr or all(b.recurrent for b in self.local.buffers):
            return 1, 1
        ratio = max(tl, tr) // min(tl, tr)
        if ratio > self.max_page_ratio and max(tl, tr) % min(tl, tr) == 0:
            raise NegotiationLimit("max_page_ratio", ratio, self.max_page_ratio, "tokens_per_page", tl, tr,
                                   "a tokens-per-page ratio of")
        if tr % tl == 0:
            return 1, tr // tl
        if tl % tr == 0:
            return tl // tr, 1
        self.refuse("tokens_per_page", tl, tr, "neither is an integer multiple of the other")
        return 1, 1

    def _tp_sources(self) -> range:
        """The prefill tp ranks whose heads decode rank ``tp_rank`` needs (empty after a refusal)."""
        lr, rr = self.local.replica, self.remote.replica
        tl, tr = lr.tp_size, rr.tp_size
        if tl % tr and tr % tl:
            self.refuse("replica.tp_size", tl, tr, "tensor-parallel degrees differ by a non-integer factor")
            return range(0)
        first = lr.tp_rank * tr // tl
        sources = range(first, first + max(1, tr // tl))
        if rr.tp_rank not in sources:
            self.refuse("replica.tp_rank", lr.tp_rank, rr.tp_rank,
                        f"decode rank {lr.tp_rank} of tp {tl} reads only prefill ranks {list(sources)} of tp {tr}")
            return range(0)
        return sources

    def _check_reads(self) -> None:
        """Refuse group pairs where some lease would lack pages the local group reads (module doc).

        Pairs come from the buffers' (layer, role), so they are checked even after other refusals.
        """
        tl, tr = self.local.tokens_per_page, self.remote.tokens_per_page
        if tl % tr and tr % tl:
            return  # refused as tokens_per_page
        remote_group = {b.identity.key: b.group for b in self.remote.buffers}
        pairs = dict.fromkeys((remote_group[b.identity.key], b.group) for b in self.local.buffers
                              if b.identity.key in remote_group)
        for rg, lg in pairs:
            local, remote = self.local.groups[lg], self.remote.groups[rg]
            if local.recurrent or remote.read_window >= self.remote.kept_window:
                continue  # a lease never outgrows the kept window, so such a group lends every page
            need = local.read_window + max(0, tl - tr)
            if remote.read_window < need:
                self.refuse(f"groups[{lg!r}].read_window", local.read_window, remote.read_window,
                            f"remote group {rg!r} lends a {remote.read_window}-token window; reading "
                            f"{local.read_window} tokens{self._kept(self.local, local.read_window)} in pages of "
                            f"{tl} from pages of {tr} needs at least {need}")
            if local.sinks * tl > remote.sinks * tr:
                self.refuse(f"groups[{lg!r}].sinks", local.sinks, remote.sinks,
                            f"local group reads {local.sinks} sink page(s) of {tl} tokens ({local.sinks * tl} tokens), "
                            f"remote group {rg!r} lends {remote.sinks} of {tr} ({remote.sinks * tr} tokens)")

    @staticmethod
    def _kept(layout: PageLayout, window: int) -> str:
        return " (its kept window)" if window == layout.kept_window else ""

    # --------------------------------------------------------- buffer matching
    def _match(self, ratio: tuple[int, int], sources: range) -> tuple[list[_Matched], set[int], list[str]]:
        remote_by_key = {b.identity.key: b for b in self.remote.buffers}
        local_keys = {b.identity.key for b in self.local.buffers}
        pp_differs = self.local.replica.pp_size != self.remote.replica.pp_size
        matched: list[_Matched] = []
        uncovered: set[int] = set()
        elsewhere: list[str] = []
        for lb in self.local.buffers:
            rb = remote_by_key.get(lb.identity.key)
            if rb is None:
                if pp_differs:
                    uncovered.add(lb.identity.layer)
                else:
                    self._refuse_missing(lb)
                continue
            pieces = self._pieces(lb, rb, ratio, sources)
            if pieces is None:
                elsewhere.append(rb.name)
            elif isinstance(pieces, _Job):  # not [] (refused)
                matched.append((lb, rb, pieces))
        if not pp_differs:
            for rb in self.remote.buffers:
                if rb.identity.key not in local_keys:
                    self.refuse(_where(rb), None, rb.name,
                                "the decode rank has no buffer for this remote (layer, role)")
        return matched, uncovered, elsewhere

    def _refuse_missing(self, lb: BufferDesc) -> None:
        layer = lb.identity.layer
        roles = sorted(b.identity.role.value for b in self.remote.buffers if b.identity.layer == layer)
        if roles:
            self.refuse(f"{_where(lb)}.identity.role", lb.identity.role.value, roles,
                        f"remote layer {layer} has other roles")
        else:
            self.refuse(_where(lb), lb.name, None, "no remote buffer holds this (layer, role)")

    def _pieces(self, lb: BufferDesc, rb: BufferDesc, ratio: tuple[int, int], sources: range) -> _Job | list | None:
        """How to build the checked pieces of one buffer pair; [] after a refusal, None when another rank
        supplies it."""
        where = _where(lb)
        lrep, rrep = self.local.replica, self.remote.replica
        tp_differs = lrep.tp_size != rrep.tp_size
        m, s = (1, 1) if lb.recurrent else ratio
        parts = 2 if lb.identity.role is Role.KV else 1
        tl, tr = (1, 1) if lb.recurrent else (self.local.tokens_per_page, self.remote.tokens_per_page)
        if lb.identity.role is Role.HEAD_KV and tl != tr:
            self.refuse(f"{where}.tokens_per_page", tl, tr,
                        "a HEAD_KV page orders each head's bytes as its engine's kernel does: it moves whole")
            return []
        gl, gr = lb.geometry, rb.geometry
        if (gl is None) != (gr is None):
            self.refuse(f"{where}.geometry", gl, gr, "only one side describes the heads of this buffer")
            return []
        if gl is None or gr is None:
            if tp_differs:
                self.refuse(f"{where}.geometry", None, None,
                            "tensor-parallel degrees differ and the buffer has no head geometry to split")
            per_l, per_r = divmod(lb.page_bytes, parts * tl), divmod(rb.page_bytes, parts * tr)
            if per_l[1] or per_r[1] or per_l[0] != per_r[0]:
                self.refuse(f"{where}.page_bytes", lb.page_bytes, rb.page_bytes,
                            f"bytes per token differ (tokens per page {tl} vs {tr})")
            if self.problems:
                return []
            # Without geometry a page is opaque token-major bytes: one "head" per token.
            return _Job((lb, rb, HeadOrder.NHD, parts, (1, 1), per_l[0], (0, 0, 1), (tr, tl), (m, s)))
        if gl.bytes_per_head != gr.bytes_per_head:
            self.refuse(f"{where}.geometry.bytes_per_head", gl.bytes_per_head, gr.bytes_per_head,
                        "element types differ" if self.local.dtype != self.remote.dtype else "head dimension differs")
        if gl.sharding is not gr.sharding:
            self.refuse(f"{where}.geometry.sharding", gl.sharding.value, gr.sharding.value,
                        "heads are split differently")
        if gl.order is not gr.order:
            self.refuse(f"{where}.geometry.order", gl.order.value, gr.order.value,
                        "pages hold heads in a different order")
        sliced = tp_differs and gl.sharding is Sharding.INDEXED and gr.sharding is Sharding.INDEXED
        if sliced:
            if gl.order is HeadOrder.NHD and gr.order is HeadOrder.NHD:
                self.refuse(f"{where}.geometry.order", "NHD", "NHD",
                            f"tp {lrep.tp_size} vs {rrep.tp_size} needs head slices, which are contiguous only in HND")
            if gl.heads * lrep.tp_size != gr.heads * rrep.tp_size:
                self.refuse(f"{where}.geometry.heads", gl.heads, gr.heads,
                            f"total heads differ: {gl.heads} x tp {lrep.tp_size} vs {gr.heads} x tp {rrep.tp_size}")
        elif gl.heads != gr.heads:
            self.refuse(f"{where}.geometry.heads", gl.heads, gr.heads, "head counts differ")
        if self.problems:
            return []
        if gl.sharding is Sharding.REPLICATED and rrep.tp_rank != sources[0]:
            return None
        if sliced:
            g0 = max(lrep.tp_rank * gl.heads, rrep.tp_rank * gr.heads)
            g1 = min((lrep.tp_rank + 1) * gl.heads, (rrep.tp_rank + 1) * gr.heads)
            heads = (g0 - rrep.tp_rank * gr.heads, g0 - lrep.tp_rank * gl.heads, g1 - g0)
        else:
            heads = (0, 0, gl.heads)
        return _Job((lb, rb, gl.order, parts, (gr.heads, gl.heads), gl.bytes_per_head, heads, (tr, tl), (m, s)))

    def _group_map(self, matched: list[_Matched]) -> dict[str, str]:
        """Remote group -> local group; refuses a group whose buffers land in two groups."""
        forward: dict[str, str] = {}
        backward: dict[str, str] = {}
        for lb, rb, _ in matched:
            lg, rg = forward.setdefault(rb.group, lb.group), backward.setdefault(lb.group, rb.group)
            if lg != lb.group or rg != rb.group:
                self.refuse(f"{_where(lb)}.group", lb.group, rb.group,
                            f"groups must correspond one to one: remote {rb.group!r} already maps to local "
                            f"{lg!r} and local {lb.group!r} to remote {rg!r}")
        return forward


def _pairs(local: PageLayout, matched: list[tuple[BufferDesc, BufferDesc, list[Piece]]], ratio: tuple[int, int],
           identity: bool) -> tuple[RegionPair, ...]:
    """Group the pieces by (remote region, local region, remote group, local group), in local order."""
    tables: dict[tuple[str, str, str, str], list[Piece]] = {}
    ratios: dict[tuple[str, str, str, str], tuple[int, int]] = {}
    for lb, rb, pieces in matched:
        key = (rb.region, lb.region, rb.group, lb.group)
        tables.setdefault(key, []).extend(pieces)
        ratios[key] = (1, 1) if lb.recurrent else ratio
    groups_of: dict[str, set[str]] = {}
    for b in local.buffers:
        groups_of.setdefault(b.region, set()).add(b.group)
    return tuple(
        RegionPair(*key, *ratios[key], tuple(sorted(pieces, key=lambda p: (p.sub, p.src_offset))),
                   whole_slot=identity and len(groups_of[key[1]]) == 1)
        for key, pieces in tables.items()
    )


def _scopes_differ(local: str, remote: str) -> str:
    """Why two scopes are refused, naming only what differs: a scope is the engine's own string, but
    one of '/'-separated parts (the vLLM connector's: platform, kernel, dtype, block size, cache
    layout, model) shows which parts."""
    a, b = local.split("/"), remote.split("/")
    if len(a) == len(b) > 1:
        parts = ", ".join(f"{x!r} vs {y!r}" for x, y in zip(a, b) if x != y)
        return f"the engines differ in {parts}: the bytes would mean something else"
    return "the engines' scopes differ: the bytes would mean something else"


def _where(b: BufferDesc) -> str:
    layer, role = b.identity.key
    return f"buffer({layer},{role})"


@dataclass(frozen=True, eq=False)
class _Job:
    """The arguments of one ``_slices`` call, and how many pieces it makes before merging."""

    args: tuple

    @property
    def count(self) -> int:
        _, _, order, parts, (hr, hl), _, (_, _, count), (tr, tl), (m, s) = self.args
        spans, n = (s, tl) if s > 1 else (m, tr) if m > 1 else (1, tr)
        if order is HeadOrder.HND:
            per_span = 1 if n == tr == tl else count
        else:
            per_span = 1 if count == hr == hl else n
        return parts * spans * per_span

    def build(self) -> list[Piece]:
        return _slices(*self.args)


_Matched = tuple[BufferDesc, BufferDesc, _Job]  # a local buffer, the remote one it reads, and how


def _slices(lb: BufferDesc, rb: BufferDesc, order: HeadOrder, parts: int, heads: tuple[int, int],
            bytes_per_head: int, window: tuple[int, int, int], tokens: tuple[int, int],
            ratio: tuple[int, int]) -> list[Piece]:
    """Pieces moving heads ``[a_r, a_r + c)`` of the remote page to ``[a_l, a_l + c)`` locally.

    ``heads`` = (remote heads, local heads), ``window`` = (a_r, a_l, c),
    ``tokens`` = (remote, local) tokens per page, ``ratio`` = (m, s).
    Adjacent pieces contiguous on both sides are merged.
    """
    hr, hl = heads
    a_r, a_l, count = window
    tr, tl = tokens
    m, s = ratio
    if s > 1:  # remote page splits: sub j holds remote tokens [j*tl, (j+1)*tl)
        spans = [(j, j * tl, 0, tl) for j in range(s)]
    elif m > 1:  # remote pages of phase q fill local tokens [q*tr, (q+1)*tr)
        spans = [(q, 0, q * tr, tr) for q in range(m)]
    else:
        spans = [(0, 0, 0, tr)]
    part_r, part_l = hr * tr * bytes_per_head, hl * tl * bytes_per_head

    def raw() -> Iterator[Piece]:
        for part in range(parts):
            src0, dst0 = rb.offset + part * part_r, lb.offset + part * part_l
            for sub, t_r0, t_l0, n in spans:
                if order is HeadOrder.HND:
                    # Whole-page token ranges on both sides: the heads are one run.
                    step = count if n == tr == tl else 1
                    for i in range(0, count, step):
                        yield Piece(rb.name, src0 + ((a_r + i) * tr + t_r0) * bytes_per_head,
                                    dst0 + ((a_l + i) * tl + t_l0) * bytes_per_head, step * n * bytes_per_head, sub)
                else:
                    # All heads on both sides: the tokens are one run.
                    step = n if count == hr == hl else 1
                    for k in range(0, n, step):
                        yield Piece(rb.name, src0 + ((t_r0 + k) * hr + a_r) * bytes_per_head,
                                    dst0 + ((t_l0 + k) * hl + a_l) * bytes_per_head, step * count * bytes_per_head, sub)

    return merge_pieces(sorted(raw(), key=lambda p: (p.sub, p.src_offset)))


def merge_pieces(pieces: list[Piece]) -> list[Piece]:
    """Merge neighbours (same ``sub``, contiguous on both sides); input sorted by (sub, src_offset).

    The merged piece keeps the first one's buffer name.
    """
    out: list[Piece] = []
    for p in pieces:
        q = out[-1] if out else None
        if q and q.sub == p.sub and q.src_offset + q.length == p.src_offset and q.dst_offset + q.length == p.dst_offset:
            out[-1] = Piece(q.buffer, q.src_offset, q.dst_offset, q.length + p.length, q.sub)
        else:
            out.append(p)
    return out
