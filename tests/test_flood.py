"""A flood of half-open connections costs the prefill little and does not stop honest transfers.

256 raw connections, the way a peer without the secret can make them: half
claim a maximum-size (16 MiB) first frame and send 64 KiB of it, half stay
silent.  Before the hello completes a frame is capped at a few KiB (the
claims are refused on their header) and connections still in the hello are
bounded per source (the silent ones beyond it are closed at once), so the
prefill's memory barely moves while a real decode keeps reading leases
byte-exact.
"""

from __future__ import annotations

import socket
import struct
import time

from conftest import prefill_request
from test_node import DEADLINE, DST_PAGES, SRC_PAGES, fetch_and_verify, free_lists, rig

import kvlend.protocol.prefill
from kvlend.protocol.prefill import MAX_PENDING_PER_SOURCE
from kvlend.protocol.wire import MAX_FRAME_BYTES

FLOOD = 256


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_256_half_open_connections_claiming_16_mib_frames_cost_little_and_honest_reads_verify(monkeypatch):
    # The hello timeout would close the silent ones after 5 s; a slow machine can take longer than
    # that to open the flood, so the flood is kept connected for the whole test instead.
    monkeypatch.setattr(kvlend.protocol.prefill, "HELLO_TIMEOUT", 20 * DEADLINE)
    with rig() as r:
        src_free = free_lists(r.layout, SRC_PAGES, 81)
        dst_free = free_lists(r.decode.layout, DST_PAGES, 82)

        def honest(i: int) -> None:
            tables = prefill_request(r.layout, r.src, src_free, 40 + i, seed=100 + i)
            r.prefill.offer(r.peer, f"honest-{i}", 40 + i, tables, r.layout.full_selection(), meta={"seed": 100 + i})
            link, offer = r.decode.next_offer(DEADLINE)
            assert fetch_and_verify(r.decode, link, offer, r.dst, dst_free).bound == 40 + i
            for name, table in tables.items():
                src_free[name].release(table)

        honest(0)  # warm: the first read wires UCX up
        before = rss_bytes()
        flood = []
        try:
            claim = struct.pack(">I", MAX_FRAME_BYTES) + b"\x00" * 65536
            for i in range(FLOOD):
                s = socket.create_connection(r.prefill.address, timeout=DEADLINE)
                s.setblocking(False)
                if i % 2:
                    try:
                        s.send(claim)
                    except OSError:
                        pass  # refused at once: fine
                flood.append(s)
            end = time.monotonic() + DEADLINE
            while r.prefill.pending_hellos < MAX_PENDING_PER_SOURCE:  # the silent ones are taken in
                assert time.monotonic() < end, r.prefill.pending_hellos
                time.sleep(0.01)
            for i in range(1, 21):  # honest reads while the flood is still connected
                honest(i)
            grown = rss_bytes() - before
            assert r.prefill.pending_hellos <= MAX_PENDING_PER_SOURCE
            print(f"flood of {FLOOD}: prefill RSS grew {grown / 2**20:.1f} MiB, "
                  f"{r.prefill.pending_hellos} connections left in the hello")
            assert grown < 64 << 20, f"RSS grew by {grown / 2**20:.1f} MiB under the flood"
        finally:
            for s in flood:
                s.close()
        assert r.prefill.ready_peers() == [r.peer]
