"""Host-planned vision tower inputs: the plan's numbers, one-copy staging, `encode` equal to transformers' own.

services/models/qwen2_vl_vision.py, for both families: the adapter's `encode` equals `get_image_features` bit for
bit (SDPA), and its items are row views of one merged output.
"""

from __future__ import annotations

import pytest
import torch

from services.common.model_info import load_model_info
from services.models.base import PixelInputs
from services.models.qwen2_vl_vision import (
    plan_vision,
    run_vision_tower,
    stage,
    stage_ints,
    time_tower,
    tower_takes_plan,
)

GRIDS = [(1, 16, 16), (1, 8, 20), (1, 4, 4), (2, 8, 8)]
_CPU = torch.device("cpu")


def _items(grids=GRIDS, seed: int = 1) -> list[PixelInputs]:
    gen = torch.Generator().manual_seed(seed)
    return [PixelInputs(torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=gen), (t, h, w)) for t, h, w in grids]


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_model_dir_25"])
def test_encode_equals_get_image_features_bit_for_bit(request: pytest.FixtureRequest, fixture: str) -> None:
    adapter = load_model_info(request.getfixturevalue(fixture)).adapter
    model = adapter.load_model()
    items = _items()
    with torch.no_grad():
        pixels = torch.cat([item.pixel_values for item in items])
        expected = model.model.get_image_features(pixels, torch.tensor(GRIDS)).pooler_output
    got = adapter.encode(model, items)
    assert len(got) == len(expected)
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(have, want)
    # the items are row views of one merged output, in order (one device-to-host copy can take them all)
    first = got[0]
    offsets = [e.storage_offset() for e in got]
    assert all(e.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for e in got)
    assert offsets == [sum(g.numel() for g in got[:i]) + first.storage_offset() for i in range(len(got))]


def test_plan_for_qwen2_vl(tiny_model_dir) -> None:
    vision = load_model_info(tiny_model_dir).adapter.config.vision_config
    plan = plan_vision(GRIDS, vision)
    assert plan.rows == [64, 40, 4, 32]
    assert plan.cu_seqlens.tolist() == [0, 256, 416, 432, 496, 560]  # one sequence per frame
    assert plan.cu_seqlens.dtype == torch.int32 and plan.max_seqlen == 256
    assert plan.position_ids.shape == (560, 2) and plan.patches == 560
    # block-major within 2x2 merge blocks: (0,0) (0,1) (1,0) (1,1) (0,2) ...
    assert plan.position_ids[:5].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2]]
    assert plan.window_index is None and "window_index" not in plan.tower_kwargs(stage_ints(plan.int_tensors(), _CPU))


def test_plan_for_qwen2_5_vl_has_windows(tiny_model_dir_25) -> None:
    vision = load_model_info(tiny_model_dir_25).adapter.config.vision_config
    plan = plan_vision([(1, 16, 16)], vision)  # window 112 px = 4 merged units = 8 patches a side
    assert plan.window_index is not None and plan.cu_window_seqlens is not None
    assert plan.window_index.shape == (64,) and sorted(plan.window_index.tolist()) == list(range(64))
    assert plan.cu_window_seqlens.tolist() == [64 * i for i in range(5)] and plan.max_window_seqlen == 64
    kwargs = plan.tower_kwargs(stage_ints(plan.int_tensors(), _CPU))
    assert kwargs["window_index"].dtype == torch.long and kwargs["max_window_seqlen"] == 64
    assert kwargs["max_seqlen"] == 256 and torch.equal(kwargs["cu_seqlens"], plan.cu_seqlens)


def test_plan_refuses_bad_grids(tiny_model_dir) -> None:
    vision = load_model_info(tiny_model_dir).adapter.config.vision_config
    with pytest.raises(ValueError, match="at least one"):
        plan_vision([], vision)
    with pytest.raises(ValueError, match="spatial merge"):
        plan_vision([(1, 5, 4)], vision)


