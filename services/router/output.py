"""Incremental detokenization and stop strings for one streamed response, one state per choice.

Invariant: the concatenation of every `text` returned equals the decoding of all tokens seen,
truncated before the first stop string; text is held back while it may still be the start of a
stop string or an incomplete UTF-8 sequence. Each token costs O(1) decoding work: with a fast
(Rust) tokenizer, one step of its own incremental decoder (`tokenizers.decoders.DecodeStream`); else only a
short window of recent tokens is decoded (vLLM's prefix/read offsets), never the whole output.
A request of n choices has n `ChoiceStream`s (`Choices`), each with its own detokenizer and stop state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import ByteLevel, DecodeStream
from transformers import PreTrainedTokenizerBase

from services.common.rpc.epd.v1 import generation_pb2, worker_pb2

_REPLACEMENT = "\ufffd"


@dataclass
class TextDelta:
    text: str
    stopped: bool


def _streams_exactly(tokenizer: PreTrainedTokenizerBase, backend: Any) -> bool:
    """Whether `DecodeStream` gives exactly `tokenizer.decode`'s text: a byte-level decoder (any byte sequence
    decodes, as in Qwen's and GPT-2's tokenizers) and no clean-up of spaces. Byte-fallback decoders (LLaMA's)
    are left to the window: on invalid bytes the stream's replacement characters differ from `decode`'s."""
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    return isinstance(backend.decoder, ByteLevel)


@dataclass
class Detokenizer:
    tokenizer: PreTrainedTokenizerBase
    stop: list[str] = field(default_factory=list)
    use_stream: bool = True  # the tokenizer's own incremental decoder, when it has one (False: the window)
    _tokens: list[int] = field(default_factory=list)
    _text: str = ""  # decoded text of _tokens[:_read]
    _prefix: int = 0  # tokens before this index give context only (word boundaries)
    _read: int = 0  # tokens before this index are in _text
    _emitted: int = 0  # characters of _text already returned
    _searched: int = 0  # characters of _text already searched for stop strings
    _stopped: bool = False
    _stream: Any = None  # the fast tokenizer's incremental decoder, when it has one
    _backend: Any = None  # that tokenizer's `tokenizers.Tokenizer`

    def __post_init__(self) -> None:
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if self.use_stream and _streams_exactly(self.tokenizer, backend):
            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=True)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _advance(self, token_ids: list[int]) -> None:
        """Append the newly decodable text, holding back an incomplete UTF-8 sequence."""
        if self._stream is not None:
            try:  # one token (the common case) passed as an int: the stream takes it without a list's conversion
                step = token_ids[0] if len(token_ids) == 1 else token_ids
                self._text += self._stream.step(self._backend, step) or ""
                return
            except Exception:  # the stream refuses some byte-fallback sequences: decode by windows from here on
                self._stream, self._prefix, self._read, self._text = None, 0, 0, ""
        before = self._decode(self._tokens[self._prefix : self._read])
        after = self._decode(self._tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._tokens)

    def add(self, token_ids: list[int]) -> TextDelta:
        """Take new tokens; return the text that is now final."""
        if self._stopped:
            return TextDelta("", True)
        self._tokens.extend(token_ids)
        self._advance(token_ids)
        if not self.stop:  # the common case: everything decoded is final
            delta, self._emitted = self._text[self._emitted :], len(self._text)
            return TextDelta(delta, False)
        longest = max(len(s) for s in self.stop)
        start = max(0, self._searched - longest + 1)
        for stop in self.stop:
            at = self._text.find(stop, start) if stop else -1
            if at >= 0:
                self._stopped = True
                delta = self._text[self._emitted : at] if at > self._emitted else ""
                self._emitted = max(self._emitted, at)
                return TextDelta(delta, True)
        self._searched = len(self._text)
        safe = len(self._text)
        for stop in self.stop:
            for keep in range(min(len(stop) - 1, safe), 0, -1):
                if self._text.endswith(stop[:keep]):
                    safe = min(safe, len(self._text) - keep)
                    break
        delta = self._text[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return TextDelta(delta, False)

    def flush(self) -> str:
        """At the end of the stream, release held-back text (never past a stop string)."""
        if self._stopped:
            return ""
        if self._stream is not None:  # what the stream holds back: once per response, the whole output decoded
            whole = self._decode(self._tokens)
            text = whole if whole.startswith(self._text) else self._text
            delta = text[self._emitted :]
            self._emitted = len(text)
            return delta
        text = (
            self._text
            + self._decode(self._tokens[self._prefix :])[len(self._decode(self._tokens[self._prefix : self._read])) :]
        )
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta


class TokenTexts:
    """Each token id's own text, ``tokenizer.decode([id])`` (what vLLM puts in a logprob's ``token``; special
    tokens kept), decoded once per id and kept: at most one string per vocabulary entry."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


