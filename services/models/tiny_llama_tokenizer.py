"""Offline, deterministic Llama-style tokenizer (BPE with byte fallback) for tiny LLaVA-1.5 model folders.

LLaVA-1.5's language model is a Llama (Vicuna) with Llama's SentencePiece-style tokenizer: `<unk>`, `<s>`,
`</s>` at ids 0-2, the 256 byte tokens `<0x00>`..`<0xFF>` after them (byte fallback for any character the
vocabulary lacks), then the learned pieces (words start with `▁`), and LLaVA's `<image>` and `<pad>` appended
(32000 and 32001 in the released model). The BPE is trained with the `tokenizers` library on the corpus in
`tiny_corpus`, and saved with the pipeline transformers' `LlamaTokenizer` rebuilds from the file (no
normalizer, `Metaspace` with `prepend_scheme="first"`, the byte-fallback decoder; `<s>` prepended to every
encoding), so `AutoTokenizer` loads it as a `LlamaTokenizer` giving the same ids as the raw file. The chat
template is LLaVA-1.5's (llava-hf/llava-1.5-7b-hf): `USER: <image>\\n... ASSISTANT:`.
Invariant: the same corpus and vocabulary target always give byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors, trainers
from tokenizers.models import BPE

from services.models.tiny_tokenizer_files import TinyTokenizerInfo, corpus_lines, write_tokenizer_files

LEADING_SPECIAL: tuple[str, ...] = ("<unk>", "<s>", "</s>")
"""Llama's reserved ids 0, 1, 2."""
TRAILING_SPECIAL: tuple[str, ...] = ("<image>", "<pad>")
"""LLaVA's added tokens, after the vocabulary."""
SPECIAL_TOKENS: tuple[str, ...] = LEADING_SPECIAL + TRAILING_SPECIAL

# llava-hf/llava-1.5-7b-hf's chat template: each turn is `ROLE: `, its images first (`<image>\n` each), then
# its texts (each followed by a space); a system turn has no prefix; the generation prompt is `ASSISTANT:`.
LLAVA_15_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}"
    "{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def train_llama_tokenizer(vocab_target: int) -> Tokenizer:
    """Train the BPE on the built-in corpus and lay out Llama's vocabulary around it.

    `vocab_target` bounds the trained pieces (characters included); the corpus is small, so the result may
    stop short of it. Ids: the three leading specials, the 256 byte tokens, the learned pieces in training
    order, then `<image>` and `<pad>`.
    """
    if vocab_target < 2:
        raise ValueError(f"vocab_target must be at least 2, got {vocab_target}")
    trainer_side = Tokenizer(BPE())
    trainer_side.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_target, min_frequency=2, show_progress=False)
    trainer_side.train_from_iterator(corpus_lines(), trainer=trainer)
    learned = json.loads(trainer_side.to_str())["model"]
    vocab = {token: index for index, token in enumerate(LEADING_SPECIAL)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token, _ in sorted(learned["vocab"].items(), key=lambda pair: pair[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    # What transformers' LlamaTokenizer builds (legacy=False, add_prefix_space=True): it keeps only the vocab,
    # merges and post-processor of the file, so the file must hold the same pipeline for both to agree.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    return tokenizer


def save_llama_tokenizer(out_dir: Path, vocab_target: int, model_max_length: int) -> TinyTokenizerInfo:
    """Write tokenizer.json and a LlamaTokenizer tokenizer_config.json (LLaVA-1.5's chat template) to `out_dir`."""
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": LLAVA_15_CHAT_TEMPLATE,
    }
    return write_tokenizer_files(out_dir, train_llama_tokenizer(vocab_target), SPECIAL_TOKENS, config)
