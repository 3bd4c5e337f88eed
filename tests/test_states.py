"""The state tables: every move through ``states.transition``, a move outside them is a bug that surfaces."""

from __future__ import annotations

import pytest

from kvlend.errors import KvlendError
from kvlend.protocol import states
from kvlend.protocol.states import (
    FETCH,
    LEASE,
    LOAN,
    FetchEvent,
    FetchState,
    IllegalTransition,
    LeaseEvent,
    LeaseState,
    LinkEvent,
    LinkState,
    LoanEvent,
    LoanState,
)
from kvlend.testing import World, finish_all

pytestmark = pytest.mark.unit


def test_a_pair_outside_the_table_is_an_illegal_transition():
    assert states.transition("fetch", FetchState.READING, FetchEvent.LAND) is FetchState.ACKING
    with pytest.raises(IllegalTransition, match="fetch: no transition from `done` on `fail`"):
        states.transition("fetch", FetchState.DONE, FetchEvent.FAIL)
    with pytest.raises(IllegalTransition, match=r"link: no transition from `ready` on `layout`"):
        states.transition("link", LinkState.READY, LinkEvent.LAYOUT)
    with pytest.raises(IllegalTransition, match=r"lease: no transition from `gone` on `offer`"):
        states.transition("lease", LeaseState.GONE, LeaseEvent.OFFER)
    assert not issubclass(IllegalTransition, KvlendError)  # no session handler takes it for a peer's failure


def test_every_table_is_over_its_own_states_and_events_and_ends_nowhere():
    for name, table in states.TABLES.items():
        kinds = {type(state) for state, _ in table if state is not None} | set(map(type, table.values()))
        assert len(kinds) == 1, (name, kinds)
        (kind,) = kinds
        assert set(kind) == {s for s, _ in table if s is not None} | set(table.values()), name  # every state is used
    assert not {state for state, _ in FETCH} & states.TERMINAL  # nothing leaves done or failed


def test_markdown_renders_every_move_once():
    text = states.markdown()
    sections = {part.split("\n", 1)[0]: part for part in text.split("### ")[1:]}
    assert list(sections) == list(states.TABLES)
    for name, table in states.TABLES.items():
        rows = [line for line in sections[name].splitlines() if line.startswith("| ") and "next state" not in line]
        assert len(rows) == len(table), name
        for (state, event), after in table.items():
            before = "(new)" if state is None else f"`{state.value}`"
            assert f"| {before} | `{event.value}` | `{after.value}` |" in rows


def test_a_planted_bad_transition_is_caught(monkeypatch):
    """With ``reading -usable-> done`` taken out of the table, the session's own move raises."""
    monkeypatch.setitem(states.TABLES, "fetch", {k: v for k, v in FETCH.items()
                                                 if k != (FetchState.READING, FetchEvent.USABLE)})
    world = World(0)
    p = world.add_prefill()
    d = world.add_decode()
    world.connect(d, p)
    record = d.fetch_ticket(p.ticket(8, seed=1), seed=1)
    assert record.fetch.state is FetchState.READING
    with pytest.raises(IllegalTransition, match="fetch: no transition from `reading` on `usable`"):
        finish_all(world, d)


def test_a_planted_bad_lease_transition_is_caught(monkeypatch):
    """With ``claimed -offer-> held`` taken out of the table, the answer to a claim made ahead raises."""
    monkeypatch.setitem(states.TABLES, "lease", {k: v for k, v in LEASE.items()
                                                 if k != (LeaseState.CLAIMED, LeaseEvent.OFFER)})
    world = World(0)
    p = world.add_prefill()
    d = world.add_decode()
    world.connect(d, p)
    ticket = p.ticket(8, seed=1)
    d.session.claim_ticket(ticket, d.now)  # sent, not yet answered (nothing pumped)
    conn = d.session.link_to(ticket.host, ticket.port, d.now)
    assert d.session._links[conn].state_of(ticket.lease) is LeaseState.CLAIMED
    with pytest.raises(IllegalTransition, match="lease: no transition from `claimed` on `offer`"):
        world.pump()


def test_a_planted_bad_loan_transition_is_caught(monkeypatch):
    """With ``offered -release-> held`` taken out of the table, releasing a lease under its reader raises."""
    monkeypatch.setitem(states.TABLES, "loan", {k: v for k, v in LOAN.items()
                                                if k != (LoanState.OFFERED, LoanEvent.RELEASE)})
    world = World(0)
    p = world.add_prefill()
    d = world.add_decode()
    world.connect(d, p)
    record = d.fetch_ticket(p.ticket(8, seed=1), seed=1)
    assert p.session.lender.loans.state_of(record.fetch.lease) is LoanState.OFFERED
    with pytest.raises(IllegalTransition, match="loan: no transition from `offered` on `release`"):
        p.session.release(record.fetch.lease)
