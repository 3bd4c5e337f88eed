"""The raw baseline's target, whole: what vLLM's NixlConnector does on the prefill for each notification.

The raw flow is one READ carrying a notification; the prefill then frees the request's blocks.  Per
engine step its worker drains ``get_new_notifs`` (``_get_new_notifs``: parse ``"req_id:tp_size"``,
look the request up, count consumers, and once all have read drop it from the requests to send),
sweeps the requests whose lease expired (``get_finished``), and its scheduler frees the finished
requests' blocks (``KVCacheManager.free``: each block's reference count down, the blocks at zero
appended to the free-block queue, a doubly linked list).  ``PeerEngine`` does that work, no more:
the ratio against it is what kvlend's safety costs over the flow teams run today.
"""

from __future__ import annotations

import time
from collections import defaultdict

RAW_BASELINE = ("raw_nixl_notif (and scenario 3's raw_nixl_prepped) is NixlConnector's per-request flow, whole: one "
                "READ of the request's pages carrying a notification 'req_id:1'; the target, polling, looks the "
                "request up in its table and frees its blocks to a free-block queue, as vLLM's engine does")
LEASE_S = 480.0  # VLLM_NIXL_ABORT_REQUEST_TIMEOUT's default: a request nobody reads is freed after it


class Block:
    """One KV block of the pool, as vLLM's ``KVCacheBlock``: a reference count and free-queue links."""

    __slots__ = ("block_id", "ref_cnt", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free: Block | None = None
        self.next_free: Block | None = None


class FreeBlocks:
    """vLLM's ``FreeKVCacheBlockQueue``: a doubly linked list between two sentinels."""

    def __init__(self, blocks: list[Block]) -> None:
        self.head, self.tail = Block(-1), Block(-2)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.count = 0
        self.append_n(blocks)

    def popleft_n(self, n: int) -> list[Block]:
        out = []
        block = self.head.next_free
        for _ in range(n):
            assert block is not None and block is not self.tail, "the bench's block pool is too small"
            out.append(block)
            block = block.next_free
        self.head.next_free = block
        assert block is not None
        block.prev_free = self.head
        for b in out:
            b.prev_free = b.next_free = None
        self.count -= n
        return out

    def append_n(self, blocks: list[Block]) -> None:
        last = self.tail.prev_free
        assert last is not None
        for block in blocks:
            block.prev_free, last.next_free = last, block
            last = block
        last.next_free, self.tail.prev_free = self.tail, last
        self.count += len(blocks)


class PeerEngine:
    """The prefill's side of NixlConnector's per-request flow: a table of requests waiting to be read,
    and the block pool their blocks return to once their readers' notifications came."""

    def __init__(self) -> None:
        self.free = FreeBlocks([])
        self.made = 0  # blocks in the pool: grown as requests are expected
        self.req_to_blocks: dict[str, list[Block]] = {}
        self.reqs_to_send: dict[str, float] = {}  # request -> when its lease expires, oldest first
        self.reqs_to_process: set[str] = set()
        self.consumer_counts: defaultdict[str, int] = defaultdict(int)
        self.notifications = self.freed = self.unknown = 0

    def expect(self, requests: list[tuple[str, int]]) -> None:
        """Requests whose prefill finished, (name, blocks) each: each holds its blocks until its readers
        notify (vLLM's ``request_finished`` with ``delay_free_blocks``; not timed: it precedes the read)."""
        need = sum(blocks for _, blocks in requests) - self.free.count
        if need > 0:
            self.free.append_n([Block(self.made + i) for i in range(need)])
            self.made += need
        expires = time.perf_counter() + LEASE_S
        for name, blocks in requests:
            taken = self.free.popleft_n(blocks)
            for block in taken:
                block.ref_cnt += 1
            self.req_to_blocks[name] = taken
            self.reqs_to_send[name] = expires
            self.reqs_to_process.add(name)

    def step(self, agent) -> int:
        """One engine step: take the notifications, free the requests all their readers have read,
        sweep expired leases.  How many notifications came."""
        done: set[str] = set()
        seen = 0
        for notifs in agent.get_new_notifs().values():
            for notif in notifs:
                seen += 1
                try:
                    req_id, tp_size = notif.decode("utf-8").rsplit(":", 1)
                except ValueError:  # not a reader's "req_id:tp_size" (NixlConnector would raise)
                    self.unknown += 1
                    continue
                if req_id not in self.reqs_to_send and req_id not in self.reqs_to_process:
                    self.unknown += 1  # NixlConnector logs "Potentially invalid KV blocks" and skips it
                    continue
                self.consumer_counts[req_id] += 1
                if self.consumer_counts[req_id] == int(tp_size):
                    done.add(req_id)
                    del self.consumer_counts[req_id]
                    self.reqs_to_process.remove(req_id)
                    self.reqs_to_send.pop(req_id, None)
        now = time.perf_counter()
        while self.reqs_to_send:
            req_id, expires = next(iter(self.reqs_to_send.items()))
            if now < expires:
                break
            self.consumer_counts.pop(req_id, 0)
            self.reqs_to_process.remove(req_id)
            del self.reqs_to_send[req_id]
            done.add(req_id)
        for req_id in done:
            self._free(req_id)
        self.notifications += seen
        return seen

    def _free(self, req_id: str) -> None:
        """The scheduler's ``KVCacheManager.free``: the blocks, last first, back to the pool."""
        blocks = self.req_to_blocks.pop(req_id, [])
        freed = []
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        self.free.append_n(freed)
        self.freed += 1


def notification(request: str, readers: int = 1) -> bytes:
    """The notification a reader's READ carries, as NixlConnector's: ``"req_id:tp_size"``."""
    return f"{request}:{readers}".encode()
