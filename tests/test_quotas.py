"""Per-peer quotas, sans-IO: every limit of ``Quotas`` refused with a ``QuotaExceeded`` naming it.

Real ``PrefillSession`` and ``DecodeSession`` over ``kvlend.testing.World``
(fake clock, in-memory network and backend).  Each refusal happens before
any state changes: no lock is taken, no lease is bound, nothing is renewed.
Also: a layout claiming an enormous page ratio is refused in under 10 ms,
and strings a peer chose cannot forge a log line.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import tracemalloc

import pytest

from kvlend.core.text import printable
from kvlend.errors import (
    ConfigError,
    KvlendError,
    LayoutMismatch,
    LeaseExpired,
    LeaseLifetimeExceeded,
    NegotiationLimit,
    ProtocolError,
    QuotaExceeded,
)
from kvlend.protocol.config import NodeConfig, Quotas
from kvlend.protocol.decode import DecodeSession, FetchState
from kvlend.testing import World, finish_all, rig as memory_rig

pytestmark = pytest.mark.unit

# read_ahead off: a refused claim is seen before anything is read (tests/support/sessions.py says why)
BASE = dict(ttl=5.0, heartbeat=1.0, handshake_timeout=3.0, transfer_timeout=1e6, cancel_grace=2.0, chunk_pages=4,
            read_ahead=False)
CFG = NodeConfig(**BASE)


def config(**quotas) -> NodeConfig:
    return NodeConfig(**BASE, quotas=Quotas(**quotas))


def rig(prefill_config: NodeConfig = CFG, **kw):
    """``kvlend.testing.rig`` with the quotas under test on the prefill only."""
    return memory_rig(prefill_config, decode_config=CFG, **kw)


def locks(p) -> int:
    return p.lender.locks.locked_pages()


def session_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvlend.session"]


# --------------------------------------------------------------- configuration
def test_defaults_are_documented_and_fit_real_models():
    q = NodeConfig().quotas
    assert q == Quotas()
    assert q.max_num_tokens >= 10_000_000  # 10M-token contexts
    assert q.max_page_ratio >= 64  # 1-token pages (SGLang) against 64-token ones
    assert q.max_lease_lifetime >= 10 * NodeConfig().ttl
    assert q.max_heartbeat_ids > q.max_leases_per_peer
    # 128 layers x K and V x ratio 64 x 16 heads per rank: the largest plan a real model asks for
    assert q.max_pieces >= 128 * 2 * 64 * 16
    for name in (f.name for f in dataclasses.fields(Quotas)):
        assert name in Quotas.__doc__, f"Quotas.{name} is not documented"
    limits = q.lease_limits
    assert (limits.max_leases_per_peer, limits.max_locked_pages_per_peer, limits.max_lease_lifetime,
            limits.max_num_tokens) == (q.max_leases_per_peer, q.max_locked_pages_per_peer, q.max_lease_lifetime,
                                       q.max_num_tokens)


@pytest.mark.parametrize("field, value", [
    ("max_leases_per_peer", 0), ("max_locked_pages_per_peer", -1), ("max_heartbeat_ids", 1.5),
    ("max_num_tokens", True), ("max_page_ratio", "64"), ("max_pieces", 0),
    ("max_lease_lifetime", 0), ("max_lease_lifetime", float("inf")), ("max_lease_lifetime", float("nan")),
])
def test_bad_quotas_are_config_errors_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"Quotas.{field}"):
        Quotas(**{field: value})


def test_node_config_checks_its_quotas():
    with pytest.raises(ConfigError, match="quotas must be a Quotas"):
        NodeConfig(quotas={"max_leases_per_peer": 4})
    with pytest.raises(ConfigError, match="max_lease_lifetime 4.0 must be at least ttl 5.0"):
        config(max_lease_lifetime=4.0)
    assert config(max_lease_lifetime=5.0).quotas.max_lease_lifetime == 5.0


def test_quota_errors_are_typed_and_name_the_limit():
    exc = QuotaExceeded("max_leases_per_peer", 5, 4, "live leases:")
    assert isinstance(exc, KvlendError) and (exc.limit, exc.value, exc.cap) == ("max_leases_per_peer", 5, 4)
    assert str(exc) == "max_leases_per_peer: live leases: 5 exceeds the cap of 4"
    assert issubclass(LeaseLifetimeExceeded, LeaseExpired) and issubclass(LeaseLifetimeExceeded, QuotaExceeded)
    assert issubclass(NegotiationLimit, LayoutMismatch) and issubclass(NegotiationLimit, QuotaExceeded)
    ratio = NegotiationLimit("max_page_ratio", 128, 64, "tokens_per_page", 2048, 16, "a ratio of")
    for e in (exc, LeaseLifetimeExceeded("max_lease_lifetime", 26.0, 25.0, "a lifetime of"), ratio):
        again = pickle.loads(pickle.dumps(e))  # rebuilt from its fields (errors cross process boundaries)
        assert type(again) is type(e) and str(again) == str(e) and again.limit == e.limit
    assert again.fields == ratio.fields


# ------------------------------------------------------------- lease lifetime
def test_a_lease_renewed_past_its_max_lifetime_is_refused_and_expires_by_then(caplog):
    world, p, d, conn = rig(config(max_lease_lifetime=12.0))
    caplog.set_level(logging.INFO, logger="kvlend.session")
    lease = p.offer("decode", 10, seed=1)  # a pushed offer the decode holds: it heartbeats it every second
    assert lease.ends_by == lease.lent_at + 12.0
    world.advance(30.0, step=0.5)
    assert (lease.id, "expired") in p.ended and locks(p) == 0
    refusals = [m for m in session_logs(caplog) if "max_lease_lifetime" in m and lease.hex in m]
    assert refusals, session_logs(caplog)
    assert all("heartbeat from decode: " in m for m in refusals)
    expired = [m for m in session_logs(caplog) if m.startswith(f"lease {lease.hex} of request") and "expired" in m]
    assert len(expired) == 1
    world.check_locks()


def test_expiry_happens_at_the_lifetime_cap_under_steady_heartbeats():
    world, p, d, conn = rig(config(max_lease_lifetime=12.0))
    lease = p.offer("decode", 10, seed=1)
    lent = lease.lent_at
    world.advance(12.0 - CFG.heartbeat - 0.25, step=0.25)
    assert (lease.id, "expired") not in p.ended  # renewed all along: heartbeats keep it past its 5 s ttl
    world.advance(CFG.heartbeat + 0.5, step=0.25)  # past lend time + 12 s
    assert (lease.id, "expired") in p.ended
    assert p.now <= lent + 12.0 + 0.5
    # Without the cap the same heartbeats keep it alive.
    world2, p2, d2, _ = rig(CFG)
    other = p2.offer("decode", 10, seed=1)
    world2.advance(30.0, step=0.5)
    assert p2.lender.get(other.id, p2.now).expires_at > p2.now


def test_a_claim_after_the_lifetime_cap_is_refused_with_the_limit_named():
    """A ticket's lifetime runs from lending: a claim that would renew it past the cap is refused."""
    world, p, d, conn = rig(config(max_lease_lifetime=6.0))
    t = p.ticket(8, seed=1)
    world.now += 2.0  # still within its 5 s ttl, but a claim now would renew it to 7 s > 6 s
    r = d.fetch_ticket(t, seed=1)
    assert r.fetch.state is FetchState.FAILED
    assert "LeaseLifetimeExceeded" in str(r.fetch.error) and "max_lease_lifetime" in str(r.fetch.error)
    lease = p.lender.get(t.lease, p.now)
    assert lease.peer is None and lease.expires_at == lease.lent_at + 5.0  # not bound, not renewed
    world.check_locks()


