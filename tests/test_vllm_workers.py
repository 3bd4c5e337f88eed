"""The connector's worker sides over real NIXL agents, driven as vLLM drives them, without vLLM.

A ``ProducerWorker`` and a ``ConsumerWorker`` in one process, each over torch
tensors shaped like vLLM's CPU KV cache, fed the plans the real scheduler
sides build and polled the way vLLM's steps poll them (``start`` then
``finished_*`` once per step).  ``test_vllm.py`` runs the same code inside
real engines; this covers the paths an engine run rarely hits: a cancelled
load, a lend refused, a prefill gone before the claim.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import kvlend.protocol.wire
from kvlend.protocol.config import NodeConfig
from kvlend.protocol.ticket import Ticket
from kvlend.security.certs import Authority
from kvlend_vllm.layout import layout_from_kv_caches
from kvlend_vllm.scheduler import (
    LEASES_KEY,
    PROGRESSIVE_KEY,
    TICKET_KEY,
    ConsumerScheduler,
    ProducerScheduler,
)
from kvlend_vllm.worker import ConsumerWorker, ProducerWorker, WorkerSettings
from tests.support.certs import creds
from tests.support.nodes import wait_until

pytestmark = pytest.mark.nixl

BS, BLOCKS, HEADS, HEAD = 16, 32, 2, 8
CONFIG = NodeConfig(ttl=5.0, heartbeat=0.5, claim_wait=2.0, transfer_timeout=5.0)


def caches(numbered: bool):
    """Two layers of vLLM-CPU-shaped KV: every element distinct (a prefill's), or zeros (a decode's)."""
    flat = torch.zeros(2 * BLOCKS * HEADS * BS * 2 * HEAD)
    if numbered:
        flat.copy_(torch.arange(flat.numel(), dtype=torch.float32))
    per = flat.numel() // 2
    return {f"model.layers.{i}.self_attn.attn": flat[i * per:(i + 1) * per].view(BLOCKS, HEADS, BS, 2 * HEAD)
            for i in range(2)}


class Stats:
    def __init__(self):
        self.ok, self.failed = [], []

    def record(self, *, seconds, read_seconds, nbytes, descriptors, local_blocks=0):
        assert 0 < descriptors <= nbytes
        self.ok.append(nbytes)

    def record_failure(self, blocks):
        self.failed.append(blocks)


class Req(SimpleNamespace):
    pass


@pytest.fixture
def pair():
    yield from make_pair(CONFIG)


@pytest.fixture
def short():
    """Leases of one second, kept alive by heartbeats every 0.2 s."""
    yield from make_pair(NodeConfig(ttl=1.0, heartbeat=0.2, claim_wait=0.5, transfer_timeout=5.0))


@pytest.fixture
def stranger(tmp_path):
    """A decode whose certificate is from another cluster's CA, writing its per-fetch lines."""
    yield from make_pair(CONFIG, WorkerSettings(Authority.create().issue("d", "decode"), config=CONFIG,
                                                stats_path=str(tmp_path / "fetches.jsonl")))


def make_pair(config: NodeConfig, decode: WorkerSettings | None = None):
    src, dst = caches(True), caches(False)
    scope = "test/cpu/bs16"
    producer = ProducerWorker(WorkerSettings(creds("p", "prefill"), config=config))
    consumer = ConsumerWorker(decode or WorkerSettings(creds("d", "decode"), config=config), BS, Stats())
    p_sched, d_sched = ProducerScheduler(BS), ConsumerScheduler(BS)
    p_sched.set_endpoints([producer.register(layout_from_kv_caches(src, block_size=BS, dtype="float32",
                                                                   scope=scope))])
    consumer.register(layout_from_kv_caches(dst, block_size=BS, dtype="float32", scope=scope))
    yield SimpleNamespace(src=src, dst=dst, producer=producer, consumer=consumer, p=p_sched, d=d_sched)
    consumer.close()
    producer.close()


