"""kvlend wired into an engine, end to end, in one process (the guide: docs/integration.md).

A prefill engine (the toy model of ``kvlend.demo.toy_engine`` and its paged KV cache,
16 tokens per page) lends each prompt's pages through a ``PrefillNode`` and
exports a *ticket* as text.  A router (here a plain queue) carries the text
to a decode engine with a cache of its own (8 tokens per page, a second NIXL
agent), which starts a fetch per ticket without blocking, collects finished
fetches once per engine step, and generates.  The model is the hybrid one:
sliding-window layers, a recurrent layer and full attention.  Every
request's tokens must equal what one process generates alone; a prefill page
is reused only after its lease ended (``can_evict`` shows it); and one fetch
is cancelled on purpose, then lent and fetched again into the same pages.

Run: ``python examples/engine_integration.py`` (exits 0 and prints ``verified: yes (N/N requests)``).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import time
from collections import deque

from kvlend import prompt_digest
from kvlend.core.fetchplan import destination_pages
from kvlend.demo import toy_engine
from kvlend.demo.workload import run_rank
from kvlend.errors import TransferCancelled, TransferTimeout
from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode, Ticket
from kvlend.security.certs import Authority
from kvlend.transport import load_backend

REQUESTS = 4
CANCELLED = "req-1"  # the decode engine cancels this request's first fetch on purpose
MAX_NEW_TOKENS = 8
TIMEOUT = 10.0  # seconds any one wait may take (and each posted read: the backend's timeout)
STEP = 0.002  # seconds of model work per engine step


@dataclasses.dataclass
class Held:
    """What the prefill engine keeps per request until its lease ends with ``done``."""

    table: object  # page table (slot ordinals)
    slot: int  # recurrent state slot
    first: int  # first generated token
    lent: bool = False  # a lease on these pages is live
    while_lent: tuple = ()  # can_evict counts (full layer, window layer) right after lending


def evictable(prefill: PrefillNode, region: str, table) -> str:
    """How many of a request's slots in ``region`` the prefill engine may reuse now."""
    return f"{int(prefill.can_evict(region, table).sum())}/{len(table)}"