# ------------------------------------------------------------ per-peer leases
def test_offers_past_the_peer_lease_quota_are_refused_before_locking():
    world, p, d, conn = rig(config(max_leases_per_peer=2))
    a, b = p.offer("decode", 10, seed=1), p.offer("decode", 12, seed=2)
    before = locks(p), p.lender.active_leases, len(d.offers)
    with pytest.raises(QuotaExceeded) as info:
        p.offer("decode", 14, seed=3)
    assert (info.value.limit, info.value.value, info.value.cap) == ("max_leases_per_peer", 3, 2)
    assert "'decode'" in str(info.value)
    with pytest.raises(QuotaExceeded, match="max_leases_per_peer"):
        p.lend(20, seed=4, peer="decode")  # lent to the peer without an offer counts the same
    assert (locks(p), p.lender.active_leases, len(d.offers)) == before
    p.ticket(16, seed=5)  # a ticket is nobody's until claimed
    # One done: the peer has room again.
    d.fetch_offer(conn, d.offers[0][1])
    finish_all(world, d)
    assert (a.id, "done") in p.ended
    c = p.offer("decode", 14, seed=6)
    assert p.lender.usage("decode") == (2, b.num_pages + c.num_pages)
    world.check_locks()


def test_leases_past_expiry_not_yet_swept_do_not_count():
    world, p, d, conn = rig(config(max_leases_per_peer=1))
    p.lend(10, seed=1, peer="decode")  # never offered: nobody heartbeats it
    world.now += CFG.ttl + 1  # past its expiry; the prefill has not ticked
    p.lend(10, seed=2, peer="decode")
    world.tick()
    assert [reason for _, reason in p.ended] == ["expired"]
    world.check_locks()


