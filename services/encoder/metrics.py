"""The encoder's metric instruments (exported on its Prometheus endpoint; counters gain `_total`).

Names follow vLLM's with an `epd_` prefix. Queue gauges are observed at scrape time from the
`EncoderLoad` snapshot function given to `observe_load`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Meter, Observation

_BATCH_ITEMS = [1, 2, 4, 8, 16, 32, 64]


@dataclass(frozen=True)
class EncoderMetrics:
    items_encoded: Counter
    cache_queries: Counter
    cache_hits: Counter
    batch_size: Histogram
    batch_tokens: Histogram
    encode_seconds: Histogram
    preprocess_seconds: Histogram
    transfer_bytes: Counter
    transfer_seconds: Histogram
    transfer_fallbacks: Counter
    rejections: Counter
    peer_waits: Counter
    meter: Meter
    preprocess_cache: Counter | None = None

    @classmethod
    def create(cls, meter: Meter) -> EncoderMetrics:
        return cls(
            items_encoded=meter.create_counter("epd_encoder_items_encoded", description="items through the tower"),
            cache_queries=meter.create_counter("epd_embedding_cache_queries", description="cache lookups"),
            cache_hits=meter.create_counter("epd_embedding_cache_hits", description="cache hits by tier"),
            batch_size=meter.create_histogram(
                "epd_encoder_batch_size",
                description="items per tower call",
                explicit_bucket_boundaries_advisory=_BATCH_ITEMS,
            ),
            batch_tokens=meter.create_histogram("epd_encoder_batch_tokens", description="encoder tokens per call"),
            encode_seconds=meter.create_histogram(
                "epd_encoder_time_seconds", unit="s", description="seconds per tower call"
            ),
            preprocess_seconds=meter.create_histogram(
                "epd_preprocess_time_seconds", unit="s", description="decode and resize seconds per item"
            ),
            transfer_bytes=meter.create_counter(
                "epd_embedding_transfer_bytes", unit="By", description="embedding bytes pushed, by transport"
            ),
            transfer_seconds=meter.create_histogram(
                "epd_embedding_transfer_seconds", unit="s", description="seconds per push, by transport"
            ),
            transfer_fallbacks=meter.create_counter(
                "epd_embedding_transfer_fallbacks", description="dist pushes retried over gRPC"
            ),
            rejections=meter.create_counter("epd_encoder_rejections", description="Encode refusals by reason"),
            peer_waits=meter.create_counter(
                "epd_encoder_peer_waits", description="items another encoder was already encoding"
            ),
            meter=meter,
            preprocess_cache=meter.create_counter(
                "epd_preprocess_cache_lookups", description="video frame-cache lookups by result (hit, miss)"
            ),
        )

    def cache_event(self, kind: str, tier: str) -> None:
        """Adapter for EmbeddingCache's `on_event` callback."""
        if kind == "hit":
            self.cache_queries.add(1)
            self.cache_hits.add(1, {"tier": tier})
        elif kind == "miss":
            self.cache_queries.add(1)

    def preprocess_cache_event(self, kind: str) -> None:
        """Adapter for PreprocessCache's `on_event` ("hit" | "miss")."""
        if self.preprocess_cache is not None:
            self.preprocess_cache.add(1, {"result": kind})

    def record_batch(self, stats: Any) -> None:
        """Adapter for the Batcher's `on_batch` (a `BatchStats`)."""
        self.encode_seconds.record(stats.seconds)
        if stats.ok:
            self.batch_size.record(stats.items)
            self.batch_tokens.record(stats.tokens)
            self.items_encoded.add(stats.items)

    def record_push(self, result: Any) -> None:
        """Adapter for the Pusher's `on_result` (a `PushResult`)."""
        self.transfer_bytes.add(result.bytes, {"transport": result.transport})
        self.transfer_seconds.record(result.seconds, {"transport": result.transport})
        if result.fell_back:
            self.transfer_fallbacks.add(1)

    def observe_load(self, snapshot: Callable[[], Any]) -> None:
        """Gauges read from `snapshot()` (an object with the `EncoderLoad` fields) at each scrape."""
        gauges = {
            "epd_encoder_queue_depth": ("queued_items", "items admitted and not yet encoded"),
            "epd_encoder_queued_tokens": ("queued_tokens", "encoder tokens admitted and not yet encoded"),
            "epd_preprocess_queue_depth": ("preprocess_outstanding", "items in the preprocessing pool"),
            "epd_encoder_batch_queue_depth": ("batch_queue_items", "items waiting for a tower call"),
            "epd_encoder_expected_wait_ms": ("expected_wait_ms", "expected wait for the admitted work to finish"),
        }
        for name, (attribute, description) in gauges.items():
            self.meter.create_observable_gauge(name, callbacks=[_reader(snapshot, attribute)], description=description)


def _reader(snapshot: Callable[[], Any], attribute: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(getattr(snapshot(), attribute))]

    return observe
