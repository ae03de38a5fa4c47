"""OpenAI response objects built from the `GenerateResponse` stream gRPC's Generate yields.

`chat.completion.chunk` objects for streaming (`ChunkWriter`) and one `chat.completion` for a
non-streamed answer (`CompletionBuilder`); `text_completion` objects of `/v1/completions` the same two ways
(`TextChunkWriter`, `TextCompletionBuilder`). Invariant: both read the same responses in the same way,
so a choice's streamed deltas concatenate to its non-streamed content, and either equals the text of
that choice in the gRPC answer to the same request; its logprob entries are the gRPC chunk's
`logprobs`, one per token, in order; `usage` carries the Final's numbers unchanged. With tools offered, the
calls the text makes leave the content: streamed as `delta.tool_calls` once each closes, whole as
`message.tool_calls` (the Final's, same ids), and the choice finishes `tool_calls`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from services.common.rpc.epd.v1 import common_pb2, generation_pb2
from services.router.tool_calls import ToolCallStream, parse_tool_calls

DONE = b"data: [DONE]\n\n"
_HOLE = "\x00epd-content\x00"  # where a content event's text goes (`ChunkWriter.encoded`)
_HOLE_JSON = orjson.dumps(_HOLE)
_USAGE_HOLE_JSON = orjson.dumps(_HOLE + "usage")  # where a content event's continuous usage goes
LOWEST_LOGPROB = -9999.0  # what -inf is sent as (JSON has no infinities), as vLLM does


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as compact UTF-8 JSON (orjson: a streamed token's event is
    encoded ~30x faster than by `json`, which was ~5 % of the router's CPU per token)."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def sse_all(payloads: list[dict[str, Any]]) -> bytes:
    """The events for `payloads`, in order, as one piece of the body (one write to the socket, not one each)."""
    return b"".join(sse(payload) for payload in payloads)


def usage_json(usage: generation_pb2.Usage) -> dict[str, Any]:
    """OpenAI's usage, plus epd's `image_tokens` and `video_tokens` (prompt tokens that stand for images, videos)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "image_tokens": usage.image_tokens,
        "video_tokens": usage.video_tokens,
    }


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else LOWEST_LOGPROB


def _alternative(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _logprob(logprob), "bytes": list(token.encode())}


def logprob_entry(entry: common_pb2.TokenLogprob) -> dict[str, Any]:
    """One `choices[i].logprobs.content[]` entry: the sampled token and its top alternatives."""
    top = [_alternative(t.token, t.logprob) for t in entry.top]
    return {**_alternative(entry.token, entry.logprob), "top_logprobs": top}


def choice_ends(final: generation_pb2.Final) -> list[tuple[int, str]]:
    """(index, finish_reason) of every choice, in index order."""
    if not final.choices:
        return [(0, final.finish_reason)]
    return [(end.index, end.finish_reason) for end in sorted(final.choices, key=lambda end: end.index)]


@dataclass(frozen=True)
class Envelope:
    """What every object of one completion shares."""

    id: str
    created: int
    model: str

    def wrap(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, **fields}


@dataclass
class StreamUsage:
    """What a streamed chunk says of usage: nothing; `null` (`include_usage`: the counts come in a last chunk of
    their own); or, with vLLM's `continuous_usage_stats`, the counts so far (every token streamed, text held
    back or not)."""

    include: bool = False
    continuous: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def take(self, chunk: generation_pb2.Chunk) -> None:
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        self.completion_tokens += len(chunk.token_ids)

    def fields(self) -> dict[str, Any]:
        if self.continuous:
            total = self.prompt_tokens + self.completion_tokens
            usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
            return {"usage": {**usage, "total_tokens": total}}
        return {"usage": None} if self.include else {}

    def encoded(self) -> bytes:
        """`fields()["usage"]` of continuous usage as its compact JSON (orjson's bytes for that object)."""
        total = self.prompt_tokens + self.completion_tokens
        return b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (
            self.prompt_tokens,
            self.completion_tokens,
            total,
        )