def test_claims_past_the_peer_lease_quota_are_refused_and_the_ticket_stays_claimable():
    world = World(1)
    p = world.add_prefill(config=config(max_leases_per_peer=2))
    d1, d2 = world.add_decode("d1", config=CFG), world.add_decode("d2", config=CFG)
    tickets = [p.ticket(8 + i, seed=i) for i in range(3)]
    first = [d1.fetch_ticket(t, seed=i) for i, t in enumerate(tickets[:2])]
    assert all(r.fetch.state is FetchState.READING for r in first)
    third = d1.fetch_ticket(tickets[2], seed=2)
    assert third.fetch.state is FetchState.FAILED
    assert "QuotaExceeded" in str(third.fetch.error) and "max_leases_per_peer: " in str(third.fetch.error)
    assert p.lender.get(tickets[2].lease, p.now).peer is None  # refused before binding
    assert not [read for read in d1.backend.reads.values() if read.tag in third.tags]
    other = d2.fetch_ticket(tickets[2], seed=2)  # another decode may still claim it
    finish_all(world, d1)
    finish_all(world, d2)
    assert all(r.fetch.state is FetchState.DONE for r in (*first, other))
    assert sorted(reason for _, reason in p.ended) == ["done"] * 3
    world.check_locks()


# ------------------------------------------------------------ per-peer pages
def test_offers_past_the_peer_page_quota_are_refused_before_locking():
    world, p, d, conn = rig(config(max_locked_pages_per_peer=20))
    lease = p.offer("decode", 4 * 8, seed=1)  # 8 token pages in each of two groups (windows are 64 tokens)
    assert lease.num_pages == 16 and p.lender.usage("decode") == (1, 16)
    before = locks(p), p.lender.active_leases
    with pytest.raises(QuotaExceeded) as info:
        p.offer("decode", 4 * 3, seed=2)  # 6 more pages: 22 > 20
    assert (info.value.limit, info.value.value, info.value.cap) == ("max_locked_pages_per_peer", 22, 20)
    assert (locks(p), p.lender.active_leases) == before
    p.offer("decode", 4 * 2, seed=3)  # 4 more: 20, at the cap
    assert p.lender.usage("decode") == (2, 20)
    # A ticket's pages count against the peer that claims it.
    t = p.ticket(4, seed=4)
    r = d.fetch_ticket(t, seed=4)
    assert r.fetch.state is FetchState.FAILED and "max_locked_pages_per_peer" in str(r.fetch.error)
    assert p.lender.usage("decode") == (2, 20) and p.lender.usage(None) == (1, 2)
    world.check_locks()


