"""Incremental detokenization and stop strings for one streamed response.

Invariant: the concatenation of every `text` returned equals the decoding of all tokens seen,
truncated before the first stop string; text is held back while it may still be the start of a
stop string or an incomplete UTF-8 sequence. Each token costs O(1) decoding work: only a short
window of recent tokens is decoded (vLLM's prefix/read offsets), never the whole output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"


@dataclass
class TextDelta:
    text: str
    stopped: bool


@dataclass
class Detokenizer:
    tokenizer: PreTrainedTokenizerBase
    stop: list[str] = field(default_factory=list)
    _tokens: list[int] = field(default_factory=list)
    _text: str = ""  # decoded text of _tokens[:_read]
    _prefix: int = 0  # tokens before this index give context only (word boundaries)
    _read: int = 0  # tokens before this index are in _text
    _emitted: int = 0  # characters of _text already returned
    _searched: int = 0  # characters of _text already searched for stop strings
    _stopped: bool = False

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _advance(self) -> None:
        """Append the newly decodable text, holding back an incomplete UTF-8 sequence."""
        before = self._decode(self._tokens[self._prefix:self._read])
        after = self._decode(self._tokens[self._prefix:])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._text += after[len(before):]
            self._prefix, self._read = self._read, len(self._tokens)

    def add(self, token_ids: list[int]) -> TextDelta:
        """Take new tokens; return the text that is now final."""
        if self._stopped:
            return TextDelta("", True)
        self._tokens.extend(token_ids)
        self._advance()
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, self._searched - longest + 1)
        for stop in self.stop:
            at = self._text.find(stop, start) if stop else -1
            if at >= 0:
                self._stopped = True
                delta = self._text[self._emitted:at] if at > self._emitted else ""
                self._emitted = max(self._emitted, at)
                return TextDelta(delta, True)
        self._searched = len(self._text)
        safe = len(self._text)
        for stop in self.stop:
            for keep in range(min(len(stop) - 1, safe), 0, -1):
                if self._text.endswith(stop[:keep]):
                    safe = min(safe, len(self._text) - keep)
                    break
        delta = self._text[self._emitted:safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return TextDelta(delta, False)

    def flush(self) -> str:
        """At the end of the stream, release held-back text (never past a stop string)."""
        if self._stopped:
            return ""
        text = self._text + self._decode(self._tokens[self._prefix:])[len(self._decode(
            self._tokens[self._prefix:self._read])):]
        delta = text[self._emitted:]
        self._emitted = len(text)
        return delta
