"""The namespace lab: one network namespace per host, veth links to a bridge, rank processes launched
inside them with their certificates; ``Lab.close`` undoes all of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from .commands import ROOT, sh
from .topology import ADDR, HOSTS, RANKS

TOOL = "lab-tool"  # the router-role identity the driver's own registry reads (kvlend cluster status) hold

# Run with the ranks' Python (this script's may lack kvlend): argv is the certificates' directory, the CA's
# (etcd's members issue their server certificate from it), then the identities.
ISSUE = """
import sys
from kvlend.security.certs import Authority, save_rank
ca = Authority.create()
ca.save(sys.argv[2])
save_rank(ca.issue("%s", "router"), sys.argv[1])
for identity in sys.argv[3:]:  # the topology's names say the role: A-prefill, A-decode0, ...
    save_rank(ca.issue(identity, "prefill" if "prefill" in identity else "decode"), sys.argv[1])
""" % TOOL


class Lab:
    """The namespaces, links and rank processes of one run; ``close`` undoes all of it."""

    def __init__(self, tag: str, workdir: str, hosts=HOSTS, ranks=RANKS) -> None:
        self.tag = tag
        self.workdir = workdir
        self.hosts, self.ranks = hosts, ranks
        self.namespaces: list[str] = []
        self.procs: dict[str, subprocess.Popen] = {}
        self.certs = self.path("certs")
        self.ca = self.path("ca")  # the throwaway CA with its key: only etcd's members issue from it

    def issue(self, python: str) -> None:
        """A throwaway cluster CA (in ``ca/``) and a certificate for each rank and the tools, in ``certs/``."""
        sh(python, "-c", ISSUE, self.certs, self.ca, *self.ranks, timeout=60)

    def tls_env(self, key: str) -> dict[str, str]:
        """``key``'s certificate files, for kvlend and, as its client certificate, for etcd."""
        cert, private = os.path.join(self.certs, f"{key}.pem"), os.path.join(self.certs, f"{key}.key")
        ca = os.path.join(self.certs, "ca.pem")
        return {"KVLEND_CA": ca, "KVLEND_CERT": cert, "KVLEND_KEY": private,
                "KVLEND_ETCD_CA": ca, "KVLEND_ETCD_CERT": cert, "KVLEND_ETCD_KEY": private}

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def build(self) -> None:
        bridge = self.ns("br")
        sh("ip", "netns", "add", bridge)
        self.namespaces.append(bridge)
        sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", bridge, "link", "set", "br0", "up")
        sh("ip", "-n", bridge, "link", "set", "lo", "up")
        for host in self.hosts:
            ns = self.ns(host)
            sh("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            # Both ends are created inside our namespaces: nothing appears in the root one.
            sh("ip", "-n", bridge, "link", "add", f"v-{host}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "-n", bridge, "link", "set", f"v-{host}", "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{ADDR[host]}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def rx_bytes(self, host: str, counter: str = "rx_bytes") -> int:
        return int(sh("ip", "netns", "exec", self.ns(host), "cat", f"/sys/class/net/eth0/statistics/{counter}"))

    def kill_host(self, host: str) -> tuple[list[int], float]:
        """SIGKILL every process in ``host``'s namespace (the host dies); their pids, and the wall-clock time
        just before the first signal (listing the pids takes a subprocess: hundreds of ms on a busy host)."""
        pids = [int(p) for p in sh("ip", "netns", "pids", self.ns(host), check=False).split()]
        at = time.time()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids, at

    def launch(self, key: str, host: str, rank_args: list[str], limit: float, python: str,
               script: str = "multinode_rank.py") -> None:
        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="eth0", PYTHONUNBUFFERED="1", **self.tls_env(key))
        cmd = ["ip", "netns", "exec", self.ns(host), "timeout", "-k", "5", str(int(limit)), python,
               os.path.join(ROOT, "examples", script),
               "--report", self.path(f"{key}.json"), *rank_args]
        log = open(self.path(f"{key}.log"), "w")
        self.procs[key] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True, cwd=ROOT)
        log.close()

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def log_has(self, key: str, text: str) -> bool:
        try:
            with open(self.path(f"{key}.log")) as f:
                return text in f.read()
        except OSError:
            return False

    def result(self, key: str) -> dict | None:
        try:
            with open(self.path(f"{key}.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self.namespaces):
            # Anything still inside one of our namespaces is ours: end it by pid.  A hung `ip`
            # must not leave the namespaces after this one behind: each gets its own try.
            try:
                for pid in sh("ip", "netns", "pids", ns, check=False).split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
            except subprocess.TimeoutExpired:
                print(f"multinode-loopback: listing the processes in {ns} timed out", file=sys.stderr)
            try:
                sh("ip", "netns", "del", ns, check=False)  # takes its veth ends with it
            except subprocess.TimeoutExpired:
                print(f"multinode-loopback: could not delete namespace {ns}: `ip netns del` timed out",
                      file=sys.stderr)
        self.namespaces.clear()