def lend(pair, rid: str, num_tokens: int, blocks: list[int]) -> dict:
    req = Req(request_id=rid, prompt_token_ids=list(range(num_tokens)), num_computed_tokens=num_tokens,
              status=SimpleNamespace(name="FINISHED_STOPPED"), kv_transfer_params={"do_remote_decode": True})
    delay, params = pair.p.request_finished(req, (blocks,))
    assert delay
    return params


def arrive(rid: str, params: dict, num_tokens: int, first: int = 0) -> Req:
    """A decode request for the prompt ``first, first + 1, ...`` (``lend``'s prompt when ``first`` is 0)."""
    return Req(request_id=rid, prompt_token_ids=list(range(first, first + num_tokens)), num_computed_tokens=0,
               kv_transfer_params=dict(params))


def load(pair, rid: str, params: dict, num_tokens: int, blocks: list[int], req: Req | None = None) -> None:
    req = req or arrive(rid, params, num_tokens)
    assert pair.d.get_num_new_matched_tokens(req, 0) == (num_tokens, True)
    pair.d.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), num_tokens)


def steps(pair, until, timeout: float = 10.0, finished: frozenset = frozenset()):
    """Run engine steps until ``until(recved, sent)`` holds; what each side reported."""
    recved, sent = set(), set()
    deadline = time.monotonic() + timeout
    while not until(recved, sent):
        assert time.monotonic() < deadline, (recved, sent)
        pair.producer.start(pair.p.take_plan())
        pair.consumer.start(pair.d.take_plan())
        recved |= pair.consumer.finished_recving()
        sent |= pair.producer.finished_sending(set(finished))
        time.sleep(0.005)
    return recved, sent


def lease_over(producer, request: str, timeout: float = 10.0) -> None:
    """Block until every lease of ``request`` ended on the prefill (its done ack was handled, say)."""
    with producer._lock:
        assert producer._lock.wait_for(lambda: request in producer._ended, timeout), request


def lease_endings(producer) -> list[str]:
    """The reasons the prefill node gives as each of its leases ends, from now on."""
    reasons, release = [], producer.node.on_release
    producer.node.on_release = lambda lease, reason: (reasons.append(reason), release(lease, reason))
    return reasons


def same_blocks(pair, src_blocks, dst_blocks) -> bool:
    return all(torch.equal(s[src_blocks], d[dst_blocks]) for s, d in zip(pair.src.values(), pair.dst.values()))


def test_a_lent_request_lands_in_the_decode_blocks_and_both_sides_report_it(pair):
    params = lend(pair, "r1", 40, [5, 2, 9])
    load(pair, "d1", params, 40, [7, 1, 30])
    recved, sent = steps(pair, lambda r, s: "d1" in r and "r1" in s, finished=frozenset({"r1"}))
    assert same_blocks(pair, [5, 2, 9], [7, 1, 30])
    assert not pair.consumer.load_errors()
    assert float(pair.dst["model.layers.0.self_attn.attn"][[0, 3]].abs().sum()) == 0  # nothing else written
    assert pair.p.holding == 1  # the scheduler frees on vLLM's update_connector_output
    pair.p.finished_sending(sent)
    assert pair.p.holding == 0


def test_the_ticket_names_the_prefill_workers_certificate_identity(pair):
    assert Ticket.from_text(lend(pair, "r1", 20, [3, 4])[TICKET_KEY]).prefill == "p" == pair.producer.node.name


def test_a_decode_from_another_ca_gets_no_kv_and_every_block_is_recomputed(stranger):
    params = lend(stranger, "r1", 40, [5, 2, 9])
    load(stranger, "d1", params, 40, [7, 1, 30])
    steps(stranger, lambda r, s: "d1" in r)
    assert stranger.consumer.load_errors() == {7, 1, 30}
    assert stranger.consumer.stats.failed == [3] and not stranger.consumer.stats.ok
    assert all(float(t.abs().sum()) == 0 for t in stranger.dst.values())  # nothing landed
    with open(stranger.consumer.settings.stats_path) as f:
        (line,) = [json.loads(text) for text in f]
    assert line["error"] == "AuthError" and line["bytes"] == 0


