"""Decode priority by an inter-token latency target: each step's prefill sized so the step is predicted to fit.

With decodes running, a step's prefill tokens are the most that the step-cost model (``step_cost.py``,
fitted from the worker's own steps) predicts keep the whole step within the target, since every decoding
sequence waits for the step to end before its next token. Prefill still advances every step by at least
``minimum`` tokens (the engine gives one KV block's worth: a chunk that fills a block, which the prefix
cache can then publish, and few enough tokens to cost about as much as a handful of decode rows), so a
long image prompt cannot starve behind decodes however tight the target. With no decode running nobody
waits: prefill takes the whole token budget. The model predicts a typical step; so that the slow ones fit
too, the step is planned to ``target / (1 + overrun)``, where overrun is how far the slowest of the recent
steps with prefill ran over the model (``StepCostModel.prefill_overrun``), kept within [0.15, 0.5]: at least
13 % under the target, since what a client sees also carries the relay after the worker (its event loop, the
router, the client), which the worker's step times do not hold; at most a third under it.

The decoding sequences' wait starts at their last token, not at the step: what the engine loop ran between
the two steps (admissions, arriving embeddings, aborts) is subtracted from the plan (``spent_s``), and that
work is itself bounded to ``COMMAND_SHARE`` of the target while sequences decode (``command_budget_s``; the
rest waits for the next gap): a burst of admissions ran 9-13 ms in one gap, next to steps planned at 14 ms.
"""

from __future__ import annotations

from services.worker.engine.step_cost import StepCostModel

_MIN_HEADROOM = 0.15  # plan at most 87 % of the target: room for the relay after the worker
_MAX_HEADROOM = 0.5  # plan at least two thirds of the target
COMMAND_SHARE = 0.25
"""The part of the target the engine loop's commands between two steps may take while sequences decode."""


class ItlTarget:
    """The prefill budget per step under an inter-token latency target of ``target_s`` seconds.

    Invariant: ``prefill_budget`` is within ``[min(minimum, budget), budget]``; it is ``budget`` when no
    sequence decodes, and otherwise above ``minimum`` only if ``model`` predicts the step within
    ``planned_s() <= target_s``.
    """

    def __init__(self, target_s: float, model: StepCostModel, minimum: int) -> None:
        if not target_s > 0:
            raise ValueError(f"an inter-token latency target must be positive, got {target_s} s")
        if minimum < 1:
            raise ValueError(f"the minimum prefill chunk must be positive, got {minimum}")
        self.target_s = target_s
        self.model = model
        self.minimum = minimum

    def planned_s(self) -> float:
        """The step time budgets are planned to: the target less room for the model's recent error."""
        return self.target_s / (1 + min(max(self.model.prefill_overrun, _MIN_HEADROOM), _MAX_HEADROOM))

    def command_budget_s(self) -> float:
        """How long the engine loop may run commands between two steps while sequences decode."""
        return self.target_s * COMMAND_SHARE

    def prefill_budget(
        self, decode_rows: int, decode_context: int, prefill_context: int, budget: int, spent_s: float = 0.0
    ) -> int:
        """Prefill tokens a step may carry next to ``decode_rows`` decodes attending to ``decode_context``
        tokens in all; ``prefill_context``: the most tokens a prefilling sequence has computed already;
        ``spent_s``: how long the decodes have waited already since their last token (the plan is that less)."""
        if decode_rows == 0:
            return budget
        return self.model.max_prefill_tokens(
            decode_rows, decode_context, prefill_context, self.planned_s() - spent_s, budget, self.minimum
        )
