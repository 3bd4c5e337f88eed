"""The runtime's thread-safety contract, over real NIXL agents (UCX on DRAM) in one process.

A started ``PrefillNode`` serves from its own thread; a started
``DecodeNode`` does its I/O on its own thread.  Two engine threads use them
at once: the prefill engine lends requests (tickets, and pushed offers) and
asks ``can_evict`` in a tight loop; the decode engine starts fetches, many in
flight, and collects them with ``finished()``.  ``on_release`` calls back into
the prefill node from the loop thread; ``on_finished`` hears of each fetch, once,
before ``finished()`` hands it to the engine.  Every byte must arrive, every lent
page must be locked while its lease lives and free once ``on_release`` ran,
and no thread may raise or deadlock.  Every wait has a deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np
import pytest

from kvlend.errors import TransferTimeout
from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode, Ticket
from kvlend.testing.kvcache import FreeList, group_layers, make_layout, make_pools, pattern, prefill_request, slots
from tests.support.agents import nixl
from tests.support.certs import creds

pytestmark = pytest.mark.nixl

DEADLINE = 20.0  # seconds the whole exchange may take before the test fails (it takes about one)
REQUESTS = 240
OFFER_EVERY = 3  # every third request is pushed as an offer, the rest go through a ticket
PAGES = 1024  # slots per pool on each side
MAX_TOKENS = 120  # <= 30 token pages per group
IN_FLIGHT = 24  # leases the prefill engine keeps outstanding (24 x 30 pages < PAGES)
CONFIG = NodeConfig(handshake_timeout=5.0, transfer_timeout=DEADLINE, chunk_pages=8)  # several chunks per fetch


def lent_pages(layout, pages) -> list[tuple[str, np.ndarray]]:
    """(region, slot ordinals) of every page a lease (group -> GroupPages, or page tables) holds."""
    out = []
    for group, table in pages.items():
        ordinals = np.asarray(getattr(table, "ordinals", table))
        ordinals = ordinals[ordinals >= 0]
        for region in sorted({b.region for b in layout.groups[group].buffers}):
            out.append((region, ordinals))
    return out


class Failures:
    """Everything that went wrong in any thread (assertions included), for the main thread to raise."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: list[str] = []

    def add(self, what: str) -> None:
        with self._lock:
            self.items.append(what)

    def run(self, name: str, body) -> threading.Thread:
        def guarded() -> None:
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - reported to the main thread
                self.add(f"{name}: {type(exc).__name__}: {exc}")

        thread = threading.Thread(target=guarded, name=name, daemon=True)
        thread.start()
        return thread


