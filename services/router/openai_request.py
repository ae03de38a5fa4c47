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

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from services.common.rpc.epd.v1 import common_pb2, generation_pb2
from services.router.constraint_size import ConstraintTooLarge, check_constraint_size
from services.router.request_prep import MAX_LOGPROBS

OPENAI_TEMPERATURE = 1.0
"""OpenAI's default when a request sets no temperature (gRPC's default is 0, greedy)."""
COMPLETION_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) default `max_tokens` of a text completion."""
U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
F32_MAX = 3.4028234663852886e38  # the largest finite float32: a larger value would reach the engine as inf
MAX_CONSTRAINT_BYTES = "max_constraint_bytes"
"""The validation context's key for the router's EPD_STRUCTURED_MAX_BYTES: a structured-output constraint
surely longer is refused while the body is validated, before it is written out as text (services/router/
constraint_size.py; without it the router's own check refuses it later, at the cost of that text)."""

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
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system turn
PART_TYPES = ("text", "image_url", "video_url")


class FieldError(ValueError):
    """A refusal from a model's own check, about `field` of the object being checked (its `param`); the
    message starts with the field's name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ApiModel(BaseModel):
    """Every body object: NaN and infinity are refused wherever a number is taken."""

    model_config = ConfigDict(allow_inf_nan=False)


Float32 = Annotated[float, Field(ge=-F32_MAX, le=F32_MAX)]
Text = Annotated[str, Field(min_length=1)]


def _needs(**conditions: Any) -> dict[str, Any]:
    """JSON schema: a field present only with another field's value (`stream_options` needs `stream: true`),
    so generated and hand-written bodies alike know the rule the validator enforces."""
    return {
        "dependentSchemas": {
            field: {"required": [other], "properties": {other: {"const": value}}}
            for field, (other, value) in conditions.items()
        }
    }


class ImageURL(ApiModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(ApiModel):
    type: Literal["text"]
    text: str


class ImagePart(ApiModel):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(ApiModel):
    url: str


class VideoPart(ApiModel):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


Content = str | list[ContentPart]


class Turn(ApiModel):
    """What every message has besides its role and content: an optional `name` (accepted, not rendered);
    fields that would change the prompt and that epd does not render are refused."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    name: str | None = None

    refused: ClassVar[tuple[str, ...]] = ("tool_calls", "function_call", "tool_call_id")

    @model_validator(mode="after")
    def _check(self) -> Turn:
        for field in self.refused:
            if (self.model_extra or {}).get(field) not in (None, []):
                raise FieldError(field, f"{field} is not supported by this server yet")
        return self


class SystemMessage(Turn):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(Turn):
    role: Literal["user"]
    content: Content


class CalledFunction(ApiModel):
    name: str
    arguments: str = Field(description="a JSON object, as text")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object (as text)")
        return value


class PastToolCall(ApiModel):
    """A call the assistant made earlier in the conversation (as a response's `message.tool_calls` gave it)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(Turn):
    refused: ClassVar[tuple[str, ...]] = ("function_call", "tool_call_id")

    role: Literal["assistant"]
    content: Content | None = Field(None, description="null or absent: an empty turn")
    tool_calls: list[PastToolCall] | None = None


class ToolMessage(Turn):
    """A tool's result, answering the assistant's call `tool_call_id`."""

    refused: ClassVar[tuple[str, ...]] = ("tool_calls", "function_call")

    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class StreamOptions(ApiModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM's: with include_usage, every chunk carries the usage so far"
    )


def refusal(name: str, value: Any, neutral: tuple[Any, ...]) -> FieldError | None:
    if value in neutral:
        return None
    hint = f" (or send {json.dumps(neutral[1])})" if len(neutral) > 1 else ""
    return FieldError(name, f"{name} is not supported by this server yet; leave it out{hint}")


Schema = dict[str, Any] | bool


class JsonSchemaFormat(ApiModel):
    """`response_format.json_schema`: the schema (`strict` accepted either way: every schema is enforced)."""

    model_config = ConfigDict(allow_inf_nan=False, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: Schema = Field(alias="schema", description="the JSON Schema the answer follows")
    strict: bool | None = None


class TextFormat(ApiModel):
    type: Literal["text"]


class JsonObjectFormat(ApiModel):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(ApiModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class StructuredOutputs(ApiModel):
    """vLLM's `structured_outputs`: one of `json`, `regex`, `choice`, `grammar`, `json_object`."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    json_: Schema | str | None = Field(None, alias="json", description="a JSON Schema (an object or its text)")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="an EBNF grammar (xgrammar's; start rule `root`)")
    json_object: bool | None = None
    disable_any_whitespace: bool | None = Field(None, description="true: compact JSON; default the server's")
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> StructuredOutputs:
        for name in ("whitespace_pattern", "structural_tag"):
            if (self.model_extra or {}).get(name) is not None:
                raise FieldError(name, f"{name} is not supported by this server yet")
        return self


def schema_text(field: str, schema: Any) -> str:
    """A schema sent as an object, as JSON text (one sent as text is kept as sent); FieldError for one nested
    too deep to write out (the router's depth limit refuses far shallower ones)."""
    if isinstance(schema, str):
        return schema
    try:
        return json.dumps(schema, ensure_ascii=False)
    except RecursionError:
        raise FieldError(field, f"{field} is nested too deeply") from None


