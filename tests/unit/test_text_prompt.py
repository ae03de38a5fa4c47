"""Raw text prompts (`GenerateRequest.prompt`): the tokenizer's own ids, placeholders and empty prompts refused,
the context checked."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.common.model_info import load_model_info
from services.router.errors import RequestError
from services.router.text_prompt import account_prompt, prompt_token_ids


@pytest.mark.parametrize("family", ["qwen2", "llava"])
def test_ids_are_the_tokenizers_own(family: str, tiny_model_dir: Path, tiny_llava_dir: Path) -> None:
    folder = tiny_model_dir if family == "qwen2" else tiny_llava_dir
    info = load_model_info(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = (
        "<|im_start|>user\nA cat and a dog.<|im_end|>\n" if family == "qwen2" else "USER: A cat and a dog. ASSISTANT:"
    )
    assert prompt_token_ids(info.adapter, text) == tokenizer(text)["input_ids"]
    assert prompt_token_ids(info.adapter, text, False) == tokenizer(text, add_special_tokens=False)["input_ids"]
    accounted = account_prompt(info, text, max_tokens=5, n=2)
    assert accounted.token_ids == tokenizer(text)["input_ids"] and accounted.refs == []
    assert accounted.projected_tokens == len(accounted.token_ids) + 10
    assert accounted.token_count().text_tokens == len(accounted.token_ids)


def test_placeholders_empty_prompts_and_the_context_are_refused(tiny_model_dir: Path) -> None:
    info = load_model_info(tiny_model_dir)
    for placeholder in ("<|image_pad|>", "<|video_pad|>"):
        with pytest.raises(RequestError, match=r"prompt: token 1 is the media placeholder"):
            account_prompt(info, f"a{placeholder}", 4)
    with pytest.raises(RequestError, match="prompt: empty"):
        account_prompt(info, "", 4)
    with pytest.raises(RequestError, match="longer than the model's context"):
        account_prompt(info, "hello", info.adapter.max_context)
