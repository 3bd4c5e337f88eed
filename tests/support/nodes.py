"""A started prefill node and a decode connected to it, each over its own pools of the toy cache,
over real NIXL agents (UCX on DRAM) and TLS on loopback; and the checks the node tests share."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from kvlend.core.layout import PageLayout
from kvlend.protocol.wire import LeaseOffer
from kvlend.runtime import DecodeNode, FetchResult, Link, NodeConfig, PrefillNode
from kvlend.runtime.clock import lease_clock
from kvlend.testing.kvcache import SENTINEL, TPP, FreeList, group_layers, make_layout, make_pools, pattern, slots

from .agents import nixl
from .certs import creds

DEADLINE = 10.0  # seconds any single wait may take before the test fails
SRC_PAGES = 256
DST_PAGES = 96  # capacities need not match: only the page geometry does
MAX_TOKENS = 160  # 40 token pages: 5 chunks of 8 pages at most
DECODE_CONFIG = NodeConfig(chunk_pages=8, handshake_timeout=DEADLINE, transfer_timeout=DEADLINE)


@dataclass
class Rig:
    """A started prefill and a decode connected to it, each over its own pools."""

    prefill: PrefillNode
    decode: DecodeNode
    peer: str  # the decode as the prefill knows it
    link: Link  # the prefill as the decode knows it
    src: list[np.ndarray]
    dst: list[np.ndarray]
    released: list[tuple[str, str]] = field(default_factory=list)  # (request, reason), from the prefill thread

    @property
    def layout(self) -> PageLayout:
        return self.prefill.layout


@contextlib.contextmanager
def rig(prefill_config: NodeConfig = NodeConfig(), clock=lease_clock, on_release=None):
    src, dst = make_pools(SRC_PAGES), make_pools(DST_PAGES)
    released: list[tuple[str, str]] = []

    def record(lease, reason):
        released.append((lease.request, reason))
        if on_release is not None:
            on_release(lease, reason)

    prefill = PrefillNode(make_layout(src), nixl("prefill"), creds("prefill", "prefill"), config=prefill_config,
                          clock=clock, on_release=record)
    decode = None
    try:
        prefill.start()
        decode = DecodeNode(make_layout(dst), nixl("decode"), creds("decode", "decode"), config=DECODE_CONFIG)
        link = decode.connect(*prefill.address)
        yield Rig(prefill, decode, prefill.wait_for_peer(DEADLINE), link, src, dst, released)
    finally:
        if decode is not None:
            decode.close()
            decode.backend.close()
        prefill.close()
        prefill.backend.close()


def free_lists(layout: PageLayout, num_pages: int, seed: int) -> dict[str, FreeList]:
    rng = np.random.default_rng(seed)
    return {name: FreeList(num_pages, rng) for name in layout.groups}


def fetch_and_verify(decode: DecodeNode, link: str, offer: LeaseOffer, dst_pools: list[np.ndarray],
                     free: dict[str, FreeList]) -> FetchResult:
    """Fetch ``offer`` into freshly allocated, sentinel-filled pages and check every byte.

    Lent token pages must hold exactly what the prefill wrote for the seed in
    the offer's meta; stale pages of a windowed group must not be written.
    """
    layout = decode.layout
    n_pages = -(-offer.num_tokens // TPP)
    dst = {name: free[name].alloc(n_pages) for name in layout.groups}
    try:
        for name, table in dst.items():
            for layer in group_layers(layout, name):
                slots(dst_pools[layer])[table] = SENTINEL
        result = decode.fetch(link, offer, dst)
        for name, table in dst.items():
            lent = offer.pages[name].token_pages
            np.testing.assert_array_equal(lent, layout.groups[name].pages_read(offer.num_tokens, TPP))
            stale = np.setdiff1d(np.arange(n_pages), lent)
            for layer in group_layers(layout, name):
                got = slots(dst_pools[layer])[table]
                want = pattern(offer.meta["seed"], layer, n_pages, got.shape[1])
                wrong = np.flatnonzero((got[lent] != want[lent]).any(axis=1))
                assert not wrong.size, (
                    f"{offer.request}: layer {layer} token page {lent[wrong[0]]} "
                    f"(slot {table[lent[wrong[0]]]}) differs from what the prefill lent")
                assert (got[stale] == SENTINEL).all(), f"{offer.request}: a stale page of layer {layer} was written"
        return result
    finally:
        for name, table in dst.items():
            free[name].release(table)


def unlocked(prefill: PrefillNode, tables: dict[str, np.ndarray]) -> bool:
    """Whether every page of ``tables`` may be evicted (no lease holds it)."""
    with prefill._lock:
        return all(prefill.lender.locks.can_evict(f"L{layer}.kv", table[table >= 0]).all()
                   for name, table in tables.items() for layer in group_layers(prefill.layout, name))


def assert_locked(prefill: PrefillNode, tables: dict[str, np.ndarray], locked: bool) -> None:
    layout = prefill.layout
    with prefill._lock:
        for name, table in tables.items():
            for layer in group_layers(layout, name):
                evictable = prefill.lender.locks.can_evict(f"L{layer}.kv", table[table >= 0])
                assert (not evictable.any()) if locked else evictable.all(), (name, layer, locked)


def intercept(decode: DecodeNode, link, before_send=lambda message: None, before_poll=lambda: None) -> None:
    """Hooks before each message the decode sends on ``link`` and before each socket poll,
    to force one interleaving of a real exchange."""
    conn = decode.session._links[link.id].conn
    send, poll = conn.send, decode._sockets.poll

    def hooked_send(message):
        before_send(message)
        send(message)

    def hooked_poll(timeout):
        before_poll()
        return poll(timeout)

    conn.send = hooked_send
    decode._sockets.poll = hooked_poll


def wait_until(done, what: str, deadline: float = DEADLINE) -> None:
    """Poll ``done()`` every 10 ms; fail the test naming ``what`` once ``deadline`` seconds pass."""
    end = time.monotonic() + deadline
    while not done():
        assert time.monotonic() < end, f"{what}: not within {deadline} s"
        time.sleep(0.01)


def read_until_eof(sock) -> bytes:
    """Everything the peer sends before closing (a reset counts as the close); times out, never hangs."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
