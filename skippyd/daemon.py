"""skippyd: its node (skippyd/node.py) runs the stages and listeners; here logging, signals, drain, sd_notify.

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

from skippyd.cli import build_parser, check_config, print_version, read_settings
from skippyd.config import Config, ConfigError, Settings, with_values
from skippyd.head.sequence import STOP_TIMEOUT_S
from skippyd.node import Node
from skippyd.plan import SettingsRefused, plan_daemon
from skippyd.runtime.llama import LlamaError
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
    """One skippyd: its node (skippyd/node.py) runs what the settings plan; the daemon keeps the signals (drain
    on SIGTERM, reload on SIGHUP), the logging and systemd's notifications."""

    def __init__(self, config: Config, *, settings: Settings | None = None):
        self.settings = settings  # where the settings came from: the file SIGHUP re-reads
        self.node = Node(config, settings=settings, notify=notify)
        self._stopping = False

    @property
    def config(self) -> Config:
        """The settings in force (SIGHUP may change the reloadable ones)."""
        return self.node.config

    # ---------------------------------------------------------------- lifetime
    async def run(self) -> None:
        node = self.node
        plan = plan_daemon(self.config, node.machines)  # before any task: SettingsRefused is exit 2
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_signals, nursery)
            await nursery.start(node.run, plan)
            # Every listener accepts work: only now may systemd hear READY=1.
            notify(f"READY=1\nSTATUS={node.describe_load()}")
            log.info("ready: %s", node.describe_role())
            nursery.start_soon(self._report_status)

    async def _report_status(self) -> None:
        last = None
        while True:
            await trio.sleep(STATUS_EVERY_S)
            line = self.node.describe_load()
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
        node = self.node
        if not await node.drain(self.config.daemon.drain_grace):
            log.warning("drain: grace period over with %d still running: cancelling them", node.running())
            await self._cancel_running()
        log.info("stopping")
        if node.control is not None:
            await node.control.close_all("skippyd is shutting down")
        scope.cancel()

    async def _cancel_running(self) -> None:
        await self.node.cancel_running(f"the daemon is shutting down (its drain grace of "
                                       f"{self.config.daemon.drain_grace:g} s is over)", KILL_WAIT_S)

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
        self.node.reconfigure(with_values(self.config, {key: new for key, (_old, new) in result.applied.items()}))
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
        notify(f"READY=1\nSTATUS={self.node.describe_load()}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print_version()
        return EXIT_OK
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
