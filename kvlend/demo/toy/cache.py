"""The paged KV cache: attention pools and recurrent state slots, a scattering page allocator, the
cache as a PageLayout, and merging tensor-parallel shards."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Sequence

import numpy as np
import torch

from kvlend.core.layout import (
    BufferDesc,
    HeadGeometry,
    LayerIdentity,
    LayerKind,
    MemoryRegion,
    PageLayout,
    ReplicaRank,
    Role,
    Sharding,
    array_info,
    layout_from_pools,
)
from kvlend.errors import PageRangeError

from .config import LAYER_KINDS, ModelConfig, ToyEngineError, check_int


def _scattered_order(num_pages: int, seed: int, max_run: int) -> np.ndarray:
    """Page ordinals as runs of 1..max_run contiguous pages, runs in seeded random order."""
    rng = np.random.default_rng(seed)
    cuts = np.cumsum(rng.integers(1, max_run + 1, size=num_pages))
    runs = np.split(np.arange(num_pages, dtype=np.int64), cuts[cuts < num_pages])
    return np.concatenate([runs[j] for j in rng.permutation(len(runs))])


class PagedKVCache:
    """One pool tensor per attention layer, ``[num_pages, 2, heads, tokens_per_page, head_dim]`` (K|V, HND),
    and one state pool per recurrent layer, ``[state_slots, ssm state + conv state]``.

    The allocator hands pages out in a seeded, scattered order (short
    contiguous runs in random order) so transfers exercise coalescing; freed
    pages go to the back of the free list.  ``scatter=False`` hands them out
    in ascending order.  State slots (one per request) come from their own
    free list.

    ``replica`` with ``tp_size > 1`` makes a shard holding only that rank's
    ``kv_heads / tp_size`` heads: a transfer target addressed with the whole
    cache's page and slot ordinals, merged into it by ``merge_shards``
    before the model uses it.  ``host_layers`` names
    attention layers whose pools stay in host memory (pinned when CUDA is
    available) even when the cache is on a GPU: the HOST tier of the layout.
    """

    def __init__(self, config: ModelConfig, num_pages: int, device: str | torch.device = "cpu", *,
                 scatter: bool = True, seed: int = 0, max_run: int = 4, state_slots: int | None = None,
                 replica: ReplicaRank = ReplicaRank(), host_layers: Sequence[int] = ()):
        if not isinstance(config, ModelConfig):
            raise ToyEngineError(f"config: must be a ModelConfig, got {type(config).__name__}")
        check_int("num_pages", num_pages, 1)
        check_int("seed", seed, 0)
        check_int("max_run", max_run, 1)
        state_slots = num_pages if state_slots is None else state_slots
        check_int("state_slots", state_slots, 1)
        if not isinstance(replica, ReplicaRank) or config.kv_heads % replica.tp_size:
            raise ToyEngineError(f"replica: kv_heads {config.kv_heads} do not split over {replica!r}")
        host = set(host_layers)
        if not host <= set(config.attention_layers):
            raise ToyEngineError(f"host_layers: {sorted(host - set(config.attention_layers))} "
                                 f"are not attention layers {list(config.attention_layers)}")
        self.config = config
        self.num_pages = int(num_pages)
        self.device = torch.device(device)
        self.replica = replica
        self.heads = config.kv_heads // replica.tp_size
        self.host_layers = tuple(sorted(host))
        shape = (self.num_pages, 2, self.heads, config.tokens_per_page, config.head_dim)
        self.tensors: list[torch.Tensor] = [self._zeros(shape, i in host) for i in config.attention_layers]
        self.states: list[torch.Tensor] = [
            self._zeros((state_slots, sum(config.state_floats)), False) for _ in config.ssm_layers
        ]
        self._pools = dict(zip(config.attention_layers, self.tensors))
        self._state_pools = dict(zip(config.ssm_layers, self.states))
        order = _scattered_order(self.num_pages, seed, max_run) if scatter else np.arange(self.num_pages)
        self._free: deque[int] = deque(int(p) for p in order)
        self._allocated = np.zeros(self.num_pages, dtype=bool)
        self._free_slots: deque[int] = deque(range(state_slots))
        self._slot_used = np.zeros(state_slots, dtype=bool)

    def _zeros(self, shape: tuple[int, ...], host: bool) -> torch.Tensor:
        dtype = self.config.torch_dtype
        if host and self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, pin_memory=torch.cuda.is_available())
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def pool(self, layer: int) -> torch.Tensor:
        """The K|V pool of attention layer ``layer`` (model layer id)."""
        return self._pools[layer]

    def state_pool(self, layer: int) -> torch.Tensor:
        """The state pool of recurrent layer ``layer`` (model layer id)."""
        return self._state_pools[layer]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray:
        """``n`` free page ordinals (int64), now allocated."""
        check_int("alloc n", n, 0)
        if n > len(self._free):
            raise PageRangeError(f"alloc: {n} pages requested, only {len(self._free)} of {self.num_pages} free")
        pages = np.fromiter((self._free.popleft() for _ in range(n)), dtype=np.int64, count=n)
        self._allocated[pages] = True
        return pages

    def free(self, ordinals: Sequence[int] | np.ndarray) -> None:
        """Return allocated pages; a page not allocated, or named twice, is refused before any change."""
        pages = self._ordinals(ordinals, "free")
        if np.unique(pages).size != pages.size:
            raise PageRangeError(f"free: duplicate page ordinals in {pages.tolist()}")
        self._allocated[pages] = False
        self._free.extend(pages.tolist())

    def alloc_state(self) -> int | None:
        """A free state slot for one request, or None when the model has no recurrent layer."""
        if not self.states:
            return None
        if not self._free_slots:
            raise PageRangeError(f"alloc_state: all {self._slot_used.size} state slots are in use")
        slot = self._free_slots.popleft()
        self._slot_used[slot] = True
        return slot

    def free_state(self, slot: int | None) -> None:
        if slot is None and not self.states:
            return
        self.check_state(slot)
        self._slot_used[slot] = False
        self._free_slots.append(int(slot))

    def check_state(self, slot: Any) -> int | None:
        """``slot`` after checking it is an allocated state slot (None when there is no recurrent layer)."""
        if not self.states:
            if slot is not None:
                raise ToyEngineError(f"state: the model has no recurrent layer, got slot {slot!r}")
            return None
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) \
                or not 0 <= slot < self._slot_used.size or not self._slot_used[slot]:
            raise PageRangeError(f"state: {slot!r} is not an allocated state slot of recurrent layers "
                                 f"{list(self.config.ssm_layers)}")
        return int(slot)

    def check_table(self, page_table: Sequence[int] | np.ndarray, num_tokens: int) -> np.ndarray:
        """The page table as int64, after checking it covers ``num_tokens`` with allocated pages."""
        table = self._ordinals(page_table, "page_table")
        check_int("num_tokens", num_tokens, 0)
        need = -(-num_tokens // self.config.tokens_per_page)
        if table.size < need:
            raise PageRangeError(f"page_table: {table.size} pages cannot hold {num_tokens} tokens (need {need})")
        return table

    def _ordinals(self, ordinals: Sequence[int] | np.ndarray, where: str) -> np.ndarray:
        pages = np.asarray(ordinals)
        if pages.ndim != 1 or (pages.size and not np.issubdtype(pages.dtype, np.integer)):
            raise PageRangeError(f"{where}: expected a 1-D array of ints, got shape {pages.shape} dtype {pages.dtype}")
        pages = pages.astype(np.int64)
        bad = pages[(pages < 0) | (pages >= self.num_pages)]
        if bad.size:
            raise PageRangeError(f"{where}: page ordinal {int(bad[0])} is outside [0, {self.num_pages})")
        loose = pages[~self._allocated[pages]]
        if loose.size:
            raise PageRangeError(f"{where}: page {int(loose[0])} is not allocated")
        return pages

    def page_view(self, layer: int) -> np.ndarray:
        """The ``layer``-th attention pool as uint8 ``[num_pages, page_bytes]``, sharing memory (CPU only)."""
        check_int("layer", layer, 0)
        if layer >= len(self.tensors):
            raise ToyEngineError(f"layer: {layer} is outside [0, {len(self.tensors)})")
        if self.tensors[layer].device.type != "cpu":
            raise ToyEngineError(f"page_view: needs a CPU pool, this one is on {self.device}")
        return self.tensors[layer].view(torch.uint8).reshape(self.num_pages, -1).numpy()

    def group_tables(self, page_table: np.ndarray, state: int | None = None) -> dict[str, np.ndarray]:
        """A request's slots per layout group: the page table for attention groups, ``[state]`` for "ssm"."""
        tables = {group: np.asarray(page_table) for group in self.layout_groups if group != "ssm"}
        if "ssm" in self.layout_groups:
            if isinstance(state, bool) or not isinstance(state, (int, np.integer)):
                raise ToyEngineError(f"state: the model has recurrent layers, so a state slot is needed, got {state!r}")
            tables["ssm"] = np.array([state], dtype=np.int64)
        return tables

    @property
    def layout_groups(self) -> tuple[str, ...]:
        """The groups of ``layout()``, named after their layers' kinds."""
        return tuple(k for k in LAYER_KINDS if k in self.config.kinds)

    def layout(self, kept_window: int | None = None, *, scope: str | None = None,
               replica: ReplicaRank | None = None) -> PageLayout:
        """The pools as a PageLayout; defaults: kept window ``max_context``, scope the config digest.

        Groups: ``full`` and ``swa`` attention (``swa`` declares the window and
        the sink pages covering ``sink_tokens``), and ``ssm``: per recurrent
        layer one region of state slots holding a STATE and a CONV buffer,
        REPLICATED across tensor-parallel ranks (every rank keeps the whole state).
        """
        c = self.config
        tpp = c.tokens_per_page
        kept = c.max_context if kept_window is None else kept_window
        attn = layout_from_pools(
            kv=self.tensors, tokens_per_page=tpp, kept_window=kept,
            scope=c.scope if scope is None else scope, replica=self.replica if replica is None else replica,
            layer_ids=c.attention_layers, windows={i: c.window for i in c.attention_layers if c.kinds[i] == "swa"},
            sinks=-(-c.sink_tokens // tpp),
        )
        if not self.states:
            return attn
        regions, buffers = list(attn.regions), list(attn.buffers)
        item = self.states[0].element_size()
        for layer, pool in zip(c.ssm_layers, self.states):
            info = array_info(pool)
            region = f"L{layer}.state"
            stride = info.nbytes // pool.shape[0]
            regions.append(MemoryRegion(region, info.kind, info.device_id, info.nbytes, stride, pool.shape[0],
                                        info.address))
            offset = 0
            for role, floats in zip((Role.STATE, Role.CONV), c.state_floats):
                nbytes = floats * item
                buffers.append(BufferDesc(
                    name=f"L{layer}.{role.value}", region=region, offset=offset, page_bytes=nbytes,
                    identity=LayerIdentity(layer, LayerKind.RECURRENT, role), group="ssm",
                    geometry=HeadGeometry(1, nbytes, sharding=Sharding.REPLICATED),
                ))
                offset += nbytes
        return dataclasses.replace(attn, regions=tuple(regions), buffers=tuple(buffers))


def merge_shards(cache: PagedKVCache, shards: Sequence[PagedKVCache], page_table: np.ndarray,
                 state: int | None = None) -> None:
    """Copy tensor-parallel shards' head slices of ``page_table``'s pages (same ordinals) into ``cache``.

    Recurrent state is replicated: it is taken from shard 0, after checking
    every shard holds the same bytes.
    """
    tp = len(shards)
    if [s.replica.tp_rank for s in shards] != list(range(tp)) or any(s.replica.tp_size != tp for s in shards):
        raise ToyEngineError(f"shards: expected tp ranks 0..{tp - 1} of tp {tp}, got {[s.replica for s in shards]}")
    if cache.replica.tp_size != 1 or any(s.config.kv_heads != cache.config.kv_heads for s in shards):
        raise ToyEngineError("cache: must be a whole cache of the shards' model")
    table = torch.as_tensor(cache.check_table(page_table, 0))
    for shard in shards:
        rows = slice(shard.replica.tp_rank * shard.heads, (shard.replica.tp_rank + 1) * shard.heads)
        for whole, part in zip(cache.tensors, shard.tensors):
            whole[table, :, rows] = part[table].to(whole.device)
    if cache.states:
        slot = cache.check_state(state)
        for whole, *parts in zip(cache.states, *(s.states for s in shards)):
            if any(not torch.equal(parts[0][slot], p[slot]) for p in parts[1:]):
                raise ToyEngineError(f"shards: replicated state slot {slot} differs between shards")
            whole[slot] = parts[0][slot].to(whole.device)
