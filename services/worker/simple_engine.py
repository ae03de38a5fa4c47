"""A one-request-at-a-time reference engine with transformers' DynamicCache.

Walking-skeleton engine: same API as the paged engine (services/worker/engine), no batching,
no paged KV. Each `step` advances every ready request by one token (prefill counts as one
step). Invariant: a request's media positions are only computed once all of its embeddings
are present; `abort` drops everything the request holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from services.models.base import ModelAdapter, PlacedEmbedding, PlacedItem


@dataclass(frozen=True)
class MediaInput:
    mm_hash: str
    offset: int
    num_tokens: int
    grid_thw: tuple[int, ...]


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    token_ids: list[int]
    media: list[MediaInput]
    sampling: SamplingOptions
    cache_salt: str = ""


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    cached_tokens: int = 0


@dataclass(frozen=True)
class KVState:
    total_blocks: int
    free_blocks: int
    reserved_blocks: int
    running: int
    waiting: int
    block_size: int


@dataclass
class _Running:
    request: EngineRequest
    cache: DynamicCache | None = None
    rope_delta: int = 0
    output: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


class SimpleEngine:
    def __init__(self, adapter: ModelAdapter, model: torch.nn.Module) -> None:
        self._adapter = adapter
        self._model = model
        self._requests: dict[str, _Running] = {}
        self._embeddings: dict[str, torch.Tensor] = {}

    def add_request(self, request: EngineRequest) -> None:
        generator = None
        if request.sampling.seed is not None:
            generator = torch.Generator().manual_seed(request.sampling.seed)
        self._requests[request.request_id] = _Running(request, generator=generator)

    def provide_embedding(self, mm_hash: str, tensor: torch.Tensor) -> None:
        self._embeddings[mm_hash] = tensor

    def missing_embeddings(self, request_id: str) -> list[str]:
        running = self._requests.get(request_id)
        if running is None:
            return []
        return [m.mm_hash for m in running.request.media if m.mm_hash not in self._embeddings]

    def abort(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self._drop_unused_embeddings()

    def has_work(self) -> bool:
        return any(not self.missing_embeddings(rid) for rid in self._requests)

    def kv_state(self) -> KVState:
        waiting = sum(1 for r in self._requests.values() if r.cache is None)
        return KVState(0, 0, 0, len(self._requests) - waiting, waiting, 16)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        outputs = []
        for request_id in list(self._requests):
            running = self._requests[request_id]
            if self.missing_embeddings(request_id):
                continue
            logits = self._prefill(running) if running.cache is None else self._decode(running)
            token = self._sample(logits, running)
            running.output.append(token)
            reason = self._finish_reason(running, token)
            outputs.append(StepOutput(request_id, [token], reason is not None, reason))
            if reason is not None:
                del self._requests[request_id]
                self._drop_unused_embeddings()
        return outputs

    def _prefill(self, running: _Running) -> torch.Tensor:
        request, adapter = running.request, self._adapter
        ids = torch.tensor(request.token_ids, dtype=torch.long)
        placed = [PlacedEmbedding(m.offset, self._embeddings[m.mm_hash]) for m in request.media]
        embeds = adapter.embed_prompt(self._model, ids, placed)
        items = [PlacedItem(m.offset, tuple(m.grid_thw)) for m in request.media]
        positions = adapter.prompt_positions(self._model, request.token_ids, items)
        running.rope_delta = positions.rope_delta
        running.cache = DynamicCache()
        hidden = adapter.forward_hidden(self._model, embeds[None], positions.positions[:, None, :],
                                        past_key_values=running.cache, use_cache=True)
        return adapter.compute_logits(self._model, hidden[:, -1])[0]

    def _decode(self, running: _Running) -> torch.Tensor:
        adapter = self._adapter
        index = len(running.request.token_ids) + len(running.output) - 1
        ids = torch.tensor(running.output[-1:], dtype=torch.long)
        embeds = adapter.embed_prompt(self._model, ids, [])
        positions = adapter.decode_positions(index, 1, running.rope_delta)
        hidden = adapter.forward_hidden(self._model, embeds[None], positions[:, None, :],
                                        past_key_values=running.cache, use_cache=True)
        return adapter.compute_logits(self._model, hidden[:, -1])[0]

    @staticmethod
    def _sample(logits: torch.Tensor, running: _Running) -> int:
        sampling = running.request.sampling
        if sampling.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=running.generator))

    def _finish_reason(self, running: _Running, token: int) -> str | None:
        sampling = running.request.sampling
        if not sampling.ignore_eos and (token in self._adapter.eos_token_ids
                                        or token in sampling.stop_token_ids):
            return "stop"
        if len(running.output) >= sampling.max_tokens:
            return "length"
        return None

    def _drop_unused_embeddings(self) -> None:
        needed = {m.mm_hash for r in self._requests.values() for m in r.request.media}
        for mm_hash in [h for h in self._embeddings if h not in needed]:
            del self._embeddings[mm_hash]
