"""services/common/logs.py, tracing.py and rpc_context.py without a cluster: formats, ids, configuration."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from services.common import logs, rpc_context, tracing
from services.common.grpc_server import ServiceBinding, channel_options, start_server
from services.common.rpc.epd.v1 import generation_pb2, generation_pb2_grpc


def capture(fmt: str) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter("router") if fmt == "json" else logs.TextFormatter())
    logger = logging.getLogger(f"test.observability.{fmt}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, stream


def test_json_lines_carry_service_request_and_trace_ids() -> None:
    logger, stream = capture("json")
    provider = TracerProvider()
    logs.bind_request_id("req-7")
    try:
        with provider.get_tracer("t").start_as_current_span("s") as span:
            logger.info("line one\nstill one line", extra=logs.fields(status="ok", tokens=3))
            trace_id = format(span.get_span_context().trace_id, "032x")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        logs.bind_request_id("")
    first, second = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert first["message"] == "line one\nstill one line" and first["service"] == "router"
    assert (first["request_id"], first["trace_id"], first["status"], first["tokens"]) == ("req-7", trace_id, "ok", 3)
    assert second["trace_id"] == "" and "ValueError: boom" in second["exception"] and second["level"] == "ERROR"


def test_text_lines_show_the_request_id_and_fields() -> None:
    logger, stream = capture("text")
    logs.bind_request_id("req-8")
    try:
        logger.info("request finished", extra=logs.fields(status="ok"))
    finally:
        logs.bind_request_id("")
    logger.info("no request")
    first, second = stream.getvalue().splitlines()
    assert first.endswith("test.observability.text: [req-8] request finished status=ok")
    assert second.endswith("test.observability.text: no request")


def test_log_format_is_text_or_json() -> None:
    assert logs.log_format({}) == "text"
    assert logs.log_format({"EPD_LOG_FORMAT": "JSON"}) == "json"
    with pytest.raises(ValueError, match="EPD_LOG_FORMAT"):
        logs.log_format({"EPD_LOG_FORMAT": "yaml"})


def test_tracing_is_off_without_an_endpoint() -> None:
    assert tracing.endpoint({}) == ""
    assert tracing.setup_tracing("router", {}) is None
    assert tracing.endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == "http://c:4317"
    assert tracing.endpoint({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317"}) == "http://t:4317"
    assert tracing.endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}) == ""
    assert tracing.endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}) == ""
    with pytest.raises(ValueError, match="grpc"):
        tracing.setup_tracing(
            "router", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
        )


def test_span_attributes_drop_none_and_long_text() -> None:
    kept = tracing.span_attributes({"a": 1, "b": None, "c": "x" * 300, "d": "short"})
    assert kept == {"a": 1, "d": "short"}


@pytest.mark.parametrize(
    ("given", "accepted"),
    [("abc-123", "abc-123"), (" spaced ", "spaced"), ("has space", ""), ("x" * 129, ""), ("é", ""), ("", "")],
)
def test_request_ids_from_clients_are_cleaned(given: str, accepted: str) -> None:
    assert rpc_context.clean_request_id(given) == accepted


class Echo(generation_pb2_grpc.GenerationServicer):
    """Records the request and trace ids each CountTokens call runs with; a request named "hop" calls the
    server once more through a `ContextChannel`."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.address = ""

    async def CountTokens(self, request, context):  # noqa: N802
        self.seen.append((logs.current_request_id(), logs.current_trace_id()))
        if request.request_id == "hop":
            channel = rpc_context.ContextChannel(grpc.aio.insecure_channel(self.address))
            async with channel:
                await generation_pb2_grpc.GenerationStub(channel).CountTokens(generation_pb2.GenerateRequest())
        return generation_pb2.TokenCount(prompt_tokens=1)


def test_request_id_and_trace_context_cross_a_real_grpc_hop() -> None:
    async def run() -> tuple[list[tuple[str, str]], dict[str, str]]:
        echo = Echo()
        binding = ServiceBinding(generation_pb2_grpc.add_GenerationServicer_to_server, echo, "epd.v1.Generation")
        server = await start_server("127.0.0.1", 0, [binding], echo_request_id=True)
        echo.address = f"127.0.0.1:{server.port}"
        try:
            async with grpc.aio.insecure_channel(echo.address, options=channel_options()) as channel:
                call = generation_pb2_grpc.GenerationStub(channel).CountTokens(
                    generation_pb2.GenerateRequest(request_id="hop"),
                    metadata=(("x-request-id", "req-9"), ("traceparent", f"00-{'ab' * 16}-{'cd' * 8}-01")),
                )
                await call
                initial = dict(await call.initial_metadata())
        finally:
            await server.stop(0)
        return echo.seen, initial

    seen, initial = asyncio.run(run())
    assert initial["x-request-id"] == "req-9"
    assert seen == [("req-9", "ab" * 16), ("req-9", "ab" * 16)]  # the second call came through the ContextChannel
    assert trace.get_current_span().get_span_context().is_valid is False  # nothing leaked into this thread
