"""The encoder's metric instruments (exported on its Prometheus endpoint)."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.metrics import Counter, Histogram, Meter


@dataclass(frozen=True)
class EncoderMetrics:
    items_encoded: Counter
    cache_queries: Counter
    cache_hits: Counter
    batch_size: Histogram
    encode_seconds: Histogram
    preprocess_seconds: Histogram
    transfer_bytes: Counter
    transfer_seconds: Histogram

    @classmethod
    def create(cls, meter: Meter) -> EncoderMetrics:
        return cls(
            items_encoded=meter.create_counter("epd_encoder_items_encoded", description="items through the tower"),
            cache_queries=meter.create_counter("epd_embedding_cache_queries", description="cache lookups"),
            cache_hits=meter.create_counter("epd_embedding_cache_hits", description="cache hits by tier"),
            batch_size=meter.create_histogram("epd_encoder_batch_size", description="items per tower call"),
            encode_seconds=meter.create_histogram("epd_encoder_time_seconds", unit="s"),
            preprocess_seconds=meter.create_histogram("epd_preprocess_time_seconds", unit="s"),
            transfer_bytes=meter.create_counter("epd_embedding_transfer_bytes", unit="By"),
            transfer_seconds=meter.create_histogram("epd_embedding_transfer_seconds", unit="s"),
        )

    def cache_event(self, kind: str, tier: str) -> None:
        """Adapter for EmbeddingCache's `on_event` callback."""
        if kind == "hit":
            self.cache_queries.add(1)
            self.cache_hits.add(1, {"tier": tier})
        elif kind == "miss":
            self.cache_queries.add(1)
