"""The encoder's batcher, admission accounting and batched-vs-alone exactness of the vision tower."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from services.encoder.batcher import Batcher, BatcherClosed, BatchItem, BatchStats


class FakeTower:
    """Records each call's items; the embedding of an item is a tensor holding its value."""

    def __init__(self, fail_on: object = None, delay_s: float = 0.0) -> None:
        self.calls: list[list[object]] = []
        self.fail_on = fail_on
        self.delay_s = delay_s
        self.threads: set[str] = set()

    def __call__(self, inputs: list[object]) -> Sequence[torch.Tensor]:
        self.calls.append(list(inputs))
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        if self.fail_on in inputs:
            raise RuntimeError(f"bad item {self.fail_on}")
        return [torch.tensor([float(hash(v) % 1000)]) for v in inputs]


def run(coro):
    return asyncio.run(coro)


async def _submit_all(batcher: Batcher, tokens: list[int], names: list[str] | None = None):
    names = names or [f"h{i}" for i in range(len(tokens))]
    return [batcher.submit(BatchItem(name, t, name)) for name, t in zip(names, tokens, strict=True)]


def test_items_from_many_submitters_share_one_call_within_budget() -> None:
    async def go() -> list[list[object]]:
        tower = FakeTower()
        batcher = Batcher(tower, max_tokens=100, max_wait_s=0.05)
        batcher.start()
        futures = await _submit_all(batcher, [10, 20, 30, 40])
        await asyncio.gather(*futures)
        assert {name for name in tower.threads} and all(n.startswith("vision-tower") for n in tower.threads)
        await batcher.close()
        return tower.calls

    assert run(go()) == [["h0", "h1", "h2", "h3"]]


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ([6, 6, 6], [["h0"], ["h1"], ["h2"]]),
        ([3, 3, 3, 3], [["h0", "h1", "h2"], ["h3"]]),
        ([4, 25, 4], [["h0"], ["h1"], ["h2"]]),  # the oversized item runs alone, nobody overtakes it
        ([25], [["h0"]]),
    ],
)
def test_budget_splits_batches_in_order_and_oversized_items_run_alone(tokens: list[int], expected) -> None:
    async def go() -> tuple[list[list[object]], list[BatchStats]]:
        tower, stats = FakeTower(), []
        batcher = Batcher(tower, max_tokens=10, max_wait_s=0.05, on_batch=stats.append)
        batcher.start()
        await asyncio.gather(*await _submit_all(batcher, tokens))
        await batcher.close()
        return tower.calls, stats

    calls, stats = run(go())
    assert calls == expected
    for call, stat in zip(calls, stats, strict=True):
        assert stat.items == len(call) and stat.ok
        assert stat.tokens <= 10 or stat.items == 1


def test_a_full_budget_leaves_at_once_and_a_partial_one_after_the_wait() -> None:
    async def go() -> tuple[list[list[object]], float]:
        tower = FakeTower()
        patient = Batcher(tower, max_tokens=10, max_wait_s=3600.0)
        patient.start()
        # A full budget does not wait: with an hour's wait, it is encoded all the same.
        await asyncio.wait_for(asyncio.gather(*await _submit_all(patient, [5, 5])), 30)
        await patient.close()
        batcher = Batcher(FakeTower(), max_tokens=10, max_wait_s=0.3)
        batcher.start()
        start = time.perf_counter()
        await asyncio.gather(*await _submit_all(batcher, [5], ["x"]))
        partial = time.perf_counter() - start
        await batcher.close()
        return tower.calls, partial

    full_calls, partial = run(go())
    assert full_calls == [["h0", "h1"]]
    assert 0.25 <= partial < 30  # held for the wait, never sooner; only a hang misses the upper bound