def test_engine_threads_lend_fetch_and_ask_can_evict_while_the_nodes_serve(caplog):
    caplog.set_level(logging.WARNING)
    failures = Failures()
    deadline = time.monotonic() + DEADLINE
    src, dst = make_pools(PAGES), make_pools(PAGES)
    released: queue.Queue = queue.Queue()  # lease id, from on_release
    callbacks = {"count": 0, "still_locked": 0}
    prefill: PrefillNode | None = None

    def on_release(lease, reason) -> None:
        # On the node's loop thread, outside its lock: calling back into the node must not deadlock.
        callbacks["count"] += 1
        for region, ordinals in lent_pages(prefill.layout, lease.pages):
            if not prefill.can_evict(region, ordinals).all():
                callbacks["still_locked"] += 1
        prefill.ready_peers()
        if reason != "done":
            failures.add(f"lease of {lease.request} ended {reason}")
        released.put(lease.id)

    prefill = PrefillNode(make_layout(src), nixl("prefill"), creds("prefill-0", "prefill"), config=CONFIG,
                          on_release=on_release)
    heard: dict[int, bool] = {}  # fetch id -> it was done when on_finished heard of it

    def on_finished(handle) -> None:
        if handle.id in heard:
            failures.add(f"on_finished heard of {handle.request} twice")
        heard[handle.id] = handle.done and handle.quiet
        assert decode.in_flight >= 0  # on the loop thread, outside the node's lock: no deadlock

    decode = DecodeNode(make_layout(dst), nixl("decode"), creds("decode-0", "decode"), config=CONFIG,
                        on_finished=on_finished)
    router: queue.Queue = queue.Queue()  # ticket text, prefill engine -> decode engine
    cleared: queue.Queue = queue.Queue()  # requests whose pushed offer the prefill engine has checked
    verified: list[str] = []
    max_in_flight = [0]  # the most fetches the decode engine had in flight at once
    try:
        prefill.start()
        decode.start()
        decode.connect(*prefill.address, timeout=CONFIG.handshake_timeout)
        peer = prefill.wait_for_peer(CONFIG.handshake_timeout)

        def prefill_engine() -> None:
            rng = np.random.default_rng(1)
            free = {g: FreeList(PAGES, rng) for g in prefill.layout.groups}
            live: dict[bytes, tuple[str, dict]] = {}  # lease id -> (request, page tables)
            sent = checks = 0
            while (sent < REQUESTS or live) and not failures.items:
                assert time.monotonic() < deadline, f"prefill engine: {sent} lent, {len(live)} live at the deadline"
                # Leases that ended: their pages must be free to evict now, then they go back to the cache.
                while True:
                    try:
                        request, tables = live.pop(released.get_nowait())
                    except queue.Empty:
                        break
                    for region, ordinals in lent_pages(prefill.layout, tables):
                        assert prefill.can_evict(region, ordinals).all(), f"{request}: {region} locked after release"
                    for group, table in tables.items():
                        free[group].release(table)
                if sent < REQUESTS and len(live) < IN_FLIGHT:
                    seed = sent
                    request = f"req-{seed}"
                    num_tokens = int(rng.integers(1, MAX_TOKENS + 1))
                    tables = prefill_request(prefill.layout, src, free, num_tokens, seed)
                    meta = {"seed": seed, "tokens": num_tokens}
                    pushed = seed % OFFER_EVERY == 0
                    if pushed:
                        lease_id = prefill.offer(peer, request, num_tokens, tables, prefill.layout.full_selection(),
                                                 meta=meta).id
                    else:
                        ticket = prefill.lend(request, num_tokens, tables, prefill.layout.full_selection(), meta=meta)
                        lease_id = ticket.lease
                    live[lease_id] = (request, tables)
                    # The lease is live: the decode has not got the ticket, or may not read the offer, yet.
                    for region, ordinals in lent_pages(prefill.layout, tables):
                        lent_now = not prefill.can_evict(region, ordinals).any()
                        assert lent_now, f"{request}: {region} evictable while lent"
                    if pushed:
                        cleared.put(request)
                    else:
                        router.put(ticket.to_text())
                    sent += 1
                # The tight loop: ask about every page still held, while both nodes' threads work.
                for _, tables in list(live.values())[:4]:
                    for region, ordinals in lent_pages(prefill.layout, tables):
                        prefill.can_evict(region, ordinals)
                        checks += 1
            assert checks > REQUESTS

        def decode_engine() -> None:
            rng = np.random.default_rng(2)
            free = {g: FreeList(PAGES, rng) for g in decode.layout.groups}
            tpp = decode.layout.tokens_per_page
            fetching: dict = {}  # handle -> page tables
            parked: dict[str, tuple] = {}  # pushed offers not yet cleared: request -> (link, offer)
            ok_to_read: set[str] = set()
            started = finished = 0

            def start(source, num_tokens: int, link=None) -> None:
                nonlocal started
                tables = {g: free[g].alloc(-(-num_tokens // tpp)) for g in decode.layout.groups}
                fetching[decode.start_fetch(source, tables, link=link)] = tables
                started += 1

            while finished < REQUESTS and not failures.items:  # another thread failed: stop too
                assert time.monotonic() < deadline, f"decode engine: {started} started, {finished} finished"
                while True:
                    try:
                        text = router.get_nowait()
                    except queue.Empty:
                        break
                    start(text, Ticket.from_text(text).num_tokens)
                while True:
                    try:
                        ok_to_read.add(cleared.get_nowait())
                    except queue.Empty:
                        break
                try:
                    link, offer = decode.next_offer(0.001)
                    parked[offer.request] = (link, offer)
                except TransferTimeout:
                    pass
                for request in sorted(ok_to_read & parked.keys()):
                    link, offer = parked.pop(request)
                    ok_to_read.discard(request)
                    start(offer, offer.num_tokens, link)
                for handle in decode.finished():
                    assert heard.get(handle.id), f"{handle.request}: finished() before on_finished"
                    tables = fetching.pop(handle)
                    result = handle.result()  # raises the fetch's error
                    seed, num_tokens = handle.meta["seed"], handle.meta["tokens"]
                    assert result.bound == num_tokens and handle.quiet, handle
                    n_pages = -(-num_tokens // tpp)
                    for group, table in tables.items():
                        rows = decode.layout.groups[group].pages_read(num_tokens, tpp)
                        for layer in group_layers(decode.layout, group):
                            view = slots(dst[layer])
                            got = view[table[rows]]
                            want = pattern(seed, layer, n_pages, view.shape[1])[rows]
                            assert np.array_equal(got, want), f"{handle.request}: layer {layer} bytes differ"
                        free[group].release(table)
                    verified.append(handle.request)
                    finished += 1
                max_in_flight[0] = max(max_in_flight[0], len(fetching))

        threads = [failures.run("prefill-engine", prefill_engine), failures.run("decode-engine", decode_engine)]
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        assert not any(t.is_alive() for t in threads), f"engine threads still running (deadlock?): {failures.items}"
    finally:
        decode.close()
        prefill.close()
        decode.backend.close()
        prefill.backend.close()
    assert not failures.items, failures.items
    assert sorted(verified) == sorted(f"req-{i}" for i in range(REQUESTS))
    assert max_in_flight[0] > 1, "the decode engine never had two fetches in flight"
    assert callbacks == {"count": REQUESTS, "still_locked": 0}
    assert len(heard) == REQUESTS and all(heard.values()), heard
    assert prefill.lender.active_leases == 0 and prefill.lender.locks.locked_pages() == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or "failed" in r.getMessage()]
    assert not errors, [f"{r.threadName}: {r.getMessage()}" for r in errors]

