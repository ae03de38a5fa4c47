"""Structured outputs in the engine: a grammar matcher per constrained sequence, its compile waited for off the
engine thread, and each step's token bitmask applied to the logits on their device.

Invariants: a constrained sequence is not scheduled until its grammar is compiled (``GrammarState.ready``);
its matcher has then accepted every token it generated, those of a previous worker included (a migrated
request's ``generated_tokens``), before its next bitmask is filled, so the engine's tokens and the matcher
never disagree. On a GPU the matchers' per-step work runs on one grammar thread, in order (on the CPU, where
the forward is the engine thread's own work and a second thread only contends with it for the GIL, the same
jobs run in the same order on the engine thread): each step's accepts (one call into xgrammar per matcher)
are queued after its sampling together with the fill of the next step's bitmask for the same rows (one call
for all of them), which so runs beside the engine's output handling, scheduling and next forward pass; the
step waits for it only after the model ran. A next step whose constrained rows are not all
among those filled queues its own fill before its forward. A sampled token is checked before it is kept
(with the grammar thread, against the host bitmask its row was masked with; on the engine thread, by its
matcher's accept itself: the matcher allows exactly the tokens whose bit is set), so a token outside the
grammar ends its choice, and a stop token ends it complete. The mask (step_mask.py) goes on in a copy
(the raw logits stay as they were: logprobs read them): on the CPU as an additive bias of 0 / -inf built
with the fill, on other devices by xgrammar's kernel after one upload. Rows without a constraint are not
touched, and a step without any costs nothing here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from services.common.grammar import Constraint
from services.common.grammar_cache import GrammarCache, tokenizer_info
from services.worker.engine.step_mask import StepMask, bit_rows

log = logging.getLogger(__name__)
FILL_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))
"""Threads xgrammar fills a step's bitmask rows on (in C++, the rows split between them)."""
REFUSED = "refused"
STOPPED = "stopped"
"""``StructuredOutputs.accept``'s verdicts: the token is outside the grammar; the token ends a complete grammar."""


class GrammarState:
    """One sequence's grammar: its compile (a future shared by the request's choices), then its matcher."""

    def __init__(self, compiling: concurrent.futures.Future, deadline: float, timeout_s: float) -> None:
        self.compiling = compiling
        self.deadline = deadline  # perf_counter time after which a compile still running fails the sequence
        self.timeout_s = timeout_s
        self.matcher: Any = None
        self.refused: int | None = None  # a token its matcher refused on the grammar thread (never, by the mask)

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def start(self, generated: list[int]) -> str | None:
        """Once the compile is done: make the matcher and feed it ``generated``; an error message when the
        compile failed, ran past its deadline, or a generated token does not fit the grammar; None when it
        started (or is still compiling within its deadline: ``ready`` tells)."""
        if not self.compiling.done():
            if time.perf_counter() < self.deadline:
                return None
            return f"the constraint took longer than {self.timeout_s:g} s to compile"
        error = self.compiling.exception()
        if error is not None:
            return str(error)
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compiling.result())
        for i, token in enumerate(generated):
            if not matcher.accept_token(token):
                return f"token {i} generated before ({token}) does not fit the constraint"
        self.matcher = matcher
        return None


