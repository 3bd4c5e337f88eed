"""A hybrid Mamba2 model's state lent across tensor-parallel degrees inside real vLLM servers: prefill
TP 1 -> decode TP 2 and prefill TP 2 -> decode TP 1, token for token against one plain server.

At TP 2 each worker holds 4 of the 8 Mamba heads, its x channels of the conv state, and the model's one
SSM group whole (B and C: vLLM repeats a single group on every rank).  The planner maps each part: a
TP 2 decode worker reads its x channels and SSM heads from the one prefill worker and B and C whole;
a TP 1 decode reads x and the SSM heads from both prefill workers and B and C from the first only.
Every state byte is read once, the page padding never.  The byte-level mapping is checked in process
against vLLM's own sharding in ``test_vllm_recurrent_units.py``.  float32, UCX over tcp.
"""

from __future__ import annotations

import os

import pytest

from kvlend_vllm import launch
from tests.support.vllm_rig import ensure_model, plain_answers
from tests.test_vllm_recurrent import BLOCK, PAGE, STATE, STATE_LAYERS, prompts
from tests.test_vllm_tp import run

pytestmark = pytest.mark.system

LENGTHS = [2, 3, 127, 129, 300, 700, 1000, 1500]
MAX_TOKENS = 6
STATE_TP2 = (288 * 3 + 4 * 64 * 16) * 4  # one worker's: x of 4 heads (256 channels), B and C (16 each); 4 SSM heads


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The prompts and a plain TP 1 server's greedy answers to them."""
    assert os.path.exists(launch.VLLM_VENV_PYTHON), "no .venv-vllm: scripts/test runs scripts/vllm-setup first"
    model = ensure_model("mamba")
    asked = prompts(27, LENGTHS)
    logs = str(tmp_path_factory.mktemp("vllm-recurrent-tp-plain"))
    return model, asked, plain_answers(model, asked, MAX_TOKENS, logs, dtype="float32", prefix_caching=False)


def run_pair(tmp_path, model, asked, prefill_tp: int, decode_tp: int) -> tuple[list[dict], list[dict]]:
    """Answers through router -> prefill (TP prefill_tp) -> kvlend -> decode (TP decode_tp), and the decode
    workers' stats lines (one per load and worker); prefix caching off (``test_vllm_tp.run``)."""
    ((got, lines),) = run(tmp_path, model, asked, prefill_tp, (decode_tp,), MAX_TOKENS, prefix_caching=False)
    return got, lines


def blocks(length: int) -> int:
    return -(-(length - 1) // BLOCK)  # the attention blocks of all but the last prompt token


def test_prefill_tp1_to_decode_tp2_each_worker_reads_its_heads_of_the_state_and_b_and_c_whole(tmp_path, plain):
    model, asked, expected = plain
    got, lines = run_pair(tmp_path, model, asked, 1, 2)
    assert [n for n, g, e in zip(LENGTHS, got, expected) if g != e] == []
    assert all(s["fetches"] == 1 and s["ok"] for s in lines) and len(lines) == 2 * len(LENGTHS), lines
    for rank in (0, 1):
        mine = [s for s in lines if s["tp_rank"] == rank]
        assert sorted(s["bytes"] for s in mine) == sorted(blocks(n) * PAGE // 2 + STATE_LAYERS * STATE_TP2
                                                          for n in LENGTHS), mine
        assert sorted(s["bound"] for s in mine) == sorted(n - 1 for n in LENGTHS), mine


def test_prefill_tp2_to_decode_tp1_the_decode_reads_both_workers_state_once(tmp_path, plain):
    model, asked, expected = plain
    got, lines = run_pair(tmp_path, model, asked, 2, 1)
    assert [n for n, g, e in zip(LENGTHS, got, expected) if g != e] == []
    assert len(lines) == len(LENGTHS) and all(s["ok"] and s["fetches"] == 2 for s in lines), lines
    # Two fetches per request make up whole blocks and whole states: B and C are read from one worker.
    assert sorted(s["bytes"] for s in lines) == sorted(blocks(n) * PAGE + STATE_LAYERS * STATE for n in LENGTHS)
    assert sorted(s["bound"] for s in lines) == sorted(n - 1 for n in LENGTHS)
