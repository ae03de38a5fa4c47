"""A large step runs with the larger thread count and the process's own is back after it, whatever happens."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from services.worker.engine import step_threads
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions
from services.worker.engine.step_threads import (
    LARGE_STEP_TOKENS,
    StepThreads,
    own_native_running,
    resolve_threads,
    runnable_tasks,
    usable_cores,
)
from tests.engine_support import Result, drain


@pytest.fixture()
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_automatic_is_twice_the_process_threads_at_most_its_cores(one_thread: None) -> None:
    cpu = torch.device("cpu")
    assert resolve_threads(0, cpu, 1) == min(2, usable_cores())
    assert resolve_threads(3, cpu, 1) == 3  # asked for: taken as given
    assert resolve_threads(0, torch.device("cuda"), 1) == 1  # the step's work is on the device
    assert resolve_threads(0, cpu, 2) == 1  # tensor-parallel ranks share the cores


@pytest.fixture()
def idle_box(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing else runs on the box, which has cores to spare: a large step may take every thread it asks for."""
    monkeypatch.setattr(step_threads, "runnable_tasks", lambda: 1)
    monkeypatch.setattr(step_threads, "usable_cores", lambda: 8)


def test_a_large_step_borrows_only_cores_nothing_else_runs_on(one_thread: None) -> None:
    busy = [1]
    threads = StepThreads(4, runnable=lambda: busy[0], cores=4)
    assert threads.threads_for(LARGE_STEP_TOKENS - 1) == 1  # a decode step keeps the process's own
    assert threads.threads_for(LARGE_STEP_TOKENS) == 4  # only this thread runs: all it asked for
    busy[0] = 3
    assert threads.threads_for(LARGE_STEP_TOKENS) == 2  # two others run: one core is idle
    busy[0] = 9
    assert threads.threads_for(LARGE_STEP_TOKENS) == 1  # the box is full: nothing to borrow
    busy[0] = 0  # a count that missed this thread is read as this thread alone
    assert threads.threads_for(LARGE_STEP_TOKENS) == 4
    assert StepThreads(3, runnable=lambda: None, cores=4).threads_for(LARGE_STEP_TOKENS) == 3  # no count: as asked


def test_this_process_s_own_spinning_workers_leave_their_core_to_the_step(one_thread: None) -> None:
    """After a two-thread step the box's count still holds its OpenMP worker, spinning before it sleeps: the next
    large step takes that core again instead of finding it busy; another process's task still counts."""
    busy, own = [2], [1]
    threads = StepThreads(2, runnable=lambda: busy[0], cores=2, own_workers=lambda: own[0])
    assert threads.threads_for(LARGE_STEP_TOKENS) == 2  # this thread and its own worker: the second core is ours
    busy[0] = 3
    assert threads.threads_for(LARGE_STEP_TOKENS) == 1  # and something else runs: the second core is taken
    busy[0], own[0] = 2, 0
    assert threads.threads_for(LARGE_STEP_TOKENS) == 1  # another task, not ours


def test_python_threads_are_not_counted_as_compute_workers() -> None:
    stop = threading.Event()
    spinning = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    spinning.start()
    try:
        time.sleep(0.05)
        before = own_native_running()
        assert before >= 0
        tid = str(spinning.native_id)
        assert tid in os.listdir("/proc/self/task")  # a thread of this process, maybe running: never in the count
        assert own_native_running() <= len(os.listdir("/proc/self/task")) - threading.active_count()
    finally:
        stop.set()
        spinning.join()


def test_the_box_count_includes_the_reader() -> None:
    count = runnable_tasks()
    assert count is None or count >= 1


def test_a_large_step_takes_the_threads_and_gives_them_back(one_thread: None) -> None:
    threads = StepThreads(2, runnable=lambda: 1, cores=2)
    with threads.for_step(LARGE_STEP_TOKENS - 1):
        assert torch.get_num_threads() == 1
    with threads.for_step(LARGE_STEP_TOKENS):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1
    with pytest.raises(RuntimeError), threads.for_step(4096):
        raise RuntimeError("a step failed")
    assert torch.get_num_threads() == 1


def test_negative_threads_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="prefill_threads must be >= 0"):
        EngineConfig(prefill_threads=-1)


def test_the_engine_prefills_with_the_threads_and_decodes_with_its_own(
    loaded: tuple[Any, Any], one_thread: None, idle_box: None
) -> None:
    """A 300-token prompt's prefill step runs at two threads, its decode steps at one, and the tokens are the same
    as with one thread throughout."""
    adapter, model = loaded
    prompt = adapter.tokenizer(" ".join(["word"] * 300))["input_ids"]
    assert len(prompt) >= LARGE_STEP_TOKENS
    tokens, seen = {}, []
    for threads in (2, 1):
        engine = Engine(adapter, model, EngineConfig(prefill_threads=threads))  # packs the model's linear layers
        hook = model.lm_head.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
        try:
            engine.add_request(EngineRequest(f"t{threads}", prompt, [], SamplingOptions(max_tokens=4, ignore_eos=True)))
            results: dict[str, Result] = {}
            seen.clear()
            drain(engine, results)
        finally:
            hook.remove()
        tokens[threads] = results[f"t{threads}"].tokens
        assert seen == [threads, 1, 1, 1]  # the prefill step (which samples the first token), then 3 decodes
    assert tokens[2] == tokens[1] and len(tokens[1]) == 4
