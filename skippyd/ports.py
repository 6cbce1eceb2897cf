"""The narrow ports between a node (skippyd/node.py) and what serves it.

The surfaces (the OpenAI API and its console, the control channel, the status
report, the metrics) read a node through :class:`NodeView` and nothing else;
the control channel reaches a deployment through :class:`DeploymentPort`. A
node is their only implementation in the daemon; tests give them stand-ins of
the same shape. Nothing here imports the daemon or the node.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from skippyd.config import Config
    from skippyd.head.engine import HeadEngine
    from skippyd.head.lanes import LanePool
    from skippyd.head.node import HeadNode
    from skippyd.stage.server import StageServer
    from skippyd.topology import Topology


class MetricsSink(Protocol):
    """Where a surface counts what it served."""

    def record_generation(self, result: Any, source: str = "control") -> None: ...


class Supervision(Protocol):
    """What the surfaces read of a supervising head's watch over its deployment."""

    @property
    def generation(self) -> int: ...

    @property
    def replans(self) -> dict[str, int]: ...

    def describe(self) -> dict: ...


class SlicePort(Protocol):
    """The slices a host holds, as the control channel receives them."""

    @property
    def dir(self) -> Path: ...

    def offer(self, sha256: str, size: int) -> Any: ...

    def write(self, sha256: str, offset: int, data: bytes) -> int: ...

    def commit(self, sha256: str, size: int) -> None: ...


class DeploymentPort(Protocol):
    """A daemon's part in a deployment (skippyd/deploy/agent.py), as the control channel and status reach it."""

    @property
    def accepts_stages(self) -> bool: ...

    @property
    def failure(self) -> str | None: ...

    @property
    def slices(self) -> SlicePort: ...

    @property
    def supervisor(self) -> Supervision | None: ...

    def describe(self) -> dict | None: ...

    def host(self) -> dict: ...

    async def calibrate(self, sha256: str, fresh: bool = False) -> dict: ...

    async def assign(self, topology_text: str, index: int) -> dict: ...

    async def release(self) -> dict | None: ...

    async def supervise(self, spec: Any) -> dict: ...

    def add_host(self, name: str, url: str) -> dict: ...


class NodeView(Protocol):
    """What the surfaces read of a node: its settings, the head (and its engine and lanes), the other stages,
    the topology, whether it drains, its deployment. Read only: a surface changes nothing here but through
    the objects' own operations (a session killed, the lanes drained)."""

    @property
    def config(self) -> Config: ...

    @property
    def head(self) -> HeadNode | None: ...

    @property
    def engine(self) -> HeadEngine | None: ...

    @property
    def pool(self) -> LanePool | None: ...

    @property
    def stages(self) -> Sequence[StageServer]: ...

    @property
    def topology(self) -> Topology | None: ...

    @property
    def draining(self) -> bool: ...

    @property
    def deployment(self) -> DeploymentPort | None: ...

    @property
    def metrics(self) -> MetricsSink: ...

    def describe_role(self) -> str: ...

    async def status(self) -> dict: ...
