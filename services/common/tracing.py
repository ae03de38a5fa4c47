"""Traces for one service: the OpenTelemetry SDK, configured by the standard `OTEL_*` variables.

`setup_tracing` installs a TracerProvider exporting OTLP over gRPC in batches only when an endpoint
is set (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`) and neither
`OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none`; otherwise it installs nothing and every
span below is the API's non-recording span (no allocation beyond the call, nothing exported).
The sampler is the SDK's, from `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (default
parentbased_always_on); the service name from `OTEL_SERVICE_NAME`, else `epd-<role>`.

Span attributes are counts, sizes, timings, ids and addresses: never prompt text, generated text or
media bytes (`span_attributes` drops str values longer than `MAX_ATTRIBUTE_CHARS` as a guard).
Spans are per request or per batch, never per token.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.util.types import AttributeValue

log = logging.getLogger(__name__)

TRACER_NAME = "epd"
MAX_ATTRIBUTE_CHARS = 256
PROTOCOLS = ("grpc",)


def endpoint(env: Mapping[str, str] | None = None) -> str:
    """The OTLP endpoint traces go to, or "" when tracing is off."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return ""
    return (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "").strip()


def setup_tracing(service: str, env: Mapping[str, str] | None = None) -> TracerProvider | None:
    """Install this process's TracerProvider when an endpoint is set (see the module docstring); None if off.
    ValueError for a protocol other than grpc."""
    env = os.environ if env is None else env
    target = endpoint(env)
    if not target:
        return None
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r} is not supported (use grpc)")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    attributes = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": f"epd-{service}"}
    provider = TracerProvider(resource=Resource.create(attributes))  # sampler from OTEL_TRACES_SAMPLER*
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=target)))
    trace.set_tracer_provider(provider)
    log.info("traces to %s (%s)", target, provider.sampler.get_description())
    return provider


def shutdown_tracing(provider: TracerProvider | None) -> None:
    """Export what is buffered and stop (a no-op when tracing is off)."""
    if provider is not None:
        provider.shutdown()


def tracer() -> trace.Tracer:
    """The epd tracer of the installed provider (a no-op tracer when tracing is off)."""
    return trace.get_tracer(TRACER_NAME)


def span_attributes(values: Mapping[str, AttributeValue | None]) -> dict[str, AttributeValue]:
    """Attributes without None values and without long strings (a guard against text in spans)."""
    return {
        key: value
        for key, value in values.items()
        if value is not None and not (isinstance(value, str) and len(value) > MAX_ATTRIBUTE_CHARS)
    }


class StageSpans:
    """Back-to-back spans of one request's stages (queue, prefill, decode): `mark(name)` ends the stage that
    began at the previous mark (or at construction) as a span named `name`, a child of the context that was
    current at construction. Spans are made after the fact with explicit times, so nothing is attached to
    the context across awaits or yields."""

    def __init__(self) -> None:
        self._parent = trace.get_current_span()
        self._since = time.time_ns()

    def mark(self, name: str, attributes: Mapping[str, AttributeValue | None] | None = None, error: str = "") -> None:
        now = time.time_ns()
        span = tracer().start_span(name, context=trace.set_span_in_context(self._parent), start_time=self._since)
        if span.is_recording():
            span.set_attributes(span_attributes(attributes or {}))
            if error:
                span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        span.end(end_time=now)
        self._since = now
