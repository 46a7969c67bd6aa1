"""A model's version policy, Triton's `version_policy`: which of the versions on disk it serves. A setting of the
server (`--version-policy`) and of each repository model (its config.json), read by the repository
(serving/engine/repository.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from capsnet.errors import CapsNetError

POLICY_KINDS = ("latest", "specific", "all")


def version_order(version: str) -> tuple[int, int, str]:
    """Sort key: numeric versions by number (10 after 9), any other name after them."""
    return (0, int(version), "") if version.isdigit() else (1, 0, version)


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions on disk a model serves, as Triton's version_policy."""

    kind: str  # POLICY_KINDS
    num_versions: int = 1  # latest
    versions: tuple[int, ...] = ()  # specific

    def select(self, available: list[str]) -> list[str]:
        """The versions of `available` (VERSION_FOLDER names) to serve, oldest first."""
        ordered = sorted(available, key=version_order)
        if self.kind == "latest":
            return ordered[-self.num_versions:]
        if self.kind == "specific":
            return [version for version in ordered if int(version) in self.versions]
        return ordered

    def describe(self) -> str:
        if self.kind == "latest":
            return f"latest:{self.num_versions}"
        if self.kind == "specific":
            return "specific:" + ",".join(map(str, self.versions))
        return "all"

    @classmethod
    def parse(cls, text: str, source: str = "--version-policy") -> "VersionPolicy":
        """The flag's form: latest:N, specific:V1,V2,... or all."""
        kind, _, value = text.partition(":")
        try:
            if kind == "latest":
                return cls._checked("latest", source, num_versions=int(value or "1"))
            if kind == "specific":
                return cls._checked("specific", source, versions=tuple(int(v) for v in value.split(",")))
            if kind == "all" and not value:
                return cls("all")
        except ValueError:
            pass
        raise CapsNetError(f"{source}: expected latest:N, specific:V1,V2,... or all, got {text[:80]!r}")

    @classmethod
    def from_json(cls, value, source: str) -> "VersionPolicy":
        """Triton's JSON form: {"latest": {"num_versions": N}}, {"specific": {"versions": [...]}} or {"all": {}}."""
        if not (isinstance(value, dict) and len(value) == 1 and next(iter(value)) in POLICY_KINDS
                and isinstance(next(iter(value.values())), dict)):
            raise CapsNetError(f"{source}: version_policy must be one of {{\"latest\": {{\"num_versions\": N}}}}, "
                               f"{{\"specific\": {{\"versions\": [...]}}}} or {{\"all\": {{}}}}, got "
                               f"{json.dumps(value)[:120]}")
        (kind, body), = value.items()
        if kind == "latest":
            return cls._checked(kind, source, num_versions=body.get("num_versions", 1))
        if kind == "specific":
            versions = body.get("versions", [])
            return cls._checked(kind, source, versions=tuple(versions) if isinstance(versions, list) else versions)
        return cls("all")

    @classmethod
    def _checked(cls, kind: str, source: str, **values) -> "VersionPolicy":
        policy = cls(kind, **values)
        if kind == "latest" and not (type(policy.num_versions) is int and policy.num_versions >= 1):
            raise CapsNetError(f"{source}: latest needs num_versions >= 1, got {policy.num_versions!r}")
        if kind == "specific" and not (isinstance(policy.versions, tuple) and policy.versions
                                       and all(type(v) is int and v >= 1 for v in policy.versions)):
            raise CapsNetError(f"{source}: specific needs a list of versions >= 1, got {policy.versions!r}")
        return policy
