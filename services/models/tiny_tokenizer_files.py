"""What the tiny models' tokenizers (`tiny_tokenizer`, Qwen2-style; `tiny_llama_tokenizer`, Llama-style) share:
the training lines of the corpus and writing a trained tokenizer's two files.

Each tokenizer module keeps only what differs: its pipeline, its special tokens and its tokenizer_config.json
fields. Invariant: the same tokenizer, special tokens and config always give byte-identical files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from services.models.tiny_corpus import CORPUS


@dataclass(frozen=True)
class TinyTokenizerInfo:
    """The saved tokenizer's size and the ids of its special tokens (by token text)."""

    vocab_size: int
    special_ids: dict[str, int]


def corpus_lines() -> list[str]:
    """The corpus's non-blank lines, line endings kept, in order: what both tokenizers train on."""
    return [line for line in CORPUS.splitlines(keepends=True) if line.strip()]


def write_tokenizer_files(
    out_dir: Path, tokenizer: Tokenizer, special_tokens: tuple[str, ...], config: dict[str, Any]
) -> TinyTokenizerInfo:
    """Write `tokenizer` as tokenizer.json and `config` as tokenizer_config.json into `out_dir`.

    The config gains `added_tokens_decoder`, one special, unnormalized entry per token of `special_tokens`
    under its id; the JSON is indented with sorted keys. Raises RuntimeError when a special token is not in
    the tokenizer. Returns the vocabulary size (added tokens included) and the special tokens' ids.
    """
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    special_ids = {tok: _token_id(tokenizer, tok) for tok in special_tokens}
    added = {
        str(special_ids[tok]): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in special_tokens
    }
    text = json.dumps({**config, "added_tokens_decoder": added}, indent=2, sort_keys=True, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")
    return TinyTokenizerInfo(vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), special_ids=special_ids)


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"special token {token!r} missing from the trained tokenizer")
    return token_id
