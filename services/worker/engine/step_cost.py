"""What an engine step costs: a linear model of its shape, fitted online from the worker's own measured steps.

A step's time is modelled as

    seconds = base + decode_rows x r + decode_context x k + prefill_tokens x p + prefill_attention x q

where ``decode_rows`` are the one-token chunks, ``decode_context`` the tokens they attend to (summed),
``prefill_tokens`` the tokens of longer chunks and ``prefill_attention`` the sum over those chunks of
``tokens x context at the chunk's end`` (attention's quadratic part). The fit is a weighted least-squares
over the last ``window`` measured steps of each kind (decode-only, and with prefill: two windows, so a long
quiet spell does not forget what prefill costs), in relative error (a 2 ms step and a 200 ms one count
alike), with Huber weights on the residuals (a noisy machine's stalls barely move it), a weak prior (worth
a hundredth of a step) that holds the coefficients no recent step has informed, and no negative coefficient.
A refit costs ~0.1-0.2 ms of numpy; it runs once the steps measured since the last one took 100 times as long
(fitting takes at most ~1 % of the engine's time: after every step of a long prefill, after some tens of
short decode steps), so the model follows a burst of prefill within a step or two.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

TERMS = ("base", "decode_rows", "decode_context", "prefill_tokens", "prefill_attention")
"""The model's terms, in the order of ``StepShape.features()`` and ``StepCostModel.coefficients``."""

DEFAULT_PRIOR = (2e-3, 1e-4, 1e-7, 5e-5, 2e-8)
"""Seconds per unit of each term before any step is measured (a small model on a CPU core): 2 ms a step,
0.1 ms a decode row, 0.4 ms per 4096 tokens of decode context, 50 us a prefill token, 84 ms for the
attention of one 2048-token chunk from scratch."""

_SCALES = np.array([1.0, 1.0, 4096.0, 256.0, 65536.0])  # each feature in units that keep the normal matrix tame
_HUBER = 2.0  # residuals beyond this many robust deviations are down-weighted
_MAD = 1.4826  # median absolute deviation -> standard deviation (normal noise)
_OVERRUN_QUANTILE = 1.0
_PRIOR_WEIGHT = 0.01  # the prior weighs as a hundredth of a step whose time is all one term's


