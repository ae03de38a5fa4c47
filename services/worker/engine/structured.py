"""Structured outputs in the engine: a grammar matcher per constrained sequence, its compile waited for off the
engine thread, and each step's token bitmask applied to the logits on their device.

Invariants: a constrained sequence is not scheduled until its grammar is compiled (``GrammarState.ready``);
its matcher has then accepted every token it generated, those of a previous worker included (a migrated
request's ``generated_tokens``), so the engine's tokens and the matcher never disagree. A step fills one
bitmask on the host for the constrained rows alone (one call into xgrammar) and uploads it once; xgrammar's
kernel sets the disallowed logits to -inf on the logits' device, in a copy (the raw logits stay as they were:
logprobs read them). Rows without a constraint are not touched, and a step without any costs nothing here.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from typing import Any

import numpy
import torch

from services.common.grammar import Constraint
from services.common.grammar_cache import GrammarCache, tokenizer_info
from services.worker.engine.host_device import HostDevice

log = logging.getLogger(__name__)
FILL_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))
"""Threads xgrammar fills a step's bitmask rows on (in C++, the rows split between them)."""


class GrammarState:
    """One sequence's grammar: its compile (a future shared by the request's choices), then its matcher."""

    def __init__(self, compiling: concurrent.futures.Future, deadline: float, timeout_s: float) -> None:
        self.compiling = compiling
        self.deadline = deadline  # perf_counter time after which a compile still running fails the sequence
        self.timeout_s = timeout_s
        self.matcher: Any = None

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

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    @property
    def complete(self) -> bool:
        """What it accepted is a whole sentence of the grammar (a stop token may follow)."""
        return bool(self.matcher.is_completed())

    @property
    def terminated(self) -> bool:
        """The grammar is complete and accepted a stop token: nothing more may follow."""
        return bool(self.matcher.is_terminated())


class StructuredOutputs:
    """The engine's grammars: compiled (``GrammarCache``, its tokenizer view built on the compile thread) and
    waited for within ``timeout_s`` of admission."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_entries: int,
        max_bytes: int,
        timeout_s: float,
    ) -> None:
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        ids = self.stop_ids = sorted(eos_token_ids)
        self.cache = GrammarCache(lambda: tokenizer_info(tokenizer, vocab_size, ids), max_entries, max_bytes)
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher: fills a step's rows in one call

    def state(self, constraint: Constraint) -> GrammarState:
        """A new sequence's grammar state; ValueError at once when the constraint is already known bad."""
        compiling = self.cache.compile(constraint)
        if compiling.done() and compiling.exception() is not None:
            raise ValueError(str(compiling.exception()))
        return GrammarState(compiling, time.perf_counter() + self.timeout_s, self.timeout_s)

    def fill_bitmask(self, states: list[GrammarState | None]) -> tuple[list[int], torch.Tensor] | None:
        """The rows of a step's sampled sequences that are constrained, and the step's bitmask ``[rows of the
        step, words]`` (int32, on the host) with those rows filled by their matchers in one call (the others
        are never read); None when no row is constrained."""
        rows = [i for i, state in enumerate(states) if state is not None]
        if not rows:
            return None
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)
        matchers = [states[i].matcher for i in rows]  # type: ignore[union-attr]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        return rows, bitmask

    def only_stop_allowed(self, bitmask: torch.Tensor, row: int) -> bool:
        """True when ``bitmask``'s ``row`` allows no token but the stop tokens (the grammar is complete)."""
        words = bitmask[row].numpy().view(numpy.uint32).copy()
        for token in self.stop_ids:
            words[token // 32] &= ~numpy.uint32(1 << (token % 32))
        return not words.any()

    def close(self) -> None:
        self.cache.close()


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, io: HostDevice) -> torch.Tensor:
    """A float32 copy of ``logits [N, vocab]`` with, in each of ``rows``, the tokens whose bit is 0 in that row of
    ``bitmask [N, words]`` set to -inf (bit ``j % 32`` of word ``j // 32`` is token ``j``), by xgrammar's kernel
    on the logits' device (C++ on the CPU, Triton on CUDA). One upload (the bitmask); no host read."""
    import xgrammar as xgr

    masks = io.to_device(bitmask, torch.int32)
    out = logits.to(torch.float32, copy=True)
    xgr.apply_token_bitmask_inplace(out, masks, indices=rows)
    return out
