"""Prefill on one engine, decode on another: a remote prefill's KV blocks (every layer, after each chunk) written
into a second engine's pool and its decode equal to transformers' greedy `generate`; text and image prompts,
chunked prefill, both pools' layouts, prefix hits on the decode side, sampling and logprobs as one engine, aborts
in each state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.worker.engine import kv_connector
from services.worker.engine.engine import Engine
from services.worker.engine.kv_copy import block_dim
from services.worker.engine.request import KV_RECEIVE, KV_SEND, KVTransfer, SamplingOptions
from tests.engine_support import Prompt, Result, backend_config, collect, mixed_workload

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def workload(loaded: tuple[Any, Any], tiny_model_dir: Path) -> list[tuple[Prompt, int, list[int]]]:
    return mixed_workload(*loaded, tiny_model_dir)


def _pair(loaded: tuple[Any, Any], backend: str, budget: int) -> tuple[Engine, Engine]:
    adapter, model = loaded
    prefill = Engine(adapter, model, backend_config(backend, budget, caching=True))
    decode = Engine(adapter, model, backend_config(backend, 512, caching=True))
    assert prefill.kv_layout == decode.kv_layout
    return prefill, decode


def _submit(prefill: Engine, decode: Engine, request_id: str, prompt: Prompt, sampling: SamplingOptions) -> int:
    """Admit at the decode engine first (its reservation, its prefix hit), then queue the prefill; embeddings go to
    the prefill engine only. The blocks the decode side already held."""
    request = prompt.request(request_id, sampling)
    request.kv_transfer = KVTransfer(KV_RECEIVE)
    assert decode.admit(request)
    skip = decode.kv_connector.skip_blocks(request_id)
    sent = prompt.request(request_id, sampling)
    sent.kv_transfer = KVTransfer(KV_SEND, skip)
    prefill.add_request(sent)
    for mm_hash, tensor in prompt.embeddings.items():
        prefill.provide_embedding(mm_hash, tensor)
    return skip


def _run(prefill: Engine, decode: Engine, results: dict[str, Result], shipped: list[int] | None = None) -> None:
    """Step both until neither can progress, every chunk the prefill made handed to the decode engine."""
    for _ in range(100_000):
        if not (prefill.has_work() or decode.has_work()):
            return
        if prefill.has_work():
            for out in prefill.step():
                assert out.finish_reason == "kv_sent" and not out.new_token_ids
            for chunk in prefill.kv_connector.take():
                if shipped is not None:
                    shipped.append(chunk.keys.shape[1 + block_dim(prefill.runner.kv.layout)])
                decode.receive_kv(chunk)
        if decode.has_work():
            collect(decode.step(), results)
    raise AssertionError("engines did not finish")


def _all_free(*engines: Engine) -> None:
    for engine in engines:
        state = engine.kv_state()
        assert state.free_blocks == state.total_blocks and state.reserved_blocks == 0
        assert engine.embedding_stats().pinned == 0 and not engine.requests
        assert not engine.kv_connector.sending and not engine.kv_connector.receiving


CASES = [("sdpa", 16), ("kernel", 64), ("flashref16", 32), ("flashref256-graphs", 64)]


@pytest.mark.parametrize(("backend", "budget"), CASES, ids=[f"{b}-{n}" for b, n in CASES])
def test_prefill_there_decode_here_equals_generate(
    loaded: tuple[Any, Any], workload: list[tuple[Prompt, int, list[int]]], backend: str, budget: int
) -> None:
    """All 16 mixed prompts prefilled on engine A in chunks of ``budget`` tokens, decoded on B; then again, with B's
    prefix cache holding what the first round wrote in (so fewer blocks are shipped); every answer is generate's."""
    prefill, decode = _pair(loaded, backend, budget)
    widest: list[int] = []
    run = decode.runner.run

    def decode_run(chunks: list, embeddings: Any) -> Any:
        widest.append(max(c.num_tokens for c in chunks))
        return run(chunks, embeddings)

    decode.runner.run = decode_run  # type: ignore[method-assign]
    for round_ in range(2):
        results: dict[str, Result] = {}
        shipped: list[int] = []
        skips = [
            _submit(prefill, decode, f"r{round_}-{i}", prompt, SamplingOptions(max_tokens=max_tokens))
            for i, (prompt, max_tokens, _) in enumerate(workload)
        ]
        _run(prefill, decode, results, shipped)
        for i, (_, max_tokens, expected) in enumerate(workload):
            got = results[f"r{round_}-{i}"]
            assert got.tokens == expected, f"round {round_} request {i}"
            assert got.finish_reason == ("length" if len(expected) == max_tokens else "stop")
        if round_ == 0:
            assert sum(skips) == 0 and len(shipped) > len(workload)  # chunks after every prefill step
            first_round = sum(shipped)
        elif decode.config.block_size == 16:
            assert sum(skips) > 0 and sum(shipped) < first_round  # its prefix cache: those blocks never shipped
        _all_free(prefill, decode)
    assert widest and max(widest) == 1  # the decode engine never computed a prompt token: decodes only


