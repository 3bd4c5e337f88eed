"""The ``--cluster`` run: etcd on e0, two prefill and two decode hosts finding each other through it,
one fault at most, then the report."""

from __future__ import annotations

import subprocess
import sys
import time

from . import faults
from .commands import ROOT, sh, skip
from .etcd_host import EtcdHost
from .evaluate import evaluate
from .logs import Logs, wait_until
from .namespaces import Lab
from .topology import ADDR, DECODES, PORT, PREFILLS, REGISTRY_TTL, rank_of


def run_cluster(lab: Lab, args, python: str) -> int:
    mode = "kill-prefill" if args.kill_prefill else "kill-etcd" if args.kill_etcd else \
        "break-link" if args.break_link else "nxm"
    fault = mode != "nxm"
    limit = args.rank_timeout
    probe = subprocess.run([python, "-c", "import os, aetcd; from kvlend.cluster.etcd_members import etcd_binary; "
                            "b = etcd_binary(); assert os.access(b, os.X_OK), f'etcd binary {b} is not executable'"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    if probe.returncode:
        skip(f"--cluster needs etcd and the etcd client: {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    lab.issue(python)
    try:
        lab.build()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        if "Operation not permitted" in str(exc) or "Permission denied" in str(exc):
            skip(f"cannot create network namespaces: {exc}")
        raise
    # The faulty host's link slowed so the fault lands while reads are in flight: 300 Mbit/s is some 60 ms a
    # request; p1 gets 100 (some 170 ms), since the kill follows the sight of a fetch from it, which at 60 ms
    # was over before the kill on a loaded host.
    slow = {"kill-prefill": ("p1", "eth0", "100mbit"), "break-link": ("br", "v-d1", "300mbit")}.get(mode)
    if slow:
        sh("tc", "-n", lab.ns(slow[0]), "qdisc", "add", "dev", slow[1], "root", "tbf", "rate", slow[2],
           "burst", "64kb", "latency", "500ms")
    start = time.monotonic()
    etcd = EtcdHost(lab, python, limit + 30)
    logs = Logs(lab)
    stop_file = lab.path("stop")
    deadlines = ["--timeout", "30", "--transfer-timeout", "3", "--ttl", "3"] if fault else \
        ["--timeout", "30", "--transfer-timeout", "10", "--ttl", "10"]
    common = ["--etcd", ",".join(etcd.endpoints), "--prefix", etcd.prefix, "--registry-ttl",
              str(REGISTRY_TTL), "--tokens", str(args.tokens), "--layers", str(args.layers), *deadlines]
    before = {h: (lab.rx_bytes(h), lab.rx_bytes(h, "tx_bytes")) for h in PREFILLS + DECODES}
    for host in PREFILLS:
        lab.launch(rank_of(host), host, ["--role", "prefill", "--host", ADDR[host], "--port", str(PORT),
                                         "--api-port", str(PORT + 1), "--serve", str(limit - 5),
                                         "--stop-file", lab.path("stop-prefills"), *common],
                   limit, python, "cluster_rank.py")
    amount = ["--requests", "0", "--stop-file", stop_file, "--pause", "0.02"] if fault else \
        ["--requests", str(args.requests)]
    for host in DECODES:  # no prefill address: they find the prefills in etcd
        lab.launch(rank_of(host), host, ["--role", "decode", "--prefills", "2", "--concurrency", "4",
                                         "--serve", str(limit - 15), *amount, *common], limit, python,
                   "cluster_rank.py")
    decodes = tuple(rank_of(h) for h in DECODES)
    facts: dict = {"mode": mode, "etcd": etcd.endpoints}
    checks: dict[str, bool] = {}

    def warmed() -> bool:  # each decode has requests served by each prefill
        return all(logs.served(d, rank_of(p)) >= 3 for d in decodes for p in PREFILLS)

    try:
        if fault:
            checks["warmed_up"] = wait_until(warmed, 40, lab, decodes)
            if mode == "kill-prefill":
                faults.kill_prefill(lab, etcd, logs, decodes, facts, checks)
            elif mode == "kill-etcd":
                faults.kill_etcd(lab, etcd, logs, decodes, facts, checks)
            else:
                faults.break_link(lab, logs, decodes, facts, checks)
            with open(stop_file, "w"):
                pass
        wait_until(lambda: all(lab.procs[d].poll() is not None for d in decodes),
                   limit + 15 - (time.monotonic() - start), lab)
        with open(lab.path("stop-prefills"), "w"):  # then the prefills: they drain their leases and report
            pass
        wait_until(lambda: all(lab.procs[rank_of(p)].poll() is not None for p in PREFILLS), 25, lab)
    finally:
        etcd.close()
    hung = [k for k, proc in lab.procs.items() if proc.poll() is None]
    after = {h: (lab.rx_bytes(h), lab.rx_bytes(h, "tx_bytes")) for h in PREFILLS + DECODES}
    ok = evaluate(lab, mode, facts, checks, before, after, hung)
    if not ok:  # the ranks' last words (their results are above), then the checks again: the last lines show why
        for key in lab.procs:
            lines = [line for line in logs.lines(key) if not line.startswith("RESULT ")]
            tail = "\n".join(line[:300] for line in lines[-20:])
            rc = lab.procs[key].poll()
            print(f"--- {key} (rc {rc}{' (killed by timeout)' if rc in (124, 137) else ''}):\n{tail}", file=sys.stderr)
        print(f"failed checks: {[name for name, value in checks.items() if not value]}", file=sys.stderr)
    print(f"multinode-loopback --cluster {mode}: {'PASS' if ok else 'FAIL'} in {time.monotonic() - start:.1f} s",
          file=sys.stderr)
    return 0 if ok else 1
