"""Which pages of a request a lease covers, per layer group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import PageRangeError


def int_array(where: str, value: Any, *, length: int | None = None) -> np.ndarray:
    """``value`` as a 1-D int64 array, or a ``PageRangeError`` naming ``where``."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise PageRangeError(f"{where}: not an integer array ({exc})") from None
    if arr.ndim != 1 or (length is not None and arr.size != length):
        expect = "must be 1-D" if length is None else f"expected {length} entries"
        raise PageRangeError(f"{where}: {expect}, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise PageRangeError(f"{where}: must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:
        raise PageRangeError(f"{where}: {int(arr.max())} is out of range")
    return arr.astype(np.int64)


@dataclass(frozen=True, eq=False)
class GroupPages:
    """Pages of one layer group: token page ``token_pages[i]`` lives in slot ``ordinals[i]``.

    Token page ``p`` covers tokens ``[p * tokens_per_page, (p + 1) * tokens_per_page)``;
    a recurrent group has one row, token page 0.  Arrays are int64, read-only,
    ``token_pages`` strictly increasing.
    """

    token_pages: np.ndarray
    ordinals: np.ndarray

    def __post_init__(self) -> None:
        tp = np.array(self.token_pages, dtype=np.int64, copy=True).reshape(-1)
        od = np.array(self.ordinals, dtype=np.int64, copy=True).reshape(-1)
        _check_rows(tp, od)
        tp.flags.writeable = False
        od.flags.writeable = False
        object.__setattr__(self, "token_pages", tp)
        object.__setattr__(self, "ordinals", od)

    @classmethod
    def _checked(cls, token_pages: np.ndarray, ordinals: np.ndarray) -> GroupPages:
        """Wrap arrays the caller built and checked (fresh int64, 1-D, equal length, valid):
        the lender's hot path, which skips ``__post_init__``'s copies and checks."""
        token_pages.flags.writeable = False
        ordinals.flags.writeable = False
        obj = object.__new__(cls)
        object.__setattr__(obj, "token_pages", token_pages)
        object.__setattr__(obj, "ordinals", ordinals)
        return obj

    @classmethod
    def viewing(cls, token_pages: np.ndarray, ordinals: np.ndarray) -> GroupPages:
        """Over 1-D int64 arrays no one writes (a peer's bytes, read in place): checked as a new one is, not
        copied (the wire's offers)."""
        _check_rows(token_pages, ordinals)
        return cls._checked(token_pages, ordinals)

    def __len__(self) -> int:
        return int(self.token_pages.size)

    def select(self, mask: np.ndarray) -> GroupPages:
        return GroupPages(self.token_pages[mask], self.ordinals[mask])


def _check_rows(tp: np.ndarray, od: np.ndarray) -> None:
    """``PageRangeError`` unless the rows are equal in number, token pages non-negative and strictly increasing,
    ordinals non-negative."""
    if tp.shape != od.shape:
        raise PageRangeError(f"token_pages ({tp.size}) and ordinals ({od.size}) differ in length")
    if tp.size and (tp[0] < 0 or not (tp[1:] > tp[:-1]).all()):
        raise PageRangeError("token_pages must be non-negative and strictly increasing")
    if od.size and od.min() < 0:
        raise PageRangeError(f"negative page ordinal {int(od.min())}")
