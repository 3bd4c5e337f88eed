"""``scripts/multinode-loopback``: real ranks on separate network namespaces, bytes over veth links.

Needs root and ``ip`` (the script exits 77 otherwise, which becomes a skip
naming the reason); the ``--cluster`` runs also need ``tc``, etcd and its
client.  Each run must leave no namespace and no etcd member behind.  The
``--cluster`` tests assert each mode's properties from its JSON report lines
(pair, decode, prefill and summary), not just its exit status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlend.security.certs import Authority

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "multinode-loopback"
SKIP = 77

pytestmark = pytest.mark.system


def run(*args: str, env: dict | None = None, timeout: float = 240) -> tuple[int, list[dict], str, int]:
    """Run the script; return its status, JSON report lines, stderr and pid."""
    environ = {**os.environ, "KVLEND_PYTHON": sys.executable, **(env or {})}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=environ)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the script's own handler cleans up on SIGTERM
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"multinode-loopback ran past {timeout} s:\n{err[-3000:]}")
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, reports, err, proc.pid


def leftover_namespaces(pid: int) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(f"kvl{pid}-")]


def run_or_skip(*args: str) -> tuple[list[dict], str]:
    rc, reports, err, pid = run(*args)
    if rc == SKIP:
        pytest.skip(err.strip().splitlines()[-1] if err.strip() else "multinode-loopback cannot run here")
    assert leftover_namespaces(pid) == [], "the script left network namespaces behind"
    assert rc == 0, err[-6000:]
    return reports, err


def test_pairs_verify_and_bytes_cross_the_links():
    reports, err = run_or_skip("--requests", "8")
    by_pair = {r["pair"]: r for r in reports}
    assert set(by_pair) == {"A", "B"}, reports
    # Pair A: each TP2 decode rank read half of the TP1 prefill's heads, so A and B move the same bytes.
    assert by_pair["A"]["bytes"] == by_pair["B"]["bytes"] == 8 * 2 * 2**20
    for r in reports:
        assert r["verified"] is True and r["passed"] is True, r
        assert r["rx_bytes"] >= r["bytes"] > 0, r
        assert r["gbps"] > 0
    assert "PASS" in err


def test_broken_link_fails_typed_within_deadline_and_other_pair_completes():
    reports, err = run_or_skip("--break-link", "--requests", "8")
    by_pair = {r["pair"]: r for r in reports}
    assert by_pair["A"]["verified"] is True and by_pair["A"]["rx_bytes"] >= by_pair["A"]["bytes"] > 0
    broken = by_pair["B"]
    assert broken["verified"] is False and broken["link_down_at_s"] is not None
    failure = broken["failure"]
    assert failure["error"] in ("PeerLost", "TransferTimeout"), failure
    # Reported once nothing can land: the aborted reads' agent retired and drained (docs/faults.md).
    assert failure["seconds"] <= failure["deadline"] + failure["grace"] + 2.0, failure
    assert broken["leases_not_released"] == 0  # the prefill's leases expired: no page stays locked


def test_missing_python_is_a_distinct_status_and_creates_nothing():
    rc, reports, err, pid = run(env={"KVLEND_PYTHON": "/nonexistent/python"}, timeout=60)
    assert rc == SKIP and reports == []
    assert "SKIP" in err
    if os.geteuid() == 0:
        assert leftover_namespaces(pid) == []


# ---------------------------------------------------------------- --cluster: N x M through etcd
MIB2 = 2 * 2**20  # one request: 256 tokens x 8 heads x 64 x fp16, K and V, 4 layers
DECODE_HOSTS, PREFILL_HOSTS = ("d0", "d1"), ("p0", "p1")
RANKS = ["d0-decode", "d1-decode", "p0-prefill", "p1-prefill"]


def cluster(*args: str) -> tuple[dict, dict, dict, dict]:
    """Run a --cluster mode: its pair, decode and prefill reports (by name) and the summary."""
    reports, err = run_or_skip("--cluster", *args)
    kinds = {kind: [r for r in reports if r.get("kind") == kind] for kind in ("pair", "decode", "prefill", "summary")}
    assert len(kinds["summary"]) == 1, reports
    summary = kinds["summary"][0]
    assert summary["passed"] is True and all(summary["checks"].values()), summary["checks"]
    assert summary["hung"] == []
    assert "PASS" in err
    for endpoint in summary["etcd"]:  # the etcd members went with their namespace
        left = subprocess.run(["pgrep", "-f", f"listen-client-urls http://{endpoint}"], capture_output=True, text=True)
        assert left.stdout.strip() == "", f"etcd member at {endpoint} still running"
    pairs = {r["pair"]: r for r in kinds["pair"]}
    assert set(pairs) == {f"{d}<-{p}" for d in DECODE_HOSTS for p in PREFILL_HOSTS}
    return pairs, {r["host"]: r for r in kinds["decode"]}, {r["host"]: r for r in kinds["prefill"]}, summary


def within_deadline(failure: dict) -> bool:
    return failure["seconds"] <= failure["deadline"] + failure["grace"] + 2.0


def test_cluster_decodes_find_prefills_in_etcd_and_every_pair_verifies():
    pairs, decodes, prefills, _ = cluster("--requests", "24")
    for pair in pairs.values():  # the router spread each decode's requests over both prefills
        assert pair["requests"] > 0 and pair["bytes"] == pair["requests"] * MIB2 and pair["gbps"] > 0, pair
    for _host, d in decodes.items():
        assert d["started"] == d["requests"] == 24 and d["verified"] is True, d
        assert d["failures"] == [] and d["lost"] == d["mismatched"] == d["stuck"] == 0
        assert d["bytes"] == 24 * MIB2 <= d["rx_bytes"]  # the bytes crossed this host's link
        assert sum(d["by_prefill"].values()) == 24 and set(d["by_prefill"]) == set(PREFILL_HOSTS)
    for host, p in prefills.items():
        served = sum(pairs[f"{d}<-{host}"]["requests"] for d in DECODE_HOSTS)
        assert p["lent"] == served and p["released"] == {"done": served} and p["leases_left"] == 0, p
        assert p["tx_bytes"] >= p["served_bytes"] == served * MIB2


def test_cluster_killed_prefill_host_fails_typed_and_p0_serves_its_requests():
    pairs, decodes, prefills, summary = cluster("--kill-prefill")
    killed = summary["killed_at"]
    assert summary["in_flight_at_kill"], "no request was in flight on p1 when it died"
    assert summary["listed_after_left"] == ["d0-decode", "d1-decode", "p0-prefill"]  # etcd itself, asked from e0
    for _host, d in decodes.items():
        assert d["verified"] is True and d["lost"] == d["mismatched"] == 0, d  # every request served, none wrong
        for failure in d["failures"]:  # only p1's requests failed, typed, within their deadline, after the kill
            assert failure["prefill"] == "p1-prefill" and failure["at"] > killed and within_deadline(failure), failure
        assert d["retried_served_by"] and set(d["retried_served_by"].values()) == {"p0"}
        assert 0 < d["record_left_after_s"] <= 2.0 + 2.0  # registry TTL 2 s
        assert d["routed_to_p1_after_left"] == 0
        assert d["by_prefill"]["p0"] > d["by_prefill"]["p1"] > 0
    assert prefills["p0"]["leases_left"] == 0 and prefills["p1"]["lent"] is None  # p1 died without a word


def test_cluster_etcd_leader_and_quorum_loss_keep_transfers_going():
    pairs, decodes, prefills, summary = cluster("--kill-etcd")
    assert summary["new_leader"] != summary["leader_killed"]
    assert sorted(summary["degraded_after_s"]) == RANKS  # no quorum: every rank says so ...
    assert all(n > 0 for n in summary["served_while_degraded"].values())  # ... and serves its known peers meanwhile
    assert sorted(summary["recovered_after_s"]) == RANKS  # members back: every rank recovered
    assert summary["listed_after_recovery"] == RANKS
    for d in decodes.values():
        assert d["verified"] is True and d["failures"] == [] and d["lost"] == d["mismatched"] == 0, d
    for p in prefills.values():
        assert p["leases_left"] == 0 and set(p["released"]) == {"done"}, p


def test_cluster_broken_decode_link_fails_within_deadline_and_the_other_decode_verifies():
    pairs, decodes, prefills, summary = cluster("--break-link")
    good, broken = decodes["d0"], decodes["d1"]
    assert good["verified"] is True and good["failures"] == [] and good["lost"] == 0, good
    assert broken["verified"] is False and broken["failed_after_break"] > 0 and broken["mismatched"] == 0
    assert broken["requests"] > 0  # it verified what it fetched before the break
    assert summary["in_flight_at_break"], "no request of d1 was in flight when its link went down"
    assert all(within_deadline(f) for f in broken["failures"]), broken["failures"]
    for p in prefills.values():  # d1's leases ended (expired or released): no page stays locked
        assert p["leases_left"] == 0, p


def test_etcd_members_command_line_answers_and_stops_its_members(tmp_path):
    """The helper --cluster runs in host e0, here on loopback: one JSON line per command."""
    Authority.create().save(str(tmp_path / "ca"))
    proc = subprocess.Popen([sys.executable, "-m", "kvlend.cluster.etcd_members", "--members", "3",
                             "--workdir", str(tmp_path / "etcd"), "--ca", str(tmp_path / "ca")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate("leader\nkill-leader\nleader\nstatus\nkill 7\nquit\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [json.loads(line) for line in out.splitlines()]
    started, first, killed, second, status, bad, quit_ = lines
    assert len(started["endpoints"]) == len(started["pids"]) == 3
    assert killed == {"killed": first["leader"], "leader": first["leader"]} and second["leader"] != first["leader"]
    alive = [m["alive"] for m in status["members"]]
    assert alive.count(False) == 1 and not alive[first["leader"]]
    assert "error" in bad and quit_ == {"quit": True} and proc.returncode == 0
    for pid in started["pids"]:  # quit stopped every member
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
