"""Random interleavings of everything that can happen to the sessions (hypothesis stateful).

Two prefills and one decode (which may die and restart under the same name)
over ``kvlend.testing``: leases lent behind tickets or pushed, fetches
started, reads completed ok, failed, or landing late in any order, cancels,
small clock steps (heartbeats and their renewals flow) and large jumps,
heartbeats held back, links cut, ranks killed and restarted, a fetch done in its lease's window (protocol 6)
whose Done is then lost, late, outlived by its prefill or its lease, fetch starts that
fail (bad tables, planner bugs inside ``receive``) and their immediate retries,
declines of offers being read (refused).  After every step:

(i)   no byte lands in a fetch's destination after its ``FetchFinished``
      (checked by the transport on each write), nor outside the pages it reads;
(ii)  a done fetch's destination holds exactly the lent bytes, and every
      fetch's bound names pages that hold them;
(iii) each prefill's page locks are exactly those of its live leases;
(iv)  nothing hangs: past ``transfer_timeout + cancel_grace`` every fetch has
      finished with every read terminal, and one TTL later no lease is left;
(v)   every fetch's, link's, peer's, lease's and loan's (the lender's record) state changed only by moves
      of their tables, each made through ``kvlend.core.tables.transition`` (recorded here).

plus the bookkeeping: the session's fetches in flight, its tracker's
requests and each fetch's open reads agree with what the backend knows.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvlend.protocol.fetch as fetch_mod
from kvlend.core import tables
from kvlend.errors import KvlendError, PageRangeError, PeerLost, ProtocolError, UsageError
from kvlend.protocol import states
from kvlend.protocol.config import NodeConfig
from kvlend.protocol.decode import FetchState
from kvlend.testing import ContractError, World
from tests.support.profiles import examples

pytestmark = pytest.mark.unit

CFG = NodeConfig(ttl=4.0, heartbeat=1.0, handshake_timeout=3.0, transfer_timeout=12.0, cancel_grace=3.0,
                 chunk_pages=4)
PORTS = (7000, 7001)
TPP = 4
_ACTIVE = (FetchState.READING, FetchState.ACKING, FetchState.CANCELLING)


class _PlannerBug(Exception):
    """Not a KvlendError."""


def _trust_event(record) -> None:
    """Coverage: whether a fetch's bound advanced before the done ack (pushed: only after a renewal)."""
    if max(record.bounds) > record.resume_from:
        event("pushed fetch trusted before its ack" if record.fetch.claimed_at is None else
              "ticket fetch trusted before its ack")


