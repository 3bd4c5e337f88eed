"""Prefill (whole or chunked), greedy decode and the single-process reference, plus what the tests
compare: digests of cache bytes, lent byte counts and seeded prompts."""

from __future__ import annotations

import hashlib
from typing import Iterator, Sequence

import numpy as np
import torch

from kvlend.core.layout import PageLayout

from .cache import PagedKVCache
from .config import ToyEngineError, check_int
from .model import ToyModel, deterministic


def lent_bytes(layout: PageLayout, num_tokens: int, *, windowed: bool = True) -> int:
    """Bytes a full-row lease of ``num_tokens`` tokens lends: per group, the pages a decoder
    reads (``windowed``) or every page (not ``windowed``), times the group's bytes per row."""
    total = 0
    for group in layout.groups.values():
        if windowed or group.recurrent:
            rows = group.pages_read(num_tokens, layout.tokens_per_page).size
        else:
            rows = -(-num_tokens // layout.tokens_per_page)
        total += rows * sum(b.page_bytes for b in group.buffers)
    return total


def kv_digest(cache: PagedKVCache, page_table: Sequence[int] | np.ndarray, num_tokens: int,
              state: int | None = None) -> str:
    """SHA-256 of the K/V bytes of tokens ``[0, num_tokens)`` in token order, every attention
    layer, then of the recurrent state in slot ``state``.

    Equal on both sides of a transfer iff every byte landed in the right
    place, wherever the pages sit in either pool.
    """
    table = cache.check_table(page_table, num_tokens)
    slot = cache.check_state(state)
    c = cache.config
    n_pages = -(-num_tokens // c.tokens_per_page)
    digest = hashlib.sha256()
    for pool in cache.tensors:
        index = torch.as_tensor(table[:n_pages], device=pool.device)
        kv = pool[index].permute(1, 2, 0, 3, 4).reshape(2, cache.heads, n_pages * c.tokens_per_page, c.head_dim)
        digest.update(kv[:, :, :num_tokens].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    for pool in cache.states:
        digest.update(pool[slot].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _check_compatible(model: ToyModel, cache: PagedKVCache) -> None:
    if model.config != cache.config:
        raise ToyEngineError("cache: its config differs from the model's")
    if model.device != cache.device:
        raise ToyEngineError(f"cache: on {cache.device}, the model on {model.device}")
    if cache.replica.tp_size != 1:
        raise ToyEngineError(f"cache: a shard of tp rank {cache.replica.tp_rank} of {cache.replica.tp_size}; "
                             "merge_shards into a whole cache first")


def _check_tokens(model: ToyModel, tokens: Sequence[int], where: str) -> list[int]:
    vocab = model.config.vocab
    out = []
    for t in tokens:
        check_int(f"{where} token", t, 0)
        if t >= vocab:
            raise ToyEngineError(f"{where}: token {t} is outside the vocabulary [0, {vocab})")
        out.append(int(t))
    return out


def prefill(model: ToyModel, cache: PagedKVCache, prompt_tokens: Sequence[int],
            state: int | None = None, chunk: int | None = None) -> tuple[np.ndarray, int]:
    """Allocate pages, write the prompt's K/V (and its recurrent state into slot ``state``, from
    ``cache.alloc_state()``, for a model with recurrent layers); return (page table, first generated token).

    ``chunk``: prefill ``chunk`` tokens at a time (see ``prefill_chunks``), as a chunked-prefill engine does.
    """
    table, first = None, None
    for table, _, first in prefill_chunks(model, cache, prompt_tokens, state, chunk):  # noqa: B007 -- the last wins
        pass
    return table, first


def prefill_chunks(model: ToyModel, cache: PagedKVCache, prompt_tokens: Sequence[int],
                   state: int | None = None, chunk: int | None = None) -> Iterator[tuple[np.ndarray, int, int | None]]:
    """Chunked prefill: after each chunk of ``chunk`` tokens (None: the whole prompt at once) yield
    (page table, tokens committed, first generated token once the last chunk is done, else None).

    The page table covers the whole prompt from the start (its pages are allocated up front) and
    the pages of committed tokens never change again, so a lender may lend them while later chunks
    run.  Chunked and one-shot prefill round alike only up to float32 reduction order: compare a
    transfer with ``generate_reference(..., chunk=)`` of the same chunking.
    """
    _check_compatible(model, cache)
    prompt = _check_tokens(model, prompt_tokens, "prompt")
    slot = cache.check_state(state)
    if not prompt:
        raise ToyEngineError("prompt: must hold at least one token")
    if len(prompt) > model.config.max_context:
        raise ToyEngineError(f"prompt: {len(prompt)} tokens exceed max_context {model.config.max_context}")
    if chunk is not None:
        check_int("chunk", chunk, 1)
    step = chunk or len(prompt)
    table = cache.alloc(-(-len(prompt) // model.config.tokens_per_page))
    done = 0
    try:
        while done < len(prompt):
            end = min(done + step, len(prompt))
            with deterministic(model.device):
                logits = model.forward(cache, table, prompt[done:end], done, slot)
            done = end
            yield table, done, int(logits.argmax()) if done == len(prompt) else None
    except GeneratorExit:  # the caller stopped early: the pages are its own (it holds the table)
        raise
    except BaseException:
        cache.free(table)
        raise


def decode(model: ToyModel, cache: PagedKVCache, page_table: Sequence[int] | np.ndarray, num_tokens: int,
           first_token: int, max_new_tokens: int, state: int | None = None) -> list[int]:
    """Greedy tokens continuing a prefilled prompt of ``num_tokens`` tokens, ``first_token`` first.

    Reads the prompt's K/V from ``page_table``'s pages and its recurrent
    state from slot ``state`` (which it advances).  Returns
    ``max_new_tokens`` tokens, as ``generate_reference`` does.  Pages it
    allocates for generated tokens go back to the cache before it returns;
    the caller's pages stay allocated.
    """
    _check_compatible(model, cache)
    check_int("num_tokens", num_tokens, 1)
    check_int("max_new_tokens", max_new_tokens, 1)
    (first,) = _check_tokens(model, [first_token], "first_token")
    table = cache.check_table(page_table, num_tokens)
    slot = cache.check_state(state)
    total = num_tokens + max_new_tokens - 1  # the last token is returned, never fed
    if total > model.config.max_context:
        raise ToyEngineError(f"max_new_tokens: {num_tokens} + {max_new_tokens} - 1 tokens exceed "
                             f"max_context {model.config.max_context}")
    extra = cache.alloc(max(0, -(-total // model.config.tokens_per_page) - table.size))
    try:
        table = np.concatenate([table, extra])
        out = [first]
        with deterministic(model.device):
            for pos in range(num_tokens, total):
                out.append(int(model.forward(cache, table, [out[-1]], pos, slot).argmax()))
        return out
    finally:
        cache.free(extra)


def generate_reference(model: ToyModel, prompt: Sequence[int], max_new_tokens: int,
                       chunk: int | None = None) -> list[int]:
    """Prefill (in chunks of ``chunk`` tokens) then decode in one private cache: what decode must
    reproduce after a transfer."""
    check_int("max_new_tokens", max_new_tokens, 1)
    tpp = model.config.tokens_per_page
    cache = PagedKVCache(model.config, max(1, -(-(len(prompt) + max_new_tokens) // tpp)), model.device,
                         state_slots=1)
    state = cache.alloc_state()
    table, first = prefill(model, cache, prompt, state, chunk)
    return decode(model, cache, table, len(prompt), first, max_new_tokens, state)


def make_prompts(n: int, seed: int, min_len: int, max_len: int, vocab: int) -> list[list[int]]:
    """``n`` deterministic prompts with lengths uniform in ``[min_len, max_len]``."""
    check_int("n", n, 0)
    check_int("seed", seed, 0)
    check_int("min_len", min_len, 1)
    check_int("max_len", max_len, min_len)
    check_int("vocab", vocab, 1)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=n)
    return [rng.integers(0, vocab, size=int(length)).tolist() for length in lengths]
