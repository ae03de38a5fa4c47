"""The seeded continuation rule a router migration relies on: a request continued from prompt + the tokens
generated so far (remaining max_tokens) draws the same tokens as the undisturbed run, seeded or greedy."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions
from services.worker.engine.sampler import position_seed
from tests.engine_support import Prompt, Result, build_prompt, drain, image

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(loaded: tuple[Any, Any]) -> Engine:
    adapter, model = loaded
    return Engine(adapter, model, EngineConfig(kv_cache_bytes=8 << 20, max_num_batched_tokens=64, max_num_seqs=8))


def _run(engine: Engine, prompt: Prompt, request: EngineRequest) -> Result:
    for mm_hash, tensor in prompt.embeddings.items():
        engine.provide_embedding(mm_hash, tensor)
    engine.add_request(request)
    results: dict[str, Result] = {}
    drain(engine, results)
    return results[request.request_id]


def test_position_seed_depends_on_seed_and_position_only() -> None:
    assert position_seed(7, 100) == position_seed(7, 100)
    seeds = {position_seed(s, p) for s in (0, 1, 2**64 - 1) for p in range(50)}
    assert len(seeds) == 150 and all(0 <= s < 2**64 for s in seeds)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_continuation_from_generated_tokens_equals_the_undisturbed_run(loaded: tuple[Any, Any], temperature: float):
    adapter, model = loaded
    prompt = build_prompt(adapter, model, ["tell me about", image(120, 90, 41), "this picture"])
    sampling = SamplingOptions(max_tokens=20, temperature=temperature, top_p=0.95, seed=99, ignore_eos=True)
    whole = _run(_engine(loaded), prompt, prompt.request("whole", sampling))
    assert len(whole.tokens) == 20
    for cut in (1, 7, 19):  # a worker died after `cut` tokens: the next one gets prompt + those tokens
        continued = EngineRequest(
            f"cont{cut}",
            [*prompt.token_ids, *whole.tokens[:cut]],
            list(prompt.media),
            dataclasses.replace(sampling, max_tokens=20 - cut),
            generated_tokens=cut,
        )
        rest = _run(_engine(loaded), prompt, continued)
        assert whole.tokens[:cut] + rest.tokens == whole.tokens, f"cut at {cut}"


def test_generated_placeholder_ids_are_text_at_decode_positions(loaded: tuple[Any, Any]) -> None:
    """A model may generate a media placeholder's id; continued elsewhere, that token is text at its decode
    position (as in the undisturbed run), not a media token without an item."""
    adapter, model = loaded
    prompt = build_prompt(adapter, model, ["look", image(64, 48, 42), "and say"])
    tail = [adapter.image_token_id, 11, adapter.video_token_id]  # as if the model had generated them
    sampling = SamplingOptions(max_tokens=4, ignore_eos=True)
    whole = _engine(loaded)
    whole.add_request(prompt.request("whole", dataclasses.replace(sampling, max_tokens=len(tail) + 4)))
    continued = EngineRequest("cont", [*prompt.token_ids, *tail], list(prompt.media), sampling)
    engine = _engine(loaded)
    with pytest.raises(ValueError, match="tokens that no item covers"):  # without the count: refused
        engine.add_request(continued)
    engine.add_request(dataclasses.replace(continued, generated_tokens=len(tail)))
    [seq] = engine.requests["cont"]
    assert seq.positions == whole.requests["whole"][0].positions
    assert len(_run(engine, prompt, EngineRequest("other", prompt.token_ids, list(prompt.media), sampling)).tokens) == 4