class Chunk(Protocol):
    """What ``StepShape.of`` reads of a scheduled chunk (``ScheduledChunk``)."""

    start: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class StepShape:
    """The features of one step that its cost depends on (see the module docstring)."""

    decode_rows: int = 0
    decode_context: int = 0
    prefill_tokens: int = 0
    prefill_attention: int = 0

    @classmethod
    def of(cls, chunks: Sequence[Chunk]) -> StepShape:
        """The shape of a step computing ``chunks``."""
        rows = context = tokens = attention = 0
        for chunk in chunks:
            end = chunk.start + chunk.num_tokens
            if chunk.num_tokens == 1:
                rows += 1
                context += end
            else:
                tokens += chunk.num_tokens
                attention += chunk.num_tokens * end
        return cls(rows, context, tokens, attention)

    def features(self) -> tuple[float, float, float, float, float]:
        """The term values, ``TERMS`` order (``base`` is 1)."""
        return 1.0, self.decode_rows, self.decode_context, self.prefill_tokens, self.prefill_attention


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One measured step: its shape, what it took, what the model predicted before seeing it, and the prefill
    budget a latency target chose for it (None when no target was consulted)."""

    shape: StepShape
    seconds: float
    predicted_s: float
    prefill_budget: int | None


class _Window:
    """The last ``size`` (features, seconds) pairs, overwritten oldest first."""

    def __init__(self, size: int) -> None:
        self.x = np.zeros((size, len(TERMS)))
        self.y = np.zeros(size)
        self.count = 0

    def add(self, features: tuple[float, ...], seconds: float) -> None:
        i = self.count % len(self.y)
        self.x[i] = features
        self.y[i] = seconds
        self.count += 1

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        n = min(self.count, len(self.y))
        return self.x[:n], self.y[:n]


class StepCostModel:
    """The online step-cost model (module docstring). Not thread-safe for writes: the engine thread observes;
    ``coefficients`` may be read from any thread (one tuple, replaced whole at each fit).

    Invariants: every coefficient is >= 0 (so predictions grow with every feature and ``max_prefill_tokens``
    is a well-defined largest chunk); with no measured step the coefficients are the prior.
    """

    def __init__(
        self,
        prior: Sequence[float] = DEFAULT_PRIOR,
        window: int = 128,
        fit_share: float = 0.01,
        iterations: int = 3,
    ) -> None:
        if len(prior) != len(TERMS) or any(v <= 0 for v in prior):
            raise ValueError(f"a prior needs {len(TERMS)} positive coefficients ({', '.join(TERMS)}), got {prior}")
        if window < len(TERMS) or not 0 < fit_share <= 1:
            raise ValueError(f"window must be >= {len(TERMS)} and fit_share within (0, 1]")
        self._prior = np.asarray(prior, dtype=float) * _SCALES  # seconds per scaled unit
        self._decode = _Window(window)
        self._prefill = _Window(window)
        self._fit_share = fit_share
        self._fit_s = 1e-4  # what the last fit took
        self._pending_s = 0.0  # measured step time since the last fit
        self._iterations = iterations
        self._theta = self._prior.copy()
        self.coefficients: tuple[float, ...] = tuple(prior)
        """Seconds per unit of each term (``TERMS`` order), as last fitted."""
        self.relative_error = 0.0
        """The robust spread of the last fit's relative residuals (1.4826 x their median absolute value)."""
        self.prefill_overrun = 0.0
        """How far the slowest step with prefill in the window ran over the last fit: the largest of
        measured / predicted - 1 (at least 0; 0 before any such step)."""

    @property
    def samples(self) -> int:
        """Steps observed since start."""
        return self._decode.count + self._prefill.count

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record a measured step; refits once the steps since the last fit took ``1 / fit_share`` times as
        long as that fit did."""
        if not seconds > 0 or not math.isfinite(seconds):
            return
        window = self._prefill if shape.prefill_tokens else self._decode
        window.add(shape.features(), seconds)
        self._pending_s += seconds
        if self._pending_s * self._fit_share >= self._fit_s:
            self.fit()

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds of a step of ``shape``."""
        c = self.coefficients
        return (
            c[0]
            + c[1] * shape.decode_rows
            + c[2] * shape.decode_context
            + c[3] * shape.prefill_tokens
            + c[4] * shape.prefill_attention
        )

    def fit(self) -> None:
        """Refit on both windows now (observe calls it on its own)."""
        started = time.perf_counter()
        self._pending_s = 0.0
        xd, yd = self._decode.rows()
        xp, yp = self._prefill.rows()
        y = np.concatenate([yd, yp])
        if not len(y):
            return
        x = np.vstack([xd, xp]) / _SCALES
        # relative error: each row divided by its measured time; the prior is a relative deviation too
        xr = x / y[:, None]
        precision = _PRIOR_WEIGHT / self._prior**2
        weights = np.ones(len(y))
        theta = self._theta
        for _ in range(self._iterations):
            theta = _nonnegative_ridge(xr, weights, precision, self._prior)
            deviation = np.abs(1.0 - xr @ theta)
            middle = len(deviation) // 2
            scale = _MAD * float(np.partition(deviation, middle)[middle]) + 1e-3
            weights = np.minimum(1.0, _HUBER * scale / np.maximum(deviation, 1e-12))
        self._theta = theta
        self.relative_error = scale
        predicted = x[len(yd) :] @ theta
        if len(predicted):  # measured over predicted, less 1, of the steps with prefill
            overrun = yp / np.maximum(predicted, 1e-12) - 1.0
            self.prefill_overrun = max(0.0, float(np.quantile(overrun, _OVERRUN_QUANTILE)))
        self.coefficients = tuple(float(v) for v in theta / _SCALES)
        self._fit_s = time.perf_counter() - started

    def decode_seconds(self, decode_rows: int, decode_context: int) -> float:
        """Predicted seconds of a step of these decodes and no prefill."""
        c = self.coefficients
        return c[0] + c[1] * decode_rows + c[2] * decode_context

    def max_prefill_tokens(
        self,
        decode_rows: int,
        decode_context: int,
        prefill_context: int,
        target_s: float,
        limit: int,
        minimum: int,
    ) -> int:
        """The most prefill tokens a step with these decodes may carry and be predicted to take at most
        ``target_s``, within ``[minimum, limit]`` (``minimum`` when not even that fits: prefill always
        advances). ``prefill_context`` is the computed tokens before the prefill (the largest, when several
        sequences prefill: the prediction then over-estimates, never under-estimates, their attention)."""
        c = self.coefficients
        spare = target_s - self.decode_seconds(decode_rows, decode_context)
        if spare <= 0:
            return min(minimum, limit)
        # c[3] n + c[4] n (prefill_context + n) <= spare: the positive root of a quadratic in n
        linear = c[3] + c[4] * prefill_context
        if c[4] > 0:
            n = (-linear + math.sqrt(linear * linear + 4 * c[4] * spare)) / (2 * c[4])
        elif linear > 0:
            n = spare / linear
        else:
            return limit
        fits = min(int(n), limit)
        while fits > 0 and self._prefill_cost(fits, prefill_context) > spare:  # float rounding at the root
            fits -= 1
        return max(min(minimum, limit), fits)

    def _prefill_cost(self, tokens: int, context: int) -> float:
        c = self.coefficients
        return c[3] * tokens + c[4] * tokens * (context + tokens)


def _nonnegative_ridge(x: np.ndarray, weights: np.ndarray, precision: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """argmin over theta >= 0 of sum w (1 - x theta)^2 + sum precision (theta - prior)^2 (relative rows ``x``):
    solve, fix the negative coefficients at 0, solve the rest again (at most once per term)."""
    free = np.ones(len(prior), dtype=bool)
    theta = np.zeros(len(prior))
    for _ in range(len(prior)):
        xf = x[:, free]
        a = xf.T @ (weights[:, None] * xf) + np.diag(precision[free])
        b = xf.T @ weights + precision[free] * prior[free]
        solved = np.linalg.solve(a, b)
        theta[:] = 0.0
        theta[free] = solved
        if (solved >= 0).all():
            return theta
        free[np.flatnonzero(free)[solved < 0]] = False
    return theta
