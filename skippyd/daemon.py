"""skippyd: wires the stage servers, the head and the control channel; logging, signals, drain, sd_notify.

    skippyd --topology DIR/topology.toml --stage K     run stage K (stage 0 is the head)
    skippyd --topology DIR/topology.toml --stage all   every stage of the topology in one daemon
    skippyd --model FILE.gguf                          the whole model as one stage
    skippyd --config /etc/skippy/skippyd.toml          the same, from a file (flags override it)

The command line is :mod:`skippyd.cli`, the settings :mod:`skippyd.config`,
what they make the daemon run :mod:`skippyd.plan`, its status report
:mod:`skippyd.status`.

Life cycle (see skippyd(8)): READY=1 goes to systemd only once every listener
accepts work. SIGTERM or SIGINT drains: no new generations, running ones get
`drain_grace` seconds to finish, the rest are cancelled through the normal
cleanup path, and the daemon exits 0 (a second signal skips the wait).
SIGHUP re-reads the config file and applies what can change safely.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import trio

from skippyd.cli import build_parser, check_config, read_settings
from skippyd.config import Config, ConfigError, Settings, parse_hostport, with_values
from skippyd.head.sequence import STOP_TIMEOUT_S
from skippyd.hosts import Machines
from skippyd.plan import Plan, SettingsRefused, plan_daemon
from skippyd.runtime.llama import LlamaError
from skippyd.stage.server import StageServer
from skippyd.status import StatusReport
from skippyd.topology import TopologyError

log = logging.getLogger("skippyd")

# after the grace period: how long cancelled generations get to clean up and answer. A generation's
# cleanup waits at most STOP_TIMEOUT_S twice (the stop down its lane, then its KV clear, which waits for
# the compute in progress: seconds with a big model).
KILL_WAIT_S = 2 * STOP_TIMEOUT_S + 1.0
STATUS_EVERY_S = 5.0  # how often systemd's STATUS= line is refreshed (when it changed)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_SOFTWARE = 0, 1, 2, 70


class JournalFormatter(logging.Formatter):
    """Plain lines; with journald (JOURNAL_STREAM set) each gets its <priority> prefix."""

    PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def __init__(self) -> None:
        super().__init__("%(name)s: %(message)s")
        self.journal = bool(os.environ.get("JOURNAL_STREAM"))

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if self.journal:
            return f"<{self.PRIORITY.get(record.levelno, 6)}>{line}"
        return f"{time.strftime('%H:%M:%S')} {record.levelname.lower()} {line}"


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def notify(state: str) -> None:
    """sd_notify without dependencies; a no-op without NOTIFY_SOCKET, never raises."""
    import socket

    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(state.encode(), addr)
    except OSError:
        pass


class Daemon:
    """One skippyd: runs what its settings plan, serves control and the OpenAI API, drains on a signal."""

    def __init__(self, config: Config, *, settings: Settings | None = None):
        from skippyd.openai.metrics import Metrics  # prometheus_client only, no HTTP server

        self.config = config  # the settings in force (SIGHUP may change the reloadable ones)
        self.settings = settings  # where they came from: the file SIGHUP re-reads
        self.metrics = Metrics(self)
        self.plan: Plan | None = None
        self.stages: list[StageServer] = []
        self.link_auth = b""  # the link secret's Hello auth (status probes present it too)
        self.head = None
        self.control = None
        self.openai = None
        self.assignment = None  # the stage `skippyctl deploy` gave this daemon, and the slices it holds
        self.started = time.time()
        self.ready = False
        self.draining = False
        self.topology = None
        self._stopping = False
        self.report = StatusReport(self)
        self.machines = Machines()  # the topology's hosts as machines (each resolved once, when asked)

    # ---------------------------------------------------------------- lifetime
    async def run(self) -> None:
        from skippyd.head.node import HeadNode

        plan = self.plan = plan_daemon(self.config, self.machines)  # before any task: SettingsRefused is exit 2
        self.topology, self.link_auth = plan.topology, plan.link_auth
        config = self.config
        waiting = plan.model is None and plan.topology is None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_signals, nursery)
            if config.control.enabled:
                from skippyd.deploy.agent import Assignment
                from skippyd.deploy.slices import SliceStore, default_slices_dir

                self.assignment = Assignment(self, SliceStore(config.pipeline.slices_dir or default_slices_dir()),
                                             accepts_stages=waiting)
                self.assignment.nursery = nursery
            if waiting:
                log.info("no topology and no model: waiting for `skippyctl deploy` to assign a stage (slices in %s)",
                         self.assignment.slices.dir)
            elif plan.model is not None:
                notify(f"STATUS=loading {plan.model}")
                self.head = await nursery.start(HeadNode(plan.stage, model_path=plan.model, **plan.head.kwargs()).run)
            else:
                # downstream stages first, so the head's lanes find them listening
                for k in sorted(plan.indices, reverse=True):
                    spec = plan.topology.stage(k)
                    notify(f"STATUS=loading stage {k} (layers {spec.layer_start}-{spec.layer_end})")
                    if k == 0:
                        self.head = await nursery.start(HeadNode(plan.stage, topology=plan.topology,
                                                                 **plan.head.kwargs()).run)
                    else:
                        self.stages.append(await nursery.start(StageServer(plan.topology, k, plan.stage).run))
            if config.control.enabled:
                from skippyd.control.server import ControlServer

                self.control = ControlServer(self, *parse_hostport(config.control.listen),
                                             token_file=config.control.token_file)
                await nursery.start(self.control.run)
            from skippyd import telemetry

            telemetry.configure(config.daemon.telemetry)
            if self.head is not None and config.openai.listen:
                from skippyd.openai.server import OpenAIServer

                self.openai = await nursery.start(OpenAIServer(self, *parse_hostport(config.openai.listen),
                                                               model_id=config.openai.model_id,
                                                               api_key=plan.api_key,
                                                               public_metrics=config.openai.public_metrics).run)
            elif config.openai.listen:
                log.info("--openai: this daemon runs no head (stage 0): no OpenAI API here")
            # Every listener started above accepts work: only now may systemd hear READY=1.
            self.ready = True
            notify(f"READY=1\nSTATUS={self.describe_load()}")
            log.info("ready: %s", self.describe_role())
            nursery.start_soon(self._report_status)

    def describe_role(self) -> str:
        if self.head is None and not self.stages and self.assignment is not None and self.assignment.accepts_stages:
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
            return f"{role}: draining, {self._running()} running"
        engine = self.head.engine if self.head is not None else None
        if engine is not None:
            return f"{role}: {len(engine.live)} generations running, {engine.totals['generations']} done"
        return f"{role}: {self._running()} sessions"

    def _running(self) -> int:
        """Generations running on the head, or sessions held by this daemon's stages."""
        if self.head is not None and self.head.engine is not None:
            # a generation has left the engine before its client has the last of it (the queued pieces,
            # the result): a drain that stopped there would cut the reply off
            answering = sum(server.answering for server in (self.control, self.openai and self.openai.app)
                            if server is not None)
            return max(len(self.head.engine.live), answering)
        return sum(s.sessions.snapshot()["live_sessions"] for s in self.stages)

    async def _report_status(self) -> None:
        last = None
        while True:
            await trio.sleep(STATUS_EVERY_S)
            line = self.describe_load()
            if line != last:
                notify(f"STATUS={line}")
                last = line

    # ---------------------------------------------------------------- signals
    async def _watch_signals(self, nursery: trio.Nursery) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGHUP:
                    self.reload()
                elif self._stopping:
                    log.info("received %s again: cancelling what still runs", name)
                    await self._cancel_running()
                    nursery.cancel_scope.cancel()
                else:
                    self._stopping = True
                    log.info("received %s: draining (running generations get %gs to finish)", name,
                             self.config.daemon.drain_grace)
                    notify("STOPPING=1\nSTATUS=draining")
                    nursery.start_soon(self._shutdown, nursery.cancel_scope)

    async def _shutdown(self, scope: trio.CancelScope) -> None:
        if not await self.drain(self.config.daemon.drain_grace):
            log.warning("drain: grace period over with %d still running: cancelling them", self._running())
            await self._cancel_running()
        log.info("stopping")
        if self.control is not None:
            await self.control.close_all("skippyd is shutting down")
        scope.cancel()

    async def drain(self, grace_s: float) -> bool:
        """Stop taking new generations, let running ones finish up to `grace_s`. True if all finished."""
        self.draining = True
        for stage in self.stages:
            stage.begin_drain()  # new sessions from upstream are refused (SHUTTING_DOWN), running ones go on
        if self.head is not None and self.head.engine is not None:
            self.head.engine.begin_drain()
        if self.head is not None and self.head.pool is not None:
            await self.head.pool.drain()
        last = None
        with trio.move_on_after(grace_s):
            while (running := self._running()) > 0:
                if running != last:
                    notify(f"STATUS={self.describe_load()}")
                    last = running
                await trio.sleep(0.05)
        await self._write_prefix_caches()
        return self._running() == 0

    async def _write_prefix_caches(self) -> None:
        """A drain writes what each local stage's prefix cache holds to its disk tier (if it has one), so the
        next start finds it there."""
        caches = [getattr(s.core, "prefix_cache", None) for s in self.stages]
        if self.head is not None and self.head.engine is not None:
            caches.append(getattr(self.head.engine, "prefix_cache", None))
        for cache in filter(None, caches):
            written = await cache.write_through()
            if written:
                log.info("stage %d: prefix cache: %d entries written to its disk tier", cache.stage_index, written)

    async def _cancel_running(self) -> None:
        """Kill every running generation through the engine's cleanup path, and wait a moment for it (and for
        its client to be told)."""
        engine = self.head.engine if self.head is not None else None
        if engine is None:
            return
        for session_id in list(engine.live):
            engine.kill(session_id, f"the daemon is shutting down (its drain grace of "
                                    f"{self.config.daemon.drain_grace:g} s is over)")
        with trio.move_on_after(KILL_WAIT_S):
            while self._running():
                await trio.sleep(0.02)

    def reload(self) -> None:
        """SIGHUP: re-read the config file; apply what can change while running, log the rest."""
        settings = self.settings
        if settings is None or settings.path is None:
            log.info("SIGHUP: no configuration file to re-read (running on flags and defaults)")
            return
        notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            result = settings.reload()
        except ConfigError as exc:
            log.error("SIGHUP: %s is invalid; keeping the running configuration:\n%s", settings.path, exc)
            notify("READY=1")
            return
        self.config = with_values(self.config, {key: new for key, (_old, new) in result.applied.items()})
        if "daemon.log_level" in result.applied:
            logging.getLogger().setLevel(self.config.daemon.log_level.upper())
        for key, (old, new) in result.applied.items():
            log.info("SIGHUP: %s: %s → %s", key, old, new)
        for key in result.pinned:
            log.info("SIGHUP: %s changed in %s, but the command line sets it: ignored", key, settings.path)
        for key in result.restart:
            log.warning("SIGHUP: %s changed in %s; it takes effect at the next restart", key, settings.path)
        if not (result.applied or result.pinned or result.restart):
            log.info("SIGHUP: re-read %s: nothing changed", settings.path)
        else:
            log.info("SIGHUP: re-read %s: %d applied, %d need a restart", settings.path, len(result.applied),
                     len(result.restart))
        notify(f"READY=1\nSTATUS={self.describe_load()}")

    # ---------------------------------------------------------------- status
    async def status(self) -> dict:
        """What `skippyctl status` shows (skippyd.status)."""
        return await self.report.status()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = read_settings(args)
    except ConfigError as exc:
        print(f"skippyd: bad configuration:\n{exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.check_config:
        check_config(settings)
        return EXIT_OK
    config = settings.config
    setup_logging(config.daemon.log_level)
    if settings.path is not None:
        log.info("configuration: %s", settings.path)
    try:
        trio.run(Daemon(config, settings=settings).run)
    except KeyboardInterrupt:
        pass
    except SettingsRefused as exc:
        print(f"skippyd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, ValueError, LlamaError, TopologyError) as exc:  # startup failures: one clear line
        log.error("fatal: %s", exc)
        return EXIT_FAILURE
    except BaseExceptionGroup as group:
        expected, other = group.split((OSError, ValueError, LlamaError, TopologyError))
        if other is None:
            log.error("fatal: %s", "; ".join(str(e) for e in _leaves(expected)))
            return EXIT_FAILURE
        log.critical("internal error (a bug; please report it)", exc_info=group)
        return EXIT_SOFTWARE
    return EXIT_OK


def _leaves(group: BaseExceptionGroup):
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


if __name__ == "__main__":
    sys.exit(main())