def test_each_loop_thread_runs_ahead_of_the_engine_where_the_host_allows_it(pair):
    """A shared-memory read is copied on the node's loop thread: it should not queue behind vLLM's
    busy processes (``KVLEND_LOOP_NICE``, -10 by default; without CAP_SYS_NICE it stays at 0)."""
    probe = threading.Thread(target=threading.Event().wait, args=(5.0,), daemon=True)
    probe.start()
    try:
        os.setpriority(os.PRIO_PROCESS, probe.native_id, -10)
        allowed = True
    except PermissionError:
        allowed = False
    for worker in (pair.producer, pair.consumer):
        nice = os.getpriority(os.PRIO_PROCESS, worker.node.loop_thread.native_id)
        assert nice == (-10 if allowed else 0), (worker, nice)


def test_a_request_is_reported_sent_only_after_vllm_said_it_finished(pair):
    params = lend(pair, "r1", 20, [3, 4])
    load(pair, "d1", params, 20, [5, 6])
    steps(pair, lambda r, s: "d1" in r)
    lease_over(pair.producer, "r1")  # the done ack arrived: the lease is over
    assert pair.producer.finished_sending(set()) == set()
    assert pair.producer.finished_sending({"r1"}) == {"r1"}


def test_a_ticket_whose_prefill_is_gone_is_reported_failed_with_every_block_to_recompute(pair):
    params = lend(pair, "r1", 40, [5, 2, 9])
    pair.producer.start(pair.p.take_plan())
    pair.producer.close()
    load(pair, "d1", params, 40, [7, 1, 30])
    recved, _ = steps(pair, lambda r, s: "d1" in r)
    assert pair.consumer.load_errors() == {7, 1, 30}
    assert pair.consumer.stats.failed == [3] and not pair.consumer.stats.ok


def test_a_lend_refused_frees_the_blocks_and_the_claim_fails_after_claim_wait(pair):
    params = lend(pair, "r1", 40, [5, 2, BLOCKS + 3])  # a block vLLM never had: the lend is refused
    load(pair, "d1", params, 40, [7, 1, 30])
    started = time.monotonic()
    recved, sent = steps(pair, lambda r, s: "d1" in r and "r1" in s, finished=frozenset({"r1"}))
    assert time.monotonic() - started >= CONFIG.claim_wait * 0.9
    assert pair.consumer.load_errors() == {7, 1, 30}


def test_a_cancelled_load_is_reported_once_quiet_and_its_blocks_are_not_recomputed(pair):
    params = lend(pair, "r1", 40, [5, 2, 9])
    load(pair, "d1", params, 40, [7, 1, 30])
    pair.consumer.start(pair.d.take_plan())  # the claim goes out; the prefill has not lent yet
    pair.d.request_finished(Req(request_id="d1"))
    recved, _ = steps(pair, lambda r, s: "d1" in r)
    assert not pair.consumer.load_errors()


def test_a_bad_ticket_is_never_loaded(pair):
    params = lend(pair, "r1", 40, [5, 2, 9])
    req = Req(request_id="d1", prompt_token_ids=list(range(40)), num_computed_tokens=0,
              kv_transfer_params={**params, TICKET_KEY: params[TICKET_KEY][:-4]})
    assert pair.d.get_num_new_matched_tokens(req, 0) == (0, False)


def test_a_request_queued_past_the_lease_ttl_still_loads_its_kv_claimed_at_arrival(short):
    params = lend(short, "r1", 40, [5, 2, 9])
    short.producer.start(short.p.take_plan())
    req = arrive("d1", params, 40)
    short.d.on_new_request(req)  # vLLM: the request is queued, no blocks yet
    deadline = time.monotonic() + 2.5  # two and a half TTLs in the queue
    while time.monotonic() < deadline:
        short.consumer.start(short.d.take_plan())
        short.producer.finished_sending(set())
        time.sleep(0.05)
    load(short, "d1", params, 40, [7, 1, 30], req)
    steps(short, lambda r, s: "d1" in r)
    assert same_blocks(short, [5, 2, 9], [7, 1, 30]) and not short.consumer.load_errors()


