"""The engine host is one interface: the thread host and the process host offer every member of `EngineHost`."""

from __future__ import annotations

import pytest

from services.worker.engine_host.host import EngineHost
from services.worker.engine_host.process_host import EngineProcess
from services.worker.engine_host.thread_host import EngineLoop

MEMBERS = sorted(
    name
    for name in {*EngineHost.__dict__, *EngineHost.__annotations__}
    if not name.startswith("_") and name not in {"register"}
)


@pytest.mark.parametrize("host", [EngineLoop, EngineProcess], ids=["thread", "process"])
def test_each_host_offers_the_whole_interface(host: type) -> None:
    assert {"add_admitted", "abort", "deliver", "kv_state", "snapshot", "start", "stop"} <= set(MEMBERS)
    instance_attributes = set(host.__init__.__code__.co_names)  # attributes set in __init__ (self.x = ...)
    missing = [name for name in MEMBERS if not hasattr(host, name) and name not in instance_attributes]
    assert not missing, f"{host.__name__} lacks {missing}"
