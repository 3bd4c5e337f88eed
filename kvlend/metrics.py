"""What operators watch: transfer time, bytes, descriptors, leases, locks, failures.

Metrics are always readable from Python (``METRICS.snapshot()``).  When
``prometheus_client`` is installed (the ``metrics`` extra) they are mirrored
into its registry as well, from the moment ``enable_prometheus`` (or
``serve(port)``, which exposes them over HTTP) is called.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Callable

from .errors import KvlendError

# Seconds: 50 µs .. 10 s.  Bytes and descriptor counts: powers of 4.
TIME_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
SIZE_BUCKETS = tuple(float(4**i) for i in range(0, 18))


@dataclass
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value


@dataclass(frozen=True)
class _Spec:
    name: str
    doc: str
    kind: str  # "counter" | "histogram" | "gauge"
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


SPECS = {
    s.name: s for s in (
        _Spec("kvlend_transfer_seconds", "One lease: start of fetch (planning included) to done (reads landed in its "
              "life, or the prefill's done ack)",
              "histogram", buckets=TIME_BUCKETS),
        _Spec("kvlend_post_seconds", "One lease: planning and posting its reads to the backend", "histogram",
              buckets=TIME_BUCKETS),
        _Spec("kvlend_transfer_bytes", "Bytes read per lease", "histogram", buckets=SIZE_BUCKETS),
        _Spec("kvlend_transfer_descriptors", "Coalesced descriptors posted per lease", "histogram",
              buckets=SIZE_BUCKETS),
        _Spec("kvlend_handshake_seconds", "Decode-side handshake: connect, authenticate, negotiate", "histogram",
              buckets=TIME_BUCKETS),
        _Spec("kvlend_active_leases", "Leases granted and not yet ended (prefill)", "gauge", ("node",)),
        _Spec("kvlend_locked_pages", "Pages locked by leases (prefill)", "gauge", ("node",)),
        _Spec("kvlend_leases_total", "Leases granted (prefill)", "counter"),
        _Spec("kvlend_expired_leases_total", "Leases that expired before their reader finished (prefill)", "counter"),
        _Spec("kvlend_failed_transfers_total", "Leases whose reads failed (decode), by error type", "counter",
              ("error",)),
        _Spec("kvlend_resumes_total", "Requests resumed from a safe-resume bound (decode)", "counter"),
        _Spec("kvlend_cert_expiry_seconds", "Seconds until this rank's certificate expires (negative once it has)",
              "gauge", ("node",)),
        _Spec("kvlend_peer_cert_expiry_seconds", "Seconds until the first certificate among this rank's live "
              "links' peers expires (+Inf with none)", "gauge", ("node",)),
        _Spec("kvlend_orphaned_agents_total", "Transfer agents that outlived their reset (decode): unhealthy",
              "counter"),
    )
}


class Metrics:
    """A thread-safe set of the metrics in ``SPECS``, keyed by name and label values."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple[str, ...]], object] = {}
        self._gauges: dict[tuple[str, tuple[str, ...]], Callable[[], float]] = {}
        self._prom = None

    def _key(self, name: str, labels: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
        spec = SPECS.get(name)
        if spec is None:
            raise KvlendError(f"no metric {name!r}; have {sorted(SPECS)}")
        if len(labels) != len(spec.labels):
            raise KvlendError(f"metric {name} takes labels {spec.labels}, got {labels}")
        return name, labels

    def inc(self, name: str, *labels: str, amount: float = 1.0) -> None:
        key = self._key(name, labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount
        if self._prom is not None:
            metric = self._prom[name]
            (metric.labels(*labels) if labels else metric).inc(amount)

    def observe(self, name: str, value: float, *labels: str) -> None:
        key = self._key(name, labels)
        with self._lock:
            hist = self._values.get(key)
            if hist is None:
                hist = self._values[key] = _Histogram(SPECS[name].buckets)
            hist.observe(value)
        if self._prom is not None:
            metric = self._prom[name]
            (metric.labels(*labels) if labels else metric).observe(value)

    def gauge(self, name: str, read: Callable[[], float], *labels: str) -> None:
        """Report ``read()`` as the gauge's value whenever metrics are read."""
        key = self._key(name, labels)
        with self._lock:
            self._gauges[key] = read
        if self._prom is not None:
            metric = self._prom[name]
            (metric.labels(*labels) if labels else metric).set_function(read)

    def remove_gauge(self, name: str, *labels: str) -> None:
        key = self._key(name, labels)
        with self._lock:
            self._gauges.pop(key, None)
        if self._prom is not None and labels:
            try:
                self._prom[name].remove(*labels)
            except KeyError:
                pass

    def snapshot(self) -> dict[str, dict]:
        """``{name: {labels: value}}``; a histogram's value is ``{"count", "sum", "buckets"}``."""
        out: dict[str, dict] = {name: {} for name in SPECS}
        with self._lock:
            for (name, labels), v in self._values.items():
                if isinstance(v, _Histogram):
                    v = {"count": v.count, "sum": v.sum, "buckets": dict(zip(v.buckets + (float("inf"),), v.counts))}
                out[name][labels] = v
            gauges = list(self._gauges.items())
        for (name, labels), read in gauges:
            out[name][labels] = float(read())
        return out

    def enable_prometheus(self, registry=None) -> None:
        """Mirror into ``prometheus_client`` (the ``metrics`` extra); idempotent.

        Counters and histograms are mirrored from this call on: what was counted
        before it stays in ``snapshot()`` only (histogram observations cannot be
        replayed into Prometheus), so enable it, or ``serve``, before creating
        nodes.  Gauges read live values and are complete either way.
        """
        if self._prom is not None:
            return
        try:
            import prometheus_client as prom
        except ImportError:
            raise KvlendError("metrics over HTTP need prometheus_client: pip install 'kvlend[metrics]'") from None
        kinds = {"counter": prom.Counter, "histogram": prom.Histogram, "gauge": prom.Gauge}
        made = {}
        for spec in SPECS.values():
            kwargs = {"buckets": spec.buckets} if spec.kind == "histogram" else {}
            name = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
            kw = {} if registry is None else {"registry": registry}
            made[spec.name] = kinds[spec.kind](name, spec.doc, spec.labels, **kwargs, **kw)
        with self._lock:
            self._prom = made
            gauges = list(self._gauges.items())
        for (name, labels), read in gauges:
            (made[name].labels(*labels) if labels else made[name]).set_function(read)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose the metrics for Prometheus at ``http://host:port/metrics``; returns the port
        (useful with ``port=0``)."""
        self.enable_prometheus()
        import prometheus_client as prom

        try:
            server, _thread = prom.start_http_server(port, addr=host)
        except OSError as exc:
            raise KvlendError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
        return server.server_port


METRICS = Metrics()