def test_same_hash_in_flight_is_encoded_once() -> None:
    async def go() -> FakeTower:
        tower = FakeTower(delay_s=0.05)
        batcher = Batcher(tower, max_tokens=100, max_wait_s=0.01)
        batcher.start()
        first = batcher.submit(BatchItem("same", 5, "a"))
        await asyncio.sleep(0.02)  # now running
        second = batcher.submit(BatchItem("same", 5, "a"))
        queued = batcher.submit(BatchItem("other", 5, "b"))
        again = batcher.submit(BatchItem("other", 5, "b"))
        assert second is first and again is queued
        results = await asyncio.gather(first, second, queued, again)
        assert torch.equal(results[0], results[1]) and torch.equal(results[2], results[3])
        later = await batcher.submit(BatchItem("same", 5, "a"))  # finished: a new submit encodes again
        assert torch.equal(later, results[0])
        await batcher.close()
        return tower

    tower = run(go())
    assert sum(call.count("a") for call in tower.calls) == 2
    assert sum(call.count("b") for call in tower.calls) == 1


def test_a_bad_item_fails_alone() -> None:
    async def go() -> tuple[list, FakeTower, list[BatchStats]]:
        tower, stats = FakeTower(fail_on="h1"), []
        batcher = Batcher(tower, max_tokens=100, max_wait_s=0.05, on_batch=stats.append)
        batcher.start()
        futures = await _submit_all(batcher, [1, 1, 1])
        results = await asyncio.gather(*futures, return_exceptions=True)
        await batcher.close()
        return results, tower, stats

    results, tower, stats = run(go())
    assert isinstance(results[1], RuntimeError) and "bad item h1" in str(results[1])
    assert isinstance(results[0], torch.Tensor) and isinstance(results[2], torch.Tensor)
    assert tower.calls == [["h0", "h1", "h2"], ["h0"], ["h1"], ["h2"]]
    assert [s.ok for s in stats] == [False, True, False, True]


def test_token_accounting_and_close_fails_what_is_left() -> None:
    async def go() -> None:
        tower = FakeTower(delay_s=0.2)
        batcher = Batcher(tower, max_tokens=10, max_wait_s=0.0)
        batcher.start()
        futures = await _submit_all(batcher, [8, 7, 6])
        await asyncio.sleep(0.05)
        assert (batcher.running_tokens, batcher.queued_tokens, batcher.queued_items) == (8, 13, 2)
        await batcher.close()
        for future in futures:
            with pytest.raises(BatcherClosed):
                await future
        assert (batcher.running_tokens, batcher.queued_tokens, batcher.queued_items) == (0, 0, 0)
        with pytest.raises(BatcherClosed):
            batcher.submit(BatchItem("late", 1, "late"))

    run(go())


def test_batcher_validates() -> None:
    with pytest.raises(ValueError):
        Batcher(FakeTower(), max_tokens=0, max_wait_s=0.0)
    with pytest.raises(ValueError):
        Batcher(FakeTower(), max_tokens=1, max_wait_s=-1.0)


# --- the real vision tower -------------------------------------------------------------------------


def test_eight_images_in_one_call_equal_each_alone(tiny_model_dir: Path) -> None:
    from PIL import Image

    from services.common.model_info import load_model_info
    from services.models.vision_runner import VisionRunner
    from tests import media_factory

    info = load_model_info(tiny_model_dir)
    runner = VisionRunner(info.adapter, info.adapter.load_model())
    sizes = [(64, 64), (200, 150), (40, 300), (333, 222), (128, 96), (90, 120), (500, 60), (224, 224)]
    images = [Image.fromarray(media_factory.pattern(w, h, seed=i), "RGB") for i, (w, h) in enumerate(sizes)]
    batched = runner.encode(images).embeddings
    for image, together in zip(images, batched, strict=True):
        alone = runner.encode([image]).embeddings[0]
        assert together.dtype == torch.float32 and together.shape == alone.shape
        assert (together - alone).abs().max().item() <= 1e-5


# --- video: split across tower calls ---------------------------------------------------------------


def test_temporal_chunks_cover_the_video_within_half_the_budget() -> None:
    from services.encoder.video_items import temporal_chunks

    assert temporal_chunks((20, 16, 28), 20 * 112, 16384) == [(0, 20)]
    chunks = temporal_chunks((20, 16, 28), 20 * 112, 1000)  # 112 tokens a step: 4 steps in 500 tokens
    assert chunks == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20)]
    assert temporal_chunks((3, 80, 80), 3 * 1600, 1000) == [(0, 1), (1, 2), (2, 3)]  # one step over budget


