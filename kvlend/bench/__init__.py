"""``kvlend bench``: measurement code, outside the core."""

from .scenarios import format_report, plot, pyplot, run

__all__ = ["format_report", "plot", "pyplot", "run"]
