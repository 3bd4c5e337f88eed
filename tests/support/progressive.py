"""What the ``test_progressive_sessions*`` files share: their config, a hybrid model's ends and helpers.

Those files drive progressive lending (issue 17) end to end over ``kvlend.testing``: a prefill lends a
request's pages while its chunked prefill still runs and grows the lease chunk by chunk.  The hybrid ends
add a recurrent layer (group "ssm", one state row per request) to the tests' layout.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvlend.core.layout import BufferDesc, HeadGeometry, LayerIdentity, LayerKind, MemoryRegion, Role
from kvlend.protocol.config import NodeConfig
from kvlend.protocol.decode import DecodeSession
from kvlend.protocol.prefill import PrefillSession
from kvlend.testing import KIND, DecodeEnd, Memory, MemoryBackend, PrefillEnd, World, connected, rig as memory_rig
from kvlend.testing.kvcache import SENTINEL, FreeList, group_layers, make_layout, make_pools, pattern, slots

CFG = NodeConfig(ttl=5.0, heartbeat=1.0, handshake_timeout=3.0, transfer_timeout=20.0, cancel_grace=2.0,
                 chunk_pages=4)
TPP = 4
EPS_T = 0.01
STATE_LAYER = 4  # the hybrid layout's recurrent layer: one state row per request, group "ssm"
STATE_ROW = 64  # bytes


# ------------------------------------------------------------------ hybrid ends
def hybrid_pools_and_layout(pages: int):
    """The tests' layout (layers 0-1 "full", 2-3 "swa": 64-token window, 1 sink page) plus a recurrent
    layer 4 in group "ssm" whose state row lives in a pool of its own (named like the others)."""
    pools = make_pools(pages)
    base = make_layout(pools)
    state = np.zeros((pages, STATE_ROW), dtype=np.uint8)
    kind = base.regions[0].kind
    region = MemoryRegion(f"L{STATE_LAYER}.kv", kind, base.regions[0].device_id, state.nbytes, STATE_ROW, pages,
                          state.ctypes.data)
    buf = BufferDesc(f"L{STATE_LAYER}.K", region.name, 0, STATE_ROW,
                     LayerIdentity(STATE_LAYER, LayerKind.RECURRENT, Role.STATE), "ssm", HeadGeometry(4, 16))
    layout = dataclasses.replace(base, regions=base.regions + (region,), buffers=base.buffers + (buf,))
    return [*pools, state], layout


class HybridPrefill(PrefillEnd):
    """A prefill whose layout has a recurrent group: its table is one state slot per request."""

    def __init__(self, world, name, host, port, pages, config, offset, certified):
        super().__init__(world, name, host, port, pages, config, offset, certified)
        self.pools, self.layout = hybrid_pools_and_layout(pages)
        self.memory = Memory(self.pools)
        self.session = PrefillSession(self.layout, KIND, self.metadata, name=name, config=config)
        self.free = {g: FreeList(pages, world.np_rng) for g in self.layout.groups}

    def _tables(self, num_tokens: int, seed: int) -> dict:
        tables = {}
        n_pages = -(-num_tokens // TPP)
        for name, group in self.layout.groups.items():
            rows = group.pages_read(num_tokens, TPP)
            table = np.full(1 if group.recurrent else n_pages, -1, dtype=np.int64)
            table[rows] = self.free[name].alloc(rows.size)
            for layer in group_layers(self.layout, name):
                view = slots(self.pools[layer])
                view[table[rows]] = pattern(seed, layer, n_pages, view.shape[1])[rows]
            tables[name] = table
        return tables


class HybridDecode(DecodeEnd):
    def __init__(self, world, name, pages, config, certified):
        super().__init__(world, name, pages, config, certified)
        self.pools, self.layout = hybrid_pools_and_layout(pages)
        for pool in self.pools:
            slots(pool)[:] = SENTINEL
        self.memory = Memory(self.pools)
        self.session = DecodeSession(self.layout, KIND, name=name, config=config)
        self.backend = MemoryBackend(world, self)
        self.free = {g: FreeList(pages, world.np_rng) for g in self.layout.groups}

    def alloc(self, num_tokens: int, resume_from: int = 0, seed: int | None = None) -> dict:
        n_pages = -(-num_tokens // TPP)
        dst = {}
        for name, group in self.layout.groups.items():
            table = dst[name] = self.free[name].alloc(1 if group.recurrent else n_pages)
            kept = np.zeros(0, dtype=np.int64) if group.recurrent else self.kept_pages(resume_from)
            for layer in group_layers(self.layout, name):
                view = slots(self.pools[layer])
                view[table] = SENTINEL
                if kept.size:
                    view[table[kept]] = pattern(seed, layer, n_pages, view.shape[1])[kept]
        return dst

    def expected(self, record, layer: int, n_pages: int) -> np.ndarray:
        if layer != STATE_LAYER:
            return super().expected(record, layer, n_pages)
        return pattern(record.seed, layer, n_pages, STATE_ROW)[:1]


def add_prefill(world: World, name: str = "prefill", *, port: int = 7000, config: NodeConfig = CFG,
                hybrid: bool = False):
    if not hybrid:
        return world.add_prefill(name, port=port, config=config)
    p = HybridPrefill(world, name, "10.0.0.1", port, 256, config, 0.0, True)
    world.prefills.append(p)
    world.by_metadata[p.metadata] = p
    return p


def add_decode(world: World, name: str = "decode", *, config: NodeConfig = CFG, hybrid: bool = False):
    if not hybrid:
        return world.add_decode(name, config=config)
    d = HybridDecode(world, name, 256, config, True)
    world.decodes.append(d)
    return d


def add_hybrid(world: World, *, config: NodeConfig = CFG):
    return add_prefill(world, config=config, hybrid=True), add_decode(world, config=config, hybrid=True)


# ------------------------------------------------------------------ helpers
def rig(config: NodeConfig = CFG, *, seed: int = 0, hybrid: bool = False, **world_kw):
    """``kvlend.testing.rig``, or the same with a hybrid model's ends (``hybrid``)."""
    if not hybrid:
        return memory_rig(config, seed=seed, **world_kw)
    world = World(seed, **world_kw)
    p, d = add_hybrid(world, config=config)
    return world, p, d, connected(world, p, d)


