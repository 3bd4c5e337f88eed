"""The connector's scheduler side: which requests to lend or load, and the tickets.

It runs in vLLM's EngineCore process, which owns no KV memory: the worker
process lends and fetches.  So the prefill scheduler *mints* the ticket
itself (a fresh random lease id plus the worker's endpoint, identity and
layout id, sent once through vLLM's handshake metadata) and tells its
worker to lend under that id on the next step; a claim that arrives first
waits for the lend (``NodeConfig.claim_wait``).  Nothing here blocks,
raises into vLLM on a bad ticket, or touches NIXL.  vLLM objects are read
duck-typed (``request``, ``blocks``), so the logic is tested without an engine.

Tensor parallel: each prefill worker runs a node of its own and lends its heads of a
request's blocks under one lease, whatever the decode's TP: the ticket key holds one
ticket per prefill worker, in rank order.  A decode with as many workers or fewer
gives each worker its slice of the list (``worker_tickets``): the prefill workers
holding its heads.  A decode with ``k`` times as many workers has ``k`` of them read
each prefill worker's heads, each under a lease id of its own derived from the
ticket's (``share_lease``): the prefill worker lends those shares of its lease when
the first is claimed (``ProducerWorker.claim_waits``), so it never needs to know the
decode's TP, and one prefill serves decodes of any TP.

A ticket travels in ``kv_transfer_params``, which any HTTP client can set, so
both sides bind it to the request's content (``request_digest``): the prefill
lends under the digest of its prompt, the decode claims with its own request's,
and a ticket put on another prompt reads nothing (the request is computed
locally).

A recurrent model (Mamba2 state groups) lends a prompt of N tokens as N - 1: vLLM recomputes the
last prompt token after a load, which applies it once more to a recurrent state.  So the prefill
computes N - 1 tokens (its request is cut short as it arrives, ``hold_back_last_token``) and lends
their attention blocks with the state h(N - 1); the decode loads those and computes token N
itself.  A one-token prompt is not lent: its decode computes it.

Progressive lending (a router that sends to both engines at once, ``docs/vllm.md``): the
router chooses the lease ids and gives them to the prefill (``LEASES_KEY``) and, as tickets
of the prefill's endpoints, to the decode (``PROGRESSIVE_KEY``: their token count is the
prompt's).  The prefill lends the request as soon as it arrives, with nothing ready, and
each step extends the lease by what the steps before computed (chunked prefill), so the
decode reads the prompt while the prefill computes the rest.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from kvlend.core.lender import LEASE_ID_BYTES
from kvlend.core.prompt import prompt_digest
from kvlend.errors import ConfigError, KvlendError, UsageError
from kvlend.protocol.ticket import Ticket

from .layout import GROUP, CacheGroup

log = logging.getLogger("kvlend.vllm")

TICKET_KEY = "kvlend_ticket"  # in kv_transfer_params, next to the do_remote_* flags routers already set
LEASES_KEY = "kvlend_leases"  # prefill: lend progressively under these lease ids (hex), the router's
PROGRESSIVE_KEY = "kvlend_progressive"  # decode: the tickets are the router's, their token count the prompt's
TEMPLATE_KEY = "kvlend_template"  # prefill: answer with this engine's tickets (lending nothing), for a router
HELD_BACK_KEY = "kvlend_held_back"  # prefill, recurrent model: the request's last prompt token was cut
ONE_GROUP = (CacheGroup(GROUP),)  # a model with full attention only
NULL_BLOCK = 0  # vLLM's null block (its BlockPool takes block 0): a freed out-of-window slot's placeholder
MAX_TICKETS = 64  # tickets one request may carry (one per prefill TP worker): more is refused unread
SHARE_COUNTS = range(2, 9)  # decode workers that may read one prefill worker's lease: 2 to 8
# Names of vLLM's RequestStatus a finished prefill is lent in (the connector checks they exist at
# start-up); an abort or error frees the blocks at once.
LENT_STATUSES = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


@dataclass(frozen=True)
class Endpoint:
    """What a producer worker tells its scheduler once, so the scheduler can mint tickets."""

    host: str
    port: int
    name: str  # the worker node's identity: its certificate's common name
    layout_id: str


@dataclass(frozen=True)
class Lend:
    request: str
    leases: tuple[bytes, ...]  # one per prefill TP rank
    num_tokens: int
    tables: dict[str, tuple[int, ...]]  # block ids per KV cache group (kvlend group name); -1: not allocated
    digest: bytes  # ``request_digest`` of the request: only a claim for the same content reads it
    ready: int | None = None  # progressive: tokens computed so far (None: all of them)


@dataclass(frozen=True)
class Extend:
    """A progressive lend grows: the steps before this one computed ``ready`` tokens."""

    request: str
    ready: int
    tables: dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class Load:
    request: str
    tickets: tuple[str, ...]  # every decode worker's: each reads its own share (worker_tickets)
    num_tokens: int  # the ticket's: the load is complete once the bound reaches it
    tables: dict[str, tuple[int, ...]]  # block ids per KV cache group (kvlend group name)
    resume_from: int  # tokens vLLM already holds locally (block-aligned): not fetched
    digest: bytes  # ``request_digest`` of the request the blocks are for: its claim carries it


@dataclass
class StepPlan:
    """What one engine step asks of the worker (the connector metadata's contents)."""

    lends: list[Lend] = field(default_factory=list)
    # (tickets, digest) to claim before vLLM has blocks
    claims: list[tuple[tuple[str, ...], bytes]] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    unclaims: list[tuple[str, ...]] = field(default_factory=list)  # tickets claimed and never to be loaded
    cancels: list[str] = field(default_factory=list)
    extends: list[Extend] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)  # progressive lends whose request was aborted
    preempts: list[str] = field(default_factory=list)  # progressive lends whose blocks vLLM takes back this step


