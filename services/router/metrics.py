"""The router's metric instruments (names follow vLLM's, with an `epd_` prefix)."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.metrics import Counter, Histogram, UpDownCounter

from services.common.fast_histogram import FastHistogram
from services.common.telemetry import Telemetry


@dataclass(frozen=True)
class RouterMetrics:
    requests: Counter
    rejections: Counter
    fetch_refusals: Counter
    media_refusals: Counter
    queue_seconds: Histogram
    ttft_seconds: Histogram
    itl_seconds: FastHistogram  # recorded per streamed chunk: the cheap kind
    e2e_seconds: Histogram
    encode_seconds: Histogram
    running: UpDownCounter
    cache_queries: Counter
    cache_hits: Counter
    migrations: Counter
    count_tokens: Counter
    remote_prefills: Counter

    @classmethod
    def create(cls, telemetry: Telemetry) -> RouterMetrics:
        meter = telemetry.meter
        return cls(
            requests=meter.create_counter(
                "epd_requests", description="Generate requests by outcome (ok, cancelled, or the gRPC status)"
            ),
            rejections=meter.create_counter("epd_admission_rejections", description="refusals by reason"),
            fetch_refusals=meter.create_counter("epd_fetch_refusals", description="URL fetch refusals by reason"),
            media_refusals=meter.create_counter("epd_media_refusals", description="media refusals by reason"),
            queue_seconds=meter.create_histogram(
                "epd_request_queue_time_seconds", unit="s", description="seconds a request waited for KV blocks"
            ),
            ttft_seconds=meter.create_histogram(
                "epd_time_to_first_token_seconds", unit="s", description="seconds from arrival to the first token"
            ),
            itl_seconds=telemetry.fast_histogram("epd_inter_token_latency_seconds", "seconds between streamed tokens"),
            e2e_seconds=meter.create_histogram(
                "epd_e2e_request_latency_seconds", unit="s", description="seconds from arrival to the end"
            ),
            encode_seconds=meter.create_histogram(
                "epd_request_encode_time_seconds", unit="s", description="seconds the router waited for encodes"
            ),
            running=meter.create_up_down_counter(
                "epd_router_requests_in_flight", description="Generate requests being served"
            ),
            cache_queries=meter.create_counter("epd_embedding_cache_queries", description="items looked up"),
            cache_hits=meter.create_counter("epd_embedding_cache_hits", description="items already cached, by tier"),
            migrations=meter.create_counter(
                "epd_migrations", description="requests moved to another worker after theirs failed, by reason"
            ),
            remote_prefills=meter.create_counter(
                "epd_remote_prefills",
                description="requests prefilled on a prefill worker, by outcome (sent, failed, cancelled)",
            ),
            count_tokens=meter.create_counter(
                "epd_count_tokens_requests", description="CountTokens calls (gRPC and HTTP) by outcome"
            ),
        )
