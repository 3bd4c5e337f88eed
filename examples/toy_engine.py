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
from kvlend.core.layout import (
    BufferDesc, HeadGeometry, LayerIdentity, LayerKind, MemoryRegion, PageLayout, ReplicaRank, Role, Sharding,
    array_info, layout_from_pools,
)

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

    ``layer_kinds`` gives each layer's kind (empty: all ``"full"``):
    ``"full"`` attention, ``"swa"`` sliding-window attention over the last
    ``window`` positions plus the first ``sink_tokens`` (both in tokens, so
    the arithmetic does not depend on the page size), or ``"ssm"``, a
    Mamba-style recurrence (a causal conv of width ``conv_width`` then
    ``s_t = a * s_{t-1} + u_t b_t^T`` over ``ssm_inner x ssm_state`` floats)
    whose state lives in one slot per request.
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
    layer_kinds: tuple[str, ...] = ()
    window: int = 64
    sink_tokens: int = 16
    ssm_inner: int = 64
    ssm_state: int = 16
    conv_width: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.layer_kinds, list):
            object.__setattr__(self, "layer_kinds", tuple(self.layer_kinds))
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if self.dtype not in _DTYPES:
            raise ToyEngineError(f"config.dtype: {self.dtype!r} is not one of {sorted(_DTYPES)}")
        for name in ("vocab", "layers", "kv_heads", "q_heads", "head_dim", "hidden", "ffn",
                     "tokens_per_page", "max_context", "window", "ssm_inner", "ssm_state", "conv_width"):
            _check_int(f"config.{name}", getattr(self, name), 1)
        _check_int("config.sink_tokens", self.sink_tokens, 0)
        kinds = self.layer_kinds
        if not isinstance(kinds, tuple) or (kinds and len(kinds) != self.layers) \
                or any(k not in LAYER_KINDS for k in kinds):
            raise ToyEngineError(f"config.layer_kinds: expected {self.layers} of {LAYER_KINDS} (or none), got {kinds!r}")
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
    def kinds(self) -> tuple[str, ...]:
        return self.layer_kinds or ("full",) * self.layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k != "ssm")

    @property
    def ssm_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k == "ssm")

    @property
    def state_floats(self) -> tuple[int, int]:
        """Elements of one request's (SSM state, conv state) per recurrent layer."""
        return self.ssm_inner * self.ssm_state, (self.conv_width - 1) * self.ssm_inner

    @property
    def scope(self) -> str:
        """Digest of everything that decides the model's weights and arithmetic (the layout scope).

        Tokens per page is left out: it is how the cache is cut, not what it
        means, so ranks with different page sizes can still exchange pages.
        """
        fields = dataclasses.asdict(self)
        del fields["tokens_per_page"]
        blob = json.dumps([MODEL_VERSION, fields], sort_keys=True)
        return f"toy-engine/{hashlib.sha256(blob.encode()).hexdigest()[:32]}"


LAYER_KINDS = ("full", "swa", "ssm")
HYBRID_PATTERN = ("swa", "ssm", "swa", "full")  # repeated over the layers by ``hybrid``

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


def hybrid(config: ModelConfig) -> ModelConfig:
    """``config`` with its layers cycling through sliding-window, recurrent, sliding-window, full."""
    return dataclasses.replace(config, layer_kinds=tuple(HYBRID_PATTERN[i % 4] for i in range(config.layers)))


