"""Local test models (random weights, locally trained BPE tokenizer): Llama, and a Mamba2 hybrid.

Why: tests and demos need a model vLLM loads offline, deterministically, with
known KV geometry, and without a hub.  ``ensure_model`` builds one once per
(size, seed) and caches it; a rebuild gives byte-identical files.

    python -m kvlend_vllm.models --size tiny|large|hybrid|mamba|lfm2 [--out DIR] [--seed N] [--force]

Sizes:
    tiny  : hidden 256, 2 layers, 4 heads, 2 KV heads, head_dim 64, vocab 1024,
            2048 positions
    large : hidden 256, 8 layers, 8 heads, 8 KV heads, head_dim 128, vocab 1024,
            16384 positions (for ~8k-token prompts; fp32 KV is 64 KiB per token)
    hybrid: tiny with 4 layers, alternately a 256-token sliding window and full
            attention (two KV cache groups under vLLM's hybrid allocator)
    mamba : a GraniteMoeHybrid (the granite-4.0-h architecture): 3 layers, Mamba2,
            attention, Mamba2 (hidden 256, 8 Mamba heads of 64, one group, state 16,
            conv 4; attention 4 heads, 2 KV heads): two recurrent KV cache groups
            (one state block per request each) and one full-attention group
    lfm2  : an LFM2 (short convolutions and attention): 3 layers, conv, attention,
            conv (hidden 256, a 3-token conv cache; attention 4 heads, 2 KV heads)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

SIZES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 max_position_embeddings=2048),
    "large": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=16384),
    "hybrid": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   max_position_embeddings=2048, sliding_window=256,
                   layer_types=["sliding_attention", "full_attention"] * 2),
    "mamba": dict(hidden_size=256, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                  num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=64,
                  mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, num_local_experts=0,
                  shared_intermediate_size=512, max_position_embeddings=2048),
    "lfm2": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                 layer_types=["conv", "full_attention", "conv"], num_attention_heads=4, num_key_value_heads=2,
                 conv_L_cache=3, block_auto_adjust_ff_dim=False, max_position_embeddings=2048,
                 conv_dim=256, block_dim=256),  # vLLM reads the conv and block widths under these names
}
# Which transformers class builds each size.
FAMILY = {"tiny": "llama", "large": "llama", "hybrid": "llama", "mamba": "granite", "lfm2": "lfm2"}
# With the default 0.02 the 8-layer model's greedy output is one token repeated
# (a weak check); 0.1 gives 16 distinct tokens out of 16.  Tiny keeps 0.02.
INIT_RANGE = {"tiny": 0.02, "large": 0.1, "hybrid": 0.1, "mamba": 0.1, "lfm2": 0.1}
VOCAB = 1024
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]   # ids 0..3
NEEDED = ("config.json", "model.safetensors", "tokenizer.json")


def prefix_caching(size: str) -> bool:
    """Whether an engine of this size may cache prefixes: vLLM's prefix caching of recurrent state (its
    Mamba align mode) is not ready on CPU, and kvlend refuses it."""
    return FAMILY[size] == "llama"


def default_root() -> str:
    return os.environ.get("KVLEND_MODEL_DIR") or os.path.expanduser("~/.cache/kvlend/models")


def _corpus() -> list[str]:
    """Deterministic training text: this Python's stdlib sources plus a few sentences."""
    import importlib
    import inspect
    lines: list[str] = []
    for name in ("argparse", "collections", "json", "textwrap",
                 "string", "inspect", "functools", "random"):
        lines.extend(inspect.getsource(importlib.import_module(name)).splitlines())
    extra = ("The quick brown fox jumps over the lazy dog. "
             "Hello, my name is Alice and I live in Paris. "
             "The capital of France is Paris. One two three four five six seven.")
    lines.extend([extra] * 50)
    return [ln for ln in lines if ln.strip()]


def _write_tokenizer(out: str, max_len: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
        eos_token="</s>", pad_token="<pad>")
    fast.model_max_length = max_len
    fast.save_pretrained(out)


def _write_model(out: str, size: str, seed: int) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    config, model = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                     "granite": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
                     "lfm2": ("Lfm2Config", "Lfm2ForCausalLM")}[FAMILY[size]]
    cfg = getattr(transformers, config)(
        vocab_size=VOCAB, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        initializer_range=INIT_RANGE[size], dtype="float32", **SIZES[size])
    getattr(transformers, model)(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)


def _complete(path: str) -> bool:
    return all(os.path.exists(os.path.join(path, f)) for f in NEEDED)


def build(size: str, out: str, seed: int = 0, force: bool = False) -> str:
    """Build into ``out`` unless complete there; atomic (temp dir, then rename)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(SIZES)}")
    out = os.path.abspath(out)
    if not force and _complete(out):
        return out
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    t = time.monotonic()
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=parent)
    os.chmod(tmp, 0o755)                         # mkdtemp makes it 0700
    try:
        _write_model(tmp, size, seed)
        _write_tokenizer(tmp, SIZES[size]["max_position_embeddings"])
        with open(os.path.join(tmp, "kvlend_model.json"), "w") as f:
            json.dump({"size": size, "seed": seed, "vocab": VOCAB,
                       "initializer_range": INIT_RANGE[size], **SIZES[size]}, f)
        if os.path.exists(out):
            if not force and _complete(out):   # another process won the race
                return out
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old.", dir=parent)
            os.rename(out, os.path.join(old, "m"))
            shutil.rmtree(old)
        try:
            os.rename(tmp, out)
        except OSError:                          # lost a race between the check and here
            if not _complete(out):
                raise
        print(f"kvlend models: built {out} in {time.monotonic() - t:.1f}s", file=sys.stderr)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def model_dir(size: str, seed: int = 0, root: str | None = None) -> str:
    """Where ``ensure_model`` keeps a size: ``<root>/<family>-<size>-s<seed>``."""
    return os.path.join(root or default_root(), f"{FAMILY[size]}-{size}-s{seed}")


def ensure_model(size: str, root: str | None = None, seed: int = 0) -> str:
    """Path of the cached model (``model_dir``), built on first use."""
    return build(size, model_dir(size, seed, root), seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--out", help="model directory (default: <root>/<family>-<size>-s<seed>)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    a = ap.parse_args()
    out = a.out or model_dir(a.size, a.seed)
    print(build(a.size, out, a.seed, a.force))


if __name__ == "__main__":
    main()
