"""Metrics for one service: an OpenTelemetry MeterProvider exported on a Prometheus endpoint.

Each service builds one `Telemetry` at start and passes it (or its meter) explicitly; metric
names follow vLLM's with an `epd_` prefix. Counters appear on the endpoint with `_total`.
"""

from __future__ import annotations

import logging

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import start_http_server

log = logging.getLogger(__name__)


class Telemetry:
    """Owns the service's MeterProvider and, when `metrics_port` > 0, its HTTP endpoint."""

    def __init__(self, service: str, metrics_host: str = "127.0.0.1", metrics_port: int = 0) -> None:
        self.service = service
        reader = PrometheusMetricReader()
        self._provider = MeterProvider(
            metric_readers=[reader], resource=Resource.create({"service.name": f"epd-{service}"})
        )
        self.meter: Meter = self._provider.get_meter(f"epd.{service}")
        self._http = None
        if metrics_port > 0:
            self._http, _ = start_http_server(metrics_port, addr=metrics_host)
            log.info("metrics for %s on http://%s:%d/metrics", service, metrics_host, metrics_port)

    def shutdown(self) -> None:
        if self._http is not None:
            self._http.shutdown()
        self._provider.shutdown()
