"""Child processes of ``test_progressive_faults``: a progressive-lending prefill or a decode, SIGKILLable.

Both run the toy engine (``kvlend.demo.toy_engine``, preset ``tiny``) over a real NIXL agent; the
test starts them with ``UCX_TLS=tcp`` so reads are really in flight.  Each prints one JSON object a
line after ``MARK`` for what happened (UCX may write to stdout too) and takes commands on stdin.

``prefill``: prints ``LISTENING host port``, prefills one prompt chunk by chunk
(``toy_engine.prefill_chunks``), lends it under a ticket after its first chunk
(``PrefillNode.lend(..., ready=)``: event ``ticket``) and extends the lease after each later one
(``PrefillNode.extend``; event ``extended``, the final one carrying ``{"first": token}``).
With ``--gated`` each chunk, the first too, runs only on ``next`` (``rest``: all that are
left), so the test can have the decode ready before the ticket's TTL starts; otherwise they
run at once, ``--pause`` seconds apart.  An extend that fails (the lease expired under a
dead decode) is reported (``extend_failed``, with the error's type) and prefill goes on: the
engine still owns its pages.  Reports ``locks`` (``lender.locks.locked_pages()``) whenever that
changes, ``released`` when the lease ends, ``prefill_done`` once every chunk ran; serves until
``stop`` (or its deadline).

Both report ``ready`` once their node serves.

``decode``: on ``fetch TICKET`` reads the lease into freshly allocated pages
(``DecodeNode.start_fetch``), reporting every change of ``FetchHandle.bound`` (``bound``).
A failed fetch reports ``failed`` (type, ``error.bound``) and dumps the pages below the bound
(``--dump``); then ``resume TICKET`` reads a new lease into the same pages with
``resume_from=bound``.  A fetch that completes reports ``fetched`` (its ``FetchResult``), then
decodes ``--new-tokens`` tokens and reports them (``tokens``, with the prompt's KV digest).

Run as ``python -m tests.support.progressive_rank MODE ...`` with ``$KVLEND_CA``, ``$KVLEND_CERT`` and
``$KVLEND_KEY`` naming the rank's credentials.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import sys
import time

import numpy as np

from kvlend.demo import toy_engine
from kvlend.errors import KvlendError, PeerLost, TransferTimeout
from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode
from kvlend.security.credentials import Credentials
from kvlend.transport import load_backend

from .fault_ranks import Stdin  # the parent's commands, without blocking; EOF reads as stop

MARK = "@@progressive "


def emit(**event) -> None:
    print("\n" + MARK + json.dumps(event), flush=True)  # own line: UCX may write to stdout too


def setup(args):
    cfg = toy_engine.preset("tiny", seed=args.seed)
    model = toy_engine.ToyModel(cfg)
    prompt = toy_engine.make_prompts(1, args.seed, args.prompt_len, args.prompt_len, cfg.vocab)[0]
    return cfg, model, prompt


def config(args) -> NodeConfig:
    return NodeConfig(ttl=args.ttl, heartbeat=args.heartbeat, chunk_pages=args.chunk_pages,
                      handshake_timeout=args.deadline, transfer_timeout=args.deadline, cancel_grace=args.cancel_grace)


# -------------------------------------------------------------------- prefill
def run_prefill(args) -> int:
    cfg, model, prompt = setup(args)
    n_pages = -(-len(prompt) // cfg.tokens_per_page)
    cache = toy_engine.PagedKVCache(cfg, 2 * n_pages, seed=args.gen)  # pages elsewhere for each generation
    layout = cache.layout()
    ended: queue.SimpleQueue = queue.SimpleQueue()
    node = PrefillNode(layout, load_backend("nixl", name=f"prog-prefill{args.gen}-{os.getpid()}"),
                       Credentials.from_env(), config=config(args),
                       on_release=lambda lease, reason: ended.put((lease.request, reason)))
    print("\nLISTENING", *node.address, flush=True)
    node.start()
    emit(ev="ready")
    stdin = Stdin()
    chunks = toy_engine.prefill_chunks(model, cache, prompt, None, args.chunk)
    ticket = None
    computed, errors, extended = 0, [], 0
    locked = -1
    budget = 0  # chunks the parent allowed (gated)
    deadline = time.monotonic() + args.deadline * 6
    finished = False
    next_at = 0.0

    def report_locks() -> None:
        nonlocal locked
        with node._lock:
            now_locked, active = node.lender.locks.locked_pages(), node.lender.active_leases
        if now_locked != locked:
            locked = now_locked
            emit(ev="locks", locked=now_locked, active=active, t=time.monotonic())

    try:
        while time.monotonic() < deadline:
            cmd = stdin.line(0.005)
            if cmd == "stop":
                break
            if cmd == "next":
                budget += 1
            elif cmd == "rest":
                budget = 1 << 30
            while not ended.empty():
                request, reason = ended.get()
                emit(ev="released", request=request, reason=reason, t=time.monotonic())
            report_locks()
            if finished or (args.gated and budget <= 0) or time.monotonic() < next_at:
                continue
            try:
                table, done, first = next(chunks)
            except StopIteration:  # cannot happen: the last chunk sets finished
                finished = True
                continue
            computed += 1
            tables = cache.group_tables(table)
            final = {} if first is None else {"first": first}
            budget -= 1
            if ticket is None:
                ticket = node.lend("prog-0", len(prompt), tables, layout.full_selection(),
                                   meta={"prompt_len": len(prompt), **final}, ready=done)
                emit(ev="ticket", ticket=ticket.to_text(), ready=done, t=time.time())
            else:
                at = time.time()
                try:
                    node.extend(ticket.lease, done, tables, meta=final or None)
                except KvlendError as exc:
                    errors.append(type(exc).__name__)
                    emit(ev="extend_failed", ready=done, kind=type(exc).__name__, error=str(exc)[:200],
                         typed=isinstance(exc, KvlendError))
                else:
                    extended += 1
                    emit(ev="extended", ready=done, final=first is not None, t=at)
            if first is not None:
                finished = True
                emit(ev="prefill_done", chunks=computed, extended=extended, errors=errors, first=first)
            next_at = time.monotonic() + args.pause
        report_locks()
    finally:
        node.close()
        node.backend.close()
    return 0


# --------------------------------------------------------------------- decode
def page_bytes(cache, table: np.ndarray) -> np.ndarray:
    """The pages ``table`` names, every attention layer: uint8 ``[layers, pages, page_bytes]``."""
    return np.stack([cache.page_view(layer)[table] for layer in range(len(cache.tensors))])


def run_decode(args) -> int:
    cfg, model, prompt = setup(args)
    tpp = cfg.tokens_per_page
    n_pages = -(-len(prompt) // tpp)
    cache = toy_engine.PagedKVCache(cfg, 2 * n_pages + -(-args.new_tokens // tpp) + 1, seed=args.gen + 100)
    node = DecodeNode(cache.layout(), load_backend("nixl", name=f"prog-decode{args.gen}-{os.getpid()}"),
                      Credentials.from_env(), config=config(args))
    node.start()
    emit(ev="ready")
    stdin = Stdin()
    table = cache.alloc(n_pages)
    for layer in range(len(cache.tensors)):
        cache.page_view(layer)[table] = 0xA5  # what was never written stays recognisable
    bound = 0
    below_digest = None
    end = time.monotonic() + args.deadline * 6
    try:
        while time.monotonic() < end:
            cmd = stdin.line(0.05)
            if cmd is None:
                continue
            if cmd == "stop":
                break
            verb, _, text = cmd.partition(" ")
            if verb not in ("fetch", "resume"):
                continue
            resume = bound if verb == "resume" else 0
            started = time.monotonic()
            handle = node.start_fetch(text, {"full": table}, resume_from=resume)
            seen, bounds = -1, []
            while not handle.done:
                b = handle.bound
                if b != seen:
                    seen = b
                    bounds.append((time.time(), b))
                    emit(ev="bound", bound=b, t=bounds[-1][0])
                time.sleep(0.001)
                if time.monotonic() - started > args.deadline + args.cancel_grace + 5.0:
                    emit(ev="hung", state=handle.state.value, bound=handle.bound)
                    return 1
            elapsed = time.monotonic() - started
            bounds.append((time.time(), handle.bound))
            try:
                result = handle.result()
            except KvlendError as exc:
                bound = exc.bound
                kept = table[: bound // tpp]
                below = page_bytes(cache, kept)
                below_digest = hashlib.sha256(below.tobytes()).hexdigest()
                if args.dump:
                    np.save(args.dump, below)
                emit(ev="failed", kind=type(exc).__name__, typed=isinstance(exc, KvlendError),
                     expected=isinstance(exc, (PeerLost, TransferTimeout)), bound=exc.bound,
                     handle_bound=handle.bound, request=getattr(exc, "request", None), quiet=handle.quiet,
                     elapsed=elapsed, error=str(exc)[:300], bounds=bounds, t=time.monotonic())
                continue
            still = None
            if resume:
                still = hashlib.sha256(page_bytes(cache, table[: resume // tpp]).tobytes()).hexdigest() == below_digest
            emit(ev="fetched", bound=result.bound, bytes=result.bytes, resumed_from=result.resumed_from,
                 descriptors=result.descriptors, elapsed=elapsed, bounds=bounds, below_unchanged=still,
                 meta={k: v for k, v in handle.meta.items() if isinstance(v, (int, str))})
            tokens = toy_engine.decode(model, cache, table, len(prompt), handle.meta["first"], args.new_tokens)
            emit(ev="tokens", tokens=tokens, digest=toy_engine.kv_digest(cache, table, len(prompt)))
    finally:
        node.close()
        node.backend.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["prefill", "decode"])
    p.add_argument("--gen", type=int, default=0, help="generation: keeps names and page placements distinct")
    p.add_argument("--seed", type=int, default=0, help="model and prompt seed")
    p.add_argument("--prompt-len", type=int, default=2008)
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk, tokens")
    p.add_argument("--gated", action="store_true", help="prefill: each later chunk waits for `next`")
    p.add_argument("--pause", type=float, default=0.0, help="prefill: seconds between ungated chunks")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--ttl", type=float, default=5.0)
    p.add_argument("--heartbeat", type=float, default=0.5)
    p.add_argument("--chunk-pages", type=int, default=4)
    p.add_argument("--cancel-grace", type=float, default=2.0)
    p.add_argument("--deadline", type=float, default=20.0, help="transfer timeout; the rank lives 6x this at most")
    p.add_argument("--dump", help="decode: .npy file for the pages below a failed fetch's bound")
    args = p.parse_args()
    return {"prefill": run_prefill, "decode": run_decode}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
