"""The runner's batch result: embeddings stay on the device, one host copy per batch, what each transport gets.

services/models/vision_runner.py: the host copy is made once, on first use, whoever asks; pipeline outcomes and
`Pusher.device` decide whether a push is handed the device tensor or the host copy.
"""

from __future__ import annotations

import threading

import pytest
import torch

from services.common.transport_dist import NCCL_ENVIRONMENT
from services.common.transport_grpc import Embedding
from services.encoder.pipeline import ItemOutcome
from services.encoder.push import Channels, DistPush, Pusher
from services.models import vision_runner as runner_module
from services.models.vision_runner import ItemEmbedding, VisionOutput, VisionRunner, _joined, same_device


def _batch() -> tuple[torch.Tensor, list[torch.Tensor]]:
    merged = torch.randn(10, 4)
    return merged, list(merged.split([3, 0, 7]))


def test_the_host_copy_is_made_once_per_batch_whoever_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = runner_module._to_host
    monkeypatch.setattr(runner_module, "_to_host", lambda parts: calls.append(len(parts)) or real(parts))
    _, parts = _batch()
    output = VisionOutput(parts)
    items = output.items()
    threads = [threading.Thread(target=item.host) for item in items for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [3]
    for part, item in zip(parts, items, strict=True):
        assert item.tensor is not None and torch.equal(item.host(), part)
        assert item.host().is_contiguous()
    assert calls == [3]


def test_on_the_cpu_the_host_copy_is_the_tensor_itself() -> None:
    merged, parts = _batch()
    host = VisionOutput(parts).host()
    assert all(h.data_ptr() == p.data_ptr() for h, p in zip(host, parts, strict=True))


def test_joined_views_row_splits_whole_and_concatenates_anything_else() -> None:
    merged, parts = _batch()
    with torch.inference_mode():
        inference = torch.randn(6, 2)
        inference_parts = [p.detach() for p in inference.split([2, 4])]  # no `_base` under inference mode
    for whole, pieces in ((merged, parts), (inference, inference_parts)):
        joined = _joined(pieces)
        assert joined.data_ptr() == whole.data_ptr() and joined.shape == whole.shape and torch.equal(joined, whole)
    swapped = [merged[5:], merged[:5]]
    assert torch.equal(_joined(swapped), torch.cat(swapped)) and _joined(swapped).data_ptr() != merged.data_ptr()
    separate = [torch.randn(2, 4), torch.randn(3, 4)]
    assert torch.equal(_joined(separate), torch.cat(separate))


def test_an_item_goes_to_a_transport_from_where_it_lives() -> None:
    _, parts = _batch()
    item = VisionOutput(parts).items()[2]
    cpu = torch.device("cpu")
    assert item.for_device(cpu) is item.tensor  # made on the host: the tensor itself
    assert item.for_device(torch.device("cuda", 0)) is item.host()  # a GPU transport gets the host copy to move
    cached = ItemEmbedding.from_host(torch.ones(2, 4))
    assert cached.host() is cached.tensor and cached.for_device(cpu) is cached.tensor
    outcome = ItemOutcome("hash", item, "encoded")
    embedding = outcome.for_device(cpu)
    assert isinstance(embedding, Embedding) and embedding.mm_hash == "hash" and embedding.tensor is item.tensor


def test_same_device() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert same_device(cpu, torch.device("cpu")) and not same_device(cpu, meta)
    assert same_device(torch.device("cuda", 1), torch.device("cuda", 1))
    assert not same_device(torch.device("cuda", 0), cpu)


def test_pushes_are_handed_host_tensors_except_dist_over_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NCCL_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)  # a DistPush for nccl sets them: restored after the test
    channels = Channels()
    assert Pusher("grpc", None, channels).device == torch.device("cpu")
    gloo = DistPush(channels, "gloo", "127.0.0.1", timeout_s=1)
    assert Pusher("dist", gloo, channels).device == torch.device("cpu")
    nccl = DistPush(channels, "nccl", "127.0.0.1", timeout_s=1, device="cuda:0")
    assert Pusher("dist", nccl, channels).device == torch.device("cuda", 0)
    assert Pusher("grpc", nccl, channels).device == torch.device("cpu")


def test_runner_keeps_device_results_and_returns_host_ones(tiny_model_dir) -> None:
    from services.common.model_info import load_model_info
    from services.models.base import PixelInputs

    adapter = load_model_info(tiny_model_dir).adapter
    runner = VisionRunner(adapter, adapter.load_model())
    gen = torch.Generator().manual_seed(3)
    inputs = [PixelInputs(torch.randn(t * h * w, 1176, generator=gen), (t, h, w)) for t, h, w in [(1, 4, 8), (1, 6, 6)]]
    items = runner.encode_items(inputs)
    host = runner.encode_inputs(inputs)
    assert [tuple(i.tensor.shape) for i in items] == [(8, adapter.hidden_size), (9, adapter.hidden_size)]
    for item, tensor in zip(items, host, strict=True):
        assert torch.equal(item.host(), tensor) and tensor.device.type == "cpu" and tensor.is_contiguous()
