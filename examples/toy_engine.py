"""A tiny, seeded, deterministic decoder-only transformer with a paged KV cache.

The example prefill/decode pair uses it to prove that transferred KV bytes are
right: the tokens decode generates from pages that crossed the wire must equal
what one process generates alone from the same prompt.

Determinism is the point.  Weights come from a seeded ``torch.Generator``, so
every process builds the same model; weights and activations are float32 and
CPU calls run on one intra-op thread; and prefill, decode and the reference
all run one code path (``ToyModel._forward``), which writes K/V into pages and
reads them back through the page table.  Equal cache bytes therefore give
bit-equal logits in any process, wherever the pages sit in the pool.  Compare
runs on one device type: CPU and CUDA kernels round differently.

``ModelConfig.dtype`` is the dtype of the KV pools (the bytes that move);
K/V are rounded to it when written, so the reference sees the same rounding.

Not a package: import it with ``examples/`` on ``sys.path``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from kvlend.errors import KvlendError, PageRangeError
from kvlend.layout import PageLayout, ReplicaRank, layout_from_pools

# Bump when the model's arithmetic changes, so old scopes stop matching.
MODEL_VERSION = 1

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ToyEngineError(KvlendError, ValueError):
    """Bad toy-engine input: a config field, a token id, a generation length."""


def _check_int(where: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ToyEngineError(f"{where}: must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ToyEngineError(f"{where}: must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the toy model; equal configs build bit-identical models.

    ``q_heads`` is a multiple of ``kv_heads`` (grouped-query attention).
    ``dtype`` (a name or a torch dtype) is the KV-pool dtype.  ``max_context``
    bounds positions and is the kept window the cache reports in its layout.
    """

    vocab: int = 256
    layers: int = 4
    kv_heads: int = 4
    q_heads: int = 8
    head_dim: int = 32
    hidden: int = 128
    ffn: int = 256
    tokens_per_page: int = 16
    dtype: str = "float32"
    seed: int = 0
    max_context: int = 4096
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if self.dtype not in _DTYPES:
            raise ToyEngineError(f"config.dtype: {self.dtype!r} is not one of {sorted(_DTYPES)}")
        for name in ("vocab", "layers", "kv_heads", "q_heads", "head_dim", "hidden", "ffn",
                     "tokens_per_page", "max_context"):
            _check_int(f"config.{name}", getattr(self, name), 1)
        _check_int("config.seed", self.seed, 0)
        if self.q_heads % self.kv_heads:
            raise ToyEngineError(f"config.q_heads: {self.q_heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ToyEngineError(f"config.head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) \
                or not self.rope_theta > 1.0:
            raise ToyEngineError(f"config.rope_theta: must be > 1, got {self.rope_theta!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def scope(self) -> str:
        """Digest of everything that decides the model's weights and arithmetic (the layout scope)."""
        blob = json.dumps([MODEL_VERSION, dataclasses.asdict(self)], sort_keys=True)
        return f"toy-engine/{hashlib.sha256(blob.encode()).hexdigest()[:32]}"


PRESETS = {
    # Fast on two CPU cores: 16 KiB of K+V per page and layer.
    "tiny": ModelConfig(),
    # Llama-3-8B KV geometry per layer (8 KV heads x 128, bf16: 32 KiB of K per
    # page and layer), but few layers and a small residual stream.
    "llama": ModelConfig(layers=4, kv_heads=8, q_heads=8, head_dim=128, hidden=256, ffn=512,
                         dtype="bfloat16", max_context=8192),
}


def preset(name: str = "tiny", **overrides: Any) -> ModelConfig:
    """A named config, with any field overridden (e.g. ``preset("llama", layers=2)``)."""
    if name not in PRESETS:
        raise ToyEngineError(f"preset: unknown name {name!r}; have {sorted(PRESETS)}")
    try:
        return dataclasses.replace(PRESETS[name], **overrides)
    except TypeError as exc:
        raise ToyEngineError(f"preset {name!r}: {exc}") from None


@contextmanager
def _deterministic(device: torch.device) -> Iterator[None]:
    """One intra-op thread on CPU, so reductions split the same way in every process."""
    threads = torch.get_num_threads()
    pin = device.type == "cpu" and threads != 1
    if pin:
        torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            yield
    finally:
        if pin:
            torch.set_num_threads(threads)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; ``cos``/``sin`` broadcast against ``x``'s halves."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class ToyModel:
    """RMSNorm, RoPE, grouped-query attention over a paged cache, SwiGLU MLP, greedy decoding."""

    def __init__(self, config: ModelConfig = ModelConfig(), device: str | torch.device = "cpu"):
        if not isinstance(config, ModelConfig):
            raise ToyEngineError(f"config: must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.device = torch.device(device)
        c = config
        gen = torch.Generator().manual_seed(c.seed)
        shapes: list[tuple[str, tuple[int, ...], float | None]] = [("embed", (c.vocab, c.hidden), 1.0)]
        for i in range(c.layers):
            shapes += [
                (f"L{i}.attn_norm", (c.hidden,), None),
                (f"L{i}.wq", (c.hidden, c.q_heads * c.head_dim), c.hidden ** -0.5),
                (f"L{i}.wk", (c.hidden, c.kv_heads * c.head_dim), c.hidden ** -0.5),
                (f"L{i}.wv", (c.hidden, c.kv_heads * c.head_dim), c.hidden ** -0.5),
                (f"L{i}.wo", (c.q_heads * c.head_dim, c.hidden), (c.q_heads * c.head_dim) ** -0.5),
                (f"L{i}.mlp_norm", (c.hidden,), None),
                (f"L{i}.w_gate", (c.hidden, c.ffn), c.hidden ** -0.5),
                (f"L{i}.w_up", (c.hidden, c.ffn), c.hidden ** -0.5),
                (f"L{i}.w_down", (c.ffn, c.hidden), c.ffn ** -0.5),
            ]
        shapes += [("final_norm", (c.hidden,), None), ("unembed", (c.hidden, c.vocab), c.hidden ** -0.5)]
        # Weights are drawn on the CPU generator, in this fixed order, then moved.
        self.weights: dict[str, torch.Tensor] = {}
        for name, shape, scale in shapes:
            w = torch.ones(shape) if scale is None else torch.randn(shape, generator=gen) * scale
            self.weights[name] = w.to(self.device)
        half = c.head_dim // 2
        self._inv_freq = (1.0 / c.rope_theta ** (torch.arange(half, dtype=torch.float32) / half)).to(self.device)

    def _forward(self, cache: PagedKVCache, page_table: np.ndarray, tokens: Sequence[int], start: int) -> torch.Tensor:
        """Run ``tokens`` at positions ``[start, start + len(tokens))``; return the last position's logits.

        Writes their K/V into the pages ``page_table`` names, then attends over
        positions ``[0, start + len(tokens))`` read back from those pages, so
        the cache is the only source of K/V.  K is cached before RoPE and
        rotated by its place in the table when read: a page in the wrong slot
        attends as the wrong positions, so misplaced pages change the tokens
        just as corrupt ones do (post-RoPE keys would make attention blind to
        page order).  The caller has validated inputs.
        """
        c, dev, w = self.config, self.device, self.weights
        tpp = c.tokens_per_page
        n_tok = len(tokens)
        total = start + n_tok
        n_pages = -(-total // tpp)
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=dev)
        pos = torch.arange(start, total, device=dev)
        table = torch.as_tensor(np.asarray(page_table[:n_pages], dtype=np.int64), device=dev)
        write_pages, write_slots = table[pos // tpp], pos % tpp
        angles = torch.arange(total, device=dev, dtype=torch.float32)[:, None] * self._inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()  # [keys, head_dim / 2]
        visible = torch.arange(total, device=dev)[None, :] <= pos[:, None]  # [queries, keys]
        group = c.q_heads // c.kv_heads
        x = w["embed"][ids]
        for i, pool in enumerate(cache.tensors):
            h = _rms_norm(x, w[f"L{i}.attn_norm"])
            q = _rope((h @ w[f"L{i}.wq"]).view(n_tok, c.q_heads, c.head_dim), cos[start:, None], sin[start:, None])
            k = (h @ w[f"L{i}.wk"]).view(n_tok, c.kv_heads, c.head_dim)
            v = (h @ w[f"L{i}.wv"]).view(n_tok, c.kv_heads, c.head_dim)
            pool[write_pages, :, :, write_slots] = torch.stack([k, v], dim=1).to(pool.dtype)
            kv = pool[table].permute(1, 2, 0, 3, 4).reshape(2, c.kv_heads, n_pages * tpp, c.head_dim)
            kv = kv[:, :, :total].to(torch.float32)  # [K|V, kv_heads, keys, head_dim]
            keys = _rope(kv[0], cos, sin)
            qg = q.permute(1, 0, 2).reshape(c.kv_heads, group * n_tok, c.head_dim)
            scores = (qg @ keys.transpose(1, 2)).view(c.kv_heads, group, n_tok, total) * c.head_dim ** -0.5
            probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
            attn = (probs.view(c.kv_heads, group * n_tok, total) @ kv[1]).view(c.q_heads, n_tok, c.head_dim)
            x = x + attn.permute(1, 0, 2).reshape(n_tok, c.q_heads * c.head_dim) @ w[f"L{i}.wo"]
            h = _rms_norm(x, w[f"L{i}.mlp_norm"])
            x = x + (torch.nn.functional.silu(h @ w[f"L{i}.w_gate"]) * (h @ w[f"L{i}.w_up"])) @ w[f"L{i}.w_down"]
        return _rms_norm(x[-1], w["final_norm"]) @ w["unembed"]


def _scattered_order(num_pages: int, seed: int, max_run: int) -> np.ndarray:
    """Page ordinals as runs of 1..max_run contiguous pages, runs in seeded random order."""
    rng = np.random.default_rng(seed)
    cuts = np.cumsum(rng.integers(1, max_run + 1, size=num_pages))
    runs = np.split(np.arange(num_pages, dtype=np.int64), cuts[cuts < num_pages])
    return np.concatenate([runs[j] for j in rng.permutation(len(runs))])


class PagedKVCache:
    """One pool tensor per layer, ``[num_pages, 2, kv_heads, tokens_per_page, head_dim]`` (K|V, HND).

    The allocator hands pages out in a seeded, scattered order (short
    contiguous runs in random order) so transfers exercise coalescing; freed
    pages go to the back of the free list.  ``scatter=False`` hands them out
    in ascending order.
    """

    def __init__(self, config: ModelConfig, num_pages: int, device: str | torch.device = "cpu", *,
                 scatter: bool = True, seed: int = 0, max_run: int = 4):
        if not isinstance(config, ModelConfig):
            raise ToyEngineError(f"config: must be a ModelConfig, got {type(config).__name__}")
        _check_int("num_pages", num_pages, 1)
        _check_int("seed", seed, 0)
        _check_int("max_run", max_run, 1)
        self.config = config
        self.num_pages = int(num_pages)
        self.device = torch.device(device)
        shape = (self.num_pages, 2, config.kv_heads, config.tokens_per_page, config.head_dim)
        self.tensors: list[torch.Tensor] = [
            torch.zeros(shape, dtype=config.torch_dtype, device=self.device) for _ in range(config.layers)
        ]
        order = _scattered_order(self.num_pages, seed, max_run) if scatter else np.arange(self.num_pages)
        self._free: deque[int] = deque(int(p) for p in order)
        self._allocated = np.zeros(self.num_pages, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray:
        """``n`` free page ordinals (int64), now allocated."""
        _check_int("alloc n", n, 0)
        if n > len(self._free):
            raise PageRangeError(f"alloc: {n} pages requested, only {len(self._free)} of {self.num_pages} free")
        pages = np.fromiter((self._free.popleft() for _ in range(n)), dtype=np.int64, count=n)
        self._allocated[pages] = True
        return pages

    def free(self, ordinals: Sequence[int] | np.ndarray) -> None:
        """Return allocated pages; a page not allocated, or named twice, is refused before any change."""
        pages = self._ordinals(ordinals, "free")
        if np.unique(pages).size != pages.size:
            raise PageRangeError(f"free: duplicate page ordinals in {pages.tolist()}")
        self._allocated[pages] = False
        self._free.extend(pages.tolist())

    def check_table(self, page_table: Sequence[int] | np.ndarray, num_tokens: int) -> np.ndarray:
        """The page table as int64, after checking it covers ``num_tokens`` with allocated pages."""
        table = self._ordinals(page_table, "page_table")
        _check_int("num_tokens", num_tokens, 0)
        need = -(-num_tokens // self.config.tokens_per_page)
        if table.size < need:
            raise PageRangeError(f"page_table: {table.size} pages cannot hold {num_tokens} tokens (need {need})")
        return table

    def _ordinals(self, ordinals: Sequence[int] | np.ndarray, where: str) -> np.ndarray:
        pages = np.asarray(ordinals)
        if pages.ndim != 1 or (pages.size and not np.issubdtype(pages.dtype, np.integer)):
            raise PageRangeError(f"{where}: expected a 1-D array of ints, got shape {pages.shape} dtype {pages.dtype}")
        pages = pages.astype(np.int64)
        bad = pages[(pages < 0) | (pages >= self.num_pages)]
        if bad.size:
            raise PageRangeError(f"{where}: page ordinal {int(bad[0])} is outside [0, {self.num_pages})")
        loose = pages[~self._allocated[pages]]
        if loose.size:
            raise PageRangeError(f"{where}: page {int(loose[0])} is not allocated")
        return pages

    def page_view(self, layer: int) -> np.ndarray:
        """Layer ``layer``'s pool as uint8 ``[num_pages, page_bytes]``, sharing memory (CPU only)."""
        _check_int("layer", layer, 0)
        if layer >= len(self.tensors):
            raise ToyEngineError(f"layer: {layer} is outside [0, {len(self.tensors)})")
        if self.device.type != "cpu":
            raise ToyEngineError(f"page_view: needs a CPU cache, this one is on {self.device}")
        return self.tensors[layer].view(torch.uint8).reshape(self.num_pages, -1).numpy()

    def layout(self, kept_window: int | None = None, *, scope: str | None = None,
               replica: ReplicaRank = ReplicaRank()) -> PageLayout:
        """The pools as a PageLayout; defaults: kept window ``max_context``, scope the config digest."""
        return layout_from_pools(
            kv=self.tensors,
            tokens_per_page=self.config.tokens_per_page,
            kept_window=self.config.max_context if kept_window is None else kept_window,
            scope=self.config.scope if scope is None else scope,
            replica=replica,
        )


def kv_digest(cache: PagedKVCache, page_table: Sequence[int] | np.ndarray, num_tokens: int) -> str:
    """SHA-256 of the K/V bytes of tokens ``[0, num_tokens)`` in token order, every layer.

    Equal on both sides of a transfer iff every byte landed in the right
    place, wherever the pages sit in either pool.
    """
    table = cache.check_table(page_table, num_tokens)
    c = cache.config
    n_pages = -(-num_tokens // c.tokens_per_page)
    index = torch.as_tensor(table[:n_pages], device=cache.device)
    digest = hashlib.sha256()
    for pool in cache.tensors:
        kv = pool[index].permute(1, 2, 0, 3, 4).reshape(2, c.kv_heads, n_pages * c.tokens_per_page, c.head_dim)
        digest.update(kv[:, :, :num_tokens].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _check_compatible(model: ToyModel, cache: PagedKVCache) -> None:
    if model.config != cache.config:
        raise ToyEngineError("cache: its config differs from the model's")
    if model.device != cache.device:
        raise ToyEngineError(f"cache: on {cache.device}, the model on {model.device}")


def _check_tokens(model: ToyModel, tokens: Sequence[int], where: str) -> list[int]:
    vocab = model.config.vocab
    out = []
    for t in tokens:
        _check_int(f"{where} token", t, 0)
        if t >= vocab:
            raise ToyEngineError(f"{where}: token {t} is outside the vocabulary [0, {vocab})")
        out.append(int(t))
    return out


def prefill(model: ToyModel, cache: PagedKVCache, prompt_tokens: Sequence[int]) -> tuple[np.ndarray, int]:
    """Allocate pages, write the prompt's K/V into them; return (page table, first generated token)."""
    _check_compatible(model, cache)
    prompt = _check_tokens(model, prompt_tokens, "prompt")
    if not prompt:
        raise ToyEngineError("prompt: must hold at least one token")
    if len(prompt) > model.config.max_context:
        raise ToyEngineError(f"prompt: {len(prompt)} tokens exceed max_context {model.config.max_context}")
    table = cache.alloc(-(-len(prompt) // model.config.tokens_per_page))
    try:
        with _deterministic(model.device):
            first = int(model._forward(cache, table, prompt, 0).argmax())
    except BaseException:
        cache.free(table)
        raise
    return table, first


def decode(model: ToyModel, cache: PagedKVCache, page_table: Sequence[int] | np.ndarray, num_tokens: int,
           first_token: int, max_new_tokens: int) -> list[int]:
    """Greedy tokens continuing a prefilled prompt of ``num_tokens`` tokens, ``first_token`` first.

    Reads the prompt's K/V from ``page_table``'s pages.  Returns
    ``max_new_tokens`` tokens, as ``generate_reference`` does.  Pages it
    allocates for generated tokens go back to the cache before it returns;
    the caller's pages stay allocated.
    """
    _check_compatible(model, cache)
    _check_int("num_tokens", num_tokens, 1)
    _check_int("max_new_tokens", max_new_tokens, 1)
    (first,) = _check_tokens(model, [first_token], "first_token")
    table = cache.check_table(page_table, num_tokens)
    total = num_tokens + max_new_tokens - 1  # the last token is returned, never fed
    if total > model.config.max_context:
        raise ToyEngineError(f"max_new_tokens: {num_tokens} + {max_new_tokens} - 1 tokens exceed "
                             f"max_context {model.config.max_context}")
    extra = cache.alloc(max(0, -(-total // model.config.tokens_per_page) - table.size))
    try:
        table = np.concatenate([table, extra])
        out = [first]
        with _deterministic(model.device):
            for pos in range(num_tokens, total):
                out.append(int(model._forward(cache, table, [out[-1]], pos).argmax()))
        return out
    finally:
        cache.free(extra)


def generate_reference(model: ToyModel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Prefill then decode in one private cache: what decode must reproduce after a transfer."""
    _check_int("max_new_tokens", max_new_tokens, 1)
    tpp = model.config.tokens_per_page
    cache = PagedKVCache(model.config, max(1, -(-(len(prompt) + max_new_tokens) // tpp)), model.device)
    table, first = prefill(model, cache, prompt)
    return decode(model, cache, table, len(prompt), first, max_new_tokens)


def make_prompts(n: int, seed: int, min_len: int, max_len: int, vocab: int) -> list[list[int]]:
    """``n`` deterministic prompts with lengths uniform in ``[min_len, max_len]``."""
    _check_int("n", n, 0)
    _check_int("seed", seed, 0)
    _check_int("min_len", min_len, 1)
    _check_int("max_len", max_len, min_len)
    _check_int("vocab", vocab, 1)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=n)
    return [rng.integers(0, vocab, size=int(length)).tolist() for length in lengths]
