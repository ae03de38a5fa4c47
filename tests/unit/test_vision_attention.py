"""The vision tower's varlen attention on the CPU: equal to per-image SDPA, one call per layer, no device reads.

services/models/vision_attention.py through the pure-torch `varlen_attn` twin, for both families: equal to
transformers' per-image SDPA, one call per layer per batch, no device value read anywhere in the encode path,
routed to the vision sub-config only (composing with the worker's paged text attention).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers.utils.generic import is_flash_attention_requested

from services.common.model_info import load_model_info
from services.models import vision_attention
from services.models.base import PixelInputs
from services.models.vision_attention import (
    ATTENTION_NAME,
    choose_mode,
    install_vision_attention,
    varlen_vision_attention,
)
from services.models.vision_runner import VisionRunner
from tests import media_factory

FAMILIES = ["tiny_model_dir", "tiny_model_dir_25"]
# several sizes in one batch: tiny and large, wide and tall, one two-frame item (a video-like grid)
GRIDS = [(1, 16, 16), (1, 8, 20), (1, 4, 4), (1, 30, 12), (2, 8, 8), (1, 6, 22)]


def _loaded(request: pytest.FixtureRequest, fixture: str):
    info = load_model_info(request.getfixturevalue(fixture))
    return info.adapter, info.adapter.load_model()


def _items(seed: int = 0) -> list[PixelInputs]:
    gen = torch.Generator().manual_seed(seed)
    return [PixelInputs(torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=gen), (t, h, w)) for t, h, w in GRIDS]


class CountingReference:
    """Wraps `varlen_attn_reference`, recording each call's number of sequences and query rows."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self._inner = vision_attention.varlen_attn_reference

    def __call__(self, query, key, value, cu_seq_q, *args, **kwargs):
        self.calls.append((cu_seq_q.numel() - 1, query.shape[0]))
        return self._inner(query, key, value, cu_seq_q, *args, **kwargs)


@pytest.mark.parametrize("fixture", FAMILIES)
def test_varlen_equals_per_image_sdpa_with_one_call_per_layer(
    request: pytest.FixtureRequest, fixture: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter, model = _loaded(request, fixture)
    items = _items()
    expected = [e.clone() for e in adapter.encode(model, items)]  # transformers' per-image SDPA
    assert install_vision_attention(model, "varlen") == "varlen"
    counter = CountingReference()
    monkeypatch.setattr(vision_attention, "varlen_attn_reference", counter)
    got = adapter.encode(model, items)
    for index, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have.dtype == torch.float32 and have.shape == want.shape, index
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=f"item {index}")
    vision = model.config.vision_config
    assert len(counter.calls) == vision.depth  # one call per layer for the whole batch
    frames = sum(t for t, _, _ in GRIDS)
    patches = sum(t * h * w for t, h, w in GRIDS)
    assert all(rows == patches for _, rows in counter.calls)
    full_layers = getattr(vision, "fullatt_block_indexes", range(vision.depth))
    for layer, (sequences, _) in enumerate(counter.calls):
        if layer in full_layers:
            assert sequences == frames  # every frame of every item is one sequence
        else:
            assert sequences > frames  # Qwen2.5-VL's window layers: one sequence per window


