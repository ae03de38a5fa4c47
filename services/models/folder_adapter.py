"""What every model adapter reads the same way: the folder's parts and the language model's config fields.

Families (Qwen2-VL, LLaVA) subclass `FolderAdapter`, call its ``__init__`` first, then read their own vision
config and check the saved image processor against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

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