def locked(prefill) -> int:
    return prefill.lender.locks.locked_pages()


def complete(ready: int, n: int) -> int:
    """Token pages wholly committed at ``ready`` tokens of ``n`` (all of them once final)."""
    return -(-n // TPP) if ready >= n else ready // TPP


def posted_pages(d, record, reads) -> dict[str, list[int]]:
    """Per local group, the token pages of ``record``'s destination that ``reads`` write."""
    inverse = {}
    for name, table in record.dst.items():
        for layer in group_layers(d.layout, name):
            for page, slot in enumerate(np.asarray(table).tolist()):
                inverse[(layer, slot)] = (name, page)
    out: dict[str, set] = {name: set() for name in record.dst}
    for read in reads:
        for _, _, laddr, length in read.copies:
            layer, off = d.memory.locate(laddr, length)
            stride = slots(d.pools[layer]).shape[1]
            for slot in range(off // stride, (off + length - 1) // stride + 1):
                name, page = inverse[(layer, slot)]
                out[name].add(page)
    return {name: sorted(v) for name, v in out.items()}


def new_reads(d, before: set) -> list:
    return [read for tag, read in d.backend.reads.items() if tag not in before]


def push_progressive(p, peer: str, n: int, seed: int, ready: int):
    """A progressive lease pushed to ``peer`` (``PrefillSession.offer(..., ready=)``)."""
    return p.offer(peer, n, seed, ready=ready)


def inject(world, p, d, conn, message) -> None:
    """A buggy prefill sends ``message`` on the decode's link ``conn``."""
    wire = world.wire(d, conn)
    p.session._peers[wire.pconn].conn.send(message)
    world.pump()


def both_groups(pages: list[int]) -> dict[str, list[int]]:
    return {"full": pages, "swa": pages}
