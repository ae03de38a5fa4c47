"""A service is healthy only once routers can find it: its first registry publish comes before SERVING.

Real Redis (a private server) and a real gRPC server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import grpc_server
from services.common.registry import Heartbeat, Registry
from tests.redis_server import RedisServer


async def _status(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return reply.status


def test_first_publish_is_awaited_and_health_follows_it(redis_server: RedisServer) -> None:
    async def scenario() -> tuple[int, bool, list[str], int]:
        running = await grpc_server.start_server("127.0.0.1", 0, [], serving=False)
        registry = Registry(redis_server.url, ttl_s=5.0)
        heartbeat = Heartbeat(registry, "worker", f"127.0.0.1:{running.port}", "rev", lambda: {"n": 1}, 60.0)
        try:
            before = await _status(running.port)
            published = await heartbeat.start()  # the loop's next publish is a minute away: this one counts
            members = [m.address for m in registry.members("worker") or []]
            await running.set_serving([])
            return before, published, members, await _status(running.port)
        finally:
            await heartbeat.stop()
            await running.stop(0)
            registry.close()

    before, published, members, after = asyncio.run(scenario())
    assert before == health_pb2.HealthCheckResponse.NOT_SERVING
    assert published and len(members) == 1
    assert after == health_pb2.HealthCheckResponse.SERVING


def test_start_reports_a_failed_first_publish_and_keeps_trying() -> None:
    """Redis unreachable at start: `start` says so instead of failing the service, and the loop runs on."""
    from services.launch.local import free_port

    async def scenario() -> tuple[bool, bool]:
        registry = Registry(f"redis://127.0.0.1:{free_port()}/0", ttl_s=5.0)
        heartbeat = Heartbeat(registry, "worker", "127.0.0.1:1", "rev", lambda: {}, 0.05)
        published = await heartbeat.start()
        await asyncio.sleep(0.2)
        running = heartbeat._task is not None and not heartbeat._task.done()
        await heartbeat.stop()
        registry.close()
        return published, running

    assert asyncio.run(scenario()) == (False, True)


def test_members_of_reads_each_role_as_members_does(redis_server: RedisServer) -> None:
    """Several roles in one read: each role's live members of the revision asked, an expired one dropped, a role
    with none empty; the same as asking role by role."""
    import time

    registry = Registry(redis_server.url, ttl_s=5.0)
    try:
        registry.publish("worker", "w1", "rev", {"n": 1})
        registry.publish("worker", "w2", "other", {"n": 2})
        registry.publish("encoder", "e1", "rev", {"n": 3})
        short = Registry(redis_server.url, ttl_s=0.05)
        short.publish("encoder", "e-gone", "rev", {})
        short.close()
        time.sleep(0.2)
        found = registry.members_of(("worker", "encoder", "prefill"), "rev")
        assert found is not None
        assert {role: [m.address for m in ms] for role, ms in found.items()} == {
            "worker": ["w1"],
            "encoder": ["e1"],
            "prefill": [],
        }
        assert found["encoder"][0].state == {"n": 3}
        assert found == {role: registry.members(role, "rev") for role in ("worker", "encoder", "prefill")}
    finally:
        registry.close()
