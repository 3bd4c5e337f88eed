"""Host e0's etcd members, driven over a pipe, and what ``kvlend cluster status`` lists through them."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time

from .commands import ROOT
from .namespaces import TOOL, Lab
from .topology import ADDR


class EtcdHost:
    """Host e0: three etcd members behind ``python -m kvlend.cluster.etcd_members``, one JSON line per command.

    It runs inside e0's namespace (only there do the 10.77.0.x addresses and its health checks
    reach); its stdin is ours, so if this driver dies the members go with it.
    """

    def __init__(self, lab: Lab, python: str, limit: float) -> None:
        cmd = ["ip", "netns", "exec", lab.ns("e0"), "timeout", "-k", "5", str(int(limit)), python, "-m",
               "kvlend.cluster.etcd_members", "--members", "3", "--host", ADDR["e0"], "--workdir", lab.path("etcd"),
               "--ca", lab.ca]
        log = open(lab.path("etcd.log"), "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     start_new_session=True, cwd=ROOT)
        log.close()
        lab.procs["etcd"] = self.proc  # ``Lab.close`` ends it, and its members by namespace
        self._buf = b""
        first = self._read(40)
        if "endpoints" not in first:
            raise RuntimeError(f"etcd host did not start: {first}")
        self.endpoints: list[str] = first["endpoints"]
        self.python, self.prefix = python, f"/kvlend/{lab.tag}"

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"etcd host: no answer within {timeout:g} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"etcd host exited (status {self.proc.poll()})")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def ask(self, command: str, timeout: float = 15.0) -> dict:
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        answer = self._read(timeout)
        if "error" in answer:
            raise RuntimeError(f"etcd host: {command}: {answer['error']}")
        return answer

    def wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(m["healthy"] for m in self.ask("status")["members"]):
                return True
            time.sleep(0.1)
        return False

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit", 15)
            except (RuntimeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


def cluster_status(lab: Lab, etcd: EtcdHost) -> list[str] | None:
    """The identities etcd lists now, asked by ``kvlend cluster status --json`` from host e0; None if it failed."""
    cmd = ["ip", "netns", "exec", lab.ns("e0"), "timeout", "20", etcd.python, "-c",
           "import sys; from kvlend.cli import main; sys.exit(main(sys.argv[1:]))", "cluster", "status", "--json",
           "--etcd", ",".join(etcd.endpoints), "--prefix", etcd.prefix]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT,
                       env={**os.environ, **lab.tls_env(TOOL)})
    try:
        return sorted(rank["identity"] for rank in json.loads(r.stdout)["ranks"]) if r.returncode == 0 else None
    except (ValueError, KeyError, TypeError):
        return None