# --------------------------------------------------------------- num_tokens
def test_lends_and_offers_past_max_num_tokens_are_refused():
    world, p, d, conn = rig(config(max_num_tokens=100))
    before = locks(p)
    for lend in (lambda: p.offer("decode", 101, seed=1), lambda: p.ticket(101, seed=2)):
        with pytest.raises(QuotaExceeded) as info:
            lend()
        assert (info.value.limit, info.value.value, info.value.cap) == ("max_num_tokens", 101, 100)
    assert locks(p) == before and p.lender.active_leases == 0 and not d.offers
    p.offer("decode", 100, seed=3)
    world.check_locks()


# --------------------------------------------------------------- heartbeats
def test_a_heartbeat_naming_too_many_ids_renews_nothing(caplog):
    world, p, d, conn = rig(config(max_heartbeat_ids=2))
    caplog.set_level(logging.INFO, logger="kvlend.session")
    leases = [p.offer("decode", 8 + i, seed=i) for i in range(3)]  # the decode heartbeats all three
    expiry = [p.lender.get(x.id, p.now).expires_at for x in leases]
    world.advance(2.0, step=0.5)  # heartbeats went out and were answered
    assert [p.lender.get(x.id, p.now).expires_at for x in leases] == expiry  # not renewed
    refused = [m for m in session_logs(caplog) if "heartbeat from decode: refused" in m]
    assert refused and "max_heartbeat_ids: a heartbeat naming lease ids: 3 exceeds the cap of 2" in refused[0]
    assert p.session.peers == ["decode"] and d.session.ready(conn)  # the link stays up
    world.advance(CFG.ttl, step=0.5)
    assert sorted(reason for _, reason in p.ended) == ["expired"] * 3
    world.check_locks()
    # At the cap, heartbeats renew as usual.
    world, p, d, conn = rig(config(max_heartbeat_ids=2))
    for i in range(2):
        p.offer("decode", 8 + i, seed=i)
    world.advance(3 * CFG.ttl, step=0.5)
    assert p.lender.active_leases == 2 and not p.ended
    world.check_locks()


# -------------------------------------------------------------- negotiation
def scaled(layout, factor: int):
    """``layout`` claiming ``factor`` times as many tokens per page (no memory behind it)."""
    regions = tuple(dataclasses.replace(r, page_stride=r.page_stride * factor, size=r.size * factor)
                    for r in layout.regions)
    buffers = tuple(dataclasses.replace(b, offset=b.offset * factor, page_bytes=b.page_bytes * factor)
                    for b in layout.buffers)
    return dataclasses.replace(layout, regions=regions, buffers=buffers,
                               tokens_per_page=layout.tokens_per_page * factor,
                               kept_window=layout.tokens_per_page * factor)


def test_a_layout_claiming_an_enormous_page_ratio_is_refused_before_any_work():
    """2^20 tokens-per-page ratio: before the caps, ~6 s and 776 MiB under the prefill's lock."""
    for run in range(5):
        world = World(run)
        p = world.add_prefill(config=CFG)
        d = world.add_decode(config=CFG)
        d.session = DecodeSession(scaled(d.layout, 1 << 20), "memory", name="decode", config=CFG)
        peaks = []
        receive = p.session.receive

        def measured(conn, data, now, receive=receive, peaks=peaks):
            tracemalloc.start()  # memory, not a clock, shows the refusal came before the work (busy hosts)
            try:
                receive(conn, data, now)
                peaks.append(tracemalloc.get_traced_memory()[1])
            finally:
                tracemalloc.stop()

        p.session.receive = measured
        conn = d.session.link_to(*p.endpoint, d.now)
        world.pump()
        error = d.session.link_error(conn)
        assert isinstance(error, ProtocolError) and "max_page_ratio" in str(error), error
        assert "tokens-per-page ratio of 1048576 exceeds the cap of 64" in str(error)
        assert p.session.peers == [] and p.lender.active_leases == 0
        worst = max(peaks)  # the receive that refused the handshake
        assert worst < 1 << 20, f"{worst / 2**20:.1f} MiB allocated while refusing"


