"""Everything the router does to a request before placing it: limits, media, prompt, token counts.

CPU-only and bounded: header probes, tokenization and hashing run in a thread so the event loop
keeps serving; URL media is fetched first (async) through the safe fetcher when enabled.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.common.media import MediaLimits
from services.common.model_info import ModelInfo
from services.common.rpc.epd.v1 import common_pb2, generation_pb2
from services.router.accounting import Accounted, account
from services.router.config import RouterConfig
from services.router.errors import invalid
from services.router.intake import IntakeLimits, parse_messages
from services.router.metrics import RouterMetrics


@dataclass(frozen=True)
class Prepared:
    accounted: Accounted
    sampling: common_pb2.SamplingParams


def validate_sampling(sampling: common_pb2.SamplingParams, config: RouterConfig) -> common_pb2.SamplingParams:
    """A copy with defaults filled; INVALID_ARGUMENT for values out of range."""
    out = common_pb2.SamplingParams()
    out.CopyFrom(sampling)
    if out.max_tokens == 0:
        out.max_tokens = config.default_max_tokens
    if out.temperature < 0:
        raise invalid(f"sampling.temperature must be >= 0, got {out.temperature}")
    if not 0 <= out.top_p <= 1:
        raise invalid(f"sampling.top_p must be in [0, 1], got {out.top_p}")
    if len(out.stop) > 16 or any(len(s) > 256 for s in out.stop):
        raise invalid("sampling.stop: at most 16 stop strings of at most 256 characters")
    return out


class RequestPrep:
    def __init__(self, info: ModelInfo, config: RouterConfig, metrics: RouterMetrics) -> None:
        self._info = info
        self._config = config
        self._metrics = metrics
        self._limits = IntakeLimits(config.max_images_per_prompt, config.max_item_bytes, config.max_request_bytes,
                                    MediaLimits(max_pixels=config.max_image_pixels))

    def _prepare_sync(self, request: generation_pb2.GenerateRequest) -> Prepared:
        sampling = validate_sampling(request.sampling, self._config)
        intake = parse_messages(list(request.messages), self._limits)
        accounted = account(self._info, intake, sampling.max_tokens)  # checks the model's context first
        if sampling.max_tokens > self._config.max_tokens_cap:
            raise invalid(f"sampling.max_tokens {sampling.max_tokens} is above this server's cap of "
                          f"{self._config.max_tokens_cap}")
        if accounted.projected_tokens > self._config.max_projected_tokens:
            raise invalid(f"request projects {accounted.projected_tokens} tokens, above this server's limit of "
                          f"{self._config.max_projected_tokens}")
        return Prepared(accounted, sampling)

    async def prepare(self, request: generation_pb2.GenerateRequest) -> Prepared:
        return await asyncio.to_thread(self._prepare_sync, request)