@dataclass
class ChunkWriter:
    """Streaming: each response becomes the chunk objects to send, in order."""

    envelope: Envelope
    n: int = 1
    usage: StreamUsage = field(default_factory=StreamUsage)
    logprobs: bool = False
    tools: bool = False  # tools were offered: calls leave the content and stream as `delta.tool_calls`
    _calls: dict[int, ToolCallStream] = field(default_factory=dict)
    _made: dict[int, int] = field(default_factory=dict)  # calls streamed per choice
    _frames: dict[int, tuple[bytes, ...]] = field(default_factory=dict)  # per choice: a content event's fixed parts

    def _chunk(
        self, index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None, usage: Any = None
    ) -> dict:
        """One choice's chunk object; its usage is `StreamUsage.fields()`, or ``usage`` in its place when given."""
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        fields = self.usage.fields() if usage is None else {"usage": usage}
        return self.envelope.wrap("chat.completion.chunk", choices=[choice], **fields)

    def start(self) -> list[dict[str, Any]]:
        """The opening chunk of every choice: the assistant's role, no content yet."""
        return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(self.n)]

    def add(self, response: generation_pb2.GenerateResponse) -> list[dict[str, Any]]:
        if response.HasField("chunk"):
            chunk = response.chunk
            self.usage.take(chunk)
            text, calls = chunk.text, []
            if self.tools:
                text, calls = self._calls.setdefault(chunk.index, ToolCallStream()).feed(text)
            out = []
            # a token whose text is held back (an unfinished character, a possible stop string) still gets its
            # chunk, with no content, as vLLM sends it (a client times each token); not while a tool call is read
            if text or (self.logprobs and chunk.logprobs) or (chunk.token_ids and not self.tools):
                logprobs = {"content": [logprob_entry(e) for e in chunk.logprobs]} if self.logprobs else None
                out.append(self._chunk(chunk.index, {"content": text}, logprobs))
            return out + [self._call_chunk(chunk.index, call) for call in calls]
        final = response.final
        out = [
            self._chunk(index, {"content": stream.finish()}) for index, stream in self._calls.items() if stream.holding
        ]
        out += [self._chunk(index, {}, finish=reason) for index, reason in choice_ends(final)]
        if self.usage.include:
            out.append(self.envelope.wrap("chat.completion.chunk", choices=[], usage=usage_json(final.usage)))
        return out

    def encoded(self, response: generation_pb2.GenerateResponse) -> bytes:
        """`add`'s events as the body's bytes. A token's plain content event (no tools, no logprobs) is its
        choice's event encoded once with the text (and continuous usage) left out, the text's JSON string (and the
        usage's) put between the fixed parts: the same bytes as encoding the whole object, without building and
        encoding it per token."""
        if self.tools or self.logprobs or not response.HasField("chunk"):
            return sse_all(self.add(response))
        chunk = response.chunk
        self.usage.take(chunk)
        if not chunk.text and not chunk.token_ids:
            return b""
        frame = self._frames.get(chunk.index)
        if frame is None:
            frame = self._frames[chunk.index] = self._frame(chunk.index)
        if self.usage.continuous:
            return frame[0] + orjson.dumps(chunk.text) + frame[1] + self.usage.encoded() + frame[2]
        return frame[0] + orjson.dumps(chunk.text) + frame[1]

    def _frame(self, index: int) -> tuple[bytes, ...]:
        """Choice ``index``'s content event split around its text (and its continuous usage, which comes after)."""
        if not self.usage.continuous:
            event = sse(self._chunk(index, {"content": _HOLE}))
            return tuple(event.rsplit(_HOLE_JSON, 1))  # nothing after the content is the client's or the model's
        event = sse(self._chunk(index, {"content": _HOLE}, usage=_HOLE + "usage"))
        head, rest = event.rsplit(_USAGE_HOLE_JSON, 1)
        return (*head.rsplit(_HOLE_JSON, 1), rest)

    def _call_chunk(self, index: int, call: generation_pb2.ToolCall) -> dict[str, Any]:
        number = self._made[index] = self._made.get(index, -1) + 1
        return self._chunk(index, {"tool_calls": [{"index": number, **tool_call_json(call)}]})