PRESETS["hybrid"] = hybrid(PRESETS["tiny"])


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
    """RMSNorm, RoPE, grouped-query attention over a paged cache (full or sliding-window),
    Mamba-style recurrent layers over per-request state slots, SwiGLU MLP, greedy decoding."""

    def __init__(self, config: ModelConfig = ModelConfig(), device: str | torch.device = "cpu"):
        if not isinstance(config, ModelConfig):
            raise ToyEngineError(f"config: must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.device = torch.device(device)
        c = config
        gen = torch.Generator().manual_seed(c.seed)
        shapes: list[tuple[str, tuple[int, ...], float | None]] = [("embed", (c.vocab, c.hidden), 1.0)]
        for i, kind in enumerate(c.kinds):
            shapes.append((f"L{i}.attn_norm", (c.hidden,), None))
            if kind == "ssm":
                shapes += [
                    (f"L{i}.w_in", (c.hidden, c.ssm_inner), c.hidden ** -0.5),
                    (f"L{i}.conv", (c.conv_width, c.ssm_inner), c.conv_width ** -0.5),
                    (f"L{i}.w_b", (c.hidden, c.ssm_state), c.hidden ** -0.5),
                    (f"L{i}.w_c", (c.hidden, c.ssm_state), c.hidden ** -0.5),
                    (f"L{i}.decay", (c.ssm_inner, c.ssm_state), 1.0),
                    (f"L{i}.w_out", (c.ssm_inner, c.hidden), (c.ssm_inner * c.ssm_state) ** -0.5),
                ]
            else:
                shapes += [
                    (f"L{i}.wq", (c.hidden, c.q_heads * c.head_dim), c.hidden ** -0.5),
                    (f"L{i}.wk", (c.hidden, c.kv_heads * c.head_dim), c.hidden ** -0.5),
                    (f"L{i}.wv", (c.hidden, c.kv_heads * c.head_dim), c.hidden ** -0.5),
                    (f"L{i}.wo", (c.q_heads * c.head_dim, c.hidden), (c.q_heads * c.head_dim) ** -0.5),
                ]
            shapes += [
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
        # Per-channel decay in (0.5, 1): the state remembers a few dozen tokens.
        self._decay = {i: torch.sigmoid(self.weights[f"L{i}.decay"] + 2.0) for i in c.ssm_layers}
        half = c.head_dim // 2
        self._inv_freq = (1.0 / c.rope_theta ** (torch.arange(half, dtype=torch.float32) / half)).to(self.device)

    def _forward(self, cache: PagedKVCache, page_table: np.ndarray, tokens: Sequence[int], start: int,
                 state: int | None = None) -> torch.Tensor:
        """Run ``tokens`` at positions ``[start, start + len(tokens))``; return the last position's logits.

        Writes their K/V into the pages ``page_table`` names, then attends over
        positions ``[0, start + len(tokens))`` read back from those pages, so
        the cache is the only source of K/V.  K is cached before RoPE and
        rotated by its place in the table when read: a page in the wrong slot
        attends as the wrong positions, so misplaced pages change the tokens
        just as corrupt ones do (post-RoPE keys would make attention blind to
        page order).  Recurrent layers read their state from slot ``state``
        (zeros when ``start`` is 0) and write it back.  Sliding-window layers
        mask what they do not read, so stale pages may hold anything finite.
        The caller has validated inputs.
        """
        c, dev, w = self.config, self.device, self.weights
        n_tok = len(tokens)
        total = start + n_tok
        table = np.asarray(page_table[:-(-total // c.tokens_per_page)], dtype=np.int64)
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=dev)
        pos = torch.arange(start, total, device=dev)
        angles = torch.arange(total, device=dev, dtype=torch.float32)[:, None] * self._inv_freq[None, :]
        rope = angles.cos(), angles.sin()  # [keys, head_dim / 2]
        keys = torch.arange(total, device=dev)[None, :]
        causal = keys <= pos[:, None]  # [queries, keys]
        windowed = causal & ((pos[:, None] - keys < c.window) | (keys < c.sink_tokens))
        x = w["embed"][ids]
        for i, kind in enumerate(c.kinds):
            h = _rms_norm(x, w[f"L{i}.attn_norm"])
            if kind == "ssm":
                x = x + self._recur(cache.state_pool(i), state, h, i, start)
            else:
                x = x + self._attend(cache.pool(i), table, h, i, pos, rope, causal if kind == "full" else windowed)
            h = _rms_norm(x, w[f"L{i}.mlp_norm"])
            x = x + (torch.nn.functional.silu(h @ w[f"L{i}.w_gate"]) * (h @ w[f"L{i}.w_up"])) @ w[f"L{i}.w_down"]
        return _rms_norm(x[-1], w["final_norm"]) @ w["unembed"]

    def _attend(self, pool: torch.Tensor, table: np.ndarray, h: torch.Tensor, i: int, pos: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], visible: torch.Tensor) -> torch.Tensor:
        """One attention layer; ``pool`` may sit in host memory while the model runs on a GPU."""
        c, w = self.config, self.weights
        tpp, n_tok, total = c.tokens_per_page, h.shape[0], visible.shape[1]
        cos, sin = rope
        start = total - n_tok
        group = c.q_heads // c.kv_heads
        q = _rope((h @ w[f"L{i}.wq"]).view(n_tok, c.q_heads, c.head_dim), cos[start:, None], sin[start:, None])
        k = (h @ w[f"L{i}.wk"]).view(n_tok, c.kv_heads, c.head_dim)
        v = (h @ w[f"L{i}.wv"]).view(n_tok, c.kv_heads, c.head_dim)
        index = torch.as_tensor(table, device=pool.device)
        at = pos.to(pool.device)
        pool[index[at // tpp], :, :, at % tpp] = torch.stack([k, v], dim=1).to(pool.device, pool.dtype)
        kv = pool[index].permute(1, 2, 0, 3, 4).reshape(2, c.kv_heads, table.size * tpp, c.head_dim)
        kv = kv[:, :, :total].to(self.device, torch.float32)  # [K|V, kv_heads, keys, head_dim]
        keys = _rope(kv[0], cos, sin)
        qg = q.permute(1, 0, 2).reshape(c.kv_heads, group * n_tok, c.head_dim)
        scores = (qg @ keys.transpose(1, 2)).view(c.kv_heads, group, n_tok, total) * c.head_dim ** -0.5
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        attn = (probs.view(c.kv_heads, group * n_tok, total) @ kv[1]).view(c.q_heads, n_tok, c.head_dim)
        return attn.permute(1, 0, 2).reshape(n_tok, c.q_heads * c.head_dim) @ w[f"L{i}.wo"]

    def _recur(self, pool: torch.Tensor, slot: int, h: torch.Tensor, i: int, start: int) -> torch.Tensor:
        """One recurrent layer: causal conv, then ``s = a * s + u b^T`` token by token, ``y = s c``."""
        c, w, dev = self.config, self.weights, self.device
        n_state, n_conv = c.state_floats
        if start == 0:
            s = torch.zeros(c.ssm_inner, c.ssm_state, device=dev)
            conv = torch.zeros(c.conv_width - 1, c.ssm_inner, device=dev)
        else:
            row = pool[slot].to(dev, torch.float32)
            s = row[:n_state].view(c.ssm_inner, c.ssm_state)
            conv = row[n_state:n_state + n_conv].view(c.conv_width - 1, c.ssm_inner)
        n_tok = h.shape[0]
        seq = torch.cat([conv, h @ w[f"L{i}.w_in"]])  # [conv_width - 1 + n_tok, inner]
        taps = torch.stack([seq[j:j + n_tok] for j in range(c.conv_width)])  # [width, n_tok, inner]
        u = torch.nn.functional.silu((taps * w[f"L{i}.conv"][:, None, :]).sum(0))
        b, cv, a = h @ w[f"L{i}.w_b"], h @ w[f"L{i}.w_c"], self._decay[i]
        ys = []
        for t in range(n_tok):
            s = a * s + u[t, :, None] * b[t, None, :]
            ys.append(s @ cv[t])
        pool[slot, :n_state] = s.reshape(-1).to(pool.device, pool.dtype)
        pool[slot, n_state:n_state + n_conv] = seq[n_tok:].reshape(-1).to(pool.device, pool.dtype)
        return torch.stack(ys) @ w[f"L{i}.w_out"]


def _scattered_order(num_pages: int, seed: int, max_run: int) -> np.ndarray:
    """Page ordinals as runs of 1..max_run contiguous pages, runs in seeded random order."""
    rng = np.random.default_rng(seed)
    cuts = np.cumsum(rng.integers(1, max_run + 1, size=num_pages))
    runs = np.split(np.arange(num_pages, dtype=np.int64), cuts[cuts < num_pages])
    return np.concatenate([runs[j] for j in rng.permutation(len(runs))])


class PagedKVCache:
    """One pool tensor per attention layer, ``[num_pages, 2, heads, tokens_per_page, head_dim]`` (K|V, HND),
    and one state pool per recurrent layer, ``[state_slots, ssm state + conv state]``.

    The allocator hands pages out in a seeded, scattered order (short
    contiguous runs in random order) so transfers exercise coalescing; freed
    pages go to the back of the free list.  ``scatter=False`` hands them out
    in ascending order.  State slots (one per request) come from their own
    free list.

    ``replica`` with ``tp_size > 1`` makes a shard holding only that rank's
    ``kv_heads / tp_size`` heads: a transfer target addressed with the whole
    cache's page and slot ordinals, merged into it by ``merge_shards``
    before the model uses it.  ``host_layers`` names
    attention layers whose pools stay in host memory (pinned when CUDA is
    available) even when the cache is on a GPU: the HOST tier of the layout.
    """

    def __init__(self, config: ModelConfig, num_pages: int, device: str | torch.device = "cpu", *,
                 scatter: bool = True, seed: int = 0, max_run: int = 4, state_slots: int | None = None,
                 replica: ReplicaRank = ReplicaRank(), host_layers: Sequence[int] = ()):
        if not isinstance(config, ModelConfig):
            raise ToyEngineError(f"config: must be a ModelConfig, got {type(config).__name__}")
        _check_int("num_pages", num_pages, 1)
        _check_int("seed", seed, 0)
        _check_int("max_run", max_run, 1)
        state_slots = num_pages if state_slots is None else state_slots
        _check_int("state_slots", state_slots, 1)
        if not isinstance(replica, ReplicaRank) or config.kv_heads % replica.tp_size:
            raise ToyEngineError(f"replica: kv_heads {config.kv_heads} do not split over {replica!r}")
        host = set(host_layers)
        if not host <= set(config.attention_layers):
            raise ToyEngineError(f"host_layers: {sorted(host - set(config.attention_layers))} "
                                 f"are not attention layers {list(config.attention_layers)}")
        self.config = config
        self.num_pages = int(num_pages)
        self.device = torch.device(device)
        self.replica = replica
        self.heads = config.kv_heads // replica.tp_size
        self.host_layers = tuple(sorted(host))
        shape = (self.num_pages, 2, self.heads, config.tokens_per_page, config.head_dim)
        self.tensors: list[torch.Tensor] = [self._zeros(shape, i in host) for i in config.attention_layers]
        self.states: list[torch.Tensor] = [
            self._zeros((state_slots, sum(config.state_floats)), False) for _ in config.ssm_layers
        ]
        self._pools = dict(zip(config.attention_layers, self.tensors))
        self._state_pools = dict(zip(config.ssm_layers, self.states))
        order = _scattered_order(self.num_pages, seed, max_run) if scatter else np.arange(self.num_pages)
        self._free: deque[int] = deque(int(p) for p in order)
        self._allocated = np.zeros(self.num_pages, dtype=bool)
        self._free_slots: deque[int] = deque(range(state_slots))
        self._slot_used = np.zeros(state_slots, dtype=bool)

    def _zeros(self, shape: tuple[int, ...], host: bool) -> torch.Tensor:
        dtype = self.config.torch_dtype
        if host and self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, pin_memory=torch.cuda.is_available())
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def pool(self, layer: int) -> torch.Tensor:
        """The K|V pool of attention layer ``layer`` (model layer id)."""
        return self._pools[layer]

    def state_pool(self, layer: int) -> torch.Tensor:
        """The state pool of recurrent layer ``layer`` (model layer id)."""
        return self._state_pools[layer]

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

    def alloc_state(self) -> int | None:
        """A free state slot for one request, or None when the model has no recurrent layer."""
        if not self.states:
            return None
        if not self._free_slots:
            raise PageRangeError(f"alloc_state: all {self._slot_used.size} state slots are in use")
        slot = self._free_slots.popleft()
        self._slot_used[slot] = True
        return slot

    def free_state(self, slot: int | None) -> None:
        if slot is None and not self.states:
            return
        self.check_state(slot)
        self._slot_used[slot] = False
        self._free_slots.append(int(slot))

    def check_state(self, slot: Any) -> int | None:
        """``slot`` after checking it is an allocated state slot (None when there is no recurrent layer)."""
        if not self.states:
            if slot is not None:
                raise ToyEngineError(f"state: the model has no recurrent layer, got slot {slot!r}")
            return None
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) \
                or not 0 <= slot < self._slot_used.size or not self._slot_used[slot]:
            raise PageRangeError(f"state: {slot!r} is not an allocated state slot of recurrent layers "
                                 f"{list(self.config.ssm_layers)}")
        return int(slot)

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
        """The ``layer``-th attention pool as uint8 ``[num_pages, page_bytes]``, sharing memory (CPU only)."""
        _check_int("layer", layer, 0)
        if layer >= len(self.tensors):
            raise ToyEngineError(f"layer: {layer} is outside [0, {len(self.tensors)})")
        if self.tensors[layer].device.type != "cpu":
            raise ToyEngineError(f"page_view: needs a CPU pool, this one is on {self.device}")
        return self.tensors[layer].view(torch.uint8).reshape(self.num_pages, -1).numpy()

    def group_tables(self, page_table: np.ndarray, state: int | None = None) -> dict[str, np.ndarray]:
        """A request's slots per layout group: the page table for attention groups, ``[state]`` for "ssm"."""
        tables = {group: np.asarray(page_table) for group in self.layout_groups if group != "ssm"}
        if "ssm" in self.layout_groups:
            if isinstance(state, bool) or not isinstance(state, (int, np.integer)):
                raise ToyEngineError(f"state: the model has recurrent layers, so a state slot is needed, got {state!r}")
            tables["ssm"] = np.array([state], dtype=np.int64)
        return tables

    @property
    def layout_groups(self) -> tuple[str, ...]:
        """The groups of ``layout()``, named after their layers' kinds."""
        return tuple(k for k in LAYER_KINDS if k in self.config.kinds)

    def layout(self, kept_window: int | None = None, *, scope: str | None = None,
               replica: ReplicaRank | None = None) -> PageLayout:
        """The pools as a PageLayout; defaults: kept window ``max_context``, scope the config digest.

        Groups: ``full`` and ``swa`` attention (``swa`` declares the window and
        the sink pages covering ``sink_tokens``), and ``ssm``: per recurrent
        layer one region of state slots holding a STATE and a CONV buffer,
        REPLICATED across tensor-parallel ranks (every rank keeps the whole state).
        """
        c = self.config
        tpp = c.tokens_per_page
        kept = c.max_context if kept_window is None else kept_window
        attn = layout_from_pools(
            kv=self.tensors, tokens_per_page=tpp, kept_window=kept,
            scope=c.scope if scope is None else scope, replica=self.replica if replica is None else replica,
            layer_ids=c.attention_layers, windows={i: c.window for i in c.attention_layers if c.kinds[i] == "swa"},
            sinks=-(-c.sink_tokens // tpp),
        )
        if not self.states:
            return attn
        regions, buffers = list(attn.regions), list(attn.buffers)
        item = self.states[0].element_size()
        for layer, pool in zip(c.ssm_layers, self.states):
            info = array_info(pool)
            region = f"L{layer}.state"
            stride = info.nbytes // pool.shape[0]
            regions.append(MemoryRegion(region, info.kind, info.device_id, info.nbytes, stride, pool.shape[0],
                                        info.address))
            offset = 0
            for role, floats in zip((Role.STATE, Role.CONV), c.state_floats):
                nbytes = floats * item
                buffers.append(BufferDesc(
                    name=f"L{layer}.{role.value}", region=region, offset=offset, page_bytes=nbytes,
                    identity=LayerIdentity(layer, LayerKind.RECURRENT, role), group="ssm",
                    geometry=HeadGeometry(1, nbytes, sharding=Sharding.REPLICATED),
                ))
                offset += nbytes
        return dataclasses.replace(attn, regions=tuple(regions), buffers=tuple(buffers))


def merge_shards(cache: PagedKVCache, shards: Sequence[PagedKVCache], page_table: np.ndarray,
                 state: int | None = None) -> None:
    """Copy tensor-parallel shards' head slices of ``page_table``'s pages (same ordinals) into ``cache``.

    Recurrent state is replicated: it is taken from shard 0, after checking
    every shard holds the same bytes.
    """
    tp = len(shards)
    if [s.replica.tp_rank for s in shards] != list(range(tp)) or any(s.replica.tp_size != tp for s in shards):
        raise ToyEngineError(f"shards: expected tp ranks 0..{tp - 1} of tp {tp}, got {[s.replica for s in shards]}")
    if cache.replica.tp_size != 1 or any(s.config.kv_heads != cache.config.kv_heads for s in shards):
        raise ToyEngineError("cache: must be a whole cache of the shards' model")
    table = torch.as_tensor(cache.check_table(page_table, 0))
    for shard in shards:
        rows = slice(shard.replica.tp_rank * shard.heads, (shard.replica.tp_rank + 1) * shard.heads)
        for whole, part in zip(cache.tensors, shard.tensors):
            whole[table, :, rows] = part[table].to(whole.device)
    if cache.states:
        slot = cache.check_state(state)
        for whole, *parts in zip(cache.states, *(s.states for s in shards)):
            if any(not torch.equal(parts[0][slot], p[slot]) for p in parts[1:]):
                raise ToyEngineError(f"shards: replicated state slot {slot} differs between shards")
            whole[slot] = parts[0][slot].to(whole.device)


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
        _check_int(f"{where} token", t, 0)
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
    for table, _, first in prefill_chunks(model, cache, prompt_tokens, state, chunk):
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
        _check_int("chunk", chunk, 1)
    step = chunk or len(prompt)
    table = cache.alloc(-(-len(prompt) // model.config.tokens_per_page))
    done = 0
    try:
        while done < len(prompt):
            end = min(done + step, len(prompt))
            with _deterministic(model.device):
                logits = model._forward(cache, table, prompt[done:end], done, slot)
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
    _check_int("num_tokens", num_tokens, 1)
    _check_int("max_new_tokens", max_new_tokens, 1)
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
        with _deterministic(model.device):
            for pos in range(num_tokens, total):
                out.append(int(model._forward(cache, table, [out[-1]], pos, slot).argmax()))
        return out
    finally:
        cache.free(extra)


def generate_reference(model: ToyModel, prompt: Sequence[int], max_new_tokens: int,
                       chunk: int | None = None) -> list[int]:
    """Prefill (in chunks of ``chunk`` tokens) then decode in one private cache: what decode must
    reproduce after a transfer."""
    _check_int("max_new_tokens", max_new_tokens, 1)
    tpp = model.config.tokens_per_page
    cache = PagedKVCache(model.config, max(1, -(-(len(prompt) + max_new_tokens) // tpp)), model.device,
                         state_slots=1)
    state = cache.alloc_state()
    table, first = prefill(model, cache, prompt, state, chunk)
    return decode(model, cache, table, len(prompt), first, max_new_tokens, state)


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
