"""The shell under faulty and hostile input, over real NIXL agents and real TLS: one failing action, a slow
name lookup or a peer that never reads its replies costs only what it belongs to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time

import numpy as np
import pytest

from kvlend.core.lender import LEASE_ID_BYTES
from kvlend.errors import ConfigError, PeerLost, ProtocolError
from kvlend.protocol.config import Quotas
from kvlend.protocol.connection import Connection
from kvlend.protocol.wire import Claim
from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode
from kvlend.testing.kvcache import FreeList, expected_pages, make_layout, make_pools, prefill_request, slots
from tests.support.agents import nixl
from tests.support.certs import creds
from tests.support.nodes import wait_until
from tests.support.raw_peer import RawDecode
from tests.support.wire import wire_text

pytestmark = pytest.mark.nixl

DEADLINE = 10.0  # a guard: anything that takes this long has hung
PAGES = 64
TPP = 4
CONFIG = NodeConfig(handshake_timeout=DEADLINE, transfer_timeout=DEADLINE)


@contextlib.contextmanager
def held(node):
    """The node's loop, held: whatever engine calls queue meanwhile goes out as one batch."""
    with node._turn:
        yield


@contextlib.contextmanager
def nodes(prefills: int = 1, advertise=(), prefill_config: NodeConfig = CONFIG, decode_config: NodeConfig = CONFIG):
    """Started prefill nodes (``advertise``: the host each one's tickets name) and a started decode."""
    started, srcs = [], []
    decode = None
    try:
        for rank in range(prefills):
            src = make_pools(PAGES)
            node = PrefillNode(make_layout(src), nixl(f"prefill{rank}"), creds(f"prefill-{rank}", "prefill"),
                               advertise=advertise[rank] if rank < len(advertise) else None, config=prefill_config)
            node.start()
            started.append(node)
            srcs.append(src)
        dst = make_pools(PAGES)
        decode = DecodeNode(make_layout(dst), nixl("decode"), creds("decode", "decode"), config=decode_config)
        decode.start()
        yield started, srcs, decode, dst
    finally:
        if decode is not None:
            decode.close()
            decode.backend.close()
        for node in started:
            node.close()
            node.backend.close()


