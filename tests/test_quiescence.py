"""A read reported as finished must not write any more: real NIXL agents over ``UCX_TLS=tcp``.

Over tcp a NIXL READ is really asynchronous (over cma on one host the copy
happens inside ``transfer()``), and NIXL 1.5.1 cannot abort one: a released
handle's GET runs on.  So each way a read can fail in flight (its timeout,
``cancel``, ``remove_peer``, the lender SIGKILLed, the lender hung) is driven
here with a READ of a large pattern-filled buffer really in flight, and the
destination must not change after the failure's Completion came from
``poll()`` while everything keeps running.  Then a fresh READ into the same
destination must land byte-exact.

UCX reads ``UCX_TLS`` when an agent is made, so the whole initiator runs in one
spawned process that sets it first (its lender, spawned from there, inherits
it); this pytest process's environment is untouched.  The scenarios share that
process and its lender to keep the file fast.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import struct
import time
import traceback

import numpy as np
import pytest

from tests.support.agents import PAGE, host_region, lender_main, random_bytes

pytestmark = pytest.mark.system

SIZE = 128 << 20  # 100-250 ms over tcp on the 2-vCPU test host
SEED = 7
SENTINEL = 0xA5
SENTINEL_WORD = np.uint64(int.from_bytes(bytes([SENTINEL]) * 8, "little"))
TIMEOUT = 0.05  # the backend's per-tag timeout in the scenarios that rely on it
ABORT_GRACE = 0.5  # how long the hung-lender scenario lets the read try to stop
WATCH = 0.3  # seconds the destination is watched after the Completion
DEADLINE = 20.0
ATTEMPTS = 5  # a READ that finished before the scenario could act is posted again, this many times at most

EXPECTED = {
    "timeout": "TransferTimeout",
    "cancel": "TransferCancelled",
    "remove_peer": "PeerLost",
    "sigkill": "PeerLost",
    "hung_lender": "TransferTimeout",
    "destroyed_agent": "TransferTimeout",  # a hung lender, and the reset destroys the agent (as over RDMA)
    "pinned_agent": "TransferTimeout",  # the same, and something still holds the reader's agent
}


@pytest.fixture(scope="module")
def initiator():
    side = InitiatorProcess()
    yield side
    side.close()


@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_failed_read_does_not_write_after_its_completion(initiator, scenario):
    report = initiator.run(scenario)
    assert report["error"] == EXPECTED[scenario], report
    assert report["changed_after_completion"] == 0, (
        f"{report['changed_after_completion']} destination bytes changed in the {WATCH} s after the "
        f"{report['error']} Completion was reported: {report}"
    )
    assert report["fresh_read_exact"], report
    if scenario == "hung_lender":  # the reader's agent was retired, not closed under the stopped lender
        assert report["lender_survived"], report
    if scenario == "destroyed_agent":  # the reset destroyed the agent: nothing outlived it
        assert report["orphaned"] == 0 and report["resets"] == 1 + report["resets_before"], report
    if scenario == "pinned_agent":  # its reset could not destroy the agent: it says so, and goes on
        assert report["orphaned"] == 1 and not report["healthy"], report
        assert report["resets"] == 1 + report["resets_before"], report


def test_a_reported_read_keeps_no_handle_object(initiator):
    """Each NIXL handle object holds the agent, and a reset must see the agent gone: a read that
    ``poll()`` reported keeps none, even if a variable still holds it (``poll``'s own loop did,
    so a reset in the same poll found the agent alive and closed the backend: issue 22, finding 6)."""
    assert initiator.run("keeps_no_handle") == {"handles_left": 0}


class InitiatorProcess:
    """The spawned initiator, running one scenario per request."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_initiator_main, args=(child,))
        self.proc.start()
        child.close()

    def run(self, scenario: str) -> dict:
        """The scenario's report; its traceback, or the process's death, fails the test."""
        if not self.proc.is_alive():
            raise AssertionError(f"initiator process is gone (exit code {self.proc.exitcode})")
        self.conn.send(scenario)
        multiprocessing.connection.wait([self.conn, self.proc.sentinel], timeout=3 * DEADLINE)
        if not self.conn.poll():
            self.proc.kill()
            raise AssertionError(f"initiator sent no report for {scenario!r} (exit code {self.proc.exitcode})")
        status, payload = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"initiator failed in {scenario!r}:\n{payload}")
        return payload

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(DEADLINE)
        if self.proc.is_alive():
            self.proc.kill()