def pages_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def group_tables(groups: tuple[CacheGroup, ...], block_ids, num_tokens: int,
                 block_size: int) -> dict[str, tuple[int, ...]] | None:
    """Each group's blocks for ``num_tokens`` (a recurrent group's: its one state block), or None when
    a group lacks one: a sliding window's (vLLM frees a finished request's blocks below ``num_tokens -
    window + 1``: the decode's recompute of the last prompt token also needs the token before, which a
    block boundary there lost) or a state block."""
    if len(block_ids) != len(groups):
        raise ConfigError(f"vLLM gave {len(block_ids)} block tables for {len(groups)} KV cache groups")
    pages = pages_for(num_tokens, block_size)
    tables = {}
    for group, ids in zip(groups, block_ids):
        if group.state is not None:
            if not ids or ids[0] == NULL_BLOCK:
                return None
            tables[group.name] = (ids[0],)
            continue
        table = tuple(ids[:pages])
        first = 0 if group.window is None else max(0, num_tokens - group.window) // block_size
        if len(table) < pages or NULL_BLOCK in table[first:]:
            return None
        tables[group.name] = table
    return tables


def padded_tables(groups: tuple[CacheGroup, ...], block_ids, num_tokens: int,
                  block_size: int) -> dict[str, tuple[int, ...]]:
    """Each group's blocks allocated so far, padded with -1 to ``num_tokens``' blocks (a request still
    prefilling: rows past what is computed are not lent, so they need no block yet)."""
    pages = pages_for(num_tokens, block_size)
    if len(block_ids) != len(groups):
        raise ConfigError(f"vLLM gave {len(block_ids)} block tables for {len(groups)} KV cache groups")
    return {g.name: (tuple(ids[:1]) or (-1,)) if g.state is not None
            else tuple(ids[:pages]) + (-1,) * max(0, pages - len(ids)) for g, ids in zip(groups, block_ids)}


def recurrent(groups: tuple[CacheGroup, ...]) -> bool:
    """The model keeps recurrent state: its tickets cover all but the last prompt token."""
    return any(g.state is not None for g in groups)


