"""Find installed transfer backends through their entry points.

A backend package registers a factory under ``kvlend.transfer_backends``;
``load_backend(name, **options)`` instantiates it, turning every failure
into a ``BackendError`` that says what is installed.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from ..errors import BackendError, KvlendError
from .contract import TransferBackend

ENTRY_POINT_GROUP = "kvlend.transfer_backends"


def available_backends() -> dict[str, str]:
    """Installed backends: name -> ``module:object``."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_backend(name: str, /, **options) -> TransferBackend:
    """Instantiate the installed backend ``name`` with ``options``."""
    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        have = sorted(available_backends()) or ["none"]
        raise BackendError(
            f"no transfer backend {name!r} is installed (installed: {', '.join(have)}); "
            f"backends register under the entry-point group {ENTRY_POINT_GROUP!r}"
        )
    try:
        factory = matches[0].load()
    except Exception as exc:
        raise BackendError(f"transfer backend {name!r} failed to load: {type(exc).__name__}: {exc}") from exc
    try:
        return factory(**options)
    except KvlendError:
        raise
    except Exception as exc:  # e.g. TypeError for an option the backend does not take
        raise BackendError(f"transfer backend {name!r} refused options {options!r}: "
                           f"{type(exc).__name__}: {exc}") from exc