def _initiator_main(conn) -> None:
    os.environ["UCX_TLS"] = "tcp"  # before the first agent exists
    side = None
    try:
        side = _Initiator()
        while (scenario := conn.recv()) is not None:
            try:
                conn.send(("ok", side.scenario(scenario)))
            except Exception:
                conn.send(("failed", traceback.format_exc()))
    except Exception:
        conn.send(("failed", traceback.format_exc()))
    finally:
        if side is not None:
            side.close()


class _Initiator:
    """The reading side and its lender process."""

    def __init__(self):
        from kvlend_nixl import NixlBackend

        self.ctx = multiprocessing.get_context("spawn")
        self.lender_name = f"lender-{secrets.token_hex(3)}"
        self.backend = NixlBackend(f"reader-{secrets.token_hex(3)}", timeout=DEADLINE)
        self.dst = np.full(SIZE, SENTINEL, np.uint8)
        self.expected = random_bytes(SIZE, SEED)
        self.backend.register([host_region(self.dst, "dst")])
        self.reported: dict = {}
        self._start_lender()
        self.peer = self.backend.add_peer(self.metadata)
        self._read(b"warm-up", PAGE)  # the first read wires the connection up (100+ ms)

    def scenario(self, scenario: str) -> dict:
        backend = self.backend
        if scenario == "keeps_no_handle":
            tag = b"reported"
            self._post(tag, SIZE)
            read = backend._reads[tag]
            self._until(lambda: self._poll() or self.reported.pop(tag, None))
            return {"handles_left": len(read.handles)}
        backend.timeout = TIMEOUT if EXPECTED[scenario] == "TransferTimeout" else DEADLINE
        backend.abort_grace = ABORT_GRACE  # an attribute the old backend ignores
        stops = scenario in ("hung_lender", "destroyed_agent", "pinned_agent")
        for attempt in range(ATTEMPTS):
            tag, posted = self._post_doomed(scenario, attempt)
            if stops:  # stop the lender first, then look: a stopped lender sends nothing more
                os.kill(self.lender.pid, signal.SIGSTOP)
            if self._in_nixl_flight(tag):
                break
            # a loaded host descheduled this thread past the whole READ: take it back and post again
            if stops:
                os.kill(self.lender.pid, signal.SIGCONT)
            self._until(lambda: self._poll() or self.reported.pop(tag, None))
        assert self._in_nixl_flight(tag), f"the READ finished before the scenario acted, {ATTEMPTS} times"
        acted = time.monotonic()
        if scenario == "cancel":
            backend.cancel(tag)
        elif scenario == "remove_peer":
            backend.remove_peer(self.peer)
        elif scenario == "sigkill":
            os.kill(self.lender.pid, signal.SIGKILL)
        pinned = None
        if scenario in ("destroyed_agent", "pinned_agent"):  # where a reset must destroy the agent (RDMA)
            backend._retire = False
        if scenario == "pinned_agent":
            pinned = backend._agent.agent  # a stray reference
        resets_before, orphans_before = getattr(backend, "resets", None), getattr(backend, "_orphans", 0)
        done = self._until(lambda: self._poll() or self.reported.pop(tag, None))
        reported = time.monotonic()
        landed = self._landed()
        snapshot = self.dst.copy()
        if scenario in ("hung_lender", "destroyed_agent", "pinned_agent"):
            os.kill(self.lender.pid, signal.SIGCONT)  # a GET left behind would write again now
        self._keep_polling(WATCH)
        changed = int(np.count_nonzero(self.dst != snapshot))

        lender_survived = self.lender.is_alive()
        if not lender_survived or scenario == "sigkill":  # UCX aborts a lender resumed under a closed socket
            self.lender.kill()
            self.lender.join(DEADLINE)
            self._start_lender()  # a new incarnation under the same name
        assert backend.add_peer(self.metadata) == self.peer  # a no-op unless it was removed or restarted
        backend.timeout = DEADLINE
        self.dst[:] = SENTINEL
        started = time.monotonic()
        fresh = self._read(f"fresh-{scenario}".encode(), SIZE)
        del pinned
        backend._retire = True
        return {
            "error": type(done.error).__name__,
            "message": str(done.error),
            "acted_after_post_ms": round((acted - posted) * 1e3, 1),
            "completion_after_action_ms": round((reported - acted) * 1e3, 1),
            "landed_at_completion": round(landed, 3),
            "changed_after_completion": changed,
            "lender_survived": lender_survived,
            "fresh_read_ms": round((time.monotonic() - started) * 1e3, 1),
            "fresh_read_error": repr(fresh.error),
            "fresh_read_exact": fresh.error is None and np.array_equal(self.dst, self.expected),
            "resets": getattr(backend, "resets", None),
            "resets_before": resets_before,
            "orphaned": getattr(backend, "_orphans", 0) - orphans_before,
            "healthy": getattr(backend, "healthy", None),
        }

    def _post_doomed(self, scenario: str, attempt: int) -> tuple[bytes, float]:
        """Post the READ the scenario fails; return once data is landing (at once for the timeout)."""
        tag = f"doomed-{scenario}-{attempt}".encode()
        self.dst[:] = SENTINEL
        self._post(tag, SIZE)
        posted = time.monotonic()
        assert self.backend.poll() == [], "the READ finished at once: make SIZE bigger"
        if scenario != "timeout":  # act mid-transfer, once data is landing
            self._until(lambda: self._poll() or self._landed() >= 1 / 16)
        return tag, posted

    def _in_nixl_flight(self, tag: bytes) -> bool:
        """NIXL's own state: every handle of ``tag`` still PROC."""
        read = self.backend._reads.get(tag)  # settled at once if transfer() finished the copy
        return read is not None and all(self.backend._agent.check_xfer_state(h) == "PROC" for h in read.handles)

    def _landed(self) -> float:
        """Share of destination pages whose first 8 bytes are no longer the sentinel."""
        heads = self.dst.view(np.uint64)[::PAGE // 8]
        return float(np.count_nonzero(heads != SENTINEL_WORD)) / len(heads)

    def _post(self, tag: bytes, size: int) -> None:
        from kvlend.core.layout import MemoryKind
        from kvlend.transport import ReadBatch

        half = size // 2  # two handles: every handle of a tag must have stopped
        local = np.array([[self.dst.ctypes.data + o, half, 0] for o in (0, half)], np.uint64)
        remote = np.array([[self.address + o, half, 0] for o in (0, half)], np.uint64)
        host = MemoryKind.HOST
        self.backend.post_read(self.peer, [ReadBatch(host, host, remote[:1], local[:1]),
                                           ReadBatch(host, host, remote[1:], local[1:])], tag)

    def _read(self, tag: bytes, size: int):
        self._post(tag, size)
        return self._until(lambda: self._poll() or self.reported.pop(tag, None))

    def _poll(self) -> None:
        """Progress the backend (the tcp data lands only then), keeping what it reports."""
        self.reported.update((c.tag, c) for c in self.backend.poll())

    def _keep_polling(self, seconds: float) -> None:
        """Progress the backend for ``seconds``, as a caller reusing the pages would."""
        end = time.monotonic() + seconds
        self._until(lambda: self._poll() or time.monotonic() >= end)

    @staticmethod
    def _until(check):
        """Call ``check`` until it returns something true, backing off 20 µs to 1 ms; fail at DEADLINE."""
        end, pause = time.monotonic() + DEADLINE, 0.0
        while not (result := check()):
            if time.monotonic() > end:
                raise AssertionError(f"not within {DEADLINE} s")
            pause = min(max(pause * 2, 20e-6), 1e-3)
            time.sleep(pause)
        return result

    def _start_lender(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.lender = self.ctx.Process(target=lender_main, args=(child, self.lender_name, SIZE, SEED), daemon=True)
        self.lender.start()
        child.close()
        multiprocessing.connection.wait([self.conn, self.lender.sentinel], timeout=DEADLINE)
        if not self.conn.poll():
            raise AssertionError(f"lender sent no metadata (exit code {self.lender.exitcode})")
        self.metadata = self.conn.recv_bytes()
        (self.address,) = struct.unpack("<Q", self.conn.recv_bytes())

    def close(self) -> None:
        if self.lender.is_alive():
            os.kill(self.lender.pid, signal.SIGCONT)
            self.conn.send_bytes(b"stop")
            self.lender.join(DEADLINE)
        if self.lender.is_alive():
            self.lender.kill()
        self.backend.close()
