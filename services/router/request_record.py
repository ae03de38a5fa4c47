"""One Generate request at the router: its `llm_request` span and the INFO line written when it ends.

`RequestRecord.begin` (at the start of the generation path, in the request's own task) fixes the
request id (the request's `request_id` field, else the client's `x-request-id`, else a new one),
binds it for logs and for the metadata of every call made for the request, starts the
`llm_request` span under the client's trace context and makes it current; parts of the path note
what they learn through `current()` (the worker, the encoders, the final message). `finish` ends
the span with the `gen_ai.*` usage and latency attributes (vLLM's names) and logs exactly one line,
`request finished`, with status, tokens, timings (an image request's by stage, `stage_times`), worker and
encoders. No prompt or output text is
put in the span or the line.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from services.common.logs import bind_request_id, current_request_id, fields
from services.common.rpc.epd.v1 import common_pb2, generation_pb2
from services.common.tracing import span_attributes, tracer

log = logging.getLogger("epd.requests")
_CURRENT: ContextVar[RequestRecord | None] = ContextVar("epd_request_record", default=None)


@dataclass
class RequestRecord:
    span: trace.Span
    request_id: str
    tenant: str
    start: float = field(default_factory=time.perf_counter)
    worker: str = ""
    encoders: list[str] = field(default_factory=list)
    final: generation_pb2.Final | None = None
    steps: dict[str, float] = field(default_factory=dict)  # step -> seconds from the start (`note_step`)

    @classmethod
    def begin(cls, request: generation_pb2.GenerateRequest, tenant: str, model: str) -> RequestRecord:
        """Start the request's span and bind its id (see the module docstring); the record becomes `current()`.
        The span stays current in this task until the task ends (each request has its own task)."""
        request_id = request.request_id or current_request_id() or uuid.uuid4().hex
        bind_request_id(request_id)
        span = tracer().start_span("llm_request", kind=trace.SpanKind.SERVER)
        if span.is_recording():
            sampling = request.sampling
            span.set_attributes(
                span_attributes(
                    {
                        "gen_ai.request.id": request_id,
                        "gen_ai.response.model": model,
                        "gen_ai.request.max_tokens": sampling.max_tokens or None,
                        "gen_ai.request.temperature": sampling.temperature,
                        "gen_ai.request.top_p": sampling.top_p or None,
                        "gen_ai.request.n": sampling.n or 1,
                        "epd.tenant": tenant,
                    }
                )
            )
        otel_context.attach(trace.set_span_in_context(span))
        record = cls(span, request_id, tenant)
        _CURRENT.set(record)
        return record

    def finish(self, status: str, error: str = "", refusal: str = "") -> None:
        """End the span and log the request's one line (`status`: ok, cancelled, or the gRPC status)."""
        usage = self.final.usage if self.final is not None else None
        timing = self.final.timing if self.final is not None else None
        total_s = time.perf_counter() - self.start
        line = {
            "status": status,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "cached_tokens": usage.cached_tokens if usage else None,
            "image_tokens": usage.image_tokens if usage else None,
            "migrations": usage.migrations if usage else None,
            "intake_s": round(timing.intake_s, 6) if timing else None,
            "queue_s": round(timing.queue_s, 6) if timing else None,
            "encode_s": round(timing.encode_s, 6) if timing else None,
            **(stage_times(timing) if timing else {}),
            "first_token_s": round(timing.first_token_s, 6) if timing else None,
            "total_s": round(total_s, 6),
            "worker": self.worker,
            "encoders": ",".join(self.encoders),
            "tenant": self.tenant,
        }
        if refusal:
            line["refusal"] = refusal
        if self.final is None:  # refused or failed: how far it got, and when
            line.update({f"{step}_at_s": round(seconds, 6) for step, seconds in self.steps.items()})
        if self.span.is_recording():
            self.span.set_attributes(
                span_attributes(
                    {
                        "gen_ai.usage.prompt_tokens": line["prompt_tokens"],
                        "gen_ai.usage.completion_tokens": line["completion_tokens"],
                        "gen_ai.latency.time_in_queue": line["queue_s"],
                        "gen_ai.latency.time_to_first_token": line["first_token_s"],
                        "gen_ai.latency.e2e": total_s,
                        "gen_ai.response.finish_reasons": [self.final.finish_reason] if self.final else None,
                        "epd.status": status,
                        "epd.worker": self.worker or None,
                        "epd.encoders": self.encoders or None,
                        "epd.refusal.reason": refusal or None,
                        "epd.cached_tokens": line["cached_tokens"],
                        "epd.migrations": line["migrations"],
                        **{f"epd.stage.{name}": line.get(name) for name in STAGES},
                    }
                )
            )
            if status not in ("ok", "cancelled"):
                self.span.set_status(trace.Status(trace.StatusCode.ERROR, error or status))
        self.span.end()
        log.info("request finished", extra=fields(**{k: v for k, v in line.items() if v not in (None, "")}))


STAGES = (
    "intake_s",
    "queue_s",
    "encode_held_s",
    "encode_decode_queue_s",
    "encode_decode_s",
    "encode_prepare_s",
    "encode_tower_s",
    "encode_cache_write_s",
    "encode_push_s",
    "embedding_wait_s",
    "prefill_s",
)


def stage_times(timing: generation_pb2.Timing) -> dict[str, float]:
    """An image request's time by stage, for its line and span: the encoder's stages (`encode_*`), the wait
    at the worker for its last embedding and the prefill (from the worker's admission to its first token,
    that wait included); each stage only when it took time (a text request has none of the encoder's)."""
    stages = {f"encode_{field.name}": getattr(timing.encode_stages, field.name) for field in _ENCODE_FIELDS}
    stages["embedding_wait_s"] = timing.embedding_wait_s
    stages["prefill_s"] = timing.prefill_s
    return {name: round(seconds, 6) for name, seconds in stages.items() if seconds > 0}


_ENCODE_FIELDS = common_pb2.EncodeStages.DESCRIPTOR.fields


def current() -> RequestRecord | None:
    """The record of the request this task serves, if any."""
    return _CURRENT.get()


def note_worker(worker: str) -> None:
    """The worker the current request was admitted to (the last one, after a migration)."""
    record = current()
    if record is not None:
        record.worker = worker


def note_step(step: str) -> None:
    """The current request passed `step` (`intake`, `lookup`, `placed`): a request that ends without a final
    message (a refusal, a failure) logs each step's time from its start, so its line says where its time went."""
    record = current()
    if record is not None:
        record.steps.setdefault(step, time.perf_counter() - record.start)


def note_encoder(encoder: str) -> None:
    """An encoder that encoded items of the current request."""
    record = current()
    if record is not None and encoder not in record.encoders:
        record.encoders.append(encoder)


def admission_attributes(admitted: Any) -> dict[str, AttributeValue]:
    """The `admission` span's attributes: the chosen worker, the KV blocks reserved there and the queueing
    time (cached prefix tokens are on the worker's `worker.prefill` span)."""
    return {"epd.worker": admitted.worker, "epd.blocks": admitted.blocks, "epd.queue_s": admitted.queue_s}
