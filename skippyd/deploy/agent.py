"""The stage a daemon was given at run time (``skippyctl deploy``), and its release.

A daemon started with neither a topology nor a model waits: its control
channel answers ``host`` (what it offers), receives slices, times a
calibration slice, and takes ``stage_assign``. :class:`Assignment` then has
the node (skippyd/node.py) run that stage exactly as ``skippyd --topology …
--stage K`` would: the same :meth:`~skippyd.node.Node.start`, its settings made
by the same planning code, the head's OpenAI API with the daemon's API key and
metrics access. ``stage_release`` (or the next assignment) has the node
release it, which releases every session through the same cleanup path as a
drain's end, and the daemon goes back to waiting. A stage that fails after it
started is logged and dropped; the daemon keeps serving its control channel.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import trio

from skippyd.config import Config
from skippyd.control.messages import RequestFailed
from skippyd.deploy.calibrate import calibrate
from skippyd.deploy.resources import anon_rss, host_report
from skippyd.deploy.slices import SliceStore, SliceStoreError
from skippyd.deploy.supervisor import SupervisedNode, Supervisor
from skippyd.plan import Plan
from skippyd.stage.threads import usable_cores
from skippyd.topology import Topology, TopologyError

log = logging.getLogger("skippyd.deploy")

TOPOLOGY_NAME = "deployed-topology.toml"
RELEASED = "the deployment running this generation was released (skippyctl undeploy, or a new deploy)"


class StagePort(SupervisedNode, Protocol):
    """What an assignment needs of its node: its settings, and the one way to start and release a stage."""

    @property
    def config(self) -> Config: ...

    def plan_stage(self, topology: Topology, index: int) -> Plan: ...

    async def start(self, plan: Plan, *, on_stop: Callable[[str | None], None] | None = None) -> None: ...

    async def release(self, why: str) -> bool: ...


class AssignError(RequestFailed):
    """An assignment that cannot be run; the message is for the deployer."""


class Assignment:
    """Has the node run the stage assigned to this daemon (at most one at a time); supervises from `nursery`."""

    def __init__(self, node: StagePort, slices: SliceStore, nursery: trio.Nursery, *, accepts_stages: bool = True):
        self.node = node
        self.slices = slices
        self.accepts_stages = accepts_stages  # False: the daemon runs what its command line gave it
        self.nursery = nursery
        self.index: int | None = None
        self.since: float | None = None
        self.failure: str | None = None  # why the last assigned stage stopped on its own
        self._lock = trio.Lock()  # one assignment or release at a time
        self._calibrations: dict[str, dict] = {}  # slice sha256 → its timing here
        self._text: str | None = None  # the running assignment's topology, as sent
        self._baseline_rss = anon_rss()  # before any stage: what a running one holds is the growth over it
        self.supervisor: Supervisor | None = None  # the head's watch over its deployment (skippyctl deploy)

    # ---------------------------------------------------------------- what the host offers
    def host(self) -> dict:
        runtime = self.node.config.runtime
        held = max(0, anon_rss() - self._baseline_rss) if self.index is not None else 0
        report = host_report(runtime.memory_limit_mb, self.slices, held, runtime.gpu_layers)
        report.update(assigned=self.describe(), accepts_stages=self.accepts_stages, ctx=runtime.ctx,
                      lanes=runtime.lanes, threads=runtime.threads or report["cores"],
                      prefix_cache_mb=runtime.prefix_cache_mb)
        return report

    async def calibrate(self, sha256: str, fresh: bool = False) -> dict:
        """ms per layer of the slice on this host; timed once, then remembered (unless `fresh`), so that planning
        the same deployment twice gives the same plan rather than one that moves with the noise."""
        path = self.slices.path(sha256)
        if not await trio.to_thread.run_sync(self.slices.is_held, sha256):
            raise SliceStoreError(f"slice {sha256[:12]} is not held here: send it first", "not_found")
        if not fresh and sha256 in self._calibrations:
            return {**self._calibrations[sha256], "remembered": True}
        threads = self.node.config.runtime.threads or usable_cores()
        async with self._lock:  # not while a stage loads here (it would time the load, not the host)
            result = await trio.to_thread.run_sync(calibrate, path, threads)
        self._calibrations[sha256] = result
        return {**result, "remembered": False}

    @property
    def topology(self) -> Topology | None:
        """The running assignment's topology, as the node serves it now (a supervisor's re-plan moves it)."""
        return self.node.topology if self.index is not None else None

    def describe(self) -> dict | None:
        if self.index is None or self.topology is None:
            return None
        spec = self.topology.stage(self.index)
        return {"stage": self.index, "stages": len(self.topology.stages), "model": self.topology.model_name,
                "layers": [spec.layer_start, spec.layer_end], "listen": spec.address,
                "since": self.since}

    # ---------------------------------------------------------------- assign and release
    async def assign(self, topology_text: str, index: int) -> dict:
        """Run stage `index` of the topology (TOML whose stage files are named by their sha256, held here);
        a stage already running is released first. Returns once it listens (the head: once its lanes may
        open)."""
        if not self.accepts_stages:
            raise AssignError("this daemon runs the stages its command line or configuration gave it; start it "
                              "with neither --topology nor --model to deploy to it")
        async with self._lock:
            if self.index == index and self._text == topology_text:
                return {**self.describe(), "unchanged": True}  # running it already: its sessions go on
            # hashes the slice unless known unchanged: seconds for a big one, off the event loop
            topology = await trio.to_thread.run_sync(self._read_topology, topology_text, index)
            await self._release()
            await self._start(topology, index)
            self._text = topology_text
            return {**self.describe(), "unchanged": False}

    # ---------------------------------------------------------------- supervision (the head's)
    async def supervise(self, spec) -> dict:
        """Supervise the deployment this head runs (skippyd/deploy/supervisor.py); one that did so already
        stops first."""
        if self.index != 0:
            raise AssignError("only the head of a deployment (stage 0) supervises it; this daemon runs "
                              + ("no stage" if self.index is None else f"stage {self.index}"))
        if not await trio.to_thread.run_sync(self.slices.is_held, spec.model_sha256):
            raise AssignError(f"the model {spec.model_sha256[:12]} is not held here: send it first", "not_found")
        if spec.plan_hosts()[0] not in {h.name for h in spec.hosts}:
            raise AssignError("the plan's head is not among the hosts")
        model = await trio.to_thread.run_sync(self._model_copy, spec.model_sha256, spec.model_name)
        try:
            supervisor = Supervisor(self.node, spec, model, self.node.config.deploy.rejoin_grace_s)
        except ValueError as exc:
            raise AssignError(str(exc)) from None
        await self._end_supervision()
        await self.nursery.start(supervisor.run)
        self.supervisor = supervisor
        return supervisor.describe()

    def add_host(self, name: str, url: str) -> dict:
        if self.supervisor is None:
            raise AssignError("this daemon supervises no deployment (it is not a deployment's head)", "not_found")
        return self.supervisor.add(name, url).describe()

    def _model_copy(self, sha256: str, name: str):
        """The model copy under its own file name (slices cut from it take their model name from it)."""
        folder = self.slices.dir / "models" / sha256
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / name
        if not link.is_symlink():
            link.unlink(missing_ok=True)
            link.symlink_to(self.slices.path(sha256))
        return link

    def _stop_supervisor(self) -> None:
        if self.supervisor is not None:
            self.supervisor.scope.cancel()
            self.supervisor = None

    async def _end_supervision(self) -> None:
        """Stop the supervisor and wait until it has let go of the head."""
        supervisor = self.supervisor
        self._stop_supervisor()
        if supervisor is not None:
            await supervisor.done.wait()

    async def release(self) -> dict | None:
        async with self._lock:
            was = self.describe()
            await self._release()
            return was

    def _read_topology(self, text: str, index: int) -> Topology:
        """Check the topology and that this host holds its stage's slice; written where the stage files are
        (its `file` keys name them relative to it)."""
        self.slices.dir.mkdir(parents=True, exist_ok=True)
        path = self.slices.dir / TOPOLOGY_NAME
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        try:
            topology = Topology.load(tmp)
        except TopologyError as exc:
            raise AssignError(str(exc).replace(str(tmp), "the topology")) from None
        finally:
            tmp.unlink(missing_ok=True)
        try:
            spec = topology.stage(index)
        except TopologyError as exc:
            raise AssignError(str(exc)) from None
        if not self.slices.is_held(spec.sha256):
            raise AssignError(f"stage {index}'s slice {spec.sha256[:12]} is not held here: send it first")
        if spec.file.resolve() != self.slices.path(spec.sha256).resolve():
            raise AssignError(f"stage {index}'s file must be its slice, {spec.sha256}.gguf")
        if spec.mmproj is not None:  # the head's projector, sent as a slice is
            sha = spec.mmproj_sha256
            if sha is None or spec.mmproj.resolve() != self.slices.path(sha).resolve():
                raise AssignError(f"stage {index}'s mmproj must be named by its sha256 (mmproj_sha256.gguf)")
            if not self.slices.is_held(sha):
                raise AssignError(f"stage {index}'s projector {sha[:12]} is not held here: send it first")
        path.write_text(text)
        return Topology.load(path)

    async def _start(self, topology: Topology, index: int) -> None:
        spec = topology.stage(index)
        log.info("deploy: starting stage %d of %s (layers %d-%d)", index, topology.model_name, spec.layer_start,
                 spec.layer_end)
        try:
            await self.node.start(self.node.plan_stage(topology, index), on_stop=self._stopped)
        except Exception as exc:
            raise AssignError(f"stage {index} did not start: {_why(exc)}", "failed") from None
        self.index, self.since, self.failure = index, time.time(), None

    def _stopped(self, why: str | None) -> None:
        """The node's stages ended: released (`why` None), or failed on their own."""
        self._stop_supervisor()
        if why is not None:
            log.error("deploy: stage %d stopped: %s; waiting for a new assignment", self.index, why)
            self.failure = f"stage {self.index} stopped: {why}"
        self.index = self.since = self._text = None

    async def _release(self) -> None:
        await self._end_supervision()
        if self.index is None:
            return
        log.info("deploy: releasing stage %d", self.index)
        # the head's generations end first, each client told why, through their cleanup
        await self.node.release(RELEASED)


def _why(exc: BaseException) -> str:
    """The messages of an exception, its group's leaves joined (a nursery wraps what a stage raised)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_why(e) for e in exc.exceptions)
    return str(exc) or type(exc).__name__
