"""A tiny, seeded, deterministic decoder-only transformer with a paged KV cache.

The example prefill/decode pair uses it to prove that transferred KV bytes are
right: the tokens decode generates from pages that crossed the wire must equal
what one process generates alone from the same prompt.

Determinism is the point.  Weights come from a seeded ``torch.Generator``, so
every process builds the same model; weights and activations are float32 and
CPU calls run on one intra-op thread; and prefill, decode and the reference
all run one code path (``ToyModel.forward``), which writes K/V into pages and
reads them back through the page table.  Equal cache bytes therefore give
bit-equal logits in any process, wherever the pages sit in the pool.  Compare
runs on one device type: CPU and CUDA kernels round differently.

``ModelConfig.dtype`` is the dtype of the KV pools (the bytes that move);
K/V are rounded to it when written, so the reference sees the same rounding.
"""

from kvlend.demo.toy.cache import PagedKVCache, merge_shards
from kvlend.demo.toy.config import (
    HYBRID_PATTERN,
    LAYER_KINDS,
    MODEL_VERSION,
    PRESETS,
    ModelConfig,
    ToyEngineError,
    hybrid,
    preset,
)
from kvlend.demo.toy.inference import (
    decode,
    generate_reference,
    kv_digest,
    lent_bytes,
    make_prompts,
    prefill,
    prefill_chunks,
)
from kvlend.demo.toy.model import ToyModel
from kvlend.errors import PageRangeError

__all__ = [
    "HYBRID_PATTERN", "LAYER_KINDS", "MODEL_VERSION", "PRESETS", "ModelConfig", "PageRangeError", "PagedKVCache",
    "ToyEngineError", "ToyModel", "decode", "generate_reference", "hybrid", "kv_digest", "lent_bytes",
    "make_prompts", "merge_shards", "prefill", "prefill_chunks", "preset",
]
