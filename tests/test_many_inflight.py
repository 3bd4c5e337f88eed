"""Many fetches in flight on one decode rank, from two prefill ranks at once, over real NIXL agents.

The decode runs without its own thread, so its loop turns only inside
``next_offer`` and ``wait``: fetches started in between stay in flight.
Half the requests travel as tickets (text, as a router would carry them),
half as offers pushed over the link; both share one link per prefill.
Every byte is checked, and nothing is left locked, tracked or in flight.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode
from kvlend.testing.kvcache import FreeList, expected_pages, make_layout, make_pools, prefill_request, slots
from tests.support.agents import nixl
from tests.support.certs import creds

pytestmark = pytest.mark.nixl

DEADLINE = 30.0
REQUESTS = 96  # per prefill: 2 x 96 fetches started before the first is collected
TOKENS = (9, 13, 20, 33)
PAGES = 2048
TPP = 4




def test_two_prefills_many_fetches_in_flight_tickets_and_offers_share_links():
    released = []
    prefills, srcs = [], []
    for rank in range(2):
        src = make_pools(PAGES)
        srcs.append(src)
        node = PrefillNode(make_layout(src), nixl(f"prefill{rank}"), creds(f"prefill-{rank}", "prefill"),
                           on_release=lambda lease, reason: released.append(reason))
        node.start()
        prefills.append(node)
    dst = make_pools(PAGES)
    decode = DecodeNode(make_layout(dst), nixl("decode"), creds("decode", "decode"), config=NodeConfig(chunk_pages=2))
    try:  # no decode thread: the loop runs only inside next_offer and wait, so fetches pile up
        links = [decode.connect(*p.address) for p in prefills]
        peers = [p.wait_for_peer(DEADLINE) for p in prefills]
        rng = np.random.default_rng(7)
        free = [{g: FreeList(PAGES, rng) for g in p.layout.groups} for p in prefills]
        dfree = {g: FreeList(PAGES, rng) for g in decode.layout.groups}
        sources, want = [], {}
        for i in range(REQUESTS):
            for rank, prefill in enumerate(prefills):
                n = TOKENS[i % len(TOKENS)]
                seed = 1000 * rank + i
                tables = prefill_request(prefill.layout, srcs[rank], free[rank], n, seed)
                request = f"p{rank}-r{i}"
                table = {g: dfree[g].alloc(-(-n // TPP)) for g in decode.layout.groups}
                want[request] = (table, expected_pages(decode.layout, table, seed, n))
                if i % 2:
                    prefill.offer(peers[rank], request, n, tables, prefill.layout.full_selection())
                else:
                    ticket = prefill.lend(request, n, tables, prefill.layout.full_selection())
                    sources.append((ticket.to_text(), None, table))
        for _ in range(REQUESTS):  # collect the pushed offers first: next_offer turns the loop
            link, offer = decode.next_offer(DEADLINE)
            sources.append((offer, link, want[offer.request][0]))
        handles = [decode.start_fetch(source, table, link=link) for source, link, table in sources]
        peak = decode.in_flight
        decode.wait(handles, DEADLINE)
        assert peak >= 64, peak
        assert all(h.ok for h in handles), [h for h in handles if not h.ok][:3]
        for h in handles:
            table, exp = want[h.request]
            for (group, layer), (rows, data) in exp.items():
                np.testing.assert_array_equal(slots(dst[layer])[table[group][rows]], data, err_msg=h.request)
        assert len(decode.links) == 2 and {link.id for link in decode.links} == {link.id for link in links}
        end = time.monotonic() + DEADLINE
        while any(p.lender.active_leases for p in prefills):
            assert time.monotonic() < end, "leases not released"
            time.sleep(0.01)
        assert released.count("done") == 2 * REQUESTS
        assert all(p.lender.locks.locked_pages() == 0 for p in prefills)
        assert decode.in_flight == 0 and decode.tracker.stats.requests == 0
        assert len(decode.finished()) == 2 * REQUESTS
    finally:
        decode.close()
        decode.backend.close()
        for p in prefills:
            p.close()
            p.backend.close()
