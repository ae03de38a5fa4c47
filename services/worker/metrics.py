"""The worker's metric instruments (names follow vLLM's, with an `epd_` prefix).

Gauges read the engine loop's last KV snapshot (and the step-cost model's last fit) when Prometheus
scrapes; counters are fed by the server as requests finish; the step histograms by the engine thread after
each timed step (`record_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Meter, Observation

from services.worker.engine.step_cost import TERMS, StepCostModel, StepTiming

RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
"""Buckets of the measured / predicted step time histogram, around 1."""

COEFFICIENT_UNITS = {
    "base": "seconds per step",
    "decode_rows": "seconds per decode row",
    "decode_context": "seconds per context token of a decode row",
    "prefill_tokens": "seconds per prefill token",
    "prefill_attention": "seconds per prefill token x its chunk's context",
}


@dataclass(frozen=True)
class WorkerMetrics:
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    prefill_seconds: Histogram
    embedding_wait_seconds: Histogram
    transfer_bytes: Counter
    step_prefill_budget: Histogram
    step_time_ratio: Histogram
    relayed_responses: Counter
    kv_transfer_bytes: Counter
    kv_transfer_seconds: Histogram

    @classmethod
    def create(cls, meter: Meter, kv_state: Callable[[], Any], step_costs: StepCostModel) -> WorkerMetrics:
        def gauge(name: str, value: Callable[[Any], float], description: str) -> None:
            def observe(options: CallbackOptions) -> Iterable[Observation]:
                yield Observation(value(kv_state()))

            meter.create_observable_gauge(name, callbacks=[observe], description=description)

        gauge(
            "epd_kv_cache_usage_perc",
            lambda s: 1 - s.free_blocks / max(1, s.total_blocks),
            "fraction of KV blocks in use",
        )
        gauge("epd_kv_cache_reserved_blocks", lambda s: s.reserved_blocks, "blocks promised to admitted requests")
        gauge("epd_kv_cache_total_blocks", lambda s: s.total_blocks, "KV blocks of this worker")
        gauge("epd_num_requests_running", lambda s: s.running, "requests being computed")
        gauge("epd_num_requests_waiting", lambda s: s.waiting, "requests waiting to be scheduled")

        def preemptions(options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(kv_state().preemptions)  # the engine's running total: a monotonic counter

        meter.create_observable_counter(
            "epd_num_preemptions", callbacks=[preemptions], description="requests preempted (recomputed later)"
        )

        def coefficients(options: CallbackOptions) -> Iterable[Observation]:
            for term, value in zip(TERMS, step_costs.coefficients, strict=True):  # one tuple: a consistent fit
                yield Observation(value, {"term": term})

        meter.create_observable_gauge(
            "epd_step_cost_coefficient",
            callbacks=[coefficients],
            description="the fitted step-cost model, step seconds = sum of coefficient x term; by term: "
            + "; ".join(f"{term}: {unit}" for term, unit in COEFFICIENT_UNITS.items()),
        )
        return cls(
            prefix_cache_queries=meter.create_counter(
                "epd_prefix_cache_queries", unit="tokens", description="prompt tokens looked up in the prefix cache"
            ),
            prefix_cache_hits=meter.create_counter(
                "epd_prefix_cache_hits", unit="tokens", description="prompt tokens found in the prefix cache"
            ),
            prompt_tokens=meter.create_counter(
                "epd_prompt_tokens", unit="tokens", description="prompt tokens of finished requests"
            ),
            generation_tokens=meter.create_counter(
                "epd_generation_tokens", unit="tokens", description="tokens generated"
            ),
            relayed_responses=meter.create_counter(
                "epd_relayed_responses", description="responses (a request's new tokens) sent on routers' relays"
            ),
            prefill_seconds=meter.create_histogram(
                "epd_request_prefill_time_seconds", unit="s", description="seconds from admission to the first token"
            ),
            embedding_wait_seconds=meter.create_histogram(
                "epd_embedding_wait_seconds", unit="s", description="seconds a request waited for pushed embeddings"
            ),
            transfer_bytes=meter.create_counter(
                "epd_embedding_transfer_received_bytes", unit="By", description="embedding bytes received, by transport"
            ),
            kv_transfer_bytes=meter.create_counter(
                "epd_kv_transfer_bytes",
                unit="By",
                description="KV bytes of remote prefills, by direction (sent, received) and transport",
            ),
            kv_transfer_seconds=meter.create_histogram(
                "epd_kv_transfer_seconds",
                unit="s",
                description="seconds from a remote prefill's admission to its decode worker's acknowledgement",
            ),
            step_prefill_budget=meter.create_histogram(
                "epd_step_prefill_budget_tokens",
                unit="tokens",
                description="prefill tokens the inter-token latency target allowed a step (EPD_ITL_TARGET_MS or "
                "EPD_ITL_TARGET_FACTOR; steps with decodes running and prefill waiting)",
            ),
            step_time_ratio=meter.create_histogram(
                "epd_step_time_ratio",
                explicit_bucket_boundaries_advisory=RATIO_BUCKETS,
                description="an engine step's measured time over the step-cost model's prediction made before it",
            ),
        )

    def record_step(self, timing: StepTiming) -> None:
        """One timed engine step (called on the engine thread)."""
        if timing.predicted_s > 0:
            self.step_time_ratio.record(timing.seconds / timing.predicted_s)
        if timing.prefill_budget is not None:
            self.step_prefill_budget.record(timing.prefill_budget)

    def record_finished(self, prompt_tokens: int, cached_tokens: int, generated: int) -> None:
        """One finished request: its prompt (queried against the prefix cache), the cached part, its output."""
        self.prefix_cache_queries.add(prompt_tokens)
        self.prefix_cache_hits.add(cached_tokens)
        self.prompt_tokens.add(prompt_tokens)
        self.generation_tokens.add(generated)
