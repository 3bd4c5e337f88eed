"""The multi-node lab's pure parts (``examples/lab``): the cluster run's checks and report lines, the
topology's names and the parsing of the ranks' log lines; no namespace, process or etcd."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.evaluate import evaluate  # examples/lab (pyproject's pytest pythonpath)
from lab.logs import Logs
from lab.topology import CLUSTER_RANKS, host_of, rank_of

pytestmark = pytest.mark.unit

MIB2 = 2 * 2**20
KILLED_AT = 1000.0
LINK_DOWN_AT = 2000.0


class FakeLab:
    """What ``evaluate`` and ``Logs`` ask of a lab: the ranks' results and where their logs are."""

    def __init__(self, results: dict, workdir: Path | None = None) -> None:
        self.results, self.workdir = results, workdir

    def result(self, key: str) -> dict | None:
        return self.results.get(key)

    def path(self, name: str) -> str:
        return str(self.workdir / name)


def per_prefill(p0: int, p1: int) -> dict:
    return {rank_of(p): {"requests": n, "bytes": n * MIB2, "busy_seconds": 0.5, "gbps": 1.0}
            for p, n in (("p0", p0), ("p1", p1)) if n}


def decode_result(p0: int = 12, p1: int = 12, **extra) -> dict:
    served = p0 + p1
    return {"role": "decode", "started": served, "requests": served, "bytes": served * MIB2, "gbps": 1.0,
            "per_prefill": per_prefill(p0, p1), "failures": [], "retried": {}, "lost": [], "mismatched": [],
            "stuck": [], "routes": [["p0-prefill", 1.0], ["p1-prefill", 1.1]], "events": [], "error": None,
            "verified": True, **extra}


def prefill_result(lent: int) -> dict:
    return {"role": "prefill", "lent": lent, "released": {"done": lent}, "leases_left": 0, "refused": 0, "ok": True}


def failure(request: str, prefill: str, at: float, seconds: float = 1.0, started: float | None = None) -> dict:
    return {"request": request, "prefill": prefill, "stage": "fetch", "error": "PeerLost", "typed": True,
            "message": "", "seconds": seconds, "started": at - seconds if started is None else started, "at": at,
            "deadline": 3.0, "grace": 0.5}


def counters(rx: int = 30 * MIB2, tx: int = 30 * MIB2) -> tuple[dict, dict]:
    """Link counters before and after: every host moved ``rx`` (decode) or ``tx`` (prefill) bytes."""
    before = {h: (0, 0) for h in ("p0", "p1", "d0", "d1")}
    after = {"d0": (rx, 0), "d1": (rx, 0), "p0": (0, tx), "p1": (0, tx)}
    return before, after


def healthy() -> dict:
    return {"d0-decode": decode_result(), "d1-decode": decode_result(),
            "p0-prefill": prefill_result(24), "p1-prefill": prefill_result(24)}


def run_evaluate(capsys, results: dict, mode: str = "nxm", facts: dict | None = None, hung=(),
                 rx: int = 30 * MIB2) -> tuple[bool, dict, list[dict]]:
    checks: dict[str, bool] = {}
    before, after = counters(rx)
    passed = evaluate(FakeLab(results), mode, dict(facts or {}), checks, before, after, list(hung))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return passed, checks, lines


def test_a_clean_run_passes_every_check_and_reports_each_pair_host_and_a_summary(capsys):
    passed, checks, lines = run_evaluate(capsys, healthy())
    assert passed is True and all(checks.values()), checks
    kinds = [line["kind"] for line in lines]
    assert kinds == ["pair"] * 4 + ["decode"] * 2 + ["prefill"] * 2 + ["summary"]
    assert {line["pair"] for line in lines if line["kind"] == "pair"} == {"d0<-p0", "d0<-p1", "d1<-p0", "d1<-p1"}
    decode = next(line for line in lines if line["kind"] == "decode")
    assert decode["by_prefill"] == {"p0": 12, "p1": 12} and decode["rx_bytes"] == 30 * MIB2
    prefill = next(line for line in lines if line["kind"] == "prefill")
    assert prefill["served_bytes"] == 24 * MIB2  # both decodes' bytes from that prefill
    assert lines[-1]["passed"] is True and lines[-1]["checks"] == checks


