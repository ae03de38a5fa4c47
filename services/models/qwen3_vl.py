"""Model adapter for Qwen3-VL (transformers `qwen3_vl`): Qwen2-VL's accounting and positions, DeepStack embeddings.

What Qwen3-VL shares with Qwen2-VL is inherited (`Qwen2VLAdapter`): the image processor and its resize rule
(Qwen2VLImageProcessor with 16-pixel patches and a 2x2 merge: 32 pixels per token side, the folder's min/max
pixels), `<|vision_start|><|image_pad|><|vision_end|>` placeholders expanded from the chat template, and the
M-RoPE position ids of `get_rope_index` (an image's t, h, w rows from where it starts, the next text at the start +
max(h, w)); the model interleaves the three axes over the rotary frequencies itself (`mrope_interleaved`), from
the same ids. What differs:

- DeepStack: the tower returns, besides the projected embedding, one feature map per `deepstack_visual_indexes`
  entry; `encode` joins them into one `[n, hidden x (1 + levels)]` tensor per item (services/models/deepstack.py),
  `embed_prompt` swaps in the main columns, and `media_forward_kwargs` hands the language model each level's rows
  for exactly the media rows of the step, which transformers' `Qwen3VLTextModel` adds after decoder layers 0, 1,
  ... (`_deepstack_process`), so a prefill chunk that splits an item adds the levels of the rows it computes.
- The language model is `qwen3_vl_text` (q/k norms, an explicit head_dim); the engine's per-layer-type mask
  becomes the one mask it takes.
- Video (services/models/qwen3_vl_video.py): its own frame sampling and whole-clip resize, and a timestamp before
  each temporal patch's frame group (`<t seconds><|vision_start|>` + the group's tokens + `<|vision_end|>`), so a
  video is one item (one tower call, one embedding, one cache entry) placed as several spans, one per frame group,
  each at its `item_row` with grid `(1, h, w)`: `get_rope_index` positions each group as an image from where it
  starts (the timestamps between are text), which is what the inherited positions give such spans.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from services.models import deepstack, qwen3_vl_video
from services.models.base import (
    BuiltPrompt,
    ChatMessage,
    ItemTokens,
    PixelInputs,
    PlacedEmbedding,
    PromptError,
    VideoTokens,
)
from services.models.loading import read_video_processor_dict
from services.models.prompt import encode_ids, expand_media_placeholders
from services.models.qwen2_vl import Qwen2VLAdapter
from services.models.qwen2_vl_video import VideoSettings
from services.models.qwen2_vl_vision import plan_vision, stage, stage_batch, tower_takes_plan

log = logging.getLogger(__name__)


class Qwen3VLAdapter(Qwen2VLAdapter):
    """Adapter for one Qwen3-VL model folder (dense language model).

    Invariant: `embedding_width == hidden_size * (1 + deepstack_levels)`: every embedding this adapter encodes or
    takes has that many columns (deepstack.py's layout), and its processor settings name the layout and the level
    count.
    """

    def __init__(
        self, model_dir: Path | None, config: Any, tokenizer: Any | None, image_processor: Any | None, eos: list[int]
    ) -> None:
        super().__init__(model_dir, config, tokenizer, image_processor, eos)
        self.deepstack_levels: int = len(config.vision_config.deepstack_visual_indexes)
        self.vision_start_token_id: int = int(config.vision_start_token_id)
        self.vision_end_token_id: int = int(config.vision_end_token_id)
        self.embedding_width = self.hidden_size * (1 + self.deepstack_levels)

    def processor_settings(self) -> dict[str, Any]:
        """Qwen2-VL's settings plus the embedding layout and its DeepStack level count (both change what an item's
        embedding is, so they enter its hash)."""
        return {
            **super().processor_settings(),
            "embedding_layout": deepstack.LAYOUT,
            "deepstack_levels": self.deepstack_levels,
        }

    # ----- accounting (router) -----

    def video_tokens(self, width: int, height: int, total_frames: int, fps: float) -> VideoTokens:
        """Frames, grid, tokens and per-patch timestamps of a video from its header (`qwen3_vl_video`)."""
        return qwen3_vl_video.video_tokens(width, height, total_frames, fps, self._video())

    def build_prompt(self, messages: list[ChatMessage], items: list[ItemTokens]) -> BuiltPrompt:
        """As Qwen2-VL's, but each video becomes its timestamped frame groups: the text the processor writes for
        it, tokenized, with one span per group (grid `(1, h, w)`, at `item_row` k x the group's tokens).

        Raises PromptError when user text holds a special token, or media parts and items disagree.
        """
        if all(item.modality != "video" for item in items):
            return super().build_prompt(messages, items)
        text, _ = self._chat_text(messages, items)
        pad = self.tokenizer.convert_ids_to_tokens(self.video_token_id)
        start = self.tokenizer.convert_ids_to_tokens(self.vision_start_token_id)
        end = self.tokenizer.convert_ids_to_tokens(self.vision_end_token_id)
        pieces = text.split(pad)  # the text around each video's one placeholder, in order
        videos = [item for item in items if item.modality == "video"]
        if len(pieces) != len(videos) + 1:
            raise PromptError(f"the chat template wrote {len(pieces) - 1} video placeholders for {len(videos)} videos")
        expanded = [pieces[0]]
        for video, after in zip(videos, pieces[1:], strict=True):
            if len(getattr(video, "timestamps", ())) != video.grid_thw[0]:
                raise PromptError(f"a video of {video.grid_thw[0]} temporal patches came without a timestamp each")
            expanded += [qwen3_vl_video.video_text(video.timestamps, start, pad, end), after]  # type: ignore[attr-defined]
        groups: list[ItemTokens] = []  # one per placeholder in the expanded text: images, and videos' frame groups
        rows: list[int] = []  # each one's first row in its item's embedding
        for item in items:
            if item.modality != "video":
                groups.append(item)
                rows.append(0)
                continue
            t, h, w = item.grid_thw
            per_group = item.num_tokens // t
            groups += [replace(item, num_tokens=per_group, grid_thw=(1, h, w))] * t
            rows += [k * per_group for k in range(t)]
        ids = encode_ids(self.tokenizer, "".join(expanded), False)
        placeholders = {"image": self.image_token_id, "video": self.video_token_id}
        built = expand_media_placeholders(ids, placeholders, groups)
        spans = [replace(span, item_row=row) for span, row in zip(built.spans, rows, strict=True)]
        return replace(built, spans=spans)

    # ----- vision (encoder) -----

    def staged_tower(self, model: torch.nn.Module, items: list[PixelInputs]) -> Callable[[], list[torch.Tensor]]:
        """As Qwen2-VL's (host-planned inputs when the tower takes them), but each item's result is its joined
        main and DeepStack rows `[n, embedding_width]`."""
        visual = model.model.visual
        pixels = [item.pixel_values for item in items]
        grids = [item.grid_thw for item in items]
        if tower_takes_plan(type(visual)):
            staged = stage_batch(visual, pixels, plan_vision(grids, model.config.vision_config))

            def planned() -> list[torch.Tensor]:
                out = visual(staged.pixels, grid_thw=staged.grid_thw, **staged.kwargs)
                joined = deepstack.join(out.pooler_output, list(out.deepstack_features))
                if joined.shape[0] != sum(staged.rows):
                    raise RuntimeError(f"vision tower returned {joined.shape[0]} rows, the plan has {sum(staged.rows)}")
                return list(joined.split(staged.rows))

            return torch.no_grad()(planned)
        weight = visual.patch_embed.proj.weight
        device_pixels = stage(pixels, weight.dtype, weight.device)
        grid_thw = torch.tensor(grids, dtype=torch.long, device=weight.device)

        def features() -> list[torch.Tensor]:
            out = model.model.get_image_features(device_pixels, grid_thw)
            levels = [list(level) for level in out.deepstack_features]
            return [deepstack.join(main, [level[i] for level in levels]) for i, main in enumerate(out.pooler_output)]

        return torch.no_grad()(features)

    # ----- language model (worker) -----

    def embed_prompt(
        self, model: torch.nn.Module, token_ids: torch.Tensor, placed: list[PlacedEmbedding]
    ) -> torch.Tensor:
        """Input embeddings `[L, hidden]` with each placed item's main columns swapped in (its DeepStack columns go
        to the language model through `media_forward_kwargs`)."""
        mains = [PlacedEmbedding(p.offset, deepstack.main_rows(p.embedding, self.hidden_size)) for p in placed]
        return super().embed_prompt(model, token_ids, mains)

    def media_forward_kwargs(self, placed: list[PlacedEmbedding], num_tokens: int) -> dict[str, Any]:
        """`forward_hidden`'s DeepStack keywords for a step of `num_tokens` rows whose media rows are `placed`."""
        return deepstack.step_inputs(placed, num_tokens, self.hidden_size, self.deepstack_levels)

    def forward_hidden(
        self, model: torch.nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """`Qwen3VLTextModel` over `inputs_embeds [1, T, H]` at `position_ids [3, 1, T]`; returns `[1, T, H]`.

        A mask given per layer type (`{"full_attention": mask}`) becomes the one mask the model takes; DeepStack
        keywords (`visual_pos_masks`, `deepstack_visual_embeds`), a cache and an attention context pass through;
        `use_cache` defaults to False.
        """
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):
            kwargs["attention_mask"] = mask.get("full_attention")
        return super().forward_hidden(model, inputs_embeds, position_ids, **kwargs)

    def _read_video_settings(self) -> VideoSettings | None:
        """The folder's video settings as Qwen3VLVideoProcessor reads them; None without a folder, or (logged: videos
        are then refused) when they ask for something the video rule does not implement."""
        if self.model_dir is None:
            return None
        try:
            return qwen3_vl_video.video_settings(read_video_processor_dict(self.model_dir))
        except ValueError as exc:
            log.warning("%s: video input off: %s", self.model_dir, exc)
            return None
