"""Family-independent types shared by every model adapter, and the adapter protocol.

The router, encoder and worker only ever talk to a model through a `ModelAdapter`; everything a
model family does differently (resize rule, chat template, placeholder expansion, positions) hides
behind it. All dataclasses here are frozen value objects: they carry no model state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch

from services.models.media_span import MediaSpan

if TYPE_CHECKING:  # PIL only for annotations: the worker's model side runs without it
    from PIL import Image


class PromptError(ValueError):
    """A chat request that cannot be turned into a prompt (for example user text holding a special token).

    The message names the offending token and the index of the message it was found in.
    """


class ImageSizeError(ValueError):
    """An image whose dimensions the model's resize rule refuses (empty, or too extreme an aspect ratio)."""


class VideoError(ValueError):
    """A video the model's frame sampling or resize rule refuses (too few frames, no frame rate, a bad size)."""


@dataclass(frozen=True)
class ChatPart:
    """One part of a chat message: text, or a placeholder for the next media item (`kind` "image" or "video")."""

    kind: Literal["text", "image", "video"]
    text: str = ""


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn. Media parts are matched, in order over the whole conversation, to the prompt's items."""

    role: str
    parts: list[ChatPart] = field(default_factory=list)


@dataclass(frozen=True)
class ItemTokens:
    """What one image becomes in the prompt, computed from its size alone.

    Invariant: `num_tokens == grid_thw[0] * grid_thw[1] * grid_thw[2] // merge_size**2`, and
    `resized_height == grid_thw[1] * patch_size`, `resized_width == grid_thw[2] * patch_size`.
    """

    num_tokens: int
    grid_thw: tuple[int, int, int]
    resized_height: int
    resized_width: int
    modality: str = "image"


@dataclass(frozen=True)
class VideoTokens(ItemTokens):
    """What one video becomes in the prompt, computed from its container header alone (no decoding).

    `frame_indices` are the decoded frames (0-based, presentation order) the encoder samples, exactly these;
    `grid_thw[0] == ceil(len(frame_indices) / temporal_patch_size)` (the last frame repeats to fill a patch).
    `second_per_grid_t` is the seconds one temporal grid step spans, as float32 (Qwen2.5-VL scales M-RoPE
    time by it); 0.0 when the family's positions do not use it. `timestamps` are the seconds of each temporal
    grid step (the mean of its first and last frame's), for a family that writes them into the prompt (Qwen3-VL);
    empty otherwise.
    """

    frame_indices: tuple[int, ...] = ()
    second_per_grid_t: float = 0.0
    timestamps: tuple[float, ...] = ()
    modality: str = "video"


@dataclass(frozen=True)
class VideoFramePlan:
    """How the encoder turns a video's bytes into the model's frames, without the model: decode the frames at
    `frame_indices` (RGB, 8 bits), resize each to `height` x `width` with torch's antialiased uint8
    `interpolate(mode=resample)` (as transformers' torchvision video processors do). Picklable."""

    frame_indices: tuple[int, ...]
    height: int
    width: int
    resample: str = "bicubic"


@dataclass(frozen=True)
class BuiltPrompt:
    """A tokenized prompt.

    Invariant: `text_tokens + media_tokens == len(token_ids)`; `spans` are the items' placeholders, grid and
    modality in prompt order (their `mm_hash` empty: the router hashes the items): one span per item, or several
    consecutive ones where the family writes text between parts of an item (Qwen3-VL's video frame groups), told
    apart by `item_row` (services/models/media_span.py).
    """

    token_ids: list[int]
    spans: list[MediaSpan]
    text_tokens: int
    media_tokens: int


