"""EngineProcess: the engine in a real child process (spawned, the tiny model loaded there) behind EngineLoop's
interface; its answers equal the in-process engine loop's, refusals and aborts drop the sinks, the KV snapshot and
step timings come back, a start-up failure names its reason, and a dead child fails what was running."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.common import config as config_lib
from services.worker.config import WorkerConfig
from services.worker.engine.request import EngineRequest, SamplingOptions
from services.worker.engine_host.process_host import EngineGone, EngineProcess
from services.worker.engine_host.thread_host import EngineLoop
from tests.engine_support import build_prompt, image

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], list(range(20, 90)), [100, 3, 100, 3, 7]]


class Stream:
    """One request's outputs as a sink sees them, on the thread that delivers them."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.failed = False
        self.freed = threading.Event()

    def __call__(self, output: Any) -> None:
        if output is None:
            self.failed = True
            self.freed.set()
            return
        self.tokens.extend(output.new_token_ids)
        if output.request_finished:
            self.freed.set()


def config(model_dir: Path, **overrides: Any) -> WorkerConfig:
    """A worker's settings as a worker loads them (validated: its dtype the folder's), whatever this shell sets."""
    settings = {"model": str(model_dir), "kv_cache_bytes": 8 << 20, "torch_threads": 1, **overrides}
    return config_lib.load(WorkerConfig, env={}, **settings)


CHILD_LOST = threading.Event()
"""Set by the module's engine process when its child is gone (the last test kills it)."""