def test_a_plan_of_too_many_pieces_is_refused_at_the_handshake():
    world = World(0)
    p = world.add_prefill(config=config(max_pieces=7))
    d = world.add_decode(config=CFG)
    conn = d.session.link_to(*p.endpoint, d.now)
    world.pump()
    error = d.session.link_error(conn)
    assert "max_pieces: mapping these layouts needs pieces: 8 exceeds the cap of 7" in str(error), error
    assert p.session.peers == []
    world2 = World(0)
    p2 = world2.add_prefill(config=config(max_pieces=8))
    d2 = world2.add_decode(config=CFG)
    assert d2.session.ready(world2.connect(d2, p2))


# ------------------------------------------------------------------ logging
EVIL = "evil\n2030-01-01 00:00:00 CRITICAL kvlend.session forged\r\x1b[2J\x1b[31m\u2028\u202e"


def test_printable_escapes_control_characters_and_truncates():
    assert printable("decode-0") == "decode-0"
    out = printable(EVIL)
    assert out.isprintable() and "\\n" in out and "\\x1b" in out and "\\u2028" in out and "\\u202e" in out
    assert printable("x" * 500, limit=10) == "x" * 10 + "...[500 chars]"
    assert printable(None) == "None" and printable(b"\x00\n") == "000a"
    assert printable(ValueError("a\nb")) == "a\\nb"


def test_strings_a_peer_chose_cannot_forge_a_log_line(caplog):
    caplog.set_level(logging.DEBUG, logger="kvlend")
    world, p, d, conn = rig(decode=EVIL)
    p.ticket(8, seed=1, request="req\n" + EVIL)  # expires: the request id is logged
    p.offer(EVIL, 8, seed=2)
    world.advance(CFG.ttl + 1)
    d.session.disconnect(conn, d.now, reason="bye\n" + EVIL)  # the reason is logged by the prefill
    world.pump()
    mine = [r.getMessage() for r in caplog.records if r.pathname.endswith("prefill.py")]
    assert any("authenticated as evil\\n" in m for m in mine), mine
    assert any("said bye: " in m and ": bye\\nevil\\n2030" in m for m in mine), mine
    assert any("of request req\\nevil" in m for m in mine), mine
    for m in mine:
        assert m.isprintable(), repr(m)


def test_the_decode_logs_a_prefills_strings_escaped(caplog):
    caplog.set_level(logging.DEBUG, logger="kvlend")
    world = World(0)
    p = world.add_prefill(EVIL, config=CFG)
    d = world.add_decode("decode", config=CFG)
    world.connect(d, p)
    r = d.fetch_ticket(p.ticket(8, seed=1, request="req\n" + EVIL), seed=1)
    d.cancel(r)
    world.pump()
    p.session.shutdown("bye\n" + EVIL)
    world.pump()
    mine = [rec.getMessage() for rec in caplog.records if rec.pathname.endswith("decode.py")]
    assert any("evil\\n" in m for m in mine), mine
    for m in mine:
        assert m.isprintable(), repr(m)


def test_the_decode_refuses_leases_past_its_own_max_num_tokens():
    """A prefill could claim any num_tokens; tracking it costs memory in proportion, so the decode checks."""
    small = dataclasses.replace(CFG, quotas=dataclasses.replace(CFG.quotas, max_num_tokens=64))
    world = World(0)
    p = world.add_prefill(config=CFG)
    d = world.add_decode("decode", config=small)
    conn = world.connect(d, p)
    lease = p.offer("decode", 100, seed=1)
    world.pump()
    assert not d.offers and (lease.id, "aborted") in p.ended  # declined at once, naming the limit
    with pytest.raises(QuotaExceeded, match="max_num_tokens"):
        d.session.fetch_ticket(p.ticket(100, seed=2), d.alloc(100), d.now)
    assert d.session.in_flight == 0 and conn in d.session.links
