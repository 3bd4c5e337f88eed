"""The pair's shared secret: generated for a demo, loaded from the environment by a rank.

Read from ``$KVLEND_SECRET`` (hex) or the file ``$KVLEND_SECRET_FILE``.
"""

from __future__ import annotations

import os
import secrets

from ..errors import AuthError

SECRET_ENV = "KVLEND_SECRET"
SECRET_FILE_ENV = "KVLEND_SECRET_FILE"


def generate_secret() -> bytes:
    return secrets.token_bytes(32)


def load_secret(environ=os.environ) -> bytes:
    """The pair's shared secret: ``$KVLEND_SECRET`` (hex) or the file ``$KVLEND_SECRET_FILE``."""
    if environ.get(SECRET_ENV):
        try:
            secret = bytes.fromhex(environ[SECRET_ENV])
        except ValueError:
            raise AuthError(f"${SECRET_ENV} must be hex") from None
    elif environ.get(SECRET_FILE_ENV):
        path = environ[SECRET_FILE_ENV]
        try:
            with open(path, "rb") as f:
                raw = f.read().strip()
        except OSError as exc:
            raise AuthError(f"cannot read ${SECRET_FILE_ENV} {path!r}: {exc.strerror}") from None
        try:
            secret = bytes.fromhex(raw.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            secret = raw
    else:
        raise AuthError(f"no shared secret: set ${SECRET_ENV} (hex) or ${SECRET_FILE_ENV}")
    if len(secret) < 16:
        raise AuthError("the shared secret must be at least 16 bytes")
    return secret
