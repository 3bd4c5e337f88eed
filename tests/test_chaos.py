"""Chaos soak on loopback: thousands of small requests, random aborts, delays and SIGKILLs;
and chaos over ``UCX_TLS=tcp`` with two prefills SIGKILLed and SIGSTOPped (``tests.support.chaos_ranks``;
``scripts/chaos`` runs it longer).

One prefill and one decode child (``tests.support.fault_ranks``) at a time.  The decode
declines some offers and sleeps past the TTL before a few fetches; the
prefill scribbles over every page whose lease ended, so a read of an expired
lease would see garbage.  At random moments the test SIGKILLs the decode
(and starts a new one) or the prefill (and starts a replacement that re-lends
the request the decode lost, which the decode then finishes from its safe
bound).  The decode checks every byte of every request it serves; at the
end no served request may differ from its pattern and the last prefill
must hold no lock.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from tests.support.chaos_ranks import chaos, prefill_args
from tests.support.ranks import Rank

pytestmark = pytest.mark.system

SOAK_S = float(os.environ.get("KVLEND_SOAK_S", "30"))
CHAOS_S = float(os.environ.get("KVLEND_CHAOS_S", "20"))  # scripts/chaos runs the long version
KILLS = {"decode": 2, "prefill": 2}
TIMING = ("--ttl", "1.5", "--heartbeat", "0.3", "--chunk-pages", "4", "--deadline", "10")


class Soak:
    """The ranks alive now, and every event the decodes reported."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(2026)
        self.gen = 0
        self.events: list[dict] = []
        self.prefill = self.decode = None

    def start_prefill(self, resume: list[str] = ()) -> Rank:
        self.gen += 1
        args = [f"--resume={r}" for r in resume]
        self.prefill = Rank(f"prefill{self.gen}", "prefill", "--gen", str(self.gen), "--seed", str(self.gen),
                            "--delay", "0.2", *TIMING, *args)
        self.prefill.listening()
        return self.prefill

    def start_decode(self) -> Rank:
        self.gen += 1
        self.decode = Rank(f"decode{self.gen}", "decode", "--gen", str(self.gen), "--seed", str(self.gen), "--chaos",
                           "--connect", "%s:%d" % self.prefill.address, *TIMING)
        self.decode.event("connected", 30.0)
        return self.decode

    def drain(self, timeout: float = 0.0) -> list[dict]:
        """Decode events available now (or within ``timeout``)."""
        out = []
        end = time.monotonic() + timeout
        while self.decode.ready() or time.monotonic() < end:
            try:
                event = self.decode.next_event(max(0.0, end - time.monotonic()))
            except AssertionError:  # nothing more now, or it exited
                break
            if event is not None:
                out.append(event)
                end = 0.0
        self.events.extend(out)
        return out


