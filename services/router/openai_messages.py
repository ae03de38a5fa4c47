"""OpenAI chat messages and their content parts, validated, and their translation into gRPC `Message`s.

Invariants: a message is discriminated by its `role`; a field that would change the prompt and that epd does not
render is refused (`Turn.refused`); every `image_url` and `video_url` becomes a `Media.url`, so intake and every
media limit treat it as they treat a gRPC request; tool calls and results are written as Qwen2.5's chat
template writes them.
"""

from __future__ import annotations

import json
from typing import Annotated, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from services.common.rpc.epd.v1 import generation_pb2
from services.router.api_model import ApiModel, FieldError

ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system turn


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
