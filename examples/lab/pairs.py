"""The default run: pair A (prefill TP1 -> decode TP2) and pair B (TP1 -> TP1), optionally with B's link
broken mid-transfer."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from .commands import sh, skip
from .namespaces import Lab
from .topology import ADDR, PORT

FAILURES = ("PeerLost", "TransferTimeout")


def run_pairs(lab: Lab, args, python: str) -> int:
    lab.issue(python)
    try:
        lab.build()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        if "Operation not permitted" in str(exc) or "Permission denied" in str(exc):
            skip(f"cannot create network namespaces: {exc}")
        raise

    common = ["--requests", str(args.requests), "--tokens", str(args.tokens), "--layers", str(args.layers)]
    fast = ["--timeout", "30", "--transfer-timeout", "20", "--ttl", "20"]
    # Pair B under --break-link: short deadlines, and d1's link slowed (80 Mbit/s, about 0.2 s per
    # request) so the break lands while a request's reads are in flight.
    short = ["--timeout", "30", "--transfer-timeout", "3", "--ttl", "3"] if args.break_link else fast
    if args.break_link:
        sh("tc", "-n", lab.ns("br"), "qdisc", "add", "dev", "v-d1", "root", "tbf", "rate", "80mbit",
           "burst", "64kb", "latency", "500ms")
    limit = args.rank_timeout
    before = {h: lab.rx_bytes(h) for h in ("d0", "d1")}
    start = time.monotonic()
    lab.launch("A-prefill", "p0", ["--role", "prefill", "--host", ADDR["p0"], "--port", str(PORT), "--peers", "2",
                                   *common, *fast], limit, python)
    lab.launch("B-prefill", "p1", ["--role", "prefill", "--host", ADDR["p1"], "--port", str(PORT), "--peers", "1",
                                   *common, *short], limit, python)
    for r in (0, 1):
        lab.launch(f"A-decode{r}", "d0", ["--role", "decode", "--connect", f"{ADDR['p0']}:{PORT}", "--tp-size", "2",
                                          "--tp-rank", str(r), *common, *fast], limit, python)
    lab.launch("B-decode0", "d1", ["--role", "decode", "--connect", f"{ADDR['p1']}:{PORT}", *common, *short],
               limit, python)

    broke_at = None
    deadline = start + limit + 15
    while any(proc.poll() is None for proc in lab.procs.values()) and time.monotonic() < deadline:
        if args.break_link and broke_at is None and lab.log_has("B-decode0", "FETCHING req-2"):
            time.sleep(0.05)  # into req-2's reads
            sh("ip", "-n", lab.ns("d1"), "link", "set", "eth0", "down")
            broke_at, broke_wall = time.monotonic() - start, time.time()
        time.sleep(0.02)
    hung = [k for k, proc in lab.procs.items() if proc.poll() is None]
    after = {h: lab.rx_bytes(h) for h in ("d0", "d1")}

    pairs = {"A": ("p0 tp1 -> d0 tp2", ["A-decode0", "A-decode1"], "d0"),
             "B": ("p1 tp1 -> d1 tp1", ["B-decode0"], "d1")}
    ok = True
    for pair, (desc, keys, host) in pairs.items():
        results = [lab.result(k) for k in keys]
        complete = all(r is not None for r in results)
        nbytes = sum(r["bytes"] for r in results if r)
        seconds = max((r["seconds"] for r in results if r), default=0.0)
        rx = after[host] - before[host]
        verified = complete and all(r["verified"] for r in results) and rx >= nbytes > 0
        report = {"pair": pair, "topology": desc, "bytes": nbytes, "seconds": round(seconds, 4),
                  "gbps": round(nbytes / seconds / 1e9, 3) if seconds else 0.0, "rx_bytes": rx,
                  "verified": verified}
        expect_failure = args.break_link and pair == "B"
        if expect_failure:
            failures = [f for r in results if r for f in r["failures"]]
            first = failures[0] if failures else None
            prefill = lab.result("B-prefill") or {}
            leaked = prefill.get("offered", -1) - sum(prefill.get("released", {}).values())
            report.update(link_down_at_s=broke_at, failure=first, leases_not_released=leaked)
            passed = (broke_at is not None and first is not None and first["error"] in FAILURES
                      and first["seconds"] <= first["deadline"] + first["grace"] + 2.0 and leaked == 0)
            if first is not None and broke_at is not None:
                report["mid_transfer"] = first["started"] < broke_wall
        else:
            passed = verified
            if not complete:
                report["missing"] = [k for k, r in zip(keys, results) if r is None]
        report["passed"] = passed
        ok &= passed
        print(json.dumps(report))
        mark = "ok  " if passed else "FAIL"
        line = (f"{mark} pair {pair} ({desc}): {nbytes / 2**20:.1f} MiB in {seconds:.3f} s, "
                f"{report['gbps']} GB/s, {host} eth0 rx +{rx / 2**20:.1f} MiB, verified {'yes' if verified else 'no'}")
        if expect_failure:
            line += (f"; link down at {broke_at and round(broke_at, 2)} s "
                     f"(mid-transfer: {report.get('mid_transfer')}), "
                     f"failure {report['failure']}, prefill leases left {report['leases_not_released']}")
        print(line, file=sys.stderr)
    if not args.break_link:
        for key in ("A-prefill", "B-prefill"):
            r = lab.result(key)
            if not (r and r["ok"]):
                print(f"FAIL {key}: {r}", file=sys.stderr)
                ok = False
    if hung:
        print(f"FAIL ranks still running at the deadline (killed): {hung}", file=sys.stderr)
        ok = False
    if not ok:
        for key in lab.procs:
            with open(lab.path(f"{key}.log")) as f:
                tail = f.read()[-1500:]
            rc = lab.procs[key].poll()
            why = " (killed by timeout)" if rc in (124, 137) else ""
            print(f"--- {key} (rc {rc}{why}):\n{tail}", file=sys.stderr)
    print(f"multinode-loopback: {'PASS' if ok else 'FAIL'} in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return 0 if ok else 1
