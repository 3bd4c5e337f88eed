"""An authenticated decode's frames cost the prefill's loop, never its lock; a silent one is timed out.

Real nodes over real NIXL (UCX) and TLS; the hostile decode is a ``RawDecode``.
Issue 22, 2 and 3: frames were decoded under the node's lock (a 15 MiB frame
of nested containers held it 19 s; the largest allowed handshake layout 862 ms),
so the engine's ``lend`` waited for them.  A decode's frame or layout is now
held in the middle of its decoding on the loop thread, and the engine's
``lend`` must still return; and an authenticated connection that never sends
its layout is dropped after ``handshake_timeout``, freeing its identity.
"""

from __future__ import annotations

import threading

import pytest

import kvlend.protocol.wire
from kvlend.core.layout import PageLayout
from kvlend.errors import PeerLost
from kvlend.protocol.config import NodeConfig
from kvlend.protocol.wire import Bye, Handshake, Heartbeat
from kvlend.testing.kvcache import prefill_request
from tests.support.certs import creds
from tests.support.nodes import DEADLINE, SRC_PAGES, free_lists, rig, wait_until
from tests.support.raw_peer import RawDecode

pytestmark = pytest.mark.nixl


@pytest.mark.parametrize("held", ["frame", "layout"])
def test_a_peers_frame_or_layout_being_decoded_holds_up_no_lend(monkeypatch, held):
    with rig() as r:
        loop = r.prefill.loop_thread
        layout = r.decode.layout.encode()
        entered, release = threading.Event(), threading.Event()

        def hold(matches: bool) -> None:
            if matches and threading.current_thread() is loop:
                entered.set()
                release.wait(2 * DEADLINE)

        if held == "frame":
            real_decode_payload = kvlend.protocol.wire.decode_payload

            def decode_payload(payload):
                hold(b"\xa1t\xa9heartbeat" in payload)  # "t": "heartbeat"
                return real_decode_payload(payload)

            monkeypatch.setattr(kvlend.protocol.wire, "decode_payload", decode_payload)
        else:
            real_decode = PageLayout.decode.__func__

            def decode(cls, data):
                hold(bytes(data) == layout)
                return real_decode(cls, data)

            monkeypatch.setattr(PageLayout, "decode", classmethod(decode))
        tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 7), 40, seed=7)
        lent, failed = threading.Event(), []

        def lend() -> None:
            try:
                r.prefill.lend("engine-call", 40, tables, r.layout.full_selection())
            except Exception as exc:  # reported by the assertion below
                failed.append(exc)
            lent.set()

        with RawDecode(r.prefill.address, creds("decode-slow", "decode")) as raw:
            try:
                if held == "frame":
                    raw.handshake(r.decode.layout)
                    raw.send(Heartbeat(()))
                else:
                    raw.send(Handshake(layout, "nixl", b"raw-peer-metadata"))
                assert entered.wait(DEADLINE), f"the {held} never reached its decoding"
                threading.Thread(target=lend, daemon=True).start()
                assert lent.wait(DEADLINE), f"lend() waited for the {held} being decoded"
                assert not failed, failed
            finally:
                release.set()
            wait_until(lambda: "decode-slow" in r.prefill.ready_peers(), "the slow peer served after all")


def test_an_authenticated_peer_that_never_sends_its_layout_is_dropped_and_frees_its_identity():
    with rig(NodeConfig(handshake_timeout=1.0)) as r:
        with RawDecode(r.prefill.address, creds("decode-silent", "decode")) as silent:
            bye = silent.recv(DEADLINE)
            assert isinstance(bye, Bye) and "no handshake within handshake_timeout 1 s" in bye.detail, bye
            with pytest.raises(PeerLost):
                silent.recv(DEADLINE)
        with RawDecode(r.prefill.address, creds("decode-silent", "decode")) as again:
            again.handshake(r.decode.layout)
            wait_until(lambda: r.prefill.ready_peers() == sorted([r.peer, "decode-silent"]), "its slot came back")