def test_stage_concatenates_and_casts_in_one_pass() -> None:
    parts = [torch.randn(3, 4), torch.randn(0, 4), torch.randn(5, 4)]
    out = stage(parts, torch.bfloat16, _CPU)
    assert out.dtype == torch.bfloat16 and out.shape == (8, 4)
    assert torch.equal(out, torch.cat(parts).to(torch.bfloat16))
    ints = [torch.arange(6).view(3, 2), torch.tensor([0, 3, 7], dtype=torch.int32)]
    staged = stage_ints(ints, _CPU)
    assert [tuple(t.shape) for t in staged] == [(3, 2), (3,)] and all(t.dtype == torch.int32 for t in staged)
    assert staged[0].tolist() == ints[0].tolist() and staged[1].tolist() == [0, 3, 7]
    assert staged[0].untyped_storage().data_ptr() == staged[1].untyped_storage().data_ptr()  # one buffer, one copy


def test_run_vision_tower_checks_pixels_against_the_plan(tiny_model_dir) -> None:
    adapter = load_model_info(tiny_model_dir).adapter
    model = adapter.load_model()
    items = _items(GRIDS[:2])
    plan = plan_vision(GRIDS[:1], model.config.vision_config)
    with pytest.raises(ValueError, match="planned patches"):
        run_vision_tower(model.model.visual, [item.pixel_values for item in items], plan)


def test_encode_without_vision_utils_falls_back_to_the_towers_own_planning(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older transformers (a GPU machine's) has no `vision_utils`, or a tower that derives its inputs itself:
    known from the code before any call, and `encode` lets the tower plan, with the same numbers."""
    from services.models import qwen2_vl_vision
    from services.models.qwen2_vl import Qwen2VLAdapter

    adapter = Qwen2VLAdapter.from_folder(tiny_model_dir)
    model = adapter.load_model()
    items = _items()
    assert tower_takes_plan(type(model.model.visual))
    planned = adapter.encode(model, items)

    class OwnPlanning(type(model.model.visual)):  # defined where no vision_utils helper is imported
        pass

    assert not tower_takes_plan(OwnPlanning)
    monkeypatch.setattr(qwen2_vl_vision, "vision_utils", None)
    assert not tower_takes_plan(type(model.model.visual))
    unplanned = adapter.encode(model, items)
    for a, b in zip(planned, unplanned, strict=True):
        assert torch.equal(a, b)


def test_an_error_inside_the_tower_surfaces(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """A TypeError raised once by the vision attention reaches the caller, and the next batch is planned again.
    (It was once taken for the tower refusing the planned inputs: the batch silently re-ran unplanned, and
    planning stayed off for good.)"""
    from services.models import qwen2_vl
    from services.models.qwen2_vl import Qwen2VLAdapter

    adapter = Qwen2VLAdapter.from_folder(tiny_model_dir)
    model = adapter.load_model()
    attention = type(model.model.visual.blocks[0].attn)
    original = attention.forward
    failures = [TypeError("attention got an unexpected keyword argument 'window'")]

    def fails_once(self, *args, **kwargs):
        if failures:
            raise failures.pop()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(attention, "forward", fails_once)
    with pytest.raises(TypeError, match="unexpected keyword argument 'window'"):
        adapter.encode(model, _items(GRIDS[:1]))
    planned_calls = []
    calling = qwen2_vl.call_tower
    monkeypatch.setattr(qwen2_vl, "call_tower", lambda *a: planned_calls.append(1) or calling(*a))
    assert len(adapter.encode(model, _items(GRIDS[:1]))) == 1 and planned_calls == [1]


def test_the_tower_timer_times_the_tower_alone(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """`staged_tower` stages once, before anything is timed; `time_tower` then runs only tower calls (what the GPU
    check's images/s divides by), none of which stages pixels again."""
    from services.models import qwen2_vl, qwen2_vl_vision

    adapter = load_model_info(tiny_model_dir).adapter
    model = adapter.load_model()
    events: list[str] = []
    staging = qwen2_vl_vision.stage
    for module in (qwen2_vl, qwen2_vl_vision):
        monkeypatch.setattr(module, "stage", lambda *a, **k: events.append("stage") or staging(*a, **k))
    model.model.visual.register_forward_hook(lambda *_: events.append("tower"))
    call = adapter.staged_tower(model, _items(GRIDS[:2]))
    staged = list(events)
    seconds = time_tower(call, torch.device("cpu"), 3)
    assert staged == ["stage", "stage"]  # pixels, then the plan's integers
    assert events[len(staged) :] == ["tower"] * 3 and isinstance(seconds, float)
