"""What the ranks logged so far, and waiting on it."""

from __future__ import annotations

import time

from .namespaces import Lab


class Logs:
    """What the ranks logged so far (lines parsed from their log files)."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab

    def lines(self, key: str) -> list[str]:
        try:
            with open(self.lab.path(f"{key}.log")) as f:
                return f.read().splitlines()
        except OSError:
            return []

    def served(self, key: str, prefill: str | None = None) -> int:
        return sum(1 for line in self.lines(key) if line.startswith("SERVED ")
                   and (prefill is None or line.split()[2] == prefill))

    def fetching(self, key: str, prefill: str) -> set[str]:
        """Requests whose fetch from ``prefill`` started and has not ended."""
        out: set[str] = set()
        for line in self.lines(key):
            words = line.split()
            if len(words) >= 3 and words[2] == prefill:
                if words[0] == "FETCHING":
                    out.add(words[1])
                elif words[0] in ("SERVED", "FAILED"):
                    out.discard(words[1])
        return out

    def failed(self, key: str) -> int:
        return sum(1 for line in self.lines(key) if line.startswith("FAILED "))

    def registry(self, key: str, event: str, identity: str = "-", after: float = 0.0) -> float | None:
        """When ``key`` first logged ``REGISTRY <event> <identity>`` after wall time ``after``."""
        for line in self.lines(key):
            words = line.split()
            if (len(words) == 4 and words[0] == "REGISTRY" and words[1] == event and words[2] == identity
                    and float(words[3]) > after):
                return float(words[3])
        return None


def wait_until(predicate, timeout: float, lab: Lab, watch: tuple[str, ...] = ()) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` (False); gives up early if a rank of ``watch`` exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if any(lab.procs[k].poll() is not None for k in watch):
            return predicate()
        time.sleep(0.05)
    return False
