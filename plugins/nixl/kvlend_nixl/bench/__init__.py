"""``kvlend bench``: kvlend's reads over this plugin against raw NIXL and other baselines.

It lives with the plugin it measures; the ``kvlend`` command imports it only when ``bench`` runs."""

from .report import format_report, plot, pyplot
from .runner import run

__all__ = ["format_report", "plot", "pyplot", "run"]
