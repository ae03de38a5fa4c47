"""What a model folder's config says about sizes: tokens per image and video, KV bytes per token, embedding bytes.

Read from config, tokenizer and processor settings only (`load_adapter`, `AutoConfig`): never the weights, so a
folder without them (a config saved from `services/models/shapes.py`) plans as well as a real checkpoint.
Every number comes from the adapter or the config: tokens from `adapter.image_tokens` (the saved processor's
pixel limits) and, when the adapter has it, `adapter.image_tokens_uncapped` (the same rule with no max_pixels);
video tokens from `adapter.video_tokens` (the saved video processor's frame sampling and pixel limits);
KV bytes per token = 2 (K and V) x layers x KV heads x head dim x dtype bytes (`KVShape.block_bytes` of a
1-token block); embedding bytes = image tokens x embedding width x dtype bytes, the width being the hidden size, or
for a family that ships DeepStack levels with each row (Qwen3-VL) the hidden size x (1 + levels): what travels,
what the caches and the worker hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_DTYPE = "bfloat16"
"""The dtype bytes are counted in when neither the command line, a profile nor the config names one."""


@dataclass(frozen=True)
class ImageSize:
    """One image of a given source size as the model sees it.

    Invariants: `embedding_bytes == tokens * embedding width * dtype bytes`, `kv_bytes == tokens * kv_bytes_per_token`,
    and the same for the `_uncapped` figures, which are None when the adapter has no uncapped rule.
    """

    width: int
    height: int
    tokens: int
    tokens_uncapped: int | None
    resized_width: int
    resized_height: int
    embedding_bytes: int
    kv_bytes: int
    embedding_bytes_uncapped: int | None
    kv_bytes_uncapped: int | None


@dataclass(frozen=True)
class VideoSize:
    """One video of a given frame size, length and rate as the model sees it (its own frame sampling).

    Invariants: `frames` are the frames sampled from `seconds x fps` (at least 1); `embedding_bytes == tokens *
    embedding width * dtype bytes`, `kv_bytes == tokens * kv_bytes_per_token`; `temporal_groups` is the tower's
    number of temporal patches (it attends within each, so its cost is that many towers over `tokens /
    temporal_groups`).
    """

    width: int
    height: int
    seconds: float
    fps: float
    frames: int
    temporal_groups: int
    tokens: int
    resized_width: int
    resized_height: int
    embedding_bytes: int
    kv_bytes: int


@dataclass(frozen=True)
class ModelSizes:
    """A model's per-token sizes in one dtype, and its adapter for counting image tokens."""

    model_dir: Path
    model_type: str
    dtype: str
    dtype_bytes: int
    hidden_size: int
    embedding_width: int
    num_layers: int
    kv_heads: int
    head_dim: int
    max_context: int
    adapter: Any

    @property
    def kv_bytes_per_token(self) -> int:
        """2 x layers x KV heads x head dim x dtype bytes."""
        from services.worker.engine.attention.kv_cache import KVShape

        return KVShape(self.num_layers, self.kv_heads, self.head_dim).block_bytes(1, DTYPES[self.dtype])

    @property
    def embedding_bytes_per_token(self) -> int:
        """embedding width x dtype bytes: one row of a projected image embedding, DeepStack levels included."""
        return self.embedding_width * self.dtype_bytes

    def image(self, width: int, height: int) -> ImageSize:
        """Tokens, resized size and bytes of one width x height image (the adapter's resize rule)."""
        item = self.adapter.image_tokens(width, height)
        uncapped_rule = getattr(self.adapter, "image_tokens_uncapped", None)
        uncapped = uncapped_rule(width, height).num_tokens if uncapped_rule is not None else None
        return ImageSize(
            width=width,
            height=height,
            tokens=item.num_tokens,
            tokens_uncapped=uncapped,
            resized_width=item.resized_width,
            resized_height=item.resized_height,
            embedding_bytes=item.num_tokens * self.embedding_bytes_per_token,
            kv_bytes=item.num_tokens * self.kv_bytes_per_token,
            embedding_bytes_uncapped=None if uncapped is None else uncapped * self.embedding_bytes_per_token,
            kv_bytes_uncapped=None if uncapped is None else uncapped * self.kv_bytes_per_token,
        )

    def video(self, width: int, height: int, seconds: float, fps: float) -> VideoSize:
        """Frames, tokens and bytes of one video (the adapter's sampling and resize rule, from its header alone).

        Raises ValueError when the model takes no video, or the adapter's VideoError for a size it refuses.
        """
        rule = getattr(self.adapter, "video_tokens", None)
        if rule is None:
            raise ValueError(f"{self.model_type} models take no video")
        total_frames = max(1, round(seconds * fps))
        item = rule(width, height, total_frames, fps)
        return VideoSize(
            width=width,
            height=height,
            seconds=seconds,
            fps=fps,
            frames=len(item.frame_indices),
            temporal_groups=item.grid_thw[0],
            tokens=item.num_tokens,
            resized_width=item.resized_width,
            resized_height=item.resized_height,
            embedding_bytes=item.num_tokens * self.embedding_bytes_per_token,
            kv_bytes=item.num_tokens * self.kv_bytes_per_token,
        )


def config_dtype(config: Any) -> str | None:
    """The dtype the config says the weights are in (its or its text config's `dtype`), when one we count in."""
    for owner in (config, config.get_text_config()):
        value = getattr(owner, "dtype", None)
        name = str(value).removeprefix("torch.") if value is not None else None
        if name in DTYPES:
            return name
    return None


def load_sizes(model_dir: Path, dtype: str | None = None) -> ModelSizes:
    """Sizes of the folder's model in `dtype` (None: the config's, else `DEFAULT_DTYPE`); reads no weights.

    Raises FileNotFoundError / ValueError as `load_adapter` does for a folder that is not a model's, and
    ValueError for an unknown dtype.
    """
    from transformers import AutoConfig

    from services.models.registry import load_adapter
    from services.worker.engine.attention.kv_cache import KVShape

    model_dir = Path(model_dir)
    adapter = load_adapter(model_dir)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    name = dtype or config_dtype(config) or DEFAULT_DTYPE
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (one of {', '.join(DTYPES)})")
    shape = KVShape.of_config(config)
    return ModelSizes(
        model_dir=model_dir,
        model_type=adapter.model_type,
        dtype=name,
        dtype_bytes=DTYPES[name].itemsize,
        hidden_size=int(adapter.hidden_size),
        embedding_width=int(adapter.embedding_width),
        num_layers=shape.num_layers,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_context=int(adapter.max_context),
        adapter=adapter,
    )
