"""Model adapter for LLaVA-1.5 (transformers `llava`: `LlavaForConditionalGeneration`, a CLIP vision tower).

Every image becomes a fixed number of tokens: the processor resizes and crops it to the tower's square input
(`image_size`, 336 in LLaVA-1.5), the tower cuts that into (image_size / patch_size)^2 patches (24 x 24 =
576) plus a CLS token, and `vision_feature_select_strategy` "default" drops the CLS row ("full" keeps it:
577). The rows come from the hidden states of `vision_feature_layer` (-2), or several layers concatenated,
then the two-layer projector; one `<image>` in the chat text becomes that many `<image>` tokens, as
transformers' LlavaProcessor expands it. The language model is a Llama with 1-D positions (the token index):
the three position rows the engine passes are three copies, and the first is what the model gets.

Preprocessing is the folder's saved image processor itself (CLIPImageProcessor in llava-hf's LLaVA-1.5:
shortest edge to 336, bicubic, center crop 336x336, CLIP mean/std; LlavaImageProcessor's `do_pad`, the
original LLaVA-1.5's pad-to-square, applies when a folder saves it). Either way the output is the tower's
square, so the token count never depends on the image, only the pixels do.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.models import llava_processor
from services.models.base import (
    BuiltPrompt,
    ChatMessage,
    ImageSizeError,
    ItemTokens,
    PixelInputs,
    Positions,
    PromptError,
)
from services.models.folder_adapter import FolderAdapter
from services.models.media_span import MediaSpan
from services.models.prompt import check_no_special_text, count_image_parts, encode_ids, expand_placeholders

if TYPE_CHECKING:  # PIL only for annotations: the worker's model side runs without it
    from PIL import Image

MAX_ASPECT_RATIO = 200
"""Longer side over shorter side beyond which an image is refused (Qwen2-VL's rule too): the processor scales
the shorter side to 336 before cropping, so a 1 x 5000 image would be resized to 336 x 1.68 million pixels."""
STRATEGIES = ("default", "full")


class LlavaAdapter(FolderAdapter):
    """Adapter for one LLaVA-1.5 model folder (config, tokenizer, image processor; never the weights).

    Stateless between calls, so one instance may serve many threads. Invariant: `image_tokens(w, h)` is
    `tokens_per_image` for every accepted size, which equals the rows `encode` returns per image and the
    `<image>` tokens LlavaProcessor expands one placeholder to.
    """

    packed_vision_attention = False
    """CLIP's attention has no packed varlen path: the encoder keeps transformers' attention for its tower."""

    def __init__(
        self, model_dir: Path | None, config: Any, tokenizer: Any | None, image_processor: Any | None, eos: list[int]
    ) -> None:
        super().__init__(model_dir, config, tokenizer, image_processor, eos)
        vision = config.vision_config
        self.image_size: int = int(vision.image_size)
        self.patch_size: int = int(vision.patch_size)
        strategy = config.vision_feature_select_strategy
        if strategy not in STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
        side = self.image_size // self.patch_size
        self.grid: tuple[int, int, int] = (1, side, side)
        self.tokens_per_image: int = side * side + (1 if strategy == "full" else 0)
        if image_processor is not None:
            self._check_processor_matches_model()

    # ----- accounting (router) -----

    def processor_settings(self) -> dict[str, Any]:
        """Canonical JSON-able dict of every image processor setting that changes its output."""
        return llava_processor.processor_settings(self.image_processor)

    def image_tokens(self, width: int, height: int) -> ItemTokens:
        """`tokens_per_image` for any width x height the processor takes; ImageSizeError for an empty image or
        one more than `MAX_ASPECT_RATIO` times longer than wide (or the reverse)."""
        if width < 1 or height < 1:
            raise ImageSizeError(f"image of {width}x{height} pixels is empty")
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            raise ImageSizeError(f"image of {width}x{height} pixels has an aspect ratio above {MAX_ASPECT_RATIO}")
        return ItemTokens(
            num_tokens=self.tokens_per_image,
            grid_thw=self.grid,
            resized_height=self.image_size,
            resized_width=self.image_size,
        )

    def build_prompt(self, messages: list[ChatMessage], items: list[ItemTokens]) -> BuiltPrompt:
        """Render the chat template (with the generation prompt), tokenize as LlavaProcessor does (`<s>` first
        unless the template wrote it), and expand each `<image>` to its item's tokens.

        Raises PromptError when user text holds a special token, a part is neither text nor image, or image
        parts and items disagree.
        """
        if not messages:
            raise PromptError("a prompt needs at least one message")
        check_no_special_text(messages, self.special_tokens)
        for index, message in enumerate(messages):
            for part in message.parts:
                if part.kind not in ("text", "image"):
                    raise PromptError(f"message {index} has a {part.kind} part; {self.model_type} takes images only")
        images = count_image_parts(messages)
        if images != len(items):
            raise PromptError(f"the messages hold {images} image parts but {len(items)} items were given")
        conversation = [
            {
                "role": message.role,
                "content": [
                    {"type": "image"} if part.kind == "image" else {"type": "text", "text": part.text}
                    for part in message.parts
                ],
            }
            for message in messages
        ]
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        bos = self.tokenizer.bos_token
        add_special = not (bos and text.startswith(bos))  # transformers' processors' rule for rendered chats
        ids = encode_ids(self.tokenizer, text, add_special)
        return expand_placeholders(ids, self.image_token_id, items)

    # ----- vision (encoder) -----

    def preprocess(self, image: Image.Image) -> PixelInputs:
        """Resize, crop and normalise one RGB, already-oriented image with the saved processor: `[1, 3, S, S]`."""
        self.image_tokens(image.width, image.height)
        pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        expected = (1, 3, self.image_size, self.image_size)
        if tuple(pixels.shape) != expected:
            raise RuntimeError(f"processor output {tuple(pixels.shape)}, the vision tower takes {expected}")
        return PixelInputs(pixel_values=pixels, grid_thw=self.grid)

    def encode(self, model: torch.nn.Module, items: list[PixelInputs]) -> list[torch.Tensor]:
        """One vision forward (tower, feature layer and strategy from the config, projector) for all items.

        Returns one `[tokens_per_image, hidden]` tensor per item: the rows `generate` places for that image
        (`get_image_features`, the path `LlavaModel.forward` takes), views of one batch output on the model's
        device. One host-to-device copy of the pixels; nothing waits for the device.
        """
        if not items:
            return []
        weight = model.model.multi_modal_projector.linear_1.weight
        pixels = torch.cat([item.pixel_values for item in items]).to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            out = list(model.model.get_image_features(pixel_values=pixels).pooler_output)
        for index, rows in enumerate(out):
            if rows.shape != (self.tokens_per_image, self.hidden_size):
                raise RuntimeError(f"item {index}: vision output {tuple(rows.shape)}, expected {self.tokens_per_image}")
        return out

    # ----- language model (worker) -----

    def prompt_positions(
        self, model: torch.nn.Module | None, token_ids: list[int], items: list[MediaSpan]
    ) -> Positions:
        """Positions `[3, L]`: the token index on three identical rows, `rope_delta` 0 (what `generate` uses).

        Raises ValueError when an item does not cover `tokens_per_image` image tokens or image tokens are
        left uncovered. `model`, when given, only chooses the device of the result.
        """
        covered = 0
        for index, item in enumerate(items):
            span = token_ids[item.offset : item.offset + self.tokens_per_image]
            if len(span) != self.tokens_per_image or any(tok != self.image_token_id for tok in span):
                raise ValueError(f"item {index} at offset {item.offset} does not cover {self.tokens_per_image} tokens")
            covered += self.tokens_per_image
        if token_ids.count(self.image_token_id) != covered:
            raise ValueError("the prompt holds image tokens that no item covers")
        positions = self.decode_positions(0, len(token_ids), 0)
        if model is not None:
            positions = positions.to(next(model.parameters()).device)
        return Positions(positions=positions, rope_delta=0)

    def decode_positions(self, start: int, count: int, rope_delta: int) -> torch.Tensor:
        """Positions `[3, count]` of tokens at indices start.. (index + rope_delta, the same on all rows)."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be non-negative, got {start} and {count}")
        row = torch.arange(start + rope_delta, start + rope_delta + count, dtype=torch.long)
        return row.unsqueeze(0).expand(3, count).clone()

    def forward_hidden(
        self, model: torch.nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """The Llama language model over `inputs_embeds [1, T, H]` at `position_ids [3, 1, T]`: `[1, T, H]`.

        The first position row is the model's `position_ids [1, T]` (the rows are equal). A mask given per
        layer type (`{"full_attention": mask}`, the engine's form for Qwen's hybrid-ready models) becomes the
        one mask a Llama takes. Other keyword arguments (cache, attention context) pass through; `use_cache`
        defaults to False so no throw-away cache is built.
        """
        kwargs.setdefault("use_cache", False)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):
            kwargs["attention_mask"] = mask.get("full_attention")
        rows = self.language_model_positions(position_ids)
        out = model.model.language_model(inputs_embeds=inputs_embeds, position_ids=rows, **kwargs)
        return out.last_hidden_state

    def language_model_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """A Llama's `position_ids [1, T]`: the first of the engine's three equal rows `[3, 1, T]`."""
        return position_ids[0] if position_ids.dim() == 3 else position_ids

    def _check_processor_matches_model(self) -> None:
        """The processor must always produce the tower's square input (else token counts would vary)."""
        try:
            out = llava_processor.output_size(self.image_processor)
        except ValueError as exc:
            raise ValueError(f"{self.model_dir}: {exc}") from None
        if out != (self.image_size, self.image_size):
            raise ValueError(
                f"{self.model_dir}: image processor makes {out[0]}x{out[1]}, the tower takes {self.image_size}"
            )