class _Ran:
    """A job run at once, where there is no grammar thread: its result, or the error it raised, read as a
    finished future's (without a future's lock and condition, on every step)."""

    __slots__ = ("_value", "_error")

    def __init__(self, job: Callable[..., Any], args: tuple) -> None:
        self._value: Any = None
        self._error: Exception | None = None
        try:
            self._value = job(*args)
        except Exception as exc:  # as the thread would hand it over: raised where the result is read
            self._error = exc

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class StructuredOutputs:
    """The engine's grammars: compiled (``GrammarCache``, its tokenizer view built on the compile thread) and
    waited for within ``timeout_s`` of admission; their matchers' per-step work on the grammar thread (made on
    the engine thread's first constrained step, so it runs at that thread's priority) when ``beside`` (default:
    off the CPU), else on the engine thread as each job is queued."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_entries: int,
        max_bytes: int,
        timeout_s: float,
        device: torch.device,
        beside: bool | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        # a CPU step's 32 constrained rows: 1.62 ms with the jobs beside, 1.41 ms run in turn (1.10 ms free)
        self.beside = device.type != "cpu" if beside is None else beside
        self.timeout_s = timeout_s
        ids = self.stop_ids = sorted(eos_token_ids)
        self._stops = frozenset(ids)
        self.cache = GrammarCache(lambda: tokenizer_info(tokenizer, vocab_size, ids), max_entries, max_bytes)
        self._on_cpu = device.type == "cpu"
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher: fills a step's rows in one call
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        # in order: each job's future and what to run when it is taken back (None: nothing; a fill taken back
        # is redone by whoever wants it, or dropped)
        self._jobs: collections.deque[tuple[concurrent.futures.Future, Callable[[], Any] | None]] = collections.deque()
        self._pending: tuple[list[GrammarState], concurrent.futures.Future] | None = None  # the next step's fill
        self.refusals = 0  # tokens a matcher refused on the grammar thread (never, while the masks are right)
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)  # reused host buffers, grown to the rows a step needs
        self._bias = torch.empty(0, 8)
        self._index = torch.empty(0, dtype=torch.int32)
        self._views: dict[int, tuple[torch.Tensor | None, ...]] = {}  # per row count: ``_views_of``
        self.fills_beside = 0  # prefetched fills the grammar thread ran (beside the forward)
        self.fills_here = 0  # fills the engine thread ran (taken back, or never prefetched)
        self._table: torch.Tensor | None = None  # byte -> its 8 tokens' bias (0 where the bit is set, else -inf)

    def state(self, constraint: Constraint) -> GrammarState:
        """A new sequence's grammar state; ValueError at once when the constraint is already known bad."""
        compiling = self.cache.compile(constraint)
        if compiling.done() and compiling.exception() is not None:
            raise ValueError(str(compiling.exception()))
        return GrammarState(compiling, time.perf_counter() + self.timeout_s, self.timeout_s)

    def prefetch(self, states: list[GrammarState]) -> None:
        """Queue the fill of ``states``' bitmask rows on the grammar thread: the constrained sequences that sample
        in the step about to run (any order), before its forward pass, which the fill then runs beside; nothing
        when the fill queued with the last accepts covers them all, or without ``beside`` (a fill now would run
        where ``step_mask``'s does, at the same cost)."""
        if not states or not self.beside:
            return
        if self._pending is not None:
            filled = {id(state) for state in self._pending[0]}
            if all(id(state) in filled for state in states):
                return
        self._pending = (states, self._submit(self._fill, states, redo=False))

    def step_mask(self, states: list[GrammarState | None]) -> StepMask | None:
        """The mask of a step's sampling rows (``states``: each row's grammar, None where unconstrained): the
        prefetched fill waited for, or, for rows it did not fill, a fill now; None when no row is constrained."""
        pending, self._pending = self._pending, None
        if None not in states:  # every row constrained (the common case of a constrained batch)
            rows, constrained = list(range(len(states))), states  # type: ignore[assignment]
        else:
            rows = [i for i, state in enumerate(states) if state is not None]
            if not rows:
                return None
            constrained: list[GrammarState] = [states[i] for i in rows]  # type: ignore[misc]
        if pending is not None and (not self.beside or self._settle(pending[1])):
            self.fills_beside += 1
            filled, future = pending
            bitmask, bias, bits = future.result()
            if filled == constrained:  # the same states in the same order (a state equals only itself)
                return StepMask(rows, constrained, list(range(len(rows))), bitmask, bias, self.stop_ids, bits)
            place = {id(state): j for j, state in enumerate(filled)}
            source = [place.get(id(state), -1) for state in constrained]
            if -1 not in source:
                return StepMask(rows, constrained, source, bitmask, bias, self.stop_ids, bits)
        self._drain()
        self.fills_here += 1
        bitmask, bias, bits = self._fill(constrained)
        return StepMask(rows, constrained, list(range(len(rows))), bitmask, bias, self.stop_ids, bits)

    def accept(self, mask: StepMask, tokens: list[int]) -> dict[int, str]:
        """The verdicts on the step's sampled ``tokens`` (one per sampling row) for the rows ``mask``
        constrains: ``REFUSED`` where the grammar does not allow the token, ``STOPPED`` where it is a stop token
        (allowed only once the grammar is complete: the choice ends); the matchers of the other constrained rows
        accept their tokens on the grammar thread, before any later fill."""
        if not self.beside:
            return self._accept_here(mask, tokens)
        # one plain loop: on the engine thread, between a forward and the next, each numpy call costs more than
        # the whole check (a row's mask is one int: ``StepMask.bits``)
        verdicts: dict[int, str] = {}
        states, accepted = [], []
        bits, stops, refusals = mask.bits, self._stops, self.refusals
        for row, state, src in zip(mask.rows, mask.states, mask.source, strict=True):
            token = tokens[row]
            if not bits[src] >> token & 1 or (refusals and state.refused is not None):
                verdicts[row] = REFUSED
            elif token in stops:
                verdicts[row] = STOPPED
            else:
                states.append(state)
                accepted.append(token)
        if states:  # accepted, then the same rows' next bitmask filled (the next step checks it covers its rows)
            redo = functools.partial(self._accept, states, accepted)
            self._pending = (states, self._submit(self._accept_and_fill, states, accepted, redo=redo))
        return verdicts

    def _accept_here(self, mask: StepMask, tokens: list[int]) -> dict[int, str]:
        """``accept`` without the grammar thread: each matcher's own accept is the check (it refuses exactly the
        tokens its bitmask does not allow), so the mask's bits are read only for a stop token; then the accepted
        rows' next bitmask is filled."""
        verdicts: dict[int, str] = {}
        states = []
        stops = self._stops
        for row, state in zip(mask.rows, mask.states, strict=True):
            token = tokens[row]
            if token in stops:  # rare: the row's bits read once
                verdicts[row] = STOPPED if mask.allows(mask.rows.index(row), token) else REFUSED
            elif state.matcher.accept_token(token):
                states.append(state)
            else:
                verdicts[row] = REFUSED
        if states:
            self._pending = (states, _Ran(self._fill, (states,)))  # type: ignore[assignment]
        return verdicts

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
        self.cache.close()

    # ----- the grammar thread's work -----

    def _submit(self, job: Any, *args: Any, redo: bool | Callable[[], Any] = True) -> concurrent.futures.Future:
        """Queue ``job(*args)`` on the grammar thread (without ``beside``, run it now). ``redo``: what must still
        run when it is taken back: True, the job itself (accepts); False, nothing (a fill: its caller fills); or
        that callable (the accepts of an accept-and-fill job)."""
        if not self.beside:  # run now, in queue order: there is no queue
            return _Ran(job, args)  # type: ignore[return-value]
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-step")
        while self._jobs and self._jobs[0][0].done():
            self._jobs.popleft()
        future = self._thread.submit(job, *args)
        again = functools.partial(job, *args) if redo is True else (redo or None)
        self._jobs.append((future, again))
        return future

    def _settle(self, wanted: concurrent.futures.Future | None = None) -> bool:
        """Finish every queued job, in order: the ones the grammar thread has not started are taken back (on a
        busy box it may not have had a core since they were queued: waiting for it would cost more than the
        work), newest first, so it starts none of them while one runs here; the one it is running is waited for;
        then the accepts taken back run here, in order (a fill taken back is dropped). True when ``wanted`` ran
        on the grammar thread (its result is there), False when it was taken back (the caller fills now)."""
        jobs = list(self._jobs)
        self._jobs.clear()
        taken = []
        for future, again in reversed(jobs):
            if not future.cancel():  # running or done, and every job before it done (one thread, in order)
                future.result()
                break
            taken.append((future, again))
        for _, again in reversed(taken):
            if again is not None:
                again()
        return wanted is not None and all(future is not wanted for future, _ in taken)

    def _drain(self) -> None:
        """Every job queued for the grammar thread finished (the buffers and matchers are then this thread's)."""
        self._settle()

    def _accept(self, states: list[GrammarState], tokens: list[int]) -> None:
        """Each matcher accepts its token (allowed by its mask, so it always does; one that does not marks its
        state, and the choice ends ``REFUSED`` at its next token). One call per matcher: xgrammar's batch call
        took twice as long for 32 rows (26 against 13 us), its list of results built element by element."""
        for state, token in zip(states, tokens, strict=True):
            if not state.matcher.accept_token(token):
                state.refused = token
                self.refusals += 1
                log.error("a grammar matcher refused token %d its own bitmask allowed", token)

    def _accept_and_fill(
        self, states: list[GrammarState], tokens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[int] | None]:
        self._accept(states, tokens)
        return self._fill(states)

    def _fill(self, states: list[GrammarState]) -> tuple[torch.Tensor, torch.Tensor | None, list[int] | None]:
        """``states``' bitmask rows ``[k, words]`` filled in one call, the same as ints (``bit_rows``) for the
        grammar thread's checks and, on the CPU, their bias ``[k, vocab]`` (views of reused buffers: valid until
        the next fill)."""
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        views = self._views.get(len(states)) or self._views_of(len(states))
        bitmask, bias = views[0], views[-1]
        self._batch.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask)
        if bias is not None:  # each byte of the bitmask looked up in the table, into the bias's rows
            _, byte_view, index, table_rows, _ = views
            torch.index_select(self._table, 0, index.copy_(byte_view), out=table_rows)
        return bitmask, bias, bit_rows(bitmask) if self.beside else None  # the grammar thread's accept checks bits

    def _views_of(self, rows: int) -> tuple[torch.Tensor, ...]:
        """The reused buffers' views for a fill of ``rows`` rows, made once per row count (the buffers grown
        first when too small): the bitmask ``[rows, words]``, and on the CPU its bytes, those as table indices,
        the table's output ``[bytes, 8]`` and the bias ``[rows, vocab]`` it is (0 where a token's bit is set,
        -inf elsewhere; little-endian words: byte ``b`` of word ``w`` holds tokens ``32w + 8b`` onwards)."""
        words = -(-self.vocab_size // 32)
        if self._bitmask.shape[0] < rows:
            size = max(rows, 2 * self._bitmask.shape[0])
            self._bitmask = torch.empty(size, words, dtype=torch.int32)
            self._bias = torch.empty(size * words * 4, 8)
            self._index = torch.empty(size * words * 4, dtype=torch.int32)
            self._views.clear()
        bitmask = self._bitmask[:rows]
        views: tuple[torch.Tensor | None, ...] = (bitmask, None)
        if self._on_cpu:
            if self._table is None:  # byte -> its 8 tokens' bias
                bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
                self._table = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf"))
            n = rows * words * 4
            table_rows = self._bias[:n]
            bias = table_rows.view(rows, -1)[:, : self.vocab_size]
            views = (bitmask, bitmask.view(torch.uint8).view(-1), self._index[:n], table_rows, bias)
        self._views[rows] = views  # type: ignore[assignment]
        return views  # type: ignore[return-value]
