"""``back_with_huge_pages``: host pools collapsed onto 2 MiB pages in place, contents kept."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvlend.core.layout import MemoryKind, MemoryRegion
from kvlend.transport.huge_pages import HUGE_PAGE, back_with_huge_pages

pytestmark = pytest.mark.unit


def _huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding ``address``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_a_host_pool_on_small_pages_is_collapsed_in_place_and_keeps_its_bytes():
    size = 8 * HUGE_PAGE
    buf = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # never advised: 4 KiB pages
    pool = np.frombuffer(buf, dtype=np.uint64)
    pool[:] = np.arange(pool.size, dtype=np.uint64)  # faults every page in
    address = pool.ctypes.data
    region = MemoryRegion("pool", MemoryKind.HOST, 0, pool.nbytes, HUGE_PAGE, pool.nbytes // HUGE_PAGE, address)
    device = MemoryRegion("gpu", MemoryKind.DEVICE, 0, pool.nbytes, HUGE_PAGE, pool.nbytes // HUGE_PAGE, address)
    collapsed, seconds = back_with_huge_pages([region, region, device])  # a repeat and a DEVICE region: skipped
    whole = (address + pool.nbytes) // HUGE_PAGE * HUGE_PAGE - -(-address // HUGE_PAGE) * HUGE_PAGE
    assert seconds >= 0 and np.array_equal(pool, np.arange(pool.size, dtype=np.uint64))
    if _thp_available():  # a kernel without transparent huge pages leaves them (logged), which is allowed
        assert collapsed == whole >= 8 * HUGE_PAGE
        assert _huge_kib(address) * 1024 >= 8 * HUGE_PAGE
    del pool
    buf.close()


def test_regions_without_a_whole_huge_page_are_left_alone():
    tiny = MemoryRegion("tiny", MemoryKind.HOST, 0, 4096, 4096, 1, 3 * HUGE_PAGE + 4096)
    assert back_with_huge_pages([tiny])[0] == 0
