"""Progressive lending inside vLLM, its pure parts: what the prefill's scheduler lends and extends step by
step under a router's lease ids, what it does on preemption and abort, and what the router sends.

The engines run in ``test_vllm_progressive.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from kvlend.protocol.ticket import Ticket
from kvlend_vllm.layout import CacheGroup
from kvlend_vllm.pd_requests import progressive_requests, template_request
from kvlend_vllm.scheduler import (
    LEASES_KEY,
    PROGRESSIVE_KEY,
    TEMPLATE_KEY,
    TICKET_KEY,
    ConsumerScheduler,
    Endpoint,
    ProducerScheduler,
    padded_tables,
    request_digest,
)

pytestmark = pytest.mark.unit

BS = 16
ENDPOINT = Endpoint("127.0.0.1", 5555, "prefill-a", "ab" * 32)
LEASE = "01" * 16


@dataclass
class Req:
    request_id: str = "r1"
    prompt_token_ids: list = field(default_factory=lambda: list(range(40)))
    num_computed_tokens: int = 0
    status: object = field(default_factory=lambda: SimpleNamespace(name="RUNNING"))
    kv_transfer_params: dict | None = field(
        default_factory=lambda: {"do_remote_decode": True, LEASES_KEY: [LEASE]})
    lora_request: object = None
    mm_features: list = field(default_factory=list)
    cache_salt: str | None = None


class Engine:
    """vLLM's side of the conversation: the request's blocks so far, and the steps."""

    def __init__(self, scheduler: ProducerScheduler) -> None:
        self.scheduler = scheduler
        self.blocks: dict[str, list[int]] = {}

    def step(self, preempted=()):
        return self.scheduler.take_plan(set(preempted), lambda rid: (self.blocks.get(rid, []),))


def producer(groups=(CacheGroup("full"),)) -> Engine:
    s = ProducerScheduler(BS, groups=groups)
    s.set_endpoints([ENDPOINT])
    return Engine(s)


def test_a_request_with_the_routers_leases_is_lent_at_once_and_grows_with_each_step():
    engine, req = producer(), Req()
    engine.scheduler.on_new_request(req)
    (lend,) = engine.step().lends  # queued, nothing computed: lent empty, so an early claim is answered
    assert (lend.leases, lend.ready, lend.num_tokens, lend.tables) == ((bytes.fromhex(LEASE),), 0, 40,
                                                                        {"full": (-1, -1, -1)})
    assert lend.digest == request_digest(req, 40)
    engine.blocks["r1"] = [7, 3]
    req.num_computed_tokens = 0  # scheduled: its first chunk computes in this step
    assert not engine.step().extends  # nothing written yet
    req.num_computed_tokens = 20  # the first chunk's forward ran
    engine.blocks["r1"] = [7, 3, 9]
    (extend,) = engine.step().extends
    assert (extend.request, extend.ready, extend.tables) == ("r1", 20, {"full": (7, 3, 9)})
    assert not engine.step().extends  # no progress, no extend
    req.num_computed_tokens, req.status = 40, SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    delay, params = engine.scheduler.request_finished(req, ([7, 3, 9],))
    assert delay and engine.scheduler.holding == 1
    assert Ticket.from_text(params[TICKET_KEY]).lease == bytes.fromhex(LEASE)
    plan = engine.step()
    assert [(e.ready, e.tables) for e in plan.extends] == [(40, {"full": (7, 3, 9)})]  # final
    assert not plan.lends and not plan.releases
    engine.scheduler.finished_sending({"r1"})
    assert engine.scheduler.holding == 0


def test_a_request_lent_whole_before_it_finished_needs_no_final_extend():
    engine, req = producer(), Req(num_computed_tokens=40)
    engine.scheduler.on_new_request(req)
    engine.blocks["r1"] = [7, 3, 9]
    assert engine.step().lends[0].ready == 40
    req.status = SimpleNamespace(name="FINISHED_STOPPED")
    assert engine.scheduler.request_finished(req, ([7, 3, 9],))[0]
    assert not engine.step().extends


@pytest.mark.parametrize("leases", [None, "01", [LEASE, LEASE], ["zz" * 16], ["01" * 8], [LEASE, "02" * 16]])
def test_lease_ids_that_do_not_fit_are_not_lent_at_all(leases):
    """One id per ticket this engine mints, distinct, of the lease id's size: anything else is a router's
    mistake, and the decode it paired the request with could read nothing else, so nothing is lent."""
    engine = producer()
    req = Req(kv_transfer_params={"do_remote_decode": True, LEASES_KEY: leases})
    engine.scheduler.on_new_request(req)
    assert not engine.step().lends
    req.num_computed_tokens, req.status = 40, SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    assert engine.scheduler.request_finished(req, ([7, 3, 9],)) == (False, None)
    assert not engine.step().lends


def test_a_sliding_window_model_is_not_lent_progressively():
    """vLLM frees a window's blocks as the chunks pass it: a lent block could be reused mid-read."""
    engine = producer(groups=(CacheGroup("g0", 32), CacheGroup("g1")))
    engine.scheduler.on_new_request(Req())
    assert not engine.scheduler.take_plan(set(), lambda rid: ([], [])).lends


