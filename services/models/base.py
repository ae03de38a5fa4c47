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

if TYPE_CHECKING:  # PIL only for annotations: the worker's model side runs without it
    from PIL import Image


class PromptError(ValueError):
    """A chat request that cannot be turned into a prompt (for example user text holding a special token).

    The message names the offending token and the index of the message it was found in.
    """


class ImageSizeError(ValueError):
    """An image whose dimensions the model's resize rule refuses (empty, or too extreme an aspect ratio)."""


@dataclass(frozen=True)
class ChatPart:
    """One part of a chat message: text, or a placeholder for the next media item (`kind == "image"`)."""

    kind: Literal["text", "image"]
    text: str = ""


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn. Image parts are matched, in order over the whole conversation, to the prompt's items."""

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


@dataclass(frozen=True)
class MediaSpan:
    """Where one item's placeholder tokens sit in a prompt: `token_ids[offset:offset + length]`."""

    offset: int
    length: int


@dataclass(frozen=True)
class BuiltPrompt:
    """A tokenized prompt.

    Invariant: `text_tokens + media_tokens == len(token_ids)`, and `spans[i]` is item i's placeholders.
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
class PlacedItem:
    """A media item's first placeholder index in the prompt and its vision grid (for positions)."""

    offset: int
    grid_thw: tuple[int, int, int]


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
    tokenizer: Any

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
        self, model: torch.nn.Module | None, token_ids: list[int], items: list[PlacedItem]
    ) -> Positions: ...

    def decode_positions(self, start: int, count: int, rope_delta: int) -> torch.Tensor: ...

    def forward_hidden(
        self, model: torch.nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor: ...

    def compute_logits(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor: ...
