"""The worker's metric instruments (names follow vLLM's, with an `epd_` prefix).

Gauges read the engine loop's last KV snapshot when Prometheus scrapes; counters are fed by the
server as requests finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Meter, Observation


@dataclass(frozen=True)
class WorkerMetrics:
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    prefill_seconds: Histogram
    embedding_wait_seconds: Histogram
    transfer_bytes: Counter

    @classmethod
    def create(cls, meter: Meter, kv_state: Callable[[], Any]) -> WorkerMetrics:
        def gauge(name: str, value: Callable[[Any], float], description: str) -> None:
            def observe(options: CallbackOptions) -> Iterable[Observation]:
                yield Observation(value(kv_state()))
            meter.create_observable_gauge(name, callbacks=[observe], description=description)

        gauge("epd_kv_cache_usage_perc", lambda s: 1 - s.free_blocks / max(1, s.total_blocks),
              "fraction of KV blocks in use")
        gauge("epd_kv_cache_reserved_blocks", lambda s: s.reserved_blocks, "blocks promised to admitted requests")
        gauge("epd_kv_cache_total_blocks", lambda s: s.total_blocks, "KV blocks of this worker")
        gauge("epd_num_requests_running", lambda s: s.running, "requests being computed")
        gauge("epd_num_requests_waiting", lambda s: s.waiting, "requests waiting to be scheduled")
        gauge("epd_num_preemptions", lambda s: s.preemptions, "preemptions since start")
        return cls(
            prefix_cache_queries=meter.create_counter("epd_prefix_cache_queries", unit="tokens"),
            prefix_cache_hits=meter.create_counter("epd_prefix_cache_hits", unit="tokens"),
            prompt_tokens=meter.create_counter("epd_prompt_tokens", unit="tokens"),
            generation_tokens=meter.create_counter("epd_generation_tokens", unit="tokens"),
            prefill_seconds=meter.create_histogram("epd_request_prefill_time_seconds", unit="s"),
            embedding_wait_seconds=meter.create_histogram("epd_embedding_wait_seconds", unit="s"),
            transfer_bytes=meter.create_counter("epd_embedding_transfer_received_bytes", unit="By"),
        )
