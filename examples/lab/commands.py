"""Running the lab's commands, and giving up cleanly (exit status 77) where the lab cannot run."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
SKIP = 77


def sh(*cmd: str, check: bool = True, timeout: float = 20) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def skip(why: str) -> None:
    print(f"multinode-loopback: SKIP: {why}", file=sys.stderr)
    sys.exit(SKIP)
