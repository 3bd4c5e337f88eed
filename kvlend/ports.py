"""TCP ports for the services the scripts and the tests start, chosen below the kernel's ephemeral range.

A port the kernel picks for ``bind(port 0)`` is free only while that socket
lives, and it comes from the range the kernel draws on for every outgoing
connection and every other ``bind(port 0)``: vLLM's own ZMQ and torch ports,
UCX's, etcd's clients.  A service started on it seconds later can find it
taken (CI saw vLLM's NIXL side channel fail so).  The kernel never hands out
a port below that range, so one chosen there and found free stays free
unless some process asks for that very number.
"""

from __future__ import annotations

import random
import socket
import threading

from .errors import ConfigError

LOWEST = 10000  # below this sit the well-known services a host may run
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_TRIES = 200
_given: set[int] = set()  # never hand out a port twice from one process
_lock = threading.Lock()
_random = random.Random()  # not the global one: a test's random.seed must not repeat another process's picks


def ephemeral_floor() -> int:
    """The lowest port the kernel picks by itself (32768 where /proc does not say)."""
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def spare_ports(n: int = 1, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now, none handed out before by this process."""
    top = ephemeral_floor()
    if top - LOWEST < 1000:
        raise ConfigError(f"the kernel's ephemeral ports start at {top} ({_RANGE_FILE}): "
                          f"too few ports below it to choose from")
    with _lock:
        ports: list[int] = []
        for _ in range(_TRIES * n):
            port = _random.randrange(LOWEST, top)
            if port not in _given and port not in ports and _bindable(host, port):
                ports.append(port)
                if len(ports) == n:
                    _given.update(ports)
                    return ports
    raise ConfigError(f"no {n} free TCP ports on {host} between {LOWEST} and {top} after {_TRIES * n} tries")


def spare_port(host: str = "127.0.0.1") -> int:
    """One port from ``spare_ports``."""
    return spare_ports(1, host)[0]
