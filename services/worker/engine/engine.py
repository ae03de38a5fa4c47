"""The worker engine: requests in, tokens out, one step at a time (not thread-safe by itself)."""

from __future__ import annotations

from typing import Any

import torch

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.config import EngineConfig
from services.worker.engine.embeddings import EmbeddingPool, EmbeddingStats
from services.worker.engine.model_runner import ModelRunner
from services.worker.engine.request import EngineRequest, KVState, MediaInput, StepOutput
from services.worker.engine.sampler import Sampler
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import Sequence


class Engine:
    """Continuous batching over paged KV for one model.

    Invariant: ``requests`` holds exactly the live sequences (waiting or running in the scheduler);
    each holds one reference in the embedding pool per media item, and a reservation in the ledger
    once admitted. Finishing or aborting a request gives all of it back. Call everything from one thread.
    """

    def __init__(self, adapter: Any, model: torch.nn.Module, config: EngineConfig) -> None:
        self.adapter = adapter
        self.runner = ModelRunner(adapter, model, config)
        self.config = config = self.runner.config  # automatic settings resolved (backend, block size, KV bytes)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.embeddings = EmbeddingPool(config.embedding_buffer_bytes, config.torch_dtype, self.runner.io)
        self.scheduler = Scheduler(config, self.block_manager, self.embeddings)
        self.sampler = Sampler(config.seed, self.runner.io)
        self.eos_token_ids = frozenset(adapter.eos_token_ids)
        self.max_model_len = self.runner.max_model_len
        self.requests: dict[str, Sequence] = {}
        self._stalled = False  # the last step scheduled nothing and nothing has changed since

    def bind_thread(self) -> None:
        """Call first on the thread that will run the engine: it makes the engine's CUDA device that thread's
        current device (streams, events and graph replays use the current device)."""
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)

    # ----- reservations (the router's admission) -----

    def can_reserve(self, projected_tokens: int) -> bool:
        ledger = self.scheduler.ledger
        return ledger.can_reserve(ledger.blocks_for(projected_tokens))

    def reserve(self, request_id: str, projected_tokens: int) -> bool:
        """Promise the blocks for ``projected_tokens`` to a request that ``add_request`` brings later."""
        if request_id in self.requests:
            return False
        ledger = self.scheduler.ledger
        return ledger.reserve(request_id, ledger.blocks_for(projected_tokens))

    def release(self, request_id: str) -> None:
        """Drop a reservation whose request never came (a live request's is dropped when it ends)."""
        if request_id not in self.requests:
            self.scheduler.ledger.release(request_id)
            self._stalled = False

    # ----- requests -----

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises ValueError when it is malformed or could never fit this worker."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already running")
        seq = Sequence(request, self.config.block_size, self.config.enable_prefix_caching)
        self._validate(seq)
        self.runner.prepare(seq)
        for item in seq.media:
            known = self.embeddings.peek(item.mm_hash)
            if known is not None:
                _check_rows(item, seq.request_id, known)
        if seq.sampling.seed is not None:
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(seq.sampling.seed)
        ledger = self.scheduler.ledger
        if request.request_id in ledger and not ledger.reserve(request.request_id, seq.max_num_blocks):
            ledger.release(request.request_id)  # the scheduler reserves the real size when it can
        self.embeddings.acquire([m.mm_hash for m in seq.media])
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self._stalled = False

    def provide_embedding(self, mm_hash: str, tensor: torch.Tensor) -> None:
        """An item's embedding ``[num_tokens, hidden]`` arrived; before or after its requests."""
        for seq in self.requests.values():
            for item in seq.media:
                if item.mm_hash == mm_hash:
                    _check_rows(item, seq.request_id, tensor)
        self.embeddings.provide(mm_hash, tensor)
        self._stalled = False

    def abort(self, request_id: str) -> bool:
        """Drop a request (or a bare reservation) and everything it holds; False if unknown."""
        seq = self.requests.get(request_id)
        self._stalled = False
        if seq is None:
            known = request_id in self.scheduler.ledger
            self.scheduler.ledger.release(request_id)
            return known
        self._finish(seq, "abort")
        return True

    def missing_embeddings(self, request_id: str) -> list[str]:
        """Hashes of the request's media items still to compute whose embedding has not arrived."""
        seq = self.requests.get(request_id)
        return [] if seq is None else seq.missing_embeddings(self.embeddings)

    # ----- stepping -----

    def has_work(self) -> bool:
        """True when a step may compute something: not all requests wait for embeddings, and the last step
        did not come back empty with nothing changed since (e.g. blocks held by reservations)."""
        return not self._stalled and any(
            seq.first_blocked_offset(seq.num_computed_tokens, self.embeddings) > seq.num_computed_tokens
            for seq in self.requests.values()
        )

    def step(self) -> list[StepOutput]:
        """Schedule, run the model once, sample; returns the new tokens of the requests that sampled."""
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            self._stalled = True
            return []
        run = self.runner.run(scheduled.chunks, self.embeddings)
        seqs = [c.seq for c in run.sampled]
        tokens: list[int] = []
        if seqs:  # the step's one device-to-host copy
            sampled = self.sampler.sample(run.logits, [s.sampling for s in seqs], [s.generator for s in seqs])
            tokens = self.runner.io.to_host(sampled)
        self.scheduler.update(scheduled)
        outputs = []
        for seq, token in zip(seqs, tokens, strict=True):
            seq.append_token(token)
            reason = seq.stop_reason(self.eos_token_ids)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(StepOutput(seq.request_id, [token], reason is not None, reason, seq.num_cached_tokens))
        return outputs

    def kv_state(self) -> KVState:
        bm, scheduler = self.block_manager, self.scheduler
        return KVState(
            total_blocks=bm.num_blocks,
            free_blocks=bm.num_free_blocks,
            reserved_blocks=scheduler.ledger.reserved_blocks,
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            block_size=self.config.block_size,
            preemptions=scheduler.num_preemptions,
            attention_backend=self.config.attention_backend,
        )

    def embedding_stats(self) -> EmbeddingStats:
        return self.embeddings.stats()

    # ----- helpers -----

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.embeddings.release([m.mm_hash for m in seq.media])
        del self.requests[seq.request_id]

    def _validate(self, seq: Sequence) -> None:
        if not seq.token_ids:
            raise ValueError(f"request {seq.request_id!r} has no prompt tokens")
        if seq.max_num_tokens > self.max_model_len:
            raise ValueError(
                f"request {seq.request_id!r}: {seq.num_prompt_tokens} prompt + {seq.sampling.max_tokens} "
                f"new tokens exceed the model's {self.max_model_len}"
            )
        self._validate_media(seq)
        if seq.max_num_blocks > self.scheduler.ledger.limit:
            raise ValueError(
                f"request {seq.request_id!r} needs {seq.max_num_blocks} KV blocks; this worker has "
                f"{self.block_manager.num_blocks}"
            )

    def _validate_media(self, seq: Sequence) -> None:
        end = 0
        for item in seq.media:
            if item.offset < end or item.num_tokens <= 0 or item.offset + item.num_tokens > seq.num_tokens:
                raise ValueError(
                    f"request {seq.request_id!r}: media item at {item.offset} (+{item.num_tokens}) overlaps, "
                    f"is out of order or runs past the prompt"
                )
            end = item.offset + item.num_tokens
            if any(t != self.adapter.image_token_id for t in seq.token_ids[item.offset : end]):
                raise ValueError(f"request {seq.request_id!r}: media item at {item.offset} covers text tokens")


def _check_rows(item: MediaInput, request_id: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 2 or tensor.shape[0] != item.num_tokens:
        raise ValueError(
            f"embedding {item.mm_hash[:16]} has shape {tuple(tensor.shape)}, request {request_id!r} "
            f"expects {item.num_tokens} rows"
        )
