"""Everything the router does to a request before placing it: limits, media, prompt, token counts.

CPU-only and bounded: header probes, tokenization and hashing run in a thread so the event loop keeps serving,
but for short text with small images (`_is_small`), where they cost less than the hop; URL media is fetched first
(async) through the safe fetcher when enabled; a structured-output constraint is checked, then compiled on its own
thread within a time bound (structured.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

from services.common import video
from services.common.grammar import ConstraintError
from services.common.media import MediaError, MediaLimits
from services.common.media_types import VideoLimits
from services.common.model_info import ModelInfo
from services.common.rpc.epd.v1 import common_pb2, generation_pb2
from services.common.tracing import tracer
from services.models.base import supports_video
from services.router.accounting import Accounted, account
from services.router.config import RouterConfig
from services.router.errors import RequestError, invalid
from services.router.fetch import FetchError, FetchPolicy, fetch_media
from services.router.intake import IntakeLimits, parse_messages
from services.router.metrics import RouterMetrics
from services.router.processor_params import check_processor_params
from services.router.structured import StructuredCheck
from services.router.text_prompt import account_prompt
from services.router.tool_calls import call_grammar, check_tools, tools_system_text

MAX_LOGPROBS = 20
"""The most top alternatives a request may ask for per token (`sampling.logprobs`), as OpenAI allows."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    accounted: Accounted
    sampling: common_pb2.SamplingParams
    tools: bool = False  # the model was offered tools: its text is parsed for calls


def validate_sampling(sampling: common_pb2.SamplingParams, config: RouterConfig) -> common_pb2.SamplingParams:
    """A copy with defaults filled; INVALID_ARGUMENT for values out of range."""
    out = common_pb2.SamplingParams()
    out.CopyFrom(sampling)
    if out.max_tokens == 0:
        out.max_tokens = config.default_max_tokens
    if out.n == 0:
        out.n = 1
    if out.n > config.max_n:
        raise invalid(f"sampling.n must be in [1, {config.max_n}], got {out.n}")
    if out.HasField("logprobs") and out.logprobs > MAX_LOGPROBS:
        raise invalid(f"sampling.logprobs must be in [0, {MAX_LOGPROBS}], got {out.logprobs}")
    if out.temperature < 0:
        raise invalid(f"sampling.temperature must be >= 0, got {out.temperature}")
    if not 0 <= out.top_p <= 1:
        raise invalid(f"sampling.top_p must be in [0, 1], got {out.top_p}")
    if len(out.stop) > 16 or any(len(s) > 256 for s in out.stop):
        raise invalid("sampling.stop: at most 16 stop strings of at most 256 characters")
    return out


