"""A llama-family language model's forward as direct calls on its own modules, taken only where a start-up probe
finds it bit-identical to transformers' forward.

transformers' decoder spends most of a small model's step in Python around the tensor math: a module call, keyword
plumbing and decorators per layer, per attention and per norm (the tiny test model's 16-row decode forward 0.70 ms,
this one 0.50 ms; the 256-wide 8-layer one 5.3 against 4.8 ms). `LeanDecoder` runs the same modules' math in the
same order (norms, projections, rotary, the step's attention, MLP, residuals), so its output is the same bits;
`LeanDecoder.probe` checks exactly that on random input before anyone uses it, and answers None for a model whose
layers compute anything else (another norm, a sliding window, an extra term), which then keeps transformers'
forward. Linear layers are called as modules, so tensor-parallel layers that replace them keep working; where the
q/k/v projections (or the MLP's gate and up) were packed as one product (`projection_groups`, models/packed_linear.py)
the lean forward calls that product once and splits its columns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from services.models.packed_linear import FusedGroup, PackedSlice

log = logging.getLogger(__name__)

try:
    from transformers.activations import SiLUActivation

    SILU_MODULES: tuple[type, ...] = (nn.SiLU, SiLUActivation)
except ImportError:  # a transformers release without it
    SILU_MODULES = (nn.SiLU,)
"""Activation modules that compute ``F.silu`` (the MLP then applies it in place; the probe checks the bits)."""

PROBE_TOKENS = 5
"""Rows of the probe's random input (several, so causality and the rotary's positions matter)."""


class StepAttention(Protocol):
    """The attention each layer calls: store ``key``/``value [Hkv, T, D]`` in layer ``layer``'s KV, attend
    ``query [H, T, D]``; returns ``[T, H, D]`` (the engine's step context has this method)."""

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor: ...


class LayerOps(Protocol):
    """How the lean forward computes a layer's elementwise parts, each the bits of transformers' formula."""

    def add_rms_norm(self, norm: Any, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden += residual`` in place when given, then ``norm``'s RMSNorm of ``hidden`` as a new tensor."""
        ...

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` as a new tensor."""
        ...


class _TorchOps:
    """`LayerOps` as torch calls: transformers' formulas, written to reuse the tensors they create."""

    def add_rms_norm(self, norm: Any, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return _rms_norm(norm, hidden if residual is None else hidden.add_(residual))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return _rotate(x, cos, sin)

    def __repr__(self) -> str:
        return "torch's norms and rotary"


TORCH_OPS: LayerOps = _TorchOps()


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's modules, read once (attribute lookups through nn.Module cost per step)."""

    index: int
    input_norm: nn.Module
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    head_dim: int
    scaling: float
    post_norm: nn.Module
    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act: Callable[[torch.Tensor], torch.Tensor]
    silu: bool
    """``act`` is SiLU: applied in place on the gate's fresh output."""
    qkv: nn.Module | None = None
    """The product q, k and v are columns of, in that order (`PackedSlice`), or None: three calls."""
    qkv_widths: tuple[int, ...] = ()
    gate_up: nn.Module | None = None
    """The product gate and up are columns of, in that order, or None: two calls."""
    gate_up_widths: tuple[int, ...] = ()


class LeanDecoder:
    """``decoder(inputs_embeds [1, T, H], position_ids [3, 1, T], attention) -> [1, T, H]``: the language model's
    last hidden states after its final norm, as its own forward computes them with ``attention`` in every layer.

    Invariant: built only by `probe`, which returns one only when its output equals transformers' bit for bit.
    """

    def __init__(
        self,
        language_model: nn.Module,
        layers: list[_Layer],
        positions: Callable[[torch.Tensor], torch.Tensor],
        ops: LayerOps,
    ) -> None:
        self.positions = positions
        self.ops = ops
        self.rotary = language_model.rotary_emb
        self.norm = language_model.norm
        self.layers = layers

    @classmethod
    def probe(
        cls,
        language_model: nn.Module,
        reference: Callable[[torch.Tensor, torch.Tensor, StepAttention], torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        positions: Callable[[torch.Tensor], torch.Tensor],
        ops: LayerOps | None = None,
    ) -> LeanDecoder | None:
        """A decoder over ``language_model`` when its forward equals ``reference(inputs_embeds, position_ids,
        attention)`` (transformers' forward as the engine calls it, on the engine's three position rows) exactly
        on random input with causal attention; None, logged, when its layers are not the shape this forward knows
        or the outputs differ. ``positions`` turns the engine's rows into what the model's rotary takes; ``ops``
        computes its norms and rotary (default `TORCH_OPS`, torch's formulas), so the probe checks them too."""
        layers = _read_layers(language_model)
        if layers is None:
            log.info("language model forward: transformers' (%s layers are not llama-shaped)",
                     type(language_model).__name__)  # fmt: skip
            return None
        decoder = cls(language_model, layers, positions, TORCH_OPS if ops is None else ops)
        width = int(language_model.norm.weight.shape[0])
        generator = torch.Generator().manual_seed(0)
        embeds = torch.randn(1, PROBE_TOKENS, width, generator=generator).to(device=device, dtype=dtype)
        steps = torch.arange(PROBE_TOKENS, device=device)
        positions = torch.stack([steps, 2 * steps, steps + 3]).view(3, 1, PROBE_TOKENS)  # three distinct axes
        attention = _CausalAttention()
        try:
            with torch.inference_mode():
                want = reference(embeds, positions, attention)
                got = decoder(embeds, positions, attention)
            same = want.shape == got.shape and bool(torch.equal(want, got))
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:  # shapes this forward does not take
            log.info("language model forward: transformers' (the lean forward failed its probe: %s)", exc)
            return None
        if not same:
            log.info("language model forward: not the lean one with %s (it differs from transformers' on the probe)",
                     decoder.ops)  # fmt: skip
            return None
        log.info("language model forward: lean, %s (bit-identical to transformers' on the probe)", decoder.ops)
        return decoder

    def __call__(
        self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attention: StepAttention
    ) -> torch.Tensor:
        ops = self.ops
        hidden = inputs_embeds
        batch, rows, _ = hidden.shape
        cos, sin = self.rotary(hidden, self.positions(position_ids))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x = ops.add_rms_norm(self.layers[0].input_norm, hidden)
        for i, layer in enumerate(self.layers):
            q, k, v = _attention_inputs(layer, x, cos, sin, ops)
            out = attention.attend(layer.index, q[0], k[0], v[0], layer.scaling).unsqueeze(0)
            attended = layer.o_proj(out.reshape(batch, rows, -1).contiguous())
            x = ops.add_rms_norm(layer.post_norm, attended, hidden)  # attended += hidden: the next residual
            hidden = attended
            if layer.gate_up is not None:  # out of place: the activation then reads strided columns only once
                gate, up = layer.gate_up(x).split(layer.gate_up_widths, dim=-1)
                gate = F.silu(gate) if layer.silu else layer.act(gate)
                mixed = layer.down_proj(gate.mul_(up))
            else:
                gate = layer.gate_proj(x)
                gate = F.silu(gate, inplace=True) if layer.silu else layer.act(gate)
                mixed = layer.down_proj(gate.mul_(layer.up_proj(x)))
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x = ops.add_rms_norm(following, mixed, hidden)
            hidden = mixed
        return x


def _attention_inputs(
    layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops: LayerOps
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's rotated queries and keys and its values, each ``[batch, heads, rows, head_dim]``. From one fused
    product without per-head norms, queries and keys rotate as one tensor of their heads side by side (the rotary
    is elementwise: the same bits as apart, in half the calls)."""
    batch, rows, _ = x.shape
    shape = (batch, rows, -1, layer.head_dim)
    if layer.qkv is not None and layer.q_norm is None:
        out = layer.qkv(x)
        q_width, k_width, _ = layer.qkv_widths
        qk = ops.rotate(out[..., : q_width + k_width].view(shape).transpose(1, 2), cos, sin)
        heads = q_width // layer.head_dim
        v = out[..., q_width + k_width :].view(shape).transpose(1, 2)
        return qk[:, :heads], qk[:, heads:], v
    if layer.qkv is not None:
        q, k, v = layer.qkv(x).split(layer.qkv_widths, dim=-1)
    else:
        q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    q, k = q.view(shape), k.view(shape)
    if layer.q_norm is not None:
        q, k = _rms_norm(layer.q_norm, q), _rms_norm(layer.k_norm, k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    return ops.rotate(q, cos, sin), ops.rotate(k, cos, sin), v.view(shape).transpose(1, 2)


def projection_groups(language_model: nn.Module) -> list[FusedGroup]:
    """The linear layers of a llama-shaped ``language_model`` that read one input, to pack as one product each:
    every layer's q/k/v projections and its MLP's gate and up (none where its layers are not llama-shaped)."""
    if _read_layers(language_model) is None:
        return []
    groups: list[FusedGroup] = []
    for layer in language_model.layers:
        groups.append((layer.self_attn, ("q_proj", "k_proj", "v_proj")))
        groups.append((layer.mlp, ("gate_proj", "up_proj")))
    return groups


def _fused(parts: list[nn.Module]) -> tuple[nn.Module | None, tuple[int, ...]]:
    """The product ``parts`` are consecutive columns of, from its first, and their widths; (None, ()) when they are
    anything else."""
    if not all(isinstance(p, PackedSlice) for p in parts):
        return None, ()
    whole, start = parts[0].fused, 0
    for part in parts:
        if part.fused is not whole or part.start != start:
            return None, ()
        start = part.stop
    if start != whole.out_features:
        return None, ()
    return whole, tuple(p.stop - p.start for p in parts)


def _read_layers(language_model: nn.Module) -> list[_Layer] | None:
    """Each layer's modules, or None when a layer lacks one this forward calls (or has a sliding window), or there
    is none."""
    for name in ("layers", "rotary_emb", "norm"):
        if getattr(language_model, name, None) is None:
            return None
    if len(language_model.layers) == 0:  # the forward reads its first layer's norm
        return None
    layers = []
    for i, layer in enumerate(language_model.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        needed = [(layer, ("input_layernorm", "post_attention_layernorm")),
                  (attn, ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx")),
                  (mlp, ("gate_proj", "up_proj", "down_proj", "act_fn"))]  # fmt: skip
        if any(owner is None or not all(hasattr(owner, n) for n in names) for owner, names in needed):
            return None
        if getattr(attn, "sliding_window", None) is not None or attn.layer_idx != i:
            return None
        norms = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
        if (norms[0] is None) != (norms[1] is None):
            return None
        modules = [layer.input_layernorm, layer.post_attention_layernorm, *[n for n in norms if n is not None]]
        if not all(hasattr(m, "weight") and hasattr(m, "variance_epsilon") for m in modules):
            return None
        layers.append(
            _Layer(
                index=i,
                input_norm=layer.input_layernorm,
                q_proj=attn.q_proj,
                k_proj=attn.k_proj,
                v_proj=attn.v_proj,
                o_proj=attn.o_proj,
                q_norm=norms[0],
                k_norm=norms[1],
                head_dim=int(attn.head_dim),
                scaling=float(attn.scaling),
                post_norm=layer.post_attention_layernorm,
                gate_proj=mlp.gate_proj,
                up_proj=mlp.up_proj,
                down_proj=mlp.down_proj,
                act=mlp.act_fn,
                silu=isinstance(mlp.act_fn, SILU_MODULES),
                qkv=(qkv := _fused([attn.q_proj, attn.k_proj, attn.v_proj]))[0],
                qkv_widths=qkv[1],
                gate_up=(gate_up := _fused([mlp.gate_proj, mlp.up_proj]))[0],
                gate_up_widths=gate_up[1],
            )
        )
    if not hasattr(language_model.norm, "variance_epsilon"):
        return None
    return layers


def _rms_norm(norm: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm as transformers computes it (float32 statistics, weight times the input-dtype result)."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)  # a new tensor: the multiplies below reuse it
    return hidden.mul_(norm.weight) if dtype == torch.float32 else norm.weight * hidden.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` as transformers computes it, the products written into the new
    tensors that hold them (floating-point sums and products are commutative: the same bits)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(rotated.mul_(sin))


class _CausalAttention:
    """The probe's attention: causal SDPA over this call's keys alone (no KV kept)."""

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(
            query[None], key[None], value[None], is_causal=True, scale=scaling, enable_gqa=True
        )
        return out[0].transpose(0, 1)
