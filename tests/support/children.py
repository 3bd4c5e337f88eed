"""Starting the tests' child processes: a module of ``tests.support`` run with ``python -m``, with the
repository and ``examples/`` first on its ``PYTHONPATH`` (as ``[tool.pytest.ini_options] pythonpath``
puts them on the test process's ``sys.path``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def support_module(name: str, *args: str) -> list[str]:
    """The command line running ``tests.support.<name>`` with ``args`` in this interpreter."""
    return [sys.executable, "-m", f"tests.support.{name}", *args]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``, with the repository and ``examples/`` first on ``PYTHONPATH``."""
    inherited = os.environ.get("PYTHONPATH")
    path = [str(ROOT), str(EXAMPLES), *([inherited] if inherited else [])]
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(path)}