def test_chaos_soak_serves_only_verified_kv_and_leaks_no_locks():
    soak = Soak()
    soak.start_prefill()
    soak.start_decode()
    start = time.monotonic()
    kills = [("decode", t) for t in soak.rng.uniform(0.15, 0.85, KILLS["decode"]) * SOAK_S]
    kills += [("prefill", t) for t in soak.rng.uniform(0.15, 0.85, KILLS["prefill"]) * SOAK_S]
    kills.sort(key=lambda k: k[1])
    killed = {"decode": 0, "prefill": 0}
    try:
        while time.monotonic() - start < SOAK_S:
            soak.drain(0.05)
            if kills and time.monotonic() - start >= kills[0][1]:
                who, _ = kills.pop(0)
                killed[who] += 1
                if who == "decode":
                    soak.decode.kill()  # its counts die with it: count what it reported
                    soak.start_decode()
                else:
                    # Mid-transfer: the decode stops after the first chunk of its next fetch lands.
                    soak.decode.send("arm")
                    end = time.monotonic() + 15.0
                    while not any(e["ev"] == "mid_transfer" for e in soak.drain(0.05)):
                        assert time.monotonic() < end, "the armed decode never fetched"
                    soak.prefill.kill()
                    # The decode notices: "lost", with its bound.
                    lost = None
                    while lost is None and time.monotonic() < end:
                        for e in soak.drain(0.05):
                            if e["ev"] in ("lost", "link_lost"):
                                lost = e
                    assert lost is not None, "the decode never noticed its prefill died"
                    resume = [f"{lost['request']}:{lost['seed']}:{lost['tokens']}"] if lost["ev"] == "lost" else []
                    soak.start_prefill(resume)
                    soak.decode.send("connect %s %d" % soak.prefill.address)
        soak.decode.send("stop")
        end_decode = soak.decode.event("decode_end", 30.0)
        soak.decode.finish(10.0)
        soak.prefill.send("stop")
        end_prefill = soak.prefill.event("prefill_end", 30.0)
        soak.prefill.finish(10.0)
    finally:
        for rank in (soak.decode, soak.prefill):
            if rank is not None:
                rank.kill()

    # Every decode reported each request as it ended, so killed decodes count too.
    events = soak.events
    counts = {k: sum(e["ev"] == k for e in events) for k in ("served", "resumed", "failed", "aborted", "lost")}
    kinds = {}
    for e in events:
        if e["ev"] == "failed":
            kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    print(f"\nchaos soak {time.monotonic() - start:.0f} s, kills {killed}: served {counts['served']}, "
          f"resumed {counts['resumed']}, failed {counts['failed']} {kinds}, aborted {counts['aborted']}, "
          f"lost mid-fetch {counts['lost']}; last decode {end_decode}; last prefill {end_prefill}")
    mismatched = [e for e in events if e["ev"] in ("served", "resumed") and not e["ok"]]
    assert not mismatched and end_decode["mismatch"] == 0, mismatched[:3]
    assert end_prefill["locked"] == 0 and end_prefill["active"] == 0
    assert killed == KILLS
    assert counts["served"] + counts["resumed"] >= 1  # correctness is above; how many fit depends on the host
    assert counts["lost"] == KILLS["prefill"]  # every prefill kill landed mid-transfer
    assert counts["resumed"] >= 1  # and a replacement finished at least one from its bound


def test_chaos_over_tcp_serves_only_verified_kv_and_ends_every_fetch_in_time():
    """Two prefills SIGKILLed and restarted, or SIGSTOPped for 1-10 s, at random, under a decode with
    64 fetches in flight.

    Before the tcp read window (``kvlend.core.tcpwindow``), a prefill resumed after its decode
    gave up on it died of SIGSEGV inside UCX now and then (both prefills, in the one run at seed
    200 with stops only measured here), and this test SIGKILLed only.
    """
    report = chaos(CHAOS_S, seed=2026, inflight=64, stops=0.5)
    assert not report["violations"], report
    assert report["served"] >= 1 and report["started"] == report["served"] + report["failed"], report


def test_a_prefill_stopped_past_the_decodes_deadline_keeps_serving(monkeypatch):
    """The decode gives up its reads (and resets its agent) while the prefill is stopped; resumed, it serves on.

    Before, the reset closed the decode's socket under the queued GETs, and UCX aborted the
    prefill on SIGCONT (``ucs_fatal``, plugins/nixl/README.md).
    """
    monkeypatch.setenv("UCX_TLS", "tcp")  # the children inherit it
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    prefill = Rank("prefill1", "prefill", *prefill_args(1))
    decode = None
    try:
        prefill.listening(60.0)
        decode = Rank("decode2", "decode", "--gen", "2", "--inflight", "16", "--deadline", "2",
                      module="chaos_ranks")
        decode.send("connect %s %d" % prefill.address)
        served = report_until(decode, lambda r: r["served"] > 0)["served"]
        os.kill(prefill.proc.pid, signal.SIGSTOP)
        report_until(decode, lambda r: r["resets"] > 0)  # it gave up the reads the prefill still owes
        os.kill(prefill.proc.pid, signal.SIGCONT)
        after = report_until(decode, lambda r: r["served"] > served + 16 or prefill.proc.poll() is not None)
        assert prefill.proc.poll() is None, f"the prefill died after SIGCONT (rc {prefill.proc.returncode})"
        decode.send("stop")
        end = decode.event("decode_end", 60.0)
        assert end["violations"] == 0, end
        print(f"\nserved {served} before the stop, {after['served']} after; decode end {end}")
    finally:
        for rank in (decode, prefill):
            if rank is not None:
                if rank.proc.poll() is None:
                    os.kill(rank.proc.pid, signal.SIGCONT)
                rank.kill()


def report_until(rank: Rank, done, timeout: float = 60.0) -> dict:
    """Ask a chaos decode for its counts until ``done(counts)``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rank.send("report")
        report = rank.event("report", timeout)
        if done(report):
            return report
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: last report {report}")
