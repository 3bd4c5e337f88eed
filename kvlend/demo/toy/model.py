"""The toy transformer: seeded weights and one forward pass that writes K/V (and recurrent state) into
the paged cache and reads it back from there."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import torch

from .config import ModelConfig, ToyEngineError

if TYPE_CHECKING:
    from .cache import PagedKVCache


@contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
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

    def forward(self, cache: PagedKVCache, page_table: np.ndarray, tokens: Sequence[int], start: int,
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
