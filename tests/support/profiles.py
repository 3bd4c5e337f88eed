"""Hypothesis example counts that follow the loaded profile.

The full run (``scripts/test``, CI) uses hypothesis's own profiles: ``default``, or ``ci`` where the ``CI``
environment variable is set, both at 100 examples a test. ``scripts/test --quick`` loads ``quick``
(``--hypothesis-profile quick``): a tenth of that. A test that asks for its own count asks through
``examples(n)``, so it runs ``n`` in the full run and scales down with the quick profile.
"""

from __future__ import annotations

from hypothesis import settings

FULL = 100  # max_examples of hypothesis's default and ci profiles
settings.register_profile("quick", max_examples=FULL // 10)


def examples(n: int) -> int:
    """``n`` examples in the full run, scaled by the loaded profile's share of ``FULL`` (at least 2)."""
    return max(2, n * settings.default.max_examples // FULL)
