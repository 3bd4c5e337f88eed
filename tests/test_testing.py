"""``kvlend.testing``'s own promises: its stable names import, and ``FakeClock`` moves only when told.

The in-memory world itself is tested by every ``test_sessions_*`` file that runs on it, and by the
integration guide's example (``tests/test_integration_example.py``).
"""

from __future__ import annotations

import math

import pytest

import kvlend.testing
from kvlend.testing import FakeClock

pytestmark = pytest.mark.unit


def test_every_public_name_is_there():
    assert kvlend.testing.__all__
    missing = [name for name in kvlend.testing.__all__ if not hasattr(kvlend.testing, name)]
    assert not missing


def test_a_fake_clock_moves_only_when_told():
    clock = FakeClock(100.0)
    assert clock() == clock.now == 100.0
    assert clock.advance(2.5) == 102.5 and clock() == 102.5
    assert clock.advance(0) == 102.5
    clock.now = 50.0  # a step back (an NTP step), only by setting it
    assert clock() == 50.0


@pytest.mark.parametrize("seconds", [-1.0, math.nan])
def test_a_fake_clock_refuses_to_advance_backwards_or_by_nan(seconds):
    clock = FakeClock(1.0)
    with pytest.raises(ValueError, match="advances by zero or more seconds"):
        clock.advance(seconds)
    assert clock() == 1.0


def test_the_worlds_time_is_its_fake_clock():
    world = kvlend.testing.World(start=10.0)
    world.clock.advance(1.0)
    assert world.now == 11.0
    world.now += 1.0  # moves the clock, ticks no one
    assert world.clock() == 12.0
