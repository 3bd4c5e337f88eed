"""What one authenticated decode may cost a prefill (issue 34, 1), sans-IO on a fake clock.

The rules alone (``protocol.budget``: a share of each turn, strikes, handshake backoffs; the frame reader's
share; negotiations cached by layout id), then a ``PrefillSession`` fed a hostile peer's frames: claims of
ids nobody lent, heartbeats naming them, empty heartbeats, reconnects and costly layouts each throttle and
then drop the peer after a stated allowance, in a line or two, while an honest decode with many leases and
claims waiting for their lend is never struck.
"""

from __future__ import annotations

import logging
import secrets

import numpy as np
import pytest

from kvlend.core.layout import layout_from_pools
from kvlend.errors import ConfigError, LayoutMismatch, QuotaExceeded
from kvlend.protocol.budget import RECONNECTS, Handshakes, Share, Strikes, work_of
from kvlend.protocol.codes import Code
from kvlend.protocol.config import NodeConfig, Quotas
from kvlend.protocol.connection import FrameReader
from kvlend.protocol.negotiations import Negotiations
from kvlend.protocol.wire import Abort, Bye, Claim, Handshake, Heartbeat, Offer, Renewed, encode_frame
from kvlend.testing import KIND
from tests.test_hostile_sessions import Peer, at, collect, prefill, session_lines

pytestmark = pytest.mark.unit

Q = Quotas()
CFG = NodeConfig(ttl=5.0, heartbeat=1.0, handshake_timeout=3.0)


# ------------------------------------------------------------------ the rules
def test_a_heartbeat_costs_the_ids_it_names_anything_else_one():
    assert work_of(Heartbeat(())) == 1 and work_of(Heartbeat((bytes(16),) * 300)) == 300
    assert work_of(Claim(bytes(16))) == 1


def test_strikes_drop_past_the_allowance_and_are_forgiven_one_per_period():
    s = Strikes(allowance=3, forgiven=1.0)
    assert not s.throttled(0.0)
    assert [s.strike(0.0) for _ in range(3)] == [False] * 3 and s.throttled(0.0)
    assert s.strike(0.0)  # the fourth within a period
    s = Strikes(allowance=3, forgiven=1.0)
    for t in range(100):  # one a period, for ever: never dropped
        assert not s.strike(float(t))
    assert not s.throttled(101.0)


def test_an_identity_dropped_for_cause_waits_a_backoff_that_doubles_and_starts_over_once_quiet():
    h = Handshakes(backoff=1.0, max_backoff=4.0)
    h.admit("d", 0.0)
    assert [h.dropped("d", t) for t in (0.0, 1.0, 3.0, 7.0, 11.0)] == [1.0, 2.0, 4.0, 4.0, 4.0]
    with pytest.raises(QuotaExceeded) as caught:
        h.admit("d", 14.9)
    assert caught.value.limit == "handshake_backoff" and h.left("d", 14.9) == pytest.approx(0.1)
    h.admit("d", 15.0)
    h.admit("other", 14.0)  # per identity
    assert h.dropped("d", 15.0 + 4.0 + 4.0) == 1.0  # quiet for the longest backoff: from the start again


def test_an_identity_connecting_more_than_the_burst_waits_a_backoff():
    h = Handshakes(backoff=1.0, max_backoff=60.0)
    for _ in range(RECONNECTS):
        h.admit("d", 0.0)
    with pytest.raises(QuotaExceeded, match="reconnects too often"):
        h.admit("d", 0.0)
    with pytest.raises(QuotaExceeded, match="dropped for cause"):
        h.admit("d", 0.5)
    h.admit("d", 1.0)  # its backoff passed: one connection
    h.admit("d", 1.0, charge=False)  # a look, not a connection
    with pytest.raises(QuotaExceeded):
        h.admit("d", 1.0)  # one more at once: a backoff of 2 s
    h.admit("d", 3.0)
    with pytest.raises(QuotaExceeded):
        h.admit("d", 3.0)  # 4 s
    with pytest.raises(QuotaExceeded):
        h.admit("d", 6.9)
    h.admit("d", 7.0)
    h.admit("d", 11.0)  # it waited a whole backoff (4 s) more: regained one


def test_one_new_negotiation_per_identity_per_backoff():
    h = Handshakes(backoff=1.0, max_backoff=60.0)
    h.may_negotiate("d", 0.0)
    with pytest.raises(QuotaExceeded, match="negotiation not cached"):
        h.may_negotiate("d", 0.5)
    h.may_negotiate("e", 0.5)
    h.may_negotiate("d", 1.0)
    with pytest.raises(QuotaExceeded):
        h.may_negotiate("d", 2.5)  # doubled
    h.may_negotiate("d", 3.0)


def test_the_budget_quotas_are_checked():
    for field in ("messages_per_turn", "work_per_turn", "throttled_messages", "max_strikes"):
        with pytest.raises(ConfigError, match=field):
            Quotas(**{field: 0})
    for field in ("strike_forgiven", "handshake_backoff", "max_handshake_backoff"):
        with pytest.raises(ConfigError, match=field):
            Quotas(**{field: 0})
    with pytest.raises(ConfigError, match="max_handshake_backoff"):
        Quotas(handshake_backoff=10.0, max_handshake_backoff=5.0)
    assert Q.share == Share(64, 4096) and Q.throttled_share == Share(4, 4096)


