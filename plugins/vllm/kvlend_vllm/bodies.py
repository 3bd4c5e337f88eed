"""What the router accepts as a request body: a JSON object of bounded size and depth, else a 4xx.

Why: a client's body is parsed in the router's one event loop, so a huge or deeply nested one is work
every other client waits behind, and a malformed one must say what was wrong (400, 413), never 500.
The size is checked against ``Content-Length`` before anything is read and counted while a chunked
body arrives, so an oversized body is refused without reading it all.  The depth cap keeps parsing
and re-encoding (for the upstreams) far from Python's recursion limit.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Mapping

MAX_BODY_BYTES = 32 << 20  # a 1M-token prompt as text or token ids is under 8 MiB; images in base64 need more
MAX_DEPTH = 64  # nested arrays and objects: OpenAI requests (messages, content parts, tool schemas) use ~10


class BodyRefused(Exception):
    """A request body the router will not route: ``status`` (400 or 413) and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(headers: Mapping[str, str], chunks: AsyncIterator[bytes], cap: int) -> bytes:
    """The body's bytes, at most ``cap`` of them: 413 once it is over, before reading the rest."""
    declared = headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BodyRefused(400, f"Content-Length must be a number of bytes, got {declared[:40]!r}")
        if int(declared) > cap:
            raise BodyRefused(413, f"request body of {int(declared)} bytes is over this router's cap of {cap} "
                                   "bytes (--max-body-bytes)")
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > cap:
            raise BodyRefused(413, f"request body is over this router's cap of {cap} bytes (--max-body-bytes)")
        parts.append(chunk)
    return b"".join(parts)


def parse_body(raw: bytes, max_depth: int = MAX_DEPTH) -> dict:
    """The JSON object ``raw`` holds; ``BodyRefused`` (400) for anything else."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BodyRefused(400, f"request body is nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, and bytes that are not UTF-8
        raise BodyRefused(400, f"request body is not JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise BodyRefused(400, f"request body must be a JSON object, got a JSON {type(body).__name__}")
    if _depth(body) > max_depth:
        raise BodyRefused(400, f"request body is nested deeper than {max_depth} levels")
    return body


def _depth(value: object) -> int:
    """How deeply arrays and objects nest in ``value`` (iteratively: no recursion to exhaust)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return deepest