def test_a_request_aborted_while_queued_gives_its_claimed_lease_back(short):
    params = lend(short, "r1", 40, [5, 2, 9])
    short.producer.start(short.p.take_plan())
    req = arrive("d1", params, 40)
    short.d.on_new_request(req)
    short.consumer.start(short.d.take_plan())
    endings = lease_endings(short.producer)  # its link may not be up yet: the abort follows the claim
    short.d.request_finished(req)
    steps(short, lambda r, s: "r1" in s, finished=frozenset({"r1"}))
    assert endings == ["aborted"], endings  # given back by the decode, not left to expire at the TTL


@pytest.mark.parametrize("early", [False, True], ids=["claimed-at-load", "claimed-at-arrival"])
def test_a_ticket_put_on_another_prompt_gets_no_kv_and_the_lease_stays_its_prompts(pair, early):
    """Issue 22, finding 4: a client copies another request's ticket onto its own prompt of the same
    length. The prefill refuses the claim before any read: nothing lands in the thief's blocks, which
    are all recomputed, and the ticket's own prompt then loads its KV."""
    params = lend(pair, "r1", 40, [5, 2, 9])
    thief = arrive("thief", params, 40, first=1000)
    if early:
        pair.d.on_new_request(thief)
    load(pair, "thief", params, 40, [7, 1, 30], thief)
    steps(pair, lambda r, s: "thief" in r)
    assert pair.consumer.load_errors() == {7, 1, 30}
    assert all(float(t.abs().sum()) == 0 for t in pair.dst.values())  # not one byte of r1's KV landed
    load(pair, "d1", params, 40, [11, 12, 13])
    steps(pair, lambda r, s: "d1" in r and "r1" in s, finished=frozenset({"r1"}))
    assert same_blocks(pair, [5, 2, 9], [11, 12, 13]) and not pair.consumer.load_errors()


def test_a_prefills_abort_reason_is_logged_escaped(pair, monkeypatch, caplog):
    """Issue 22, 9: the worker logged a prefill's Abort reason raw, so a prefill could forge log lines."""
    evil = "gone\n2030-01-01 00:00:00 CRITICAL kvlend forged\x1b[2J"
    monkeypatch.setattr(kvlend.protocol.wire, "detail_of", lambda exc: f"{type(exc).__name__}: {evil}")
    params = lend(pair, "r1", 40, [5, 2, 9])
    pair.producer.start(pair.p.take_plan())
    pair.producer.node.release(Ticket.from_text(params[TICKET_KEY]).lease)  # its claim is refused: the reason
    caplog.set_level(logging.INFO, logger="kvlend.vllm")
    load(pair, "d1", params, 40, [7, 1, 30])
    steps(pair, lambda r, s: "d1" in r)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvlend.vllm" and "forged" in r.getMessage()]
    assert lines and all(line.isprintable() and "\\n2030" in line for line in lines), lines


