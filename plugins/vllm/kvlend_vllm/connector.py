"""``KvlendConnector``: kvlend as a vLLM v1 KV connector.

Load it with ``--kv-transfer-config '{"kv_connector": "KvlendConnector",
"kv_connector_module_path": "kvlend_vllm.connector", "kv_role": "kv_producer"
| "kv_consumer", "kv_load_failure_policy": "recompute", ...}'`` (docs/vllm.md).
vLLM builds one instance per role: the scheduler side (``scheduler.py``) in
EngineCore and the worker side (``worker.py``) in the process owning the KV
tensors.  This class only routes vLLM's hooks to whichever side it is.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec
from vllm.v1.request import RequestStatus

from kvlend.errors import ConfigError, KvlendError
from kvlend.protocol.config import NodeConfig
from kvlend.security.credentials import Credentials
from kvlend.transport.huge_pages import back_with_huge_pages

from .layout import GROUP, CacheGroup, StateShape, layout_from_kv_caches, model_digest, scope_of, state_scope
from .scheduler import LENT_STATUSES, ConsumerScheduler, Endpoint, ProducerScheduler, StepPlan
from .stats import KvlendPromMetrics, KvlendStats
from .worker import ConsumerWorker, ProducerWorker, WorkerSettings

log = logging.getLogger("kvlend.vllm")


def _show_kvlend_logs() -> None:
    """vLLM configures only its own loggers: without this, kvlend's warnings would vanish."""
    root = logging.getLogger("kvlend")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"(kvlend pid={os.getpid()}) %(levelname)s %(asctime)s "
                                               "[%(name)s] %(message)s", "%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("KVLEND_LOG", "INFO"))

# kv_connector_extra_config keys and defaults (seconds): docs/vllm.md.
DEFAULTS = {"host": "127.0.0.1", "port": 0, "advertise": None, "ttl": 30.0, "heartbeat": 1.0, "progressive_ttl": 1.0,
            "claim_wait": 5.0, "transfer_timeout": 30.0, "stats_path": None,
            "etcd": None, "cluster_prefix": "/kvlend/default", "huge_pages": True}


def _number(extra: dict, key: str) -> float:
    value = extra[key]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"kv_connector_extra_config.{key}: expected a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"kv_connector_extra_config.{key}: expected a number, got {value!r}") from None


# vLLM releases this connector was built and tested against: [low, high) of (major, minor).
SUPPORTED_VLLM = ((0, 32), (0, 33))


def check_vllm(version: str, config) -> None:
    """Refuse, at start-up, a vLLM or a configuration this connector does not understand.

    Better a clear error before the workers start than wrong KV or a hang in the first request.
    """
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        major_minor = None
    low, high = SUPPORTED_VLLM
    if major_minor is None or not low <= major_minor < high:
        raise ConfigError(f"KvlendConnector supports vLLM {low[0]}.{low[1]}.x, not {version!r}")
    missing = [name for name in LENT_STATUSES if name not in RequestStatus.__members__]
    if missing:
        raise ConfigError(f"KvlendConnector: vLLM {version}'s RequestStatus has no {missing}")
    parallel = config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError(f"KvlendConnector: pipeline parallel size must be 1, got {parallel.pipeline_parallel_size}")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, name, 1)
        if size != 1:  # each rank would hold some of a request's tokens, which no layout here says
            raise ConfigError(f"KvlendConnector: {name} must be 1, got {size}")


def _endpoints(extra: dict) -> tuple[str, ...]:
    """``etcd``: host:port[,host:port...] of kvlend's registry, or none."""
    value = extra["etcd"]
    if value is None:
        return ()
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"kv_connector_extra_config.etcd: expected host:port[,host:port...], got {value!r}")
    return tuple(e.strip() for e in value.split(",") if e.strip())


# Where a model's config names its Mamba2 SSM groups (granite-4.0-h and Falcon-H1, Nemotron-H and
# Mamba2, Zamba2).
_GROUP_KEYS = ("mamba_n_groups", "n_groups", "mamba_ngroups")


