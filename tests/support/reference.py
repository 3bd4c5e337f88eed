"""Brute-force references that the property tests compare the real code against."""

from __future__ import annotations

from kvlend.core.layout import PageLayout


def reference_bound(lay: PageLayout, n: int, delivered: dict[str, set], reads=None) -> int:
    """Brute force over every token position, straight from the definition (``reads``: a cache of
    ``pages_read`` as sets, keyed by (group, position), for callers that ask often)."""
    reads = {} if reads is None else reads
    best = 0
    for t in range(n + 1):
        ok = True
        for name, g in lay.groups.items():
            if g.recurrent:
                ok &= t == n and 0 in delivered[name]
            else:
                if (name, t) not in reads:
                    reads[name, t] = set(g.pages_read(t, lay.tokens_per_page).tolist())
                ok &= reads[name, t] <= delivered[name]
        if ok:
            best = t
    return best
