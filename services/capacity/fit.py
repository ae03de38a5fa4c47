"""Least-squares fits of measured costs to named terms, with no negative coefficient.

A term is `1` (a constant) or a product of variable names joined by `*` (`tokens*tokens`, `batch*context`).
Invariant: every coefficient of a `LinearFit` is >= 0, so a fitted cost never falls as a variable grows
(for non-negative variables) and is never negative: a term whose unconstrained coefficient comes out
negative is dropped (coefficient 0) and the rest refitted, until none is (an active-set method: on
noisy timings a small negative quadratic term would otherwise make large sizes look cheap).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


class FitError(ValueError):
    """Too few points for the terms, or a point lacking a variable or the target."""


@dataclass(frozen=True)
class LinearFit:
    """`target = sum(coefficients[i] * term_i(variables))`; `rms` is the fit's root-mean-square residual."""

    terms: tuple[str, ...]
    coefficients: tuple[float, ...]
    rms: float = 0.0

    def __call__(self, **variables: float) -> float:
        return sum(c * _term(t, variables) for t, c in zip(self.terms, self.coefficients, strict=True))

    def coefficient(self, term: str) -> float:
        """The coefficient of `term` (0 when the fit has no such term)."""
        return dict(zip(self.terms, self.coefficients, strict=True)).get(term, 0.0)

    def to_json(self) -> dict[str, Any]:
        return {"terms": list(self.terms), "coefficients": list(self.coefficients), "rms": self.rms}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LinearFit:
        terms = tuple(str(t) for t in data["terms"])
        coefficients = tuple(float(c) for c in data["coefficients"])
        if len(terms) != len(coefficients):
            raise FitError(f"a fit has {len(terms)} terms but {len(coefficients)} coefficients")
        return cls(terms, coefficients, float(data.get("rms", 0.0)))


def fit(points: Sequence[Mapping[str, Any]], target: str, terms: Sequence[str], *, relative: bool = False) -> LinearFit:
    """Fit `target` over `points` (dicts of variables and the target) to `terms`, coefficients >= 0.

    `relative` minimises relative rather than absolute residuals (each point weighted by 1 / its target, which
    must then be > 0): timings spanning orders of magnitude would otherwise fit the largest and miss the small
    ones by more than their size. `rms` is in the target's unit either way. Raises FitError when there are
    fewer distinct points than terms, a point lacks a name, or (`relative`) a target is not positive.
    """
    if not terms:
        raise FitError("a fit needs at least one term")
    try:
        rows = np.array([[_term(t, p) for t in terms] for p in points], dtype=float)
        values = np.array([float(p[target]) for p in points], dtype=float)
    except KeyError as exc:
        raise FitError(f"a point lacks {exc.args[0]!r}") from None
    if len(points) < len(terms) or np.linalg.matrix_rank(rows) < len(terms):
        raise FitError(f"{len(points)} points do not determine the {len(terms)} terms {list(terms)}")
    weights = np.ones(len(values))
    if relative:
        if np.any(values <= 0):
            raise FitError(f"a relative fit needs every {target} above 0")
        weights = 1.0 / values
    weighted_rows, weighted_values = rows * weights[:, None], values * weights
    active = list(range(len(terms)))
    coefficients = np.zeros(len(terms))
    while active:
        solution, *_ = np.linalg.lstsq(weighted_rows[:, active], weighted_values, rcond=None)
        coefficients = np.zeros(len(terms))
        coefficients[active] = solution
        negative = [i for i in active if coefficients[i] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda i: coefficients[i]))  # drop the most negative, refit
    coefficients = np.clip(coefficients, 0.0, None)
    residuals = values - rows @ coefficients
    rms = math.sqrt(float(np.mean(residuals**2))) if len(values) else 0.0
    return LinearFit(tuple(terms), tuple(float(c) for c in coefficients), rms)


def _term(term: str, variables: Mapping[str, float]) -> float:
    if term == "1":
        return 1.0
    value = 1.0
    for name in term.split("*"):
        value *= float(variables[name])
    return value
