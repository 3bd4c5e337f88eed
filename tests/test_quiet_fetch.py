"""A failed fetch is reported only once nothing can land: real ranks over ``UCX_TLS=tcp``.

Over tcp a NIXL READ is really in flight after it is posted (over cma on one
host the copy happens inside ``transfer()``).  A decode rank and its prefill
ranks run as spawned processes (``quiet_ranks``) over tcp on loopback.  A
fetch of a 128 MiB lease fails while its reads are in flight, by its
deadline and by the prefill being SIGKILLed; once the fetch reports
failed (and quiet), its destination must not change while the node keeps
running, and a resume from the error's bound into the same destination must
end byte-exact.  On the code before the sessions issue the failure was
reported while GETs still wrote into the destination.

And a prefill engine that releases a lease while its reads are in flight
(its request was cancelled) reuses the pages only once the decode is quiet:
reads that landed before the decode heard of the release count for its
bound (in protocol 6 a fetch whose reads all landed in the lease's window is
done with them), so they must have read the lent bytes.  Before issue 22 the pages
were reused at once and the bound covered them.
"""

from __future__ import annotations

import multiprocessing

import pytest

from tests.support import quiet_ranks

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def reports() -> dict:
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=quiet_ranks.decode_main, args=(there,))
    proc.start()
    there.close()
    try:
        assert here.poll(240.0), "the decode rank did not report"
        out = here.recv()
    finally:
        proc.join(30.0)
        if proc.is_alive():
            proc.kill()
    assert "crash" not in out, out.get("crash")
    return out


@pytest.mark.parametrize("scenario, error", [("timeout", "TransferTimeout"), ("peer_lost", "PeerLost")])
def test_nothing_lands_after_a_failed_fetch_is_quiet_and_a_resume_is_exact(reports, scenario, error):
    r = reports[scenario]
    assert r["reads_in_flight"] > 0, f"no read was in flight when the failure struck: {r}"
    # reads in flight as it failed: a fetch whose cancelled reads stopped at once goes straight to failed
    assert r["state_after_deadline"] in ("reading", "cancelling", "failed"), r
    assert r["error"] == error and r["quiet"], r
    assert r["changed_after_quiet"] == 0, f"{r['changed_after_quiet']} bytes landed after the fetch was quiet: {r}"
    assert r["resume_error"] is None and r["exact"], r
    assert r["resumed_from"] == r["bound"], r


def test_a_release_under_a_read_never_reuses_pages_a_bound_covers(reports):
    r = reports["released"]
    assert r["reads_in_flight_after_release"] > 0, f"no read was in flight when the engine released the lease: {r}"
    assert r["bound_when_landed"] == r["tokens"], r
    assert r["reused_under_bound"] == 0, (
        f"{r['reused_under_bound']} bytes under the bound of {r['bound_when_landed']} tokens hold reused pages: {r}")
    if r["state_when_landed"] == "done":  # protocol 6: every read landed in the lease's window, the pages locked
        assert r["error"] is None and r["bound"] == r["tokens"], r
    else:  # landed past the window (a slow host): the ack decides, and the release voids what was read
        assert r["state_when_landed"] == "acking", r
        assert r["error"] == "LeaseUnknown" and r["bound"] == 0, r
    (request, reason, after), = r["ended"]
    assert reason == "released" and after < 30.0, r  # freed by the decode's done, well before the lease's TTL
