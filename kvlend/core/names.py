"""The rule for rank identities and their roles, shared by certificates (``security``) and registry
records (``cluster``).

Pure: a rank's identity lands in logs, file names and etcd keys, so it is a short, plain name.
"""

from __future__ import annotations

import re

from ..errors import ConfigError

ROLES = ("prefill", "decode", "router")  # what a rank's certificate may say it is (and its registry record)
_IDENTITY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}")


def check_identity(identity: str) -> str:
    """A rank identity: 1-64 characters of letters, digits and ``._:@-`` (it lands in logs and file names)."""
    if not isinstance(identity, str) or not _IDENTITY.fullmatch(identity):
        raise ConfigError(f"rank identity {identity!r}: expected 1-64 characters of letters, digits and ._:@- "
                          "starting with a letter or digit")
    return identity
