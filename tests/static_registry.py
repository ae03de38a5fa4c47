"""A registry of fixed members, for a ClusterView without Redis: a subclass says `members(role)`."""

from __future__ import annotations

from services.common.registry import Member


class StaticRegistry:
    """`Registry`'s two reads over the members a subclass's `members` names (none by default)."""

    def members(self, role: str, revision: str | None = None) -> list[Member]:
        return []

    def members_of(self, roles: tuple[str, ...], revision: str | None = None) -> dict[str, list[Member]]:
        return {role: self.members(role, revision) for role in roles}
