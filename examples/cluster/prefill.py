"""The cluster loopback's prefill rank: page slots filled with a request's KV and lent under a ticket."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np

from kvlend.runtime import PrefillNode, reload_on_sighup
from kvlend.security.credentials import Credentials
from multinode_rank import backend, config, emit, make_pools  # examples/, the rank script's folder

from .api import ApiServer
from .kv import build_layout, page_shape, pages_of, request_pattern
from .watch import Watch, open_registry, say


class Lending:
    """The prefill's page slots: which are free, which each live lease holds."""

    def __init__(self, args, pools, layout) -> None:
        self.args, self.pools, self.layout = args, pools, layout
        self.rng = np.random.default_rng([args.seed, 11])  # slots in a seeded random order
        self.free = set(range(args.pool_pages))
        self.leases: dict[bytes, np.ndarray] = {}
        self.lent = self.refused = 0
        self.released: dict[str, int] = {}
        self.node: PrefillNode | None = None
        self.lock = threading.Lock()

    def lend(self, request: str, tokens: int) -> dict | None:
        """Fill free slots with ``request``'s KV and lend them; None when too few are free."""
        n = pages_of(self.args, tokens)
        with self.lock:
            if n > len(self.free):
                self.refused += 1
                return None
            slots = self.rng.choice(np.fromiter(self.free, dtype=np.int64), n, replace=False)
            self.free.difference_update(slots.tolist())
        try:
            for layer, pair in enumerate(self.pools):  # the slots are ours alone until lent
                for role in (0, 1):
                    pair[role][slots] = request_pattern(self.args.seed, request, layer, role, page_shape(self.args, n))
            with self.lock:  # ``release`` waits for the lease to be known
                ticket = self.node.lend(request, tokens, {"full": slots}, self.layout.full_selection())
                self.leases[ticket.lease] = slots
                self.lent += 1
        except BaseException:
            with self.lock:
                self.free.update(slots.tolist())
            raise
        return {"ticket": ticket.to_text(), "prefill": self.node.name}

    def release(self, lease, reason: str) -> None:  # on_release: the node's thread
        with self.lock:
            slots = self.leases.pop(lease.id, None)
            if slots is not None:
                self.free.update(slots.tolist())
            self.released[reason] = self.released.get(reason, 0) + 1

    @property
    def live(self) -> int:
        with self.lock:
            return len(self.leases)


def run_prefill(args, credentials: Credentials) -> int:
    stopping: list[int] = []  # a handler may take no lock (it may interrupt the lock's holder): just a flag
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    pools = make_pools(args, args.heads, args.pool_pages, fill=False)
    layout = build_layout(pools)
    lending = Lending(args, pools, layout)
    api = ApiServer((args.host, args.api_port), lending, credentials.context(server=True))
    registry = open_registry(args)
    watch = Watch(registry)
    capacity = max(1, args.pool_pages // pages_of(args, args.tokens))
    node = PrefillNode(layout, backend(args, "prefill", credentials), credentials, host=args.host, port=args.port,
                       config=config(args), on_release=lending.release, registry=registry, capacity=capacity,
                       meta={"api": f"{args.host}:{api.server_address[1]}"})
    reload_on_sighup(node)  # renewed certificate files take over for new links
    lending.node = node
    node.start()
    serving = threading.Thread(target=api.serve_forever, kwargs={"poll_interval": 0.1}, name="api", daemon=True)
    serving.start()
    ready = registry.ready(args.timeout)
    watch.start()
    say(f"LISTENING {node.address[0]} {node.address[1]} api {api.server_address[1]} registry "
        f"{'ready' if ready else 'NOT READY'}")
    until = time.monotonic() + args.serve
    while not stopping and time.monotonic() < until:  # until told to stop (signal or file), or the limit
        if args.stop_file and os.path.exists(args.stop_file):
            break
        time.sleep(0.1)
    say(f"STOPPING {time.time():.3f} leases {lending.live}")
    api.shutdown()
    api.server_close()
    drain_by = time.monotonic() + args.ttl + 2.0  # a lease nobody reads ends by its TTL
    while lending.live and time.monotonic() < drain_by:
        time.sleep(0.05)
    say(f"DRAINED {time.time():.3f} leases {lending.live}")
    events = watch.close()
    with lending.lock:
        result = {"role": "prefill", "identity": node.name, "api": api.server_address[1], "lent": lending.lent,
                  "refused": lending.refused, "released": dict(lending.released),
                  "leases_left": len(lending.leases), "registry_ready": ready, "events": events}
    result["ok"] = ready and result["leases_left"] == 0
    emit(args, result)
    node.close()
    registry.close()
    node.backend.close()
    return 0 if result["ok"] else 1