def test_a_long_video_does_not_starve_an_image() -> None:
    """The video's chunks go one at a time, so an image submitted while the first runs rides in the second
    call, not after the whole video; the chunks' rows come back whole and in order."""
    from services.encoder.video_items import encode_video
    from services.models.base import PixelInputs
    from services.models.vision_runner import VisionOutput

    calls: list[list[object]] = []

    def tower(inputs: list[object]) -> list:
        calls.append([i.grid_thw[0] if isinstance(i, PixelInputs) else i for i in inputs])
        time.sleep(0.02)
        rows = [i.pixel_values[:, :1].clone() if isinstance(i, PixelInputs) else torch.zeros(1, 1) for i in inputs]
        return VisionOutput(rows).items()

    async def go() -> torch.Tensor:
        batcher = Batcher(tower, max_tokens=20, max_wait_s=0.001)  # chunks of 2 steps (8 tokens): 6 of them
        batcher.start()
        rows = torch.arange(12 * 16, dtype=torch.float32)[:, None].expand(-1, 4).contiguous()
        video = asyncio.ensure_future(encode_video(batcher, "v", PixelInputs(rows, (12, 4, 4)), 12 * 4))
        while not calls:  # until the first chunk is in the tower (it stays 20 ms)
            await asyncio.sleep(0.001)
        image = batcher.submit(BatchItem("img", 10, "image"))
        embedding, _ = await asyncio.gather(video, image)
        await batcher.close()
        return embedding.host()

    embedding = run(go())
    with_image = [index for index, call in enumerate(calls) if "image" in call]
    assert with_image == [1], calls  # right after the first chunk, alone or with the second
    assert sum(step for call in calls for step in call if step != "image") == 12 and calls[0] == [2], calls
    assert torch.equal(embedding[:, 0], torch.arange(12 * 16, dtype=torch.float32))  # every row, in order


def test_a_video_split_across_calls_equals_it_whole(
    tiny_model_dir: Path, tiny_model_dir_25: Path, tiny_qwen3_vl_dir: Path
) -> None:
    """The towers attend within a temporal patch (Qwen3-VL's also interpolates its position grid per patch): chunks of
    patches give the whole video's rows (Qwen3-VL's with their DeepStack levels)."""
    from services.common.media_types import VideoLimits
    from services.common.model_info import load_model_info
    from services.common.video import probe_video
    from services.encoder.video_decode import decode_video
    from services.encoder.video_items import encode_video
    from services.models.vision_runner import VisionRunner
    from tests import media_factory

    data = media_factory.video(97, 61, seconds=4, fps=10, seed=7)
    header = probe_video(data, VideoLimits())
    for folder in (tiny_model_dir, tiny_model_dir_25, tiny_qwen3_vl_dir):
        adapter = load_model_info(folder).adapter
        runner = VisionRunner(adapter, adapter.load_model())
        tokens = adapter.video_tokens(header.width, header.height, header.frames, header.fps)
        frames, _ = decode_video(
            data, adapter.video_frame_plan(tokens.grid_thw, tokens.frame_indices), VideoLimits(), 30
        )
        inputs = adapter.preprocess_video(frames, tokens.grid_thw)
        whole = runner.encode_inputs([inputs])[0]

        async def split(runner=runner, inputs=inputs, tokens=tokens.num_tokens, steps=tokens.grid_thw[0]):
            batcher = Batcher(runner.encode_items, max_tokens=2 * tokens // steps, max_wait_s=0)  # 1 step a call
            batcher.start()
            embedding = await encode_video(batcher, "v", inputs, tokens)
            await batcher.close()
            return embedding.host()

        assert tokens.grid_thw[0] == 4 and whole.shape[1] == adapter.embedding_width
        assert (run(split()) - whole).abs().max().item() <= 1e-5