def hold_back_last_token(request: Any) -> bool:
    """Cut a recurrent model's request to all but its last prompt token, once, so the prefill computes
    h(N - 1) and its decode token N (vLLM recomputes a loaded prompt's last token, which would apply it to
    the state twice).  False, leaving the request whole, when it cannot be cut: one prompt token (nothing
    would be left to lend), prompt embeddings, or a request that reads no cache (prompt logprobs)."""
    params = request.kv_transfer_params
    if params.get(HELD_BACK_KEY):
        return True
    ids = request.prompt_token_ids
    skips = getattr(request, "get_skip_reading_prefix_cache", None)
    if ids is None or len(ids) < 2 or (skips is not None and skips()):
        return False
    del ids[-1]
    del request._all_token_ids[-1]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    params[HELD_BACK_KEY] = True
    return True


def parse_leases(value: Any, count: int) -> tuple[bytes, ...]:
    """``LEASES_KEY``'s lease ids: ``count`` distinct ones (one per ticket this engine mints), each
    ``LEASE_ID_BYTES`` in hex; UsageError says what is wrong."""
    if not isinstance(value, list) or len(value) != count or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{LEASES_KEY}: expected a list of {count} hex lease ids")
    try:
        leases = tuple(bytes.fromhex(v) for v in value)
    except ValueError:
        raise UsageError(f"{LEASES_KEY}: expected hex lease ids") from None
    if any(len(lease) != LEASE_ID_BYTES for lease in leases) or len(set(leases)) != count:
        raise UsageError(f"{LEASES_KEY}: expected {count} distinct ids of {LEASE_ID_BYTES} bytes")
    return leases


def share_lease(lease: bytes, index: int, count: int) -> bytes:
    """The lease id decode worker ``index`` of the ``count`` reading one prefill worker's ``lease`` claims:
    derived from it, so only a holder of its ticket can name it, and the prefill can find it."""
    return hashlib.sha256(b"kvlend/share\0" + lease + bytes((index, count))).digest()[:LEASE_ID_BYTES]