class Sessions(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**16), shuffle=st.booleans(), fragment=st.booleans(),
                offset=st.sampled_from([0.0, -777.5, 1e5]), eager=st.sampled_from(["hold", "hold", "ok", "mixed"]),
                on_cancel=st.sampled_from(["hold", "prompt", "late"]))
    def setup(self, seed, shuffle, fragment, offset, eager, on_cancel):
        self.world = World(seed, shuffle=shuffle, fragment=fragment)
        rng = self.world.rng
        if eager != "hold":  # a backend that completes some reads inside post (cma on one host does)
            self.world.post_policy = lambda b, r: b.finish(r.tag) if eager == "ok" or rng.random() < 0.5 else None
        if on_cancel == "prompt":
            self.world.cancel_policy = lambda b, r: b.fail(r.tag)
        elif on_cancel == "late":
            self.world.cancel_policy = lambda b, r: b.late(r.tag) if rng.random() < 0.5 else None
        self.prefills = [self.world.add_prefill(f"p{i}", port=port, config=CFG, offset=offset * i)
                         for i, port in enumerate(PORTS)]
        self.decode = self.world.add_decode("d0", config=CFG)
        self.other = self.world.add_decode("d1", config=CFG)  # a second reader, for tickets both try to claim
        self.seed = 0
        self.restarts = 0
        self.ahead: list = []  # (decode, ticket, seed) claimed ahead, not yet read or given back
        self.moves: list = []  # (table, state, event, next state) of each transition since the last check
        self.seen: dict = {}  # (session, table, id) -> the state last checked
        self.transition = tables.transition
        tables.transition = self._recorded

    def _recorded(self, name, state, event_):
        after = self.transition(name, state, event_)
        self.moves.append((name, state, event_, after))
        return after

    # ------------------------------------------------------------- helpers
    def _next_seed(self) -> int:
        self.seed += 1
        return self.seed

    def _room(self, end, num_tokens: int, times: int = 1) -> bool:
        need = times * -(-num_tokens // TPP)
        return all(len(f) >= need for f in end.free.values())

    def _prefill(self, i: int):
        p = self.prefills[i % len(self.prefills)]
        return p if p.alive else None

    # --------------------------------------------------------------- lending
    @rule(i=st.integers(0, 1), n=st.integers(1, 72))
    def fetch_ticket(self, i, n):
        p, d = self._prefill(i), self.decode
        if p is None or not self._room(p, n) or not self._room(d, n):
            return
        seed = self._next_seed()
        ticket = p.ticket(n, seed)
        d.fetch_ticket(ticket, seed=seed)

    @rule(i=st.integers(0, 1), n=st.integers(1, 72))
    def claim_ahead(self, i, n):
        """An engine claims a ticket as its request arrives, before it has pages for it."""
        p, d = self._prefill(i), self.decode
        if p is None or not self._room(p, n) or not self._room(d, n):
            return
        seed = self._next_seed()
        ticket = p.ticket(n, seed)
        d.claim(ticket)
        self.ahead.append((d, ticket, seed))

    @rule(k=st.integers(0, 7), read=st.booleans())
    def settle_claimed(self, k, read):
        """Later: the claimed ticket is read into fresh pages, or given back unread."""
        if not self.ahead:
            return
        d, ticket, seed = self.ahead.pop(k % len(self.ahead))
        if not d.alive:
            return
        if read and self._room(d, ticket.num_tokens):
            d.fetch_ticket(ticket, seed=seed)
        else:
            d.unclaim(ticket)

    @rule(i=st.integers(0, 1), n=st.integers(1, 72), first=st.booleans())
    def double_claim(self, i, n, first):
        """Two decodes redeem one ticket: exactly one of them may read it."""
        p = self._prefill(i)
        readers = [self.decode, self.other] if first else [self.other, self.decode]
        if p is None or not self._room(p, n) or not all(self._room(d, n) for d in readers):
            return
        seed = self._next_seed()
        ticket = p.ticket(n, seed)
        for d in readers:
            d.fetch_ticket(ticket, seed=seed)
        states = [d.records[max(d.records)].fetch for d in readers]
        denied = [f for f in states if type(f.error).__name__ == "LeaseDenied"]
        reading = [f.state is FetchState.READING and f.confirmed for f in states]  # read ahead counts once confirmed
        assert len(denied) <= 1 and not (len(denied) == 0 and all(reading))

    @rule(k=st.integers(0, 63))
    def finish_one_fetch(self, k):
        """Every read of one running fetch completes ok, in a random order."""
        d = self.decode if k % 3 else self.other
        running = [r for r in d.running() if r.fetch.tags]
        if not running:
            return
        record = running[k % len(running)]
        tags = sorted(record.fetch.tags)
        self.world.rng.shuffle(tags)
        for tag in tags:
            if not d.backend.reads[tag].terminal:
                d.backend.finish(tag)
        self.world.pump()

    @rule(k=st.integers(0, 63), then=st.sampled_from(["lose_done", "late_done", "kill_prefill", "expire"]))
    def finish_then_fault(self, k, then):
        """Every read of one fetch lands while what the decode sends waits on the wire; then its Done (and
        heartbeats) are lost with the link, arrive late, its prefill dies, or its lease expires before
        anything gets through.  One done in the lease's window stays done with every byte (protocol 6); one
        acking fails or is acked, never done over a reused page (the world checks the bytes)."""
        d = self.decode
        running = [r for r in d.running() if r.fetch.tags and r.fetch.state is FetchState.READING
                   and r.fetch.link in d.wires and d.wires[r.fetch.link].open]
        if not running:
            return
        record = running[k % len(running)]
        f, wire = record.fetch, d.wires[record.fetch.link]
        held = wire.hold_to_prefill
        wire.hold_to_prefill = True
        for tag in sorted(f.tags):
            if not d.backend.reads[tag].terminal:
                d.backend.finish(tag)
        self.world.pump()
        usable = f.state is FetchState.DONE
        event(f"finished, then {then}: {f.state.value}")
        if then == "lose_done":
            self.world.cut(wire)
        elif then == "late_done":
            self.world.advance(0.9 * CFG.heartbeat)
        elif then == "kill_prefill":
            i = next(i for i, p in enumerate(self.prefills) if p is wire.prefill)
            old = self.prefills[i]
            if old.alive:
                self.world.kill_prefill(old)
            self.prefills[i] = self.world.add_prefill(old.name, port=old.endpoint[1], config=CFG, offset=old.offset)
        else:
            self.world.jump(CFG.ttl + 0.5)
        if wire.open:
            wire.hold_to_prefill = held
        self.world.pump()
        if usable:  # finished in the window: nothing after changes what the engine was given
            assert f.state is FetchState.DONE and f.error is None and f.bound == f.num_tokens

    @rule(i=st.integers(0, 1), n=st.integers(1, 72))
    def push_offer(self, i, n):
        p = self._prefill(i)
        if p is None or self.decode.name not in p.session.peers or not self._room(p, n):
            return
        p.offer(self.decode.name, n, self._next_seed())

    @rule(i=st.integers(0, 1), k=st.integers(0, 63), land=st.booleans(), really=st.integers(0, 2))
    def engine_releases(self, i, k, land, really):
        """The prefill engine cancels a request it lent; its Abort waits on the wire while reads land (which
        count for the bound: the pages under them must not be reused yet)."""
        p = self._prefill(i)
        if p is None or not p.lent or really:
            return
        lease_id = list(p.lent)[k % len(p.lent)]  # in lending order: ids are random
        saved = [(w, w.hold_to_decode) for w in self.world.wires if w.prefill is p]
        for w, _ in saved:
            w.hold_to_decode = True
        p.session.release(lease_id)
        self.world.pump()
        if land:
            for d in (self.decode, self.other):
                for read in d.backend.in_flight():
                    if not read.terminal:
                        d.backend.finish(read.tag)
            self.world.pump()
        for w, held in saved:
            w.hold_to_decode = held
        self.world.pump()

    @rule(i=st.integers(0, 1))
    def connect(self, i):
        p = self._prefill(i)
        if p is not None:
            self.world.connect(self.decode, p)

    @rule(k=st.integers(0, 7), decline=st.integers(0, 4), resume=st.booleans())
    def take_offer(self, k, decline, resume):
        d = self.decode
        if not d.offers:
            return
        decline = decline == 0
        conn, offer = d.offers.pop(k % len(d.offers))
        if not d.session.ready(conn):
            return  # its link died: the offer went with it
        if decline:
            d.session.decline(conn, offer, "engine declines")
            self.world.pump()
            return
        if not self._room(d, offer.num_tokens):
            d.offers.append((conn, offer))
            return
        resume_from = (offer.num_tokens // TPP // 2) * TPP if resume else 0
        try:
            d.fetch_offer(conn, offer, resume_from=resume_from)
        except UsageError as exc:  # its prefill's engine released it meanwhile
            assert "no longer offered" in str(exc)

    @rule(k=st.integers(0, 7), call=st.integers(1, 3), bad=st.sampled_from(["planner", "dst", "resume"]))
    def broken_fetch_offer(self, k, call, bad):
        """A fetch start that raises (a planner bug, a bad table, a bad resume point) changes nothing."""
        d = self.decode
        ready = [(c, o) for c, o in d.offers if d.session.ready(c) and self._room(d, o.num_tokens)]
        if not ready:
            return
        conn, offer = ready[k % len(ready)]
        before = (d.session.in_flight, d.session.tracker.stats, len(d.backend.reads))
        good = d.alloc(offer.num_tokens)
        dst, resume = good, 0
        if bad == "dst":
            dst = {**good, "swa": good["swa"][:-1]}
        elif bad == "resume":
            resume = offer.num_tokens + call
        real, calls = fetch_mod.plan_reads, []

        def plan_reads(*args, **kw):
            calls.append(1)
            if len(calls) == call:
                raise _PlannerBug("injected")
            return real(*args, **kw)

        if bad == "planner":
            fetch_mod.plan_reads = plan_reads
        try:
            fetch = d.session.fetch_offer(conn, offer, dst, d.now, resume)
        except (_PlannerBug, KvlendError):
            fetch = None
        finally:
            fetch_mod.plan_reads = real
        if fetch is not None:  # fewer chunks than the injection waited for: a real fetch
            assert bad == "planner" and len(calls) < call
            d.offers.remove((conn, offer))
            d._track(fetch, good, 0)
            self.world.pump()
            return
        d._free_tables(good)
        self.world.pump()
        assert (d.session.in_flight, d.session.tracker.stats, len(d.backend.reads)) == before

    @rule(i=st.integers(0, 1), n=st.integers(1, 72), bad=st.sampled_from(["missing", "outside"]),
          retry=st.booleans())
    def broken_fetch_ticket(self, i, n, bad, retry):
        """A ticket redeemed with a bad table: refused at once on a ready link, else failed when its offer arrives.

        Either way nothing is posted and no Abort is sent: a retry with a good table works at once.
        """
        p, d = self._prefill(i), self.decode
        if p is None or not self._room(p, n) or not self._room(d, n, times=2):
            return
        seed = self._next_seed()
        ticket = p.ticket(n, seed)
        good = d.alloc(n, seed=seed)
        dst = {k: v for k, v in good.items() if k != "swa"} if bad == "missing" else \
            {**good, "full": np.full_like(good["full"], 10_000)}
        ready = any(w.prefill is p and d.session.ready(c) for c, w in d.wires.items())
        try:
            fetch = d.session.fetch_ticket(ticket, dst, d.now)
        except PageRangeError:
            assert bad == "missing" and ready  # only a ready link's plan can judge the table up front
            event("bad ticket table refused up front")
            if retry:
                d.fetch_ticket(ticket, good, seed=seed)
            else:
                d._free_tables(good)
            return
        assert not (bad == "missing" and ready)
        record = d._track(fetch, good, 0, seed)  # the good tables: a superset of what it may write
        self.world.pump()
        assert not record.tags  # no table this bad gets a read posted
        if not record.finished:
            return  # the claim's answer is still on its way (a held link); it fails when it comes
        assert fetch.state is FetchState.FAILED and fetch.bound == 0
        event(f"bad ticket table failed later: {type(fetch.error).__name__}")
        if retry and type(fetch.error).__name__ in ("LayoutError", "PageRangeError"):
            d.fetch_ticket(ticket, seed=seed)  # at once: UsageError here would mean the lease is wedged
            event("bad ticket table retried")

    @rule(i=st.integers(0, 1), n=st.integers(1, 72), call=st.integers(1, 3), retry=st.booleans())
    def planner_bug_inside_receive(self, i, n, call, retry):
        """The planner fails while an offer that answers a claim is being started: that fetch fails, nothing escapes."""
        p, d = self._prefill(i), self.decode
        if p is None or not self._room(p, n) or not self._room(d, n, times=2):
            return
        seed = self._next_seed()
        ticket = p.ticket(n, seed)
        real, calls = fetch_mod.plan_reads, []

        def plan_reads(*args, **kw):
            calls.append(1)
            if len(calls) == call:
                raise _PlannerBug("injected")
            return real(*args, **kw)

        fetch_mod.plan_reads = plan_reads
        try:
            record = d.fetch_ticket(ticket, seed=seed)  # any claimed offer started in this pump may be the one hit
        finally:
            fetch_mod.plan_reads = real
        for r in d.records.values():
            if r.finished and "_PlannerBug" in str(r.fetch.error):
                assert type(r.fetch.error) is KvlendError and r.fetch.bound == r.fetch.resume_from
                assert not r.tags
                event("planner bug inside receive failed a fetch")
        if retry and record.finished and "_PlannerBug" in str(record.fetch.error):
            d.fetch_ticket(ticket, seed=seed)  # at once: UsageError here would mean the lease is wedged
            event("planner bug retried")

    @rule(k=st.integers(0, 63))
    def decline_while_fetching(self, k):
        """Declining an offer that is being read is refused and changes nothing."""
        d = self.decode
        running = [r for r in d.running() if r.fetch.offer is not None]
        if not running:
            return
        f = running[k % len(running)].fetch
        before = (f.state, f.bound, len(d.backend.reads), d.session.in_flight)
        with pytest.raises(UsageError if d.session.ready(f.link) else PeerLost):
            d.session.decline(f.link, f.offer, "engine changes its mind")
        self.world.pump()
        assert (f.state, f.bound, len(d.backend.reads), d.session.in_flight) == before

    # ----------------------------------------------------------------- reads
    @rule(picks=st.lists(st.tuples(st.integers(0, 63), st.sampled_from(["ok"] * 6 + ["error", "late", "land"])),
                         min_size=1, max_size=8))
    def end_reads(self, picks):
        """End some reads in flight, in any order: ok, failed, landing late, or landing and still in flight."""
        backend = (self.decode if len(picks) % 3 else self.other).backend
        for k, how in picks:
            reads = backend.in_flight()
            if not reads:
                break
            read = reads[k % len(reads)]
            if how == "ok":
                backend.finish(read.tag)
            elif how == "error":
                backend.fail(read.tag)
            elif how == "late":
                backend.late(read.tag)
            else:
                backend.land(read.tag)
            if k % 2:
                self.world.pump()  # some reads are reported one by one, some together
        self.world.pump()

    @rule(k=st.integers(0, 63), really=st.integers(0, 2))
    def cancel(self, k, really):
        running = self.decode.running()
        if running and really == 0:
            self.decode.cancel(running[k % len(running)])

    # ------------------------------------------------------------------ time
    @rule(dt=st.floats(0.05, 2.0))
    def advance(self, dt):
        self.world.advance(dt)

    @rule(dt=st.sampled_from([CFG.ttl + 0.5, 2 * CFG.ttl, CFG.transfer_timeout + 1,
                              3 * (CFG.transfer_timeout + CFG.cancel_grace)]), really=st.integers(0, 2))
    def jump(self, dt, really):
        if really == 0:
            self.world.jump(dt)

    @rule(k=st.integers(0, 7))
    def toggle_heartbeats(self, k):
        """Hold (or let through) what the decode sends on one link: heartbeats, claims, dones, aborts."""
        wires = [w for w in self.decode.wires.values() if w.decode_open]
        if wires:
            wire = wires[k % len(wires)]
            wire.hold_to_prefill = not wire.hold_to_prefill
            self.world.pump()

    @rule(dt=st.floats(0.05, 0.9 * CFG.heartbeat), both=st.booleans())
    def latency(self, dt, both):
        """Everything a prefill sends (and maybe what the decodes send) waits ``dt`` < a heartbeat on the wire."""
        wires = [w for w in self.world.wires if w.open]
        saved = [(w, w.hold_to_decode, w.hold_to_prefill) for w in wires]
        for w in wires:
            w.hold_to_decode = True
            w.hold_to_prefill = w.hold_to_prefill or both
        self.world.advance(dt)
        for w, a, b in saved:
            w.hold_to_decode, w.hold_to_prefill = a, b
        self.world.pump()

    # ---------------------------------------------------------------- faults
    @rule(k=st.integers(0, 7), really=st.integers(0, 2))
    def cut_link(self, k, really):
        wires = [w for w in self.world.wires if w.open]
        if wires and really == 0:
            self.world.cut(wires[k % len(wires)])

    @rule(i=st.integers(0, 1), really=st.integers(0, 3))
    def restart_prefill(self, i, really):
        if really:
            return
        i %= len(self.prefills)
        old = self.prefills[i]
        if old.alive:
            self.world.kill_prefill(old)
        self.prefills[i] = self.world.add_prefill(old.name, port=old.endpoint[1], config=CFG, offset=old.offset)

    @rule(really=st.integers(0, 3))
    def restart_decode(self, really):
        if really:
            return
        self.world.kill_decode(self.decode)
        self.decode = self.world.add_decode("d0", config=CFG)
        self.restarts += 1

    @rule()
    def collect(self):
        """The engine takes finished fetches and frees their destinations."""
        for d in (self.decode, self.other):
            self._collect(d)

    def _collect(self, d):
        for record in list(d.records.values()):
            if record.finished:
                _trust_event(record)
                d.session.forget(record.fetch.id)
                d.release_dst(record)
                del d.records[record.fetch.id]

    # ------------------------------------------------------------ invariants
    @invariant()
    def locks_match_live_leases(self):
        self.world.check_locks()

    @invariant()
    def bookkeeping_agrees(self):
        for d in (self.decode, self.other):
            self._agree(d)

    @invariant()
    def states_change_only_by_moves_of_the_tables(self):
        """(v): each state seen now is the last seen one, or reached from it by this step's recorded moves."""
        made = {}
        for name, state, event_, after in self.moves:
            assert states.TABLES[name][state, event_] is after
            made.setdefault(name, set()).add((state, after))
            event(f"{name}: {'(new)' if state is None else state.value} -{event_.value}-> {after.value}")
        self.moves.clear()
        watched = [(d.session, "fetch", d.session._fetches) for d in self.world.decodes]
        watched += [(d.session, "link", d.session._links) for d in self.world.decodes]
        watched += [(p.session, "peer", p.session._peers) for p in self.world.prefills]
        watched += [(d.session, "lease", _link_leases(d.session)) for d in self.world.decodes]
        watched += [(p.session, "loan", p.session.lender.loans.all) for p in self.world.prefills]
        gone = {"lease": states.LeaseState.GONE, "loan": states.LoanState.GONE}
        for name, state in gone.items():  # forgotten, an id may begin again from nothing
            made.setdefault(name, set()).add((state, None))
        for session, name, objects in watched:
            for key, obj in objects.items():
                before = self.seen.get((session, name, key))
                assert obj.state is before or _reachable(made.get(name, ()), before, obj.state), \
                    (name, key, before, obj.state, made.get(name))
                self.seen[session, name, key] = obj.state
            if name in gone:  # one forgotten (its link still open) went there by moves to ``gone``
                for key in [k for k in self.seen if k[:2] == (session, name) and k[2] not in objects]:
                    before = self.seen.pop(key)
                    assert name == "lease" and key[2][0] not in session._links or \
                        _reachable(made[name], before, gone[name]), (key, before, made[name])

    def _agree(self, d):
        s = d.session
        running = d.running()
        assert s.in_flight == len(running), (s.in_flight, [r.fetch.state for r in running])
        assert s.tracker.stats.requests == sum(r.fetch.state in _ACTIVE for r in d.records.values())
        for record in d.records.values():
            f = record.fetch
            open_reads = {t for t in record.tags if not d.backend.reads[t].reported}
            assert f.tags == open_reads, (f.id, f.state, f.tags, open_reads)
            if record.finished:
                assert f.done and f.quiet
                assert isinstance(f.error, KvlendError) if f.state is FetchState.FAILED else f.error is None

    def teardown(self):
        if not hasattr(self, "world"):
            return
        try:
            self._settle()
        finally:
            tables.transition = self.transition

    def _settle(self):
        world = self.world
        for end in world.decodes:
            for r in end.finished:
                event(f"before teardown: {r.fetch.state.value} {type(r.fetch.error).__name__}")
                if isinstance(r.fetch.error, ProtocolError):
                    event(f"protocol error: {str(r.fetch.error)[:60]}")
            for r in end.records.values():
                _trust_event(r)
        for wire in world.wires:
            wire.hold_to_prefill = wire.hold_to_decode = False
        world.pump()
        live = [d for d in world.decodes if d.alive]
        for d, ticket, _ in self.ahead:  # the engine gives back what it claimed and will not read
            if d.alive:
                d.unclaim(ticket)
        for d in live:
            for conn, offer in d.offers:
                if d.session.ready(conn):
                    d.session.decline(conn, offer, "teardown")
            d.offers.clear()
        world.pump()
        world.settle()  # (iv) no read is ended by the test from here on
        for d in live:
            stuck = [(r.fetch.id, r.fetch.state.value) for r in d.running()]
            if stuck:
                raise ContractError(f"{d.name}: fetches still running past their deadline and grace: {stuck}")
            if d.backend.in_flight():
                raise ContractError(f"{d.name}: reads never went terminal: {[r.tag for r in d.backend.in_flight()]}")
        world.advance(CFG.ttl + 2 * CFG.heartbeat)
        world.check_locks()
        for p in world.prefills:
            if p.alive and p.lender.active_leases:
                raise ContractError(f"prefill {p.name} still holds {p.lender.active_leases} leases "
                                    f"({p.lender.locks.locked_pages()} pages) with nothing reading them")


def _link_leases(session) -> dict:
    """Every lease each of ``session``'s links knows, by (link id, lease id)."""
    return {(conn, lease): known for conn, link in session._links.items() for lease, known in link.leases.items()}


def _reachable(moves, start, end) -> bool:
    """Whether ``moves`` (pairs of states) lead from ``start`` to ``end``."""
    seen, todo = {start}, [start]
    while todo:
        state = todo.pop()
        for a, b in moves:
            if a is state and b not in seen:
                seen.add(b)
                todo.append(b)
    return end in seen


Sessions.TestCase.settings = settings(max_examples=examples(80), stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_sessions_stateful = Sessions.TestCase


class TestSessionsLong(Sessions.TestCase):
    settings = settings(max_examples=examples(40), stateful_step_count=60, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
