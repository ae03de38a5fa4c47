"""Compiled grammars for one tokenizer (xgrammar's token-mask tables), compiled on a thread of their own and
kept by constraint key, bounded in count and bytes.

Invariants: a constraint is compiled at most once at a time (callers asking while it compiles share its
future), and one the library refused is not compiled again while remembered (as many as grammars are
kept; the refusal is answered at once); a cached grammar is the one its key names; after every insertion the
cache holds at most ``max_entries`` grammars and ``max_bytes`` (xgrammar's ``memory_size_bytes``), least
recently used evicted first (a grammar larger than ``max_bytes`` is handed out, not kept). Nothing here
waits for a compile: callers bound the wait themselves, and a compile that outlives
them still finishes and is kept, so the next request for it is served from the cache.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from services.common.grammar import Constraint, ConstraintError, grammar_of, library_message


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> Any:
    """xgrammar's view of a Hugging Face tokenizer for logits ``vocab_size`` wide (ids past the tokenizer's
    are never allowed); ``eos_token_ids`` end a completed grammar."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))


class GrammarCache:
    """Compiles constraints for a tokenizer on ``threads`` pool threads and keeps the results. ``info`` is a
    ``tokenizer_info`` or a function making one, called on the pool's first compile (building it for a large
    vocabulary takes a while: never on the caller's thread)."""

    def __init__(
        self, info: Any | Callable[[], Any], max_entries: int = 128, max_bytes: int = 512 << 20, threads: int = 1
    ) -> None:
        self._info = info
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._compiler: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self._compiling: dict[str, concurrent.futures.Future] = {}
        self._refused: OrderedDict[str, str] = OrderedDict()  # keys the library refused -> its message
        self.bytes = 0
        self.compiles = 0  # compiles started (a hit starts none)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Any | None:
        """The cached grammar for ``key`` (now the most recently used), or None."""
        with self._lock:
            compiled = self._entries.get(key)
            if compiled is not None:
                self._entries.move_to_end(key)
            return compiled

    def compile(self, constraint: Constraint) -> concurrent.futures.Future:
        """A future of the constraint's compiled grammar: done at once on a hit; raises ConstraintError when the
        library refuses the constraint."""
        key = constraint.key
        with self._lock:
            compiled = self._entries.get(key)
            if compiled is not None:
                self._entries.move_to_end(key)
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(compiled)
                return done
            refused = self._refused.get(key)
            if refused is not None:
                failed: concurrent.futures.Future = concurrent.futures.Future()
                failed.set_exception(ConstraintError(refused))
                return failed
            future = self._compiling.get(key)
            if future is None:
                self.compiles += 1
                future = self._compiling[key] = self._pool.submit(self._compile, constraint)
            return future

    def _compile(self, constraint: Constraint) -> Any:
        key = constraint.key
        try:
            grammar = grammar_of(constraint)
            try:
                compiled = self._compiler_for_pool().compile_grammar(grammar)
            except (RuntimeError, ValueError) as exc:
                raise ConstraintError(f"{constraint.kind} does not compile: {library_message(exc)}") from None
        except BaseException as exc:
            with self._lock:
                self._compiling.pop(key, None)
                if isinstance(exc, ConstraintError) and self.max_entries > 0:
                    self._refused[key] = str(exc)
                    while len(self._refused) > self.max_entries:
                        self._refused.popitem(last=False)
            raise
        with self._lock:  # kept and no longer compiling in one step: a later caller finds one or the other
            self._keep(key, compiled)
            self._compiling.pop(key, None)
        return compiled

    def _compiler_for_pool(self) -> Any:
        with self._init_lock:  # not ``_lock``: callers' lookups never wait for this
            if self._compiler is None:
                import xgrammar as xgr

                info = self._info() if callable(self._info) else self._info
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _keep(self, key: str, compiled: Any) -> None:
        size = compiled.memory_size_bytes
        if size > self.max_bytes or self.max_entries <= 0 or key in self._entries:
            return
        self._entries[key] = compiled
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.memory_size_bytes

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
