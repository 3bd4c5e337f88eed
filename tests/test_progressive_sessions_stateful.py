"""Progressive lending (issue 17), sans-IO: random interleavings in a hypothesis state machine.

Extensions, read completions in any order, heartbeats, clock steps and faults, on plain and hybrid ends;
after every step the transport's contract holds and, in a clean run, every fetch ends done with no lock
left.  The scenario tests: ``test_progressive_sessions.py`` and ``test_progressive_sessions_faults.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvlend.errors import KvlendError
from kvlend.protocol.config import NodeConfig
from kvlend.protocol.decode import FetchState
from kvlend.testing import ContractError, World, finish_all
from tests.support.profiles import examples
from tests.support.progressive import TPP, add_hybrid, posted_pages, push_progressive

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------ stateful
SCFG = NodeConfig(ttl=4.0, heartbeat=1.0, handshake_timeout=3.0, transfer_timeout=12.0, cancel_grace=3.0,
                  chunk_pages=4)
_ACTIVE = (FetchState.READING, FetchState.ACKING, FetchState.CANCELLING)


class Progressive(RuleBasedStateMachine):
    """Random interleavings of extensions, read completions in any order, heartbeats and clock steps."""

    @initialize(seed=st.integers(0, 2**16), shuffle=st.booleans(), fragment=st.booleans(), hybrid=st.booleans(),
                eager=st.sampled_from(["hold", "hold", "mixed"]))
    def setup(self, seed, shuffle, fragment, hybrid, eager):
        self.world = World(seed, shuffle=shuffle, fragment=fragment)
        rng = self.world.rng
        if eager == "mixed":  # a backend that completes some reads inside post
            self.world.post_policy = lambda b, r: b.finish(r.tag) if rng.random() < 0.5 else None
        if hybrid:
            self.p, self.d = add_hybrid(self.world, config=SCFG)
        else:
            self.p = self.world.add_prefill(config=SCFG)
            self.d = self.world.add_decode(config=SCFG)
        self.world.connect(self.d, self.p)
        self.seed = 0
        self.growing: list = []  # (lease id, num_tokens) still being extended
        self.ahead: list = []  # (ticket, seed) claimed ahead
        self.clean = True  # no fault, no clock step that could outlast a deadline: every fetch must end DONE
        self.elapsed = 0.0

    def _room(self, n: int) -> bool:
        need = 2 * -(-n // TPP)
        return all(len(f) >= need for f in self.p.free.values()) and all(len(f) >= need for f in self.d.free.values())

    def _new_seed(self) -> int:
        self.seed += 1
        return self.seed

    @rule(n=st.integers(1, 90), first=st.integers(0, 100), ahead=st.booleans())
    def lend_ticket(self, n, first, ahead):
        if not self._room(n) or not self.p.alive:
            return
        ready = min(n, first * n // 100)
        seed = self._new_seed()
        t = self.p.ticket(n, seed, ready=ready)
        if ready < n:
            self.growing.append((t.lease, n))
        if ahead:
            self.d.claim(t)
            self.ahead.append((t, seed))
        else:
            self.d.fetch_ticket(t, seed=seed)

    @rule(n=st.integers(1, 90), first=st.integers(0, 100))
    def push(self, n, first):
        if not self._room(n) or self.d.name not in self.p.session.peers:
            return
        ready = min(n, first * n // 100)
        lease = push_progressive(self.p, self.d.name, n, self._new_seed(), ready)
        if ready < n:
            self.growing.append((lease.id, n))

    @rule(k=st.integers(0, 7))
    def start_fetch(self, k):
        """The engine starts a fetch of a pushed offer or of a ticket claimed ahead."""
        d = self.d
        if d.offers and k % 2:
            conn, offer = d.offers.pop(k % len(d.offers))
            if d.session.ready(conn):
                d.fetch_offer(conn, offer)
        elif self.ahead:
            t, seed = self.ahead.pop(k % len(self.ahead))
            d.fetch_ticket(t, seed=seed)

    @rule(k=st.integers(0, 15), step=st.integers(1, 40), final=st.integers(0, 3))
    def extend(self, k, step, final):
        if not self.growing:
            return
        lease_id, n = self.growing[k % len(self.growing)]
        try:
            lease = self.p.lender.get(lease_id, self.p.now)
        except KvlendError:
            self.growing.remove((lease_id, n))
            return
        ready = n if final == 0 else min(n, lease.ready + step)
        try:
            grown = self.p.extend(lease_id, ready, meta={"chunk": ready} if step % 3 == 0 else None)
        except KvlendError as exc:  # ended meanwhile (expired, aborted by its reader)
            event(f"extend refused: {type(exc).__name__}")
            self.growing.remove((lease_id, n))
            return
        if grown.final:
            self.growing.remove((lease_id, n))
            event("lease extended to final")

    @rule(picks=st.lists(st.tuples(st.integers(0, 63), st.sampled_from(["ok"] * 8 + ["error", "late", "land"])),
                         min_size=1, max_size=8))
    def end_reads(self, picks):
        backend = self.d.backend
        for k, how in picks:
            reads = backend.in_flight()
            if not reads:
                break
            read = reads[k % len(reads)]
            if how == "ok":
                backend.finish(read.tag)
            elif how == "error":
                self.clean = False
                backend.fail(read.tag)
            elif how == "late":
                self.clean = False
                backend.late(read.tag)
            else:
                backend.land(read.tag)
            if k % 2:
                self.world.pump()
        self.world.pump()

    @rule()
    def tick(self):
        self.world.tick()

    @rule(dt=st.floats(0.05, 2.0))
    def advance(self, dt):
        self.elapsed += dt
        if self.elapsed > SCFG.transfer_timeout / 2:
            self.clean = False
        self.world.advance(dt)

    @rule(k=st.integers(0, 3))
    def toggle_hold(self, k):
        """Hold (or let through) one direction of the link: claims, heartbeats, dones or offers, extensions."""
        wires = [w for w in self.world.wires if w.open]
        if not wires:
            return
        wire = wires[0]
        self.clean = False  # a held claim or heartbeat may let a lease expire
        if k % 2:
            wire.hold_to_prefill = not wire.hold_to_prefill
        else:
            wire.hold_to_decode = not wire.hold_to_decode
        self.world.pump()

    @rule(really=st.integers(0, 5))
    def cut(self, really):
        wires = [w for w in self.world.wires if w.open]
        if wires and really == 0:
            self.clean = False
            self.world.cut(wires[0])
            self.world.connect(self.d, self.p)

    @rule(k=st.integers(0, 15), really=st.integers(0, 3))
    def cancel(self, k, really):
        running = self.d.running()
        if running and really == 0:
            self.clean = False
            self.d.cancel(running[k % len(running)])

    @rule()
    def collect(self):
        for record in list(self.d.records.values()):
            if record.finished:
                self.d.session.forget(record.fetch.id)
                self.d.release_dst(record)
                del self.d.records[record.fetch.id]

    @invariant()
    def locks_match_live_leases(self):
        self.world.check_locks()

    @invariant()
    def each_page_is_read_once(self):
        """A grown lease's reader posts only what it has not read yet: no destination page is read twice."""
        d = self.d
        for record in d.records.values():
            seen: dict[str, set] = {}
            for tag in sorted(record.tags):
                for name, pages in posted_pages(d, record, [d.backend.reads[tag]]).items():
                    again = seen.setdefault(name, set()).intersection(pages)
                    assert not again, f"fetch {record.fetch.id} reads {name} pages {sorted(again)} twice"
                    seen[name].update(pages)

    @invariant()
    def bookkeeping_agrees(self):
        d, s = self.d, self.d.session
        running = d.running()
        assert s.in_flight == len(running)
        assert s.tracker.stats.requests == sum(r.fetch.state in _ACTIVE for r in d.records.values())
        for record in d.records.values():
            f = record.fetch
            assert f.tags == {t for t in record.tags if not d.backend.reads[t].reported}
            if f.state is FetchState.ACKING:
                assert f.offer.final  # Done only once final
            if f.offer is not None and not f.done:  # never ahead of what the prefill lent
                try:
                    lease = self.p.lender.get(f.lease, self.p.now)
                except KvlendError:
                    continue
                assert f.offer.ready <= lease.ready

    def teardown(self):
        if not hasattr(self, "world"):
            return
        world, d, p = self.world, self.d, self.p
        for wire in world.wires:
            wire.hold_to_prefill = wire.hold_to_decode = False
        world.pump()
        for t, _seed in self.ahead:
            d.unclaim(t)
        for conn, offer in d.offers:
            if d.session.ready(conn):
                d.session.decline(conn, offer, "teardown")
        d.offers.clear()
        # Prefill finishes every prompt; the decode's reads all land.
        for lease_id, n in list(self.growing):
            try:
                p.extend(lease_id, n)
            except KvlendError:
                pass
        for _ in range(20):
            if not finish_all(world, d):
                break
        world.pump()
        if self.clean:
            stuck = [(r.fetch.id, r.fetch.state.value, r.fetch.error) for r in d.records.values()
                     if r.fetch.state is not FetchState.DONE]
            if stuck:
                raise ContractError(f"with no fault every fetch must end done: {stuck}")
            event("clean run: every fetch done")
        world.settle()
        if d.running() or d.backend.in_flight():
            raise ContractError(f"fetches still running past their deadline: {[r.fetch.id for r in d.running()]}")
        world.advance(SCFG.ttl + 2 * SCFG.heartbeat)
        world.check_locks()
        if p.lender.active_leases:
            raise ContractError(f"prefill still holds {p.lender.active_leases} leases with nothing reading them")


Progressive.TestCase.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_progressive_stateful = Progressive.TestCase
