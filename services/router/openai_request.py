"""OpenAI chat-completion request bodies, validated, and their translation into a `GenerateRequest`.

Invariant: the HTTP API adds no rule of its own about content, media or sampling values; it only
maps field names. Every `image_url` and `video_url` (a data: URL or an https URL; the latter as vLLM
accepts it) becomes a `Media.url` of an image or video part, so intake,
the safe fetcher and every limit treat it exactly as they treat a gRPC request, with the same
messages. The checks here are about the JSON's shape and the OpenAI fields epd does not serve.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.rpc.epd.v1 import common_pb2, generation_pb2

OPENAI_TEMPERATURE = 1.0
"""OpenAI's default when a request sets no temperature (gRPC's default is 0, greedy)."""

# OpenAI fields that would change the answer and that epd does not implement, with their neutral values:
# a request carrying anything else is refused rather than silently answered differently.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
}
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system turn


class ImageURL(BaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(BaseModel):
    url: str


class VideoPart(BaseModel):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class Message(BaseModel):
    role: str
    content: str | list[ContentPart]
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The body of `POST /v1/chat/completions` (and of `/v1/count_tokens`); unknown fields are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Message]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, lt=1 << 64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # epd's own fields (extra_body in the openai client)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off")
    ignore_eos: bool = False
    cache_salt: str = ""

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        for name, neutral in UNSUPPORTED.items():
            if (self.model_extra or {}).get(name) not in neutral:
                raise ValueError(f"{name} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self


def _content(content: str | list[TextPart | ImagePart | VideoPart]) -> list[generation_pb2.ContentPart]:
    if isinstance(content, str):
        return [generation_pb2.ContentPart(text=content)]
    return [_part(part) for part in content]


def _part(part: TextPart | ImagePart | VideoPart) -> generation_pb2.ContentPart:
    if isinstance(part, TextPart):
        return generation_pb2.ContentPart(text=part.text)
    if isinstance(part, VideoPart):
        return generation_pb2.ContentPart(video=generation_pb2.Media(url=part.video_url.url))
    return generation_pb2.ContentPart(image=generation_pb2.Media(url=part.image_url.url))


def sampling_params(body: ChatCompletionRequest) -> common_pb2.SamplingParams:
    """OpenAI's sampling fields as epd's; unset max tokens stay 0 (the router's default applies).
    `logprobs: true` asks for the sampled token's logprob, `top_logprobs: k` also for the top k."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sampling = common_pb2.SamplingParams(
        max_tokens=body.max_completion_tokens or body.max_tokens or 0,
        temperature=OPENAI_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        stop=stop,
        ignore_eos=body.ignore_eos,
        n=body.n,
    )
    if body.seed is not None:
        sampling.seed = body.seed
    if body.logprobs:
        sampling.logprobs = body.top_logprobs or 0
    return sampling


def generate_request(body: ChatCompletionRequest, request_id: str) -> generation_pb2.GenerateRequest:
    """The gRPC request the HTTP body stands for."""
    messages = [
        generation_pb2.Message(role=ROLE_ALIASES.get(m.role, m.role), content=_content(m.content))
        for m in body.messages
    ]
    return generation_pb2.GenerateRequest(
        request_id=request_id, messages=messages, sampling=sampling_params(body), cache_salt=body.cache_salt
    )
