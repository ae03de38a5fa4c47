"""Service discovery and load state in Redis: services heartbeat, routers read.

Each live service has a key `epd:reg:<role>:<address>` holding its state as JSON with a TTL of a
few heartbeat intervals, and is a member of the sorted set `epd:reg:<role>` scored by that
expiry. A service whose heartbeats stop drops out within the TTL. Routers hold no state another
router needs: every replica reads the same keys. Redis errors never raise to callers:
`publish` returns False and `members` returns None so a reader can keep its last view.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

log = logging.getLogger(__name__)
PREFIX = "epd:reg"


def draining_role(role: str) -> str:
    """The role a draining service of `role` publishes under: alive, but taking no new work."""
    return f"{role}-draining"


@dataclass(frozen=True)
class Member:
    """One service as it last described itself."""

    role: str
    address: str
    revision: str
    state: dict[str, Any]
    published_at: float


class Registry:
    def __init__(self, redis_url: str, ttl_s: float = 1.0, socket_timeout_s: float = 0.25) -> None:
        self.ttl_s = ttl_s
        self._redis = redis.Redis.from_url(
            redis_url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
        )

    @staticmethod
    def _key(role: str, address: str) -> str:
        return f"{PREFIX}:{role}:{address}"

    def publish(self, role: str, address: str, revision: str, state: dict[str, Any]) -> bool:
        now = time.time()
        body = json.dumps({"revision": revision, "state": state, "published_at": now})
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.set(self._key(role, address), body, px=int(self.ttl_s * 1000))
            pipe.zadd(f"{PREFIX}:{role}", {address: now + self.ttl_s})
            pipe.execute()
            return True
        except (redis.RedisError, OSError) as exc:
            log.debug("registry publish failed: %s", exc)
            return False

    def withdraw(self, role: str, address: str) -> None:
        try:
            self._redis.delete(self._key(role, address))
            self._redis.zrem(f"{PREFIX}:{role}", address)
        except (redis.RedisError, OSError):
            pass

    def members(self, role: str, revision: str | None = None) -> list[Member] | None:
        """Live members of `role` (matching `revision` when given); None when Redis cannot answer."""
        found = self.members_of((role,), revision)
        return None if found is None else found[role]

    def members_of(self, roles: tuple[str, ...], revision: str | None = None) -> dict[str, list[Member]] | None:
        """`members` of each of `roles`, read in two round trips whatever their number (a router reads four roles
        ten times a second); None when Redis cannot answer."""
        now = time.time()
        try:
            pipe = self._redis.pipeline(transaction=False)
            for role in roles:
                pipe.zremrangebyscore(f"{PREFIX}:{role}", "-inf", now)
                pipe.zrangebyscore(f"{PREFIX}:{role}", now, "+inf")
            found = pipe.execute()[1::2]
            keyed = [(role, a.decode()) for role, addresses in zip(roles, found, strict=True) for a in addresses]
            bodies = self._redis.mget([self._key(role, a) for role, a in keyed]) if keyed else []
        except (redis.RedisError, OSError) as exc:
            log.debug("registry read failed: %s", exc)
            return None
        out: dict[str, list[Member]] = {role: [] for role in roles}
        for (role, address), body in zip(keyed, bodies, strict=True):
            if body is None:
                continue
            data = json.loads(body)
            if revision is not None and data["revision"] != revision:
                continue
            out[role].append(Member(role, address, data["revision"], data["state"], data["published_at"]))
        return out

    def close(self) -> None:
        self._redis.close()


class Heartbeat:
    """Publishes `state()` every `interval_s` on a background asyncio task until `stop()`."""

    def __init__(
        self,
        registry: Registry,
        role: str,
        address: str,
        revision: str,
        state: Callable[[], dict[str, Any]],
        interval_s: float = 0.2,
    ) -> None:
        self._registry, self._role, self._address, self._revision = registry, role, address, revision
        self._state = state
        self._interval_s = interval_s
        self._task: asyncio.Task | None = None

    @property
    def role(self) -> str:
        """The role it publishes under now."""
        return self._role

    async def start(self) -> bool:
        """Publish once, awaited (a service turns its health SERVING after this, so whoever sees it healthy
        can find it in the registry), then every `interval_s` on a background task. False when the first
        publish failed (Redis unreachable; logged): the task keeps trying."""
        published = await self._publish()
        if not published:
            log.warning(
                "%s %s: registry publish failed at start-up; retrying every heartbeat", self._role, self._address
            )
        self._task = asyncio.create_task(self._run())
        return published

    async def _publish(self) -> bool:
        state = self._state()
        return await asyncio.to_thread(self._registry.publish, self._role, self._address, self._revision, state)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self._publish()

    async def move_to(self, role: str) -> None:
        """Publish under `role` from now on, leaving the current role at once (a draining service moves to
        `<role>-draining`: routers send it nothing new but still see it alive)."""
        old, self._role = self._role, role
        await asyncio.to_thread(self._registry.withdraw, old, self._address)
        await self._publish()
        await asyncio.to_thread(self._registry.withdraw, old, self._address)  # a publish in flight may have landed

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await asyncio.to_thread(self._registry.withdraw, self._role, self._address)
