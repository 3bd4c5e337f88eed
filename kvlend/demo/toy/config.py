"""The toy model's configuration: ``ModelConfig`` (validated, digested into the layout scope) and its
named presets."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvlend.errors import KvlendError

# Bump when the model's arithmetic changes, so old scopes stop matching.
MODEL_VERSION = 1

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ToyEngineError(KvlendError, ValueError):
    """Bad toy-engine input: a config field, a token id, a generation length."""


def check_int(where: str, value: Any, minimum: int) -> None:
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
            check_int(f"config.{name}", getattr(self, name), 1)
        check_int("config.sink_tokens", self.sink_tokens, 0)
        kinds = self.layer_kinds
        if not isinstance(kinds, tuple) or (kinds and len(kinds) != self.layers) \
                or any(k not in LAYER_KINDS for k in kinds):
            raise ToyEngineError(
                f"config.layer_kinds: expected {self.layers} of {LAYER_KINDS} (or none), got {kinds!r}")
        check_int("config.seed", self.seed, 0)
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