def _constraints(body: GenerationFields, max_bytes: int | None) -> list[tuple[str, str, Any]]:
    """Every constraint the body sets: (HTTP field, SamplingParams field, value), each schema as JSON text;
    FieldError for one surely over ``max_bytes`` (checked before any schema is written out)."""
    sent: list[tuple[str, str, Any]] = []
    fmt = body.response_format
    if isinstance(fmt, JsonObjectFormat):
        sent.append(("response_format", "json_object", True))
    elif isinstance(fmt, JsonSchemaResponseFormat):
        sent.append(("response_format.json_schema.schema", "json_schema", fmt.json_schema.schema_))
    so = body.structured_outputs
    if so is not None:
        if so.json_ is not None:
            sent.append(("structured_outputs.json", "json_schema", so.json_))
        for name in ("regex", "choice", "grammar"):
            if getattr(so, name) is not None:
                sent.append((f"structured_outputs.{name}", name, getattr(so, name)))
        if so.json_object:
            sent.append(("structured_outputs.json_object", "json_object", True))
    extra = body.model_extra or {}
    if extra.get("guided_json") is not None:
        sent.append(("guided_json", "json_schema", extra["guided_json"]))
    for name in ("regex", "choice", "grammar"):
        if extra.get(f"guided_{name}") is not None:
            sent.append((f"guided_{name}", name, extra[f"guided_{name}"]))
    for field, kind, value in sent:
        try:
            if kind != "json_object":
                check_constraint_size(field, value, max_bytes)
        except ConstraintTooLarge as exc:
            raise FieldError(exc.field, str(exc)) from None
    return [(field, kind, schema_text(field, value) if kind == "json_schema" else value) for field, kind, value in sent]


def _set_constraint(sampling: common_pb2.SamplingParams, kind: str, value: Any, field: str) -> None:
    if kind == "json_object":
        sampling.json_object = True
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise FieldError(field, f"{field} must be an array of strings")
        sampling.choice.choices.extend(value)
    else:
        if not isinstance(value, str):
            raise FieldError(field, f"{field} must be a string")
        setattr(sampling, kind, value)


class GenerationFields(ApiModel):
    """What chat and text completions share: sampling, streaming, and epd's own fields."""

    model_config = ConfigDict(
        extra="allow", allow_inf_nan=False, json_schema_extra=_needs(stream_options=("stream", True))
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
        constraints = self._constraint_list = _constraints(self, (info.context or {}).get(MAX_CONSTRAINT_BYTES))
        if len(constraints) > 1:
            names = " and ".join(field for field, _, _ in constraints)
            raise FieldError(constraints[1][0], f"one structured-output constraint per request, got {names}")
        return self

    def constraints(self) -> list[tuple[str, str, Any]]:
        """The body's constraints (one at most once validated): (HTTP field, SamplingParams field, value, a
        schema as JSON text), made once."""
        if self._constraint_list is None:
            self._constraint_list = _constraints(self, None)
        return self._constraint_list

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
            _set_constraint(sampling, kind, value, field)
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
        json_schema_extra=_needs(stream_options=("stream", True), top_logprobs=("logprobs", True)),
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


def _content(content: str | list[TextPart | ImagePart | VideoPart] | None) -> list[generation_pb2.ContentPart]:
    if content is None:  # an assistant turn without text (vLLM renders it as empty)
        return [generation_pb2.ContentPart(text="")]
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
    sampling = body.base_sampling(body.max_completion_tokens or body.max_tokens or 0)
    if body.logprobs:
        sampling.logprobs = body.top_logprobs or 0
    return sampling


def generation_messages(messages: list[Message]) -> list[generation_pb2.Message]:
    """The chat turns as gRPC messages. Tool calls and results are written as Qwen2.5's chat template writes
    them: an assistant turn's calls after its text, each `<tool_call>` JSON `</tool_call>`; consecutive tool
    results as one user turn of `<tool_response>` blocks."""
    out: list[generation_pb2.Message] = []
    for i, m in enumerate(messages):
        content = _content(m.content)
        if isinstance(m, AssistantMessage) and m.tool_calls:
            calls = "".join(_past_call(c) for c in m.tool_calls)
            said = any(part.text for part in content)
            content.append(generation_pb2.ContentPart(text=calls if said else calls.removeprefix("\n")))
        if isinstance(m, ToolMessage):
            results = [generation_pb2.ContentPart(text="<tool_response>\n"), *content]
            results.append(generation_pb2.ContentPart(text="\n</tool_response>"))
            if i > 0 and isinstance(messages[i - 1], ToolMessage):
                out[-1].content.add(text="\n")
                out[-1].content.extend(results)
                continue
            out.append(generation_pb2.Message(role="user", content=results))
            continue
        out.append(generation_pb2.Message(role=ROLE_ALIASES.get(m.role, m.role), content=content))
    return out


def _past_call(call: PastToolCall) -> str:
    arguments = json.loads(call.function.arguments)  # a JSON object: checked when the body was read
    body = json.dumps({"name": call.function.name, "arguments": arguments}, ensure_ascii=False)
    return f"\n<tool_call>\n{body}\n</tool_call>"


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
