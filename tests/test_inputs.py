"""The records the shell hands the sessions (``kvlend.protocol.inputs``): each session's ``handle`` passes
each record it takes to the call that takes it, and refuses the other node's (a shell bug, never a peer's)."""

from __future__ import annotations

import pytest

from kvlend.errors import PeerLost
from kvlend.protocol.codes import Code
from kvlend.protocol.inputs import Accepted, Authenticated, Connected, Data, Gone
from kvlend.protocol.wire import Bye
from kvlend.testing import rig
from tests.support.sessions import CFG

pytestmark = pytest.mark.unit

ERROR = PeerLost("stream ended")
NOW = 7.0
# (record, the session call it reaches, the arguments that call gets)
COMMON = [
    (Authenticated(3, "peer"), "authenticated", (3, "peer", NOW)),
    (Data(3, [Bye(Code.OK, "done")], ERROR), "deliver", (3, [Bye(Code.OK, "done")], ERROR, NOW)),
    (Gone(3, "reset"), "closed", (3, NOW, "reset", False)),
    (Gone(3, "TLS refused", True), "closed", (3, NOW, "TLS refused", True)),
]
PREFILL = [(Accepted(3, "10.0.0.9"), "accept", (3, NOW, "10.0.0.9")), *COMMON]
DECODE = [(Connected(3, False), "connected", (3, NOW, False)), *COMMON]


def _sessions():
    _, p, d, _ = rig(CFG)
    return p.session, d.session


@pytest.mark.parametrize("side, record, call, args",
                         [("prefill", *c) for c in PREFILL] + [("decode", *c) for c in DECODE])
def test_a_record_reaches_the_call_that_takes_it(side, record, call, args):
    prefill, decode = _sessions()
    session = prefill if side == "prefill" else decode
    calls = []
    setattr(session, call, lambda *a: calls.append(a))
    session.handle(record, NOW)
    assert calls == [args]


@pytest.mark.parametrize("side, record", [("prefill", Connected(3, True)), ("decode", Accepted(3, None))])
def test_a_session_refuses_the_other_nodes_record(side, record):
    prefill, decode = _sessions()
    with pytest.raises(TypeError, match=type(record).__name__):
        (prefill if side == "prefill" else decode).handle(record, NOW)


def test_a_connection_handed_as_records_is_served_like_one_handed_as_calls():
    prefill, _ = _sessions()
    before = prefill.pending
    prefill.handle(Accepted(99, "10.0.0.9"), NOW)
    assert prefill.pending == before + 1
    prefill.handle(Gone(99, "reset"), NOW)
    assert prefill.pending == before
