"""examples/engine_integration.py, the integration guide's example, runs and verifies (real NIXL agents)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "engine_integration.py"


def test_engine_integration_example_verifies():
    run = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "verified: yes (4/4 requests)", run.stdout
    requests = [line for line in lines if line.startswith("req-")]
    assert len(requests) == 4 and all("tokens match" in line for line in requests)
    for line in requests:  # the full layer is locked while lent and free after; the window layer is partly free
        lent, total, after = map(int, re.search(r"full layer (\d+)/(\d+) while lent, (\d+)/", line).groups())
        window = int(re.search(r"window layer (\d+)/", line).group(1))
        assert lent == 0 and after == total and 0 < window < total, line
