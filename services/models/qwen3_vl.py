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
- Video: Qwen3-VL writes a timestamp before each frame (`<t seconds><|vision_start|>frame<|vision_end|>`), so a
  video's placeholders are not one run; that layout is not built: the adapter is no `VideoAdapter`, so the router
  refuses video parts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.models import deepstack
from services.models.base import PixelInputs, PlacedEmbedding
from services.models.qwen2_vl import Qwen2VLAdapter
from services.models.qwen2_vl_video import VideoSettings
from services.models.qwen2_vl_vision import plan_vision, stage, stage_batch, tower_takes_plan


class Qwen3VLAdapter(Qwen2VLAdapter):
    """Adapter for one Qwen3-VL model folder (dense language model).

    Invariant: `embedding_width == hidden_size * (1 + deepstack_levels)`: every embedding this adapter encodes or
    takes has that many columns (deepstack.py's layout), and its processor settings name the layout and the level
    count.
    """

    # Not a `VideoAdapter` (so the router refuses a video part at intake, before fetching it): a protocol method
    # set to None blocks `isinstance`, as typing documents. Qwen3-VL's timestamped frames are not built.
    video_tokens = None  # type: ignore[assignment]
    video_frame_plan = None  # type: ignore[assignment]
    preprocess_video = None  # type: ignore[assignment]

    def __init__(
        self, model_dir: Path | None, config: Any, tokenizer: Any | None, image_processor: Any | None, eos: list[int]
    ) -> None:
        super().__init__(model_dir, config, tokenizer, image_processor, eos)
        self.deepstack_levels: int = len(config.vision_config.deepstack_visual_indexes)
        self.embedding_width = self.hidden_size * (1 + self.deepstack_levels)

    def processor_settings(self) -> dict[str, Any]:
        """Qwen2-VL's settings plus the embedding layout and its DeepStack level count (both change what an item's
        embedding is, so they enter its hash)."""
        return {
            **super().processor_settings(),
            "embedding_layout": deepstack.LAYOUT,
            "deepstack_levels": self.deepstack_levels,
        }

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
        """None: Qwen3-VL's timestamped video layout is not built (images never need the settings)."""
        return None
