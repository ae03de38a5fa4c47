"""Metrics for one service: an OpenTelemetry MeterProvider exported on a Prometheus endpoint.

Each service builds one `Telemetry` at start and passes it (or its meter) explicitly; metric
names follow vLLM's with an `epd_` prefix. Counters appear on the endpoint with `_total`, and an
instrument's unit is appended when the name lacks it (unit "tokens" on `epd_x` gives `epd_x_tokens`).

Histograms get explicit buckets by name (`HISTOGRAM_VIEWS`): `*_seconds` from 1 ms to 2 min,
roughly log-spaced; `*batch_size` (items) and `*_tokens` / `*_bytes` in powers of two or four.
Each Telemetry has its own Prometheus registry (its instruments plus the process and Python
collectors), so two services in one process never mix their endpoints.

Invariants of the endpoint: every `epd_*` sample carries a `model_name` label (the served model's
name, as vLLM's), no sample carries `otel_scope_*` labels, and every family has HELP text (an
instrument created without a description is a bug; tests/deploy/test_metrics_live.py checks it).
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
from collections.abc import Sequence

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, Histogram, MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, start_http_server

from services.common import loop_lag
from services.common.fast_histogram import FastHistogram

log = logging.getLogger(__name__)

MODEL_LABEL = "model_name"

SECONDS_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.35,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    4.0,
    6.0,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
    120.0,
)
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(2**k) for k in range(4, 19))  # 16 .. 262144
BYTE_BUCKETS: tuple[float, ...] = tuple(float(4**k) for k in range(5, 16))  # 1 KiB .. 1 GiB

# Instrument-name pattern -> bucket boundaries; the patterns never overlap (one stream each).
HISTOGRAM_VIEWS: dict[str, Sequence[float]] = {
    "*_seconds": SECONDS_BUCKETS,
    "*batch_size": BATCH_SIZE_BUCKETS,
    "*_tokens": TOKEN_BUCKETS,
    "*_bytes": BYTE_BUCKETS,
}


def histogram_views() -> list[View]:
    """One View per `HISTOGRAM_VIEWS` pattern, for histograms only."""
    return [
        View(
            instrument_type=Histogram,
            instrument_name=pattern,
            aggregation=ExplicitBucketHistogramAggregation(boundaries=list(bounds)),
        )
        for pattern, bounds in HISTOGRAM_VIEWS.items()
    ]


class Telemetry:
    """Owns the service's MeterProvider, its registry and, when `metrics_port` > 0, its HTTP endpoint."""

    def __init__(
        self, service: str, metrics_host: str = "127.0.0.1", metrics_port: int = 0, model_name: str = ""
    ) -> None:
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        # the resource's model_name becomes a label of every sample; scope labels are dropped
        reader = PrometheusMetricReader(
            registry=self.registry, scope_info_enabled=False, resource_attribute_filter=lambda key: key == MODEL_LABEL
        )
        # no exemplars: the Prometheus reader never exports them, and sampling one made each histogram record
        # ~4x dearer (~5 us of the router's per-token inter-token-latency record)
        self._provider = MeterProvider(
            metric_readers=[reader],
            views=histogram_views(),
            exemplar_filter=AlwaysOffExemplarFilter(),
            resource=Resource.create({"service.name": f"epd-{service}", MODEL_LABEL: model_name}),
        )
        self.meter: Meter = self._provider.get_meter(f"epd.{service}")
        self._model_name = model_name
        self._http = None
        self._loop_watch: asyncio.Task | None = None
        if metrics_port > 0:
            self._http, _ = start_http_server(metrics_port, addr=metrics_host, registry=self.registry)
            log.info("metrics for %s on http://%s:%d/metrics", service, metrics_host, metrics_port)

    def fast_histogram(self, name: str, description: str) -> FastHistogram:
        """A histogram for a per-token hot path (services/common/fast_histogram.py) on this endpoint, its bounds
        by name as the OTel instruments' (`HISTOGRAM_VIEWS`)."""
        bounds = next(b for pattern, b in HISTOGRAM_VIEWS.items() if fnmatch.fnmatchcase(name, pattern))
        histogram = FastHistogram(name, description, bounds, {MODEL_LABEL: self._model_name})
        self.registry.register(histogram)
        return histogram

    def watch_loop(self) -> None:
        """Record the running event loop's lag (`epd_event_loop_lag_seconds`, services/common/loop_lag.py) until
        `shutdown`; call once, from the loop the service serves on."""
        histogram = self.fast_histogram(loop_lag.NAME, loop_lag.DESCRIPTION)
        self._loop_watch = asyncio.get_running_loop().create_task(loop_lag.watch(histogram))

    def shutdown(self) -> None:
        if self._loop_watch is not None:
            self._loop_watch.cancel()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self._provider.shutdown()