@pytest.mark.parametrize("prefill_tp, decode_tps", [(2, (1,)), (1, (2,)), (2, (2,)), (1, (1, 2)), (2, (2, 1))])
def test_tensor_parallel_workers_each_land_exactly_their_heads(prefill_tp, decode_tps):
    """Every worker a node of its own (real NIXL agents), as vLLM runs them: the prefill workers each lend
    their heads of a request's blocks, the tickets go through both schedulers, and every decode worker's
    blocks end up holding exactly its heads; each request is reported loaded by every worker of its decode
    and sent by every prefill worker.  One prefill serves decodes of every TP in one run, told none: a
    decode with more workers reads each prefill worker's lease as shares of it."""
    whole = caches(True)

    def heads(tensors: dict, tp: int, rank: int) -> dict:
        share = HEADS // tp
        return {name: t[:, rank * share:(rank + 1) * share].clone() for name, t in tensors.items()}

    def layout(tensors: dict, tp: int, rank: int):
        return layout_from_kv_caches(tensors, block_size=BS, dtype="float32", scope="test/cpu/bs16", tp_size=tp,
                                     tp_rank=rank)

    src = [heads(whole, prefill_tp, r) for r in range(prefill_tp)]
    dst = [[heads(caches(False), tp, r) for r in range(tp)] for tp in decode_tps]
    producers = [ProducerWorker(WorkerSettings(creds(f"p-{r}", "prefill"), config=CONFIG, tp_size=prefill_tp,
                                               tp_rank=r))
                 for r in range(prefill_tp)]
    decodes = [[ConsumerWorker(WorkerSettings(creds(f"d{e}-{r}", "decode"), config=CONFIG, tp_size=tp, tp_rank=r), BS,
                               Stats()) for r in range(tp)] for e, tp in enumerate(decode_tps)]
    try:
        p_sched = ProducerScheduler(BS)
        p_sched.set_endpoints([w.register(layout(src[r], prefill_tp, r)) for r, w in enumerate(producers)])
        for e, tp in enumerate(decode_tps):
            for r, w in enumerate(decodes[e]):
                w.register(layout(dst[e][r], tp, r))
        d_scheds = [ConsumerScheduler(BS, tp) for tp in decode_tps]
        for e, d_sched in enumerate(d_scheds):  # request r{e} for decode engine e
            pair = SimpleNamespace(p=p_sched, d=d_sched)
            load(pair, f"d{e}", lend(pair, f"r{e}", 40, [5, 2, 9]), 40, [7, 1, 30])
        requests = {f"r{e}" for e in range(len(decode_tps))}
        recved = [[set() for _ in workers] for workers in decodes]
        sent = [set() for _ in producers]
        deadline = time.monotonic() + 10.0
        # A load is reported once verified, before the done ack; its stats come with the ack.
        while not (all(f"d{e}" in r for e, ranks in enumerate(recved) for r in ranks)
                   and all(requests <= s for s in sent) and all(w.stats.ok for ws in decodes for w in ws)):
            assert time.monotonic() < deadline, (recved, sent)
            p_plan = p_sched.take_plan()  # one plan, every worker
            for r, w in enumerate(producers):
                w.start(p_plan)
                sent[r] |= w.finished_sending(requests)
            for e, d_sched in enumerate(d_scheds):
                d_plan = d_sched.take_plan()
                for r, w in enumerate(decodes[e]):
                    w.start(d_plan)
                    recved[e][r] |= w.finished_recving()
            time.sleep(0.005)
        for e, tp in enumerate(decode_tps):
            share = HEADS // tp
            for r, w in enumerate(decodes[e]):
                assert not w.load_errors()
                assert sum(w.stats.ok) == 2 * 3 * share * BS * 2 * HEAD * 4  # layers x blocks x its heads
                for name, t in dst[e][r].items():
                    assert torch.equal(t[[7, 1, 30]], whole[name][[5, 2, 9], r * share:(r + 1) * share]), (e, r)
                    assert not t[[0, 3]].any()  # nothing else written
    finally:
        for w in [w for ws in decodes for w in ws] + producers:
            w.close()


# ------------------------------------------------------------------ progressive lending
LEASE = "0a" * 16


class Growing:
    """A prefill request lent as its chunks compute, under the router's lease id, and its decode."""

    def __init__(self, pair, rid: str, num_tokens: int, lease: str = LEASE) -> None:
        self.pair, self.blocks = pair, []
        self.req = Req(request_id=rid, prompt_token_ids=list(range(num_tokens)), num_computed_tokens=0,
                       status=SimpleNamespace(name="RUNNING"),
                       kv_transfer_params={"do_remote_decode": True, LEASES_KEY: [lease]})
        pair.p.on_new_request(self.req)
        e = pair.p.endpoints[0]
        text = Ticket(bytes.fromhex(lease), e.host, e.port, e.name, 1, e.layout_id).to_text()
        self.decode_params = {"do_remote_prefill": True, TICKET_KEY: [text], PROGRESSIVE_KEY: True}

    def step(self, preempted=()):
        plan = self.pair.p.take_plan(set(preempted), lambda rid: (list(self.blocks),))
        self.pair.producer.start(plan)
        return plan

    def compute(self, tokens: int, blocks: list[int]) -> None:
        """A chunk's forward wrote up to ``tokens`` into ``blocks``; the next step lends it."""
        self.req.num_computed_tokens, self.blocks = tokens, blocks
        self.step()


