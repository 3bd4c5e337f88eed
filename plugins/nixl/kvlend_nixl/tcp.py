"""Whether this process's READs may go over UCX's tcp transport, and pinning its socket buffers.

Over tcp a READ is a GET the target answers in software, and an answer that finds the socket
full waits inside UCX, which can crash the target later (docs/faults.md).  The decode keeps its
bytes in flight per prefill below the socket buffering (``kvlend.core.tcpwindow``); that needs
the buffers pinned, not autotuned, on both sides, which ``pin`` does before the agent is made.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import MutableMapping

from kvlend.core.tcpwindow import pinned_buffers, window_bytes

_NET_CORE = Path("/proc/sys/net/core")


def carries_reads(env: MutableMapping[str, str], rdma_devices: bool) -> bool:
    """Whether UCX may use tcp for READs: ``UCX_TLS`` names it (or excludes it not), and without
    ``UCX_TLS`` whether this host has no RDMA device (UCX then reads over tcp between hosts)."""
    tls = env.get("UCX_TLS", "").strip()
    if not tls or tls == "all":
        return not rdma_devices
    names = set(tls.lstrip("^").split(","))
    return ("tcp" not in names) if tls.startswith("^") else ("tcp" in names or "all" in names)


SHARED_MEMORY = frozenset({"sm", "shm", "cma", "posix", "sysv", "xpmem", "knem"})  # UCX's transports within a host


def local_reads_over_tcp(env: MutableMapping[str, str]) -> bool:
    """Whether reads from a peer on this host go over tcp too: ``UCX_TLS`` lists transports and none
    of them moves bytes through shared memory (unset, ``all`` or an exclusion list leaves UCX its
    shared-memory transports, which it prefers within a host)."""
    tls = env.get("UCX_TLS", "").strip()
    if not tls or tls == "all" or tls.startswith("^"):
        return False
    return not set(tls.split(",")) & (SHARED_MEMORY | {"all"})


def rdma_devices() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def host_limits() -> tuple[int, int]:
    """(``net.core.rmem_max``, ``net.core.wmem_max``) of this host."""
    return tuple(int((_NET_CORE / name).read_text()) for name in ("rmem_max", "wmem_max"))


def pin(env: MutableMapping[str, str]) -> int:
    """Pin ``UCX_TCP_SNDBUF``/``RCVBUF`` in ``env`` (kept where set) and return the read window in bytes.

    ``ConfigError`` where the host's ``net.core`` limits cannot give the sizes.  Every kvlend
    process pins alike, so a prefill's send buffer matches its decodes' receive buffers.
    """
    snd, rcv = pinned_buffers(env, *host_limits())
    env.setdefault("UCX_TCP_SNDBUF", str(snd))
    env.setdefault("UCX_TCP_RCVBUF", str(rcv))
    return window_bytes(snd, rcv)
