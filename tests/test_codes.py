"""Error codes on the wire: one table maps exceptions to codes and back, and nothing parses a detail."""

from __future__ import annotations

import struct

import msgpack
import pytest

from kvlend.errors import (
    AuthError,
    LayoutMismatch,
    LeaseDenied,
    LeaseExpired,
    LeaseLifetimeExceeded,
    LeaseUnknown,
    NegotiationLimit,
    PeerLost,
    PeerProtocolError,
    PromptMismatch,
    QuotaExceeded,
    TransferCancelled,
    TransferTimeout,
    UsageError,
)
from kvlend.protocol.codes import Code, code_of, detail_of, lease_error, link_error
from kvlend.protocol.wire import PROTOCOL_VERSION, Abort, Bye, DoneAck, FrameDecoder, encode_frame
from kvlend.testing import World

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("error, code", [
    (LeaseUnknown("x"), Code.LEASE_UNKNOWN), (LeaseExpired("x"), Code.LEASE_EXPIRED),
    (LeaseDenied("x"), Code.LEASE_DENIED), (PromptMismatch("x"), Code.PROMPT_MISMATCH),
    (QuotaExceeded("max_leases_per_peer", 3, 2), Code.QUOTA_EXCEEDED),
    (LeaseLifetimeExceeded("max_lease_lifetime", 3, 2), Code.QUOTA_EXCEEDED),  # a quota first, then an expiry
    (NegotiationLimit("max_pieces", 9, 8, "pieces", 1, 2), Code.QUOTA_EXCEEDED),
    (AuthError("x"), Code.AUTH), (PeerProtocolError("x"), Code.PROTOCOL), (UsageError("x"), Code.PROTOCOL),
    (LayoutMismatch([("dtype", "a", "b", "differ")]), Code.LAYOUT), (TransferTimeout("x"), Code.TIMEOUT),
    (TransferCancelled("x"), Code.CANCELLED), (PeerLost("x"), Code.FAILED), (RuntimeError("bug"), Code.FAILED),
])
def test_every_error_has_one_code(error, code):
    assert code_of(error) is code
    assert detail_of(error).startswith(f"{type(error).__name__}: ")


@pytest.mark.parametrize("cls", [LeaseUnknown, LeaseExpired, LeaseDenied, PromptMismatch])
def test_a_lease_error_travels_as_its_code_and_comes_back_as_its_class(cls):
    error = lease_error(code_of(cls("gone")), "prefill p0 refused lease ab: gone")
    assert type(error) is cls and str(error) == "prefill p0 refused lease ab: gone"


@pytest.mark.parametrize("code", [c for c in Code if c not in (Code.LEASE_UNKNOWN, Code.LEASE_EXPIRED,
                                                                Code.LEASE_DENIED, Code.PROMPT_MISMATCH)])
def test_any_other_code_refuses_a_lease_as_unknown(code):
    assert type(lease_error(code, "x")) is LeaseUnknown


def test_a_refused_handshake_is_an_auth_error_only_for_the_auth_code():
    assert type(link_error(Code.AUTH, "x")) is AuthError
    assert {type(link_error(c, "x")) for c in Code if c is not Code.AUTH} == {PeerProtocolError}


def test_a_detail_never_decides_the_class():
    """Version 4 split ``"LeaseExpired: ..."`` at the colon; a detail naming a class is text now."""
    assert type(lease_error(Code.LEASE_UNKNOWN, "LeaseExpired: not really")) is LeaseUnknown
    ack = DoneAck(b"\x00" * 16, Code.LEASE_DENIED, "LeaseExpired: says the text")
    assert not ack.ok and DoneAck(b"\x00" * 16, Code.OK, "").ok


def test_codes_travel_as_small_ints():
    frame = encode_frame(Abort(b"\x00" * 16, Code.PROMPT_MISMATCH, "d"))
    body = msgpack.unpackb(frame[4:])[1]
    assert body == {"t": "abort", "lease": b"\x00" * 16, "code": 4, "detail": "d"}
    decoder = FrameDecoder()
    decoder.feed(frame)
    assert decoder.next_message().code is Code.PROMPT_MISMATCH


def test_a_prefill_of_an_older_release_fails_the_link_naming_both_versions():
    world = World(0)
    d = world.add_decode()
    session = d.session
    conn = session.open("10.0.0.1", 7000, world.now)
    session.connected(conn, world.now)
    session.authenticated(conn, "prefill", world.now)
    payload = msgpack.packb([PROTOCOL_VERSION - 1, Bye(Code.OK, "x").to_wire()], use_bin_type=True)
    session.receive(conn, struct.pack(">I", len(payload)) + payload, world.now)
    error = session.link_error(conn)
    assert isinstance(error, PeerProtocolError), error
    assert (f"peer speaks kvlend protocol version {PROTOCOL_VERSION - 1}, this rank speaks {PROTOCOL_VERSION}: "
            "run the same kvlend release on both sides") in str(error)
