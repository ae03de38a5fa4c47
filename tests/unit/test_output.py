"""Incremental detokenization: streamed pieces add up to the full decode; stop strings cut it."""

from __future__ import annotations

import random
from pathlib import Path

from transformers import AutoTokenizer

from services.router.output import Detokenizer


def _stream(detok: Detokenizer, tokens: list[int], seed: int) -> tuple[str, bool]:
    rng = random.Random(seed)
    out, index = "", 0
    while index < len(tokens):
        step = rng.randint(1, 3)
        delta = detok.add(tokens[index:index + step])
        out += delta.text
        index += step
        if delta.stopped:
            return out, True
    return out + detok.flush(), False


def test_pieces_add_up_to_the_full_decode(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocab = len(tokenizer)
    for seed in range(20):
        rng = random.Random(seed)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 120))]
        text, stopped = _stream(Detokenizer(tokenizer), tokens, seed)
        assert not stopped
        assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    words = tokenizer("the window near the small table, and the cat", add_special_tokens=False)["input_ids"]
    assert _stream(Detokenizer(tokenizer), words, 1)[0] == tokenizer.decode(words, skip_special_tokens=True)


def test_stop_string_cuts_the_text(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokens = tokenizer("the window near the small table, and the cat sat", add_special_tokens=False)["input_ids"]
    full = tokenizer.decode(tokens, skip_special_tokens=True)
    for stop in ("small", "table, and", "sat", "nowhere"):
        text, stopped = _stream(Detokenizer(tokenizer, [stop]), tokens, 3)
        if stop in full:
            assert stopped and text == full[:full.index(stop)]
        else:
            assert not stopped and text == full
