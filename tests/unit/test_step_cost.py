"""The step-cost model and the latency target: fits synthetic step times, budgets that fit, minimum progress,
and what the engine times."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.engine.itl_target import COMMAND_SHARE, ItlTarget
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.step_cost import DEFAULT_PRIOR, TERMS, StepCostModel, StepShape, StepTiming

# A made-up machine: 3 ms a step, 0.15 ms a decode row, 0.8 ms per 4096 decode context tokens, 90 us a
# prefill token, and attention making a 2048-token chunk from scratch cost another 125 ms.
TRUE = (3e-3, 1.5e-4, 2e-7, 9e-5, 3e-8)


def true_cost(shape: StepShape) -> float:
    return sum(c * f for c, f in zip(TRUE, shape.features(), strict=True))


def random_shape(rng: random.Random) -> StepShape:
    """Steps of 0-32 decode rows; without rows, or two times in five, with a prefill chunk of 16-2048 tokens
    at a context of 0-1500."""
    rows = rng.randint(0, 32)
    context = sum(rng.randint(20, 1500) for _ in range(rows))
    if rows and rng.random() < 0.6:
        return StepShape(rows, context)
    tokens, start = rng.randint(16, 2048), rng.randint(0, 1500)
    return StepShape(rows, context, tokens, tokens * (start + tokens))


def fitted(seed: int = 1, steps: int = 400, noise: float = 0.05, outliers: float = 0.05) -> StepCostModel:
    """A model fed ``steps`` synthetic steps: the true cost times 1 + N(0, noise), and a share of outliers
    stalled by 10-60 ms more (a noisy machine)."""
    rng = random.Random(seed)
    model = StepCostModel()
    for _ in range(steps):
        shape = random_shape(rng)
        seconds = true_cost(shape) * (1 + rng.gauss(0, noise))
        if rng.random() < outliers:
            seconds += rng.uniform(0.01, 0.06)
        model.observe(shape, seconds)
    model.fit()  # observe refits by elapsed time (a loaded box fits less often): end on a fit of every step
    return model


FITTED = {seed: fitted(seed) for seed in (1, 2, 3)}


def test_shape_of_chunks_counts_decode_rows_and_prefill_attention() -> None:
    chunks = [
        ScheduledChunk(None, 40, 1, True),
        ScheduledChunk(None, 9, 1, True),  # type: ignore[arg-type]
        ScheduledChunk(None, 100, 50, False),
        ScheduledChunk(None, 0, 16, True),
    ]  # type: ignore[arg-type]
    assert StepShape.of(chunks) == StepShape(2, 41 + 10, 66, 50 * 150 + 16 * 16)
    assert StepShape.of([]) == StepShape()


def test_before_any_step_the_prior_predicts() -> None:
    model = StepCostModel()
    assert model.coefficients == DEFAULT_PRIOR and model.samples == 0
    assert model.predict(StepShape(8, 800)) == pytest.approx(2e-3 + 8 * 1e-4 + 800 * 1e-7)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fits_synthetic_step_times_with_noise_and_outliers(seed: int) -> None:
    model = fitted(seed)
    by_term = dict(zip(TERMS, model.coefficients, strict=True))
    for term, truth in zip(TERMS, TRUE, strict=True):
        if term == "decode_context":  # the smallest term (under 10 % of a step): loosely identified
            assert 0.5 * truth < by_term[term] < 1.5 * truth, (term, by_term[term], truth)
        else:
            assert by_term[term] == pytest.approx(truth, rel=0.15), term
    rng = random.Random(seed + 100)
    errors = sorted(abs(model.predict(s) / true_cost(s) - 1) for s in (random_shape(rng) for _ in range(200)))
    assert errors[len(errors) // 2] < 0.05 and errors[-1] < 0.2
    assert model.relative_error < 0.1  # about the 5 % noise, the outliers set aside


def test_outliers_do_not_drag_the_fit() -> None:
    clean, noisy = fitted(4, outliers=0.0), fitted(4, outliers=0.1)
    for ours, theirs in zip(noisy.coefficients, clean.coefficients, strict=True):
        assert ours == pytest.approx(theirs, rel=0.15, abs=1e-9)


def test_a_long_quiet_spell_does_not_forget_what_prefill_costs() -> None:
    model = fitted(5)
    prefill = model.coefficients[3:]
    rng = random.Random(6)
    for _ in range(2000):  # decode-only steps only, far more than a window
        shape = StepShape(8, 8 * rng.randint(100, 900))
        model.observe(shape, true_cost(shape))
    model.fit()
    assert model.coefficients[3:] == pytest.approx(prefill, rel=0.2)


def test_coefficients_never_go_negative() -> None:
    model = StepCostModel()
    for rows in range(1, 200):  # decode cost falling with rows: least squares alone would go negative
        model.observe(StepShape(rows, 100 * rows), 0.01 - rows * 1e-5)
    model.fit()
    assert min(model.coefficients) >= 0
    assert model.coefficients[1] == model.coefficients[2] == 0.0  # the constraint held them, not the data
    assert model.predict(StepShape(150, 15000)) == pytest.approx(0.0087, rel=0.05)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 64),
    per_row_context=st.integers(1, 4000),
    prefill_context=st.integers(0, 8000),
    target_ms=st.floats(0.5, 500),
    limit=st.integers(1, 8192),
    seed=st.integers(1, 3),
)
def test_budgets_never_predict_over_the_target_and_are_the_largest(
    rows: int, per_row_context: int, prefill_context: int, target_ms: float, limit: int, seed: int
) -> None:
    model = FITTED[seed]
    target, minimum = target_ms / 1000, 16
    budget = model.max_prefill_tokens(rows, rows * per_row_context, prefill_context, target, limit, minimum)
    assert min(minimum, limit) <= budget <= limit

    def predicted(tokens: int) -> float:
        return model.predict(StepShape(rows, rows * per_row_context, tokens, tokens * (prefill_context + tokens)))

    if budget > minimum:
        assert predicted(budget) <= target * (1 + 1e-9)
    if budget < limit:  # one more token would not fit (or the minimum already does not)
        assert predicted(budget + 1) > target * (1 - 1e-9)


def test_minimum_progress_when_decodes_alone_exceed_the_target() -> None:
    model = FITTED[1]
    assert model.predict(StepShape(64, 64 * 2000)) > 0.005
    assert model.max_prefill_tokens(64, 64 * 2000, 0, 0.005, 2048, 16) == 16
    assert model.max_prefill_tokens(64, 64 * 2000, 0, 0.005, 8, 16) == 8  # never over the step's budget
    target = ItlTarget(0.005, model, minimum=16)
    assert target.prefill_budget(64, 64 * 2000, 0, 2048) == 16


def test_no_decodes_take_the_full_budget() -> None:
    target = ItlTarget(0.001, FITTED[1], minimum=16)  # a target nothing fits
    assert target.prefill_budget(0, 0, 0, 2048) == 2048
    assert target.prefill_budget(1, 100, 0, 2048) == 16


def test_budget_shrinks_with_decodes_and_context_and_grows_with_the_target() -> None:
    model = FITTED[2]

    def budget(rows: int, start: int, target_ms: float) -> int:
        return model.max_prefill_tokens(rows, rows * 500, start, target_ms / 1000, 8192, 16)

    assert budget(4, 0, 40) > budget(32, 0, 40) > 16
    assert budget(8, 0, 40) > budget(8, 2000, 40)
    assert budget(8, 0, 80) > budget(8, 0, 40)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        StepCostModel(prior=(1.0, 0.0, 1.0, 1.0, 1.0))
    with pytest.raises(ValueError):
        ItlTarget(0.0, StepCostModel(), 16)
    with pytest.raises(ValueError):
        ItlTarget(0.01, StepCostModel(), 0)


def test_target_plans_under_itself_by_the_recent_overrun() -> None:
    model = fitted(7, outliers=0.1)
    assert model.prefill_overrun > 0
    target = ItlTarget(0.04, model, minimum=16)
    assert target.planned_s() == pytest.approx(0.04 / (1 + min(max(model.prefill_overrun, 0.15), 0.5)))
    budget = target.prefill_budget(8, 8 * 500, 300, 8192)
    assert model.predict(StepShape(8, 8 * 500, budget, budget * (300 + budget))) <= target.planned_s() < 0.04


def test_time_already_waited_comes_off_the_plan() -> None:
    """What the decodes waited before the step (the engine loop's commands) is planned out of the step."""
    model = FITTED[2]
    target = ItlTarget(0.04, model, minimum=16)
    fresh, late = target.prefill_budget(8, 4000, 300, 8192), target.prefill_budget(8, 4000, 300, 8192, 0.01)
    assert 16 < late < fresh

    def predicted(tokens: int) -> float:
        return model.predict(StepShape(8, 4000, tokens, tokens * (300 + tokens)))

    assert predicted(late) <= target.planned_s() - 0.01 < predicted(late + 1)
    assert target.prefill_budget(8, 4000, 300, 8192, target.planned_s()) == 16  # nothing left: the minimum
    assert target.command_budget_s() == pytest.approx(0.04 * COMMAND_SHARE)


def test_relative_target_is_a_multiple_of_the_decodes_own_step() -> None:
    """A relative target: ``factor`` times the predicted decode-only step of the step's decodes, so more or longer
    decodes allow a longer step; the planned step fits under it, and the command budget follows it."""
    model = fitted(7, outliers=0.1)
    target = ItlTarget(0.0, model, minimum=16, factor=6.0)
    for rows, context in ((4, 4 * 300), (32, 32 * 300), (32, 32 * 1500)):
        budget = target.prefill_budget(rows, context, 300, 8192)
        alone = model.decode_seconds(rows, context)
        assert target.last_target_s == pytest.approx(6.0 * alone)
        assert target.command_budget_s() == pytest.approx(6.0 * alone * COMMAND_SHARE)
        step = model.predict(StepShape(rows, context, budget, budget * (300 + budget)))
        assert 16 < budget < 8192 and step <= target.planned_s() < 6.0 * alone
    assert target.prefill_budget(32, 32 * 300, 300, 8192) > target.prefill_budget(4, 4 * 300, 300, 8192)


def test_engine_target_setting_chooses_time_factor_or_none() -> None:
    from services.worker.engine.config import EngineConfig

    model = StepCostModel()
    assert ItlTarget.of(EngineConfig(block_size=16), model) is None  # off by default
    relative = ItlTarget.of(EngineConfig(block_size=16, itl_target_factor=6.0), model)
    assert relative is not None and relative.factor == 6.0 and relative.target_s == 0.0
    timed = ItlTarget.of(EngineConfig(block_size=16, itl_target_ms=25.0, itl_target_factor=6.0), model)
    assert timed is not None and timed.target_s == 0.025 and timed.factor == 0.0  # a time wins over the factor
    with pytest.raises(ValueError, match="itl_target_factor"):
        EngineConfig(itl_target_factor=-1.0).check()
    with pytest.raises(ValueError, match="not both"):
        ItlTarget(0.02, model, 16, factor=6.0)


@pytest.mark.parametrize("itl_target_ms", [0.0, 20.0])
def test_engine_loop_bounds_its_commands_between_steps_under_a_target(
    loaded: tuple[Any, Any], itl_target_ms: float
) -> None:
    """While a sequence decodes under a 20 ms target, commands between two steps run for at most a quarter of it
    (5 ms): six commands of at least 3 ms each spread over at least three gaps, never more than two in one.
    Without a target they all run in the first gap after they were queued."""
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import Engine
    from services.worker.engine.request import EngineRequest, SamplingOptions
    from services.worker.engine_host.thread_host import EngineLoop

    adapter, model = loaded
    config = EngineConfig(kv_cache_bytes=4 << 20, max_model_len=1024, itl_target_ms=itl_target_ms)
    engine = Engine(adapter, model, config)
    steps = []
    engine.on_step = steps.append
    loop = EngineLoop(engine)
    loop.start()
    try:
        decoding = threading.Event()
        request = EngineRequest("a", [5, 6, 7, 8], [], SamplingOptions(max_tokens=800, ignore_eos=True))
        loop.add_request(request, lambda out: decoding.set())
        assert decoding.wait(30)
        block = threading.Event()
        loop.submit(lambda e: block.wait(10))  # hold the loop so that all six are queued before any runs
        ran = [loop.submit(lambda e: (time.sleep(0.003), len(steps))[1]) for _ in range(6)]
        block.set()
        at_step = [f.result(timeout=30) for f in ran]
    finally:
        loop.stop()
    per_gap = [at_step.count(n) for n in sorted(set(at_step))]
    if itl_target_ms:
        assert max(per_gap) <= 2 and len(per_gap) >= 3, at_step
    else:
        assert per_gap == [6], at_step


def test_engine_times_a_step_from_the_last_tokens_while_sequences_decode(
    loaded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The time between two steps (the engine loop's work) is part of the decoding sequences' inter-token time;
    after a step that left nothing decoding, a step is timed from its own start. On the engine's own clock,
    which moves a millisecond per reading and else only when the test says so."""
    from services.worker.engine import engine as engine_module
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import Engine
    from services.worker.engine.request import EngineRequest, SamplingOptions

    now = [0.0]

    def perf_counter() -> float:
        now[0] += 0.001
        return now[0]

    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=perf_counter))
    adapter, model = loaded
    engine = Engine(adapter, model, EngineConfig(kv_cache_bytes=4 << 20, max_model_len=512))
    timings: list[StepTiming] = []
    engine.on_step = timings.append
    engine.add_request(EngineRequest("a", [5, 6, 7, 8], [], SamplingOptions(max_tokens=3, ignore_eos=True)))
    engine.step()  # prefill, samples the first token; "a" decodes on
    now[0] += 0.05  # the loop's work between two steps
    engine.step()
    assert timings[-1].shape == StepShape(1, 5) and timings[-1].seconds >= 0.05
    engine.step()  # the last token: "a" ends
    now[0] += 1000.0  # idle: not anybody's inter-token time
    engine.add_request(EngineRequest("b", [9, 10], [], SamplingOptions(max_tokens=1, ignore_eos=True)))
    engine.step()
    assert timings[-1].shape == StepShape(0, 0, 2, 4) and timings[-1].seconds < 1.0
    assert engine.step_costs.samples == 4


def test_observe_refits_once_the_steps_outweigh_the_last_fit() -> None:
    model = StepCostModel(fit_share=0.5)
    model.observe(StepShape(8, 800), 1.0)  # a second of steps against a fit of ~0.1 ms: refit now
    assert model.coefficients != DEFAULT_PRIOR
    fitted_once = model.coefficients
    model.observe(StepShape(8, 800), 1e-9)  # far less than the fit took: no refit
    assert model.coefficients == fitted_once