def tool_call_json(call: generation_pb2.ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class CompletionBuilder:
    """Non-streaming: the responses gathered into one `chat.completion`."""

    envelope: Envelope
    logprobs: bool = False
    choices: dict[int, _Choice] = field(default_factory=dict)
    final: generation_pb2.Final | None = None

    def add(self, response: generation_pb2.GenerateResponse) -> None:
        if response.HasField("chunk"):
            choice = self.choices.setdefault(response.chunk.index, _Choice())
            choice.text.append(response.chunk.text)
            choice.logprobs.extend(logprob_entry(e) for e in response.chunk.logprobs)
        else:
            self.final = response.final

    def _choice(self, index: int, reason: str) -> dict[str, Any]:
        got = self.choices.get(index, _Choice())
        logprobs = {"content": got.logprobs} if self.logprobs else None
        message: dict[str, Any] = {"role": "assistant", "content": "".join(got.text)}
        ends = [end for end in self.final.choices if end.index == index] if self.final is not None else []
        if ends and ends[0].tool_calls:  # the content less the calls (None when nothing else was said)
            message["content"] = parse_tool_calls(message["content"])[0] or None
            message["tool_calls"] = [tool_call_json(call) for call in ends[0].tool_calls]
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def result(self) -> dict[str, Any]:
        if self.final is None:
            raise ValueError("the stream ended without a final message")
        choices = [self._choice(index, reason) for index, reason in choice_ends(self.final)]
        return self.envelope.wrap("chat.completion", choices=choices, usage=usage_json(self.final.usage))


def token_count_json(count: generation_pb2.TokenCount) -> dict[str, Any]:
    """CountTokens' numbers under their proto names."""
    return {
        "object": "token_count",
        "prompt_tokens": count.prompt_tokens,
        "text_tokens": count.text_tokens,
        "image_tokens": count.image_tokens,
        "video_tokens": count.video_tokens,
        "max_tokens": count.max_tokens,
        "projected_tokens": count.projected_tokens,
        "tokens_per_item": list(count.tokens_per_item),
    }


def text_logprobs(entries: list[common_pb2.TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions `logprobs` of `entries` whose text starts at `offset` of the choice's text:
    `tokens`, `token_logprobs`, `top_logprobs` (token -> logprob, the sampled token included, as vLLM's)
    and `text_offset`."""
    offsets, tops = [], []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
        top = {t.token: _logprob(t.logprob) for t in entry.top}
        top.setdefault(entry.token, _logprob(entry.logprob))
        tops.append(top)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [_logprob(e.logprob) for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


@dataclass
class TextChunkWriter:
    """Streaming `/v1/completions`: the same `start`/`add` as ChunkWriter, in `text_completion` objects (no
    role chunk; `choices[i].text`, legacy `logprobs`)."""

    envelope: Envelope
    usage: StreamUsage = field(default_factory=StreamUsage)
    logprobs: bool = False
    offsets: dict[int, int] = field(default_factory=dict)

    def _chunk(self, index: int, text: str, logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return self.envelope.wrap("text_completion", choices=[choice], **self.usage.fields())

    def start(self) -> list[dict[str, Any]]:
        return []

    def encoded(self, response: generation_pb2.GenerateResponse) -> bytes:
        """`add`'s events as the body's bytes."""
        return sse_all(self.add(response))

    def add(self, response: generation_pb2.GenerateResponse) -> list[dict[str, Any]]:
        if response.HasField("chunk"):
            chunk = response.chunk
            self.usage.take(chunk)
            if not chunk.text and not chunk.token_ids and not (self.logprobs and chunk.logprobs):
                return []  # a token whose text is held back still gets its chunk, as in chat
            logprobs = None
            if self.logprobs:
                offset = self.offsets.get(chunk.index, 0)
                logprobs = text_logprobs(list(chunk.logprobs), offset)
                self.offsets[chunk.index] = offset + sum(len(e.token) for e in chunk.logprobs)
            return [self._chunk(chunk.index, chunk.text, logprobs)]
        final = response.final
        out = [self._chunk(index, "", finish=reason) for index, reason in choice_ends(final)]
        if self.usage.include:
            out.append(self.envelope.wrap("text_completion", choices=[], usage=usage_json(final.usage)))
        return out


@dataclass
class TextCompletionBuilder:
    """Non-streaming `/v1/completions`: the responses gathered into one `text_completion`."""

    envelope: Envelope
    logprobs: bool = False
    texts: dict[int, list[str]] = field(default_factory=dict)
    entries: dict[int, list[common_pb2.TokenLogprob]] = field(default_factory=dict)
    final: generation_pb2.Final | None = None

    def add(self, response: generation_pb2.GenerateResponse) -> None:
        if response.HasField("chunk"):
            self.texts.setdefault(response.chunk.index, []).append(response.chunk.text)
            self.entries.setdefault(response.chunk.index, []).extend(response.chunk.logprobs)
        else:
            self.final = response.final

    def result(self) -> dict[str, Any]:
        if self.final is None:
            raise ValueError("the stream ended without a final message")
        choices = [
            {
                "index": index,
                "text": "".join(self.texts.get(index, [])),
                "logprobs": text_logprobs(self.entries.get(index, []), 0) if self.logprobs else None,
                "finish_reason": reason,
            }
            for index, reason in choice_ends(self.final)
        ]
        return self.envelope.wrap("text_completion", choices=choices, usage=usage_json(self.final.usage))