def with_tools_turn(request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    """A copy whose system turn offers the tools (Qwen2.5's tools block after the system text, or a system turn
    of its own first)."""
    copy = generation_pb2.GenerateRequest()
    copy.CopyFrom(request)
    text = tools_system_text(list(request.tools))
    if copy.messages and copy.messages[0].role == "system":
        copy.messages[0].content.add(text="\n\n" + text)
    else:
        turn = generation_pb2.Message(role="system", content=[generation_pb2.ContentPart(text=text)])
        copy.messages.insert(0, turn)
    return copy


INLINE_TEXT_CHARS = 8192
"""The most text characters of a request prepared on the event loop itself (`_is_small`)."""
INLINE_IMAGE_BYTES = 256 << 10
"""The most image bytes of such a request (inline or data: URLs, as decoded; no video): decoding a data: URL, probing
a header and hashing ~100 KB cost less than the hop to a thread and back."""


def _is_small(request: generation_pb2.GenerateRequest) -> bool:
    chars, media = len(request.prompt), 0
    for message in request.messages:
        for part in message.content:
            kind = part.WhichOneof("part")
            if kind == "text":
                chars += len(part.text)
            elif kind == "image" and part.image.WhichOneof("source") == "data":
                media += len(part.image.data)
            elif kind == "image" and part.image.url.startswith("data:"):
                media += len(part.image.url) * 3 // 4  # base64: what it decodes to
            else:
                return False
    return chars <= INLINE_TEXT_CHARS and media <= INLINE_IMAGE_BYTES


def _is_remote(part: generation_pb2.ContentPart) -> bool:
    kind = part.WhichOneof("part")
    if kind not in ("image", "video"):
        return False
    media = getattr(part, kind)
    return media.WhichOneof("source") == "url" and not media.url.startswith("data:")


def fetch_policy(config: RouterConfig) -> FetchPolicy:
    """The router's one fetch policy (built once: it holds the TLS context)."""
    if config.fetch_allow_loopback_for_tests:
        log.warning(
            "EPD_FETCH_ALLOW_LOOPBACK_FOR_TESTS is on: media URLs may reach 127.0.0.1 over http. "
            "Never enable this in production."
        )
    return FetchPolicy(
        allowed_hosts=frozenset(config.fetch_allowed_hosts) or None,
        max_bytes=config.max_item_bytes,
        total_timeout_s=config.fetch_timeout_s,
        connect_timeout_s=min(5.0, config.fetch_timeout_s),
        max_redirects=config.fetch_max_redirects,
        allow_loopback_for_tests=config.fetch_allow_loopback_for_tests,
    )


class RequestPrep:
    def __init__(self, info: ModelInfo, config: RouterConfig, metrics: RouterMetrics) -> None:
        self._info = info
        self._config = config
        self._metrics = metrics
        self._policy = fetch_policy(config) if config.fetch_enabled else None
        self.structured = StructuredCheck(info, config)
        self._limits = IntakeLimits(
            config.max_images_per_prompt,
            config.max_item_bytes,
            config.max_request_bytes,
            MediaLimits(max_pixels=config.max_image_pixels),
            config.max_videos_per_prompt,
            VideoLimits(config.max_video_frame_pixels, config.max_video_frames, config.max_video_seconds),
            accepts_video=supports_video(info.adapter),
        )
        if self._limits.accepts_video:
            video.warm_up()

    def _prepare_sync(self, request: generation_pb2.GenerateRequest) -> Prepared:
        sampling = validate_sampling(request.sampling, self._config)
        check_processor_params(sampling, self._info.adapter.tokenizer, self._info.adapter.vocab_size)
        offered = self._offer_tools(request, sampling)
        if offered:
            request = with_tools_turn(request)
        self.structured.resolve(sampling)
        if request.prompt:
            if request.messages:
                raise invalid("a request has messages or a prompt, not both")
            accounted = account_prompt(self._info, request.prompt, sampling.max_tokens, sampling.n)
        else:
            accounted = self._account_messages(request, sampling)
        if sampling.max_tokens > self._config.max_tokens_cap:
            raise invalid(
                f"sampling.max_tokens {sampling.max_tokens} is above this server's cap of {self._config.max_tokens_cap}"
            )
        if accounted.projected_tokens > self._config.max_projected_tokens:
            raise invalid(
                f"request projects {accounted.projected_tokens} tokens, above this server's limit of "
                f"{self._config.max_projected_tokens}"
            )
        return Prepared(accounted, sampling, offered)

    def _offer_tools(self, request: generation_pb2.GenerateRequest, sampling: common_pb2.SamplingParams) -> bool:
        """Whether the request offers the model tools (any, and tool_choice not "none"); with "required" or a
        named function, ``sampling.grammar`` becomes the grammar of one call. INVALID_ARGUMENT naming the field
        for bad tools or a choice that cannot hold."""
        choice = request.tool_choice
        try:
            check_tools(list(request.tools), choice, self._config.structured_max_depth)
        except ConstraintError as exc:
            raise invalid(str(exc)) from None
        if not request.tools or choice.mode == "none":
            return False
        if request.prompt:
            raise invalid("tools need messages (a raw prompt has no system turn to offer them in)")
        if choice.mode in ("required", "function"):
            if sampling.WhichOneof("structured") is not None:
                raise invalid(f"tool_choice {choice.mode} holds the answer to a call: no other constraint with it")
            tools = [t for t in request.tools if choice.mode == "required" or t.name == choice.function]
            spaced = self._config.structured_any_whitespace
            any_whitespace = sampling.any_whitespace if sampling.HasField("any_whitespace") else spaced
            try:
                sampling.grammar = call_grammar(tools, any_whitespace)
            except ConstraintError as exc:
                raise invalid(str(exc)) from None
        return True

    def _account_messages(
        self, request: generation_pb2.GenerateRequest, sampling: common_pb2.SamplingParams
    ) -> Accounted:
        try:
            intake = parse_messages(list(request.messages), self._limits)
        except RequestError as exc:
            if isinstance(exc.__cause__, MediaError):
                self._metrics.media_refusals.add(1, {"reason": str(exc.__cause__.reason)})
            raise
        return account(self._info, intake, sampling.max_tokens, sampling.n)  # checks the model's context first

    async def prepare(self, request: generation_pb2.GenerateRequest) -> Prepared:
        if self._policy is not None:
            request = await self._fetch_urls(request)
        if _is_small(request):
            # a millisecond or less of probing, hashing and tokenizing: a thread hop (and its GIL handoffs while the
            # loop streams tokens) would cost more, and refusals must come back fast
            prepared = self._prepare_sync(request)
        else:
            prepared = await asyncio.to_thread(self._prepare_sync, request)
        await self.structured.compile(prepared.sampling)  # on the compile thread, within its time bound
        return prepared

    async def _fetch_urls(self, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
        """A copy of `request` with every non-data: media URL replaced by its fetched bytes."""
        targets = [
            (m, p)
            for m, message in enumerate(request.messages)
            for p, part in enumerate(message.content)
            if _is_remote(part)
        ]
        if not targets:
            return request
        most = self._config.max_images_per_prompt + self._config.max_videos_per_prompt
        if len(targets) > most:
            raise invalid(f"more than {most} media URLs in one prompt")
        fetched = await asyncio.gather(*(self._fetch_one(request, m, p) for m, p in targets), return_exceptions=True)
        for result in fetched:
            if isinstance(result, BaseException):
                raise result
        copy = generation_pb2.GenerateRequest()
        copy.CopyFrom(request)
        for (m, p), data in zip(targets, fetched, strict=True):
            part = copy.messages[m].content[p]
            getattr(part, part.WhichOneof("part")).data = data
        return copy

    async def _fetch_one(self, request: generation_pb2.GenerateRequest, m: int, p: int) -> bytes:
        part = request.messages[m].content[p]
        url = getattr(part, part.WhichOneof("part")).url
        with tracer().start_as_current_span("fetch") as span:  # the host only: a URL's path or query may be secret
            span.set_attribute("server.address", urlsplit(url).hostname or "")
            try:
                data = await fetch_media(url, self._policy)
            except FetchError as exc:
                self._metrics.fetch_refusals.add(1, {"reason": str(exc.reason)})
                span.set_attribute("epd.refusal.reason", str(exc.reason))
                raise invalid(f"messages[{m}].content[{p}]: {exc}") from exc
            span.set_attribute("epd.bytes", len(data))
            return data
