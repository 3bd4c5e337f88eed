"""Scenario 4: a cold peer, first contact to first verified byte: kvlend's control channel against
NIXL's own listener."""

from __future__ import annotations

import os
import time

import numpy as np

from kvlend.ports import spare_port

from ...backend import NixlBackend
from ...nixl_build import api
from ..lender_process import LenderProcess
from ..pools import GROUP, PAGE_BYTES, descriptor_rows, expected_ok, make_pools
from ..sizes import Sizes
from ..timing import BenchError, backoff


def run(lender: LenderProcess, backend, sizes: Sizes, progress) -> dict:
    """First contact to first verified byte: kvlend's control channel vs NIXL's listener (one sample each)."""
    import tempfile

    from kvlend.runtime import DecodeNode
    from kvlend.security.certs import Authority, save_rank

    n = sizes.s3_pages
    ca = Authority.create()  # a throwaway cluster: the lender loads its rank's files, then they go
    with tempfile.TemporaryDirectory(prefix="kvlend-bench-") as certs:
        host, port = lender.call("prefill", {"pages": n, "credentials": save_rank(ca.issue("bench-prefill",
                                                                                           "prefill"), certs)})
    arrays, layout = make_pools(n, 1, False, fill=False)
    progress("scenario 4: cold decode -> PrefillNode (TCP and TLS handshakes, negotiate, add_peer, first read)")
    cold_backend = NixlBackend(f"cold-decode-{os.getpid()}")
    decode = DecodeNode(layout, cold_backend, ca.issue("bench-decode", "decode"))
    try:
        start = time.perf_counter()
        link = decode.connect(host, port)
        peer, offer = decode.next_offer(30.0)
        decode.fetch(peer, offer, {GROUP: np.arange(n)})
        kv_s = time.perf_counter() - start
        slots = np.arange(n)
        verified = all(expected_ok(a, r, slots, slots) for r, a in enumerate(arrays))
        handshake_ms = link.handshake_ms
    finally:
        decode.close()
        cold_backend.close()
    progress("scenario 4: cold raw NIXL agent -> peer listener (fetch_remote_metadata, first read)")
    free = spare_port()  # for the peer's listener
    nbytes = n * 2 * PAGE_BYTES
    name, address = lender.call("listener", {"port": free, "bytes": nbytes})
    dst = np.zeros(nbytes // 8, np.uint64)
    agent = api.nixl_agent(f"cold-raw-{os.getpid()}", api.nixl_agent_config(enable_listen_thread=True, listen_port=0))
    reg = agent.register_memory(descriptor_rows(np.array([dst.ctypes.data]), np.array([nbytes])), "DRAM")
    try:
        start = time.perf_counter()
        agent.fetch_remote_metadata(name, "127.0.0.1", free)
        deadline = time.monotonic() + 30.0
        while not agent.check_remote_metadata(name):
            if time.monotonic() > deadline:
                raise BenchError("NIXL listener metadata did not arrive within 30 s")
            time.sleep(0.0005)
        local = agent.get_xfer_descs(descriptor_rows(np.array([dst.ctypes.data]), np.array([nbytes])), "DRAM")
        remote = agent.get_xfer_descs(descriptor_rows(np.array([address]), np.array([nbytes])), "DRAM")
        h = agent.initialize_xfer("READ", local, remote, name)
        state = agent.transfer(h)
        spins = 0
        while state == "PROC":
            spins = backoff(spins, deadline, "cold raw NIXL read")
            state = agent.check_xfer_state(h)
        raw_s = time.perf_counter() - start
        h.release()
        raw_ok = state == "DONE" and bool(np.array_equal(dst, np.arange(dst.size, dtype=np.uint64)))
    finally:
        agent.deregister_memory(reg)
    return {
        "name": "cold peer: first contact to first verified byte (one sample each)", "pages": n, "bytes": nbytes,
        "results": {"kvlend": {"ms": kv_s * 1e3, "handshake_ms": handshake_ms, "verified": verified},
                    "raw_nixl_listener": {"ms": raw_s * 1e3, "verified": raw_ok}},
        "ratios": {"kvlend/raw time": kv_s / raw_s},
        "targets": {"kvlend <= 50 ms": kv_s * 1e3 <= 50},
    }
