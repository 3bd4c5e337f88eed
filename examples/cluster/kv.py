"""What both ends of the cluster loopback agree on: a request's KV, derived from its id alone, and the
pools' shape and layout."""

from __future__ import annotations

import hashlib

import numpy as np

from kvlend.core.layout import ReplicaRank, layout_from_pools
from multinode_rank import DTYPE  # examples/, the rank script's folder

SCOPE = "kvlend-cluster"


def request_pattern(seed: int, request: str, layer: int, role: int, shape: tuple[int, ...]) -> np.ndarray:
    """The KV of ``request``'s pages (K: role 0, V: role 1): both ends derive it from the request id alone."""
    key = int.from_bytes(hashlib.sha256(request.encode()).digest()[:8], "little")
    rng = np.random.default_rng([seed, key, layer, role])
    n = int(np.prod(shape)) * np.dtype(DTYPE).itemsize
    return rng.integers(0, 256, n, dtype=np.uint8).view(DTYPE).reshape(shape)


def pages_of(args, tokens: int) -> int:
    return -(-tokens // args.tokens_per_page)


def page_shape(args, pages: int) -> tuple[int, ...]:
    return (pages, args.heads, args.tokens_per_page, args.head_dim)


def build_layout(pools):
    return layout_from_pools(k=[p[0] for p in pools], v=[p[1] for p in pools], kept_window=1 << 20,
                             replica=ReplicaRank(1, 0), scope=SCOPE)
