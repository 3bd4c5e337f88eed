"""``prompt_digest``: what ties a lease to the prompt whose KV it holds.

A ticket crosses HTTP, where anyone who sees it may put it on another request.
So the prefill engine lends with the digest of the prompt's token ids, a decode
claims with the digest of its own request's prompt, and the prefill refuses a
claim whose digest differs (``PromptMismatch``) before any byte moves: KV for a
prompt only ever reaches a request with the same prompt, and a stolen ticket
reveals nothing its thief did not already send.

The digest is BLAKE2b-256 (personalised, so it collides with no other use of
the hash) over the token ids as little-endian int64, followed by an engine's
``context`` bytes (whatever else the KV depends on, e.g. a LoRA adapter's name
or the hashes of a prompt's images).  Both sides must compute it with this
function and the same ``context``.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..errors import LeaseError, PageRangeError
from .pages import int_array

PROMPT_DIGEST_BYTES = 32
_PERSON = b"kvlend-prompt-1"


def prompt_digest(token_ids: Any, context: bytes = b"") -> bytes:
    """The digest of a prompt's ``token_ids`` (a 1-D sequence of ints) and the engine's ``context``."""
    ids = int_array("token_ids", token_ids)
    if not isinstance(context, (bytes, bytearray)):
        raise PageRangeError(f"context: must be bytes, got {type(context).__name__}")
    h = hashlib.blake2b(digest_size=PROMPT_DIGEST_BYTES, person=_PERSON)
    h.update(len(ids).to_bytes(8, "little"))
    h.update(ids.astype("<i8").tobytes())
    h.update(bytes(context))
    return h.digest()


def check_digest(value: Any, where: str = "prompt_digest") -> bytes | None:
    """``value`` if it is None or a digest (``PROMPT_DIGEST_BYTES`` bytes), else ``LeaseError``."""
    if value is not None and (not isinstance(value, bytes) or len(value) != PROMPT_DIGEST_BYTES):
        got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise LeaseError(f"{where}: must be None or {PROMPT_DIGEST_BYTES} bytes, got {got}")
    return value