@pytest.fixture(scope="module")
def process(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    CHILD_LOST.clear()
    engine = EngineProcess(config(tiny_model_dir, itl_target_ms=50.0), on_lost=CHILD_LOST.set)
    engine.start(timeout_s=120)
    yield engine
    engine.stop()


def all_free(loop: Any, timeout_s: float = 10.0) -> bool:
    """Whether the loop's KV snapshot shows every block free and none reserved within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = loop.kv_state
        if state.free_blocks == state.total_blocks and state.reserved_blocks == 0 and state.running == 0:
            return True
        time.sleep(0.01)
    return False


def run(loop: Any, requests: list[EngineRequest], embeddings: dict | None = None) -> dict[str, Stream]:
    streams = {r.request_id: Stream() for r in requests}
    for request in requests:
        assert loop.add_admitted(request, streams[request.request_id]).result(timeout=30) is not None
    for mm_hash, tensor in (embeddings or {}).items():
        loop.provide_embedding(mm_hash, tensor)
    for stream in streams.values():
        assert stream.freed.wait(60)
    return streams


def test_answers_equal_the_engine_loops_and_the_state_comes_back(
    process: EngineProcess, loaded: tuple[Any, Any]
) -> None:
    """Greedy and seeded sampling, an image prompt with its embedding sent over: the same tokens as an
    EngineLoop in this process; afterwards the child's snapshot shows every block free, each finished request's
    freeing time arrived before its last output, and the step timings reached `on_step`."""
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import Engine

    adapter, model = loaded
    timings: list[Any] = []
    process.on_step = timings.append
    picture = build_prompt(adapter, model, [image(300, 200, seed=3), "What is it?"])

    def requests() -> list[EngineRequest]:
        greedy = [
            EngineRequest(f"r{i}", ids, [], SamplingOptions(max_tokens=12, ignore_eos=True))
            for i, ids in enumerate(PROMPTS)
        ]
        seeded = EngineRequest("s", PROMPTS[1], [], SamplingOptions(max_tokens=12, temperature=0.8, seed=7))
        return [*greedy, seeded, picture.request("img", SamplingOptions(max_tokens=8, ignore_eos=True))]

    local = EngineLoop(Engine(adapter, model, EngineConfig(kv_cache_bytes=8 << 20, itl_target_ms=50.0)))
    local.start()
    try:
        want = run(local, requests(), picture.embeddings)
    finally:
        local.stop()
    got = run(process, requests(), picture.embeddings)
    assert {k: s.tokens for k, s in got.items()} == {k: s.tokens for k, s in want.items()}
    assert all(len(s.tokens) > 0 for s in got.values())
    assert set(got) <= set(process.finished_at)
    assert timings and all(t.seconds > 0 for t in timings)
    assert all_free(process)
    assert process.step_costs.coefficients != ()


def test_refusals_and_aborts_drop_the_sink_and_free_the_blocks(process: EngineProcess) -> None:
    state = process.kv_state
    too_big = EngineRequest("big", [5] * 8, [], SamplingOptions(max_tokens=state.total_blocks * state.block_size))
    with pytest.raises(ValueError, match="needs 1025 KV blocks"):  # the engine's own error crosses over as itself
        process.add_admitted(too_big, Stream()).result(timeout=30)
    empty = EngineRequest("empty", [], [], SamplingOptions(max_tokens=4))  # refused as the child prepares it
    with pytest.raises(ValueError, match="has no prompt tokens"):
        process.add_admitted(empty, Stream()).result(timeout=30)
    assert "big" not in process._sinks and "empty" not in process._sinks
    hold = EngineRequest("hold", [5] * 8, [], SamplingOptions(max_tokens=(state.total_blocks - 2) * state.block_size))
    held = Stream()
    assert process.add_admitted(hold, held).result(timeout=30) is not None
    refused = Stream()
    second = EngineRequest("second", [5] * 8, [], SamplingOptions(max_tokens=4 * state.block_size))
    assert process.add_admitted(second, refused).result(timeout=30) is None  # no room left to reserve
    assert process.abort("hold").result(timeout=30) is True
    assert not refused.tokens and "second" not in process._sinks and "hold" not in process._sinks

    long = Stream()
    started = threading.Event()

    def sink(output: Any) -> None:
        long(output)
        started.set()

    process.add_admitted(EngineRequest("long", PROMPTS[0], [], SamplingOptions(max_tokens=4000, ignore_eos=True)), sink)
    assert started.wait(30)
    assert process.abort("long").result(timeout=30) is True
    seen = len(long.tokens)
    assert process.abort("long").result(timeout=30) is False  # already gone
    assert all_free(process)  # the snapshot follows the abort's reply within an engine-loop iteration
    assert len(long.tokens) == seen and not long.freed.is_set()  # nothing reached the sink after the abort


def test_a_failing_step_callback_costs_no_tokens(process: EngineProcess) -> None:
    def broken(timing: Any) -> None:
        raise RuntimeError("a metrics exporter bug")

    process.on_step = broken
    try:
        request = EngineRequest("cb", PROMPTS[1], [], SamplingOptions(max_tokens=10, ignore_eos=True))
        streams = run(process, [request])
    finally:
        process.on_step = None
    assert len(streams["cb"].tokens) == 10 and not streams["cb"].failed


def test_the_tower_runs_in_the_child(process: EngineProcess, loaded: tuple[Any, Any]) -> None:
    """Co-located encoding: the child's vision tower gives the embedding this process's tower gives."""
    from services.models.vision_runner import VisionRunner

    adapter, model = loaded
    picture = image(300, 200, seed=3)
    (want,) = VisionRunner(adapter, model).encode([picture]).embeddings
    (got,) = process.encode([picture]).embeddings
    assert got.shape == want.shape and (got - want).abs().max().item() < 1e-5


def test_a_kept_embedding_serves_later_requests_until_forgotten(
    process: EngineProcess, loaded: tuple[Any, Any]
) -> None:
    """An embedding sent with `keep` serves a later request of the same image (a prompt that differs before it, so
    the prefix cache does not cover it) without being sent again; once forgotten, a request waits for it."""
    adapter, model = loaded
    photo = image(120, 90, seed=11)
    prompts = [build_prompt(adapter, model, [text, photo, "What is it?"]) for text in ("First", "Second", "Third")]
    (mm_hash,) = prompts[0].embeddings
    greedy = SamplingOptions(max_tokens=6, ignore_eos=True)
    process.provide_embedding(mm_hash, prompts[0].embeddings[mm_hash], keep=True)
    first = run(process, [prompts[0].request("k0", greedy)])  # ends before the next is admitted: nothing pins it
    later = run(process, [prompts[1].request("k1", greedy)])
    assert len(first["k0"].tokens) == len(later["k1"].tokens) == 6
    process.forget_embedding(mm_hash)
    waiting = Stream()
    assert process.add_admitted(prompts[2].request("k2", greedy), waiting).result(timeout=30) is not None
    assert not waiting.freed.wait(1.0) and waiting.tokens == []  # nothing past the image without its embedding
    process.provide_embedding(mm_hash, prompts[2].embeddings[mm_hash])
    assert waiting.freed.wait(60) and len(waiting.tokens) == 6
    assert all_free(process)


def test_a_start_up_failure_names_its_reason(tmp_path: Path) -> None:
    engine = EngineProcess(config(tmp_path / "no-model"))
    with pytest.raises(RuntimeError, match="the engine process failed to start: .*no-model"):
        engine.start(timeout_s=120)


def test_a_dead_child_fails_the_running_requests(process: EngineProcess) -> None:
    """Kill the child mid-stream: the running request's sink gets None, new calls fail, `on_lost` runs. Last here:
    the module's engine process is the one killed."""
    stream = Stream()
    started = threading.Event()

    def sink(output: Any) -> None:
        stream(output)
        started.set()

    request = EngineRequest("long", PROMPTS[0], [], SamplingOptions(max_tokens=8000, ignore_eos=True))
    process.add_admitted(request, sink)
    assert started.wait(30)
    assert not CHILD_LOST.is_set()
    os.kill(process.pid, signal.SIGKILL)
    assert CHILD_LOST.wait(30) and stream.freed.wait(5) and stream.failed
    with pytest.raises(EngineGone, match="engine process is gone"):
        process.abort("long").result(timeout=5)


@pytest.mark.parametrize(
    ("settings", "in_child"),
    [
        ({}, True),  # the default, auto: a CPU worker of role both, one rank
        ({"EPD_DEVICE": "cuda"}, False),  # the child has not run on a GPU: the thread host there
        ({"EPD_WORKER_ROLE": "prefill"}, False),  # KV transfer runs on the thread host only
        ({"EPD_TENSOR_PARALLEL_SIZE": "2"}, False),  # ranks are spawned by the thread host's engine
        ({"EPD_ENGINE_PROCESS": "off"}, False),
        ({"EPD_ENGINE_PROCESS": "false"}, False),
        ({"EPD_ENGINE_PROCESS": "true", "EPD_DEVICE": "cuda"}, True),
    ],
    ids=str,
)
def test_where_the_engine_runs(settings: dict[str, str], in_child: bool) -> None:
    config = config_lib.load(WorkerConfig, env={"EPD_MODEL": "/m", **settings})
    assert config.engine_in_child() is in_child


def test_an_unknown_engine_process_setting_is_refused_by_name() -> None:
    with pytest.raises(config_lib.ConfigError, match="EPD_ENGINE_PROCESS: 'sometimes' is not one of auto, on, off"):
        config_lib.load(WorkerConfig, env={"EPD_MODEL": "/m", "EPD_ENGINE_PROCESS": "sometimes"})
    with pytest.raises(config_lib.ConfigError, match="EPD_WORKER_ROLE=decode with EPD_ENGINE_PROCESS=on"):
        config_lib.load(WorkerConfig, env={"EPD_MODEL": "/m", "EPD_ENGINE_PROCESS": "on", "EPD_WORKER_ROLE": "decode"})
