"""A node's read view (skippyd.ports.NodeView) over stand-ins: what the surfaces' in-process tests give them in
place of a running node."""

from __future__ import annotations

from typing import Any

import attrs

from skippyd.config import Config


@attrs.define
class FakeNode:
    head: Any = None
    stages: list = attrs.field(factory=list)
    draining: bool = False
    topology: Any = None
    config: Config = attrs.field(factory=Config)
    deployment: Any = None
    metrics: Any = None
    role: str = "head"

    @property
    def engine(self):
        return self.head.engine if self.head is not None else None

    @property
    def pool(self):
        return self.head.pool if self.head is not None else None

    def describe_role(self) -> str:
        return self.role

    async def status(self) -> dict:
        return {"role": self.role}
