"""The attention backend interface, and the transformers attention function that hands each layer to the step's
backend.

The language model runs on one flattened row of all scheduled tokens. A backend chooses the KV layout,
appends its metadata to the step's packed ints (``lay_out``), and builds, once per step, a context whose
``attend`` each layer calls: write this step's K/V into the sequences' slots, then attend to each
sequence's context. Rows are decodes first, then chunks (services/worker/engine/step_input.py).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from services.worker.engine.attention.kv_cache import KVCache
from services.worker.engine.step_input import StepInput

ATTENTION_NAME = "epd_paged"
"""Registered with transformers; no ``sdpa``/``flash``/``flex`` in it (transformers dispatches on substrings)."""
CONTEXT_KWARG = "epd_attention"
"""The keyword the step context rides on through ``language_model(...)`` to every attention call."""


class StepContext(Protocol):
    """One step's attention, shared by all layers (tensors are views of the step's packed ints)."""

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Store ``key``/``value [Hkv, T, D]`` in layer ``layer``'s slots, attend ``query [H, T, D]``; ``[T, H, D]``."""
        ...


class AttentionBackend(Protocol):
    """A named way to run attention over paged KV.

    ``kv_layout`` names the ``KVCache`` layout it reads; ``supports_graphs`` is True when a decode-only step
    of a fixed shape has fixed metadata offsets (so it can be captured as a CUDA graph).
    """

    name: str
    block_size: int
    kv_layout: str
    supports_graphs: bool

    def lay_out(self, step: StepInput, table_width: int | None = None) -> None:
        """Append this backend's metadata for ``step.rows`` (and padding) to ``step.ints``; set ``step.layout``.

        ``table_width`` fixes the block-table width (graphs); None sizes it to the step.
        """
        ...

    def advance(self, step: StepInput, ints: np.ndarray, began: list[tuple[int, int, int]]) -> bool:
        """Advance this backend's metadata in ``ints`` (the packed ints of ``step``, a kept decode-only step laid out
        by ``lay_out``) by one token a row, each ``(row, index, block_id)`` of ``began`` a row whose new token
        starts block ``block_id`` at table index ``index``; False, with nothing written, when the layout cannot
        hold that (services/worker/engine/decode_batch.py lays the step out afresh then)."""
        ...

    def context(self, step: StepInput, packed: torch.Tensor, kv: KVCache) -> StepContext:
        """The step's context over ``packed`` (``step.ints`` on the device)."""
        ...


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, T, D]`` to ``(out [1, T, H, D], None)``.

    Without a step context (for example ``generate`` on the same model) it is plain SDPA.
    """
    ctx = kwargs.pop(CONTEXT_KWARG, None)
    if ctx is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if sliding_window is not None:
        raise NotImplementedError("paged attention does not support sliding-window layers")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = ctx.attend(module.layer_idx, query[0], key[0], value[0], scaling)  # type: ignore[attr-defined]
    return out.unsqueeze(0), None


def install_paged_attention(model: torch.nn.Module) -> None:
    """Register ``paged_attention`` and route the model's text config (only) to it.

    Other sub-configs (a vision tower) keep their implementation. The model stays usable without our
    context: ``paged_attention`` falls back to SDPA then.
    """
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    config = model.config
    text_config = config.get_text_config()
    if text_config is config:
        model.set_attn_implementation(ATTENTION_NAME)
        return
    mapping = {}
    for key in config.sub_configs:
        sub = getattr(config, key, None)
        if sub is not None:
            mapping[key] = ATTENTION_NAME if sub is text_config else sub._attn_implementation
    model.set_attn_implementation(mapping)
