"""The cluster run's faults, one per run, each while requests are under way: a prefill host killed, etcd's
leader and then its quorum lost, a decode host's link broken.  Each records facts and checks."""

from __future__ import annotations

import time

from .commands import sh
from .etcd_host import EtcdHost, cluster_status
from .logs import Logs, wait_until
from .namespaces import Lab
from .topology import CLUSTER_RANKS, PREFILLS, REGISTRY_TTL, rank_of


def kill_prefill(lab: Lab, etcd: EtcdHost, logs: Logs, decodes, facts: dict, checks: dict) -> None:
    """SIGKILL every process of host p1 while requests run; wait until every decode saw its record leave."""
    dead = rank_of("p1")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(logs.fetching(d, dead) for d in decodes):
        time.sleep(0.005)  # kill while a fetch from p1 is under way
    pids, facts["killed_at"] = lab.kill_host("p1")  # a fetch started before the signal was in flight at it
    facts["killed_pids"] = len(pids)
    checks["record_left_everywhere"] = wait_until(
        lambda: all(logs.registry(d, "LEFT", dead, facts["killed_at"]) for d in decodes), REGISTRY_TTL + 8, lab,
        decodes)
    facts["listed_after_left"] = cluster_status(lab, etcd)
    checks["p1_not_in_etcd"] = facts["listed_after_left"] == sorted({*CLUSTER_RANKS} - {dead})
    served = {d: logs.served(d) for d in decodes}
    # Requests go on for a while after the record left: none of them may be routed to p1.
    checks["served_after_left"] = wait_until(lambda: all(logs.served(d) >= served[d] + 8 for d in decodes), 15, lab,
                                             decodes)


def kill_etcd(lab: Lab, etcd: EtcdHost, logs: Logs, decodes, facts: dict, checks: dict) -> None:
    """Kill the etcd leader, then a second member (no quorum), then restart both; requests run throughout."""
    ranks = tuple(rank_of(p) for p in PREFILLS) + decodes
    served = {d: logs.served(d) for d in decodes}
    facts["leader_killed_at"] = time.time()  # before the command: a rank may notice before it returns
    first = facts["leader_killed"] = etcd.ask("kill-leader")["killed"]
    facts["new_leader"] = etcd.ask("leader")["leader"]
    checks["new_leader_elected"] = facts["new_leader"] != first
    checks["served_after_leader_kill"] = wait_until(lambda: all(logs.served(d) >= served[d] + 8 for d in decodes),
                                                    15, lab, decodes)

    def recovered(key: str, since: float) -> bool:
        down = logs.registry(key, "DEGRADED", after=since)
        return down is None or logs.registry(key, "RECOVERED", after=down) is not None

    checks["recovered_from_leader_kill"] = wait_until(
        lambda: all(recovered(k, facts["leader_killed_at"]) for k in ranks), 10, lab, decodes)
    facts["degraded_by_leader_kill"] = [k for k in ranks
                                        if logs.registry(k, "DEGRADED", after=facts["leader_killed_at"])]
    second = facts["new_leader"]
    facts["quorum_lost_at"], facts["second_killed"] = time.time(), second
    etcd.ask(f"kill {second}")
    checks["all_ranks_degraded"] = wait_until(
        lambda: all(logs.registry(k, "DEGRADED", after=facts["quorum_lost_at"]) for k in ranks), 10, lab, decodes)
    facts["degraded_after_s"] = {k: round(t - facts["quorum_lost_at"], 3) for k in ranks
                                 if (t := logs.registry(k, "DEGRADED", after=facts["quorum_lost_at"]))}
    served = {d: logs.served(d) for d in decodes}
    # The outage outlasts the records' TTL: no rank may lose its peers for want of etcd.
    outage_until = facts["quorum_lost_at"] + REGISTRY_TTL + 1.5
    checks["served_while_degraded"] = wait_until(
        lambda: time.time() >= outage_until and all(logs.served(d) >= served[d] + 4 for d in decodes), 15, lab, decodes)
    facts["served_while_degraded"] = {d: logs.served(d) - served[d] for d in decodes}
    facts["restarted_at"] = time.time()
    etcd.ask(f"start {first}")
    etcd.ask(f"start {second}")
    checks["etcd_healthy_again"] = etcd.wait_healthy(20)
    checks["all_ranks_recovered"] = wait_until(
        lambda: all(logs.registry(k, "RECOVERED", after=facts["restarted_at"]) for k in ranks), 15, lab, decodes)
    facts["recovered_after_s"] = {k: round(t - facts["restarted_at"], 3) for k in ranks
                                  if (t := logs.registry(k, "RECOVERED", after=facts["restarted_at"]))}
    served = {d: logs.served(d) for d in decodes}
    checks["served_after_recovery"] = wait_until(lambda: all(logs.served(d) >= served[d] + 4 for d in decodes), 10,
                                                 lab, decodes)
    listed = cluster_status(lab, etcd)
    facts["listed_after_recovery"] = listed
    checks["all_records_in_etcd_after_recovery"] = listed == sorted(ranks)


def break_link(lab: Lab, logs: Logs, decodes, facts: dict, checks: dict) -> None:
    """Set d1's link down while requests run; d1's fail within their deadline, d0's go on."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(logs.fetching(rank_of("d1"), rank_of(p)) for p in PREFILLS):
        time.sleep(0.005)  # break it while d1 is reading
    served = logs.served(rank_of("d0"))
    failed = logs.failed(rank_of("d1"))
    sh("ip", "-n", lab.ns("d1"), "link", "set", "eth0", "down")
    facts["link_down_at"] = time.time()  # once it is down: a busy host may take a while to run ip
    checks["d1_failed"] = wait_until(lambda: logs.failed(rank_of("d1")) > failed, 15, lab, decodes)
    time.sleep(3.0 + 1.5 + 1.0)  # past one request's deadline: d1's in-flight requests have all ended
    checks["d0_served_meanwhile"] = logs.served(rank_of("d0")) >= served + 8