class Requests:
    """Requests lent by prefills as tickets, each read into its own decode pages and checked byte for byte."""

    def __init__(self, decode: DecodeNode, dst) -> None:
        self.decode, self.dst = decode, dst
        rng = np.random.default_rng(3)
        self.dfree = {g: FreeList(PAGES, rng) for g in decode.layout.groups}
        self.free: dict[int, dict] = {}
        self.want: dict[str, tuple] = {}

    def lend(self, prefill: PrefillNode, src, seed: int, num_tokens: int = 21):
        free = self.free.setdefault(id(prefill), {g: FreeList(PAGES, np.random.default_rng(seed))
                                                  for g in prefill.layout.groups})
        tables = prefill_request(prefill.layout, src, free, num_tokens, seed)
        request = f"req-{seed}"
        table = {g: self.dfree[g].alloc(-(-num_tokens // TPP)) for g in self.decode.layout.groups}
        self.want[request] = (table, expected_pages(self.decode.layout, table, seed, num_tokens))
        return prefill.lend(request, num_tokens, tables, prefill.layout.full_selection()), table

    def check(self, handle) -> None:
        assert handle.ok, handle.error
        table, exp = self.want[handle.request]
        for (group, layer), (rows, data) in exp.items():
            np.testing.assert_array_equal(slots(self.dst[layer])[table[group][rows]], data, err_msg=handle.request)


# ------------------------------------------------------------ one action fails
@pytest.mark.parametrize("read_ahead", [False, True], ids=["claims", "claims-and-reads"])
@pytest.mark.parametrize("host", ["a..b", "bug.invalid"])
def test_a_connect_that_raises_fails_only_its_link_and_the_rest_of_the_batch_runs(host, read_ahead):
    """``a..b`` makes ``getaddrinfo`` raise ``UnicodeError`` (not an ``OSError``); for ``bug.invalid`` the
    sockets' connect raises a plain ``RuntimeError``, as a bug would.  Either way its link fails typed, and
    what is queued after it in the same batch still runs: the claims (and with ``read_ahead`` the reads, which
    would otherwise never be posted nor ever go quiet), so those fetches finish byte-exact."""
    decode_config = dataclasses.replace(CONFIG, read_ahead=read_ahead)
    with nodes(decode_config=decode_config) as (prefills, srcs, decode, dst):
        prefill = prefills[0]
        decode.connect(*prefill.address)
        connect = decode._sockets.connect

        def buggy_connect(conn, to, port):
            if to == "bug.invalid":
                raise RuntimeError("injected fault")
            return connect(conn, to, port)

        decode._sockets.connect = buggy_connect
        requests = Requests(decode, dst)
        lent = [requests.lend(prefill, srcs[0], seed) for seed in (1, 2)]
        failure: list[BaseException] = []

        def dial_bad_host() -> None:
            try:
                decode.connect(host, prefill.port)
            except BaseException as exc:
                failure.append(exc)

        bad = threading.Thread(target=dial_bad_host, daemon=True)
        with held(decode):
            bad.start()
            wait_until(lambda: any(decode.session.link_info(c)["endpoint"][0] == host for c in decode.session.links),
                     "the bad connect queued")
            handles = [decode.start_fetch(ticket.to_text(), table) for ticket, table in lent]
            assert all(ticket.pages is not None for ticket, _ in lent)  # small: read as the claim goes out
        decode.wait(handles, DEADLINE)
        for handle in handles:
            requests.check(handle)
        bad.join(DEADLINE)
        assert len(failure) == 1 and isinstance(failure[0], PeerLost), failure
        assert host in str(failure[0])
        assert [link.host for link in decode.links] == [prefill.host]  # the good link is still up


def test_a_ticket_with_a_bad_host_is_refused_before_anything_connects_and_others_still_read():
    with nodes() as (prefills, srcs, decode, dst):
        requests = Requests(decode, dst)
        ticket, table = requests.lend(prefills[0], srcs[0], 3)
        forged = wire_text(lease=ticket.lease, host="a..b", port=ticket.port, prefill=ticket.prefill,
                           num_tokens=ticket.num_tokens, layout_id=ticket.layout_id)
        with pytest.raises(ProtocolError, match="ticket.host"):
            decode.start_fetch(forged, table)
        with pytest.raises(ProtocolError, match="ticket.host"):
            decode.claim(forged)
        assert decode.session.links == [] and decode.in_flight == 0  # nothing dialled, nothing started
        handle = decode.start_fetch(ticket.to_text(), table)
        decode.wait([handle], DEADLINE)
        requests.check(handle)


def test_a_prefill_advertising_a_host_no_ticket_may_name_is_refused_at_construction():
    backend = nixl("prefill")
    try:
        with pytest.raises(ConfigError, match="advertise: .*label 'b_c'"):
            PrefillNode(make_layout(make_pools(PAGES)), backend, creds("prefill-0", "prefill"),
                        advertise="a.b_c.example")
    finally:
        backend.close()

# ------------------------------------------------------------ name lookups
def test_a_slow_name_lookup_holds_up_no_fetch_to_another_prefill(monkeypatch):
    """Tickets name their prefills by host name; the lookup of one hangs (a slow DNS server) until the test
    lets it go.  A fetch from the other prefill finishes meanwhile, and the slow one once its name resolves."""
    slow = threading.Event()
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if kwargs.get("flags", 0) & socket.AI_NUMERICHOST:
            return real(host, port, *args, **kwargs)  # only asks whether it is an IP literal: never waits
        if host == "slow.test":
            slow.wait(3 * DEADLINE)
        return real("127.0.0.1" if host.endswith(".test") else host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    try:
        with nodes(2, advertise=("slow.test", "fast.test")) as (prefills, srcs, decode, dst):
            requests = Requests(decode, dst)
            (slow_ticket, slow_table), (fast_ticket, fast_table) = (
                requests.lend(prefill, src, seed) for seed, prefill, src in zip((4, 5), prefills, srcs))
            assert (slow_ticket.host, fast_ticket.host) == ("slow.test", "fast.test")
            held_up = decode.start_fetch(slow_ticket.to_text(), slow_table)
            wait_until(lambda: decode.session.links, "the slow lookup started")
            fast = decode.start_fetch(fast_ticket.to_text(), fast_table)
            decode.wait([fast], DEADLINE)
            requests.check(fast)
            assert not held_up.done and not slow.is_set()  # its name is still being looked up
            slow.set()
            decode.wait([held_up], DEADLINE)
            requests.check(held_up)
    finally:
        slow.set()


# ------------------------------------------------------ a peer that never reads
class Drops(logging.Handler):
    """Why the prefill session dropped a decode: its "dropped decode rank" lines, nothing else."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("dropped decode rank"):
            self.lines.append(record.getMessage())


@pytest.mark.parametrize("limits, why", [
    # One TLS record of claims (16 KiB) is answered by 64 KiB of aborts: past the cap in one turn.
    (dict(output_pause_bytes=16 << 10, max_output_bytes=48 << 10), "exceed the cap of 49152"),
    (dict(output_pause_bytes=16 << 10, output_stall_timeout=1.0), "pending for more than 1 s"),
], ids=["cap", "deadline"])
def test_a_decode_that_never_reads_its_replies_is_paused_then_dropped_and_others_still_read(limits, why):
    """An authenticated decode pipelines claims of unknown leases (each answered by an Abort) and reads
    nothing: the prefill stops reading it once its replies pile up, then drops it; an honest decode's
    fetch from the same prefill finishes byte-exact meanwhile."""
    # Claims of ids nobody lent are strikes (``Quotas.max_strikes``) that would drop it first: lifted, so that
    # what is tested here is the output bound alone.
    config = NodeConfig(handshake_timeout=DEADLINE, transfer_timeout=DEADLINE, quotas=Quotas(max_strikes=1 << 30),
                        **limits)
    with nodes(prefill_config=config) as (prefills, srcs, decode, dst):
        prefill = prefills[0]
        hung_up = threading.Event()
        with RawDecode(prefill.address, creds("mute-decode", "decode")) as mute:
            mute.handshake(decode.layout)
            claims = Connection(time.monotonic())
            claims.authenticate(mute.peer)
            for i in range(4096):
                claims.send(Claim(i.to_bytes(LEASE_ID_BYTES, "big")))
            burst = claims.data_to_send()  # 4096 claims: pipelined, never waiting for an answer

            def flood() -> None:
                try:
                    while True:
                        mute.send_bytes(burst)
                except (PeerLost, OSError):
                    hung_up.set()

            drops = Drops()
            session_log = logging.getLogger("kvlend.session")
            level = session_log.level
            session_log.setLevel(logging.INFO)
            session_log.addHandler(drops)
            try:
                threading.Thread(target=flood, daemon=True).start()
                wait_until(lambda: "mute-decode" not in prefill.ready_peers(), "the mute decode dropped", 3 * DEADLINE)
            finally:
                session_log.removeHandler(drops)
                session_log.setLevel(level)
            assert len(drops.lines) == 1 and "mute-decode" in drops.lines[0] and why in drops.lines[0], drops.lines
            requests = Requests(decode, dst)
            ticket, table = requests.lend(prefill, srcs[0], 6)
            handle = decode.start_fetch(ticket.to_text(), table)
            decode.wait([handle], DEADLINE)
            requests.check(handle)
            assert hung_up.wait(DEADLINE), "the mute decode's connection is still open"
