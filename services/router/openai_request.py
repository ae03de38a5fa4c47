"""OpenAI chat and text completion request bodies, validated, and their translation into a `GenerateRequest`.

Invariants: every number is bounded by what the gRPC request carries (uint32, uint64, a finite float32),
so no body can overflow the proto; NaN and infinity are refused; `null` is "not set" wherever OpenAI
documents a field nullable. The HTTP API adds no value rule of its own (temperature >= 0, n up to
EPD_MAX_N, the max_tokens cap, stop limits, media): the router checks those for gRPC and HTTP alike, and
`field_names` says which HTTP field each `SamplingParams` field came from, so its message names the
field the client sent. Every `image_url` and `video_url` (a data: URL or an https URL; the latter as
vLLM accepts it) becomes a `Media.url`, so intake, the safe fetcher and every limit treat it as they
treat a gRPC request. A field that would change the answer and that epd does not implement is refused
unless it holds its neutral value (`REFUSED`); other unknown fields (`user`, `metadata`, ...) are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from services.common.rpc.epd.v1 import common_pb2, generation_pb2
from services.router.api_model import U32, U64, ApiModel, FieldError, Float32, Text, needs, refusal
from services.router.openai_messages import Message, generation_messages
from services.router.openai_structured import (
    MAX_CONSTRAINT_BYTES,
    ResponseFormat,
    StructuredOutputs,
    constraints,
    schema_text,
    set_constraint,
)
from services.router.request_prep import MAX_LOGPROBS

OPENAI_TEMPERATURE = 1.0
"""OpenAI's default when a request sets no temperature (gRPC's default is 0, greedy)."""
COMPLETION_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) default `max_tokens` of a text completion."""

# Fields that would change the answer and that epd does not implement (OpenAI's, then vLLM's extras), with
# the values that mean "off" (what leaving the field out means); anything else is refused with 400 naming
# the field. `best_of` is refused unless it equals `n` (`_check_refused`).
REFUSED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "suffix": (None, ""),
    "echo": (None, False),
    "allowed_token_ids": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "guided_whitespace_pattern": (None,),
    "guided_decoding_backend": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None, []),
    "mm_processor_kwargs": (None, {}),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "vllm_xargs": (None, {}),
}
COMPLETION_REFUSED = {"tools": (None, []), "tool_choice": (None, "none", "auto")}
"""Chat's tool fields, refused on text completions (no system turn to offer tools in)."""
ADD_SPECIAL_TOKENS = {"chat": (None, False), "completion": (None, True)}  # vLLM's defaults differ by endpoint


class StreamOptions(ApiModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM's: with include_usage, every chunk carries the usage so far"
    )


class GenerationFields(ApiModel):
    """What chat and text completions share: sampling, streaming, and epd's own fields."""

    model_config = ConfigDict(
        extra="allow", allow_inf_nan=False, json_schema_extra=needs(stream_options=("stream", True))
    )
    endpoint: ClassVar[str] = "chat"
    _constraint_list: list[tuple[str, str, Any]] | None = PrivateAttr(None)  # _constraints, made once

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=U32)
    temperature: Float32 | None = Field(None, description="default 1; 0 is greedy")
    top_p: Float32 | None = Field(None, description="default 1 (off)")
    seed: int | None = Field(None, ge=0, le=U64)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=U32, description="choices; default 1")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # epd's and vLLM's own fields (extra_body in the openai client)
    top_k: int | None = Field(None, ge=-1, le=U32, description="0 or -1: off")
    ignore_eos: bool | None = None
    cache_salt: str | None = None
    # the penalties and logit_bias (OpenAI's) and vLLM's sampling extras; the router bounds their values
    repetition_penalty: Float32 | None = Field(None, description="> 0; 1 is off (vLLM)")
    presence_penalty: Float32 | None = Field(None, description="[-2, 2]; 0 is off")
    frequency_penalty: Float32 | None = Field(None, description="[-2, 2]; 0 is off")
    min_p: Float32 | None = Field(None, description="[0, 1]; 0 is off (vLLM)")
    min_tokens: int | None = Field(None, ge=0, le=U32, description="no stop before this many tokens (vLLM)")
    stop_token_ids: list[Annotated[int, Field(ge=0, le=U32)]] | None = Field(None, description="vLLM's")
    bad_words: list[str] | None = Field(None, description="words never generated (vLLM)")
    logit_bias: dict[str, Float32] | None = Field(None, description="token id (a string) -> bias in [-100, 100]")
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs (and its older guided_* fields)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and int(key) <= U32):
                raise ValueError(f"keys are token ids, got {key!r}")
        return value

    @property
    def choices(self) -> int:
        return self.n or 1

    @model_validator(mode="after")
    def _check_refused(self, info: ValidationInfo) -> GenerationFields:
        extra = self.model_extra or {}
        refused = {**REFUSED, "add_special_tokens": ADD_SPECIAL_TOKENS[self.endpoint]}
        if self.endpoint == "completion":
            refused.update(COMPLETION_REFUSED)
        for name, neutral in refused.items():
            error = refusal(name, extra.get(name), neutral)
            if error is not None:
                raise error
        if extra.get("best_of") not in (None, self.choices):
            raise FieldError("best_of", f"best_of other than n ({self.choices}) is not supported by this server yet")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed with stream=true")
        sent = self._constraint_list = self._constraints((info.context or {}).get(MAX_CONSTRAINT_BYTES))
        if len(sent) > 1:
            names = " and ".join(field for field, _, _ in sent)
            raise FieldError(sent[1][0], f"one structured-output constraint per request, got {names}")
        return self

    def constraints(self) -> list[tuple[str, str, Any]]:
        """The body's constraints (one at most once validated): (HTTP field, SamplingParams field, value, a
        schema as JSON text), made once."""
        if self._constraint_list is None:
            self._constraint_list = self._constraints(None)
        return self._constraint_list

    def _constraints(self, max_bytes: int | None) -> list[tuple[str, str, Any]]:
        return constraints(self.response_format, self.structured_outputs, self.model_extra or {}, max_bytes)

    def structured_field(self) -> dict[str, str]:
        """The SamplingParams field of the body's constraint -> the HTTP field that set it (none: empty)."""
        return {kind: field for field, kind, _ in self.constraints()}

    def base_sampling(self, max_tokens: int) -> common_pb2.SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        sampling = common_pb2.SamplingParams(
            max_tokens=max_tokens,
            temperature=OPENAI_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            stop=stop,
            ignore_eos=bool(self.ignore_eos),
            n=self.choices,
            repetition_penalty=self.repetition_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens or 0,
            stop_token_ids=self.stop_token_ids or [],
            bad_words=self.bad_words or [],
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
        )
        if self.seed is not None:
            sampling.seed = self.seed
        for field, kind, value in self.constraints():
            set_constraint(sampling, kind, value, field)
        so = self.structured_outputs
        if so is not None and so.disable_any_whitespace is not None:
            sampling.any_whitespace = not so.disable_any_whitespace
        return sampling

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's `continuous_usage_stats`, which takes `include_usage` too)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class FunctionDef(ApiModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="the arguments' JSON Schema")
    strict: bool | None = None


