"""Multi-node loopback test: prefill and decode ranks on separate "hosts" (Linux
network namespaces) joined by veth links to a bridge, UCX carrying the KV bytes
over TCP on those links (UCX_TLS=tcp: no shared-memory or cma shortcut).

Topology (every name carries this run's PID, so parallel runs never collide):
  pair A: prefill TP1 on host p0  ->  decode TP2, ranks 0 and 1 on host d0
          (each decode rank reads its head slice of the prefill's pages)
  pair B: prefill TP1 on host p1  ->  decode TP1 on host d1
Addresses 10.77.0.0/24 exist only inside the namespaces; the root namespace
is never touched.  Proof that bytes crossed the links: each decode host's
eth0 rx_bytes must grow by at least the bytes its ranks report.

Every run makes its own cluster CA and one certificate per rank (its
identity: A-prefill, A-decode0, ...), with the ranks' Python and
kvlend.security.certs, into the run's private directory; the CA's key is
never written.

--break-link: pair B runs with short deadlines and d1's eth0 is set down
after its first requests; pair B must fail with PeerLost or TransferTimeout
within its deadline while pair A still verifies.

--cluster: hosts p0 and p1 run one prefill each (examples/cluster_rank.py),
d0 and d1 one decode each, e0 three etcd members (python -m
kvlend.cluster.etcd_members, inside e0's namespace).  No decode is given an
address: each finds the prefills in etcd and routes every request to the
least loaded one (POST to the prefill's HTTPS API for a ticket, then the
fetch), so requests spread over the N x M pairs; every byte is checked
against the request's own pattern.  Reported: per pair (decode host x
prefill host) requests, bytes and GB/s while busy; per host the bytes moved
and eth0 rx (decode) or tx (prefill) counters covering them.  Registry TTL
2 s.  One fault per run, each with short deadlines (3 s):
  --kill-prefill  SIGKILL every process of host p1 mid-run: its requests fail
                  typed within the deadline and are served again by p0; its
                  record leaves etcd within the TTL; nothing is routed to p1
                  after that.
  --kill-etcd     kill the etcd leader (a new one is elected, transfers go on),
                  then a second member (no quorum: every rank reports its
                  registry degraded and keeps serving known peers), then
                  restart both (every rank reports recovered).
  --break-link    set d1's eth0 down mid-run: d1's requests fail within their
                  deadline, d0's complete and verify.
The last line on stdout is a JSON summary: "checks" (each true or false) and
"passed".

Exit status: 0 all checks passed, 1 a check failed, 77 cannot run here
(not root, no `ip`, no `tc` with --break-link, namespaces unavailable).  Everything created is removed
on every exit path; every rank runs under `timeout`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile

from .cluster import run_cluster
from .commands import ROOT, skip
from .namespaces import Lab
from .pairs import run_pairs
from .topology import CLUSTER_HOSTS, CLUSTER_RANKS


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16,
                   help="requests per pair (--cluster: per decode host; a fault mode runs until its faults are done)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per request (16 per page)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank-timeout", type=float, default=120.0, help="hard limit per rank process (s)")
    p.add_argument("--break-link", action="store_true", help="set d1's link down during pair B's transfers")
    p.add_argument("--keep-logs", action="store_true", help="keep the rank logs and print where")
    p.add_argument("--cluster", action="store_true",
                   help="2 prefill hosts x 2 decode hosts found through 3 etcd members on host e0")
    p.add_argument("--kill-prefill", action="store_true", help="with --cluster: SIGKILL host p1 mid-run")
    p.add_argument("--kill-etcd", action="store_true",
                   help="with --cluster: kill the etcd leader, then a second member, then restart both")
    args = p.parse_args(argv)
    faults = args.break_link + args.kill_prefill + args.kill_etcd
    if (args.kill_prefill or args.kill_etcd) and not args.cluster:
        p.error("--kill-prefill and --kill-etcd need --cluster")
    if faults > 1:
        p.error("one fault per run: --break-link, --kill-prefill or --kill-etcd")

    if os.geteuid() != 0:
        skip("needs root to create network namespaces")
    for tool in ("ip", "timeout") + (("tc",) if args.break_link or args.kill_prefill else ()):
        if shutil.which(tool) is None:
            skip(f"`{tool}` not found on PATH")
    python = os.environ.get("KVLEND_PYTHON", os.path.join(ROOT, ".venv", "bin", "python"))
    if not os.access(python, os.X_OK):
        skip(f"no Python at {python} (run scripts/setup)")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    workdir = tempfile.mkdtemp(prefix="kvl-multinode-")
    if args.cluster:
        lab = Lab(f"kvl{os.getpid()}", workdir, CLUSTER_HOSTS, CLUSTER_RANKS)
    else:
        lab = Lab(f"kvl{os.getpid()}", workdir)
    try:
        return run_cluster(lab, args, python) if args.cluster else run_pairs(lab, args, python)
    finally:
        lab.close()
        if args.keep_logs:
            print(f"logs in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
