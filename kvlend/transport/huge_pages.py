"""Host KV pools on 2 MiB pages, for UCX's shared-memory copy.

Over CMA (``process_vm_readv``) the kernel pins and walks both sides' pages one by one: a 256 MiB
read over 4 KiB pages took 55 ms here, over transparent huge pages 25 ms.  numpy asks Linux for huge
pages for its large arrays; torch does not, and an engine allocates and zeroes its KV cache before a
connector sees it, so the pages must be collapsed in place (``MADV_COLLAPSE``, Linux 6.1).  Contents
are kept; only the mapping changes.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import sys
import time
from typing import Iterable

from kvlend.core.layout import MemoryKind, MemoryRegion

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EPERM)


def back_with_huge_pages(regions: Iterable[MemoryRegion]) -> tuple[int, float]:
    """Ask Linux to map the whole 2 MiB pages inside each HOST region as huge pages, now.

    Returns (bytes collapsed, seconds taken).  Best effort: where the kernel has no transparent huge
    pages or no ``MADV_COLLAPSE`` nothing changes (logged); a region it cannot collapse whole (memory
    too fragmented) keeps the pages it could.  Call it before anything reads or writes the regions
    concurrently (before the engine's first step).
    """
    started = time.monotonic()
    if not sys.platform.startswith("linux"):
        return 0, 0.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done, seen = 0, set()
    for r in regions:
        low = -(-r.address // HUGE_PAGE) * HUGE_PAGE
        high = (r.address + r.size) // HUGE_PAGE * HUGE_PAGE
        if r.kind is not MemoryKind.HOST or high <= low or (low, high) in seen:
            continue
        seen.add((low, high))
        for advice in (MADV_HUGEPAGE, MADV_COLLAPSE):
            if libc.madvise(low, high - low, advice) != 0:
                code = ctypes.get_errno()
                if code in _UNSUPPORTED:
                    log.info("kvlend: host KV pools stay on 4 KiB pages (madvise %d: %s)", advice,
                             errno.errorcode.get(code, code))
                    return done, time.monotonic() - started
                log.info("kvlend: region %r only partly on huge pages (madvise %d: %s)", r.name, advice,
                         errno.errorcode.get(code, code))
                break
        else:
            done += high - low
    return done, time.monotonic() - started
