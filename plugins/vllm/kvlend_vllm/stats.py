"""kvlend's transfer metrics in vLLM's own channels: the periodic log line and ``/metrics``.

The decode worker records one entry per finished fetch; vLLM ships them to
its logger process, which calls ``reduce`` for the log and ``observe`` for
Prometheus (``vllm:kvlend_*``, next to ``vllm:nixl_*`` when comparing).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

_KEYS = ("transfer_duration", "read_duration", "bytes_transferred", "num_descriptors", "num_failed_transfers",
         "num_recomputed_blocks", "num_local_blocks")


@dataclass
class KvlendStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {key: [] for key in _KEYS}  # plain lists: vLLM serialises them between processes

    def record(self, *, seconds: float, read_seconds: float, nbytes: int, descriptors: int,
               local_blocks: int = 0) -> None:
        self.data["transfer_duration"].append(seconds)
        self.data["read_duration"].append(read_seconds)
        self.data["bytes_transferred"].append(nbytes)
        self.data["num_descriptors"].append(descriptors)
        self.data["num_local_blocks"].append(local_blocks)

    def record_failure(self, recomputed_blocks: int) -> None:
        self.data["num_failed_transfers"].append(1)
        self.data["num_recomputed_blocks"].append(recomputed_blocks)

    def clone_and_reset(self) -> KvlendStats:
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in _KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _KEYS:
            self.data[key].extend(other.data.get(key, ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        times = np.asarray(self.data["transfer_duration"], dtype=float)
        mb = float(np.sum(self.data["bytes_transferred"])) / 2**20
        out = {"Num successful transfers": len(times),
               "Num failed transfers": len(self.data["num_failed_transfers"]),
               "Blocks recomputed": int(np.sum(self.data["num_recomputed_blocks"])),
               "Blocks held locally, not read": int(np.sum(self.data["num_local_blocks"]))}
        if len(times):
            out.update({"Avg xfer time (ms)": round(float(times.mean()) * 1e3, 3),
                        "P90 xfer time (ms)": round(float(np.percentile(times, 90)) * 1e3, 3),
                        "Avg read time (ms)": round(float(np.mean(self.data["read_duration"])) * 1e3, 3),
                        "Avg MB per transfer": round(mb / len(times), 3),
                        "Avg number of descriptors": round(float(np.mean(self.data["num_descriptors"])), 1),
                        "Throughput (MB/s)": round(mb / max(float(times.sum()), 1e-9), 3)})
        return out


class KvlendPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric):
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        self._time = per_engine(self._histogram_cls(
            name="vllm:kvlend_xfer_time_seconds", labelnames=labelnames,
            documentation="kvlend fetch time, claim to done (reads landed in the lease's life, or the prefill's "
                          "done ack), per request.",
            buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]))
        self._read = per_engine(self._histogram_cls(
            name="vllm:kvlend_read_time_seconds", labelnames=labelnames,
            documentation="kvlend reads alone, posted to landed, per request (compare vllm:nixl_xfer_time_seconds).",
            buckets=[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0]))
        self._bytes = per_engine(self._histogram_cls(
            name="vllm:kvlend_bytes_transferred", labelnames=labelnames,
            documentation="KV bytes kvlend read per request.", buckets=[2 ** (10 + i) for i in range(1, 25, 2)]))
        self._descriptors = per_engine(self._histogram_cls(
            name="vllm:kvlend_num_descriptors", labelnames=labelnames,
            documentation="NIXL descriptors kvlend posted per request (compare vllm:nixl_num_descriptors).",
            buckets=[2 ** i for i in range(0, 20, 2)]))
        self._failed = per_engine(self._counter_cls(
            name="vllm:kvlend_failed_transfers", labelnames=labelnames,
            documentation="kvlend fetches that failed (their blocks were reported for recompute)."))
        self._recomputed = per_engine(self._counter_cls(
            name="vllm:kvlend_recomputed_blocks", labelnames=labelnames,
            documentation="Blocks past a failed fetch's verified bound, handed back to vLLM to recompute."))
        self._local = per_engine(self._counter_cls(
            name="vllm:kvlend_local_blocks", labelnames=labelnames,
            documentation="Blocks of fetched requests the decode held already (its prefix cache): not read."))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for value in transfer_stats_data["transfer_duration"]:
            self._time[engine_idx].observe(value)
        for value in transfer_stats_data["read_duration"]:
            self._read[engine_idx].observe(value)
        for value in transfer_stats_data["bytes_transferred"]:
            self._bytes[engine_idx].observe(value)
        for value in transfer_stats_data.get("num_descriptors", ()):
            self._descriptors[engine_idx].observe(value)
        for value in transfer_stats_data["num_failed_transfers"]:
            self._failed[engine_idx].inc(value)
        for value in transfer_stats_data["num_recomputed_blocks"]:
            self._recomputed[engine_idx].inc(value)
        for value in transfer_stats_data.get("num_local_blocks", ()):
            self._local[engine_idx].inc(value)