def test_a_reader_decodes_a_share_and_keeps_the_rest_for_the_next_turn():
    frames = b"".join(encode_frame(Heartbeat(())) for _ in range(10))
    big = encode_frame(Heartbeat((bytes(16),) * 50))
    reader = FrameReader()
    got, error = reader.read(frames + big + frames, Share(4, 1000))
    assert len(got) == 4 and error is None and reader.backlog
    got, _ = reader.read(b"", Share(100, 20))  # the turn ends after the message that reaches the work
    assert len(got) == 7 and isinstance(got[-1], Heartbeat) and len(got[-1].leases) == 50
    got, _ = reader.read(b"", Share(0, 0))
    assert got == [] and reader.backlog
    got, _ = reader.read(b"")
    assert len(got) == 10 and not reader.backlog


def _layout(tpp: int, heads: int = 512):
    return layout_from_pools(kv=[np.zeros((2, 2, heads, tpp, 1), dtype=np.uint16) for _ in range(4)],
                             kept_window=1 << 20)


def test_negotiations_are_cached_by_layout_id_and_a_new_one_is_charged_to_the_identity(monkeypatch):
    import kvlend.protocol.negotiations as negotiations

    ours = _layout(1)
    made = []
    real = negotiations.negotiate
    monkeypatch.setattr(negotiations, "negotiate", lambda *a, **k: made.append(a[0].layout_id) or real(*a, **k))
    n = Negotiations(ours, Q, Handshakes(1.0, 60.0))
    costly = Handshake(_layout(64).encode(), KIND, b"")
    plan = n.result("flood", costly, 0.0)
    assert plan.plan.kind == "mapped" and plan.line.startswith("mapped plan") and len(made) == 1
    for t in range(5):  # reconnects with the same layout, from any address space: a lookup
        assert n.result("flood", Handshake(_layout(64).encode(), KIND, b""), 0.1 * t) is plan
    assert len(made) == 1
    with pytest.raises(QuotaExceeded, match="handshake_backoff"):
        n.result("flood", Handshake(_layout(32).encode(), KIND, b""), 0.5)  # another costly one, too soon
    mismatch = Handshake(_layout(1, heads=256).encode(), KIND, b"")
    for _ in range(2):
        with pytest.raises(LayoutMismatch):
            n.result("other", mismatch, 0.5)  # refused once, and cached as refused
    assert len(made) == 2
    n.prepare("flood", Handshake(_layout(16).encode(), KIND, b""), 0.6)  # its backoff: not computed, no raise
    assert len(made) == 2


# ----------------------------------------------------------------- the session
def drops(caplog, identity: str) -> list[str]:
    return session_lines(caplog, f"dropped decode rank {identity}")


