"""``kvlend bench``: the quick run's report shape, verified bytes, and its helpers (no timing asserts)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest

from kvlend import cli
from kvlend_nixl.bench.pools import fragmented, min_descriptors
from kvlend_nixl.bench.reference import in_process_read
from kvlend_nixl.bench.report import format_report, throughputs

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, Path]:
    """One real quick run (two NIXL agents, two processes) with ``--plot``, shared by the checks below."""
    import contextlib
    import io

    png = tmp_path_factory.mktemp("bench") / "tmp.png"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["bench", "--quick", "--json", "--plot", str(png)])
    assert code == cli.EXIT_OK, err.getvalue()
    assert "scenario 1:" in err.getvalue() and "scenario 3:" in err.getvalue()  # progress lines on stderr
    return json.loads(out.getvalue()), png


@pytest.fixture(scope="module")
def quick_report(quick_run) -> dict:
    return quick_run[0]


def test_plot_is_a_png_of_throughput_per_method(quick_run):
    report, png = quick_run
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    labels, series = throughputs(report)
    assert len(labels) == 3  # scenario 3 (16 pages), scenario 2 (1k tokens), scenario 1 (one lease)
    assert labels[0].startswith("16 pages") and labels[-1].startswith("one contiguous lease")
    assert [i for i, _ in series["kvlend"]] == [0, 1, 2]  # kvlend is measured at every size
    assert set(series) == {"kvlend", "raw NIXL, kvlend's descriptors", "raw NIXL, one descriptor per page",
                           "raw NIXL, kvlend's descriptors, the target freeing blocks per notification",
                           "raw NIXL, prepared page lists by index, the target freeing blocks per notification",
                           "kvlend through the nodes",
                           "kvlend through the nodes, reads ahead of the claim's answer",
                           "kvlend through the nodes, claimed a request ahead",
                           "host staging (gather + read + scatter)",
                           "raw NIXL, one descriptor", "memcpy (same process)"}
    assert all(gbps > 0 for points in series.values() for _, gbps in points)


def _check_stats(r: dict) -> None:
    assert r["n"] >= 1
    assert 0 < r["min_ms"] <= r["p50_ms"] <= r["max_ms"]
    assert r["p10_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["max_ms"]


def test_quick_report_has_every_scenario_and_machine_facts(quick_report):
    assert set(quick_report["scenarios"]) == {"1", "2", "3", "4", "5", "6", "7"}
    m = quick_report["machine"]
    assert m["nproc"] >= 1 and m["memory_gib"] > 0 and m["cpu"]
    assert not multiprocessing.active_children()  # the lender process was reaped


def test_scenario_1_kvlend_moved_verified_bytes(quick_report):
    (s1,) = quick_report["scenarios"]["1"]["requests"]  # --quick: the 8 MiB lease only
    assert s1["bytes"] == 8 << 20 and set(s1["targets"]) == {"kvlend/raw >= 0.90"}
    assert set(s1["results"]) == {"kvlend", "raw_nixl", "memcpy"}
    for r in s1["results"].values():
        _check_stats(r)
        assert r["gbps"] > 0
    assert s1["results"]["kvlend"]["verified"] is True
    assert s1["results"]["raw_nixl"]["verified"] is True
    assert s1["results"]["kvlend"]["descriptors"] == 1  # one contiguous lease, one descriptor
    assert set(s1["ratios"]) == {"kvlend/raw", "kvlend/memcpy"} and all(v > 0 for v in s1["ratios"].values())


def test_scenario_2_descriptors_and_every_path_verified(quick_report):
    (req,) = quick_report["scenarios"]["2"]["requests"]
    assert req["tokens"] == 1024 and req["pages"] == 64
    d = req["descriptors"]
    assert d["per_page"] == req["pages"] * 2 * req["layers"]
    assert d["minimum"] <= d["kvlend"] < d["per_page"]  # coalesced, never below the contiguous minimum
    for name, r in req["results"].items():
        _check_stats(r)
        assert r["verified"] is True, name
    assert set(req["results"]["staging"]["steps"]) == {"gather", "transfer", "scatter"}
    assert set(req["targets"]) == {"descriptors == minimum", "kvlend/raw_same >= 0.90", "kvlend/staging >= 1.5"}


def test_scenario_3_latencies_and_notifications(quick_report):
    s3 = quick_report["scenarios"]["3"]
    for r in s3["results"].values():
        _check_stats(r)
        assert r["verified"] is True
    assert set(s3["results"]) == {"kvlend", "raw_nixl_notif", "raw_nixl_prepped", "kvlend_node", "kvlend_node_ahead",
                                  "kvlend_node_claimed_ahead"}
    assert s3["node_overhead_ms"] == s3["results"]["kvlend_node"]["p50_ms"] - s3["results"]["kvlend"]["p50_ms"]
    n = s3["results"]["raw_nixl_notif"]["n"]
    # Both raw baselines notify every read, warm-up and verifying runs included: the target saw them all
    # and freed each request's blocks, as NixlConnector's engine does.
    sent = 2 * (n + 6)
    assert s3["notifications"] == {"sent": sent, "seen_by_target": sent, "freed_by_target": sent,
                                   "unknown_to_target": 0}
    assert "NixlConnector" in s3["baseline"]
    for name in ("kvlend_node", "kvlend_node_ahead"):
        _check_breakdown(s3["results"][name]["breakdown"])
    _check_breakdown(s3["results"]["kvlend_node_claimed_ahead"]["breakdown"], claimed_ahead=True)
    assert "no TCP control channel" in s3["path"]


def test_scenario_5_reads_every_request_with_many_in_flight_both_ways(quick_report):
    s5 = quick_report["scenarios"]["5"]
    assert (s5["count"], s5["inflight"]) == (24, 8)
    for name in ("kvlend", "kvlend_read_ahead", "raw_nixl_notif"):
        r = s5["results"][name]
        assert r["verified"] is True and r["seconds"] > 0
        assert r["gbps"] == pytest.approx(s5["bytes"] / r["seconds"] / 1e9)
        assert r["requests_per_s"] == pytest.approx(24 / r["seconds"])
    assert set(s5["targets"]) == {"GB/s kvlend/raw >= 0.60", "GB/s kvlend_read_ahead/raw >= 0.60"}
    assert set(s5["aims"]) == {"GB/s kvlend/raw >= 0.80", "GB/s kvlend_read_ahead/raw >= 0.80"}
    assert s5["results"]["raw_nixl_notif"]["notifications"] == {"sent": 24, "seen_by_target": 24,
                                                                "freed_by_target": 24, "unknown_to_target": 0}
    for name in ("kvlend", "kvlend_read_ahead"):
        _check_breakdown(s5["results"][name]["breakdown"])


def _check_breakdown(b: dict, claimed_ahead: bool = False) -> None:
    """The p50 of each phase of the fetches' timelines, in ms: every ticket fetch reached each step up to
    usable; only one whose reads landed after its lease's window waits for an ack (protocol 6), so the
    last phase may have no sample.  A fetch of a ticket ``claimed_ahead`` whose offer was already held
    when it started has no claim of its own: the first phase may have none either."""
    assert list(b) == ["p50 claim->grant ms", "p50 grant->landed ms", "p50 landed->usable ms", "p50 usable->acked ms"]
    claim, *usable, acked = b.values()
    assert (claim is None and claimed_ahead) or (claim is not None and claim >= 0), b
    assert all(v is not None and v >= 0 for v in usable) and (acked is None or acked >= 0), b


def test_scenario_4_cold_peer_reached_verified_bytes_both_ways(quick_report):
    s4 = quick_report["scenarios"]["4"]
    for name in ("kvlend", "raw_nixl_listener"):
        assert s4["results"][name]["verified"] is True and s4["results"][name]["ms"] > 0
    assert 0 < s4["results"]["kvlend"]["handshake_ms"] <= s4["results"]["kvlend"]["ms"]


def test_scenario_6_times_both_lending_modes_from_the_last_chunk(quick_report):
    s6 = quick_report["scenarios"]["6"]
    assert (s6["tokens"], s6["chunk_tokens"]) == (1024, 256)
    for mode in ("progressive_on", "progressive_off"):
        r = s6["results"][mode]
        assert r["verified"] is True and r["n"] == 2 and r["p50_ms"] > 0  # two timed rounds after a warm-up
    assert 0 < s6["one_chunk_transfer_ms"] < s6["transfer_ms_off"]
    assert s6["ratios"]["tail on/off"] == pytest.approx(
        s6["results"]["progressive_on"]["p50_ms"] / s6["results"]["progressive_off"]["p50_ms"])


def test_scenario_7_sweeps_fetches_in_flight_for_each_count_of_prefill_ranks(quick_report):
    s7 = quick_report["scenarios"]["7"]
    assert [b["peers"] for b in s7["requests"]] == [1, 2]  # --quick: 1 and 2 prefill ranks, 4 and 16 in flight
    for block in s7["requests"]:
        assert list(block["results"]) == ["4 in flight", "16 in flight"]
        for point in block["results"].values():
            assert point["verified"] is True
            assert 0 < point["cpu_seconds"] and 0 < point["seconds"]
        cpu = [p["cpu_us_per_request"] for p in block["results"].values()]
        assert block["ratios"] == {"CPU per request 16/4 in flight": pytest.approx(cpu[1] / cpu[0])}
        assert set(block["targets"]) == {"CPU per request at 16 in flight <= 1.3x that at 4"}


def test_the_in_process_yardstick_reads_the_bytes_and_descriptors_asked_for():
    r = in_process_read(3 << 20, 8, reps=3)  # 4 layers of K and V, 48 pages of 32 KiB in each region
    assert (r["bytes"], r["descriptors"], r["n"], r["verified"]) == (3 << 20, 8, 3, True)
    assert 0 < r["min_ms"] <= r["p50_ms"] and r["gbps"] > 0


def test_human_table_names_every_method(quick_report):
    text = format_report(quick_report)
    for word in ("kvlend", "raw_nixl", "memcpy", "raw_per_page", "staging", "raw_nixl_notif", "targets:",
                 "progressive_on", "progressive_off", "one chunk's", "us CPU per request", "2 prefill ranks",
                 "p50 phases: claim->grant", "baseline: raw_nixl_notif"):
        assert word in text


@pytest.mark.parametrize("argv, needle", [
    (["bench", "--scenario", "9"], "unknown scenario"),
    (["bench", "--scenario", "one"], "--scenario"),
    (["bench", "--reps", "0"], "--reps"),
])
def test_bad_arguments_exit_2_naming_the_option(capsys, argv, needle):
    assert cli.main(argv) == cli.EXIT_USAGE
    assert needle in capsys.readouterr().err
    assert not multiprocessing.active_children()


def test_fragmented_pool_gives_distinct_slots_in_short_runs():
    slots = fragmented(400, 300, seed=1)
    assert len(np.unique(slots)) == 300 and slots.min() >= 0 and slots.max() < 400
    runs = np.split(slots, np.flatnonzero(np.diff(slots) != 1) + 1)
    assert len(runs) > 50  # scattered, not one block


def test_min_descriptors_counts_runs_contiguous_on_both_sides():
    src = np.array([0, 1, 2, 7, 8, 3])
    dst = np.array([5, 6, 9, 10, 11, 12])
    # pairs joined only where both sides step by one: (0,5)-(1,6) and (7,10)-(8,11) -> runs [0,1] [2] [7,8] [3]
    assert min_descriptors(src, dst, buffers=2) == 2 * 4
