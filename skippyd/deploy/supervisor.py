"""The head supervises its deployment: hosts that go are dropped, hosts that come are taken in.

``skippyctl deploy`` hands the head (stage 0's daemon) what it deployed: the
hosts offered, the plan, each host's measured speed, the control token, and a
copy of the model file (left in the head's slice store). From then on the
head asks every other host's control channel for its ``host`` report once a
second. A host of the plan that does not answer for ``deploy.rejoin_grace_s``
(or answers but no longer runs its stage: it restarted) is dropped: the head
plans again over the hosts that answer (the planner's rule, the head keeping
its own host and layers, where its clients are connected), cuts the slices
from its copy, ships those a host lacks, starts the new stages from the last
one, points its lanes at the new stage 1, and serves again. Generations in
flight are replayed (skippyd/head/resume.py) once it does; new ones wait
meanwhile (skippyd/head/availability.py). When the hosts left cannot hold the
model, requests get 503 with the shortfall until a host returns.

A dropped host that answers again, or a host added with ``skippyctl deploy
--add``, makes the head plan again: it switches when that plan gives the
dropped host its share back, or is faster by ``SWITCH_GAIN`` by the planner's
estimate, at a request boundary (new requests wait, running ones finish, the
stages move, new requests go on). A host must present the deployment's token
to be asked at all: one that refuses it stays dropped, with that reason.

A host lost while a change runs (a re-plan cutting, shipping or starting the
new stages; a switch draining, shipping or starting) stops the change: a call
to it fails, or the probes drop it meanwhile. The change is abandoned (the
stages it started released, the head's upstream rule put back), the host
dropped, and the head plans again at once over the hosts that answer;
generations in flight and waiting go on waiting and are replayed once it
serves. A switch abandoned before it started a stage keeps the plan it was
leaving, which serves on. Either counts as a re-plan with the cause
`lost_during_transfer` (a re-plan after a loss) or `lost_during_switch`. A
host that failed the change with an error of its own (not silence) is taken
back no sooner than ``REFUSED_BACKOFF_S`` later.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import attrs
import trio

from skippyd.control import messages as m
from skippyd.control.client import ControlError
from skippyd.deploy import transfer
from skippyd.deploy.planner import DeployPlan, HostInfo, PlanError, PlanRefused, model_shape, plan_tail
from skippyd.deploy.remote import call, send_slice
from skippyd.head.availability import RECOVERING, SERVING, SHORT
from skippyd.head.engine import HeadEngine
from skippyd.head.states import GenerationState
from skippyd.topology import Topology, format_address, parse_address

log = logging.getLogger("skippyd.deploy")

PROBE_S = 1.0  # each host is asked for its report this often
PROBE_TIMEOUT_S = 2.0  # ... and is unreachable when it does not answer within this
DECIDE_S = 0.25  # how often the decisions are looked at again without a probe's news (a grace ending)
RECOVER_BUDGET_S = 120.0  # a re-plan (cut, ship, start) gets this long on top of the grace before requests fail
SWITCH_GAIN = 0.10  # a plan this much faster (by the planner's estimate) is worth a switch
DRAIN_S = 30.0  # a switch waits this long for running generations to end; the rest are replayed
ASSIGN_TIMEOUT_S = 120.0



class HostPhase(enum.StrEnum):
    """Where a host stands in the deployment (status shows the value)."""

    IN_PLAN = "in plan"  # runs a stage of the plan served
    WAITING = "waiting"  # answers, runs none: planned with at the next change
    UNREACHABLE = "unreachable"  # of the plan, silent within its grace
    DROPPED = "dropped"  # silent past its grace, lost during a change, or refusing the token


class Step(enum.StrEnum):
    """The step a change is at (status: supervised.change.step)."""

    DRAINING = "draining"  # a switch waits for running generations at a request boundary
    CUTTING = "cutting"
    SHIPPING = "shipping"
    STARTING = "starting"


class Cause(enum.StrEnum):
    """Why the deployment moved to a new plan (skippy_deploy_replans_total's cause)."""

    DROPPED = "dropped"
    RETURNED = "returned"
    ADDED = "added"
    RESTARTED = "restarted"
    LOST_DURING_TRANSFER = "lost_during_transfer"
    LOST_DURING_SWITCH = "lost_during_switch"


IN_PLAN, WAITING, UNREACHABLE, DROPPED = HostPhase
RELEASE_TIMEOUT_S = 10.0  # an abandoned change's stages are released within this (a host that does not answer
# is left as it is: the next plan assigns or releases it)


REFUSED_BACKOFF_S = 60.0  # a host that answered a change with an error is taken back no sooner than this


class SupervisedNode(Protocol):
    """What the supervisor reads of the head's node, and the only ways it moves it (skippyd/node.py)."""

    @property
    def engine(self) -> HeadEngine | None: ...

    @property
    def topology(self) -> Topology | None: ...

    async def retarget(self, topology: Topology) -> None: ...

    def take_token_return_from(self, topology: Topology) -> Callable[[], None]: ...


class HostLost(Exception):
    """A host a change needs was lost while the change ran (`code`: the control channel's error code,
    "unreachable" when it did not answer): the change is abandoned."""

    def __init__(self, host: str, why: str, code: str = "unreachable"):
        super().__init__(f"{host}: {why}")
        self.host, self.why, self.code = host, why, code


@attrs.define
class HostState:
    name: str  # HOST:PORT of its control channel, as the deployer named it
    url: str
    ms_per_layer: float | None  # None: not timed yet (added, not calibrated)
    memory_bytes: int = 0
    prefix_cache_bytes: int = 0  # its prefix cache's budget, which its stage needs beside the slice
    state: HostPhase = WAITING
    since: float = attrs.field(factory=time.time)  # when it entered its state (wall clock)
    reason: str | None = None  # why it is unreachable or dropped
    failing_since: float | None = None  # trio time of the first unanswered probe in a row
    assigned: dict | None = None  # what it said it runs, at its last answer
    answered: bool = False  # has answered a probe since supervision began
    returned: bool = False  # was dropped, answers again: its share is to be restored
    held_until: float | None = None  # trio time before which it stays dropped though it answers

    @property
    def host(self) -> str:
        return parse_address(self.name)[0]

    def move(self, state: HostPhase, reason: str | None = None) -> None:
        if state != self.state:
            self.since = time.time()
        self.state, self.reason = state, reason

    def describe(self) -> dict:
        return {"name": self.name, "state": str(self.state), "since": round(self.since, 3), "reason": self.reason,
                "memory_bytes": self.memory_bytes, "ms_per_layer": self.ms_per_layer}


@attrs.frozen
class ServedPlan:
    """The plan the deployment serves: its hosts in pipeline order (the head's first), where the head's layers
    end, one token's expected time, and its form in status (as deploy sent it, or as the switch to it made it)."""

    hosts: tuple[str, ...]
    head_end: int
    ms_per_token: float
    shown: dict = attrs.field(eq=False, repr=False)

    @classmethod
    def deployed(cls, data: dict) -> ServedPlan:
        """The plan deploy sent (`skippyctl plan --json`'s form); ValueError if it is not one."""
        try:
            stages = data["stages"]
            return cls(tuple(s["host"] for s in stages), int(stages[0]["layers"][1]), float(data["ms_per_token"]),
                       data)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ValueError(f"the plan is not one `skippyctl plan --json` prints (no {exc})") from None

    @classmethod
    def switched(cls, plan: DeployPlan) -> ServedPlan:
        return cls(tuple(plan.hosts), plan.ranges[0][1], plan.ms_per_token,
                   {**plan.as_dict(), "ranges": plan.ranges})

    @property
    def tail(self) -> tuple[str, ...]:
        """The hosts of the stages after the head."""
        return self.hosts[1:]

    def as_dict(self) -> dict:
        return self.shown


@attrs.define
class Change:
    """The change under way (status: supervised.change)."""

    step: Step
    cause: str
    hosts: list[str]
    shipping: list[str] = attrs.field(factory=list)  # the hosts being sent a slice
    since: float = attrs.field(factory=lambda: round(time.time(), 3))

    def describe(self) -> dict:
        return {"step": str(self.step), "cause": self.cause, "hosts": list(self.hosts),
                "shipping": list(self.shipping), "since": self.since}


class Supervisor:
    """Runs in the head daemon's nursery while its deployment lasts (a new `supervise`, or the head's release,
    ends it)."""

    def __init__(self, node: SupervisedNode, spec: m.Supervise, model: Path, grace_s: float):
        self.node = node
        self.spec = spec
        self.model = model  # the copy in this host's slice store, under the name deploy gave it
        self.grace_s = grace_s
        self.token = spec.token
        self.head_name = spec.plan_hosts()[0]
        self.hosts: dict[str, HostState] = {
            h.name: HostState(h.name, h.url, h.ms_per_layer, h.memory_bytes) for h in spec.hosts}
        for name in spec.plan_hosts():
            self.hosts[name].move(IN_PLAN)
        self.added: set[str] = set()  # hosts offered with `deploy --add`: a switch to them must be worth it
        self.generation = 1
        self.plan = ServedPlan.deployed(spec.plan)
        self.shape = None
        self.replans = dict.fromkeys(Cause, 0)
        self.last_change: dict | None = None
        self.change: Change | None = None  # the change under way, for status
        self._started: list[str] = []  # the hosts the change under way has started a stage on
        self._broken: tuple[Cause, str, float] | None = None  # (kind, cause, start) of a change abandoned: plan again
        self._wake = trio.Event()
        self.running = False  # started, not yet stopped
        self.done = trio.Event()
        self._refused_over: frozenset | None = None  # the hosts (and memory) the model last did not fit
        self._changing = False  # the stages are moving: what a host reports meanwhile is not news
        self._epoch = 0  # one more at each change of plan: a probe asked before it says nothing of the new one
        self._nursery: trio.Nursery | None = None
        self._undo_token_return: Callable[[], None] | None = None  # puts the head's token-return rule back
        self.scope = trio.CancelScope()

    # ---------------------------------------------------------------- status
    def describe(self) -> dict:
        engine = self._engine()
        availability = engine.availability if engine is not None else None
        return {"generation": self.generation, "plan": self.plan.as_dict(),
                "state": availability.state if availability is not None else None,
                "why": availability.why if availability is not None else None,
                "rejoin_grace_s": self.grace_s, "hosts": [h.describe() for h in self.hosts.values()],
                "replans": {str(cause): n for cause, n in self.replans.items()}, "last_change": self.last_change,
                "change": self.change.describe() if self.change is not None else None}

    def _engine(self) -> HeadEngine | None:
        return self.node.engine

    # ---------------------------------------------------------------- the tasks
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._run(task_status)
        except Exception:
            if not self.running:
                raise
            # a bug: supervision stops, the deployment serves on as it is
            log.exception("deploy: supervising the deployment failed; it runs on unsupervised")
        finally:
            self.running = False
            self.done.set()
            engine = self._engine()
            if engine is not None:  # nobody decides any more: the pipeline's own liveness does, as unsupervised
                engine.availability.supervised = False
                engine.availability.set(SERVING)

    async def _run(self, task_status) -> None:
        with self.scope:
            self.shape = await trio.to_thread.run_sync(model_shape, self.model)
            engine = self._engine()
            engine.supervise(self.grace_s + RECOVER_BUDGET_S, self.grace_s + RECOVER_BUDGET_S)
            log.info("deploy: supervising generation 1 of %s over %s (hosts dropped after %g s unreachable)",
                     self.shape.name, ", ".join(self.spec.plan_hosts()), self.grace_s)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for name in self.hosts:
                    if name != self.head_name:
                        nursery.start_soon(self._probe, self.hosts[name])
                task_status.started()
                self.running = True
                await self._decide_forever()

    def add(self, name: str, url: str) -> HostState:
        """A host offered later (skippyctl deploy --add): probed, timed, and planned with from now on."""
        if name in self.hosts:
            host = self.hosts[name]
        else:
            host = self.hosts[name] = HostState(name, url, None)
            host.returned = True  # whether it is worth a switch: the plan decides (the gain)
            self.added.add(name)
            self._nursery.start_soon(self._probe, host)
        self._wake.set()
        return host

    async def _probe(self, host: HostState) -> None:
        while True:
            epoch = self._epoch
            try:
                report = await call(host.url, host.name, self.token, lambda i: m.Host(id=i), timeout=PROBE_TIMEOUT_S)
            except ControlError as exc:  # news even while the stages move: a host lost then stops the change
                self._missed(host, str(exc))
            else:
                if epoch == self._epoch and not self._changing:
                    self._answered(host, report)
                elif self._changing:
                    host.failing_since = None  # it answers: not lost, whatever it runs meanwhile
            await trio.sleep(PROBE_S)

    def _missed(self, host: HostState, why: str) -> None:
        now = trio.current_time()
        if host.failing_since is None:
            host.failing_since = now
            if host.state == IN_PLAN:
                log.warning("deploy: %s does not answer (%s): dropped if it does not within %g s", host.name, why,
                            self.grace_s)
                host.move(UNREACHABLE, why)
                self._set(RECOVERING, f"{host.name} does not answer")
        elif host.state in (UNREACHABLE, DROPPED):
            host.reason = why  # the latest: a host back with another token is refused, and says so
        if host.state == UNREACHABLE and now - host.failing_since >= self.grace_s:
            host.move(DROPPED, why)
            self._wake.set()
        elif host.state == WAITING:
            host.move(DROPPED, why)

    def _answered(self, host: HostState, report: dict) -> None:
        host.failing_since = None
        host.answered = True
        host.memory_bytes = report["memory_bytes"]
        host.prefix_cache_bytes = report.get("prefix_cache_mb", 0) << 20
        host.assigned = report.get("assigned")
        if host.state == UNREACHABLE:  # back within the grace: as if nothing happened, if it still runs its stage
            host.move(IN_PLAN)
            if self._runs_its_stage(host):
                log.info("deploy: %s answers again within the grace", host.name)
                if self.change is None and not any(h.state in (UNREACHABLE, DROPPED) and self._in_plan(h)
                                                   for h in self.hosts.values()):
                    self._set(SERVING)  # (a change under way says when it serves)
            self._wake.set()
        elif host.state == IN_PLAN and not self._runs_its_stage(host):
            self._wake.set()  # restarted within the grace: it runs nothing now
        elif host.state == DROPPED and host.held_until is not None and trio.current_time() < host.held_until:
            pass  # it failed a change with an error of its own: taking it back at once would fail again
        elif host.state == DROPPED:
            log.info("deploy: %s, dropped %.0f s ago, answers again", host.name, time.time() - host.since)
            host.move(WAITING)
            host.returned = True
            self._wake.set()

    def _in_plan(self, host: HostState) -> bool:
        return host.name in self.plan.hosts

    def _runs_its_stage(self, host: HostState) -> bool:
        """False once the host answers running nothing (it restarted). A host running another stage than
        planned is left alone: an operator's new deploy is under way, and it assigns the head last."""
        return not host.answered or host.assigned is not None

    def _set(self, state: str, why: str | None = None) -> None:
        engine = self._engine()
        if engine is not None:
            engine.availability.set(state, why)

    # ---------------------------------------------------------------- decisions
    async def _decide_forever(self) -> None:
        while True:
            self._wake = trio.Event()
            try:
                await self._decide()
            except ControlError as exc:  # a host failed mid-change: the next round plans without it
                log.warning("deploy: re-planning: %s; planning again", exc)
            except Exception:  # a bug: logged, and tried again, never taking the head down
                log.exception("deploy: re-planning failed; trying again")
            with trio.move_on_after(DECIDE_S):
                await self._wake.wait()

    async def _decide(self) -> None:
        now = trio.current_time()
        for h in self.hosts.values():  # a grace ends on time, not at the next probe (which may take seconds)
            if h.state == UNREACHABLE and h.failing_since is not None and now - h.failing_since >= self.grace_s:
                h.move(DROPPED, h.reason)
        if self._broken is not None:  # a change was abandoned: the pipeline may be half moved, plan again now
            kind, cause, started = self._broken
            self._broken = None
            self._refused_over = None  # planned with again, whatever was refused before
            for h in self.hosts.values():  # no grace: the plan is broken now, not perhaps in a while
                if h.name != self.head_name and h.state == UNREACHABLE:
                    h.move(DROPPED, h.reason)
            await self._replan(cause, kind, switch=False, started=started)
            return
        lost = [self.hosts[n] for n in self.plan.tail if self.hosts[n].state == DROPPED
                or (self.hosts[n].state == IN_PLAN and not self._runs_its_stage(self.hosts[n]))]
        if any(self.hosts[n].state == UNREACHABLE for n in self.plan.tail):
            return  # within its grace: no plan yet
        engine = self._engine()
        short = engine is not None and engine.availability.state == SHORT
        returned = [h for h in self.hosts.values() if h.returned and h.state == WAITING]
        for h in returned:
            if h.ms_per_layer is None:
                await self._calibrate(h)
        if lost or short:
            for h in lost:
                if h.state == IN_PLAN:  # answers, but runs nothing: it restarted; planned with as any other
                    h.move(WAITING, "it restarted (it ran no stage)")
            cause = (f"{', '.join(h.name for h in lost)} dropped ({'; '.join(h.reason or '' for h in lost)})"
                     if lost else f"{', '.join(h.name for h in returned) or 'a host'} back")
            kind = Cause.RESTARTED if lost and all(h.state == WAITING for h in lost) else \
                Cause.DROPPED if lost else Cause.RETURNED
            await self._replan(cause, kind, switch=False)
        elif returned:
            await self._consider(returned)

    def _candidates(self) -> list[HostState]:
        return [h for name, h in self.hosts.items() if name != self.head_name
                and h.state in (IN_PLAN, WAITING) and h.ms_per_layer is not None]

    def _plan_over(self, hosts: list[HostState]) -> DeployPlan:
        head = self.hosts[self.head_name]
        head_end = self.plan.head_end
        stages = self.spec.stages - 1 if self.spec.stages else None
        tail = [HostInfo(h.name, h.memory_bytes, h.ms_per_layer, prefix_cache_bytes=h.prefix_cache_bytes)
                for h in hosts]
        return plan_tail(self.shape, HostInfo(head.name, max(head.memory_bytes, 1), head.ms_per_layer or 1.0),
                         head_end, tail,
                         ctx=self.spec.ctx, lanes=self.spec.lanes, stages=stages, hop_ms=self.spec.hop_ms)

    async def _replan(self, cause: str, kind: Cause, *, switch: bool, started: float | None = None) -> None:
        started = trio.current_time() if started is None else started
        candidates = self._candidates()
        over = frozenset((h.name, h.memory_bytes >> 26) for h in candidates)  # memory to 64 MiB: it moves
        if over == self._refused_over:
            return  # the same hosts that could not hold the model: nothing new to plan with
        try:
            plan = self._plan_over(candidates)
        except PlanRefused as exc:
            log.error("deploy: %s: cannot serve: %s (waiting for a host to return)", cause, exc)
            self._refused_over = over
            self._set(SHORT, str(exc))
            return
        self._refused_over = None
        self._set(RECOVERING, cause)
        await self._apply(plan, cause, kind, started, drain=switch)

    async def _consider(self, returned: list[HostState]) -> None:
        """A host came (back) while the plan serves: switch if that restores its share or is faster enough."""
        try:
            plan = self._plan_over(self._candidates())
        except PlanError:
            return
        restores = [h for h in returned if h.name in plan.hosts and h.name not in self.added]
        faster = plan.ms_per_token <= (1 - SWITCH_GAIN) * self.plan.ms_per_token
        for h in returned:
            h.returned = False
        if not (restores or faster):
            log.info("deploy: %s answers; the plan over it is not %.0f%% faster (%.2f against %.2f ms per token): "
                     "kept", ", ".join(h.name for h in returned), SWITCH_GAIN * 100, plan.ms_per_token,
                     self.plan.ms_per_token)
            return
        cause = (f"{', '.join(h.name for h in restores)} back" if restores else
                 f"{', '.join(h.name for h in returned)} joined: {plan.ms_per_token:.2f} ms per token against "
                 f"{self.plan.ms_per_token:.2f}")
        await self._apply(plan, cause, Cause.RETURNED if restores else Cause.ADDED, trio.current_time(), drain=True)

    async def _apply(self, plan: DeployPlan, cause: str, kind: Cause, started: float, *, drain: bool) -> None:
        self._epoch += 1
        self._started = []
        self._undo_token_return = None
        self.change = Change(Step.DRAINING if drain else Step.CUTTING, cause, list(plan.hosts))
        try:
            await self._guarded(plan, drain, lambda: self._switch(plan, cause, kind, started, drain=drain))
        except HostLost as exc:
            if self._undo_token_return is not None:
                self._undo_token_return()
            await self._abandon(exc, plan, cause, started, drain=drain)
        finally:
            self._changing = False
            self._epoch += 1
            self.change = None

    async def _guarded(self, plan: DeployPlan, drain: bool, change) -> None:
        """Run `change`; a host it needs lost meanwhile (dropped by the probes: a waiting host at its first
        unanswered probe, one in the plan after its grace) stops it with HostLost, as a call to it that fails
        does. It needs the new plan's hosts, and while draining those of the plan that serves."""
        watched = set(plan.hosts[1:])
        if drain:
            watched |= {name for name in self.plan.tail if self.hosts[name].state == IN_PLAN}
        lost: list[HostLost] = []

        async def watch(scope: trio.CancelScope) -> None:
            while True:
                for name in watched:
                    h = self.hosts[name]
                    if h.state == DROPPED or (h.state == UNREACHABLE and h.failing_since is not None
                                              and trio.current_time() - h.failing_since >= self.grace_s):
                        lost.append(HostLost(name, h.reason or "it does not answer"))
                        scope.cancel()
                        return
                await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            try:
                await change()
            except HostLost as exc:
                lost.insert(0, exc)
            nursery.cancel_scope.cancel()
        if lost:
            raise lost[0]

    async def _abandon(self, exc: HostLost, plan: DeployPlan, cause: str, started: float, *, drain: bool) -> None:
        """A host was lost mid-change: drop it, release what the change started, and serve on the old plan when
        the change touched none of its stages, else plan again at once (the next round of decisions)."""
        kind = Cause.LOST_DURING_SWITCH if drain else Cause.LOST_DURING_TRANSFER
        step = self.change.step if self.change else "change"
        lost = self.hosts[exc.host]
        lost.move(DROPPED, f"lost while {step} ({exc.why})")
        lost.returned = False
        if exc.code != "unreachable":  # it answered, with an error: not again at once (nor every few seconds)
            lost.held_until = trio.current_time() + REFUSED_BACKOFF_S
        if lost.failing_since is None:
            lost.failing_since = trio.current_time()
        started_on = [n for n in self._started if n != lost.name]
        if started_on:  # half a pipeline of the abandoned plan: released, the next plan starts its own stages
            async def release(h: HostState) -> None:
                with trio.move_on_after(RELEASE_TIMEOUT_S):
                    try:
                        await call(h.url, h.name, self.token, lambda i: m.StageRelease(id=i),
                                   timeout=RELEASE_TIMEOUT_S)
                        h.assigned = None
                    except ControlError as why:
                        log.warning("deploy: could not release %s's stage of the abandoned plan: %s", h.name, why)

            async with trio.open_nursery() as nursery:
                for name in started_on:
                    nursery.start_soon(release, self.hosts[name])
        took = trio.current_time() - started
        what = f"{lost.name} lost while {step} ({exc.why})"
        old = [self.hosts[name] for name in self.plan.tail]
        if drain and not started_on and all(h.state == IN_PLAN and self._runs_its_stage(h) for h in old):
            self.replans[kind] += 1
            self.last_change = {"generation": self.generation, "cause": f"{what}; switch abandoned ({cause})",
                                "took_s": round(took, 2), "bytes_shipped": 0, "at": round(time.time(), 3)}
            self._set(SERVING)
            log.warning("deploy: %s: the switch (%s) abandoned after %.2f s; generation %d serves on as it was",
                        what, cause, took, self.generation)
            return
        self._broken = (kind, what, started)
        self._set(RECOVERING, f"{what}: planning again")
        log.warning("deploy: %s: the change to %s (%s) abandoned after %.2f s; planning again over the hosts "
                    "that answer", what, ", ".join(plan.hosts), cause, took)
        self._wake.set()

    async def _switch(self, plan: DeployPlan, cause: str, kind: Cause, started: float, *, drain: bool) -> None:
        engine = self._engine()
        if drain:  # a request boundary: new generations wait, running ones finish (or are replayed after)
            self._set(RECOVERING, f"switching: {cause}")
            with trio.move_on_after(DRAIN_S):
                while any(live.state != GenerationState.QUEUED for live in list(engine.live.values())):
                    await trio.sleep(0.05)
        self.change.step = Step.CUTTING
        topology, files = await trio.to_thread.run_sync(self._cut, plan)
        self.change.step = Step.SHIPPING
        shipped = 0
        failed: list[HostLost] = []

        async def ship(k: int, scope: trio.CancelScope) -> None:
            nonlocal shipped
            host = self.hosts[plan.stages[k].host]
            spec = topology.stage(k)
            try:
                shipped += await send_slice(host.url, host.name, self.token, files[k], spec.sha256,
                                            on_start=lambda: self.change.shipping.append(host.name))
            except ControlError as exc:
                failed.append(HostLost(host.name, str(exc), exc.code))
                scope.cancel()

        async with trio.open_nursery() as nursery:
            for k in range(1, len(plan.stages)):
                nursery.start_soon(ship, k, nursery.cancel_scope)
        if failed:
            raise failed[0]
        self.change.step = Step.STARTING
        self._changing = True
        text = transfer.wire_topology(topology)
        # the new final stage returns tokens from its host
        self._undo_token_return = self.node.take_token_return_from(topology)
        for k in reversed(range(1, len(plan.stages))):
            host = self.hosts[plan.stages[k].host]
            self._started.append(host.name)  # (a failed assignment may leave a stage half started)
            try:
                host.assigned = await call(host.url, host.name, self.token,
                                           lambda i, k=k: m.StageAssign(id=i, topology=text, stage=k),
                                           timeout=ASSIGN_TIMEOUT_S)
            except ControlError as exc:
                raise HostLost(host.name, str(exc), exc.code) from None
        placed = set(plan.hosts)
        for h in self.hosts.values():
            if h.name != self.head_name and h.name not in placed and h.state in (IN_PLAN, WAITING) \
                    and h.assigned is not None:
                try:  # it ran a stage of the old plan: it waits now
                    await call(h.url, h.name, self.token, lambda i: m.StageRelease(id=i), timeout=30.0)
                    h.assigned = None
                except ControlError as exc:
                    log.warning("deploy: could not release %s's old stage: %s", h.name, exc)
            if h.state in (IN_PLAN, WAITING):
                h.move(IN_PLAN if h.name in placed else WAITING)
                if h.name in placed:  # (one back while the change ran and left out: considered next)
                    h.returned = False
        await self.node.retarget(topology)  # the head's lanes and watch to the new stage 1
        self.plan = ServedPlan.switched(plan)
        self.generation += 1
        self._set(SERVING)
        took = trio.current_time() - started
        self.replans[kind] += 1
        self.last_change = {"generation": self.generation, "cause": cause, "took_s": round(took, 2),
                            "bytes_shipped": shipped, "at": round(time.time(), 3)}
        log.info("deploy: generation %d: %s; now %s (%s shipped); serving after %.2f s", self.generation, cause,
                 ", ".join(f"{s.host} {s.layer_start}:{s.layer_end}" for s in plan.stages),
                 f"{shipped / (1 << 20):.1f} MiB" if shipped else "nothing", took)

    def _cut(self, plan: DeployPlan) -> tuple[Topology, list[Path]]:
        """The plan's stage files, cut from the model copy once per ranges (kept beside it); the topology's head
        the one serving now."""
        addresses = [format_address(self.hosts[s.host].host, self.spec.stage_port + s.index) for s in plan.stages]
        topology = transfer.cut_slices(self.model, plan.ranges, self.model.parent / "cuts", addresses)
        files = [s.file for s in topology.stages]
        head = self.node.topology.stage(0) if self.node.topology is not None else topology.stages[0]
        return attrs.evolve(topology, stages=[head, *topology.stages[1:]]), files

    async def _calibrate(self, host: HostState) -> None:
        """Time a host that joined on a few of the model's layers (as deploy does)."""
        path, sha = await trio.to_thread.run_sync(transfer.calibration_slice, self.model, self.shape.n_layer,
                                                  self.model.parent / "cuts")
        try:
            await send_slice(host.url, host.name, self.token, path, sha)
            timing = await call(host.url, host.name, self.token, lambda i: m.Calibrate(id=i, sha256=sha),
                                timeout=120.0)
        except ControlError as exc:
            log.warning("deploy: could not time %s: %s", host.name, exc)
            return
        host.ms_per_layer = timing["ms_per_layer"]
        log.info("deploy: %s joins: %.3f ms per layer", host.name, host.ms_per_layer)

