"""The thread host's commands when their caller gives up: a future cancelled while its command is queued (a gRPC call
cancelled while awaiting it through `asyncio.wrap_future`) runs nothing, and the loop goes on serving every other
request; before, setting the cancelled future's result raised on the engine thread, which then failed every
running request as if a step had failed."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from services.worker.engine_host.thread_host import EngineLoop


class _IdleEngine:
    """Just what the loop asks of an engine with no work; admissions always fit."""

    def __init__(self) -> None:
        self.kv_connector = SimpleNamespace(outbox=[])
        self.admitted: list[str] = []
        self.aborted: list[str] = []

    def bind_thread(self) -> None: ...

    def has_work(self) -> bool:
        return False

    def command_budget_s(self) -> None:
        return None

    def kv_state(self) -> None:
        return None

    def admit(self, request: SimpleNamespace, prepared: list | None = None) -> bool:
        self.admitted.append(request.request_id)
        return True

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def test_a_command_cancelled_while_queued_runs_nothing_and_fails_no_request() -> None:
    engine = _IdleEngine()
    loop = EngineLoop(engine)
    delivered: list = []
    loop.deliver = delivered.extend
    loop.start()
    try:
        running = SimpleNamespace(request_id="running")
        assert loop.add_admitted(running, lambda out: None).result(timeout=10) is not None
        gate = threading.Event()
        blocked = loop.submit(lambda e: gate.wait(10))  # holds the engine thread: what follows stays queued
        late = loop.add_admitted(SimpleNamespace(request_id="left"), lambda out: None)
        assert late.cancel()  # its caller left before it ran
        gate.set()
        assert blocked.result(timeout=10) is True
        assert loop.submit(lambda e: "still serving").result(timeout=10) == "still serving"
    finally:
        loop.stop()
    assert engine.admitted == ["running"]  # the cancelled admission reserved nothing
    assert engine.aborted == [] and delivered == []  # no request failed for it
