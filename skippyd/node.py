"""The node: what one skippyd runs (the head, the other stages, the HTTP listener in front of the head, the
control channel, its part in a deployment) and the only way any of it starts or stops.

:meth:`Node.run` takes the daemon's plan (skippyd/plan.py): it starts the
deployment agent and the plan's stages, then the control channel, and reports
itself started once all of them accept work. :meth:`Node.start` runs a set of
stages in a cancel scope of its own, downstream first, and on the head the
OpenAI API with the daemon's settings (its model id, API key, public
metrics); :meth:`Node.release` ends them, the head's generations first.
``skippyd --topology``/``--model`` start-up and ``skippyctl deploy``
(skippyd/deploy/agent.py) both go through them, so a deployed stage runs with
the settings the daemon's own start-up applies.

The surfaces read the node through :class:`skippyd.ports.NodeView`; the
supervisor (skippyd/deploy/supervisor.py) moves the head through
:meth:`retarget` and :meth:`take_token_return_from`. skippyd/daemon.py keeps
signals, reload and logging.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import attrs
import trio

from skippyd.config import Config, Settings, parse_hostport
from skippyd.head.node import HeadNode
from skippyd.hosts import Machines
from skippyd.openai.auth import ApiKey
from skippyd.plan import Plan, head_options, stage_config, stages_on_this_host
from skippyd.stage.server import StageServer
from skippyd.status import StatusReport
from skippyd.topology import Topology

log = logging.getLogger("skippyd")

KILL_WAIT_S = 5.0  # released stages' generations get this long to end through their cleanup


@attrs.define(eq=False)
class _Running:
    """One set of stages started together, and what ends them."""

    plan: Plan
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    done: trio.Event = attrs.field(factory=trio.Event)


class Node:
    """One daemon's stages and listeners (see the module's docstring)."""

    def __init__(self, config: Config, *, settings: Settings | None = None, machines: Machines | None = None,
                 notify: Callable[[str], None] = lambda state: None):
        from skippyd.openai.metrics import Metrics  # prometheus_client only, no HTTP server

        self.config = config  # the settings in force (the daemon's reload changes the reloadable ones)
        self.settings = settings  # where they came from
        self.machines = machines if machines is not None else Machines()  # the topology's hosts as machines
        self.notify = notify  # systemd's sd_notify (the daemon's): STATUS= lines while stages load
        self.metrics = Metrics(self)
        self.link_auth = b""  # the link secret's Hello auth (status probes present it too)
        self.api_key: ApiKey | None = None  # what the OpenAI API asks for (None: nothing)
        self.head: HeadNode | None = None
        self.stages: list[StageServer] = []
        self.topology: Topology | None = None
        self.openai = None  # the OpenAI API's server, on the head
        self.control = None
        self.deployment = None  # the deployment agent (skippyd/deploy/agent.py), with the control channel
        self.started = time.time()
        self.ready = False
        self.draining = False
        self.report = StatusReport(self)
        self._nursery: trio.Nursery | None = None
        self._running: _Running | None = None

    # ---------------------------------------------------------------- the read view (skippyd.ports.NodeView)
    @property
    def engine(self):
        return self.head.engine if self.head is not None else None

    @property
    def pool(self):
        return self.head.pool if self.head is not None else None

    async def status(self) -> dict:
        """What `skippyctl status` shows (skippyd.status)."""
        return await self.report.status()

    def warnings(self) -> list[str]:
        """What the operator should know: an OpenAI listener other hosts reach with no API key."""
        return self.openai.warnings() if self.openai is not None else []

    def describe_role(self) -> str:
        if self.head is None and not self.stages and self.deployment is not None \
                and self.deployment.accepts_stages:
            return "waiting for a deployment"
        parts = []
        if self.head is not None:
            parts.append("head")
        parts += [f"stage {s.index}" for s in sorted(self.stages, key=lambda s: s.index)]
        return ", ".join(parts)

    def describe_load(self) -> str:
        """One line for systemd's STATUS=."""
        role = self.describe_role() or "starting"
        if self.draining:
            return f"{role}: draining, {self.running()} running"
        engine = self.engine
        if engine is not None:
            return f"{role}: {len(engine.live)} generations running, {engine.totals['generations']} done"
        return f"{role}: {self.running()} sessions"

    def describe_settings(self) -> dict | None:
        """The settings the running stages were started with (None: none run): how each computes, the
        head's options, and the OpenAI API's. The same whichever way the stages were started."""
        if self._running is None:
            return None
        plan, openai = self._running.plan, self.config.openai
        stage = attrs.asdict(plan.stage, recurse=False, filter=lambda a, _: a.name != "link_auth")
        stage.update(link_auth=bool(plan.stage.link_auth), prefix_cache_dir=_text(plan.stage.prefix_cache_dir),
                     upstream_allow=None if plan.stage.upstream_allow is None else list(plan.stage.upstream_allow))
        head = {k: _text(v) for k, v in plan.head.kwargs().items() if k != "chat_template"}
        head["chat_template"] = plan.head.chat_template is not None
        serves = self.head is not None and bool(openai.listen)
        return {"indices": list(plan.indices), "stage": stage, "head": head,
                "openai": None if not serves else {"listen": openai.listen, "model_id": openai.model_id,
                                                   "api_key": self.api_key is not None,
                                                   "public_metrics": openai.public_metrics}}

    def running(self) -> int:
        """Generations running on the head, or sessions held by this node's stages."""
        engine = self.engine
        if engine is not None:
            # a generation has left the engine before its client has the last of it (the queued pieces,
            # the result): a drain that stopped there would cut the reply off
            answering = sum(server.answering for server in (self.control, self.openai and self.openai.app)
                            if server is not None)
            return max(len(engine.live), answering)
        return sum(s.sessions.snapshot()["live_sessions"] for s in self.stages)

    def reconfigure(self, config: Config) -> None:
        """The settings a reload applied (skippyd/daemon.py): what the node reads from now on."""
        self.config = config

    # ---------------------------------------------------------------- lifetime
    async def run(self, plan: Plan, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Everything the plan asks for, until cancelled; started once every listener accepts work."""
        self.link_auth, self.api_key = plan.link_auth, plan.api_key
        config = self.config
        waiting = plan.model is None and plan.topology is None
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if config.control.enabled:
                from skippyd.deploy.agent import Assignment
                from skippyd.deploy.slices import SliceStore, default_slices_dir

                slices = SliceStore(config.pipeline.slices_dir or default_slices_dir())
                self.deployment = Assignment(self, slices, nursery, accepts_stages=waiting)
            if waiting:
                log.info("no topology and no model: waiting for `skippyctl deploy` to assign a stage (slices in %s)",
                         self.deployment.slices.dir)
            else:
                await self.start(plan)
            if config.control.enabled:
                from skippyd.control.server import ControlServer

                self.control = ControlServer(self, *parse_hostport(config.control.listen),
                                             token_file=config.control.token_file)
                await nursery.start(self.control.run)
            from skippyd import telemetry

            telemetry.configure(config.daemon.telemetry)
            if self.head is None and config.openai.listen and not waiting:
                log.info("--openai: this daemon runs no head (stage 0): no OpenAI API here")
            # every listener started above accepts work
            self.ready = True
            task_status.started(self)

    def plan_stage(self, topology: Topology, index: int) -> Plan:
        """How this node runs stage `index` of a topology it was given at run time: as the daemon's start-up
        would with ``--topology FILE --stage index`` (the same settings, made by the same code)."""
        config = self.config
        n_local = stages_on_this_host(topology, index, self.machines)
        groups = config.runtime.decode_groups or self.machines.count([s.host for s in topology.stages])
        return Plan(topology, None, (index,), stage_config(config, n_local, groups, self.link_auth),
                    head_options(config), self.link_auth, self.api_key)

    async def start(self, plan: Plan, *, on_stop: Callable[[str | None], None] | None = None) -> None:
        """Run the plan's stages (downstream first, so the head's lanes find them listening) and, on the head,
        the OpenAI API; returns once they accept work. The only way a stage runs; :meth:`release` ends it.

        Without `on_stop` a stage's failure ends the node (the daemon's start-up: a fatal error). With it the
        stages stop alone: `on_stop` hears why (None: released) and the node serves on without them."""
        if self._running is not None:
            raise RuntimeError("this node runs stages already: release them first")
        running = _Running(plan)
        await self._nursery.start(self._run, running, on_stop)
        self._running = running

    async def release(self, why: str) -> bool:
        """End the running stages: the head's generations first, each client told `why`, through their
        cleanup; then every stage, its sessions released as at a drain's end. False: none ran."""
        running = self._running
        if running is None:
            return False
        engine = self.engine
        if engine is not None:
            for session_id in list(engine.live):
                engine.kill(session_id, why)
            with trio.move_on_after(KILL_WAIT_S):
                while engine.live:
                    await trio.sleep(0.02)
        running.scope.cancel()
        await running.done.wait()
        return True

    async def _run(self, running: _Running, on_stop, task_status=trio.TASK_STATUS_IGNORED) -> None:
        plan, config = running.plan, self.config
        started = False
        why = None
        self.topology = plan.topology
        try:
            with running.scope:
                async with trio.open_nursery() as inner:
                    if plan.model is not None:
                        self.notify(f"STATUS=loading {plan.model}")
                        self.head = await inner.start(HeadNode(plan.stage, model_path=plan.model,
                                                               **plan.head.kwargs()).run)
                    for k in sorted(plan.indices, reverse=True):
                        spec = plan.topology.stage(k)
                        self.notify(f"STATUS=loading stage {k} (layers {spec.layer_start}-{spec.layer_end})")
                        if k == 0:
                            self.head = await inner.start(HeadNode(plan.stage, topology=plan.topology,
                                                                   **plan.head.kwargs()).run)
                        else:
                            self.stages.append(await inner.start(StageServer(plan.topology, k, plan.stage).run))
                    if self.head is not None and config.openai.listen:
                        from skippyd.openai.server import OpenAIServer

                        self.openai = await inner.start(OpenAIServer(
                            self, *parse_hostport(config.openai.listen), model_id=config.openai.model_id,
                            api_key=self.api_key, public_metrics=config.openai.public_metrics,
                            metrics=self.metrics).run)
                    started = True
                    task_status.started()
        except Exception as exc:
            if not started or on_stop is None:
                raise
            why = _why(exc)  # (on_stop says it)
        finally:
            self.head, self.openai, self.stages, self.topology = None, None, [], None
            if self._running is running:
                self._running = None
            if started and on_stop is not None:
                on_stop(why)
            running.done.set()

    # ---------------------------------------------------------------- the supervisor's control of the head
    async def retarget(self, topology: Topology) -> None:
        """The head's lanes and liveness watch go to the new topology's stage 1, which status shows from now
        on; returns once the head sees stage 1 answer (30 s at most)."""
        head = self.head
        await head.retarget(topology)
        self.topology = topology
        with trio.move_on_after(30):
            while not (head.watch is None or await head.watch.check()):
                await trio.sleep(0.1)

    def take_token_return_from(self, topology: Topology) -> Callable[[], None]:
        """The head takes the token-return connection from the final stage of `topology` (3 stages or more);
        returns what puts the rule before back."""
        head = self.head
        return head.take_token_return_from(topology) if head is not None else (lambda: None)

    # ---------------------------------------------------------------- drain
    async def drain(self, grace_s: float) -> bool:
        """Stop taking new generations, let running ones finish up to `grace_s`. True if all finished."""
        self.draining = True
        for stage in self.stages:
            stage.begin_drain()  # new sessions from upstream are refused (SHUTTING_DOWN), running ones go on
        if self.engine is not None:
            self.engine.begin_drain()
        if self.pool is not None:
            await self.pool.drain()
        last = None
        with trio.move_on_after(grace_s):
            while (running := self.running()) > 0:
                if running != last:
                    self.notify(f"STATUS={self.describe_load()}")
                    last = running
                await trio.sleep(0.05)
        await self._write_prefix_caches()
        return self.running() == 0

    async def _write_prefix_caches(self) -> None:
        """A drain writes what each local stage's prefix cache holds to its disk tier (if it has one), so the
        next start finds it there."""
        caches = [s.core.prefix_cache for s in self.stages]
        if self.engine is not None:
            caches.append(self.engine.prefix_cache)
        for cache in caches:
            written = await cache.write_through()
            if written:
                log.info("stage %d: prefix cache: %d entries written to its disk tier", cache.stage_index, written)

    async def cancel_running(self, why: str, wait_s: float) -> None:
        """Kill every running generation through the engine's cleanup path, and wait up to `wait_s` for it (and
        for its client to be told)."""
        engine = self.engine
        if engine is None:
            return
        for session_id in list(engine.live):
            engine.kill(session_id, why)
        with trio.move_on_after(wait_s):
            while self.running():
                await trio.sleep(0.02)


def _text(value):
    return str(value) if value is not None and not isinstance(value, (bool, int, float, str)) else value


def _why(exc: BaseException) -> str:
    """The messages of an exception, its group's leaves joined (a nursery wraps what a stage raised)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_why(e) for e in exc.exceptions)
    return str(exc) or type(exc).__name__
