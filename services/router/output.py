"""Incremental detokenization and stop strings for one streamed response.

Invariant: the concatenation of every `text` returned equals the decoding of all tokens
seen, truncated before the first stop string; text is held back while it may still be the
start of a stop string or an incomplete UTF-8 sequence.
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
    _emitted: int = 0
    _stopped: bool = False

    def add(self, token_ids: list[int]) -> TextDelta:
        """Take new tokens; return the text that is now final."""
        if self._stopped:
            return TextDelta("", True)
        self._tokens.extend(token_ids)
        text = self.tokenizer.decode(self._tokens, skip_special_tokens=True)
        for stop in self.stop:
            at = text.find(stop)
            if stop and at >= 0:
                self._stopped = True
                delta = text[self._emitted:at] if at > self._emitted else ""
                self._emitted = max(self._emitted, at)
                return TextDelta(delta, True)
        safe = len(text)
        if text.endswith(_REPLACEMENT):
            safe = len(text.rstrip(_REPLACEMENT))
        for stop in self.stop:
            for keep in range(min(len(stop) - 1, safe), 0, -1):
                if text[:safe].endswith(stop[:keep]):
                    safe -= keep
                    break
        delta = text[self._emitted:safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return TextDelta(delta, False)

    def flush(self) -> str:
        """At the end of the stream, release held-back text (never past a stop string)."""
        if self._stopped:
            return ""
        text = self.tokenizer.decode(self._tokens, skip_special_tokens=True)
        delta = text[self._emitted:]
        self._emitted = len(text)
        return delta
