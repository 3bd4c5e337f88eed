"""The parent's handle on a rank in a child process (``tests.support.fault_ranks`` or ``chaos_ranks``)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
import time

from kvlend.security.certs import save_rank

from .certs import creds
from .children import child_env, support_module
from .fault_ranks import MARK
from .nodes import DEADLINE


class Rank:
    """A ``fault_ranks`` child (or ``module``'s): JSON events on stdout, commands on stdin, SIGKILL on demand.

    It proves ``identity`` with a certificate from the tests' CA, written into a private directory
    that goes when the child does.  Its stderr is discarded unless ``$KVLEND_RANK_STDERR`` is set
    (for debugging a child).
    """

    def __init__(self, identity: str, mode: str, *args: str, module: str = "fault_ranks") -> None:
        self._certs = tempfile.TemporaryDirectory(prefix="kvlend-rank-")
        self.proc = subprocess.Popen(
            support_module(module, mode, *args),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
            stderr=None if os.environ.get("KVLEND_RANK_STDERR") else subprocess.DEVNULL,
            env=child_env(**save_rank(creds(identity, "prefill" if "prefill" in mode else "decode"), self._certs.name)),
        )
        self.address: tuple[str, int] | None = None
        self._buf = b""

    def line(self, timeout: float) -> str:
        """The next line of output (unbuffered reads, so ``select`` never misses a line already read)."""
        end = time.monotonic() + timeout
        while b"\n" not in self._buf:
            remaining = end - time.monotonic()
            if remaining <= 0 or not select.select([self.proc.stdout], [], [], remaining)[0]:
                raise AssertionError(f"child said nothing within {timeout} s")
            data = os.read(self.proc.stdout.fileno(), 65536)
            if not data:
                raise AssertionError(f"child exited (rc {self.proc.wait(DEADLINE)})")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def ready(self) -> bool:
        return b"\n" in self._buf or bool(select.select([self.proc.stdout], [], [], 0)[0])

    def listening(self, timeout: float = 30.0) -> tuple[str, int]:
        end = time.monotonic() + timeout
        while not (line := self.line(max(0.0, end - time.monotonic()))).startswith("LISTENING "):
            pass
        _, host, port = line.split()
        self.address = (host, int(port))
        return self.address

    def next_event(self, timeout: float) -> dict | None:
        """The next event line, or None for a line of something else (UCX writes to stdout too)."""
        line = self.line(timeout)
        if not line.startswith(MARK):
            return None
        return json.JSONDecoder().raw_decode(line[len(MARK):])[0]

    def event(self, want: str, timeout: float = DEADLINE) -> dict:
        end = time.monotonic() + timeout
        while True:
            event = self.next_event(max(0.0, end - time.monotonic()))
            if event is not None and event["ev"] == want:
                return event

    def send(self, text: str) -> None:
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(DEADLINE)
        self._certs.cleanup()

    def finish(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.send("stop")
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(DEADLINE)
        self._certs.cleanup()
