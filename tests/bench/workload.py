"""The benchmark's workload and its latency accounting, shared by the engine and the baseline runs."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from services.models.base import ChatMessage, ChatPart, PixelInputs
from tests import media_factory

WORDS = [
    "image",
    "picture",
    "scene",
    "light",
    "colour",
    "shape",
    "detail",
    "describe",
    "explain",
    "compare",
    "object",
    "person",
    "street",
    "house",
    "tree",
    "water",
    "sky",
    "window",
    "table",
    "chair",
    "small",
    "large",
    "bright",
    "dark",
    "left",
    "right",
    "above",
    "below",
    "near",
    "far",
]


@dataclass
class BenchRequest:
    """One request of the workload: prompt ids, an optional image (preprocessed), output length, arrival."""

    request_id: str
    arrival_s: float
    token_ids: list[int]
    max_tokens: int
    pixels: PixelInputs | None = None
    embedding: torch.Tensor | None = None
    image_offset: int = 0
    image_tokens: int = 0


@dataclass
class Timeline:
    """When each of a request's tokens came out (seconds from the run's start)."""

    arrival_s: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival_s

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass(frozen=True)
class Summary:
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    wall_s: float
    output_tokens: int


def make_workload(
    adapter: Any,
    num_requests: int,
    image_fraction: float,
    output_range: tuple[int, int],
    mean_interval_s: float,
    seed: int,
    image_size: int = 448,
) -> list[BenchRequest]:
    """Mixed text and image requests with Poisson arrivals; deterministic for a seed."""
    rng = random.Random(seed)
    requests, clock = [], 0.0
    for i in range(num_requests):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))
        with_image = rng.random() < image_fraction
        parts = [ChatPart("image"), ChatPart("text", text)] if with_image else [ChatPart("text", text)]
        items = [adapter.image_tokens(image_size, image_size)] if with_image else []
        built = adapter.build_prompt([ChatMessage("user", parts)], items)
        request = BenchRequest(f"req-{i}", clock, built.token_ids, rng.randint(*output_range))
        if with_image:
            picture = media_factory.image(image_size, image_size, seed=seed * 1000 + i)
            request.pixels = adapter.preprocess(picture)
            request.image_offset, request.image_tokens = built.spans[0].offset, built.spans[0].num_tokens
        requests.append(request)
        clock += rng.expovariate(1.0 / mean_interval_s) if mean_interval_s > 0 else 0.0
    return requests


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(timelines: list[Timeline]) -> Summary:
    start = min(t.arrival_s for t in timelines)
    end = max(t.token_times[-1] for t in timelines)
    tokens = sum(len(t.token_times) for t in timelines)
    ttfts = [t.ttft for t in timelines]
    itls = [gap for t in timelines for gap in t.itls()]
    return Summary(
        tokens_per_s=tokens / (end - start),
        ttft_p50_ms=1000 * percentile(ttfts, 50),
        ttft_p99_ms=1000 * percentile(ttfts, 99),
        itl_p50_ms=1000 * percentile(itls, 50),
        itl_p99_ms=1000 * percentile(itls, 99),
        wall_s=end - start,
        output_tokens=tokens,
    )
