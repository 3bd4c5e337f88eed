"""The reading side: a NixlBackend, local pools, a plan against the lender's, and every timed path
(kvlend's own, raw NIXL with various descriptor lists, prepared lists) over the same bytes."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from kvlend.core.layout import PageLayout
from kvlend.core.lender import Lender
from kvlend.core.negotiate import negotiate
from kvlend.core.plan import plan_reads
from kvlend.core.tracker import DeliveryTracker
from kvlend.errors import KvlendError

from .lender_process import LenderProcess
from .pools import GROUP, descriptor_rows, expected_ok, host_region, make_pools
from .timing import XFER_TIMEOUT, BenchError, backoff


class Reader:
    """This side: a NixlBackend, the local pools, a plan against the lender's, and the timed paths."""

    def __init__(self, lender: LenderProcess, backend, pages: int, layers: int, combined: bool, staging: int) -> None:
        encoded, metadata, self.remote_staging = lender.call(
            "pools", {"pages": pages, "layers": layers, "combined": combined, "staging": staging})
        self.lender_proc = lender
        self.backend = backend
        self.remote = PageLayout.decode(encoded)
        self.arrays, self.local = make_pools(pages, layers, combined, fill=False)
        self.staging = np.zeros(max(staging, 1), np.uint8)
        backend.deregister()
        backend.register(list(self.local.regions) + [host_region(self.staging, "staging")])
        self.peer = backend.add_peer(metadata)
        self.agent = backend._agent
        self.plan = negotiate(self.local, self.remote)
        self.lender = Lender(self.remote)  # the lend runs here: same CPU work, no control channel
        self.tracker = DeliveryTracker(self.local)
        self.selection = self.local.full_selection()
        self.seq = 0
        self._prepped = None  # (local handle, remote handle, local and remote first index of each region)

    # the kvlend path: lend + plan + post + poll + tracker + release
    def kvlend(self, src: np.ndarray, dst: np.ndarray, tokens: int) -> int:
        self.seq += 1
        request = f"r{self.seq}"
        lease = self.lender.lend(request, tokens, {GROUP: src}, self.selection, time.monotonic(), 60.0)
        batches = plan_reads(self.plan, lease.pages, {GROUP: dst}, lease.selection)
        self.tracker.begin(request, tokens)
        tag = request.encode()
        self.backend.post_read(self.peer, batches, tag)
        self.tracker.post(request, 0, {GROUP: lease.pages[GROUP].token_pages})
        deadline = time.monotonic() + XFER_TIMEOUT
        spins = 0
        while not self.tracker.complete(request):
            for c in self.backend.poll():
                if c.error is not None:
                    raise BenchError(f"kvlend read {tag!r} failed: {c.error}")
                self.tracker.done(request, 0)
            spins = backoff(spins, deadline, "kvlend read")
        self.tracker.finish(request)
        self.lender.release(lease.id)
        return sum(b.count for b in batches)

    def descriptors(self, src: np.ndarray, dst: np.ndarray, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """kvlend's own coalesced descriptors for a request (local, remote)."""
        lease = self.lender.lend("plan-only", tokens, {GROUP: src}, self.selection, time.monotonic(), 60.0)
        batches = plan_reads(self.plan, lease.pages, {GROUP: dst}, lease.selection)
        self.lender.release(lease.id)
        return np.concatenate([b.local for b in batches]), np.concatenate([b.remote for b in batches])

    def per_page(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One descriptor per page per layer buffer, as common connectors post."""
        local, remote = [], []
        for lr, rr in zip(self.local.regions, self.remote.regions):
            local.append(descriptor_rows(lr.address + dst * lr.page_stride, np.full(len(dst), lr.page_stride)))
            remote.append(descriptor_rows(rr.address + src * rr.page_stride, np.full(len(src), rr.page_stride)))
        return np.concatenate(local), np.concatenate(remote)

    def raw(self, local: np.ndarray, remote: np.ndarray, notif: bytes = b"") -> None:
        a = self.agent
        self._wait(a.initialize_xfer("READ", a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(remote, "DRAM"),
                                     self.peer, notif))

    def prepped(self, src: np.ndarray, dst: np.ndarray, notif: bytes = b"") -> None:
        """Raw NIXL the way vLLM's NixlConnector posts: page lists prepared once per side (one strided
        row per region), then ``make_prepped_xfer`` by page index; NIXL merges adjacent entries."""
        a = self.agent
        if self._prepped is None:
            def strided(regions, agent_name):
                rows = np.array([[r.address, r.page_stride, 0, r.page_stride, r.num_pages] for r in regions],
                                dtype=np.uint64)
                return a.prep_xfer_dlist(agent_name, rows, "DRAM")
            def first_index(regions):
                return np.concatenate([[0], np.cumsum([r.num_pages for r in regions])[:-1]]).astype(np.int64)
            self._prepped = (strided(self.local.regions, "NIXL_INIT_AGENT"), strided(self.remote.regions, self.peer),
                             first_index(self.local.regions), first_index(self.remote.regions))
        local_h, remote_h, local_base, remote_base = self._prepped
        local_idx = (local_base[:, None] + dst[None, :]).ravel()
        remote_idx = (remote_base[:, None] + src[None, :]).ravel()
        self._wait(a.make_prepped_xfer("READ", local_h, local_idx, remote_h, remote_idx, notif))

    def _wait(self, h) -> None:
        """Post ``h`` and poll it to DONE, then release it."""
        a = self.agent
        try:
            state = a.transfer(h)
            deadline = time.monotonic() + XFER_TIMEOUT
            spins = 0
            while state == "PROC":
                spins = backoff(spins, deadline, "raw NIXL read")
                state = a.check_xfer_state(h)
            if state != "DONE":
                raise BenchError(f"raw NIXL read ended in state {state}")
        finally:
            h.release()

    def verified(self, fn: Callable[[], object], src: np.ndarray, dst: np.ndarray) -> bool:
        """Zero the destination pages, run ``fn`` once, check every word landed where it belongs."""
        for a in self.arrays:
            a[dst] = 0
        fn()
        return all(expected_ok(a, r, src, dst) for r, a in enumerate(self.arrays))

    def close(self) -> None:
        if self._prepped is not None:
            for handle in self._prepped[:2]:
                self.agent.release_dlist_handle(handle)
        try:
            self.backend.remove_peer(self.peer)
        except KvlendError:
            pass