def state_shape(spec: MambaSpec, hf_config, where: str) -> StateShape:
    """A ``MambaSpec`` group's state block as kvlend describes it; ConfigError names what is not
    supported (a Mamba1, gated-delta-net or linear-attention state, prefix caching's align mode,
    speculative state blocks, shapes that are not a Mamba2 or a short conv's)."""
    kind = spec.mamba_type
    if kind not in (MambaAttentionBackendEnum.MAMBA2, MambaAttentionBackendEnum.SHORT_CONV):
        raise ConfigError(f"KvlendConnector: {where} holds {getattr(kind, 'name', kind)} state; only Mamba2 and "
                          "short conv (LFM2) state are supported")
    if spec.mamba_cache_mode != "none":
        raise ConfigError(f"KvlendConnector: {where}: mamba_cache_mode {spec.mamba_cache_mode!r} (prefix caching "
                          "of recurrent state) is not supported; start the engine with --no-enable-prefix-caching")
    if spec.num_speculative_blocks:  # (checkpoint blocks exist only in align mode)
        raise ConfigError(f"KvlendConnector: {where}: {spec.num_speculative_blocks} speculative state blocks "
                          "per request (speculative decoding) are not supported")
    shapes = tuple(tuple(int(n) for n in shape) for shape in spec.shapes)
    conv_first = is_conv_state_dim_first()
    dtypes = tuple(str(d).removeprefix("torch.") for d in spec.dtypes)
    if kind is MambaAttentionBackendEnum.SHORT_CONV:
        if len(shapes) != 1 or len(shapes[0]) != 2:
            raise ConfigError(f"KvlendConnector: {where}: state shapes {shapes} are not a short conv's")
        return StateShape(shapes[0], None, spec.dtypes[0].itemsize, 0, conv_first, 0, dtypes)
    if len(shapes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 3:
        raise ConfigError(f"KvlendConnector: {where}: state shapes {shapes} are not a Mamba2 conv state "
                          "and SSM state")
    groups = next((hf_config[k] for k in _GROUP_KEYS if isinstance(hf_config.get(k), int)), None)
    if groups is None:
        raise ConfigError(f"KvlendConnector: {where}: the model config names no SSM group count "
                          f"(looked for {list(_GROUP_KEYS)})")
    state = StateShape(shapes[0], shapes[1], spec.dtypes[0].itemsize, spec.dtypes[1].itemsize, conv_first, groups,
                       dtypes)
    try:
        state.channels()
    except KvlendError as exc:
        raise ConfigError(f"KvlendConnector: {where}: {exc}") from None
    return state


def cache_groups(kv_cache_config, hf_config: dict | None = None) -> tuple[tuple[CacheGroup, tuple[str, ...]], ...]:
    """vLLM's KV cache groups as kvlend groups, with their layers: full attention (or MLA) moves whole,
    a sliding window (vLLM's hybrid allocator) only its window's blocks, a Mamba2 or short conv group
    its state block (``hf_config``: the model's, for its SSM groups); any other kind is refused."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is None:
        return ((CacheGroup(GROUP), ()),)
    if not groups:
        raise ConfigError("KvlendConnector: the engine has no KV cache group")
    transfer = getattr(kv_cache_config, "transfer_group_ids", None)
    if transfer is not None and tuple(transfer) != tuple(range(len(groups))):
        raise ConfigError(f"KvlendConnector moves every KV cache group; vLLM transfers only groups {list(transfer)} "
                          f"of {len(groups)}")
    out = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        name = GROUP if len(groups) == 1 else f"g{i}"
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            out.append((CacheGroup(name), tuple(g.layer_names)))
        elif type(spec) is SlidingWindowSpec:
            out.append((CacheGroup(name, int(spec.sliding_window)), tuple(g.layer_names)))
        elif type(spec) is MambaSpec:
            state = state_shape(spec, hf_config or {}, f"KV cache group {i} (layers {list(g.layer_names)[:3]})")
            out.append((CacheGroup(name, state=state), tuple(g.layer_names)))
        else:
            raise ConfigError(f"KvlendConnector: KV cache group {i} ({type(spec).__name__}, layers "
                              f"{list(g.layer_names)[:3]}...) is not full attention, a sliding window "
                              "or Mamba2 or short conv state")
    return tuple(out)


@dataclass
class KvlendMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KvlendHandshake(KVConnectorHandshakeMetadata):
    endpoint: Endpoint | None = None


class KvlendConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _show_kvlend_logs()
        check_vllm(vllm.__version__, vllm_config)
        self.groups = cache_groups(kv_cache_config, vllm_config.model_config.hf_config.to_dict())
        transfer = self._kv_transfer_config
        if transfer.kv_role not in ("kv_producer", "kv_consumer"):
            raise ConfigError(f"KvlendConnector: kv_role must be kv_producer or kv_consumer, got {transfer.kv_role!r}")
        self.producer = transfer.kv_role == "kv_producer"
        extra = {**DEFAULTS, **(transfer.kv_connector_extra_config or {})}
        unknown = sorted(set(extra) - set(DEFAULTS))
        if unknown:
            raise ConfigError(f"KvlendConnector: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(DEFAULTS)}")
        self.block_size = vllm_config.cache_config.block_size
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.scheduler = self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            groups = tuple(g for g, _ in self.groups)
            self.scheduler = (ProducerScheduler(self.block_size, groups) if self.producer
                              else ConsumerScheduler(self.block_size, tp, groups))
        else:
            # progressive_ttl bounds how long a preemption waits for a reader that ignores the lease's end.
            config = NodeConfig(ttl=_number(extra, "ttl"), heartbeat=_number(extra, "heartbeat"),
                                progressive_ttl=_number(extra, "progressive_ttl"),
                                claim_wait=_number(extra, "claim_wait") if self.producer else 0.0,
                                transfer_timeout=_number(extra, "transfer_timeout"))
            # Each TP worker runs a node of its own: {rank} in $KVLEND_CERT/$KVLEND_KEY names its certificate.
            rank = get_tensor_model_parallel_rank()
            credentials = Credentials.from_env(rank=rank, ranks=tp)
            settings = WorkerSettings(credentials, extra["host"], int(_number(extra, "port")), extra["advertise"],
                                      config, extra["stats_path"], tp, rank, _endpoints(extra),
                                      str(extra["cluster_prefix"]))
            self.stats = KvlendStats()
            self.worker = (ProducerWorker(settings) if self.producer
                           else ConsumerWorker(settings, self.block_size, self.stats))
        self._endpoint: Endpoint | None = None
        self._on_device = False  # the KV tensors are on an accelerator (set as they are registered)
        self._huge_pages = extra["huge_pages"]
        if not isinstance(self._huge_pages, bool):
            raise ConfigError(f"kv_connector_extra_config.huge_pages: expected true or false, got {self._huge_pages!r}")

    # ------------------------------------------------------------ scheduler
    def on_new_request(self, request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.producer:
            return 0, False
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if not self.producer:
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        if not self.producer:
            return KvlendMetadata(self.scheduler.take_plan())
        # Called before vLLM counts this step's tokens as computed: a request's num_computed_tokens is
        # what earlier steps' forwards wrote, and the worker lends it before this step's forward.
        return KvlendMetadata(self.scheduler.take_plan(scheduler_output.preempted_req_ids or (),
                                                       self._kv_cache_manager.get_block_ids))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        if self.producer:
            return self.scheduler.request_finished(request, block_ids)
        self.scheduler.request_finished(request)
        return False, None

    def update_connector_output(self, connector_output) -> None:
        if self.producer:
            self.scheduler.finished_sending(connector_output.finished_sending)
        else:
            self.scheduler.finished_recving(connector_output.finished_recving)

    def has_pending_block_frees(self) -> bool:
        # Lent blocks come back when their lease ends: wait for them rather than preempt.
        return self.producer and self.scheduler.holding > 0

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self.producer:  # one endpoint per TP worker, keyed by its rank
            tp = self._vllm_config.parallel_config.tensor_parallel_size
            if sorted(metadata) != list(range(tp)):
                raise ConfigError(f"KvlendConnector: handshake metadata from workers {sorted(metadata)}, "
                                  f"expected ranks 0..{tp - 1}")
            self.scheduler.set_endpoints([metadata[rank].endpoint for rank in range(tp)])

    # --------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        stateful = {layer for group, layers in self.groups if group.state is not None for layer in layers}
        first = next(iter(kv_caches.values()))
        attention = next((t for name, t in kv_caches.items() if name not in stateful), None)
        # A state block's view is raw bytes: the model's element type is the attention cache's.
        dtype = (str(attention.dtype) if attention is not None else str(self._vllm_config.model_config.dtype))
        dtype = dtype.removeprefix("torch.")
        config = self._vllm_config
        on_device = self._on_device = first.device.type != "cpu"
        kernel = (f"CPU_ATTN-{torch.backends.cpu.get_cpu_capability()}" if not on_device
                  else f"{first.device.type}-sm{''.join(map(str, torch.cuda.get_device_capability(first.device)))}")
        state = next((g.state for g, _ in self.groups if g.state is not None), None)
        scope = scope_of(platform=first.device.type, kernel=kernel, dtype=dtype, block_size=self.block_size,
                         cache_layout=str(getattr(self._kv_cache_config, "kv_cache_layout", "default")),
                         model=model_digest(config.model_config.hf_config.to_dict()),
                         state="" if state is None else state_scope(state))
        tp = config.parallel_config.tensor_parallel_size
        model = config.model_config
        layout = layout_from_kv_caches(kv_caches, block_size=self.block_size, dtype=dtype, scope=scope,
                                       device_id=first.device.index or 0, on_device=on_device, tp_size=tp,
                                       tp_rank=get_tensor_model_parallel_rank(),
                                       replicated=model.use_mla or model.get_total_num_kv_heads() < tp,
                                       groups={layer: group for group, layers in self.groups for layer in layers}
                                       or None)
        if not on_device and self._huge_pages:
            collapsed, seconds = back_with_huge_pages(layout.regions)
            log.info("kvlend: %.2f GiB of KV cache on 2 MiB pages in %.1f s", collapsed / 2**30, seconds)
        if self.producer:
            self._endpoint = self.worker.register(layout)
        else:
            self.worker.register(layout)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return KvlendHandshake(self._endpoint) if self.producer else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Lend and start fetches here, before the step's forward: start_load_kv runs after it, and
        # a batched prefill forward took 450-900 ms, all of it added to every claim waiting for a lend.
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KvlendMetadata):
            plan = connector_metadata.plan
            if self._on_device and (plan.extends or any(lend.ready for lend in plan.lends)):
                torch.cuda.current_stream().synchronize()  # the steps before wrote what is lent now
            self.worker.start(plan)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Before this step's forward, which may overwrite the blocks vLLM took back from them.
        if isinstance(kv_connector_metadata, KvlendMetadata) and kv_connector_metadata.plan.preempts:
            self.worker.preempt(kv_connector_metadata.plan.preempts)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass  # started in bind_connector_metadata; the loads are asynchronous

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads are whole-request and asynchronous: a request runs only once its load finished

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        pass  # lent in place after the request finishes: nothing to save per layer

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.producer:
            return self.worker.finished_sending(finished_req_ids) or None, None
        return None, self.worker.finished_recving() or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        failed = set() if self.producer else self.worker.failed_loads()
        return KVConnectorTransferResults(sending or set(), recving or set(), failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.producer else self.worker.load_errors()

    def get_kv_connector_stats(self) -> KvlendStats | None:
        if self.worker is None or self.stats.is_empty():
            return None
        return self.stats.clone_and_reset()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvlendStats:
        return KvlendStats(data=data) if data is not None else KvlendStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KvlendPromMetrics:
        return KvlendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
