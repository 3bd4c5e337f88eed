"""The vLLM connector's pure parts: KV tensors as a PageLayout, the scheduler side's decisions, and
which certificate a worker loads.

vLLM itself is not imported (it lives in its own venv, ``scripts/vllm-setup``):
the layout is derived from real torch tensors shaped as vLLM registers them,
and the scheduler is fed objects with the attributes vLLM's ``Request`` has.
The real engines run in ``test_vllm.py``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvlend.core.layout import HeadGeometry, HeadOrder, PageLayout, Role, Sharding
from kvlend.core.negotiate import negotiate
from kvlend.core.pages import GroupPages
from kvlend.core.plan import plan_reads
from kvlend.errors import LayoutError, LayoutMismatch, UsageError
from kvlend.protocol.ticket import Ticket
from kvlend_vllm.bench import merge, parse_connector, shared_prompts, table
from kvlend_vllm.layout import CacheGroup, layout_from_kv_caches, model_digest, scope_of
from kvlend_vllm.pd_requests import push_requests
from kvlend_vllm.scheduler import (
    NULL_BLOCK,
    TICKET_KEY,
    ConsumerScheduler,
    Endpoint,
    ProducerScheduler,
    group_tables,
    parse_tickets,
    request_digest,
    share_lease,
    worker_tickets,
)

pytestmark = pytest.mark.unit

BS = 16


def cpu_caches(layers=2, blocks=8, heads=2, head=8, block_size=BS):
    flat = torch.zeros(layers * blocks * heads * block_size * 2 * head)
    per = blocks * heads * block_size * 2 * head
    return {f"model.layers.{i}.self_attn.attn": flat[i * per:(i + 1) * per].view(blocks, heads, block_size, 2 * head)
            for i in reversed(range(layers))}  # vLLM's dict order is not promised


def layout(caches, scope="s", block_size=BS) -> PageLayout:
    return layout_from_kv_caches(caches, block_size=block_size, dtype="float32", scope=scope)


def test_cpu_layout_is_one_head_major_page_per_block_and_layer_in_layer_order():
    caches = cpu_caches()
    lay = layout(caches)
    assert [r.name for r in lay.regions] == ["L0", "L1"]
    t0 = caches["model.layers.0.self_attn.attn"]
    r0 = lay.regions[0]
    assert (r0.address, r0.page_stride, r0.num_pages) == (t0.data_ptr(), t0.stride(0) * 4, 8)
    assert lay.regions[1].address == r0.address + r0.size  # back to back in one allocation
    heads = HeadGeometry(2, 2 * 8 * 4, HeadOrder.HND, Sharding.INDEXED)  # a cell: K and V of 8 float32 each
    assert all(b.identity.role is Role.HEAD_KV and b.geometry == heads for b in lay.buffers)
    assert lay.tokens_per_page == BS and lay.kept_window == 8 * BS
    plan = negotiate(layout(cpu_caches()), lay)
    assert plan.summary().startswith("identity plan")


def test_hybrid_allocator_layers_sharing_a_tensor_are_one_page_each_in_their_own_group():
    # vLLM's hybrid allocator: layer i of the windowed group and layer i of the full group share a tensor.
    shared = cpu_caches(layers=2)
    caches = {f"model.layers.{2 * i + j}.self_attn.attn": t
              for i, t in enumerate(shared[f"model.layers.{k}.self_attn.attn"] for k in range(2)) for j in range(2)}
    swa, full = CacheGroup("g0", 4 * BS), CacheGroup("g1")
    groups = {name: swa if layer % 2 == 0 else full
              for layer, name in ((int(n.split(".")[2]), n) for n in caches)}
    lay = layout_from_kv_caches(caches, block_size=BS, dtype="float32", scope="s", groups=groups)
    assert [(b.name, b.region, b.offset, b.group, b.window) for b in lay.buffers] == [
        ("L0.kv", "L0-L1", 0, "g0", 4 * BS), ("L1.kv", "L0-L1", 0, "g1", None),
        ("L2.kv", "L2-L3", 0, "g0", 4 * BS), ("L3.kv", "L2-L3", 0, "g1", None)]
    assert lay.groups["g0"].read_window == 4 * BS and lay.groups["g1"].read_window == lay.kept_window
    assert negotiate(layout_from_kv_caches(caches, block_size=BS, dtype="float32", scope="s", groups=groups),
                     lay).summary().startswith("identity plan")
    # A layer in no group that shares another's tensor reuses its cache (cross-layer KV sharing): folded.
    folded = layout_from_kv_caches(caches, block_size=BS, dtype="float32", scope="s",
                                   groups={n: g for n, g in groups.items() if ".3." not in n})
    assert [b.name for b in folded.buffers] == ["L0.kv", "L1.kv", "L2.kv"]
    with pytest.raises(LayoutError, match="model.layers.2.self_attn.attn.*in no KV cache group"):
        layout_from_kv_caches(caches, block_size=BS, dtype="float32", scope="s",
                              groups={n: g for n, g in groups.items() if ".2." not in n and ".3." not in n})


def test_group_tables_take_each_groups_blocks_and_refuse_a_window_vllm_already_freed():
    groups = (CacheGroup("g0", 2 * BS), CacheGroup("g1"))
    n = 5 * BS  # 5 blocks; the window reads rows 3 and 4
    assert group_tables(groups, ([NULL_BLOCK] * 3 + [8, 9, 10], [1, 2, 3, 4, 5, 6]), n, BS) == {
        "g0": (NULL_BLOCK,) * 3 + (8, 9), "g1": (1, 2, 3, 4, 5)}
    # One token less: the window starts one token back, in row 2, which vLLM freed (the null block).
    assert group_tables(groups, ([NULL_BLOCK] * 3 + [8, 9], [1, 2, 3, 4, 5]), n - 1, BS) is None
    assert group_tables(groups, ([8, 9], [1, 2, 3, 4, 5]), n, BS) is None  # too few blocks
    with pytest.raises(Exception, match="2 block tables for 1 KV cache groups"):
        group_tables(groups[:1], ([1], [2]), BS, BS)


def test_a_different_block_size_or_kernel_is_refused_by_scope():
    a = layout(cpu_caches(), scope=scope_of(platform="cpu", kernel="CPU_ATTN-AVX512", dtype="float32",
                                            block_size=BS, cache_layout="LBHNC", model="m"))
    b = layout(cpu_caches(), scope=scope_of(platform="cpu", kernel="CPU_ATTN-AVX2", dtype="float32",
                                            block_size=BS, cache_layout="LBHNC", model="m"))
    with pytest.raises(LayoutMismatch, match="scope"):
        negotiate(b, a)


def test_token_major_blocks_and_kernel_blocks_are_one_page_per_vllm_block():
    flat = torch.zeros(8, BS, 2, 16)  # LBNHC: [blocks, tokens, heads, content] in memory
    nhd = layout({"model.layers.0.attn": flat.permute(0, 2, 1, 3)})  # vLLM's view: [blocks, heads, tokens, content]
    (r,), (b,) = nhd.regions, nhd.buffers
    assert (r.address, r.page_stride, r.num_pages, b.page_bytes) == (flat.data_ptr(), BS * 2 * 16 * 4, 8, r.page_stride)
    assert b.geometry.order is HeadOrder.NHD
    halves = layout({"model.layers.0.attn": torch.zeros(16, 2, BS // 2, 16)})  # kernel blocks of BS/2 tokens
    assert (halves.regions[0].page_stride, halves.regions[0].num_pages) == (BS * 2 * 16 * 4, 8)
    assert halves.buffers[0].geometry is None  # its heads repeat per kernel block: it moves whole


# -------------------------------------------------------- tensor parallel
def filled(layers=2, blocks=8, heads=2, head=8, seed=0):
    """CPU caches whose every element differs (and differs by seed)."""
    caches = cpu_caches(layers, blocks, heads, head)
    for i, t in enumerate(caches.values()):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) + 1e5 * (i + 10 * seed))
    return caches


def tp_layout(caches, tp_size, tp_rank):
    return layout_from_kv_caches(caches, block_size=BS, dtype="float32", scope="s", tp_size=tp_size, tp_rank=tp_rank)


def move(plan, blocks: dict[int, int]) -> None:
    """Carry out ``plan`` for a lease of ``blocks`` (remote block -> local block), bytes by ctypes."""
    src = {"full": GroupPages(np.arange(len(blocks)), np.array(list(blocks)))}
    dst = {"full": np.array(list(blocks.values()))}
    for batch in plan_reads(plan, src, dst, plan.remote.full_selection()):
        for (r_addr, length, _), (l_addr, _, _) in zip(batch.remote.tolist(), batch.local.tolist()):
            ctypes.memmove(l_addr, r_addr, length)


@pytest.mark.parametrize("tp_prefill, tp_decode", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_each_decode_worker_gets_exactly_its_heads_of_every_block(tp_prefill, tp_decode):
    """Prefill and decode TP degrees differ: every decode worker's blocks end up holding its slice of the
    model's 4 KV heads, read through negotiated plans from the prefill worker(s) holding them, as vLLM's
    CPU kernel views them (a head's K rows, then its V rows)."""
    heads = 4
    prefill = [filled(heads=heads // tp_prefill, seed=s) for s in range(tp_prefill)]
    blocks = {1: 5, 2: 0, 6: 3}
    for rank in range(tp_decode):
        decode = cpu_caches(heads=heads // tp_decode)
        local = tp_layout(decode, tp_decode, rank)
        for source in range(tp_prefill):
            try:
                plan = negotiate(local, tp_layout(prefill[source], tp_prefill, source))
            except LayoutMismatch as exc:
                assert "replica.tp_rank" in str(exc)  # a prefill worker holding none of this rank's heads
                continue
            move(plan, blocks)
        for name, t in decode.items():
            whole = torch.cat([p[name] for p in prefill], dim=1)  # [blocks, all heads, tokens, content]
            mine = whole[:, rank * heads // tp_decode:(rank + 1) * heads // tp_decode]
            for remote, here in blocks.items():
                assert torch.equal(t[here], mine[remote]), (name, rank, remote)
                kernel = t.view(8, heads // tp_decode, BS * 2, -1).chunk(2, dim=2)  # cpu_attn.py's K/V split
                want = mine.reshape(8, heads // tp_decode, BS * 2, -1).chunk(2, dim=2)
                assert all(torch.equal(k[here], w[remote]) for k, w in zip(kernel, want))
            untouched = [b for b in range(8) if b not in blocks.values()]
            assert not t[untouched].any()


def test_a_vllm_block_is_never_split_by_tokens():
    """Whatever the scope says, a HEAD_KV page moves whole: the kernel orders a head's bytes (CPU: its K
    rows then its V rows), so a token range of it is not a run of bytes."""
    small = layout_from_kv_caches(cpu_caches(block_size=BS), block_size=BS, dtype="float32", scope="s")
    big = layout_from_kv_caches(cpu_caches(blocks=4, block_size=2 * BS), block_size=2 * BS, dtype="float32",
                                scope="s")
    with pytest.raises(LayoutMismatch, match="HEAD_KV page orders each head's bytes"):
        negotiate(small, big)


def test_a_tensor_parallel_mapping_vllm_cannot_slice_is_refused():
    nhd = {"model.layers.0.attn": torch.zeros(8, BS, 4, 16).permute(0, 2, 1, 3)}  # token-major: LBNHC
    half = {"model.layers.0.attn": torch.zeros(8, BS, 2, 16).permute(0, 2, 1, 3)}
    with pytest.raises(LayoutMismatch, match="contiguous only in HND"):
        negotiate(tp_layout(half, 2, 0), tp_layout(nhd, 1, 0))
    kernel_blocks = {"model.layers.0.attn": torch.zeros(16, 2, BS // 2, 16)}
    half_blocks = {"model.layers.0.attn": torch.zeros(16, 1, BS // 2, 16)}
    with pytest.raises(LayoutMismatch, match="no head geometry"):
        negotiate(tp_layout(half_blocks, 2, 0), tp_layout(kernel_blocks, 1, 0))


def test_block_outermost_layers_share_one_region_with_a_page_per_packed_block():
    packed = torch.zeros(6, 2, 2, BS, 16)  # BLHNC: [blocks, layers, heads, tokens, content]
    lay = layout({f"model.layers.{i}.attn": packed[:, i] for i in (1, 0)})
    (r,) = lay.regions
    page = 2 * BS * 16 * 4
    assert (r.name, r.address, r.page_stride, r.num_pages) == ("L0-L1", packed.data_ptr(), 2 * page, 6)
    assert [(b.name, b.region, b.offset, b.page_bytes) for b in lay.buffers] == [
        ("L0.kv", "L0-L1", 0, page), ("L1.kv", "L0-L1", page, page)]


def test_a_layer_sharing_another_layers_cache_moves_with_it():
    caches = cpu_caches()
    lay = layout({**caches, "model.layers.2.attn": caches["model.layers.0.self_attn.attn"]})
    assert [b.name for b in lay.buffers] == ["L0.kv", "L1.kv"]


@pytest.mark.parametrize("caches, match", [
    ({}, "no KV cache tensors"),
    ({"model.layers.0.attn": torch.zeros(8, 2, BS + 1, 16)}, "do not make up vLLM's blocks of 16"),
    ({"model.layers.0.attn": torch.zeros(2, 8, BS, 16).transpose(0, 1)}, "LHBNC"),  # heads outside blocks
    ({"model.layers.0.attn": torch.zeros(8 * 2 * BS * 16).as_strided((8, 2, BS, 16), (BS * 16, BS * 16, 16, 1))},
     "overlap"),
    ({"model.layers.0.attn": torch.zeros(2, 6, BS, 2, 8)}, "not vLLM's"),
    ({"model.layers.0.attn": torch.zeros(8, 2, BS, 16), "model.layers.1.attn": torch.zeros(4, 2, BS, 16)},
     "4 blocks, other layers have 8"),
    ({"lm_head": torch.zeros(8, 2, BS, 16)}, "no layer number"),
])
def test_tensors_kvlend_cannot_describe_exactly_are_refused(caches, match):
    with pytest.raises(LayoutError, match=match):
        layout(caches)


def test_model_digest_ignores_the_path_but_not_the_architecture():
    base = {"num_hidden_layers": 2, "num_key_value_heads": 2, "_name_or_path": "/a"}
    assert model_digest(base) == model_digest({**base, "_name_or_path": "/b"})
    assert model_digest(base) != model_digest({**base, "num_key_value_heads": 4})


# ------------------------------------------------------------------ scheduler
@dataclass
class Req:
    request_id: str = "r1"
    prompt_token_ids: list = field(default_factory=lambda: list(range(40)))
    num_computed_tokens: int = 40
    status: object = field(default_factory=lambda: SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
    kv_transfer_params: dict | None = field(default_factory=lambda: {"do_remote_decode": True})
    lora_request: object = None
    mm_features: list = field(default_factory=list)
    cache_salt: str | None = None


ENDPOINT = Endpoint("127.0.0.1", 5555, "prefill-a", "ab" * 32)


def producer(endpoints=(ENDPOINT,)) -> ProducerScheduler:
    s = ProducerScheduler(BS)
    s.set_endpoints(list(endpoints))
    return s


def test_producer_lends_a_finished_request_and_mints_its_ticket():
    s = producer()
    delay, params = s.request_finished(Req(), ([7, 3, 9, 11],))
    assert delay and params["do_remote_prefill"] and not params["do_remote_decode"]
    ticket = Ticket.from_text(params[TICKET_KEY])
    assert (ticket.host, ticket.port, ticket.prefill, ticket.num_tokens) == ("127.0.0.1", 5555, "prefill-a", 40)
    (lend,) = s.take_plan().lends
    # 40 tokens: 3 blocks
    assert (lend.request, lend.leases, lend.tables) == ("r1", (ticket.lease,), {"full": (7, 3, 9)})
    assert lend.digest == request_digest(Req(), 40)  # lent for this prompt alone
    assert s.holding == 1 and not s.take_plan().lends
    s.finished_sending({"r1"})
    assert s.holding == 0


def test_two_tickets_never_share_a_lease_id():
    s = producer()
    a = Ticket.from_text(s.request_finished(Req("a"), ([1, 2, 3],))[1][TICKET_KEY])
    b = Ticket.from_text(s.request_finished(Req("b"), ([4, 5, 6],))[1][TICKET_KEY])
    assert a.lease != b.lease


@pytest.mark.parametrize("req, blocks", [
    (Req(kv_transfer_params=None), [1, 2, 3]),
    (Req(kv_transfer_params={"do_remote_decode": False}), [1, 2, 3]),
    (Req(status=SimpleNamespace(name="FINISHED_ABORTED")), [1, 2, 3]),
    (Req(), []),
    (Req(prompt_token_ids=None), [1, 2, 3]),  # prompt embeddings: no token ids to bind a ticket to
    (Req(prompt_token_ids=list(range(39))), [1, 2, 3]),  # KV past the prompt: no decode would take it
])
def test_producer_frees_at_once_what_it_must_not_lend(req, blocks):
    s = producer()
    assert s.request_finished(req, (blocks,)) == (False, None)
    assert not s.take_plan().lends and s.holding == 0


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (1, 8), (3, 6)])
def test_tensor_parallel_tickets_give_each_decode_worker_every_prefill_worker_holding_its_heads(prefill_tp,
                                                                                              decode_tp):
    """One lease per prefill worker, whatever the decode's TP; decode worker r's share of the list names
    exactly the prefill ranks whose heads overlap r's (the negotiator's sources), and where several decode
    workers read one prefill worker each claims a share of its lease of its own."""
    endpoints = [Endpoint("127.0.0.1", 5555 + r, f"prefill-{r}", "ab" * 32) for r in range(prefill_tp)]
    s = producer(endpoints)
    params = s.request_finished(Req(), ([7, 3, 9],))[1]
    texts = params[TICKET_KEY]
    assert len(texts if isinstance(texts, list) else [texts]) == prefill_tp
    (lend,) = s.take_plan().lends
    texts = tuple(texts) if isinstance(texts, list) else (texts,)
    assert [Ticket.from_text(t).lease for t in texts] == list(lend.leases)
    parse_tickets(list(texts), decode_tp)  # what the decode checks
    claimed = []
    for rank in range(decode_tp):
        mine = [Ticket.from_text(t) for t in worker_tickets(texts, decode_tp, rank)]
        first, count = rank * prefill_tp // decode_tp, max(1, prefill_tp // decode_tp)
        assert [t.prefill for t in mine] == [f"prefill-{r}" for r in range(first, first + count)]
        readers = max(1, decode_tp // prefill_tp)
        for t in mine:  # the lease lent on that prefill worker, or this reader's share of it
            lease = lend.leases[int(t.prefill.split("-")[1])]
            assert t.lease == (lease if readers == 1 else share_lease(lease, rank % readers, readers))
            claimed.append(t.lease)
    assert len(set(claimed)) == len(claimed) == max(prefill_tp, decode_tp)  # no lease read twice


def test_a_ticket_list_that_does_not_fit_the_decodes_workers_is_computed_locally():
    endpoints = [Endpoint("127.0.0.1", 5555 + r, f"prefill-{r}", "ab" * 32) for r in range(2)]
    two = producer(endpoints).request_finished(Req(), ([7, 3, 9],))[1][TICKET_KEY]
    one = producer(endpoints[:1]).request_finished(Req(), ([7, 3, 9],))[1][TICKET_KEY]
    for texts, tp, match in ((two, 3, "cannot be shared by 3"), (one, 16, "at most 8 decode workers"),
                             ([one, one], 1, "named twice"), ([], 1, "a list of 1 to"),
                             (two * 40, 1, "a list of 1 to"), ([two[0], 5], 1, "a list")):
        with pytest.raises(UsageError, match=match):
            parse_tickets(texts, tp)
        s = ConsumerScheduler(BS, tp)
        assert s.get_num_new_matched_tokens(decode_req(texts), 0) == (0, False)


def test_producer_without_its_workers_endpoint_does_not_lend():
    assert ProducerScheduler(BS).request_finished(Req(), ([1, 2, 3],)) == (False, None)


def decode_req(ticket_text: str, prompt: int = 40, **kw) -> Req:
    return Req(prompt_token_ids=list(range(prompt)), num_computed_tokens=0,
               kv_transfer_params={"do_remote_prefill": True, TICKET_KEY: ticket_text}, **kw)


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def test_consumer_loads_a_ticket_once_into_the_blocks_vllm_allocated():
    text = Ticket(b"\x01" * 16, "127.0.0.1", 5555, "prefill-a", 40, "ab" * 32).to_text()
    s, req = ConsumerScheduler(BS), decode_req(text)
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)  # side-effect free
    s.update_state_after_alloc(req, Blocks([5, 4, 8, 2]), 40)
    (load,) = s.take_plan().loads
    assert (load.tickets, load.num_tokens, load.tables, load.resume_from) == ((text,), 40, {"full": (5, 4, 8)}, 0)
    assert load.digest == request_digest(req, 40)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # used: a reschedule recomputes
    s.update_state_after_alloc(req, Blocks([5, 4, 8, 2]), 0)
    assert not s.take_plan().loads
    s.request_finished(req)
    assert s.take_plan().cancels == ["r1"]
    s.finished_recving({"r1"})
    s.request_finished(req)
    assert not s.take_plan().cancels


def test_consumer_reads_only_the_blocks_its_prefix_cache_lacks():
    """vLLM's local prefix hit (whole blocks) is not read again: the load resumes after it.  vLLM sets
    request.num_computed_tokens only after update_state_after_alloc, so it cannot tell the hit."""
    text = Ticket(b"\x01" * 16, "127.0.0.1", 5555, "prefill-a", 40, "ab" * 32).to_text()
    s, req = ConsumerScheduler(BS), decode_req(text)
    hit = 2 * BS
    assert s.get_num_new_matched_tokens(req, hit) == (40 - hit, True)
    s.update_state_after_alloc(req, Blocks([5, 4, 8, 2]), 40 - hit)  # req.num_computed_tokens is still 0
    (load,) = s.take_plan().loads
    assert (load.tables, load.resume_from) == ({"full": (5, 4, 8)}, hit)


@pytest.mark.parametrize("params", [
    None, {}, {"do_remote_prefill": True}, {"do_remote_prefill": True, TICKET_KEY: "kvl1.!!"},
    {"do_remote_prefill": True, TICKET_KEY: 17},
    {"do_remote_prefill": True, TICKET_KEY: Ticket(b"\x01" * 16, "h", 1, "p", 39, "x").to_text()},  # not the prompt
])
def test_consumer_computes_locally_on_a_missing_bad_or_mismatched_ticket(params):
    s = ConsumerScheduler(BS)
    req = Req(num_computed_tokens=0, kv_transfer_params=params)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    assert not s.take_plan().loads


def test_consumer_claims_at_arrival_and_gives_back_what_it_will_not_load():
    text = Ticket(b"\x01" * 16, "127.0.0.1", 5555, "prefill-a", 40, "ab" * 32).to_text()
    s = ConsumerScheduler(BS)
    loaded, local, aborted = decode_req(text), decode_req(text, request_id="r2"), decode_req(text, request_id="r3")
    for req in (loaded, local, aborted):
        s.on_new_request(req)
    assert s.take_plan().claims == [((text,), request_digest(loaded, 40))] * 3
    s.update_state_after_alloc(loaded, Blocks([5, 4, 8]), 40)
    s.update_state_after_alloc(local, Blocks([1, 2, 3]), 0)  # a full local hit after all
    s.request_finished(aborted)  # aborted in the queue
    s.request_finished(loaded)  # finished while loading: a cancel, not an unclaim
    plan = s.take_plan()
    assert [load.request for load in plan.loads] == ["r1"]
    assert plan.unclaims == [(text,), (text,)] and plan.cancels == ["r1"]


def test_consumer_claims_nothing_for_a_request_without_a_usable_ticket():
    s = ConsumerScheduler(BS)
    s.on_new_request(Req(kv_transfer_params=None))
    s.on_new_request(Req(kv_transfer_params={"do_remote_prefill": True, TICKET_KEY: "kvl1.!!"}))
    assert not s.take_plan().claims


# ------------------------------------------------------------- request digests
def test_a_request_digest_is_its_prompt_and_whatever_else_its_kv_depends_on():
    """A ticket is bound to what made its KV: the prompt's token ids, the LoRA adapter, the multimodal
    inputs (their placeholders are the same token ids for any image) and the tenant's cache salt."""
    base = Req()
    image = SimpleNamespace(identifier="img-1", mm_position=SimpleNamespace(offset=4, length=8))
    variants = [
        Req(prompt_token_ids=list(range(1, 41))),
        Req(prompt_token_ids=list(range(40)) + [0]),  # more prompt than the 40 tokens lent: the 40 count
        Req(lora_request=SimpleNamespace(lora_name="adapter-a")),
        Req(mm_features=[image]),
        Req(mm_features=[SimpleNamespace(identifier="img-2", mm_position=image.mm_position)]),
        Req(mm_features=[SimpleNamespace(identifier="img-1", mm_position=SimpleNamespace(offset=5, length=8))]),
        Req(cache_salt="tenant-b"),
    ]
    digests = [request_digest(r, 40) for r in variants]
    assert digests[1] == request_digest(base, 40)
    del digests[1]
    assert request_digest(base, 40) not in digests and len(set(digests)) == len(digests)
    assert request_digest(base, 40) == request_digest(Req(request_id="other"), 40)  # content, not identity
    assert request_digest(Req(prompt_token_ids=None), 40) is None
    assert request_digest(Req(prompt_token_ids=list(range(39))), 40) is None


def test_a_ticket_on_another_prompt_of_its_length_is_claimed_with_that_prompts_digest():
    """The prefill, not the decode, decides: the decode claims with its own request's digest, so a
    ticket copied onto another prompt is refused (and the request computed locally)."""
    p = producer()
    params = p.request_finished(Req(), ([7, 3, 9],))[1]
    (lend,) = p.take_plan().lends
    s = ConsumerScheduler(BS)
    own, thief = decode_req(params[TICKET_KEY]), decode_req(params[TICKET_KEY], request_id="r2")
    thief.prompt_token_ids = [t + 1 for t in thief.prompt_token_ids]
    for req in (own, thief):
        s.on_new_request(req)
        s.update_state_after_alloc(req, Blocks([1, 2, 3]), 40)
    plan = s.take_plan()
    assert [digest for _, digest in plan.claims] == [load.digest for load in plan.loads]
    assert [load.digest == lend.digest for load in plan.loads] == [True, False]


# ------------------------------------------------------------------ the bench
def test_bench_shared_prefix_prompts_share_exactly_their_prefix():
    prompts = shared_prompts(4, 2048, 90)
    assert {len(p) for p in prompts} == {2048}
    assert len({tuple(p[:1843]) for p in prompts}) == 1  # 90 % of 2048, rounded down
    assert len({tuple(p[1843:]) for p in prompts}) == 4  # and each its own after it
    assert len({tuple(p[:8]) for p in shared_prompts(4, 2048, 0)}) == 4


def test_bench_compares_every_baseline_it_ran_with_kvlend():
    def run(connector, ttft):
        return {"connector": connector, "row": "r", "requests": 1, "errors": 0, "ttft_s": [ttft],
                "decode_leg_s": [ttft / 2], "kv_transfers": 1, "kv_xfer_s": 0.1, "kv_read_s": 0.05,
                "kv_bytes": 2**20, "kv_descriptors": 4, "kv_failed": 0, "wall_s": 1.0}
    merged = merge([run("kvlend", 0.1), run("nixl:1", 0.5), run("nixl:4", 0.3)])
    assert [m["descriptors_per_request"] for m in merged] == [4.0, 4.0, 4.0]
    lines = table(merged).splitlines()
    assert [line.split(" | ")[1] for line in lines[2:]] == ["kvlend", "nixl:1", "nixl:4", "nixl:1/kvlend",
                                                            "nixl:4/kvlend"]
    assert lines[-1].split(" | ")[2] == "3.00x"
    both = table(merge([run("kvlend", 0.2), run("kvlend-progressive", 0.1), run("mooncake", 0.3)])).splitlines()
    assert [line.split(" | ")[1:3] for line in both[5:]] == [
        ["mooncake/kvlend", "1.50x"], ["mooncake/kvlend-progressive", "3.00x"], ["kvlend/kvlend-progressive", "2.00x"]]
    assert parse_connector("kvlend-progressive") == ("kvlend-progressive", None)
    assert parse_connector("nixl:2") == ("nixl", 2) and parse_connector("kvlend") == ("kvlend", None)
    assert parse_connector("nixl-push:1") == ("nixl-push", 1) and parse_connector("mooncake") == ("mooncake", None)
    for bad in ("nixl:0", "kvlend:2", "mooncake:2", "nixl:x", "sglang"):
        with pytest.raises(ValueError):
            parse_connector(bad)


def test_push_mode_sends_prefill_and_decode_one_transfer_id_and_the_decode_only_the_prefills_coordinates():
    client = {"prompt": [5, 6, 7], "max_tokens": 9, "stream": True, "kv_transfer_params": {"kvlend_ticket": "x"}}
    coordinates = {"remote_engine_id": "p", "remote_host": "127.0.0.1", "remote_port": 5600}
    p_body, d_body = push_requests(client, coordinates, "rid-1")
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                            "transfer_id": "rid-1"}
    assert d_body["max_tokens"] == 9 and d_body["stream"] is True
    assert d_body["kv_transfer_params"] == {**coordinates, "do_remote_prefill": True, "do_remote_decode": False,
                                            "transfer_id": "rid-1", "remote_request_id": "rid-1"}
