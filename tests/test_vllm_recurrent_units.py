"""The vLLM connector's pure parts for recurrent (Mamba2) models: state blocks as a PageLayout, their
tensor-parallel mapping checked byte for byte against vLLM's own sharding, and the N - 1 rule.

vLLM is not imported: tensors are shaped as vLLM 0.32 registers a hybrid model's caches (a Mamba
layer's ``[blocks, 1, 1, state bytes]`` int8 view on the storage its attention layers use, pages
padded to the attention page), and the scheduler is fed objects with the attributes of vLLM's
``Request``.  The real engines run in ``test_vllm_recurrent.py``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvlend.core.layout import LayerKind, Role, Sharding
from kvlend.core.negotiate import negotiate
from kvlend.core.pages import GroupPages
from kvlend.core.plan import plan_reads
from kvlend.errors import LayoutError, LayoutMismatch
from kvlend.protocol.ticket import Ticket
from kvlend_vllm.layout import CacheGroup, StateShape, layout_from_kv_caches, scope_of, state_scope
from kvlend_vllm.scheduler import (
    HELD_BACK_KEY,
    LEASES_KEY,
    PROGRESSIVE_KEY,
    TICKET_KEY,
    ConsumerScheduler,
    Endpoint,
    ProducerScheduler,
    group_tables,
    hold_back_last_token,
    padded_tables,
    request_digest,
)
from tests.test_vllm_units import Req as BaseReq

pytestmark = pytest.mark.unit

BS = 16  # tokens per attention block
BLOCKS = 6
# The tiny granite-4.0-h model of the system tests: 8 Mamba heads of 64, one SSM group, d_state 16,
# a 4-wide conv (3 rows kept), float32.
HEADS, HEAD_DIM, GROUPS, D_STATE, ROWS = 8, 64, 1, 16, 3
PAGE, HEAD = 131072, 8  # the attention block's bytes at TP 1 (the state padded to it); a head's K and V


def state(tp: int, conv_first: bool = True, groups: int = GROUPS) -> StateShape:
    """What vLLM's MambaSpec says of one rank's state block (``MambaStateShapeCalculator``): B and C
    hold every group once per rank when one group cannot be split."""
    local_groups = (groups + (0 if groups % tp == 0 else tp - groups)) // tp
    channels = HEADS * HEAD_DIM // tp + 2 * local_groups * D_STATE
    conv = (channels, ROWS) if conv_first else (ROWS, channels)
    return StateShape(conv, (HEADS // tp, HEAD_DIM, D_STATE), 4, 4, conv_first, groups, ("float32", "float32"))


def caches(shape: StateShape, tp: int = 1):
    """One tensor shared by a Mamba layer (0, group s) and an attention layer (1, group a), as vLLM's
    hybrid allocator lays them out: pages of the attention block's size, the state padded to it."""
    page = PAGE // tp
    assert page >= shape.nbytes
    flat = torch.zeros(BLOCKS * page, dtype=torch.int8)
    attention = flat.view(torch.float32).view(BLOCKS, page // (BS * 2 * HEAD * 4), BS, 2 * HEAD)
    mamba = torch.as_strided(flat, (BLOCKS, 1, 1, shape.nbytes), (page, page, page, 1))
    groups = {"model.layers.0.mixer": CacheGroup("s", state=shape), "model.layers.1.self_attn.attn": CacheGroup("a")}
    return {"model.layers.0.mixer": mamba, "model.layers.1.self_attn.attn": attention}, groups, flat


def layout_of(shape: StateShape, tp: int = 1, rank: int = 0, scope: str = "s"):
    kv, groups, flat = caches(shape, tp)
    lay = layout_from_kv_caches(kv, block_size=BS, dtype="float32", scope=scope, tp_size=tp, tp_rank=rank,
                                groups=groups)
    return lay, flat


def test_a_mamba2_state_block_is_its_conv_parts_and_ssm_state_and_never_its_padding():
    shape = state(1)
    lay, _ = layout_of(shape)
    row = ROWS * 4
    x, b = HEADS * HEAD_DIM, GROUPS * D_STATE
    assert [(buf.name, buf.offset, buf.page_bytes, buf.identity.role, buf.group) for buf in lay.buffers] == [
        ("L0.conv_x", 0, x * row, Role.CONV, "s"),
        ("L0.conv_b", x * row, b * row, Role.CONV_B, "s"),
        ("L0.conv_c", (x + b) * row, b * row, Role.CONV_C, "s"),
        ("L0.ssm", (x + 2 * b) * row, HEADS * HEAD_DIM * D_STATE * 4, Role.STATE, "s"),
        ("L1.kv", 0, PAGE, Role.HEAD_KV, "a")]
    state_bytes = sum(buf.page_bytes for buf in lay.buffers[:4])
    assert state_bytes == shape.nbytes < lay.regions[0].page_stride  # the padding is in no buffer
    assert lay.groups["s"].kind is LayerKind.RECURRENT and lay.groups["a"].kind is LayerKind.ATTENTION
    assert lay.buffers[1].geometry.sharding is Sharding.REPLICATED  # one SSM group: every rank holds it whole
    assert lay.buffers[0].geometry.heads == HEADS and lay.buffers[3].geometry.heads == HEADS


def test_a_token_major_conv_state_moves_whole_and_cannot_be_split_by_tensor_parallelism():
    lay, _ = layout_of(state(1, conv_first=False))
    assert [(b.name, b.geometry) for b in lay.buffers[:1]] == [("L0.conv", None)]
    with pytest.raises(LayoutMismatch, match=r"buffer\(0,CONV\)\.geometry"):
        negotiate(layout_of(state(2, conv_first=False), 2, 1)[0], lay)


def test_engines_storing_state_differently_are_refused_naming_the_difference():
    ds = scope_of(platform="cpu", kernel="k", dtype="float32", block_size=BS, cache_layout="d", model="m",
                  state=state_scope(state(1)))
    sd = scope_of(platform="cpu", kernel="k", dtype="float32", block_size=BS, cache_layout="d", model="m",
                  state=state_scope(state(1, conv_first=False)))
    with pytest.raises(LayoutMismatch, match="state-DS-float32-float32' vs 'state-SD-float32-float32"):
        negotiate(layout_of(state(1), scope=ds)[0], layout_of(state(1), scope=sd)[0])


def test_shapes_that_are_not_a_mamba2_state_are_refused():
    with pytest.raises(LayoutError, match="conv channels are not"):
        StateShape((HEADS * HEAD_DIM + 7, ROWS), (HEADS, HEAD_DIM, D_STATE), 4, 4, True, 1).channels()
    shape = state(1)
    kv, groups, flat = caches(shape)
    kv["model.layers.0.mixer"] = flat[:BLOCKS * 100].view(BLOCKS, 1, 1, 100)  # smaller than the state
    with pytest.raises(LayoutError, match="is not a Mamba2 state block"):
        layout_from_kv_caches(kv, block_size=BS, dtype="float32", scope="s", groups=groups)


def fill_as_vllm(flat: torch.Tensor, lay, block: int, tp: int, rank: int, groups: int = GROUPS) -> None:
    """Write rank ``rank``'s share of one request's state into ``block`` as vLLM shards it: every value
    names its global place (conv channel and row, SSM head and cell), so a byte in the wrong place shows."""
    heads, x = HEADS // tp, HEADS * HEAD_DIM // tp
    split = groups % tp == 0
    local_groups = groups // tp if split else 1
    b = local_groups * D_STATE
    x_channels = np.arange(rank * x, (rank + 1) * x)
    first_group = rank * local_groups if split else 0  # one group: each rank holds group 0
    b_channels = HEADS * HEAD_DIM + np.arange(first_group * D_STATE, first_group * D_STATE + b)
    c_channels = b_channels + groups * D_STATE
    channels = np.concatenate([x_channels, b_channels, c_channels])
    conv = (channels[:, None] * 10 + np.arange(ROWS)[None, :]).astype(np.float32)  # DS: (channels, rows)
    ssm = np.arange(rank * heads * HEAD_DIM * D_STATE, (rank + 1) * heads * HEAD_DIM * D_STATE,
                    dtype=np.float32) + 1e6
    page = lay.regions[0].page_stride
    start = block * page
    data = np.concatenate([conv.ravel(), ssm]).view(np.int8)
    flat[start:start + data.size] = torch.from_numpy(data.copy())


def copy_plan(plan, src_block: int, dst_block: int) -> int:
    """Carry out a plan's reads of one request's state byte for byte (by ctypes, as NIXL would); bytes moved."""
    src = {g: GroupPages(np.zeros(1, dtype=np.int64), np.array([src_block])) for g in plan.group_map
           if plan.remote.groups[g].recurrent}
    dst = {plan.group_map[g]: np.array([dst_block]) for g in src}
    moved = 0
    for batch in plan_reads(plan, src, dst, plan.remote.full_selection()):
        for (r_addr, length, _), (l_addr, _, _) in zip(batch.remote.tolist(), batch.local.tolist()):
            ctypes.memmove(l_addr, r_addr, length)
            moved += length
    return moved


@pytest.mark.parametrize("prefill_tp, decode_tp, groups", [(1, 2, 1), (2, 1, 1), (1, 2, 2), (2, 1, 2),
                                                           (2, 4, 4), (1, 1, 1)])
def test_tensor_parallel_ranks_read_exactly_their_x_b_c_and_ssm_heads(prefill_tp, decode_tp, groups):
    """The planner's pieces, carried out on bytes laid out as vLLM shards them, give each decode rank
    the state vLLM itself would hold there: x and the SSM state by heads, B and C by groups (or whole,
    from one prefill rank, when the model has a single group)."""
    p_shape, d_shape = state(prefill_tp, groups=groups), state(decode_tp, groups=groups)
    prefills = [layout_of(p_shape, prefill_tp, r) for r in range(prefill_tp)]
    for p_rank, (lay, flat) in enumerate(prefills):
        fill_as_vllm(flat, lay, 2, prefill_tp, p_rank, groups)
    for d_rank in range(decode_tp):
        mine, flat = layout_of(d_shape, decode_tp, d_rank)
        expect, expect_flat = layout_of(d_shape, decode_tp, d_rank)
        fill_as_vllm(expect_flat, expect, 4, decode_tp, d_rank, groups)
        moved = 0
        for lay, _ in prefills:
            try:
                plan = negotiate(mine, lay)
            except LayoutMismatch as exc:  # a prefill rank holding none of this decode rank's heads
                assert "reads only prefill ranks" in str(exc)
                continue
            moved += copy_plan(plan, 2, 4)
        page = mine.regions[0].page_stride
        assert moved == d_shape.nbytes  # each state byte read once, the padding never
        assert torch.equal(flat[4 * page:4 * page + d_shape.nbytes], expect_flat[4 * page:4 * page + d_shape.nbytes])


def short_conv(tp: int) -> StateShape:
    """An LFM2 layer's state block per rank: 256 conv channels split evenly, 3 rows each (DS)."""
    return StateShape((256 // tp, ROWS), None, 4, 0, True, 0)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1), (1, 1), (2, 4)])
def test_a_short_conv_state_is_its_channels_and_each_rank_reads_its_own(prefill_tp, decode_tp):
    lay, _ = layout_of(short_conv(1))
    assert [(b.name, b.offset, b.page_bytes, b.identity.role, b.geometry.heads) for b in lay.buffers[:1]] == [
        ("L0.conv", 0, 256 * ROWS * 4, Role.CONV, 256)]
    page = PAGE

    def fill(flat, tp: int, rank: int, block: int) -> None:
        channels = np.arange(rank * 256 // tp, (rank + 1) * 256 // tp)
        data = (channels[:, None] * 10 + np.arange(ROWS)[None, :]).astype(np.float32).view(np.int8).ravel()
        flat[block * (page // tp):block * (page // tp) + data.size] = torch.from_numpy(data.copy())

    prefills = [layout_of(short_conv(prefill_tp), prefill_tp, r) for r in range(prefill_tp)]
    for r, (_, flat) in enumerate(prefills):
        fill(flat, prefill_tp, r, 2)
    for d_rank in range(decode_tp):
        mine, flat = layout_of(short_conv(decode_tp), decode_tp, d_rank)
        moved = 0
        for p_lay, _ in prefills:
            try:
                moved += copy_plan(negotiate(mine, p_lay), 2, 4)
            except LayoutMismatch as exc:
                assert "reads only prefill ranks" in str(exc)
        expect = torch.zeros_like(flat)
        fill(expect, decode_tp, d_rank, 4)
        assert moved == short_conv(decode_tp).nbytes and torch.equal(flat, expect)


# ------------------------------------------------------------------ scheduler
@dataclass
class Req(BaseReq):
    """vLLM's ``Request`` as the recurrent prefill's cut sees it: its token lists, counts and ``max_tokens``."""

    num_computed_tokens: int = 39
    max_tokens: int = 16
    skip_reading: bool = False

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids or ())
        self.num_prompt_tokens = len(self._all_token_ids)

    def get_skip_reading_prefix_cache(self) -> bool:
        return self.skip_reading


GROUPS_OF = (CacheGroup("g0", state=state(1)), CacheGroup("g1"))
ENDPOINT = Endpoint("127.0.0.1", 5555, "prefill-a", "ab" * 32)


def producer() -> ProducerScheduler:
    s = ProducerScheduler(BS, GROUPS_OF)
    s.set_endpoints([ENDPOINT])
    return s


def test_a_recurrent_prefill_computes_all_but_the_last_token_and_lends_them_with_the_state_block():
    s, req = producer(), Req()
    s.on_new_request(req)
    assert req.prompt_token_ids == list(range(39)) and req._all_token_ids == list(range(39))
    assert (req.num_prompt_tokens, req.max_tokens, req.kv_transfer_params[HELD_BACK_KEY]) == (39, 1, True)
    s.on_new_request(req)  # once only, even if vLLM hands the request over again (a preemption)
    assert req.num_prompt_tokens == 39
    delay, params = s.request_finished(req, ([7], [3, 9, 11, 12]))
    assert delay and Ticket.from_text(params[TICKET_KEY]).num_tokens == 39
    (lend,) = s.take_plan().lends
    assert (lend.num_tokens, lend.tables) == (39, {"g0": (7,), "g1": (3, 9, 11)})
    assert lend.digest == request_digest(Req(), 39)  # the decode's first 39 tokens


@pytest.mark.parametrize("req", [Req(prompt_token_ids=[5], num_computed_tokens=1),
                                 Req(skip_reading=True, num_computed_tokens=40)])
def test_a_recurrent_request_that_cannot_lose_its_last_token_is_computed_by_its_decode(req):
    s = producer()
    s.on_new_request(req)
    assert HELD_BACK_KEY not in req.kv_transfer_params
    assert s.request_finished(req, ([7], [3, 9, 11])) == (False, None)
    assert not s.take_plan().lends


def test_a_progressive_recurrent_lend_holds_the_state_block_and_covers_all_but_the_last_token():
    s = producer()
    req = Req(kv_transfer_params={"do_remote_decode": True, LEASES_KEY: ["01" * 16]}, num_computed_tokens=16)
    s.on_new_request(req)
    (lend,) = s.take_plan(block_ids_of=lambda rid: ([7], [3])).lends
    assert (lend.num_tokens, lend.ready, lend.tables) == (39, 16, {"g0": (7,), "g1": (3, -1, -1)})
    one = Req("r2", prompt_token_ids=[5], kv_transfer_params={"do_remote_decode": True, LEASES_KEY: ["02" * 16]})
    s.on_new_request(one)
    assert s.request_finished(one, ([8], [4])) == (False, None)  # never lent: its decode computes it


def test_state_groups_take_their_one_block_and_refuse_a_missing_one():
    assert group_tables(GROUPS_OF, ([7], [3, 9, 11]), 33, BS) == {"g0": (7,), "g1": (3, 9, 11)}
    assert group_tables(GROUPS_OF, ([0], [3, 9, 11]), 33, BS) is None  # the null block: no state
    assert group_tables(GROUPS_OF, ([], [3, 9, 11]), 33, BS) is None
    assert padded_tables(GROUPS_OF, ([], [3]), 33, BS) == {"g0": (-1,), "g1": (3, -1, -1)}


class Blocks:
    def __init__(self, *ids):
        self.ids = ids

    def get_block_ids(self):
        return self.ids


def decode_req(tokens: int, prompt: int = 40, **params) -> Req:
    text = Ticket(b"\x01" * 16, "127.0.0.1", 5555, "prefill-a", tokens, "ab" * 32).to_text()
    return Req(prompt_token_ids=list(range(prompt)), num_computed_tokens=0,
               kv_transfer_params={"do_remote_prefill": True, TICKET_KEY: text, **params})


def test_a_recurrent_decode_loads_all_but_the_last_token_and_computes_that_one_itself():
    s, req = ConsumerScheduler(BS, 1, GROUPS_OF), decode_req(39)
    assert s.get_num_new_matched_tokens(req, 0) == (39, True)
    s.update_state_after_alloc(req, Blocks([6], [5, 4, 8]), 39)
    (load,) = s.take_plan().loads
    assert (load.num_tokens, load.tables) == (39, {"g0": (6,), "g1": (5, 4, 8)})
    # A ticket for the whole prompt would apply its last token twice; a one-token prompt has nothing lent.
    assert s.get_num_new_matched_tokens(decode_req(40), 0) == (0, False)
    assert s.get_num_new_matched_tokens(decode_req(1, prompt=1), 0) == (0, False)
    assert s.get_num_new_matched_tokens(decode_req(1, prompt=1, **{PROGRESSIVE_KEY: True}), 0) == (0, False)
    # A progressive ticket's count is the decode's to say: all but the last prompt token.
    assert s.get_num_new_matched_tokens(decode_req(7, **{PROGRESSIVE_KEY: True}), 0) == (39, True)
    # An attention-only decode never takes a recurrent prefill's N - 1.
    assert ConsumerScheduler(BS).get_num_new_matched_tokens(decode_req(39), 0) == (0, False)


def test_hold_back_is_idempotent_and_leaves_a_one_token_prompt_whole():
    req = Req(prompt_token_ids=[1, 2])
    assert hold_back_last_token(req) and hold_back_last_token(req)
    assert req.prompt_token_ids == [1] and req.num_prompt_tokens == 1
    single = Req(prompt_token_ids=[1])
    assert not hold_back_last_token(single) and single.prompt_token_ids == [1]
