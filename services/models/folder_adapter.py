"""What every model adapter does the same way: read the folder's parts and the language model's config fields,
load the transformers model, embed a prompt's ids with media rows swapped in, and apply the head.

Families (Qwen2-VL, LLaVA) subclass `FolderAdapter`, call its ``__init__`` first, then read their own vision
config and check the saved image processor against it; vision, positions and the language model's forward
are theirs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

import torch

from services.models.base import PlacedEmbedding
from services.models.loading import load_folder_parts


class FolderAdapter:
    """Config, tokenizer, image processor and eos ids of one model folder (never the weights).

    Invariant: ``tokenizer`` and ``image_processor`` are both None when built ``from_config`` (the model side
    only: encoding pixels and running the language model work; building prompts and preprocessing do not);
    ``special_tokens`` lists every added or special token of the tokenizer, sorted (empty without one).
    """

    def __init__(
        self, model_dir: Path | None, config: Any, tokenizer: Any | None, image_processor: Any | None, eos: list[int]
    ) -> None:
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.config = config
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.model_type: str = config.model_type
        self.image_token_id: int = int(config.image_token_id)
        self.eos_token_ids: list[int] = eos
        self.max_context: int = int(config.text_config.max_position_embeddings)
        self.hidden_size: int = int(config.text_config.hidden_size)
        self.embedding_width: int = self.hidden_size  # columns of an item's embedding (DeepStack families: more)
        self.vocab_size: int = int(config.text_config.vocab_size)  # the logits' width (lm_head's rows)
        self.special_tokens: list[str] = []
        if tokenizer is not None:
            self.special_tokens = sorted(set(tokenizer.added_tokens_encoder) | set(tokenizer.all_special_tokens))

    @classmethod
    def from_folder(cls, model_dir: Path) -> Self:
        """Read config, tokenizer, image processor and eos ids from `model_dir` (no weights)."""
        parts = load_folder_parts(Path(model_dir))
        return cls(parts.model_dir, parts.config, parts.tokenizer, parts.image_processor, parts.eos_token_ids)

    @classmethod
    def from_config(cls, config: Any) -> Self:
        """The model side only, from a transformers config (no folder, tokenizer or processor): encoding pixel
        inputs and running the language model over token ids work; building prompts and preprocessing images
        do not (the GPU check builds its models this way)."""
        eos = config.get_text_config().eos_token_id
        return cls(None, config, None, None, list(eos) if isinstance(eos, list | tuple) else [int(eos)])

    def load_model(self, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """The full transformers model (vision tower, projector, language model, head) in eval mode, its
        parameters frozen, on `device` in `dtype`; read from the folder only (never downloaded)."""
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(self.model_dir, dtype=dtype, local_files_only=True)
        model = model.to(device)
        model.eval()
        model.requires_grad_(False)
        return model

    def embed_prompt(
        self, model: torch.nn.Module, token_ids: torch.Tensor, placed: list[PlacedEmbedding]
    ) -> torch.Tensor:
        """Input embeddings `[L, hidden]` for 1-D `token_ids`, with each placed embedding's rows swapped in.

        Raises ValueError when `token_ids` is not 1-D or a placed embedding runs past the ids. Reads no device
        value: that the rows cover media placeholders is the caller's check on its host-side ids (the
        engine's at add_request).
        """
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        embed = model.model.get_input_embeddings()
        ids = token_ids.to(embed.weight.device)
        with torch.no_grad():
            rows = embed(ids)
        for index, item in enumerate(placed):
            end = item.offset + item.embedding.shape[0]
            if item.offset < 0 or end > ids.shape[0]:
                raise ValueError(f"placed embedding {index} spans {item.offset}..{end}, outside {ids.shape[0]} ids")
            rows[item.offset : end] = item.embedding.to(device=rows.device, dtype=rows.dtype)
        return rows

    def compute_logits(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits for hidden states (`[..., H]` to `[..., vocab]`) through `lm_head`; the leading
        dims of `hidden` are kept, on the head's device."""
        return model.lm_head(hidden)
