"""``printable``: a peer-supplied string made safe to put in a log line.

A peer chooses its name, the request ids and meta it sends, and the reasons
in its ``Abort``/``Bye``; logged raw, a newline forges a log record and an
ANSI escape rewrites the operator's terminal.  ``printable`` escapes every
non-printable character the way ``repr`` does (``\\n``, ``\\x1b``,
``\\u2028``, ...) and truncates to ``limit`` characters of the original.
"""

from __future__ import annotations

from typing import Any

LOG_LIMIT = 200  # characters of a peer's string kept in a log line


def printable(value: Any, limit: int = LOG_LIMIT) -> str:
    """``value`` (a str, or anything ``str`` accepts) with control and other non-printable
    characters escaped, cut to its first ``limit`` characters (the rest counted)."""
    if value is None:
        return "None"
    if isinstance(value, (bytes, bytearray)):
        text = bytes(value[:limit]).hex()
        return text + (f"...[{len(value)} bytes]" if len(value) > limit else "")
    text = value if isinstance(value, str) else str(value)
    head = text[:limit]
    out = head if head.isprintable() else repr(head)[1:-1]
    return out + (f"...[{len(text)} chars]" if len(text) > limit else "")
