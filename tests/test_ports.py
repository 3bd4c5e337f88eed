"""Ports for started services come from below the kernel's ephemeral range, free, and never twice."""

from __future__ import annotations

import socket

import pytest

from kvlend import ports
from kvlend.errors import ConfigError

pytestmark = pytest.mark.unit


def test_spare_ports_are_distinct_free_and_below_the_kernels_own_range():
    got = ports.spare_ports(8)
    assert len(set(got)) == 8
    assert all(ports.LOWEST <= p < ports.ephemeral_floor() for p in got), got
    for p in got:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: the picker's own probe socket is closed


def test_a_port_is_never_handed_out_twice_even_while_it_stays_free():
    first = set(ports.spare_ports(50))
    assert first.isdisjoint(ports.spare_ports(50))


def test_a_port_someone_listens_on_is_skipped(monkeypatch):
    free = ports.spare_port()  # not a fixed number: something on the host may listen there
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        picks = iter([busy, busy, free])
        monkeypatch.setattr(ports, "_random", type("Seq", (), {"randrange": lambda self, a, b: next(picks)})())
        monkeypatch.setattr(ports, "ephemeral_floor", lambda: 65536)  # the listener's own port is in range
        monkeypatch.setattr(ports, "_given", set())
        assert ports.spare_ports(1) == [free]


def test_too_narrow_a_range_is_a_config_error(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_floor", lambda: ports.LOWEST + 10)
    with pytest.raises(ConfigError, match="ephemeral ports start at"):
        ports.spare_ports()
