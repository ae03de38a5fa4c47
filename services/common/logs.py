"""Logging for one service: text or JSON lines (`EPD_LOG_FORMAT`), each carrying the request and trace ids.

The request id lives in a context variable (`bind_request_id`), set by the gRPC server interceptor
(services/common/rpc_context.py) from the `x-request-id` metadata and by the router once it knows
the request's id; the trace id is the current OpenTelemetry span's. Both are empty outside a request.

Invariants: in JSON format every record is exactly one line holding one JSON object with at least
`ts`, `level`, `service`, `logger`, `message`, `request_id` and `trace_id` (exceptions are folded
into an `exception` string); fields given as `extra={"fields": {...}}` are merged in (text format
appends them as `key=value`). Prompt text and media bytes are never logged here.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from opentelemetry import trace

FORMATS = ("text", "json")
_REQUEST_ID: ContextVar[str] = ContextVar("epd_request_id", default="")


def bind_request_id(request_id: str) -> None:
    """Make `request_id` the current request's id (for this task and the tasks it starts)."""
    _REQUEST_ID.set(request_id)


def current_request_id() -> str:
    """The current request's id, or "" outside a request."""
    return _REQUEST_ID.get()


def current_trace_id() -> str:
    """The current span's trace id as 32 hex digits, or "" when there is no valid span context."""
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""


def fields(**values: Any) -> dict[str, Mapping[str, Any]]:
    """`extra=` for a log call whose structured fields should appear as JSON keys (or `k=v` in text)."""
    return {"fields": values}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": current_request_id(),
            "trace_id": current_trace_id(),
        }
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: [request_id] message k=v ...`: the ids only when set."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        request_id = current_request_id()
        extra = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        head, sep, rest = text.partition(": ")
        if request_id:
            text = f"{head}{sep}[{request_id}] {rest}"
        return f"{text} {extra}" if extra else text


def log_format(env: Mapping[str, str] | None = None) -> str:
    """`EPD_LOG_FORMAT` (text by default); ValueError for anything but text or json."""
    value = (os.environ if env is None else env).get("EPD_LOG_FORMAT", "text").strip().lower() or "text"
    if value not in FORMATS:
        raise ValueError(f"EPD_LOG_FORMAT must be one of {', '.join(FORMATS)}, not {value!r}")
    return value


def setup_logging(level: str, service: str, fmt: str | None = None) -> None:
    """Configure the root logger once for this process: `level`, and `fmt` (default: `EPD_LOG_FORMAT`)."""
    json_lines = (fmt or log_format()) == "json"
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(service) if json_lines else TextFormatter())
    if json_lines:
        _no_progress_bars()
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.captureWarnings(True)  # Python warnings become records too (one JSON line each)


def _no_progress_bars() -> None:
    """Progress bars (model loading) write partial lines to stderr: off, so every line stays JSON."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    transformers_logging.disable_progress_bar()
