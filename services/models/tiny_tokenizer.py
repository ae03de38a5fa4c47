"""Offline, deterministic byte-level BPE tokenizer for tiny Qwen2-VL-style model folders.

The tokenizer is trained with the `tokenizers` library on the fixed corpus in `tiny_corpus`, using
the same normalizer, pre-tokenizer and decoder as Qwen2's tokenizer, then gets Qwen2-VL's special
tokens appended after the learned vocabulary (as in the real model, where they follow the BPE ids).
Invariant: the same corpus and vocabulary target always give byte-identical files.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

from services.models.tiny_tokenizer_files import TinyTokenizerInfo, corpus_lines, write_tokenizer_files

# Qwen2's pre-tokenization split (digits one by one, contractions, words with one leading symbol).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2-VL's chat template: a default system turn, images as <|vision_start|><|image_pad|><|vision_end|>.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(vocab_target: int) -> Tokenizer:
    """Train the byte-level BPE on the built-in corpus and append the special tokens.

    `vocab_target` bounds the learned vocabulary (the 256 byte symbols included); the corpus is small,
    so the result may stop short of it. Special tokens always come after the learned ids.
    """
    if vocab_target < 257:
        raise ValueError(f"vocab_target must exceed the 256 byte symbols, got {vocab_target}")
    tokenizer = Tokenizer(
        BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS])
    return tokenizer


def save_tokenizer(
    out_dir: Path, vocab_target: int, model_max_length: int, chat_template: str = QWEN2_VL_CHAT_TEMPLATE
) -> TinyTokenizerInfo:
    """Write tokenizer.json and a Qwen2-style tokenizer_config.json (with `chat_template`, Qwen2-VL's unless
    given) to `out_dir`."""
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "chat_template": chat_template,
    }
    return write_tokenizer_files(out_dir, train_tokenizer(vocab_target), SPECIAL_TOKENS, config)
