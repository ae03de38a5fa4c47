"""Prefill/decode roles: `EPD_WORKER_ROLE` read once with the engine's settings, refused where a transfer cannot
work, and each engine's KV layout identity published through a real Redis for the router to pair on."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from services.common import config as config_lib
from services.common.config import ConfigError
from services.common.kv_layout import KVLayout
from services.common.registry import Registry
from services.router.cluster_view import ClusterView
from services.worker.config import WorkerConfig
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.startup import published_layout, registry_role
from tests.redis_server import RedisServer


def test_role_is_an_engine_setting_read_from_env() -> None:
    worker = config_lib.load(WorkerConfig, env={"EPD_MODEL": "/m", "EPD_WORKER_ROLE": "prefill"})
    worker.validate()
    assert worker.worker_role == "prefill" and worker.engine_config().worker_role == "prefill"
    assert WorkerConfig().worker_role == EngineConfig().worker_role == "both"
    assert registry_role("prefill") == "prefill" and registry_role("decode") == registry_role("both") == "worker"


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"EPD_WORKER_ROLE": "encode"}, "EPD_WORKER_ROLE must be one of"),
        ({"EPD_WORKER_ROLE": "decode", "EPD_TENSOR_PARALLEL_SIZE": "2"}, "not built"),
        ({"EPD_WORKER_ROLE": "decode", "EPD_OVERCOMMIT": "1.5"}, "EPD_OVERCOMMIT=1"),
    ],
)
def test_roles_refused(env: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        config_lib.load(WorkerConfig, env={"EPD_MODEL": "/m", **env}).validate()


def _engine(loaded: tuple[Any, Any], **settings: Any) -> Engine:
    adapter, model = loaded
    return Engine(adapter, model, EngineConfig(kv_cache_bytes=1 << 20, **settings))


def test_layouts_published_and_paired(loaded: tuple[Any, Any], redis_server: RedisServer, tiny_model_dir: Path) -> None:
    """Engines at the same settings publish equal identities (the router pairs them); another block size, another
    layout or another model revision is a different identity, never paired."""
    text = loaded[1].config.get_text_config()
    same = _engine(loaded, attention_backend="sdpa", block_size=16, worker_role="decode").kv_state().kv_layout
    assert same == KVLayout("", "float32", text.num_hidden_layers, text.num_key_value_heads,
                            text.hidden_size // text.num_attention_heads, 16, "head-major", 1)  # fmt: skip
    prefill = _engine(loaded, attention_backend="sdpa", block_size=16, worker_role="prefill").kv_layout
    bigger = _engine(loaded, attention_backend="sdpa", block_size=32).kv_layout
    paged = _engine(loaded, attention_backend="flash-reference", block_size=16).kv_layout
    assert prefill == same and bigger != same and paged.layout == "paged" and paged != same

    registry = Registry(redis_server.url, ttl_s=30)
    base = {"total_blocks": 8, "reserved_blocks": 0, "running": 0, "waiting": 0, "block_size": 16}

    def publish(role: str, address: str, layout: KVLayout, revision: str = "rev") -> None:
        state = {**base, "worker_role": role, "kv_layout": published_layout(layout, revision)}
        assert registry.publish(registry_role(role), address, "rev", state)

    publish("decode", "d:1", same)
    publish("prefill", "p:1", prefill)
    publish("prefill", "p:2", bigger)
    publish("prefill", "p:3", paged)
    publish("prefill", "p:4", prefill, revision="other-weights")
    view = ClusterView(registry, "rev")
    asyncio.run(view.refresh())
    workers = view.workers()
    assert [(w.address, w.worker_role) for w in workers] == [("d:1", "decode")]  # prefill workers are not placed on
    decode = workers[0]
    assert decode.kv_layout == dataclasses.replace(same, model_revision="rev")
    assert [w.address for w in view.prefill_workers_for(decode)] == ["p:1"]
    assert view.prefill_workers_for(dataclasses.replace(decode, kv_layout=None)) == []
    registry.close()


def test_an_absence_watch_fires_once_at_the_refresh_that_passes_its_time(redis_server: RedisServer) -> None:
    """`on_absent`: a worker missing from the registry for the watch's time has its callback called once, by the
    view's refresh; a withdrawn watch and one on a worker still listed are never called."""
    registry = Registry(redis_server.url, ttl_s=30)
    state = {"total_blocks": 8, "reserved_blocks": 0, "running": 0, "waiting": 0, "block_size": 16}
    for address in ("gone:1", "kept:1"):
        assert registry.publish("worker", address, "rev", state)
    view = ClusterView(registry, "rev")
    fired: list[str] = []

    async def run() -> None:
        await view.refresh()
        view.on_absent("gone:1", 0.2, lambda: fired.append("gone"))
        view.on_absent("gone:1", 0.2, lambda: fired.append("withdrawn"))()
        view.on_absent("kept:1", 0.2, lambda: fired.append("kept"))
        registry.withdraw("worker", "gone:1")
        await view.refresh()
        assert fired == []  # missing, but not yet for 0.2 s
        for _ in range(6):
            await asyncio.sleep(0.06)
            await view.refresh()

    asyncio.run(run())
    registry.close()
    assert fired == ["gone"]
