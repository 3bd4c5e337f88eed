"""The vLLM connector refuses, at start-up, a vLLM or a configuration it does not understand
(tensor parallel on either side it takes; a recurrent state only Mamba2's, without prefix caching or
speculative blocks).

Run in .venv-vllm (the connector imports vLLM), in a child interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvlend_vllm import launch
from tests.support.children import child_env

pytestmark = pytest.mark.system

PROBE = r"""
import json, os, sys
os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"  # as kvlend_vllm.launch starts engines
from types import SimpleNamespace as NS
import torch
import vllm
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvlend.errors import ConfigError
from kvlend_vllm.connector import cache_groups, check_vllm

def config(role="kv_consumer", tp=1, pp=1, dcp=1):
    return NS(parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp, decode_context_parallel_size=dcp),
              kv_transfer_config=NS(kv_role=role))

geometry = dict(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
full, swa = FullAttentionSpec(**geometry), SlidingWindowSpec(**geometry, sliding_window=256)
chunked = ChunkedLocalAttentionSpec(**geometry, attention_chunk_size=256)
f32 = torch.float32

def mamba(shapes=((544, 3), (8, 64, 16)), **kw):  # the tiny granite-4.0-h's, DS
    return MambaSpec(block_size=2048, shapes=shapes, dtypes=(f32,) * len(shapes), **kw)

granite = {"mamba_n_groups": 1}

def groups(*specs):
    return NS(kv_cache_groups=[NS(layer_names=[f"model.layers.{i}.attn"], kv_cache_spec=s)
                               for i, s in enumerate(specs)])

def refusal(fn, *args):
    try:
        fn(*args)
    except ConfigError as exc:
        return str(exc)
    return None

print(json.dumps({
    "installed": refusal(check_vllm, vllm.__version__, config("kv_producer")),
    "old": refusal(check_vllm, "0.31.4", config()),
    "next": refusal(check_vllm, "0.33.0", config()),
    "garbage": refusal(check_vllm, "main", config()),
    "pp": refusal(check_vllm, vllm.__version__, config(pp=2)),
    "dcp": refusal(check_vllm, vllm.__version__, config(dcp=2)),
    "producer_tp": refusal(check_vllm, vllm.__version__, config("kv_producer", tp=2)),
    "consumer_tp": refusal(check_vllm, vllm.__version__, config("kv_consumer", tp=4)),
    "mamba2": [[g.name, g.state is not None] for g, _ in cache_groups(groups(mamba(), full), granite)],
    "mamba1": refusal(cache_groups, groups(mamba(mamba_type=MambaAttentionBackendEnum.MAMBA1), full), granite),
    "align": refusal(cache_groups, groups(mamba(mamba_cache_mode="align"), full), granite),
    "speculative": refusal(cache_groups, groups(mamba(num_speculative_blocks=1), full), granite),
    "no_groups": refusal(cache_groups, groups(mamba(), full), {}),
    "gdn": refusal(cache_groups, groups(mamba(mamba_type=MambaAttentionBackendEnum.GDN_ATTN), full), {}),
    "short_conv": [[g.name, g.state is not None] for g, _ in cache_groups(
        groups(mamba(shapes=((256, 2),), mamba_type=MambaAttentionBackendEnum.SHORT_CONV), full), {})],
    "shapes": refusal(cache_groups, groups(mamba(shapes=((544, 3),)), full), granite),
    "groups": [[g.name, g.window, list(layers)] for g, layers in cache_groups(groups(full, swa))],
    "one_group": [[g.name, g.window] for g, _ in cache_groups(groups(full))],
    "chunked": refusal(cache_groups, groups(full, chunked)),
    "no_config": [[g.name, g.window] for g, _ in cache_groups(None)],
}))
"""


def test_the_connector_refuses_what_it_does_not_understand_before_the_workers_start():
    assert os.path.exists(launch.VLLM_VENV_PYTHON), "no .venv-vllm: scripts/test runs scripts/vllm-setup first"
    out = subprocess.run([launch.VLLM_VENV_PYTHON, "-c", PROBE], capture_output=True, text=True, timeout=180,
                         env=child_env())
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["installed"] is None  # what the tests run passes
    assert got["one_group"] == got["no_config"] == [["full", None]]
    assert got["groups"] == [["g0", None, ["model.layers.0.attn"]], ["g1", 256, ["model.layers.1.attn"]]]
    assert "group 1 (ChunkedLocalAttentionSpec" in got["chunked"] and "not full attention, a sliding window or " \
        "Mamba2 or short conv state" in got["chunked"]
    assert got["mamba2"] == [["g0", True], ["g1", False]]
    assert "holds MAMBA1 state; only Mamba2 and short conv (LFM2) state are supported" in got["mamba1"]
    assert "holds GDN_ATTN state" in got["gdn"]
    assert got["short_conv"] == [["g0", True], ["g1", False]]
    assert "mamba_cache_mode 'align'" in got["align"] and "--no-enable-prefix-caching" in got["align"]
    assert "1 speculative state blocks" in got["speculative"]
    assert "names no SSM group count" in got["no_groups"]
    assert "are not a Mamba2 conv state and SSM state" in got["shapes"]
    assert "supports vLLM 0.32.x, not '0.31.4'" in got["old"] and "'0.33.0'" in got["next"]
    assert "'main'" in got["garbage"]
    assert "pipeline parallel size must be 1, got 2" in got["pp"]
    assert "decode_context_parallel_size must be 1, got 2" in got["dcp"]
    assert got["producer_tp"] is None and got["consumer_tp"] is None


def test_the_connector_imports_without_nixl():
    """The connector finds its backend through the registry when it starts: importing it needs neither the
    NIXL plugin nor a NIXL build (``None`` in ``sys.modules`` makes their import fail)."""
    assert os.path.exists(launch.VLLM_VENV_PYTHON), "no .venv-vllm: scripts/test runs scripts/vllm-setup first"
    blocked = ("kvlend_nixl", "nixl", "nixl_cu13", "nixl_cu12")
    probe = f"import sys; sys.modules.update(dict.fromkeys({blocked!r})); import kvlend_vllm.connector"
    out = subprocess.run([launch.VLLM_VENV_PYTHON, "-c", probe], capture_output=True, text=True, timeout=180,
                         env=child_env())
    assert out.returncode == 0, out.stderr[-2000:]