def wait_for(condition, pair, timeout: float = 10.0) -> None:
    """Step the decode until ``condition()`` holds (its reads land on the node's thread)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        pair.consumer.start(pair.d.take_plan())
        pair.consumer.finished_recving()
        time.sleep(0.005)


def test_a_progressive_lend_is_read_chunk_by_chunk_and_lands_whole(pair):
    grow = Growing(pair, "r1", 40)
    grow.step()  # lent with nothing ready: the decode's claim is answered
    load(pair, "d1", grow.decode_params, 40, [7, 1, 30])
    grow.compute(32, [5, 2, 9])  # two whole blocks computed
    wait_for(lambda: same_blocks(pair, [5, 2], [7, 1]), pair)
    assert float(pair.dst["model.layers.0.self_attn.attn"][30].abs().sum()) == 0  # not lent yet
    grow.req.num_computed_tokens, grow.req.status = 40, SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    delay, params = pair.p.request_finished(grow.req, ([5, 2, 9],))
    assert delay and Ticket.from_text(params[TICKET_KEY]).lease == bytes.fromhex(LEASE)
    steps(pair, lambda r, s: "d1" in r and "r1" in s, finished=frozenset({"r1"}))
    assert same_blocks(pair, [5, 2, 9], [7, 1, 30]) and not pair.consumer.load_errors()


def test_a_preempted_progressive_lend_ends_before_vllm_reuses_its_blocks(pair):
    """No block the decode keeps (reports loaded) holds bytes written after the preemption."""
    grow = Growing(pair, "r1", 64)
    grow.step()
    load(pair, "d1", grow.decode_params, 64, [7, 1, 30, 12])
    grow.compute(32, [5, 2, 9])
    wait_for(lambda: same_blocks(pair, [5, 2], [7, 1]), pair)
    before = {name: t.clone() for name, t in pair.src.items()}
    grow.req.num_computed_tokens = 0
    plan = grow.step(preempted={"r1"})
    assert plan.preempts == ["r1"]
    pair.producer.preempt(plan.preempts)  # returns once no read of its blocks can still land
    for t in pair.src.values():  # vLLM gives the blocks to another request, whose forward writes them
        t[[5, 2, 9]] = -1.0
    recved, _ = steps(pair, lambda r, s: "d1" in r)
    bad = pair.consumer.load_errors()
    assert bad and bad <= {7, 1, 30, 12}
    kept = [(s, d) for s, d in ((5, 7), (2, 1), (9, 30)) if d not in bad]
    assert all(torch.equal(before[n][s], pair.dst[n][d]) for n in before for s, d in kept)
    grow.req.num_computed_tokens, grow.req.status = 64, SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    assert pair.p.request_finished(grow.req, ([4, 6, 8, 10],)) == (False, None)  # not lent again
    assert pair.producer.finished_sending({"r1"}) == set()  # vLLM freed its blocks itself


SLACK = 0.5  # seconds past the bound a busy host may take to wake preempt's wait


@pytest.fixture
def progressive_short():
    """Progressive leases of one second (the connector's default), other leases of five."""
    yield from make_pair(dataclasses.replace(CONFIG, progressive_ttl=1.0))


def preempted_mid_read(pair, rid: str, blocks: list[int], dst: list[int]):
    """A progressive lend read up to its first two blocks, then preempted: how long ``preempt`` took, and
    the prefill's blocks as the decode read them."""
    grow = Growing(pair, rid, 64, lease=secrets.token_hex(16))
    grow.step()
    load(pair, "d" + rid, grow.decode_params, 64, dst)
    grow.compute(32, blocks[:3])
    wait_for(lambda: same_blocks(pair, blocks[:2], dst[:2]), pair)
    before = {name: t.clone() for name, t in pair.src.items()}
    grow.req.num_computed_tokens = 0
    plan = grow.step(preempted={rid})
    assert plan.preempts == [rid]
    started = time.monotonic()
    pair.producer.preempt(plan.preempts)
    took = time.monotonic() - started
    for t in pair.src.values():  # vLLM gives the blocks to another request, whose forward writes them
        t[blocks[:3]] = -1.0
    return took, before


def test_a_reader_ignoring_the_end_of_its_lease_holds_preempt_at_most_the_progressive_ttl(progressive_short,
                                                                                           monkeypatch):
    """Issue 34, 4: a decode that ignores the prefill's Abort held vLLM's step for a whole TTL (30 s by
    default).  Now ``preempt`` returns within ``progressive_ttl`` (measured against an honest reader in the
    same run), the reader is dropped, and no block it reports loaded holds a byte written after it."""
    pair = progressive_short
    bound = pair.producer.settings.config.progressive_ttl
    honest, _ = preempted_mid_read(pair, "r0", [5, 2, 9], [7, 1, 30, 12])
    steps(pair, lambda r, s: "dr0" in r)
    pair.consumer.load_errors()
    session = pair.consumer.node.session
    monkeypatch.setattr(session._messages, "_withdrawn", lambda *args: None)  # hears the Abort, does nothing about it
    took, before = preempted_mid_read(pair, "r1", [4, 6, 8], [3, 10, 11, 13])
    assert honest < took <= bound + SLACK < CONFIG.ttl, (honest, took)
    wait_until(lambda: not pair.producer.node.ready_peers(), "the reader dropped", 5.0)
    steps(pair, lambda r, s: "dr1" in r)
    bad = pair.consumer.load_errors()
    assert bad and bad <= {3, 10, 11, 13}
    kept = [(s, d) for s, d in ((4, 3), (6, 10), (8, 11)) if d not in bad]
    assert kept and all(torch.equal(before[n][s], pair.dst[n][d]) for n in before for s, d in kept)


def test_a_progressive_lend_naming_a_live_lease_is_refused_and_that_lease_still_ends_cleanly(pair):
    """A router's lease ids come from a client's request: one naming another request's live lease lends
    nothing, and the other request is still read and reported."""
    params = lend(pair, "r1", 20, [3, 4])
    pair.producer.start(pair.p.take_plan())
    grow = Growing(pair, "r2", 20, lease=Ticket.from_text(params[TICKET_KEY]).lease.hex())
    grow.step()
    load(pair, "d1", params, 20, [5, 6])
    recved, sent = steps(pair, lambda r, s: "d1" in r and {"r1", "r2"} <= s, finished=frozenset({"r1", "r2"}))
    assert same_blocks(pair, [3, 4], [5, 6]) and not pair.consumer.load_errors()


def recurrent_pair(decode: WorkerSettings | None = None):
    """A prefill and a decode worker over a Mamba2 + attention model's caches (``test_vllm_recurrent_units``'s:
    a state block in the first bytes of each attention page), the prefill's bytes random."""
    from tests.test_vllm_recurrent_units import BS as RBS, caches as mamba_caches, state

    shape = state(1)
    (src, groups, src_flat), (dst, _, dst_flat) = mamba_caches(shape), mamba_caches(shape)
    seeded = torch.Generator().manual_seed(3)
    src_flat.copy_(torch.randint(-128, 128, src_flat.shape, dtype=torch.int8, generator=seeded))
    order = (groups["model.layers.0.mixer"], groups["model.layers.1.self_attn.attn"])
    producer = ProducerWorker(WorkerSettings(creds("p", "prefill"), config=CONFIG))
    consumer = ConsumerWorker(decode or WorkerSettings(creds("d", "decode"), config=CONFIG), RBS, Stats())
    p_sched, d_sched = ProducerScheduler(RBS, order), ConsumerScheduler(RBS, 1, order)
    layout = dict(block_size=RBS, dtype="float32", scope="test/mamba", groups=groups)
    p_sched.set_endpoints([producer.register(layout_from_kv_caches(src, **layout))])
    consumer.register(layout_from_kv_caches(dst, **layout))
    yield SimpleNamespace(src=src_flat, dst=dst_flat, page=src_flat.numel() // 6, state=shape.nbytes, bs=RBS,
                          producer=producer, consumer=consumer, p=p_sched, d=d_sched)
    consumer.close()
    producer.close()


@pytest.fixture
def recurrent():
    yield from recurrent_pair()


@pytest.fixture
def recurrent_stranger():
    yield from recurrent_pair(WorkerSettings(Authority.create().issue("d", "decode"), config=CONFIG))


def lend_recurrent(pair, prompt: int, state_block: int, blocks: list[int]) -> dict:
    """The prefill side of a recurrent request: cut to ``prompt - 1`` tokens as it arrives, computed, lent."""
    req = Req(request_id="r1", prompt_token_ids=list(range(prompt)), num_computed_tokens=0,
              status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"), kv_transfer_params={"do_remote_decode": True},
              _all_token_ids=list(range(prompt)), num_prompt_tokens=prompt, max_tokens=8)
    pair.p.on_new_request(req)
    req.num_computed_tokens = req.num_prompt_tokens
    delay, params = pair.p.request_finished(req, ([state_block], blocks))
    assert delay and req.num_prompt_tokens == prompt - 1
    return params


def load_recurrent(pair, params: dict, prompt: int, state_block: int, blocks: list[int]) -> None:
    req = arrive("d1", params, prompt)
    assert pair.d.get_num_new_matched_tokens(req, 0) == (prompt - 1, True)
    pair.d.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([state_block], blocks)), prompt - 1)