@dataclass(frozen=True)
class PixelInputs:
    """Processor output for one image: `pixel_values` is `[grid_t * grid_h * grid_w, patch_dim]` float32."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]


@dataclass(frozen=True)
class PlacedEmbedding:
    """Embedding rows `[n, hidden]` that replace the input embeddings at `offset .. offset + n`."""

    offset: int
    embedding: torch.Tensor


@dataclass(frozen=True)
class Positions:
    """Rotary positions of a whole prompt: `positions` is `[3, L]` long (M-RoPE axes t, h, w).

    A token at index `i >= L` (decoded after the prompt) has position `i + rope_delta` on every axis.
    """

    positions: torch.Tensor
    rope_delta: int


@runtime_checkable
class ModelAdapter(Protocol):
    """What the router, encoder and worker need from a model family.

    Construction (`from_folder`) reads config, tokenizer and processor settings only; weights are
    loaded by `load_model` where they are needed (encoder, worker), never in the router.
    """

    model_dir: Path
    model_type: str
    image_token_id: int
    eos_token_ids: list[int]
    max_context: int
    hidden_size: int
    embedding_width: int
    """Columns of one media item's embedding rows: `hidden_size`, more for a family that ships extra rows per token
    with the embedding (Qwen3-VL's DeepStack levels, services/models/deepstack.py)."""
    vocab_size: int
    tokenizer: Any
    packed_vision_attention: bool
    """True when the vision tower takes transformers' packed varlen attention path over a whole batch (Qwen2-VL's
    towers); the encoder routes the tower to `epd_flash_varlen_vision` only then (vision_attention.py)."""

    def processor_settings(self) -> dict[str, Any]: ...

    def image_tokens(self, width: int, height: int) -> ItemTokens: ...

    def build_prompt(self, messages: list[ChatMessage], items: list[ItemTokens]) -> BuiltPrompt: ...

    def load_model(self, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module: ...

    def preprocess(self, image: Image.Image) -> PixelInputs: ...

    def encode(self, model: torch.nn.Module, items: list[PixelInputs]) -> list[torch.Tensor]: ...

    def embed_prompt(
        self, model: torch.nn.Module, token_ids: torch.Tensor, placed: list[PlacedEmbedding]
    ) -> torch.Tensor: ...

    def prompt_positions(
        self, model: torch.nn.Module | None, token_ids: list[int], items: list[MediaSpan]
    ) -> Positions: ...

    def decode_positions(self, start: int, count: int, rope_delta: int) -> torch.Tensor:
        """Positions ``[3, count]`` of generated tokens at indices ``start``..: each token's are its predecessor's
        plus one on every axis (the engine advances a kept decode step by that rule: decode_batch.py)."""
        ...

    def forward_hidden(
        self, model: torch.nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor: ...

    def compute_logits(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class VideoAdapter(Protocol):
    """What a family that takes video adds to `ModelAdapter` (the router refuses video for any other).

    Code that places media asks `placeholder_token_id(adapter, modality)` (below), which also serves the
    image-only families through their `image_token_id`.

    `video_tokens` counts from the container header alone (router); `video_frame_plan` says which frames
    to decode and their size (encoder, before decoding); `preprocess_video` turns those frames into pixel
    inputs `encode` takes like an image's (normalise, patchify).
    """

    def placeholder_token_id(self, modality: str) -> int:
        """The token an item of `modality` ("image", "video") fills in a prompt; ValueError for another."""
        ...

    def video_tokens(self, width: int, height: int, total_frames: int, fps: float) -> VideoTokens: ...

    def video_frame_plan(self, grid_thw: tuple[int, int, int], frame_indices: tuple[int, ...]) -> VideoFramePlan: ...

    def preprocess_video(self, frames: Any, grid_thw: tuple[int, int, int]) -> PixelInputs: ...


def supports_video(adapter: Any) -> bool:
    """Whether `adapter`'s family takes video input (implements `VideoAdapter`)."""
    return isinstance(adapter, VideoAdapter)


def placeholder_token_id(adapter: Any, modality: str) -> int:
    """The placeholder token of `modality` through the adapter (`VideoAdapter.placeholder_token_id`); an
    adapter without that method takes images only, whose placeholder is its `image_token_id`."""
    method = getattr(adapter, "placeholder_token_id", None)
    if method is not None:
        return int(method(modality))
    if modality != "image":
        raise ValueError(f"{adapter.model_type} takes no {modality} input")
    return int(adapter.image_token_id)


def language_model_positions(adapter: Any, position_ids: torch.Tensor) -> torch.Tensor:
    """The positions the adapter's language model takes, from the engine's three M-RoPE rows `[3, 1, T]`: the
    adapter's `language_model_positions` where it has one (Llava's Llama: the first row, `[1, T]`), else the rows
    as they are (Qwen's models take all three)."""
    method = getattr(adapter, "language_model_positions", None)
    return position_ids if method is None else method(position_ids)


def media_forward_kwargs(adapter: Any, placed: list[PlacedEmbedding], num_tokens: int) -> dict[str, Any]:
    """What `forward_hidden` takes besides the input embeddings for a step of `num_tokens` rows whose media rows are
    `placed` (as given to `embed_prompt`): the adapter's `media_forward_kwargs` (Qwen3-VL: the DeepStack levels of
    those rows); {} for a family without one, or a step without media rows."""
    method = getattr(adapter, "media_forward_kwargs", None)
    if method is None or not placed:
        return {}
    return dict(method(placed, num_tokens))
