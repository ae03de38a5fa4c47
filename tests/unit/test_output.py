"""Incremental detokenization: streamed pieces add up to the full decode; stop strings cut it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.router.output import Detokenizer


def _stream(detok: Detokenizer, tokens: list[int], seed: int) -> tuple[str, bool]:
    rng = random.Random(seed)
    out, index = "", 0
    while index < len(tokens):
        step = rng.randint(1, 3)
        delta = detok.add(tokens[index : index + step])
        out += delta.text
        index += step
        if delta.stopped:
            return out, True
    return out + detok.flush(), False


@pytest.mark.parametrize("use_stream", [True, False], ids=["decode-stream", "window"])
def test_pieces_add_up_to_the_full_decode(tiny_model_dir: Path, use_stream: bool) -> None:
    """Byte-level BPE (Qwen's): random ids and words, by the tokenizer's own stream and by windows."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert (Detokenizer(tokenizer, use_stream=use_stream)._stream is not None) == use_stream  # both paths run
    vocab = len(tokenizer)
    for seed in range(20):
        rng = random.Random(seed)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 120))]
        text, stopped = _stream(Detokenizer(tokenizer, use_stream=use_stream), tokens, seed)
        assert not stopped
        assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    words = tokenizer("the window near the small table, and the cat", add_special_tokens=False)["input_ids"]
    assert _stream(Detokenizer(tokenizer, use_stream=use_stream), words, 1)[0] == tokenizer.decode(
        words, skip_special_tokens=True
    )


def test_a_byte_fallback_tokenizer_decodes_by_windows(tiny_llava_dir: Path) -> None:
    """LLaVA's tokenizer (byte fallback): the stream's text could differ from `decode`'s on invalid bytes, so
    the window decodes it; words add up to the full decode."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_dir)
    assert Detokenizer(tokenizer)._stream is None
    words = tokenizer("the window near the small table, and the cat", add_special_tokens=False)["input_ids"]
    assert _stream(Detokenizer(tokenizer), words, 1)[0] == tokenizer.decode(words, skip_special_tokens=True)


@pytest.mark.parametrize("use_stream", [True, False], ids=["decode-stream", "window"])
def test_stop_string_cuts_the_text(tiny_model_dir: Path, use_stream: bool) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokens = tokenizer("the window near the small table, and the cat sat", add_special_tokens=False)["input_ids"]
    full = tokenizer.decode(tokens, skip_special_tokens=True)
    for stop in ("small", "table, and", "sat", "nowhere"):
        text, stopped = _stream(Detokenizer(tokenizer, [stop], use_stream), tokens, 3)
        if stop in full:
            assert stopped and text == full[: full.index(stop)]
        else:
            assert not stopped and text == full


def test_choices_keep_their_own_text_stop_state_and_counts(tiny_model_dir: Path) -> None:
    """Two choices' worker responses interleaved: each choice's chunks add up to its own text, a stop string
    ends one choice only (its later tokens are dropped), logprob tokens get their text, and the ends count
    each choice's tokens."""
    from services.common.rpc.epd.v1 import common_pb2, worker_pb2
    from services.router.output import Choices, TokenTexts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    first = tokenizer("the cat sat near the window and the dog", add_special_tokens=False)["input_ids"]
    second = tokenizer("a small table by the warm window", add_special_tokens=False)["input_ids"]
    choices = Choices(tokenizer, ["dog"], 2, TokenTexts(tokenizer))
    texts, counts = {0: "", 1: ""}, {0: 0, 1: 0}
    for start in range(0, max(len(first), len(second)), 2):
        for index, tokens in ((0, first), (1, second)):
            piece = tokens[start : start + 2]
            if not piece:
                continue
            logprobs = [common_pb2.TokenLogprob(token_id=t, top=[common_pb2.TopLogprob(token_id=t)]) for t in piece]
            last = start + 2 >= len(tokens)
            response = worker_pb2.WorkerResponse(
                token_ids=piece, index=index, finished=last, finish_reason="length" if last else "", logprobs=logprobs
            )
            out = choices.chunk(response)
            if out is None:
                continue
            chunk = out.chunk
            assert chunk.index == index and list(chunk.token_ids) == piece
            assert [e.token for e in chunk.logprobs] == [tokenizer.decode([t]) for t in piece]
            assert [e.top[0].token for e in chunk.logprobs] == [tokenizer.decode([t]) for t in piece]
            texts[index] += chunk.text
            counts[index] += len(piece)
    full = tokenizer.decode(first, skip_special_tokens=True)
    assert texts[0] == full[: full.find("dog")] and texts[1] == tokenizer.decode(second, skip_special_tokens=True)
    assert choices.done
    assert [(e.index, e.finish_reason, e.completion_tokens) for e in choices.ends()] == [
        (0, "stop", counts[0]),
        (1, "length", len(second)),
    ]
