"""Model adapter for Qwen2-VL and Qwen2.5-VL (transformers `qwen2_vl` / `qwen2_5_vl`).

Both families share the image processor (Qwen2VLImageProcessor), the chat template conventions
(`<|vision_start|><|image_pad|><|vision_end|>` per image), the M-RoPE rule for images and the module
layout `model.model.{visual, language_model}` + `model.lm_head`; Qwen2.5-VL only differs inside the
vision tower (window attention), whose inputs `qwen2_vl_vision.plan_vision` computes on the host, and in
the time axis of video positions (`tokens_per_second`). Video rules: `qwen2_vl_video` (the mixin).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.models import mrope
from services.models.base import (
    BuiltPrompt,
    ChatMessage,
    ItemTokens,
    PixelInputs,
    Positions,
    PromptError,
)
from services.models.folder_adapter import FolderAdapter
from services.models.loading import read_video_processor_dict
from services.models.media_span import MediaSpan
from services.models.prompt import (
    check_no_special_text,
    encode_ids,
    expand_media_placeholders,
    expand_placeholders,
    media_parts,
)
from services.models.qwen2_vl_resize import smart_resize
from services.models.qwen2_vl_video import Qwen2VLVideoMixin, VideoSettings
from services.models.qwen2_vl_vision import call_tower, plan_vision, stage, stage_batch, tower_takes_plan

if TYPE_CHECKING:  # PIL only for annotations: the worker's model side runs without it
    from PIL import Image


log = logging.getLogger(__name__)


class Qwen2VLAdapter(FolderAdapter, Qwen2VLVideoMixin):
    """Adapter for one Qwen2-VL / Qwen2.5-VL model folder.

    Holds config, tokenizer and image processor (never the weights: `load_model` returns them to the
    caller, who passes the model back into the compute methods). Stateless between calls, so one instance may
    serve many threads.
    Invariant: `image_tokens(w, h)` equals the token count the saved image processor produces for a w x h
    image, and `video_tokens(...)` the one its video processor produces from the sampled frames.
    """

    packed_vision_attention = True
    """Both towers take transformers' packed varlen path when their attention name contains "flash"."""

    def __init__(
        self, model_dir: Path | None, config: Any, tokenizer: Any | None, image_processor: Any | None, eos: list[int]
    ) -> None:
        super().__init__(model_dir, config, tokenizer, image_processor, eos)
        vision = config.vision_config
        self.patch_size: int = int(vision.patch_size)
        self.merge_size: int = int(vision.spatial_merge_size)
        self.temporal_patch_size: int = int(vision.temporal_patch_size)
        self.video_token_id: int = int(config.video_token_id)
        self.tokens_per_second: float | None = getattr(vision, "tokens_per_second", None)  # Qwen2.5-VL only
        self.video_settings = self._read_video_settings()
        self._pixels = None  # one-pass image pixels where the probe finds them equal to the processor's
        if image_processor is not None:
            self._check_processor_matches_model()
            from services.models.qwen2_vl_pixels import probe_image_pixels  # PIL: the processor's side only

            self._pixels = probe_image_pixels(
                image_processor,
                self.patch_size,
                self.merge_size,
                self.temporal_patch_size,
                lambda width, height: self.image_tokens(width, height).grid_thw,
            )

    # ----- accounting (router) -----

    def processor_settings(self) -> dict[str, Any]:
        """Canonical JSON-able dict of every image and video processor setting that changes their output."""
        ip = self.image_processor
        return {
            "image_processor_type": type(ip).__name__.removesuffix("Pil"),
            "do_convert_rgb": bool(ip.do_convert_rgb),
            "do_resize": bool(ip.do_resize),
            "min_pixels": int(ip.size.shortest_edge),
            "max_pixels": int(ip.size.longest_edge),
            "resample": int(ip.resample),
            "do_rescale": bool(ip.do_rescale),
            "rescale_factor": float(ip.rescale_factor),
            "do_normalize": bool(ip.do_normalize),
            "image_mean": [float(v) for v in ip.image_mean],
            "image_std": [float(v) for v in ip.image_std],
            "patch_size": int(ip.patch_size),
            "temporal_patch_size": int(ip.temporal_patch_size),
            "merge_size": int(ip.merge_size),
            "video": None if self.video_settings is None else self.video_settings.as_json(),
        }

    def image_tokens(self, width: int, height: int) -> ItemTokens:
        """Tokens, vision grid and resized size of a width x height image, without running the processor."""
        return self._image_tokens(width, height, int(self.image_processor.size.longest_edge))

    def image_tokens_uncapped(self, width: int, height: int) -> ItemTokens:
        """`image_tokens` with the processor's max_pixels lifted (min_pixels kept): the image at full resolution
        (capacity planning shows what the cap saves)."""
        return self._image_tokens(width, height, 1 << 62)

    def _image_tokens(self, width: int, height: int, max_pixels: int) -> ItemTokens:
        resized_h, resized_w = smart_resize(
            height,
            width,
            factor=self.patch_size * self.merge_size,
            min_pixels=int(self.image_processor.size.shortest_edge),
            max_pixels=max_pixels,
        )
        grid = (1, resized_h // self.patch_size, resized_w // self.patch_size)
        return ItemTokens(
            num_tokens=mrope.item_length(grid, self.merge_size),
            grid_thw=grid,
            resized_height=resized_h,
            resized_width=resized_w,
        )

    def build_prompt(self, messages: list[ChatMessage], items: list[ItemTokens]) -> BuiltPrompt:
        """Render the chat template (with the generation prompt), expand image and video placeholders, tokenize.

        Raises PromptError when user text holds a special token, or media parts and items disagree.
        """
        text, kinds = self._chat_text(messages, items)
        ids = encode_ids(self.tokenizer, text, False)
        if "video" not in kinds:  # the common case, scanned in C
            return expand_placeholders(ids, self.image_token_id, items)
        placeholders = {"image": self.image_token_id, "video": self.video_token_id}
        return expand_media_placeholders(ids, placeholders, items)

    def _chat_text(self, messages: list[ChatMessage], items: list[ItemTokens]) -> tuple[str, list[str]]:
        """The rendered chat template (one placeholder per media part) and the media parts' kinds, checked against
        `items`. Raises PromptError."""
        if not messages:
            raise PromptError("a prompt needs at least one message")
        check_no_special_text(messages, self.special_tokens)
        kinds = media_parts(messages)
        if kinds != [item.modality for item in items]:
            held = f"{kinds.count('image')} image parts" + (
                f", {kinds.count('video')} video" if "video" in kinds else ""
            )
            raise PromptError(
                f"the messages hold {held} but {len(items)} items were given (in order, of kinds "
                f"{[item.modality for item in items]})"
            )
        conversation = [
            {
                "role": message.role,
                "content": [
                    {"type": "text", "text": part.text} if part.kind == "text" else {"type": part.kind}
                    for part in message.parts
                ],
            }
            for message in messages
        ]
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return text, kinds

    # ----- vision (encoder) -----

    def preprocess(self, image: Image.Image) -> PixelInputs:
        """Resize, normalise and patchify one RGB, already-oriented image as the saved processor does (in one pass
        where its probe allowed: services/models/qwen2_vl_pixels.py)."""
        expected = self.image_tokens(image.width, image.height)
        if self._pixels is not None and image.mode == "RGB":
            _, grid_h, grid_w = expected.grid_thw
            rows = self._pixels(image, grid_h * self.patch_size, grid_w * self.patch_size)
            return PixelInputs(pixel_values=torch.from_numpy(rows), grid_thw=expected.grid_thw)
        out = self.image_processor(images=[image], return_tensors="pt")
        grid = tuple(int(v) for v in out["image_grid_thw"][0].tolist())
        if grid != expected.grid_thw:
            raise RuntimeError(f"processor grid {grid} differs from the resize rule's {expected.grid_thw}")
        return PixelInputs(pixel_values=out["pixel_values"], grid_thw=expected.grid_thw)

    def encode(self, model: torch.nn.Module, items: list[PixelInputs]) -> list[torch.Tensor]:
        """One vision forward for all items; returns one `[num_tokens_i, hidden]` tensor per item.

        The tower's shape-derived inputs are planned on the host from the items' grids and its output split
        by host-known counts (`qwen2_vl_vision`), so nothing here waits for the device; one host-to-device
        copy of the pixels. The results stay on the model's device: views of one merged tensor.
        """
        if not items:
            return []
        out = self.staged_tower(model, items)()
        for index, (item, rows) in enumerate(zip(items, out, strict=True)):
            expected = mrope.item_length(item.grid_thw, self.merge_size)
            if rows.shape != (expected, self.embedding_width):
                raise RuntimeError(f"item {index}: vision output {tuple(rows.shape)}, expected {expected} rows")
        return out

    def staged_tower(self, model: torch.nn.Module, items: list[PixelInputs]) -> Callable[[], list[torch.Tensor]]:
        """The items' inputs staged on the tower's device now, and the call that runs the tower on them (and
        nothing else: what a tower benchmark times), returning one tensor per item.

        With a tower that takes planned inputs (`tower_takes_plan`, checked from its code) the call is
        `call_tower` with the host plan; otherwise (an older transformers, a GPU machine's) `get_image_features`,
        which plans on the device with host syncs. Errors inside the tower propagate either way.
        """
        visual = model.model.visual
        pixels = [item.pixel_values for item in items]
        if tower_takes_plan(type(visual)):
            staged = stage_batch(
                visual, pixels, plan_vision([item.grid_thw for item in items], model.config.vision_config)
            )
            return torch.no_grad()(lambda: call_tower(visual, staged))
        weight = visual.patch_embed.proj.weight
        device_pixels = stage(pixels, weight.dtype, weight.device)
        grids = torch.tensor([item.grid_thw for item in items], dtype=torch.long, device=weight.device)
        return torch.no_grad()(lambda: list(model.model.get_image_features(device_pixels, grids).pooler_output))

    # ----- language model (worker) -----

    def prompt_positions(
        self, model: torch.nn.Module | None, token_ids: list[int], items: list[MediaSpan]
    ) -> Positions:
        """M-RoPE positions `[3, L]` of a whole prompt (the same numbers `generate` uses).

        A pure computation (see `mrope`); `model`, when given, only chooses the device of the result.
        Raises ValueError when items are out of order, overlap, do not cover exactly the media tokens.
        """
        covered = {"image": 0, "video": 0}
        for index, item in enumerate(items):
            length = mrope.item_length(item.grid_thw, self.merge_size)
            span = token_ids[item.offset : item.offset + length]
            token = self.placeholder_token_id(item.modality)
            if len(span) != length or any(tok != token for tok in span):
                raise ValueError(f"item {index} at offset {item.offset} does not cover {length} {item.modality} tokens")
            covered[item.modality] += length
        for modality, count in covered.items():
            if token_ids.count(self.placeholder_token_id(modality)) != count:
                raise ValueError(f"the prompt holds {modality} tokens that no item covers")
        positions = mrope.mrope_positions(len(token_ids), items, self.merge_size, self.tokens_per_second)
        if model is None:
            return positions
        device = next(model.parameters()).device
        return Positions(positions=positions.positions.to(device), rope_delta=positions.rope_delta)

    def decode_positions(self, start: int, count: int, rope_delta: int) -> torch.Tensor:
        """Positions `[3, count]` of tokens at indices start.. (index + rope_delta on all three axes)."""
        return mrope.decode_positions(start, count, rope_delta)

    def forward_hidden(
        self, model: torch.nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """Language model over `inputs_embeds [1, T, H]` at `position_ids [3, 1, T]`; returns `[1, T, H]`.

        Keyword arguments (cache, attention context, attention_mask) reach the model untouched;
        `use_cache` defaults to False so that no throw-away cache is built when the caller passes none
        (a cache given as `cache=` is still read and updated).
        """
        kwargs.setdefault("use_cache", False)
        out = model.model.language_model(inputs_embeds=inputs_embeds, position_ids=position_ids, **kwargs)
        return out.last_hidden_state

    def _read_video_settings(self) -> VideoSettings | None:
        """The folder's video settings; None without a folder, or (logged: videos are then refused) when they
        ask for something the video rule does not implement. Images never depend on them."""
        if self.model_dir is None:
            return None
        try:
            return VideoSettings.from_dict(read_video_processor_dict(self.model_dir))
        except ValueError as exc:
            log.warning("%s: video input off: %s", self.model_dir, exc)
            return None

    def _check_processor_matches_model(self) -> None:
        ip = self.image_processor
        pairs = {
            "patch_size": (int(ip.patch_size), self.patch_size),
            "merge_size": (int(ip.merge_size), self.merge_size),
            "temporal_patch_size": (int(ip.temporal_patch_size), self.temporal_patch_size),
        }
        for name, (saved, model_value) in pairs.items():
            if saved != model_value:
                raise ValueError(f"{self.model_dir}: image processor {name}={saved} but the model uses {model_value}")