@pytest.mark.parametrize("spoil, failed_check", [
    (lambda r: r["d0-decode"].update(mismatched=["d0-decode-3"]), "d0_no_wrong_kv"),
    (lambda r: r["d1-decode"].update(verified=False), "d1_verified"),
    (lambda r: r["d0-decode"].update(per_prefill=per_prefill(24, 0)), "d0_used_both_prefills"),
    (lambda r: r["d1-decode"].update(failures=[failure("d1-decode-1", "p0-prefill", 5.0)]), "d1_no_failures"),
    (lambda r: r["p1-prefill"].update(ok=False), "p1_leases_all_ended"),
    (lambda r: r.pop("p0-prefill"), "ranks_reported"),
])
def test_each_fault_in_a_rank_report_fails_its_own_check(capsys, spoil, failed_check):
    results = healthy()
    spoil(results)
    passed, checks, lines = run_evaluate(capsys, results)
    assert passed is False and lines[-1]["passed"] is False
    assert checks[failed_check] is False


def test_bytes_the_link_counters_do_not_cover_fail_the_run(capsys):
    passed, checks, _ = run_evaluate(capsys, healthy(), rx=MIB2)
    assert passed is False and checks["d0_rx_covers_bytes"] is False and checks["d1_rx_covers_bytes"] is False


def test_a_hung_rank_fails_the_run_and_is_named_in_the_summary(capsys):
    passed, checks, lines = run_evaluate(capsys, healthy(), hung=["d1-decode"])
    assert passed is False and checks["nothing_hung"] is False and lines[-1]["hung"] == ["d1-decode"]


def killed_prefill_results(**d0) -> dict:
    """p1 died at KILLED_AT mid-request: each decode's request on it failed and p0 served it again."""
    left = {"event": "left", "identity": "p1-prefill", "at": KILLED_AT + 2.5}
    results = {"p0-prefill": prefill_result(40)}  # p1 left no result: it died
    for d in ("d0", "d1"):
        results[f"{d}-decode"] = decode_result(
            14, 6, failures=[failure(f"{d}-decode-7", "p1-prefill", KILLED_AT + 1.0, started=KILLED_AT - 0.1)],
            retried={f"{d}-decode-7": "p0-prefill"}, events=[left],
            routes=[["p1-prefill", KILLED_AT - 1.0], ["p0-prefill", KILLED_AT + 3.0]])
    results["d0-decode"].update(d0)
    return results


def test_killed_prefill_passes_when_its_requests_fail_typed_and_are_served_by_p0(capsys):
    facts = {"killed_at": KILLED_AT}
    passed, checks, lines = run_evaluate(capsys, killed_prefill_results(), "kill-prefill", facts)
    assert passed is True and all(checks.values()), checks
    decode = next(line for line in lines if line["kind"] == "decode")
    assert decode["record_left_after_s"] == 2.5 and decode["first_failure_after_s"] == 1.0
    assert decode["retried_served_by"] == {"d0-decode-7": "p0"} and decode["routed_to_p1_after_left"] == 0
    assert lines[-1]["noticed"]["d1"] == {"first_failure_s": 1.0, "record_left_s": 2.5}
    assert [f["request"] for f in lines[-1]["in_flight_at_kill"]] == ["d0-decode-7", "d1-decode-7"]


def test_killed_prefill_fails_when_a_request_is_routed_to_p1_after_its_record_left(capsys):
    late = [["p1-prefill", KILLED_AT + 4.0]]
    passed, checks, _ = run_evaluate(capsys, killed_prefill_results(routes=late), "kill-prefill",
                                     {"killed_at": KILLED_AT})
    assert passed is False and checks["nothing_routed_to_p1_after_left"] is False


