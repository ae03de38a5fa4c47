"""Decode priority by an inter-token latency target: each step's prefill sized so the step is predicted to fit.

With decodes running, a step's prefill tokens are the most that the step-cost model (``step_cost.py``, fitted from
the worker's own steps) predicts keep the whole step within the target, since every decoding sequence waits for
the step to end before its next token. The target is a time (``itl_target_ms``) or relative
(``itl_target_factor``): that many times what the model predicts the same decodes take alone, so the inter-token
latency of a step that takes in prefill stays a few decode steps long on any machine and model (a GPU's decode
step and a 2-core CPU's differ many times over; a time that suits one starves or ignores the other's prefill).
Neither is set by default (docs/decisions.md: what a target costs the first tokens). Prefill still advances every
step by at least ``minimum`` tokens (the engine gives one KV block's worth: a chunk that fills a block, which the
prefix cache can then publish, and few enough tokens to cost about as much as a handful of decode rows), so a long
image prompt cannot starve behind decodes however tight the target. With no decode running nobody waits: prefill
takes the whole token budget. The model predicts a typical step; so that the slow ones fit too, the step is
planned to ``target / (1 + overrun)``, where overrun is how far the slowest of the recent steps with prefill ran
over the model (``StepCostModel.prefill_overrun``), kept within [0.15, 0.5]: at least 13 % under the target, since
what a client sees also carries the relay after the worker (its event loop, the router, the client), which the
worker's step times do not hold; at most a third under it.

The decoding sequences' wait starts at their last token, not at the step: what the engine loop ran between
the two steps (admissions, arriving embeddings, aborts) is subtracted from the plan (``spent_s``), and that
work is itself bounded to ``COMMAND_SHARE`` of the target while sequences decode (``command_budget_s``; the
rest waits for the next gap): a burst of admissions ran 9-13 ms in one gap, next to steps planned at 14 ms.
"""

from __future__ import annotations

from services.worker.engine.config import EngineConfig
from services.worker.engine.step_cost import StepCostModel

_MIN_HEADROOM = 0.15  # plan at most 87 % of the target: room for the relay after the worker
_MAX_HEADROOM = 0.5  # plan at least two thirds of the target
COMMAND_SHARE = 0.25
"""The part of the target the engine loop's commands between two steps may take while sequences decode."""


class ItlTarget:
    """The prefill budget per step under an inter-token latency target: ``target_s`` seconds, or with ``factor``
    (and ``target_s`` 0) that many times the predicted decode-only step of the step's decodes.

    Invariant: ``prefill_budget`` is within ``[min(minimum, budget), budget]``; it is ``budget`` when no
    sequence decodes, and otherwise above ``minimum`` only if ``model`` predicts the step within
    ``planned_s(target) <= target``, the target of those decodes.
    """

    def __init__(self, target_s: float, model: StepCostModel, minimum: int, factor: float = 0.0) -> None:
        if factor > 0:
            if target_s:
                raise ValueError("an inter-token latency target is a time or a factor, not both")
        elif not target_s > 0:
            raise ValueError(f"an inter-token latency target must be positive, got {target_s} s")
        if minimum < 1:
            raise ValueError(f"the minimum prefill chunk must be positive, got {minimum}")
        self.target_s = target_s
        self.factor = factor
        self.model = model
        self.minimum = minimum
        self.last_target_s = target_s or factor * model.decode_seconds(1, 0)
        """The target of the last step planned with decodes (the time target's, before any)."""

    @classmethod
    def of(cls, config: EngineConfig, model: StepCostModel) -> ItlTarget | None:
        """The engine's target: ``itl_target_ms`` when set, else ``itl_target_factor``; None when both are 0."""
        if config.itl_target_ms > 0:
            return cls(config.itl_target_ms / 1000, model, config.block_size)
        if config.itl_target_factor > 0:
            return cls(0.0, model, config.block_size, factor=config.itl_target_factor)
        return None

    def target_for(self, decode_rows: int, decode_context: int) -> float:
        """The target of a step with these decodes: the time, or the factor times their predicted step alone."""
        return self.target_s or self.factor * self.model.decode_seconds(decode_rows, decode_context)

    def planned_s(self, target_s: float | None = None) -> float:
        """The step time budgets are planned to: the target (the last one planned, by default) less room for the
        model's recent error."""
        target = self.last_target_s if target_s is None else target_s
        return target / (1 + min(max(self.model.prefill_overrun, _MIN_HEADROOM), _MAX_HEADROOM))

    def command_budget_s(self) -> float:
        """How long the engine loop may run commands between two steps while sequences decode."""
        return self.last_target_s * COMMAND_SHARE

    def prefill_budget(
        self, decode_rows: int, decode_context: int, prefill_context: int, budget: int, spent_s: float = 0.0
    ) -> int:
        """Prefill tokens a step may carry next to ``decode_rows`` decodes attending to ``decode_context``
        tokens in all; ``prefill_context``: the most tokens a prefilling sequence has computed already;
        ``spent_s``: how long the decodes have waited already since their last token (the plan is that less)."""
        if decode_rows == 0:
            return budget
        self.last_target_s = self.target_for(decode_rows, decode_context)
        return self.model.max_prefill_tokens(
            decode_rows, decode_context, prefill_context, self.planned_s() - spent_s, budget, self.minimum
        )
