"""What a lend or extend takes: per group, the rows of a request's page table complete at ``ready``
(checked against the layout), and the page-lock slots they hold.  Pure, as the lender that uses it."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..errors import LeaseError, PageRangeError
from .layout import PageLayout, RowSelection
from .lease import Lease
from .locks import PageLocks, Slots
from .pages import GroupPages, int_array

_SELECTION_CACHE = 64  # distinct selections whose per-group regions are kept


class LendRows:
    """Plans the rows a lease takes on one layout's pages."""

    def __init__(self, layout: PageLayout, locks: PageLocks) -> None:
        self.layout = layout
        self.locks = locks
        self._by_selection: dict[RowSelection, dict[str, tuple[tuple[str, ...], int]]] = {}
        self._region_order = {r.name: i for i, r in enumerate(layout.regions)}

    def targets(self, selection: RowSelection) -> dict[str, tuple[tuple[str, ...], int]]:
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

    def plan(
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


def _table(group: str, value: Any, length: int) -> np.ndarray:
    return int_array(f"pages[{group!r}]", value, length=length)


def all_groups(layout: PageLayout, lease: Lease) -> dict[str, GroupPages]:
    """What ``lease`` holds per group of the layout (groups it lends nothing of yet: empty)."""
    empty = GroupPages._checked(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    return {name: lease.pages.get(name, empty) for name in layout.groups}


def merged(a: GroupPages, b: GroupPages | None) -> GroupPages:
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
