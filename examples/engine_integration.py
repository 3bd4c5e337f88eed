"""kvlend wired into an engine, end to end, in one process (the guide: docs/integration.md).

A prefill engine (the toy model of ``toy_engine.py`` and its paged KV cache)
lends each prompt's pages through a ``PrefillNode``; a decode engine with a
cache of its own reads them through a ``DecodeNode`` (a second NIXL agent)
and generates.  The model is the hybrid one: sliding-window layers, a
recurrent layer and full attention.  Every request's tokens must equal what
one process generates alone, and a page may be reused only when
``can_evict`` says so.

Run: ``python examples/engine_integration.py`` (exits 0 and prints ``verified: yes``).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import toy_engine  # noqa: E402
from workload import run_rank  # noqa: E402

from kvlend.backend import load_backend  # noqa: E402
from kvlend.control import generate_secret  # noqa: E402
from kvlend.errors import KvlendError  # noqa: E402
from kvlend.node import DecodeNode, NodeConfig, PrefillNode  # noqa: E402

MAX_NEW_TOKENS = 8
TIMEOUT = 10.0  # seconds any one wait (and each posted chunk, the backend's timeout) may take


def evictable(node: PrefillNode, region: str, table) -> str:
    """How many of a request's slots in ``region`` the engine may reuse now."""
    return f"{int(node.lender.locks.can_evict(region, table).sum())}/{len(table)}"


def main() -> int:
    config = toy_engine.preset("hybrid")  # layers: swa, ssm, swa, full
    model = toy_engine.ToyModel(config)
    prompts = toy_engine.make_prompts(4, seed=0, min_len=100, max_len=300, vocab=config.vocab)
    secret = generate_secret()  # two processes would share it: $KVLEND_SECRET or $KVLEND_SECRET_FILE

    # ---- prefill engine: describe the pools once, lend them through a node.
    p_cache = toy_engine.PagedKVCache(config, num_pages=128, state_slots=4)
    p_layout = p_cache.layout()  # layout_from_pools for attention, plus hand-built recurrent state rows
    released = []  # (request, reason), appended on the node's thread
    prefill = PrefillNode(p_layout, load_backend("nixl", name=f"prefill-{os.getpid()}", timeout=TIMEOUT), secret,
                          config=NodeConfig(transfer_timeout=TIMEOUT),
                          on_release=lambda lease, reason: released.append((lease.request, reason)))
    prefill.start()  # serve handshakes, heartbeats and done from a background thread

    # ---- decode engine: its own cache (other slots, other addresses), its own agent.
    d_cache = toy_engine.PagedKVCache(config, num_pages=128, seed=1, state_slots=1)
    decode = DecodeNode(d_cache.layout(), load_backend("nixl", name=f"decode-{os.getpid()}", timeout=TIMEOUT), secret,
                        config=NodeConfig(transfer_timeout=TIMEOUT))
    verified = 0
    try:
        link = decode.connect(*prefill.address)  # authenticate, exchange layouts, negotiate a plan
        peer = prefill.wait_for_peer(TIMEOUT)
        print(f"plan: {link.plan.summary().splitlines()[0]}")
        for i, prompt in enumerate(prompts):
            request = f"req-{i}"
            # Prefill: compute the KV into pages, then lend them (the lease locks what it covers).
            slot = p_cache.alloc_state()
            table, first = toy_engine.prefill(model, p_cache, prompt, slot)
            prefill.offer(peer, request, len(prompt), p_cache.group_tables(table, slot),
                          p_layout.full_selection(), meta={"first": first})
            while_lent = (evictable(prefill, "L3.kv", table), evictable(prefill, "L0.kv", table))

            # Decode: take the offer, read it into freshly allocated slots, generate.
            src, offer = decode.next_offer(TIMEOUT)
            d_table, d_slot = d_cache.alloc(len(table)), d_cache.alloc_state()
            try:
                result = decode.fetch(src, offer, d_cache.group_tables(d_table, d_slot))
                tokens = toy_engine.decode(model, d_cache, d_table, offer.num_tokens, offer.meta["first"],
                                           MAX_NEW_TOKENS, d_slot)
            finally:
                d_cache.free(d_table)
                d_cache.free_state(d_slot)
            ok = tokens == toy_engine.generate_reference(model, prompt, MAX_NEW_TOKENS) \
                and result.bound == offer.num_tokens
            verified += ok

            # The done ack came after the prefill released the lease: its pages are free to reuse.
            if (request, "done") not in released:
                raise KvlendError(f"{request}: the prefill did not release its lease before the done ack "
                                  f"(released so far: {released})")
            after = evictable(prefill, "L3.kv", table)
            p_cache.free(table)
            p_cache.free_state(slot)
            print(f"{request}: {len(prompt)} tokens, {result.bytes} bytes in {result.descriptors} descriptors, "
                  f"bound {result.bound}, tokens {'match' if ok else 'DIFFER'}; evictable "
                  f"full layer {while_lent[0]} while lent, {after} after release; window layer "
                  f"{while_lent[1]} while lent")
    finally:
        decode.close()
        prefill.close()
        decode.backend.close()
        prefill.backend.close()
    print(f"verified: {'yes' if verified == len(prompts) else 'NO'} ({verified}/{len(prompts)} requests)")
    return 0 if verified == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(run_rank(main, "engine_integration"))
