"""Decodes SIGKILLed with reads in flight over ``UCX_TLS=tcp``: the prefill must live on and end their leases in time.

Each trial starts one prefill (``fault_ranks``, as in the chaos runs) and one chaos decode with
``--inflight`` fetches, lets it serve, SIGKILLs it at a random moment, and checks that the
prefill is still alive ``TTL + 3 heartbeats`` later and that every lease the dead decode held
expired within ``TTL + heartbeat`` of the kill (the prefill's loop did not stall).  Prints one
JSON line per trial and exits non-zero if any failed.

    python -m tests.support.decode_kills --trials 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from .chaos_ranks import BEAT, TCP, TTL, prefill_args
from .ranks import Rank


def trial(seed: int, inflight: int) -> dict:
    rng = random.Random(seed)
    prefill = Rank(f"prefill{seed}", "prefill", *prefill_args(seed), "--report-expired")
    decode = None
    try:
        prefill.listening(60.0)
        decode = Rank(f"decode{seed}", "decode", "--gen", str(seed), "--inflight", str(inflight), module="chaos_ranks")
        decode.send("connect %s %d" % prefill.address)
        end = time.monotonic() + 60.0
        while time.monotonic() < end:  # serving: reads in flight all the time
            decode.send("report")
            if decode.event("report", 30.0)["served"] >= 50:
                break
            time.sleep(0.1)
        time.sleep(rng.uniform(0.0, 1.0))
        decode.proc.kill()
        killed = time.monotonic()
        decode.proc.wait(10)
        expired = []
        watch_end = killed + TTL + 3 * BEAT
        while time.monotonic() < watch_end and prefill.proc.poll() is None:
            if prefill.ready():
                try:
                    event = prefill.next_event(max(0.01, watch_end - time.monotonic()))
                except AssertionError:
                    break
                if event and event["ev"] == "expired":
                    expired.append(event["t"] - killed)
            else:
                time.sleep(0.01)
        rc = prefill.proc.poll()
        latest = max(expired, default=None)
        ok = rc is None and bool(expired) and latest <= TTL + BEAT
        return {"seed": seed, "ok": ok, "prefill_rc": rc, "expired": len(expired),
                "last_expired_after_s": None if latest is None else round(latest, 3)}
    finally:
        for rank in (decode, prefill):
            if rank is not None and rank.proc.poll() is None:
                rank.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--inflight", type=int, default=64)
    args = ap.parse_args(argv)
    os.environ.update(TCP)  # the children inherit it
    bad = 0
    for i in range(args.trials):
        out = trial(args.seed + i, args.inflight)
        bad += not out["ok"]
        print(json.dumps(out), flush=True)
    print(f"decode kills: {args.trials - bad} of {args.trials} trials held (ttl {TTL}, heartbeat {BEAT})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