def test_received_kv_is_written_a_piece_per_gap_while_sequences_decode(
    loaded: tuple[Any, Any], workload: list[tuple[Prompt, int, list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one block a piece and no time for writes between steps, a decode engine that decodes writes one piece of
    the arriving KV before each step (and all of it when idle): the answers are still generate's, every block
    comes back, and the KV of later requests really waited for the steps."""
    monkeypatch.setattr(kv_connector, "KV_PIECE_BYTES", 1)
    monkeypatch.setattr(kv_connector, "KV_WRITE_SHARE", 0.0)
    prefill, decode = _pair(loaded, "sdpa", 64)
    written: list[tuple[bool, int, int]] = []  # (paced, pieces written, pieces left)
    write = decode.kv_connector.write

    def counted(step_s: float | None) -> list:
        before = len(decode.kv_connector.queued)
        done = write(step_s)
        written.append((step_s is not None, before - len(decode.kv_connector.queued), len(decode.kv_connector.queued)))
        return done

    decode.kv_connector.write = counted  # type: ignore[method-assign]
    results: dict[str, Result] = {}
    for i, (prompt, max_tokens, _) in enumerate(workload):
        _submit(prefill, decode, f"p{i}", prompt, SamplingOptions(max_tokens=max_tokens))
    _run(prefill, decode, results)
    for i, (_, _, expected) in enumerate(workload):
        assert results[f"p{i}"].tokens == expected, i
    paced = [(n, left) for is_paced, n, left in written if is_paced]
    assert paced and all(n == 1 for n, _ in paced)
    assert any(left > 0 for _, left in paced)  # pieces waited for later gaps
    assert any(not is_paced and n > 1 for is_paced, n, _ in written)  # idle: everything at once
    _all_free(prefill, decode)


def test_sampling_and_logprobs_as_one_engine(
    loaded: tuple[Any, Any], workload: list[tuple[Prompt, int, list[int]]]
) -> None:
    """Seeded sampling with logprobs through the split: the same tokens as one engine doing both, and its logprobs (to
    float noise: the batches differ), next to requests the decode engine prefills itself (both kinds in one batch)."""
    sampling = SamplingOptions(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, logprobs=2, repetition_penalty=1.1)
    prompts = [prompt for prompt, _, _ in workload[:8]]
    alone = Engine(loaded[0], loaded[1], backend_config("sdpa", 32, caching=True))
    expected: dict[str, Result] = {}
    for i, prompt in enumerate(prompts):
        for mm_hash, tensor in prompt.embeddings.items():
            alone.provide_embedding(mm_hash, tensor)
        alone.add_request(prompt.request(f"s{i}", sampling))
    logprobs: dict[str, list] = {}
    while alone.has_work():
        for out in alone.step():
            logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
            collect([out], expected)
    prefill, decode = _pair(loaded, "sdpa", 32)
    results: dict[str, Result] = {}
    got_logprobs: dict[str, list] = {}
    for i, prompt in enumerate(prompts):
        if i % 2:
            _submit(prefill, decode, f"s{i}", prompt, sampling)
        else:  # prefilled locally by the decode engine
            for mm_hash, tensor in prompt.embeddings.items():
                decode.provide_embedding(mm_hash, tensor)
            decode.add_request(prompt.request(f"s{i}", sampling))
    step = decode.step  # a remote prefill's first token comes out of the step that wrote its last KV

    def decode_step() -> list:
        outs = step()
        for out in outs:
            got_logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
        return outs

    decode.step = decode_step  # type: ignore[method-assign]
    _run(prefill, decode, results)
    for i in range(len(prompts)):
        assert results[f"s{i}"].tokens == expected[f"s{i}"].tokens, i
        got, want = got_logprobs[f"s{i}"], logprobs[f"s{i}"]
        assert [g.top_ids for g in got] == [w.top_ids for w in want], i
        values = [(g.logprob, *g.top_logprobs, w.logprob, *w.top_logprobs) for g, w in zip(got, want, strict=True)]
        assert all(abs(v[k] - v[k + 3]) < 1e-4 for v in values for k in range(3)), i  # other batches: float noise
    _all_free(prefill, decode)


def test_aborts_in_every_state_free_everything(
    loaded: tuple[Any, Any], workload: list[tuple[Prompt, int, list[int]]]
) -> None:
    """Aborted while queued at the prefill engine, while prefilling (chunks shipped, the rest not), while its KV is
    half arrived at the decode engine (late chunks dropped), and while decoding: every block comes back on both sides,
    and an undisturbed request beside them still equals generate."""
    prefill, decode = _pair(loaded, "sdpa", 16)
    long_prompts = [(i, p) for i, (p, _, _) in enumerate(workload) if len(p.token_ids) > 64][:4]
    assert len(long_prompts) == 4
    results: dict[str, Result] = {}
    for i, prompt in long_prompts:
        _submit(prefill, decode, f"a{i}", prompt, SamplingOptions(max_tokens=8))
    keep, max_tokens, expected = workload[2]
    _submit(prefill, decode, "keep", keep, SamplingOptions(max_tokens=max_tokens))
    queued, prefilling, transferring, decoding = (f"a{i}" for i, _ in long_prompts)
    assert prefill.abort(queued) and decode.abort(queued)  # the router's cancel reaches both
    prefill.step()
    assert prefill.kv_connector.sends(prefill.requests[prefilling][0])
    late = prefill.kv_connector.take()
    assert prefill.abort(prefilling) and decode.abort(prefilling)
    for chunk in late:
        decode.receive_kv(chunk)  # arrives after the abort: dropped (below: every block comes back)
    for _ in range(200):  # until `transferring` has part of its KV at the decode engine
        prefill.step()
        chunks = prefill.kv_connector.take()
        for chunk in chunks:
            decode.receive_kv(chunk)
        if decode.has_work():  # a step writes what arrived
            collect(decode.step(), results)
        seq = decode.kv_connector.receiving.get(transferring)
        if seq is not None and seq.num_computed_tokens > 0:
            break
    assert decode.abort(transferring) and prefill.abort(transferring)  # the decode side gave up first
    for _ in range(500):  # until `decoding` has decoded a token past its first
        if prefill.has_work():
            prefill.step()
        for chunk in prefill.kv_connector.take():
            decode.receive_kv(chunk)
        collect(decode.step(), results)
        if len(results.get(decoding, Result()).tokens) >= 2:
            break
    assert not prefill.abort(decoding) and decode.abort(decoding)  # only the decode engine still holds it
    _run(prefill, decode, results)
    assert len(results[decoding].tokens) < 8
    assert results["keep"].tokens == expected
    _all_free(prefill, decode)
