"""The raw baseline's target: NixlConnector's work per notification (look the request up, free its blocks)."""

from __future__ import annotations

import pytest

from kvlend_nixl.bench.peer_engine import PeerEngine, notification

pytestmark = pytest.mark.unit


class _Agent:
    """A NIXL agent's notifications, as ``get_new_notifs`` hands them: by the reader's agent name."""

    def __init__(self) -> None:
        self.queued: list[bytes] = []

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        out, self.queued = self.queued, []
        return {"reader": out} if out else {}


def test_a_request_frees_its_blocks_once_every_reader_notified():
    engine, agent = PeerEngine(), _Agent()
    engine.expect([("a", 3), ("b", 2)])
    assert engine.free.count == 0 and set(engine.reqs_to_send) == {"a", "b"}
    agent.queued = [notification("a", readers=2), notification("b")]
    assert engine.step(agent) == 2
    assert engine.freed == 1 and engine.free.count == 2 and "a" in engine.reqs_to_send  # a waits for its 2nd reader
    agent.queued = [notification("a", readers=2)]
    engine.step(agent)
    assert engine.freed == 2 and engine.free.count == 5 and not engine.reqs_to_send and not engine.req_to_blocks
    engine.expect([("c", 5)])  # the freed blocks are taken again: the pool does not grow
    assert engine.made == 5 and engine.free.count == 0


def test_unknown_and_malformed_notifications_free_nothing():
    engine, agent = PeerEngine(), _Agent()
    engine.expect([("a", 1)])
    agent.queued = [notification("zzz"), b"bench"]
    engine.step(agent)
    assert (engine.notifications, engine.unknown, engine.freed) == (2, 2, 0)