@dataclass
class ChoiceStream:
    """One choice of a streamed response: its text so far and how it ended.

    Invariant: once ``finish_reason`` is set (the worker finished it, or a stop string ended it here),
    nothing more of this choice is streamed; ``completion_tokens`` counts the tokens streamed for it.
    """

    index: int
    detok: Detokenizer
    completion_tokens: int = 0
    finish_reason: str = ""

    def chunk(self, response: worker_pb2.WorkerResponse, texts: TokenTexts) -> generation_pb2.GenerateResponse | None:
        """The response carrying the chunk to stream for the worker's response for this choice (built in place:
        the client's message, not a chunk copied into one); None once the choice has ended."""
        if self.finish_reason:
            return None
        token_ids = list(response.token_ids)
        self.completion_tokens += len(token_ids)
        stopped_on_id = response.finished and response.finish_reason == "stop" and token_ids
        # the eos or stop_token_ids entry that ended it: in token_ids, not in the text (vLLM)
        delta = self.detok.add(token_ids[:-1] if stopped_on_id else token_ids)
        text = delta.text + (self.detok.flush() if response.finished and not delta.stopped else "")
        if delta.stopped or response.finished:
            self.finish_reason = "stop" if delta.stopped else response.finish_reason
        out = generation_pb2.GenerateResponse()
        chunk = out.chunk
        chunk.token_ids.extend(token_ids)
        chunk.text = text
        chunk.index = self.index
        if response.logprobs:
            for entry in response.logprobs:
                entry.token = texts(entry.token_id)
                for top in entry.top:
                    top.token = texts(top.token_id)
            chunk.logprobs.extend(response.logprobs)
        return out


class Choices:
    """The ``n`` choices of one streamed response, fed the worker's responses in stream order."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str], n: int, texts: TokenTexts) -> None:
        self.streams = [ChoiceStream(i, Detokenizer(tokenizer, list(stop))) for i in range(max(n, 1))]
        self._texts = texts
        self._open = len(self.streams)  # choices not ended yet

    @property
    def done(self) -> bool:
        """Every choice has ended: nothing more is to be streamed."""
        return not self._open

    def chunk(self, response: worker_pb2.WorkerResponse) -> generation_pb2.GenerateResponse | None:
        """The response carrying the chunk for a worker response (the choice ``response.index``), None when there
        is nothing to stream."""
        if response.index >= len(self.streams):
            raise ValueError(f"worker answered for choice {response.index} of {len(self.streams)}")
        stream = self.streams[response.index]
        out = stream.chunk(response, self._texts)
        if out is not None and stream.finish_reason:
            self._open -= 1
        return out

    def ends(self, unfinished: str = "length") -> list[generation_pb2.ChoiceEnd]:
        """How each choice ended (``unfinished`` for one the worker's stream left open)."""
        return [
            generation_pb2.ChoiceEnd(
                index=s.index, finish_reason=s.finish_reason or unfinished, completion_tokens=s.completion_tokens
            )
            for s in self.streams
        ]
