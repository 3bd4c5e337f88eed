"""Validation helpers for PageLayout and its parts: the caps on a peer's layout, and checks whose
errors quote the offending value briefly."""

from __future__ import annotations

import reprlib
from enum import Enum
from typing import Any

from ..errors import LayoutError

# Caps for decoding a peer's bytes: refuse before allocating for a claim.
MAX_ENCODED_BYTES = 4 << 20
MAX_REGIONS = 4096
MAX_BUFFERS = 16384
MAX_NAME_LEN = 256
MAX_SCOPE_LEN = 65535
MAX_INT = (1 << 63) - 1


# Error messages quote a peer's values; keep the quote short and never recurse
# through deep nesting (repr of a 1000-deep list raises RecursionError).
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlevel = 3


def show(value: Any) -> str:
    return _REPR.repr(value)


def fail(where: str, msg: str) -> LayoutError:
    return LayoutError(f"{where}: {msg}")


def check_int(where: str, value: Any, *, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(where, f"must be an int, got {type(value).__name__} {show(value)}")
    if value < minimum or value > MAX_INT:
        raise fail(where, f"must be in [{minimum}, 2**63), got {value}")


def check_name(where: str, value: Any, max_len: int = MAX_NAME_LEN) -> None:
    if not isinstance(value, str) or not value:
        raise fail(where, f"must be a non-empty str, got {show(value)}")
    if len(value) > max_len:
        raise fail(where, f"longer than {max_len} characters ({len(value)})")


def check_enum(where: str, value: Any, enum: type[Enum]) -> None:
    if not isinstance(value, enum):
        raise fail(where, f"must be a {enum.__name__}, got {show(value)}")