class ToolDef(ApiModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(ApiModel):
    name: str


class NamedToolChoice(ApiModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationFields):
    """The body of `POST /v1/chat/completions` (and of `/v1/count_tokens`)."""

    model_config = ConfigDict(
        extra="allow",
        allow_inf_nan=False,
        json_schema_extra=needs(stream_options=("stream", True), top_logprobs=("logprobs", True)),
    )

    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default auto with tools; required or a named function: exactly one call"
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=U32)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs=true")
        return self

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def tool_protos(self) -> tuple[list[generation_pb2.Tool], generation_pb2.ToolChoice]:
        tools = [
            generation_pb2.Tool(
                name=t.function.name,
                description=t.function.description or "",
                parameters=schema_text(f"tools[{i}].function.parameters", t.function.parameters)
                if t.function.parameters is not None
                else "",
            )
            for i, t in enumerate(self.tools or [])
        ]
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return tools, generation_pb2.ToolChoice(mode="function", function=choice.function.name)
        return tools, generation_pb2.ToolChoice(mode=choice or "")

    def field_names(self) -> dict[str, str]:
        """`SamplingParams` field -> the HTTP field it came from (where the names differ)."""
        max_tokens = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        return {"max_tokens": max_tokens, "logprobs": "top_logprobs", **self.structured_field()}


class CompletionRequest(GenerationFields):
    """The body of `POST /v1/completions`: one text prompt, no chat template."""

    endpoint: ClassVar[str] = "completion"

    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=1)] = Field(
        description="the text, or a list of exactly one text"
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="the top k alternatives of each token")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_text(cls, value: Any) -> Any:
        if isinstance(value, list) and value and not all(isinstance(item, str) for item in value):
            raise ValueError("token-id prompts are not supported by this server yet; send the text")
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"one prompt per request is supported, got {len(value)}")
        return value

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def field_names(self) -> dict[str, str]:
        return {"max_tokens": "max_tokens", "logprobs": "logprobs", **self.structured_field()}


def sampling_params(body: ChatCompletionRequest) -> common_pb2.SamplingParams:
    """OpenAI's sampling fields as epd's; unset max tokens stay 0 (the router's default applies).
    `logprobs: true` asks for the sampled token's logprob, `top_logprobs: k` also for the top k."""
    sampling = body.base_sampling(body.max_completion_tokens or body.max_tokens or 0)
    if body.logprobs:
        sampling.logprobs = body.top_logprobs or 0
    return sampling


def generate_request(body: ChatCompletionRequest, request_id: str) -> generation_pb2.GenerateRequest:
    """The gRPC request the chat body stands for."""
    tools, choice = body.tool_protos()
    return generation_pb2.GenerateRequest(
        request_id=request_id,
        messages=generation_messages(body.messages),
        sampling=sampling_params(body),
        cache_salt=body.cache_salt or "",
        tools=tools,
        tool_choice=choice,
    )


def completion_request(body: CompletionRequest, request_id: str) -> generation_pb2.GenerateRequest:
    """The gRPC request the text completion body stands for: its text as a raw `prompt`."""
    sampling = body.base_sampling(body.max_tokens or COMPLETION_MAX_TOKENS)
    if body.logprobs is not None:
        sampling.logprobs = body.logprobs
    return generation_pb2.GenerateRequest(
        request_id=request_id, prompt=body.text, sampling=sampling, cache_salt=body.cache_salt or ""
    )
