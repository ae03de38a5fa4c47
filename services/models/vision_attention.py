"""The vision tower's attention as one varlen call per layer over the whole batch (`epd_flash_varlen_vision`).

Qwen2-VL / Qwen2.5-VL vision attention has two paths in transformers: when the vision config's attention
implementation NAME contains "flash" it calls the attention function once per layer over the packed batch
with ``cu_seq_lens_q/k`` and ``max_length_q/k``; otherwise it splits q/k/v per image (``lengths.tolist()``,
a host sync per layer) and calls the function once per image. `varlen_vision_attention` is registered with
transformers' `AttentionInterface` as ``epd_flash_varlen_vision`` so the packed path is taken. It runs
torch's FlashAttention `varlen_attn` (non-causal, window (-1, -1)) where that kernel can run
(`flash_supports`: CUDA, fp16/bf16) and the pure-torch `varlen_attn_reference` elsewhere.

Routing a loaded model's vision sub-config to the name needs no flash_attn package and makes transformers
do nothing else flash-specific (tested). The one exception: building a NEW model from a config that
already carries the name runs transformers' flash import check, which fails at once with ValueError (no
such kernel; it is no hub repo name, so nothing is fetched). So the name is set only on a loaded model,
by `install_vision_attention`; it is not saved with the config.

`install_vision_attention(model, mode)` chooses the path once, when a model is loaded for encoding:
``auto`` takes the varlen path where the kernel runs and otherwise keeps transformers' per-image SDPA
(exact on the CPU: a batch equals its items alone bit for bit); ``varlen`` forces it (CPU tests use the
reference); ``sdpa`` keeps transformers' own path. Only the vision sub-config is routed, so it composes
with the worker's `install_paged_attention` (text sub-config only) on the same model, in either order.
A tower without the packed path (LLaVA's CLIP: the adapter's `packed_vision_attention` is False) always keeps
transformers' attention: ``auto`` is ``sdpa`` there and ``varlen`` is refused.
"""

from __future__ import annotations

import logging

import torch
from transformers import AttentionInterface

from services.models.varlen_attention import flash_supports, torch_varlen_attn, varlen_attn_reference

log = logging.getLogger(__name__)

ATTENTION_NAME = "epd_flash_varlen_vision"
"""Contains "flash" (transformers dispatches its packed vision path on that substring), and is clearly ours."""
MODES = ("auto", "varlen", "sdpa")
VISION_KEY = "vision_config"


def varlen_vision_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: packed ``query [1, H, T, D]`` to ``(out [1, T, H, D], None)``.

    One kernel call for all sequences (``cu_seq_lens_q/k``, int32 on the device; ``max_length_q/k``, host
    ints). Reads no device value. Raises ValueError without sequence boundaries (only vision towers send
    them) and NotImplementedError for a mask, causal attention or dropout.
    """
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(f"{ATTENTION_NAME} needs cu_seq_lens_q and max_length_q (a vision tower's packed call)")
    if attention_mask is not None or is_causal or dropout:
        raise NotImplementedError(f"{ATTENTION_NAME} is non-causal, unmasked attention without dropout")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME} takes one packed row, got batch {query.shape[0]}")
    cu_k = cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
    max_k = max_length_q if max_length_k is None else max_length_k
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D], last dim contiguous: no copy
    fn = torch_varlen_attn(paged=False) if flash_supports(q.device, q.dtype, paged=False) else varlen_attn_reference
    out = fn(
        q, k, v, _int32(cu_seq_lens_q), _int32(cu_k), int(max_length_q), int(max_k),
        scale=scaling, window_size=(-1, -1),
    )  # fmt: skip
    return out.unsqueeze(0), None


def _int32(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)


def choose_mode(mode: str, device: torch.device, dtype: torch.dtype, packed: bool = True) -> str:
    """The path `mode` stands for on `device`/`dtype`: ``varlen`` or ``sdpa`` (``auto`` resolved).

    ``packed`` says whether the tower has transformers' packed path at all (the adapter's
    `packed_vision_attention`); without it ``auto`` is ``sdpa``. Raises ValueError for an unknown mode, and
    for ``varlen`` on a tower without the packed path.
    """
    if mode not in MODES:
        raise ValueError(f"vision attention mode {mode!r}; use one of {', '.join(MODES)}")
    if not packed:
        if mode == "varlen":
            raise ValueError("this model's vision tower has no packed varlen attention path; use auto or sdpa")
        return "sdpa"
    if mode == "auto":
        return "varlen" if flash_supports(device, dtype, paged=False) else "sdpa"
    return mode


def install_vision_attention(model: torch.nn.Module, mode: str = "auto", packed: bool = True) -> str:
    """Route the model's vision sub-config (only) to the path `mode` chooses; returns ``varlen`` or ``sdpa``.

    The other sub-configs keep their current implementation (a paged text attention installed before or
    after stays). ``sdpa`` undoes an earlier varlen install and otherwise leaves transformers' choice.
    ``packed`` is the adapter's `packed_vision_attention`: a tower without the packed path (LLaVA's CLIP)
    always keeps transformers' attention (see `choose_mode`).
    """
    vision = getattr(model.config, VISION_KEY, None)
    if vision is None:
        raise ValueError(f"{type(model).__name__} has no {VISION_KEY}: not a vision-language model")
    param = next(model.parameters())
    chosen = choose_mode(mode, param.device, param.dtype, packed)
    if chosen == "varlen":
        AttentionInterface.register(ATTENTION_NAME, varlen_vision_attention)
        model.set_attn_implementation({VISION_KEY: ATTENTION_NAME})
        kernel = (
            "torch varlen_attn" if flash_supports(param.device, param.dtype, paged=False) else "varlen_attn_reference"
        )
        log.info("vision attention: one %s call per layer per batch (%s, %s)", kernel, param.device, param.dtype)
    elif vision._attn_implementation == ATTENTION_NAME:
        model.set_attn_implementation({VISION_KEY: "sdpa"})
    return chosen
