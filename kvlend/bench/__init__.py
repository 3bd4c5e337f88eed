"""``kvlend bench``: measurement code, outside the core."""

from .report import format_report, plot, pyplot
from .runner import run

__all__ = ["format_report", "plot", "pyplot", "run"]
