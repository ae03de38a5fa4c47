"""The worker engine: requests in, tokens out, one step at a time (not thread-safe by itself)."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from services.common.kv_blocks import request_blocks
from services.common.kv_layout import KVLayout
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.config import EngineConfig
from services.worker.engine.embeddings import EmbeddingPool, EmbeddingStats
from services.worker.engine.itl_target import ItlTarget
from services.worker.engine.kv_connector import KVChunk, KVConnector
from services.worker.engine.request import (
    KV_RECEIVE,
    EngineRequest,
    KVState,
    KVTransfer,
    StepOutput,
    TokenLogprobs,
)
from services.worker.engine.request_checks import check_request, check_rows, item_rows
from services.worker.engine.sampler import Sampler
from services.worker.engine.scheduler import Scheduler, SchedulerOutput
from services.worker.engine.sequence import Sequence, request_choices
from services.worker.engine.step_cost import StepCostModel, StepShape, StepTiming
from services.worker.engine.step_sampling import sample_step
from services.worker.engine.structured import REFUSED, STOPPED, StructuredOutputs
from services.worker.engine.tensor_parallel.start import make_runner

log = logging.getLogger(__name__)
GRAMMAR_POLL_S = 0.005
"""How long a step with nothing to compute waits for a grammar compiling on its thread."""


class Engine:
    """Continuous batching over paged KV for one model.

    Invariant: ``requests`` maps each live request id to its live sequences, one per choice not finished
    (each waiting or running in the scheduler); each sequence holds one reference in the embedding pool
    per media item, and a reservation in the ledger once admitted (under its ``seq_id``, ``(request id,
    choice)``; a bare reservation takes choice 0's key). Finishing a choice gives its part back; aborting a
    request gives all of it back. Call everything from one thread.

    Every step whose end is known on the host (it sampled: the one device-to-host copy waits for the device;
    or the device is the CPU) is timed to that copy, fed to ``step_costs``, then handed to ``on_step`` when set
    (the worker's metrics). It is timed from the previous timed step's end when sequences decoded on from there
    (their inter-token time: whatever the caller did between the steps, such as the engine loop's commands and
    outputs, counts), else from scheduling. With ``itl_target_ms`` the scheduler sizes prefill by the model.

    A constrained choice (``sampling.structured``) waits in ``awaiting_grammar``, unscheduled, while its grammar
    compiles on the compile thread (structured.py); then its matcher masks its logits each step and accepts
    each token. It ends "stop" once the grammar is complete, and "error" (no token) when the compile fails or
    outlives ``grammar_compile_timeout_s``.
    """

    def __init__(self, adapter: Any, model: torch.nn.Module, config: EngineConfig) -> None:
        self.adapter = adapter
        self.runner = make_runner(adapter, model, config)  # tensor parallelism: rank 0's, the ranks started
        self.config = config = self.runner.config  # automatic settings resolved (backend, block size, KV bytes)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        shape = self.runner.shape
        self.kv_layout = KVLayout("", config.dtype, shape.num_layers, shape.kv_heads, shape.head_dim,
                                  config.block_size, self.runner.kv.layout, config.tensor_parallel_size)  # fmt: skip
        self.embeddings = EmbeddingPool(config.embedding_buffer_bytes, config.torch_dtype, self.runner.io)
        self.step_costs = StepCostModel()
        self.itl_target = ItlTarget.of(config, self.step_costs)
        self.scheduler = Scheduler(config, self.block_manager, self.embeddings, self.itl_target)
        self.kv_connector = KVConnector(self.block_manager, self.runner.kv)  # prefill/decode disaggregation
        self.on_step: Callable[[StepTiming], None] | None = None
        self.eos_token_ids = frozenset(adapter.eos_token_ids)
        self.sampler = Sampler(config.seed, self.runner.io, self.eos_token_ids)
        self.vocab_size = model.get_output_embeddings().out_features  # the logits' width (whole under TP)
        self.max_model_len = self.runner.max_model_len
        self.requests: dict[str, list[Sequence]] = {}
        self.structured = StructuredOutputs(
            adapter.tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            config.grammar_cache_entries,
            config.grammar_cache_bytes,
            config.grammar_compile_timeout_s,
            self.runner.device,
        )
        self.awaiting_grammar: list[Sequence] = []
        self._stalled = False  # the last step scheduled nothing and nothing has changed since
        self._tokens_at: float | None = None  # the last timed step's end, when sequences decode on after it
        self._step_s = 0.0  # the last timed step's own time (from its scheduling to its sampled tokens)

    def bind_thread(self) -> None:
        """Call first on the thread that will run the engine: it makes the engine's CUDA device that thread's
        current device (streams, events and graph replays use the current device)."""
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)

    # ----- requests -----

    def admit(self, request: EngineRequest, prepared: list[Sequence] | None = None) -> bool:
        """The router's admission: reserve the blocks of all the request's choices and queue it, as one; False
        (nothing kept) when they do not fit now or the id is live. Raises ValueError as ``add_request`` does
        (``NeverFits`` when the request could never fit this worker). ``prepared``: `prepare`'s sequences for it."""
        if request.request_id in self.requests:
            return False
        choices = self._choices(request, prepared)
        needs = {seq.seq_id: seq.reserve_blocks for seq in choices}
        if not self.scheduler.ledger.reserve_many(needs):
            return False
        self._enqueue(choices, request.kv_transfer)
        return True

    def receive_kv(self, chunk: KVChunk) -> None:
        """A chunk of a ``KV_RECEIVE`` request's prompt KV arrived (kv_connector.py): checked (ValueError) and queued;
        the following steps write it into its blocks, paced, and the last one's first token is then the request's
        first output (it decodes here, or ends on that token). A chunk of a request not receiving here (aborted,
        re-admitted) is dropped."""
        self.kv_connector.receive(chunk)
        self._stalled = False

    def _write_received_kv(self) -> list[StepOutput]:
        """Write queued KV pieces (while sequences decode, paced by the last step's time: ``KVConnector.write``);
        the first-token outputs of the sequences whose KV is then complete."""
        outputs = []
        for seq, first in self.kv_connector.write(None if self._tokens_at is None else self._step_s):
            output = self._token_output(seq, first.token_id, first.logprobs)
            if not output.finished:
                self.scheduler.ready.append(seq)
            outputs.append(output)
        return outputs

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (its ``sampling.n`` choices) without reserving: the scheduler reserves each choice's
        blocks when they fit. Raises ValueError when it is malformed, ``NeverFits`` when it could never fit."""
        transfer = request.kv_transfer
        if transfer is not None and transfer.direction == KV_RECEIVE:
            raise ValueError(f"request {request.request_id!r}: a KV_RECEIVE request is admitted (reserved), not added")
        self._enqueue(self._choices(request), transfer)

    def provide_embedding(self, mm_hash: str, tensor: torch.Tensor, keep: bool = False) -> None:
        """An item's embedding ``[num_tokens, hidden]`` arrived; before or after its requests. ``keep``: held here
        until ``forget_embedding``, for later requests of the same item (`EmbeddingPool`)."""
        for seq in self._sequences():
            rows = item_rows(seq.media, mm_hash)
            if rows:
                check_rows(mm_hash, rows, seq.request_id, tensor, self.adapter.embedding_width)
        self.embeddings.provide(mm_hash, tensor, keep)
        self._stalled = False

    def forget_embedding(self, mm_hash: str) -> None:
        """An embedding provided with ``keep`` need not be held any longer (dropped once no request needs it)."""
        self.embeddings.forget(mm_hash)

    def abort(self, request_id: str) -> bool:
        """Drop a request (all its choices) and everything it holds; False if unknown."""
        choices = self.requests.get(request_id)
        self._stalled = False
        if choices is None:
            return False
        for seq in list(choices):
            self._finish(seq, "abort")
        return True

    def missing_embeddings(self, request_id: str) -> list[str]:
        """Hashes of the request's media items still to compute (by any choice) whose embedding has not arrived."""
        live = [seq for seq in self.requests.get(request_id, []) if not self.kv_connector.receives(seq)]
        missing = [h for seq in live for h in seq.missing_embeddings(self.embeddings)]
        return list(dict.fromkeys(missing))

    # ----- stepping -----

    def has_work(self) -> bool:
        """True when a step may compute something: not all requests wait for embeddings, and the last step
        did not come back empty with nothing changed since (e.g. blocks held by reservations), or received KV
        waits to be written."""
        if self.awaiting_grammar or self.kv_connector.queued:
            return True  # a compile may finish: the step polls it; a step writes received KV
        return not self._stalled and any(
            seq.first_blocked_offset(seq.num_computed_tokens, self.embeddings) > seq.num_computed_tokens
            for seq in self._sequences()
        )

    def command_budget_s(self) -> float | None:
        """How long the caller may run commands (admissions, embeddings, aborts) before the next step: bounded
        by the ITL target while sequences decode on from the last step, else None (no bound)."""
        if self.itl_target is None or self._tokens_at is None:
            return None
        return self.itl_target.command_budget_s()

    def step(self) -> list[StepOutput]:
        """Schedule, run the model once, sample; returns the new tokens of the requests that sampled."""
        early = self._write_received_kv() if self.kv_connector.queued else []
        if self.awaiting_grammar:
            early += self._start_grammars()
        now = time.perf_counter()
        start = self._tokens_at or now
        self._tokens_at = None
        scheduled = self.scheduler.schedule(spent_s=now - start)
        if scheduled.block_copies:
            self.runner.copy_blocks(scheduled.block_copies)
        if not scheduled.chunks:
            if self.awaiting_grammar:
                concurrent.futures.wait([s.grammar.compiling for s in self.awaiting_grammar], GRAMMAR_POLL_S)
            else:
                self._stalled = True
            return early
        if self.structured.beside:  # the grammar thread fills the step's masks beside the forward
            self.structured.prefetch(
                [c.seq.grammar for c in scheduled.chunks if c.samples and c.seq.grammar is not None]
            )
        run = self.runner.run(scheduled.chunks, self.embeddings)
        seqs = [c.seq for c in run.sampled]
        sampled, mask = [], None
        if seqs:  # the step's one device-to-host copy: token ids and any logprobs together
            sampled, mask = sample_step(self.sampler, self.structured, self.runner.io, seqs, run.logits)
        timed = bool(seqs) or self.runner.device.type != "cuda"
        end = time.perf_counter()
        if timed:
            self._time_step(scheduled, end - start)
            self._step_s = end - now
        self.scheduler.update(scheduled)
        if self.kv_connector.sending:
            self.kv_connector.export(scheduled.chunks)
        outputs = early
        verdicts = self.structured.accept(mask, [token for token, _ in sampled]) if mask is not None else {}
        # a row per sampling sequence: the checks that cost a call (grammar verdict, remote prefill) are skipped
        # when no row can need them
        sending, decodes_on = self.kv_connector.sending, False
        for row, (seq, (token, logprobs)) in enumerate(zip(seqs, sampled, strict=True)):
            verdict = verdicts.get(row) if verdicts else None
            if verdict == REFUSED:
                log.error("request %s: sampled token %d outside its grammar; ended", seq.name, token)
                self._finish(seq, "error")
                outputs.append(self._ended(seq, "error"))
                continue
            if sending and self.kv_connector.sends(seq):  # a remote prefill: the token goes with the KV, it ends here
                self.kv_connector.send_first_token(seq, token, logprobs)
                self._finish(seq, "kv_sent")
                outputs.append(self._ended(seq, "kv_sent"))
                continue
            output = self._token_output(seq, token, logprobs, verdict == STOPPED)
            decodes_on = decodes_on or not output.finished
            outputs.append(output)
        if decodes_on and timed:
            self._tokens_at = end  # a sequence decodes next step: that step's time runs from here
        return outputs

    def _start_grammars(self) -> list[StepOutput]:
        """Start the matchers whose compile finished; end (``"error"``, no token) the sequences whose compile
        failed or ran out of time. Their outputs."""
        ended = []
        for seq in list(self.awaiting_grammar):
            error = seq.grammar.start(seq.token_ids[seq.output_start :])  # type: ignore[union-attr]
            if error is None and not seq.grammar.ready:  # type: ignore[union-attr]
                continue
            self.awaiting_grammar.remove(seq)
            self._stalled = False
            if error is not None:
                log.warning("request %s: %s", seq.name, error)
                self._finish(seq, "error")
                ended.append(self._ended(seq, "error"))
        return ended

    def _token_output(
        self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, grammar_stopped: bool = False
    ) -> StepOutput:
        """``token`` appended to ``seq``, which finishes when it stops (or its grammar ended it); its output."""
        seq.append_token(token)
        reason = seq.stop_reason(self.eos_token_ids)
        if reason is None and grammar_stopped:
            reason = "stop"
        if reason is not None:
            self._finish(seq, reason)
        return StepOutput(seq.request_id, [token], reason is not None, reason, seq.num_cached_tokens, seq.index,
                          None if logprobs is None else [logprobs], seq.request_id not in self.requests)  # fmt: skip

    def _ended(self, seq: Sequence, reason: str) -> StepOutput:
        """The output of a choice ended without a new token."""
        return StepOutput(
            seq.request_id,
            [],
            finished=True,
            finish_reason=reason,
            cached_tokens=seq.num_cached_tokens,
            index=seq.index,
            request_finished=seq.request_id not in self.requests,
        )

    def _time_step(self, scheduled: SchedulerOutput, seconds: float) -> None:
        shape = StepShape.of(scheduled.chunks)
        if self.on_step is None:
            self.step_costs.observe(shape, seconds)
            return
        predicted = self.step_costs.predict(shape)  # before the model sees this step: an honest error
        self.step_costs.observe(shape, seconds)
        self.on_step(StepTiming(shape, seconds, predicted, scheduled.itl_budget))

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
            pinned_embeddings=len(self.embeddings.pinned),
            kv_layout=self.kv_layout,
        )

    def embedding_stats(self) -> EmbeddingStats:
        return self.embeddings.stats()

    # ----- helpers -----

    def _sequences(self) -> list[Sequence]:
        return [seq for choices in self.requests.values() for seq in choices]

    def prepare(self, request: EngineRequest) -> list[Sequence]:
        """The request's sequences, checked on their own and prepared (positions, seeded generators): the part of an
        admission that reads only what never changes in the engine, so any thread may run it while the engine
        thread steps (the engine process's pipe reader does: docs/engine.md). ValueError for a malformed request,
        ``NeverFits`` for one that could never fit this worker."""
        size, caching = self.config.block_size, self.config.enable_prefix_caching
        choices = request_choices(request, size, caching)
        first, sampling = choices[0], request.sampling
        check_request(first, self.adapter, self.max_model_len, self.vocab_size)
        needed = request_blocks(first.num_prompt_tokens, sampling.max_tokens, sampling.n, size, caching)
        projected = first.num_prompt_tokens + max(sampling.n, 1) * sampling.max_tokens
        self.scheduler.ledger.check_fits(first.request_id, needed, projected)  # the ledger's limit never changes
        self.runner.prepare(first)
        for seq in choices:
            seq.positions = first.positions  # read-only: every choice has the same prompt and lengths
            if seq.sampling.seed is not None:
                seq.generator = torch.Generator(device=self.runner.device).manual_seed(seq.sampling.seed)
        return choices

    def _choices(self, request: EngineRequest, prepared: list[Sequence] | None = None) -> list[Sequence]:
        """The request's sequences (``prepared`` by `prepare`, or prepared now), checked against the engine's state
        (its id, known embeddings, a KV transfer, the constraint); nothing kept yet."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already running")
        choices = prepared if prepared is not None else self.prepare(request)
        first, sampling = choices[0], request.sampling
        for mm_hash in dict.fromkeys(item.mm_hash for item in first.media):
            known = self.embeddings.peek(mm_hash)
            if known is not None:
                check_rows(
                    mm_hash, item_rows(first.media, mm_hash), first.request_id, known, self.adapter.embedding_width
                )
        if request.kv_transfer is not None:
            self.kv_connector.check(first, len(choices))
        if sampling.structured is not None:
            for seq in choices:
                seq.grammar = self.structured.state(sampling.structured)  # ValueError: known not to compile
        return choices

    def _enqueue(self, choices: list[Sequence], transfer: KVTransfer | None = None) -> None:
        for seq in choices:
            self.embeddings.acquire([m.mm_hash for m in seq.media])
            if transfer is not None and transfer.direction == KV_RECEIVE:
                self.kv_connector.start_receive(seq)  # blocks now, filled by receive_kv; then decodes
                continue
            if transfer is not None:
                self.kv_connector.start_send(seq, transfer.skip_blocks)
            self.scheduler.add(seq)
            if seq.grammar is not None:
                self.awaiting_grammar.append(seq)
        self.requests[choices[0].request_id] = list(choices)
        self._stalled = False

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.kv_connector.forget(seq)
        if seq in self.awaiting_grammar:
            self.awaiting_grammar.remove(seq)
        self.embeddings.release([m.mm_hash for m in seq.media])
        choices = self.requests[seq.request_id]
        choices.remove(seq)
        if not choices:
            del self.requests[seq.request_id]
