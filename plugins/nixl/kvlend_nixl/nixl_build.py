"""The NIXL build this host has: ``nixl-cu13`` or ``nixl-cu12``, one of them, found at import.

kvlend depends on one build (``kvlend-nixl[cu13]`` or ``[cu12]``), not on the ``nixl`` meta
package, which installs both (about 230 MiB each).  Where the meta package is installed anyway
(vLLM's own connector imports it), its choice is used.  NIXL's own logging is lowered to WARNING
here, once it is imported.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType

BUILDS = ("nixl_cu13", "nixl_cu12")  # on a host without CUDA either moves DRAM; the meta package prefers cu13


def _cuda_major() -> int | None:
    """The CUDA major of an already imported torch (the build must match it); None without one."""
    version = getattr(getattr(sys.modules.get("torch"), "version", None), "cuda", None)
    return int(version.split(".")[0]) if version else None


def _import(package: str) -> tuple[ModuleType, ModuleType] | None:
    try:
        return importlib.import_module(f"{package}._api"), importlib.import_module(f"{package}._bindings")
    except ModuleNotFoundError as exc:
        if exc.name not in (package, f"{package}._api", f"{package}._bindings"):
            raise  # the build is there but something it needs is not: say so
        return None


def load() -> tuple[ModuleType, ModuleType]:
    """NIXL's ``_api`` and ``_bindings`` modules of the installed build."""
    major = _cuda_major()
    order = ["nixl"] + ([f"nixl_cu{major}"] if major else []) + list(BUILDS)
    for package in dict.fromkeys(order):
        found = _import(package)
        if found is not None:
            return found
    raise ImportError("no NIXL build is installed: pip install 'kvlend-nixl[cu13]' (CUDA 13, or a host without "
                      "a GPU) or 'kvlend-nixl[cu12]' (CUDA 12)")


def quiet_logging() -> None:
    """NIXL logs every agent and backend creation at INFO on stdout; keep WARNING.

    An explicit ``NIXL_LOG_LEVEL`` (read by NIXL itself) is left to rule.
    """
    if "NIXL_LOG_LEVEL" in os.environ:
        return
    log = logging.getLogger("nixl")
    if log.level == logging.INFO:  # NIXL's own default, not a user's choice
        log.setLevel(logging.WARNING)


api, bindings = load()
quiet_logging()
