"""The router's check of a request's structured-output constraint: resolved (`any_whitespace` from the router's
setting), held to the limits, and compiled for the model's tokenizer within a time bound, before admission.

Invariant: a constrained request reaches a worker only after its constraint compiled here (or was found in
this router's cache of compiled ones), so what a worker is asked to compile is known to compile, and a bad,
oversized, too deep or too slow constraint is INVALID_ARGUMENT naming it (`sampling.<field> ...`) before any
worker reserves blocks. The compile runs on the cache's own thread: the event loop only waits, at most
EPD_STRUCTURED_COMPILE_TIMEOUT_S (a compile past it goes on and is kept, so a retry is answered at once).
"""

from __future__ import annotations

import asyncio

from services.common.grammar import ConstraintError, GrammarLimits, check_constraint, constraint_of
from services.common.grammar_cache import GrammarCache, tokenizer_info
from services.common.model_info import ModelInfo
from services.common.rpc.epd.v1 import common_pb2
from services.router.config import RouterConfig
from services.router.errors import invalid

ROUTER_CACHE_BYTES = 256 << 20
"""Bytes of compiled grammars the router keeps (it only checks them; each worker keeps its own)."""


class StructuredCheck:
    def __init__(self, info: ModelInfo, config: RouterConfig) -> None:
        adapter = info.adapter
        self.limits = GrammarLimits(config.structured_max_bytes, config.structured_max_depth)
        self.any_whitespace = config.structured_any_whitespace
        self.timeout_s = config.structured_compile_timeout_s
        self.cache = GrammarCache(
            lambda: tokenizer_info(adapter.tokenizer, adapter.vocab_size, adapter.eos_token_ids),
            config.structured_cache_entries,
            ROUTER_CACHE_BYTES,
        )

    def resolve(self, sampling: common_pb2.SamplingParams) -> None:
        """Set ``any_whitespace`` where a JSON constraint leaves it unset (the worker reads it as sent) and check
        the limits; INVALID_ARGUMENT naming the field at fault. Cheap: no compile."""
        constraint = constraint_of(sampling, self.any_whitespace)
        if constraint is None:
            return
        if constraint.is_json and not sampling.HasField("any_whitespace"):
            sampling.any_whitespace = self.any_whitespace
        try:
            check_constraint(constraint, self.limits)
        except ConstraintError as exc:
            raise invalid(f"sampling.{exc}") from None

    async def compile(self, sampling: common_pb2.SamplingParams) -> None:
        """Compile the (resolved) constraint, waiting at most the time bound; INVALID_ARGUMENT when it does not
        compile or takes longer."""
        constraint = constraint_of(sampling, self.any_whitespace)
        if constraint is None:
            return
        future = asyncio.wrap_future(self.cache.compile(constraint))
        try:  # shielded: a wait that times out leaves the compile running (and kept) for the next request
            await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            raise invalid(
                f"sampling.{constraint.kind} takes longer than this server's {self.timeout_s:g} s "
                "(EPD_STRUCTURED_COMPILE_TIMEOUT_S) to compile; simplify it"
            ) from None
        except ConstraintError as exc:
            raise invalid(f"sampling.{exc}") from None

    def close(self) -> None:
        self.cache.close()