def worker_tickets(tickets: tuple[str, ...], tp_size: int, tp_rank: int) -> tuple[str, ...]:
    """Decode worker ``tp_rank`` of ``tp_size``'s share of a request's tickets (one per prefill worker, in
    rank order): its slice of them, or, with more decode workers than tickets, its share of one ticket's
    lease (``share_lease``)."""
    if tp_size <= len(tickets):
        per = len(tickets) // tp_size
        return tickets[tp_rank * per:(tp_rank + 1) * per]
    count = tp_size // len(tickets)
    ticket = Ticket.from_text(tickets[tp_rank // count])
    return (replace(ticket, lease=share_lease(ticket.lease, tp_rank % count, count)).to_text(),)


def parse_tickets(value: Any, tp_size: int, num_tokens: int | None = None) -> tuple[tuple[str, ...], list[Ticket]]:
    """The ticket key's texts and tickets, checked against this decode's TP; KvlendError says what is wrong.
    ``num_tokens``: the tickets' token count, whatever their texts say (a router's tickets for a
    progressive lend, minted before anyone counted the prompt's tokens)."""
    texts = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else None
    if texts is None or not texts or len(texts) > MAX_TICKETS or not all(isinstance(t, str) for t in texts):
        raise UsageError(f"{TICKET_KEY}: expected a ticket or a list of 1 to {MAX_TICKETS} tickets")
    if max(len(texts), tp_size) % min(len(texts), tp_size) or tp_size // len(texts) > SHARE_COUNTS[-1]:
        raise UsageError(f"{TICKET_KEY}: {len(texts)} tickets (prefill workers) cannot be shared by {tp_size} "
                         f"decode workers: one count must divide the other, at most {SHARE_COUNTS[-1]} "
                         "decode workers per prefill worker")
    tickets = [Ticket.from_text(t) for t in texts]
    if num_tokens is not None:
        tickets = [replace(t, num_tokens=num_tokens) for t in tickets]
        texts = tuple(t.to_text() for t in tickets)
    if len({t.prefill for t in tickets}) != len(tickets):
        raise UsageError(f"{TICKET_KEY}: a prefill worker is named twice")
    if len({t.num_tokens for t in tickets}) != 1:
        raise UsageError(f"{TICKET_KEY}: the tickets cover different token counts")
    return texts, tickets


def request_digest(request: Any, num_tokens: int) -> bytes | None:
    """The prompt digest of ``request``'s first ``num_tokens`` prompt tokens and of what else their KV
    depends on (LoRA adapter, images and other multimodal inputs, and the cache salt, which keeps tenants
    apart); None if the prompt has fewer token ids (say, prompt embeddings): such a request is not lent."""
    ids = request.prompt_token_ids
    if ids is None or len(ids) < num_tokens:
        return None
    lora = getattr(request, "lora_request", None)
    parts = ["lora", getattr(lora, "lora_name", "") if lora is not None else "",
             "salt", getattr(request, "cache_salt", None) or ""]
    for feature in getattr(request, "mm_features", None) or ():
        position = getattr(feature, "mm_position", None)
        parts += ["mm", str(feature.identifier), str(getattr(position, "offset", "")),
                  str(getattr(position, "length", ""))]
    context = b"".join(len(b).to_bytes(4, "little") + b for b in (p.encode() for p in parts))
    return prompt_digest(ids[:num_tokens], context)


@dataclass
class _Growing:
    """A request lent progressively, under the router's lease ids."""

    request: Any  # vLLM's Request: its num_computed_tokens is what the steps so far computed
    leases: tuple[bytes, ...]
    num_tokens: int  # its prompt's
    digest: bytes
    ready: int | None = None  # tokens lent so far (None: not lent yet)
    preempted: bool = False  # vLLM took its blocks back: its lease ended, nothing more is lent


class ProducerScheduler:
    """Prefill: lend a finished request's blocks in place and hand back its ticket(s), or lend a
    request as its chunks compute, under lease ids a router chose (``LEASES_KEY``)."""

    def __init__(self, block_size: int, groups: tuple[CacheGroup, ...] = ONE_GROUP) -> None:
        self.block_size = block_size
        self.groups = groups  # vLLM's KV cache groups, in its order
        self.recurrent = recurrent(groups)
        self.endpoints: list[Endpoint] = []  # one per TP rank, in rank order
        self._plan = StepPlan()
        self._held: set[str] = set()  # requests whose blocks wait for finished_sending
        self._growing: dict[str, _Growing] = {}

    def set_endpoints(self, endpoints: list[Endpoint]) -> None:
        self.endpoints = list(endpoints)

    def _tickets(self, leases: tuple[bytes, ...], num_tokens: int) -> list[str]:
        return [Ticket(lease, e.host, e.port, e.name, num_tokens, e.layout_id).to_text()
                for e, lease in zip(self.endpoints, leases)]

    def _new_leases(self) -> tuple[bytes, ...]:
        return tuple(secrets.token_bytes(LEASE_ID_BYTES) for _ in self.endpoints)

    def on_new_request(self, request: Any) -> None:
        """A recurrent model's request to be lent loses its last prompt token; a request carrying the
        router's lease ids is lent progressively, from the next step on."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return
        held_back = self.recurrent and hold_back_last_token(request)
        if LEASES_KEY not in params:
            return
        why = None
        if self.recurrent and not held_back:
            why = "a recurrent model's one-token prompt is computed by its decode"
        elif not self.endpoints:
            why = "no kvlend endpoint from the workers yet"
        elif any(g.window is not None for g in self.groups):  # vLLM frees a window's blocks as chunks pass it
            why = "a sliding-window model is lent once its prefill finished"
        num_tokens = len(request.prompt_token_ids or ())
        digest = request_digest(request, num_tokens) if num_tokens else None
        if why is None and digest is None:
            why = "no prompt token ids"
        try:
            leases = parse_leases(params[LEASES_KEY], len(self.endpoints)) if why is None else ()
        except KvlendError as exc:
            why = str(exc)
        if why is not None:
            log.warning("request %s: not lent progressively (%s)", request.request_id, why)
            return
        self._growing[request.request_id] = _Growing(request, leases, num_tokens, digest)

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """``block_ids``: one list per KV cache group."""
        params = request.kv_transfer_params
        if params and params.get(TEMPLATE_KEY) and self.endpoints:  # a router asks what tickets look like
            return False, {TEMPLATE_KEY: self._tickets(self._new_leases(), 1)}
        growing = self._growing.pop(request.request_id, None)
        if growing is not None:
            return self._finish_growing(growing, block_ids)
        if not params or not params.get("do_remote_decode") or LEASES_KEY in params:
            return False, None  # (lease ids it could not lend under: its decode reads nothing else)
        if self.recurrent and not params.get(HELD_BACK_KEY):
            log.info("request %s: a recurrent model's request computed whole; not lent", request.request_id)
            return False, None
        status = getattr(request.status, "name", str(request.status))
        num_tokens = request.num_computed_tokens
        if status not in LENT_STATUSES or not any(block_ids) or num_tokens <= 0:
            return False, None
        if not self.endpoints:
            log.warning("request %s: no kvlend endpoint from the workers yet; not lent", request.request_id)
            return False, None
        digest = request_digest(request, num_tokens)
        if digest is None:
            log.info("request %s: its KV covers more than its prompt token ids; not lent", request.request_id)
            return False, None
        tables = group_tables(self.groups, block_ids, num_tokens, self.block_size)
        if tables is None:
            log.info("request %s: a sliding window's first block is already freed (or a state block is missing); "
                     "not lent", request.request_id)
            return False, None
        leases = self._new_leases()
        texts = self._tickets(leases, num_tokens)
        self._plan.lends.append(Lend(request.request_id, leases, num_tokens, tables, digest))
        self._held.add(request.request_id)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      TICKET_KEY: texts[0] if len(texts) == 1 else texts, "remote_num_tokens": num_tokens}

    def _finish_growing(self, growing: _Growing, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """A progressive lend's request ended: make the lease final, or end it and keep the blocks until
        its reader is quiet."""
        rid = growing.request.request_id
        if growing.preempted or growing.ready is None:  # its lease ended when vLLM took the blocks back, or
            return False, None  # was never lent: nobody can be reading
        self._held.add(rid)
        status = getattr(growing.request.status, "name", str(growing.request.status))
        complete = growing.request.num_computed_tokens >= growing.num_tokens and status in LENT_STATUSES
        if complete and growing.ready < growing.num_tokens:
            self._plan.extends.append(Extend(rid, growing.num_tokens, padded_tables(
                self.groups, block_ids, growing.num_tokens, self.block_size)))
        elif not complete:  # aborted mid-prefill: freed once the reader is quiet (finished_sending)
            self._plan.releases.append(rid)
            return True, None
        texts = self._tickets(growing.leases, growing.num_tokens)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      TICKET_KEY: texts[0] if len(texts) == 1 else texts, "remote_num_tokens": growing.num_tokens}

    def finished_sending(self, request_ids) -> None:
        self._held.difference_update(request_ids or ())

    @property
    def holding(self) -> int:
        """Requests whose blocks are lent and not yet given back."""
        return len(self._held)

    def take_plan(self, preempted=(), block_ids_of=None) -> StepPlan:
        """This step's plan.  ``preempted``: the requests vLLM preempted in it; ``block_ids_of(request id)``:
        a request's blocks per group (vLLM's KV cache manager), for the progressive lends."""
        for rid, growing in self._growing.items():
            if growing.preempted:
                continue
            if rid in preempted:
                growing.preempted = True
                if growing.ready is not None:
                    self._plan.preempts.append(rid)
                continue
            ready = min(growing.request.num_computed_tokens, growing.num_tokens)
            if growing.ready is not None and ready <= growing.ready:
                continue
            tables = padded_tables(self.groups, block_ids_of(rid), growing.num_tokens, self.block_size)
            if growing.ready is None:
                self._plan.lends.append(Lend(rid, growing.leases, growing.num_tokens, tables, growing.digest,
                                             ready=ready))
            else:
                self._plan.extends.append(Extend(rid, ready, tables))
            growing.ready = ready
        plan, self._plan = self._plan, StepPlan()
        return plan


class ConsumerScheduler:
    """Decode: load a request's tickets into the blocks vLLM allocated, once per request."""

    def __init__(self, block_size: int, tp_size: int = 1, groups: tuple[CacheGroup, ...] = ONE_GROUP) -> None:
        self.block_size = block_size
        self.tp_size = tp_size  # this engine's workers: each reads its share of the tickets
        self.groups = groups  # vLLM's KV cache groups, in its order
        self.recurrent = recurrent(groups)
        self._plan = StepPlan()
        # request -> (tickets, digest), claimed and not yet loading
        self._claimed: dict[str, tuple[tuple[str, ...], bytes]] = {}
        self._loading: set[str] = set()

    def tickets_of(self, request: Any) -> tuple[tuple[str, ...], int] | None:
        """The request's tickets and their token count, if it still has some to redeem and they fit the
        prompt and this engine's workers; never raises."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or TICKET_KEY not in params:
            return None
        prompt = len(request.prompt_token_ids or ())
        expected = prompt - 1 if self.recurrent else prompt  # the state is lent as h(N - 1)
        if expected < 1:
            return None
        try:
            texts, tickets = parse_tickets(params[TICKET_KEY], self.tp_size,
                                           expected if params.get(PROGRESSIVE_KEY) is True else None)
        except KvlendError as exc:
            log.warning("request %s: bad kvlend ticket, computing locally: %s", request.request_id, exc)
            return None
        if tickets[0].num_tokens != expected:
            log.warning("request %s: ticket covers %d tokens but %d are lent for a prompt of %d%s; computing "
                        "locally", request.request_id, tickets[0].num_tokens, expected, prompt,
                        " (a recurrent model lends all but the last)" if self.recurrent else "")
            return None
        return texts, tickets[0].num_tokens

    def on_new_request(self, request: Any) -> None:
        """Claim the tickets as the request arrives: heartbeats keep the leases alive while it queues."""
        found = self.tickets_of(request)
        if found is not None:
            claim = (found[0], request_digest(request, found[1]))
            self._plan.claims.append(claim)
            self._claimed[request.request_id] = claim

    def _unclaim(self, request_id: str) -> None:
        claim = self._claimed.pop(request_id, None)
        if claim is not None:
            self._plan.unclaims.append(claim[0])

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        found = self.tickets_of(request)
        if found is None:
            return 0, False
        count = found[1] - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        found = self.tickets_of(request)
        if found is None:
            return
        texts, num_tokens = found
        request.kv_transfer_params["do_remote_prefill"] = False  # one load per request, even if rescheduled
        if num_external_tokens <= 0:
            self._unclaim(request.request_id)  # all local: give the prefill its blocks back now
            return
        tables = group_tables(self.groups, blocks.get_block_ids(), num_tokens, self.block_size)
        if tables is None:  # vLLM allocates a loaded window and a state whole; if it did not, compute
            log.warning("request %s: a sliding window's or a state's block is not allocated; computing locally",
                        request.request_id)
            self._unclaim(request.request_id)
            return
        claim = self._claimed.pop(request.request_id, None)
        digest = claim[1] if claim is not None else request_digest(request, num_tokens)
        # What vLLM holds already (its prefix cache: whole blocks) is not read again.  vLLM sets
        # request.num_computed_tokens only after this call, so it comes from the external count.
        resume = num_tokens - num_external_tokens
        self._plan.loads.append(Load(request.request_id, texts, num_tokens, tables, resume, digest))
        self._loading.add(request.request_id)

    def request_finished(self, request: Any) -> None:
        """A request ended (an abort, typically while its KV was still loading or queued): stop its fetch
        or give its claimed lease back."""
        if request.request_id in self._loading:
            self._plan.cancels.append(request.request_id)
        self._unclaim(request.request_id)

    def finished_recving(self, request_ids) -> None:
        self._loading.difference_update(request_ids or ())

    def take_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        return plan