def lines_about(caplog, identity: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvlend.session" and r.levelno >= logging.INFO and identity in r.getMessage()]


def test_claims_of_ids_nobody_lent_throttle_then_drop_the_peer_in_two_lines(caplog):
    caplog.set_level(logging.INFO, logger="kvlend.session")
    world, p = prefill(CFG)
    flood = Peer(p, 1, "flood")
    flood.send(Claim(secrets.token_bytes(16)))
    assert isinstance(flood.next(), Abort) and flood.closed is None
    assert p.session.throttled(p.now) == {1: Q.throttled_share}  # a strike is held against it
    flood.send(*(Claim(secrets.token_bytes(16)) for _ in range(Q.max_strikes)))
    collect(p, flood)
    assert flood.closed is not None and "max_strikes" in flood.closed
    assert p.session.peers == [] and p.session.throttled(p.now) == {}
    lines = lines_about(caplog, "flood")
    assert len(lines) == 3, lines  # its handshake, one summary of its refused claims, its drop
    assert "claims from flood: claim of lease" in lines[1] and "it may connect again in 1 s" in lines[2]


def test_a_refused_id_never_becomes_nameable_a_heartbeat_of_it_is_a_strike():
    """Before: a refused claim's id was remembered as named, so heartbeats naming it passed the drop rule."""
    world, p = prefill(CFG)
    flood = Peer(p, 1, "flood")
    bogus = secrets.token_bytes(16)
    flood.send(Claim(bogus))
    assert isinstance(flood.next(), Abort)
    for _ in range(Q.max_strikes - 1):  # one racing heartbeat is honest; a stream is not
        flood.send(Heartbeat((bogus,)))
        assert flood.next() == Renewed(()) and flood.closed is None
    flood.send(Heartbeat((bogus,)))
    collect(p, flood)
    assert flood.closed is not None and "max_strikes" in flood.closed


def test_empty_heartbeats_are_strikes():
    world, p = prefill(CFG)
    flood = Peer(p, 1, "flood")
    flood.send(*(Heartbeat(()) for _ in range(Q.max_strikes)))
    collect(p, flood)
    assert flood.closed is None
    flood.send(Heartbeat(()))
    collect(p, flood)
    assert flood.closed is not None and "empty heartbeat" in flood.closed


def test_a_dropped_identity_is_held_unread_through_its_backoff_then_told_why():
    world, p = prefill(CFG)
    flood = Peer(p, 1, "flood")
    flood.send(*(Heartbeat(()) for _ in range(Q.max_strikes + 1)))
    collect(p, flood)
    assert flood.closed is not None
    again = Peer(p, 2, "flood", layout=False)
    again.send(Handshake(p.layout.encode(), KIND, b"metadata"), Claim(secrets.token_bytes(16)))
    collect(p, again)
    assert again.inbox == [] and again.closed is None  # no answer, nothing handled
    assert p.session.throttled(p.now)[2] == Share(0, 0)  # not read meanwhile
    assert p.session.next_deadline() == pytest.approx(p.now + Q.handshake_backoff)
    at(world, p, world.now + Q.handshake_backoff + 0.01)
    bye = again.next()
    assert isinstance(bye, Bye) and bye.code is Code.QUOTA_EXCEEDED and "handshake_backoff" in bye.detail
    assert again.closed is not None
    Peer(p, 3, "flood")  # its backoff passed: served again
    assert p.session.peers == ["flood"]


def test_an_honest_decode_with_many_leases_and_waiting_claims_is_never_struck():
    config = NodeConfig(ttl=5.0, heartbeat=1.0, handshake_timeout=3.0, claim_wait=1.0,
                        quotas=Quotas(max_leases_per_peer=200))
    world, p = prefill(config)
    honest = Peer(p, 1, "decode-a")
    early = [secrets.token_bytes(16) for _ in range(200)]  # claimed before they are lent, as vLLM's connector does
    honest.send(*(Claim(i) for i in early))
    honest.send(Heartbeat(tuple(early)))  # waiting claims are nameable
    assert honest.next() == Renewed(()) and honest.closed is None
    for seed, i in enumerate(early):
        p.lend(4, seed, lease_id=i)
    collect(p, honest)
    assert sum(isinstance(m, Offer) for m in honest.inbox) == 200
    honest.inbox.clear()
    gone = p.lend(4, 999)
    p.session.release(gone.id)
    for _ in range(3 * Q.max_strikes):  # claims of leases that ended, and heartbeats of many: no strike
        honest.send(Claim(gone.id), Heartbeat(tuple(early)))
    collect(p, honest)
    assert honest.closed is None and p.session.throttled(p.now) == {}


def test_a_refused_layout_is_refused_again_from_the_cache_and_reconnects_past_the_burst_are_held():
    """A refused decode may come back at once to give back another ticket's lease (``test_sessions``): each
    time its layout costs a lookup; reconnecting more than ``RECONNECTS`` times at once holds it."""
    world, p = prefill(CFG)
    wrong = Handshake(_layout(8, heads=2).encode(), KIND, b"m")
    for conn in range(1, RECONNECTS + 1):
        peer = Peer(p, conn, "odd", layout=False)
        peer.send(wrong)
        assert isinstance(peer.next(), Handshake) and p.session.peers == []  # ours, without metadata: refused
        peer.send(Bye(Code.OK, "cannot read it"))
        collect(p, peer)
        assert peer.closed is not None
    assert len(p.session.negotiations._cache) == 1
    again = Peer(p, 99, "odd", layout=False)
    again.send(wrong)
    collect(p, again)
    assert again.inbox == [] and p.session.throttled(p.now)[99] == Share(0, 0)
    at(world, p, world.now + Q.handshake_backoff + 0.01)
    bye = again.next()
    assert isinstance(bye, Bye) and "reconnects too often" in bye.detail


def test_a_refused_decode_declining_ids_nobody_lent_is_struck_in_one_line(caplog):
    caplog.set_level(logging.INFO, logger="kvlend.session")
    world, p = prefill(CFG)
    odd = Peer(p, 1, "odd", layout=False)
    odd.send(Handshake(_layout(8, heads=2).encode(), KIND, b"m"))
    assert isinstance(odd.next(), Handshake)  # refused: it may decline its leases
    odd.send(*(Claim(secrets.token_bytes(16)) for _ in range(Q.max_strikes + 1)))
    collect(p, odd)
    assert odd.closed is not None and "max_strikes" in odd.closed
    assert len(session_lines(caplog, "declines from odd")) == 1


def test_a_burst_of_frames_is_handled_a_share_per_turn_by_the_reader():
    """What the shell does each turn: the reader decodes a peer's share; the rest waits unread."""
    world, p = prefill(CFG)
    honest = Peer(p, 1, "decode-a")
    reader = FrameReader()
    ids = [p.lend(4, i, peer="decode-a").id for i in range(200)]
    data = b"".join(encode_frame(Claim(i)) for i in ids)
    turns, share = 0, Q.share
    messages, _ = reader.read(data, share)
    while messages:
        turns += 1
        assert len(messages) <= share.messages
        p.session.deliver(1, messages, None, p.now)
        messages, _ = reader.read(b"", share)
    collect(p, honest)
    assert turns == -(-200 // share.messages) and sum(isinstance(m, Offer) for m in honest.inbox) == 200