def test_killed_prefill_fails_when_a_failure_outlasts_its_deadline(capsys):
    slow = [failure("d0-decode-7", "p1-prefill", KILLED_AT + 9.0, seconds=9.0, started=KILLED_AT - 0.1)]
    passed, checks, _ = run_evaluate(capsys, killed_prefill_results(failures=slow), "kill-prefill",
                                     {"killed_at": KILLED_AT})
    assert passed is False and checks["d0_failures_typed_on_p1_within_deadline"] is False


def test_broken_link_passes_when_d1_fails_within_its_deadline_and_d0_verifies(capsys):
    results = healthy()
    results["d1-decode"].update(verified=False, failures=[
        failure("d1-decode-9", "p0-prefill", LINK_DOWN_AT + 3.2, seconds=3.4, started=LINK_DOWN_AT - 0.2),
        failure("d1-decode-10", "p1-prefill", LINK_DOWN_AT + 3.5, seconds=3.0)])
    facts = {"link_down_at": LINK_DOWN_AT}
    passed, checks, lines = run_evaluate(capsys, results, "break-link", facts)
    assert passed is True and all(checks.values()), checks
    assert "d1_verified" not in checks and checks["d0_verified"] is True
    summary = lines[-1]
    assert [f["request"] for f in summary["in_flight_at_break"]] == ["d1-decode-9"]
    assert summary["slowest_failure_s"] == 3.4


def test_broken_link_fails_when_no_request_was_in_flight_at_the_break(capsys):
    results = healthy()
    results["d1-decode"]["failures"] = [failure("d1-decode-10", "p1-prefill", LINK_DOWN_AT + 3.5, seconds=3.0)]
    passed, checks, _ = run_evaluate(capsys, results, "break-link", {"link_down_at": LINK_DOWN_AT})
    assert passed is False and checks["d1_in_flight_failed"] is False


def test_rank_names_and_hosts_round_trip():
    assert [rank_of(host_of(r)) for r in CLUSTER_RANKS] == list(CLUSTER_RANKS)
    assert rank_of("p1") == "p1-prefill" and rank_of("d0") == "d0-decode" and host_of("d1-decode") == "d1"


def test_logs_read_served_failed_fetching_and_registry_events(tmp_path):
    (tmp_path / "d0-decode.log").write_text("\n".join([
        "DISCOVERED p0-prefill p1-prefill",
        "REGISTRY JOINED p0-prefill 10.000",
        "FETCHING d0-decode-0 p0-prefill",
        "FETCHING d0-decode-1 p1-prefill",
        "SERVED d0-decode-0 p0-prefill 2097152 ok",
        "FETCHING d0-decode-2 p1-prefill",
        "FAILED d0-decode-1 p1-prefill fetch PeerLost 1.200",
        "REGISTRY DEGRADED - 20.500",
        "REGISTRY LEFT p1-prefill 21.000",
        "REGISTRY RECOVERED - 25.000",
    ]) + "\n")
    logs = Logs(FakeLab({}, tmp_path))
    assert logs.served("d0-decode") == 1 and logs.served("d0-decode", "p1-prefill") == 0
    assert logs.failed("d0-decode") == 1
    assert logs.fetching("d0-decode", "p1-prefill") == {"d0-decode-2"}  # -1 ended (failed), -2 still running
    assert logs.registry("d0-decode", "LEFT", "p1-prefill") == 21.0
    assert logs.registry("d0-decode", "LEFT", "p1-prefill", after=21.0) is None
    assert logs.registry("d0-decode", "DEGRADED") == 20.5
    assert logs.registry("d0-decode", "RECOVERED", after=20.5) == 25.0
    assert logs.lines("d1-decode") == [] and logs.served("d1-decode") == 0  # no log yet
