"""vLLM's `/tokenize` and `/detokenize`: request bodies and their answers, from the router's own tokenizer.

Invariants: `/tokenize` with a `prompt` gives the ids `/v1/completions` feeds the model for that text
(services/router/text_prompt.py); with `messages` the ids a chat completion of them feeds it (the chat
template with its generation prompt, every image and video expanded to its placeholder tokens), through
the router's own request preparation, so the same limits and messages apply. `/detokenize` refuses an
id outside the tokenizer's vocabulary. Long inputs are (de)tokenized off the event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ConfigDict, Field, model_validator

from services.common.rpc.epd.v1 import common_pb2, generation_pb2
from services.router.api_model import ApiModel, FieldError, refusal
from services.router.errors import invalid
from services.router.openai_messages import Message, generation_messages
from services.router.openai_request import REFUSED
from services.router.text_prompt import prompt_token_ids

INLINE = 8192
"""Characters (or ids) up to which the work runs on the event loop itself."""


class Preparing(Protocol):
    """The router's request preparation (services/router/request_prep.py's RequestPrep)."""

    async def prepare(self, request: generation_pb2.GenerateRequest) -> Any: ...


class TokenizeRequest(ApiModel):
    """`POST /tokenize`: a `prompt` (as `/v1/completions` takes it) or chat `messages`, not both."""

    model_config = ConfigDict(
        extra="allow",
        allow_inf_nan=False,
        json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]},
    )

    model: str | None = None
    prompt: str = Field(None)  # type: ignore[assignment]  (absent is None; null itself is refused)
    messages: list[Message] = Field(None, min_length=1)  # type: ignore[assignment]
    add_special_tokens: bool | None = Field(None, description="prompt: default true; messages: only false")
    return_token_strs: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "prompt or messages: send exactly one of them")
        if self.messages is not None and self.add_special_tokens:
            raise FieldError(
                "add_special_tokens", "add_special_tokens with messages is not supported by this server yet"
            )
        extra = self.model_extra or {}
        for name, neutral in REFUSED.items():
            error = refusal(name, extra.get(name), neutral)
            if error is not None:
                raise error
        return self


class DetokenizeRequest(ApiModel):
    """`POST /detokenize`: token ids to text."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    tokens: list[int] = Field(description="token ids of this model's vocabulary")


@dataclass(frozen=True)
class Tokens:
    """Tokenizing and detokenizing with the served model's tokenizer."""

    adapter: Any
    prep: Preparing

    @property
    def vocabulary(self) -> int:
        return len(self.adapter.tokenizer)

    async def tokenize(self, body: TokenizeRequest) -> list[int]:
        if body.messages is None:
            text, special = body.prompt or "", body.add_special_tokens is not False
            if len(text) <= INLINE:
                return prompt_token_ids(self.adapter, text, special)
            return await asyncio.to_thread(prompt_token_ids, self.adapter, text, special)
        request = generation_pb2.GenerateRequest(
            messages=generation_messages(body.messages), sampling=common_pb2.SamplingParams(max_tokens=1)
        )
        return list((await self.prep.prepare(request)).accounted.token_ids)

    def token_strs(self, ids: list[int]) -> list[str]:
        return list(self.adapter.tokenizer.convert_ids_to_tokens(ids))

    async def detokenize(self, ids: list[int]) -> str:
        size = self.vocabulary
        for position, token_id in enumerate(ids):
            if not 0 <= token_id < size:
                raise invalid(f"tokens[{position}]: {token_id} is not a token id of this model (ids 0 to {size - 1})")
        if len(ids) <= INLINE:
            return self.adapter.tokenizer.decode(ids)
        return await asyncio.to_thread(self.adapter.tokenizer.decode, ids)


def tokenize_json(ids: list[int], max_model_len: int, strs: list[str] | None) -> dict[str, Any]:
    """vLLM's tokenize answer."""
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}