def main() -> int:
    config = toy_engine.preset("hybrid")  # layers: swa, ssm, swa, full; 16 tokens per page
    model = toy_engine.ToyModel(config)
    d_config = dataclasses.replace(config, tokens_per_page=8)  # the same model, cut into smaller pages
    d_model = toy_engine.ToyModel(d_config)
    prompts = {f"req-{i}": p for i, p in enumerate(
        toy_engine.make_prompts(REQUESTS, seed=0, min_len=100, max_len=300, vocab=config.vocab))}
    # A throwaway cluster CA and a certificate per node; ranks in their own processes would each load
    # theirs with Credentials.from_env() ($KVLEND_CA, $KVLEND_CERT, $KVLEND_KEY; `kvlend certs` writes them).
    cluster = Authority.create()
    node_config = NodeConfig(transfer_timeout=TIMEOUT)

    # ---- prefill engine: describe the pools once; a node lends them, serving from its own thread.
    p_cache = toy_engine.PagedKVCache(config, num_pages=128, state_slots=REQUESTS)
    p_layout = p_cache.layout()
    released: queue.Queue = queue.Queue()  # (lease, reason) from on_release, which runs on the node's thread
    prefill = PrefillNode(p_layout, load_backend("nixl", name=f"prefill-{os.getpid()}", timeout=TIMEOUT),
                          cluster.issue("prefill", "prefill"), config=node_config,
                          on_release=lambda lease, reason: released.put((lease, reason)))
    prefill.start()

    # ---- decode engine: its own cache (other slots, other addresses, other page size), its own agent.
    # No start() here: the engine's step loop drives this node (finished() progresses it).
    d_cache = toy_engine.PagedKVCache(d_config, num_pages=256, seed=1, state_slots=REQUESTS)
    decode = DecodeNode(d_cache.layout(), load_backend("nixl", name=f"decode-{os.getpid()}", timeout=TIMEOUT),
                        cluster.issue("decode", "decode"), config=node_config)

    router: deque[tuple[str, str]] = deque()  # (request, ticket text): what kv_transfer_params would carry
    retries: deque[str] = deque()  # decode -> prefill: lend this request again
    held: dict[str, Held] = {}  # prefill: request -> its pages
    fetching = {}  # decode: handle -> (request, ticket, page table, state slot, dst)
    resume = {}  # decode: request -> (page table, state slot, dst, bound) of a failed fetch to resume
    lines, evicted, decoded = {}, {}, set()  # what each engine reports per request

    def lend(request: str) -> None:
        h = held[request]
        # Bound to the prompt: the ticket crosses a router (an HTTP client could copy it onto another prompt),
        # and only a claim with this prompt's digest reads the pages.
        ticket = prefill.lend(request, len(prompts[request]), p_cache.group_tables(h.table, h.slot),
                              p_layout.full_selection(), meta={"first": h.first},
                              prompt_digest=prompt_digest(prompts[request]))
        h.lent, h.while_lent = True, (evictable(prefill, "L3.kv", h.table), evictable(prefill, "L0.kv", h.table))
        router.append((request, ticket.to_text()))

    def start(request: str, text: str):
        ticket = Ticket.from_text(text)
        if request in resume:  # a retry: the same pages, skipping what the failed fetch verified
            table, slot, dst, bound = resume.pop(request)
        else:
            link = decode.connect(*ticket.endpoint)  # the first ticket opens the link; later ones reuse it
            need = destination_pages(link.plan, ticket.num_tokens)  # entries per local group ("ssm": 1)
            table, slot = d_cache.alloc(max(need["full"], need["swa"])), d_cache.alloc_state()
            dst, bound = d_cache.group_tables(table, slot), 0
        # never blocks; the digest of the decode's own copy of the prompt, which the prefill checks
        handle = decode.start_fetch(text, dst, resume_from=bound, prompt_digest=prompt_digest(prompts[request]))
        fetching[handle] = (request, ticket, table, slot, dst)
        return handle

    def prefill_step() -> None:
        """The prefill engine's share of a step: reuse pages whose lease ended, serve retries."""
        while not released.empty():
            lease, reason = released.get()
            h = held[lease.request]
            h.lent = False
            if reason == "done":
                evicted[lease.request] = (f"evictable full layer {h.while_lent[0]} while lent, "
                                          f"{evictable(prefill, 'L3.kv', h.table)} after release; "
                                          f"window layer {h.while_lent[1]} while lent")
                p_cache.free(h.table)  # the lease ended: no peer can still read these pages
                p_cache.free_state(h.slot)
            else:
                print(f"prefill: lease of {lease.request} ended: {reason}")
        for _ in range(len(retries)):
            request = retries.popleft()
            if held[request].lent:
                retries.append(request)  # its old lease has not ended yet: the pages are still lent
            else:
                lend(request)

    def decode_step() -> None:
        """The decode engine's share of a step: start fetches for new tickets, generate from finished ones."""
        while router:
            start(*router.popleft())
        for handle in decode.finished():
            request, ticket, table, slot, dst = fetching.pop(handle)
            if handle.ok:
                result = handle.result()
                tokens = toy_engine.decode(d_model, d_cache, table, ticket.num_tokens, handle.meta["first"],
                                           MAX_NEW_TOKENS, slot)
                ok = tokens == toy_engine.generate_reference(model, prompts[request], MAX_NEW_TOKENS) \
                    and result.bound == ticket.num_tokens
                lines[request] = (f"{request}: {ticket.num_tokens} tokens into {len(table)} decode pages, "
                                  f"{result.bytes} bytes in {result.descriptors} descriptors, bound {result.bound}, "
                                  f"tokens {'match' if ok else 'DIFFER'}")
            elif isinstance(handle.error, TransferCancelled) and request == CANCELLED and request not in lines:
                lines[request] = ""  # retried once: keep the pages, resume from the bound
                resume[request] = (table, slot, dst, handle.error.bound)
                retries.append(request)
                continue
            else:
                lines[request] = f"{request}: FAILED: {type(handle.error).__name__}: {handle.error}"
            decoded.add(request)
            d_cache.free(table)  # done, or failed and quiet: nothing can still land in these pages
            d_cache.free_state(slot)

    try:
        # Prefill: compute each prompt's KV into pages, then lend them (the lease locks what a decoder reads).
        for request, prompt in prompts.items():
            slot = p_cache.alloc_state()
            table, first = toy_engine.prefill(model, p_cache, prompt, slot)
            held[request] = Held(table, slot, first)
            lend(request)

        # Decode: a fetch per ticket, all in flight at once; then give up on one of them on purpose.
        handles = {}
        while router:
            request, text = router.popleft()
            handles[request] = start(request, text)
        victim = handles[CANCELLED]
        victim.cancel()
        decode.wait([victim], TIMEOUT)  # done once no read of it is in flight
        print(f"cancelled {CANCELLED} on purpose: state {victim.state.value}, quiet {victim.quiet}, "
              f"{type(victim.error).__name__} at bound {victim.error.bound}")

        # Engine steps until every request is verified (or failed).
        deadline = time.monotonic() + 3 * TIMEOUT
        while len(decoded) < len(prompts) or any(r not in evicted for r in prompts if "match" in lines.get(r, "")):
            if time.monotonic() > deadline:
                raise TransferTimeout(f"requests {sorted(set(prompts) - decoded)} not decoded, "
                                      f"{sorted(set(prompts) - set(evicted))} not released in time")
            prefill_step()
            decode_step()
            time.sleep(STEP)
    finally:
        decode.close()
        prefill.close()
        decode.backend.close()
        prefill.backend.close()
    for request in prompts:
        print(f"{lines[request]}; {evicted.get(request, 'lease not released')}")
    verified = sum("tokens match" in lines[r] and r in evicted for r in prompts)
    print(f"verified: {'yes' if verified == len(prompts) else 'NO'} ({verified}/{len(prompts)} requests)")
    return 0 if verified == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(run_rank(main, "engine_integration"))
