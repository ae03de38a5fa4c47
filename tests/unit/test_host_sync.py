"""One device-to-host synchronisation per step: the sampled ids and any logprobs, through `HostDevice.to_host`
(or `argmax_to_host`, when every row is plain greedy).

On a GPU every host read of a device value (``tolist``, ``item``, ``bool(tensor)``, a boolean index, ...)
stalls the host until the device catches up. On the CPU nothing stalls, so the test watches for the
reads themselves: torch's function and dispatch modes see every such call made while a step runs, in our
code and in transformers'. Each step that samples must make exactly one, and it must be the counted one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import SamplingOptions
from tests.engine_support import build_prompt, image

HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "__array__"}
aten = torch.ops.aten
SYNCING_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.is_nonzero.default, aten.equal.default,
               aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default}  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class HostReads(TorchFunctionMode):
    """Records the tensor methods that read values back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


class SyncingOps(TorchDispatchMode):
    """Records ops that synchronise on a GPU: scalar reads, data-dependent shapes, boolean indexing."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        boolean_index = func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []) if i is not None
        )
        unsized_repeat = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if func in SYNCING_OPS or boolean_index or unsized_repeat:
            self.calls.append(str(func))
        return func(*args, **kwargs)


SAMPLINGS = [
    SamplingOptions(max_tokens=9),
    SamplingOptions(max_tokens=7, temperature=0.8, seed=3, ignore_eos=True),
    SamplingOptions(max_tokens=8, temperature=1.0, top_k=20, top_p=0.9, ignore_eos=True),
    SamplingOptions(max_tokens=6, temperature=0.7, top_p=0.5, seed=9),
    SamplingOptions(max_tokens=12, temperature=0.9, seed=5, n=3, logprobs=4, ignore_eos=True),  # logprobs rows
    SamplingOptions(max_tokens=10, logprobs=0, ignore_eos=True),
    SamplingOptions(max_tokens=8, temperature=0.9, seed=2, min_p=0.1, repetition_penalty=1.3, frequency_penalty=0.5,
                    presence_penalty=0.2, min_tokens=3, bad_words=((5,), (7, 9)), logit_bias=((11, 2.0),),
                    stop_token_ids=(13,)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("backend", "graphs"), [("flash-reference", "eager"), ("flash-reference", "off"), ("sdpa", "off")]
)
def test_one_host_read_per_sampling_step(loaded: tuple[Any, Any], backend: str, graphs: str) -> None:
    """Mixed steps (chunked prefill with images, decodes, greedy and seeded top-k/top-p rows, rows with logprobs
    and without, a request of three choices, a row with every logits processor and min-p), arrivals staggered."""
    adapter, model = loaded
    config = EngineConfig(kv_cache_bytes=4 << 20, attention_backend=backend, cuda_graphs=graphs, max_num_seqs=8,
                          max_num_batched_tokens=40, max_model_len=1024)  # fmt: skip
    engine = Engine(adapter, model, config)
    prompts = [
        build_prompt(adapter, model, ["a picture", image(112, 84, 1), "what is it?"]),
        build_prompt(adapter, model, ["tell me a story " * 4]),
        build_prompt(adapter, model, [image(56, 56, 2), "and", image(84, 56, 3), "compare"]),
        build_prompt(adapter, model, ["short"]),
        build_prompt(adapter, model, ["three answers about", image(84, 84, 4), "this picture, please " * 3]),
        build_prompt(adapter, model, ["greedy with the sampled token's logprob"]),
        build_prompt(adapter, model, ["penalties, bad words, a bias", image(56, 84, 5)]),
    ]
    for prompt in prompts:
        for mm_hash, tensor in prompt.embeddings.items():
            engine.provide_embedding(mm_hash, tensor)
    io = engine.runner.io
    sampling_steps = 0
    choices = set()
    arrivals = 2 * len(prompts)
    for step in range(200):
        if step < arrivals and step % 2 == 0:
            i = step // 2
            engine.add_request(prompts[i].request(f"r{i}", SAMPLINGS[i]))
        if step >= arrivals and not engine.has_work():
            break
        before = io.downloads
        reads, ops = HostReads(), SyncingOps()
        with reads, ops:
            outputs = engine.step()
        # the counted read: tolist, or numpy where every row is plain greedy (HostDevice.argmax_to_host on the CPU)
        allowed = (["tolist"], ["numpy"]) if outputs else ([],)
        assert reads.calls in allowed and ops.calls == [], f"step {step}: {reads.calls} {ops.calls}"
        assert io.downloads - before == len(reads.calls)
        for out in outputs:
            choices.add((out.request_id, out.index))
            asked = SAMPLINGS[int(out.request_id[1:])].logprobs
            assert (out.logprobs is None) == (asked is None)
            assert out.logprobs is None or [len(lp.top_ids) for lp in out.logprobs] == [asked]
        sampling_steps += bool(outputs)
    assert sampling_steps > 10 and not engine.requests
    assert {("r4", 0), ("r4", 1), ("r4", 2)} <= choices
    if graphs == "eager":
        assert engine.runner.graphs.steps > 0