def test_a_recurrent_request_lands_as_its_state_block_and_the_attention_of_all_but_its_last_token(recurrent):
    pair = recurrent
    params = lend_recurrent(pair, 2 * pair.bs + 1, 4, [1, 3])  # 33 tokens: 32 lent, in two blocks
    load_recurrent(pair, params, 2 * pair.bs + 1, 2, [5, 3])
    steps(pair, lambda r, s: "d1" in r and pair.consumer.stats.ok)  # a load's stats come with the done ack
    page = pair.page
    assert torch.equal(pair.dst[2 * page:2 * page + pair.state], pair.src[4 * page:4 * page + pair.state])
    assert not pair.dst[2 * page + pair.state:3 * page].any()  # the state block's padding is never read
    for src, dst in ((1, 5), (3, 3)):
        assert torch.equal(pair.dst[dst * page:(dst + 1) * page], pair.src[src * page:(src + 1) * page])
    assert not pair.dst[:2 * page].any() and not pair.dst[4 * page:5 * page].any()  # nothing else written
    assert pair.consumer.stats.ok == [pair.state + 2 * page]
    assert not pair.consumer.load_errors() and not pair.consumer.failed_loads()


def test_a_failed_recurrent_load_is_reported_as_its_request_which_vllm_recomputes_whole(recurrent_stranger):
    """vLLM takes no block ids from a model with several KV cache groups (it would stop the engine): the
    request itself is reported failed, with its finish."""
    pair = recurrent_stranger
    params = lend_recurrent(pair, 40, 4, [1, 3, 5])
    load_recurrent(pair, params, 40, 2, [3, 5, 1])
    steps(pair, lambda r, s: "d1" in r)
    assert pair.consumer.failed_loads() == {"d1"} and not pair.consumer.load_errors()
    assert pair.consumer.stats.failed == [4] and not pair.consumer.stats.ok  # 3 attention blocks and the state
    assert not pair.dst.any()
