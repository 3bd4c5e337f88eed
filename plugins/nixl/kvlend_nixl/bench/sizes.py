"""How much each scenario moves and how often: the full run's sizes and ``--quick``'s."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    s1_bytes: tuple[int, ...]  # one contiguous lease of each size
    s2_requests: tuple[tuple[int, int], ...]  # (tokens, layers)
    s3_layers: int
    s3_pages: int
    reps: int
    s3_reps: int
    s5_requests: int = 300  # from two prefill processes, 1..S5_MAX_PAGES pages each
    s5_inflight: int = 32
    s6_pages: int = 512  # one prompt: 8192 tokens
    s6_layers: int = 4
    s6_chunk_pages: int = 64  # chunked prefill: 1024 tokens a chunk
    s6_compute_s: float = 0.040  # simulated compute per chunk (the prefill's GPU time)
    s6_rounds: int = 6  # per mode
    s7_peers: tuple[int, ...] = (1, 4, 16)  # prefill ranks, spread over the two lender processes
    s7_inflight: tuple[int, ...] = (8, 64, 512)
    s7_requests: int = 256  # per point, at least; 3 x the fetches in flight where that is more


FULL = Sizes((8 << 20, 256 << 20), ((1024, 32), (8192, 32), (32768, 8)), 1, 16, 10, 500)
QUICK = Sizes((8 << 20,), ((1024, 4),), 1, 16, 3, 30, 24, 8, 64, 1, 16, 0.005, 2, (1, 2), (4, 16), 24)
S5_MAX_PAGES = 64
S7_PAGES = 4  # per request: small, so the control plane is most of the cost
