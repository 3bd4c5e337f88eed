"""The cluster run's report: one JSON line per pair, decode host and prefill host, then a summary, and the
checks each mode must pass.  Pure but for printing: ranks' results come from ``lab.result``."""

from __future__ import annotations

import json
import sys

from .topology import CLUSTER_RANKS, DECODES, PREFILLS, REGISTRY_TTL, host_of, rank_of


def evaluate(lab, mode: str, facts: dict, checks: dict, before: dict, after: dict, hung: list[str]) -> bool:
    """The report lines (JSON on stdout, one human line each on stderr) and the checks they must pass."""
    results = {k: lab.result(k) for k in CLUSTER_RANKS}
    dead = {"kill-prefill": ("p1-prefill",)}.get(mode, ())
    broken = {"break-link": ("d1-decode",)}.get(mode, ())
    checks["ranks_reported"] = all(results[k] is not None for k in CLUSTER_RANKS if k not in dead)
    checks["nothing_hung"] = not hung
    decodes = {d: results[rank_of(d)] or {} for d in DECODES}
    served_from = {p: 0 for p in PREFILLS}
    for d, r in decodes.items():
        for p in PREFILLS:
            stats = r.get("per_prefill", {}).get(rank_of(p), {"requests": 0, "bytes": 0, "busy_seconds": 0.0,
                                                              "gbps": 0.0})
            served_from[p] += stats["bytes"]
            report = {"kind": "pair", "mode": mode, "pair": f"{d}<-{p}", "decode": d, "prefill": p, **stats}
            print(json.dumps(report))
            print(f"     pair {d} <- {p}: {stats['requests']} requests, {stats['bytes'] / 2**20:.1f} MiB, "
                  f"{stats['gbps']} GB/s while busy ({stats['busy_seconds']} s)", file=sys.stderr)
    routed_after_left = 0
    for d, r in decodes.items():
        rx = after[d][0] - before[d][0]
        failures = r.get("failures", [])
        report = {"kind": "decode", "mode": mode, "host": d, "started": r.get("started"), "requests": r.get("requests"),
                  "bytes": r.get("bytes", 0), "rx_bytes": rx, "gbps": r.get("gbps"), "verified": r.get("verified"),
                  "mismatched": len(r.get("mismatched", [])), "lost": len(r.get("lost", [])),
                  "stuck": len(r.get("stuck", [])), "failures": failures,
                  "by_prefill": {host_of(p): s["requests"] for p, s in r.get("per_prefill", {}).items()},
                  "error": r.get("error")}
        report["retried_served_by"] = {q: p and host_of(p) for q, p in r.get("retried", {}).items()}
        if "killed_at" in facts:
            left = next((e["at"] for e in r.get("events", []) if e["event"] == "left"
                         and e["identity"] == "p1-prefill" and e["at"] > facts["killed_at"]), None)
            report["record_left_after_s"] = None if left is None else round(left - facts["killed_at"], 3)
            after_fail = [f["at"] - facts["killed_at"] for f in failures if f["at"] > facts["killed_at"]]
            report["first_failure_after_s"] = round(min(after_fail), 3) if after_fail else None
            late = [t for p, t in r.get("routes", []) if p == "p1-prefill" and left is not None and t >= left]
            report["routed_to_p1_after_left"] = len(late)
            routed_after_left += len(late)
            facts.setdefault("noticed", {})[d] = {"first_failure_s": report["first_failure_after_s"],
                                                  "record_left_s": report["record_left_after_s"]}
        if "link_down_at" in facts:
            report["failed_after_break"] = sum(1 for f in failures if f["at"] > facts["link_down_at"])
        print(json.dumps(report))
        print(f"     decode {d}: {r.get('requests')} of {r.get('started')} requests, "
              f"{report['bytes'] / 2**20:.1f} MiB, "
              f"eth0 rx +{rx / 2**20:.1f} MiB, {len(failures)} typed failures, {report['lost']} lost, "
              f"{report['mismatched']} mismatched, by prefill {report['by_prefill']}", file=sys.stderr)
        checks[f"{d}_no_wrong_kv"] = report["mismatched"] == 0 and not report["stuck"] and r.get("requests", 0) > 0
        checks[f"{d}_rx_covers_bytes"] = rx >= report["bytes"] > 0
        checks[f"{d}_used_both_prefills"] = all(report["by_prefill"].get(p, 0) > 0 for p in PREFILLS)
        if rank_of(d) in broken:
            within = all(f["seconds"] <= f["deadline"] + f["grace"] + 2.0 for f in failures)
            checks[f"{d}_failed_within_deadline"] = report["failed_after_break"] > 0 and within
            in_flight = [f for f in failures if f["started"] < facts["link_down_at"]]
            facts["in_flight_at_break"] = [{k: f[k] for k in ("request", "stage", "error", "seconds")}
                                           for f in in_flight]
            facts["slowest_failure_s"] = max((f["seconds"] for f in failures), default=None)
            checks[f"{d}_in_flight_failed"] = bool(in_flight)
        else:
            checks[f"{d}_verified"] = r.get("verified") is True
            if mode == "kill-prefill":
                typed = all(f["prefill"] == "p1-prefill" and f["at"] > facts["killed_at"]
                            and f["seconds"] <= f["deadline"] + f["grace"] + 2.0 for f in failures)
                checks[f"{d}_failures_typed_on_p1_within_deadline"] = typed
                checks[f"{d}_retried_on_p0"] = all(v == "p0" for v in report["retried_served_by"].values())
                checks[f"{d}_record_left_within_ttl"] = (report["record_left_after_s"] is not None
                                                         and report["record_left_after_s"] <= REGISTRY_TTL + 2.0)
            else:
                checks[f"{d}_no_failures"] = not failures
    if mode == "kill-prefill":
        in_flight = [f for r in decodes.values() for f in r.get("failures", []) if f["started"] < facts["killed_at"]]
        facts["in_flight_at_kill"] = [{k: f[k] for k in ("request", "stage", "error", "seconds")} for f in in_flight]
        checks["in_flight_failed_and_retried"] = bool(in_flight)
        checks["nothing_routed_to_p1_after_left"] = routed_after_left == 0
    for p in PREFILLS:
        r = results[rank_of(p)]
        tx = after[p][1] - before[p][1]
        report = {"kind": "prefill", "mode": mode, "host": p, "tx_bytes": tx, "served_bytes": served_from[p],
                  "lent": (r or {}).get("lent"), "released": (r or {}).get("released"),
                  "leases_left": (r or {}).get("leases_left"), "refused": (r or {}).get("refused")}
        print(json.dumps(report))
        print(f"     prefill {p}: lent {report['lent']}, released {report['released']}, leases left "
              f"{report['leases_left']}, eth0 tx +{tx / 2**20:.1f} MiB for {served_from[p] / 2**20:.1f} MiB served",
              file=sys.stderr)
        checks[f"{p}_tx_covers_bytes"] = tx >= served_from[p] > 0
        if rank_of(p) not in dead:
            checks[f"{p}_leases_all_ended"] = r is not None and r.get("ok") is True
    passed = all(checks.values())
    print(json.dumps({"kind": "summary", "mode": mode, **facts, "checks": checks, "hung": hung, "passed": passed}))
    for name, value in checks.items():
        print(f"{'ok  ' if value else 'FAIL'} {name}", file=sys.stderr)
    shown = {k: v for k, v in facts.items() if k != "etcd"}
    print(f"     {mode}: {shown}", file=sys.stderr)
    return passed
