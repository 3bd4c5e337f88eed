"""The tests' cluster: one CA per test process, rank certificates issued from it.

A child process gets its certificate as files (``kvlend.security.certs.save_rank``).
"""

from __future__ import annotations

import functools

from kvlend.security.certs import Authority
from kvlend.security.credentials import Credentials

CA = Authority.create()


@functools.cache
def creds(identity: str, role: str) -> Credentials:
    """A ``role`` rank certificate for ``identity`` from the tests' cluster CA (cached: issuing costs
    milliseconds)."""
    return CA.issue(identity, role)