def test_a_preempted_request_ends_its_lease_before_the_step_that_reuses_its_blocks():
    engine, req = producer(), Req()
    engine.scheduler.on_new_request(req)
    engine.blocks["r1"] = [7, 3, 9]
    req.num_computed_tokens = 32
    assert engine.step().lends[0].ready == 32
    req.num_computed_tokens = 0  # vLLM's preemption
    plan = engine.step(preempted={"r1"})
    assert plan.preempts == ["r1"] and not plan.extends
    req.num_computed_tokens = 40  # recomputed after it resumed: never lent again
    assert not engine.step().extends
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    assert engine.scheduler.request_finished(req, ([4, 5, 6],)) == (False, None)
    assert engine.scheduler.holding == 0


def test_a_request_preempted_before_it_was_lent_has_nothing_to_end():
    engine, req = producer(), Req()
    engine.scheduler.on_new_request(req)
    assert not engine.step(preempted={"r1"}).preempts


def test_an_abort_mid_prefill_ends_the_lease_and_keeps_the_blocks_until_its_reader_is_quiet():
    engine, req = producer(), Req(num_computed_tokens=16)
    engine.scheduler.on_new_request(req)
    engine.blocks["r1"] = [7, 3]
    engine.step()
    req.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert engine.scheduler.request_finished(req, ([7, 3],)) == (True, None)
    plan = engine.step()
    assert plan.releases == ["r1"] and not plan.extends and engine.scheduler.holding == 1


def test_an_abort_before_the_first_lend_frees_at_once():
    engine, req = producer(), Req(status=SimpleNamespace(name="FINISHED_ABORTED"))
    engine.scheduler.on_new_request(req)
    assert engine.scheduler.request_finished(req, ([],)) == (False, None)
    assert not engine.step().lends


def test_a_template_request_gets_this_engines_tickets_and_lends_nothing():
    engine = producer()
    req = Req(prompt_token_ids=[0], num_computed_tokens=1, kv_transfer_params=template_request("m")[
        "kv_transfer_params"], status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
    engine.scheduler.on_new_request(req)
    delay, params = engine.scheduler.request_finished(req, ([5],))
    (ticket,) = map(Ticket.from_text, params[TEMPLATE_KEY])
    assert not delay and (ticket.host, ticket.port, ticket.prefill) == ("127.0.0.1", 5555, "prefill-a")
    assert not engine.step().lends and engine.scheduler.holding == 0


def test_the_router_sends_the_prefill_its_leases_and_the_decode_tickets_for_them():
    body = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True,
            "kv_transfer_params": {TICKET_KEY: "a client's"}}
    text = Ticket(bytes.fromhex(LEASE), "127.0.0.1", 5555, "prefill-a", 1, "ab" * 32).to_text()
    p, d = progressive_requests(body, [LEASE], [text])
    assert p["max_tokens"] == 1 and not p["stream"]
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, LEASES_KEY: [LEASE]}
    assert d["kv_transfer_params"] == {"do_remote_prefill": True, "do_remote_decode": False,
                                       TICKET_KEY: [text], PROGRESSIVE_KEY: True}
    assert d["max_tokens"] == 8 and d["stream"]


def test_the_decode_counts_a_progressive_tickets_tokens_in_its_own_prompt():
    text = Ticket(bytes.fromhex(LEASE), "127.0.0.1", 5555, "prefill-a", 1, "ab" * 32).to_text()
    params = {"do_remote_prefill": True, TICKET_KEY: [text], PROGRESSIVE_KEY: True}
    s, req = ConsumerScheduler(BS), Req(kv_transfer_params=params)
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    s.on_new_request(req)
    ((texts, digest),) = s.take_plan().claims
    assert Ticket.from_text(texts[0]).num_tokens == 40 and digest == request_digest(req, 40)
    # Without the flag a ticket's count must be the prompt's, as a prefill that finished minted it.
    assert ConsumerScheduler(BS).get_num_new_matched_tokens(
        Req(kv_transfer_params={"do_remote_prefill": True, TICKET_KEY: [text]}), 0) == (0, False)


def test_padded_tables_hold_minus_one_where_vllm_has_not_allocated_yet():
    groups = (CacheGroup("full"),)
    assert padded_tables(groups, ([4],), 40, BS) == {"full": (4, -1, -1)}
    assert padded_tables(groups, ([4, 5, 6, 7],), 40, BS) == {"full": (4, 5, 6)}
