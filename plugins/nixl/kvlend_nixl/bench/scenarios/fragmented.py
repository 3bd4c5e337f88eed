"""Scenario 2: model-shaped requests over fragmented pools: kvlend, raw NIXL with kvlend's descriptors
and with one per page, and host staging (gather, one read, scatter)."""

from __future__ import annotations

import time

import numpy as np

from ..lender_process import LenderProcess
from ..pools import PAGE_BYTES, TPP, descriptor_rows, fragmented, min_descriptors
from ..reader import Reader
from ..sizes import Sizes
from ..timing import ratio, side_by_side, stats


def run(lender: LenderProcess, backend, sizes: Sizes, progress) -> dict:
    rows, notes = [], []
    configs: dict[int, list[int]] = {}
    for tokens, layers in sizes.s2_requests:
        configs.setdefault(layers, []).append(tokens)
        if layers != 32:
            notes.append(f"{tokens} tokens: scaled to {layers} layers instead of 32 "
                         "(size cap: both processes hold pools and staging buffers in RAM)")
    for layers, requests in configs.items():
        need = max(requests) // TPP
        pool = need * 3 // 2
        reader = Reader(lender, backend, pool, layers, False, need * 2 * layers * PAGE_BYTES)
        try:
            for tokens in requests:
                rows.append(_model_request(reader, lender, tokens, layers, pool, sizes.reps, progress))
        finally:
            reader.close()
    return {"name": "model-shaped fragmented reads (Llama-3-8B-like: 8 KV heads x 128, 2-byte, 16 tokens/page)",
            "requests": rows, "notes": notes}


def _model_request(reader: Reader, lender: LenderProcess, tokens: int, layers: int, pool: int, reps: int,
                   progress) -> dict:
    n = tokens // TPP
    src, dst = fragmented(pool, n, seed=tokens), fragmented(pool, n, seed=tokens + 1)
    nbytes = n * 2 * layers * PAGE_BYTES
    label = f"scenario 2: {tokens} tokens x {layers} layers ({nbytes >> 20} MiB)"
    local, remote = reader.descriptors(src, dst, tokens)
    pl, pr = reader.per_page(src, dst)
    steps: dict[str, list[float]] = {"gather": [], "transfer": [], "scatter": []}
    one_l = descriptor_rows(np.array([reader.staging.ctypes.data]), np.array([nbytes]))
    one_r = descriptor_rows(np.array([reader.remote_staging]), np.array([nbytes]))

    def staged() -> None:
        steps["gather"].append(lender.call("gather", src))  # timed inside the lender process
        start = time.perf_counter()
        reader.raw(one_l, one_r)
        steps["transfer"].append(time.perf_counter() - start)
        start = time.perf_counter()
        offset = 0
        for a in reader.arrays:
            size = n * a[0].nbytes
            a[dst] = reader.staging[offset:offset + size].view(a.dtype).reshape((n,) + a.shape[1:])
            offset += size
        steps["scatter"].append(time.perf_counter() - start)

    methods = {"kvlend": lambda: reader.kvlend(src, dst, tokens),
               "raw_same_descriptors": lambda: reader.raw(local, remote),
               "raw_per_page": lambda: reader.raw(pl, pr)}
    progress(f"{label}: kvlend, raw NIXL (same descriptors), raw NIXL (per page), {reps} rounds")
    times = side_by_side(methods, reps, warmup=2)
    progress(f"{label}: host staging (gather, one-descriptor read, scatter), {reps} rounds")
    side_by_side({"staging": staged}, reps, warmup=2)
    steps = {k: v[2:] for k, v in steps.items()}  # drop the warm-up
    kv, raw, per = (stats(times[k], nbytes) for k in methods)
    stage = stats([sum(t) for t in zip(*steps.values())], nbytes)
    stage["steps"] = {k: stats(v) for k, v in steps.items()}
    for r, name in ((kv, "kvlend"), (raw, "raw_same_descriptors"), (per, "raw_per_page")):
        r["verified"] = reader.verified(methods[name], src, dst)
    stage["verified"] = reader.verified(staged, src, dst)
    minimum = min_descriptors(src, dst, 2 * layers)
    return {
        "tokens": tokens, "layers": layers, "pages": n, "bytes": nbytes,
        "descriptors": {"kvlend": len(local), "minimum": minimum, "per_page": len(pl), "staging": 1},
        "results": {"kvlend": kv, "raw_same_descriptors": raw, "raw_per_page": per, "staging": stage},
        "ratios": {"kvlend/raw_same": ratio(kv, raw), "kvlend/per_page": ratio(kv, per),
                   "kvlend/staging": ratio(kv, stage)},
        "targets": {"descriptors == minimum": len(local) == minimum,
                    "kvlend/raw_same >= 0.90": ratio(kv, raw) >= 0.90,
                    "kvlend/staging >= 1.5": ratio(kv, stage) >= 1.5},
    }