@pytest.mark.parametrize("fixture", FAMILIES)
def test_the_varlen_encode_path_reads_no_device_value(request: pytest.FixtureRequest, fixture: str) -> None:
    """On the meta device any `.item()`/`.tolist()`/data-dependent op raises: the varlen path has none, while
    transformers' per-image path (its `lengths.tolist()` per layer) does."""
    adapter, model = _loaded(request, fixture)
    model.to("meta")
    items = _items()
    with pytest.raises(NotImplementedError, match="meta"):
        adapter.encode(model, items)
    install_vision_attention(model, "varlen")
    out = adapter.encode(model, items)
    assert [tuple(e.shape) for e in out] == [(t * h * w // 4, adapter.hidden_size) for t, h, w in GRIDS]
    assert all(e.device.type == "meta" for e in out)


@pytest.mark.parametrize("fixture", FAMILIES)
def test_runner_with_varlen_equals_the_default_runner_on_real_images(request: pytest.FixtureRequest, fixture) -> None:
    info = load_model_info(request.getfixturevalue(fixture))
    default = VisionRunner(info.adapter, info.adapter.load_model())
    varlen = VisionRunner(info.adapter, info.adapter.load_model(), attention="varlen")
    assert (default.attention, varlen.attention) == ("sdpa", "varlen")  # auto on the CPU keeps per-image SDPA
    sizes = [(64, 64), (200, 150), (40, 300), (333, 222), (90, 120)]
    images = [Image.fromarray(media_factory.pattern(w, h, seed=i), "RGB") for i, (w, h) in enumerate(sizes)]
    for want, have in zip(default.encode(images).embeddings, varlen.encode(images).embeddings, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)


def test_only_the_vision_config_is_routed_and_installs_compose(tiny_model_dir: Path) -> None:
    from services.worker.engine.attention.backend import ATTENTION_NAME as PAGED
    from services.worker.engine.attention.backend import install_paged_attention

    adapter = load_model_info(tiny_model_dir).adapter
    for order in ("paged first", "vision first"):
        model = adapter.load_model()
        top = model.config._attn_implementation
        if order == "paged first":
            install_paged_attention(model)
            install_vision_attention(model, "varlen")
        else:
            install_vision_attention(model, "varlen")
            install_paged_attention(model)
        config = model.config
        assert (config.text_config._attn_implementation, config.vision_config._attn_implementation) == (
            PAGED,
            ATTENTION_NAME,
        ), order
        assert model.model.visual.config._attn_implementation == ATTENTION_NAME
        assert model.model.language_model.config._attn_implementation == PAGED
        assert config._attn_implementation == top  # the top-level config is left alone
        assert install_vision_attention(model, "sdpa") == "sdpa"  # undoes the vision side only
        assert (config.text_config._attn_implementation, config.vision_config._attn_implementation) == (PAGED, "sdpa")


def test_a_flash_named_function_needs_no_flash_attn_package(tiny_model_dir: Path) -> None:
    """transformers takes the packed path for the name and does nothing else flash-specific: no flash_attn
    import (it is not installed here), no hub kernel, and the language model's attention is untouched."""
    assert importlib.util.find_spec("flash_attn") is None
    adapter = load_model_info(tiny_model_dir).adapter
    model = adapter.load_model()
    install_vision_attention(model, "varlen")
    assert "flash" in ATTENTION_NAME and ATTENTION_NAME.startswith("epd_")
    assert is_flash_attention_requested(model.config.vision_config)
    assert not is_flash_attention_requested(model.config.text_config)
    assert not is_flash_attention_requested(model.config)
    out = adapter.encode(model, _items()[:2])
    assert all(torch.isfinite(e).all() for e in out)


def test_a_model_is_built_first_and_routed_after(tiny_model_dir: Path) -> None:
    """The one flash-specific thing transformers does with the name: building a NEW model from a config that
    already carries it runs its flash import check, which fails at once (no kernel of that name; nothing is
    fetched: it is no hub repo). So the name is only ever set on a loaded model, as `install_vision_attention`
    does; it is not saved with the config."""
    model = load_model_info(tiny_model_dir).adapter.load_model()
    install_vision_attention(model, "varlen")
    assert ATTENTION_NAME not in str(model.config.to_dict())
    with pytest.raises(ValueError, match="flash attention implementation at `epd_flash_varlen_vision`"):
        type(model)._from_config(model.config)


def test_auto_takes_varlen_only_where_the_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert choose_mode("auto", cpu, torch.float32) == "sdpa"
    assert choose_mode("auto", cpu, torch.bfloat16) == "sdpa"
    assert choose_mode("varlen", cpu, torch.float32) == "varlen"
    assert choose_mode("sdpa", cuda, torch.bfloat16) == "sdpa"
    monkeypatch.setattr(
        vision_attention, "flash_supports", lambda device, dtype, paged=True: device.type == "cuda" and not paged
    )
    assert choose_mode("auto", cuda, torch.bfloat16) == "varlen"
    with pytest.raises(ValueError, match="vision attention mode"):
        choose_mode("flash", cpu, torch.float32)


def test_the_function_picks_the_kernel_by_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where `flash_supports` says so, torch's `varlen_attn` gets the call (non-causal, full window)."""
    seen: list[dict] = []

    def fake_kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        seen.append({"max": (max_q, max_k), "cu": cu_q.dtype, **kwargs})
        return torch.zeros_like(q)

    monkeypatch.setattr(vision_attention, "flash_supports", lambda device, dtype, paged=True: not paged)
    monkeypatch.setattr(vision_attention, "torch_varlen_attn", lambda paged=True: fake_kernel)
    q = torch.randn(1, 2, 10, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int64)
    out, weights = varlen_vision_attention(
        torch.nn.Module(), q, q, q, None, scaling=0.25, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6,
        max_length_k=6, is_causal=False,
    )  # fmt: skip
    assert out.shape == (1, 10, 2, 16) and weights is None
    assert seen == [{"max": (6, 6), "cu": torch.int32, "scale": 0.25, "window_size": (-1, -1)}]


def test_the_function_refuses_what_it_does_not_do() -> None:
    q = torch.randn(1, 2, 4, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        varlen_vision_attention(module, q, q, q, None)
    with pytest.raises(NotImplementedError):
        varlen_vision_attention(module, q, q, q, None, is_causal=True, cu_seq_lens_q=cu, max_length_q=4)
    with pytest.raises(NotImplementedError):
        varlen_vision_attention(module, q, q, q, torch.zeros(1, 1, 4, 4), cu_seq_lens_q=cu, max_length_q=4)
    with pytest.raises(ValueError, match="not a vision-language model"):
        install_vision_attention(SimpleNamespace(config=SimpleNamespace()))  # type: ignore[arg-type]
