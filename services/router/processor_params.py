"""The router's checks of a request's logits-processor fields (penalties, min_p, min_tokens, stop_token_ids,
bad words, logit_bias), and its bad words tokenized into the token-id sequences the worker applies.

Invariant: a request that leaves here has every such field within its bound and every token id within the
model's vocabulary (the worker checks the ids again: an id past its logits would fault the device); anything
else is INVALID_ARGUMENT naming the field, before any worker is involved.
"""

from __future__ import annotations

import math
from typing import Any

from services.common.rpc.epd.v1 import common_pb2
from services.router.errors import invalid

MAX_BAD_WORDS = 128
"""Bad words per request (each at most ``MAX_WORD_CHARS`` characters); also the most token-id sequences a
client may send itself."""
MAX_WORD_CHARS = 256
MAX_LOGIT_BIAS = 1024
"""Entries of ``logit_bias`` per request."""
MAX_STOP_TOKEN_IDS = 128
LOGIT_BIAS_BOUND = 100.0
PENALTY_BOUND = 2.0
"""presence_penalty and frequency_penalty lie within [-2, 2], as OpenAI's and vLLM's."""


def check_processor_params(sampling: common_pb2.SamplingParams, tokenizer: Any, vocab: int) -> None:
    """Check ``sampling``'s processor fields (``max_tokens`` already filled) and append its ``bad_words``,
    tokenized, to ``bad_words_token_ids``; INVALID_ARGUMENT for the first field out of bounds."""
    rep = sampling.repetition_penalty
    if rep != 0 and not 0 < rep < math.inf:
        raise invalid(f"sampling.repetition_penalty must be > 0 and finite (0 or 1: off), got {rep}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not -PENALTY_BOUND <= value <= PENALTY_BOUND:
            raise invalid(f"sampling.{name} must be in [-2, 2], got {value}")
    if not 0 <= sampling.min_p <= 1:
        raise invalid(f"sampling.min_p must be in [0, 1], got {sampling.min_p}")
    if sampling.min_tokens > sampling.max_tokens:
        raise invalid(f"sampling.min_tokens {sampling.min_tokens} is above max_tokens {sampling.max_tokens}")
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"sampling.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids")
    _check_ids("sampling.stop_token_ids", sampling.stop_token_ids, vocab)
    _check_logit_bias(sampling, vocab)
    _check_bad_words(sampling, tokenizer, vocab)


def _check_ids(field: str, ids: Any, vocab: int) -> None:
    for token in ids:
        if token >= vocab:
            raise invalid(f"{field}: token id {token} is outside the model's vocabulary of {vocab}")


def _check_logit_bias(sampling: common_pb2.SamplingParams, vocab: int) -> None:
    if len(sampling.logit_bias) > MAX_LOGIT_BIAS:
        raise invalid(f"sampling.logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(sampling.logit_bias)}")
    _check_ids("sampling.logit_bias", sampling.logit_bias.keys(), vocab)
    for token, bias in sampling.logit_bias.items():
        if not -LOGIT_BIAS_BOUND <= bias <= LOGIT_BIAS_BOUND:
            raise invalid(f"sampling.logit_bias[{token}] must be in [-100, 100], got {bias}")


def _check_bad_words(sampling: common_pb2.SamplingParams, tokenizer: Any, vocab: int) -> None:
    words = list(sampling.bad_words)
    if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_WORD_CHARS for w in words):
        raise invalid(f"sampling.bad_words: at most {MAX_BAD_WORDS} words of at most {MAX_WORD_CHARS} characters")
    if len(sampling.bad_words_token_ids) > MAX_BAD_WORDS:
        raise invalid(f"sampling.bad_words_token_ids: at most {MAX_BAD_WORDS} sequences")
    for i, word in enumerate(sampling.bad_words_token_ids):
        if not word.ids:
            raise invalid(f"sampling.bad_words_token_ids[{i}] is empty")
        _check_ids(f"sampling.bad_words_token_ids[{i}]", word.ids, vocab)
    for i, word in enumerate(words):
        if not word.strip():
            raise invalid(f"sampling.bad_words[{i}] is empty")
        spellings = bad_word_ids(tokenizer, word)
        if not spellings:
            raise invalid(f"sampling.bad_words[{i}] ({word!r}) tokenizes to no token")
        for ids in spellings:
            _check_ids(f"sampling.bad_words[{i}] ({word!r})", ids, vocab)
            sampling.bad_words_token_ids.add(ids=ids)


def bad_word_ids(tokenizer: Any, word: str) -> list[list[int]]:
    """The token-id sequences that spell ``word``, as vLLM finds them: the word (leading spaces stripped) as
    tokenized alone, and with one leading space when that starts with another token and is as long (the word
    in the middle of a text); none when the word tokenizes to nothing."""
    bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    if not bare:
        return []
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
        return [bare, spaced]
    return [bare]
