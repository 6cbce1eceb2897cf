"""skippyd: flags and config, logging, signals and drain — wires the stage servers, the head and the control channel.

    skippyd --topology DIR/topology.toml --stage K     run stage K (stage 0 is the head)
    skippyd --topology DIR/topology.toml --stage all   every stage of the topology in one daemon
    skippyd --model FILE.gguf                          the whole model as one stage
    skippyd --config /etc/skippy/skippyd.toml          the same, from a file (flags override it)

Life cycle (see skippyd(8)): READY=1 goes to systemd only once every listener
accepts work. SIGTERM or SIGINT drains: no new generations, running ones get
`drain_grace` seconds to finish, the rest are cancelled through the normal
cleanup path, and the daemon exits 0 (a second signal skips the wait).
SIGHUP re-reads the config file and applies what can change safely.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

import trio

from skippyd import config as cfgmod
from skippyd.config import ConfigError, Settings, parse_hostport
from skippyd.head.engine import STOP_TIMEOUT_S
from skippyd.hosts import THIS_MACHINE, Machines
from skippyd.runtime.llama import LlamaError
from skippyd.stage.server import StageConfig, StageServer
from skippyd.stage.threads import usable_cores
from skippyd.topology import TopologyError
from skippyd.wire.messages import PROTOCOL_VERSION

log = logging.getLogger("skippyd")

DEFAULT_CONTROL = cfgmod.DEFAULT_CONTROL
# after the grace period: how long cancelled generations get to clean up and answer. A generation's
# cleanup waits at most STOP_TIMEOUT_S twice (the stop down its lane, then its KV clear, which waits for the
# compute in progress: seconds with a big model); 3 s cut that short and the client got the daemon's
# going-away close instead of its "cancelled" result.
KILL_WAIT_S = 2 * STOP_TIMEOUT_S + 1.0
STATUS_EVERY_S = 5.0  # how often systemd's STATUS= line is refreshed (when it changed)
PROBE_TTL_S = 1.0  # status: a stage's reachability is probed at most this often

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_SOFTWARE = 0, 1, 2, 70


def _hostport(text: str) -> tuple[str, int]:
    try:
        return parse_hostport(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _allow_list(text: str) -> list[str]:
    from skippyd.topology import TopologyError, parse_allow_entry

    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise argparse.ArgumentTypeError("give at least one address, or 'any'")
    for entry in entries:
        try:
            parse_allow_entry(entry)
        except TopologyError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return entries


def build_parser() -> argparse.ArgumentParser:
    """Every flag that has a config key defaults to None: "not given", so the file's value applies."""
    p = argparse.ArgumentParser(
        prog="skippyd", description="skippy pipeline stage daemon (one per host). See skippyd(8).",
        epilog="Flags override the configuration file (skippyd.toml(5)).")
    p.add_argument("--config", type=Path, default=None,
                   help="configuration file (default: $CONFIGURATION_DIRECTORY/skippyd.toml, "
                        "then /etc/skippy/skippyd.toml, if present)")
    p.add_argument("--check-config", action="store_true",
                   help="check the configuration, print the settings in force and exit")
    src = p.add_argument_group("what to run")
    src.add_argument("--topology", type=Path, help="topology.toml written by `skippyctl model split`")
    src.add_argument("--stage", default=None, help="stage index to run, or 'all' (default: all)")
    src.add_argument("--model", type=Path, help="run this whole GGUF model as a single stage")
    run = p.add_argument_group("runtime")
    run.add_argument("--lanes", type=int, default=None, help="concurrent sessions per stage (KV sequences, default 4)")
    run.add_argument("--ctx", type=int, default=None, help="context tokens per session (default 4096)")
    run.add_argument("--threads", type=int, default=None,
                     help="compute threads per stage (default: all cores it may use, affinity and cgroup quota; "
                          "with --compute-lock off, those cores / stages of the topology on this host)")
    run.add_argument("--thread-poll", type=int, default=None, metavar="N",
                     help="ggml thread pool: workers spin N (0-100) before sleeping between graphs "
                          "(default 0); -1 uses llama.cpp's per-graph threads instead of a pool")
    run.add_argument("--keep-warm-ms", type=float, default=None, metavar="MS",
                     help="after each compute, a thread of the lowest scheduling class spins MS milliseconds on "
                          "otherwise idle cores, so the next step does not start on cores gone cold (default 0: "
                          "off; for a host that runs nothing but this stage, above the pipeline's round trip)")
    run.add_argument("--compute-lock", choices=("auto", "on", "off"), default=None,
                     help="skippy stages on this host take turns at the cores, each computing with all its "
                          "threads (default auto: on unless a stage has 1 thread; off: the stages of the "
                          "topology on this host split the cores instead)")
    run.add_argument("--adapt-threads", choices=("on", "off"), default=None,
                     help="with several threads: compute with fewer (half, down to one) while that is much "
                          "faster, as when other programs hold the cores and ggml's threads wait for each other "
                          "(default on)")
    run.add_argument("--flash-attn", choices=("off", "on", "auto"), default=None,
                     help="llama.cpp's flash attention (default off: on this CPU build it halves decode speed "
                          "once a session holds a few hundred tokens; auto lets llama.cpp decide)")
    run.add_argument("--decode-groups", type=int, default=None, metavar="N",
                     help="keep the sessions decoding at once in N groups, one in flight on each stage, so that "
                          "stages on hosts of their own compute at the same time (default 0: the number of "
                          "machines of the topology, by address; 1 with --stage all or --model). Give every stage "
                          "the same N")
    run.add_argument("--batch", type=int, default=None, help="max tokens per llama_decode (default 512)")
    run.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per prefill chunk (default 256)")
    run.add_argument("--credit", type=int, default=None, help="outstanding prefill acks per link (default 2)")
    run.add_argument("--reply-timeout", type=float, default=None,
                     help="seconds a stage may take to answer (default 30)")
    run.add_argument("--direct-return", action=argparse.BooleanOptionalAction, default=None,
                     help="with 3+ stages the final stage sends predictions straight to the head "
                          "(default on; the head listens on its topology address for it)")
    run.add_argument("--queue-timeout", type=_non_negative, default=None, metavar="SECONDS",
                     help="the head: how long a generation may wait for a free session slot (default 30)")
    run.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                     help="the head: a generation a stage failure interrupts is replayed once the pipeline "
                          "is whole again, instead of failing (default off)")
    run.add_argument("--resume-window", type=_non_negative, default=None, metavar="SECONDS",
                     help="with --resume: how long to wait for the pipeline to come back (default 30)")
    net = p.add_argument_group("network")
    net.add_argument("--listen", type=_hostport, default=None,
                     help="HOST:PORT for this stage's listener (default: from the topology)")
    net.add_argument("--upstream-allow", type=_allow_list, default=None, metavar="LIST",
                     help="comma-separated addresses, networks (10.0.0.0/24) or host names that may open a "
                          "lane to this stage, or 'any' (default: the previous stage's host in the topology)")
    net.add_argument("--link-secret-file", type=Path, default=None, metavar="FILE",
                     help="a secret shared by every daemon of the pipeline: stage links without it are refused")
    net.add_argument("--frame-timeout", type=_non_negative, default=None, metavar="SECONDS",
                     help="a frame, once started, must arrive whole within this plus its size at 1 MiB/s "
                          "(default 5)")
    net.add_argument("--control", type=_hostport, default=None,
                     help=f"control websocket HOST:PORT (default {DEFAULT_CONTROL})")
    net.add_argument("--control-token-file", type=Path, default=None,
                     help="file holding the control token (created 0600 if absent; "
                          "default $STATE_DIRECTORY/control.token or ~/.local/state/skippy/control.token)")
    net.add_argument("--no-control", action="store_true", help="do not serve the control channel")
    net.add_argument("--link-delay-ms", type=_non_negative, default=None, metavar="MS",
                     help="link conditioning (tests, benchmarks): add MS one-way delay to every frame this "
                          "daemon sends to another stage (default 0)")
    net.add_argument("--link-mbps", type=_non_negative, default=None, metavar="MBPS",
                     help="link conditioning: cap what this daemon sends to another stage at MBPS megabits/s "
                          "per connection (default 0: no cap)")
    life = p.add_argument_group("daemon")
    life.add_argument("--drain-grace", type=float, default=None,
                      help="seconds running generations may take to finish on SIGTERM (default 30)")
    life.add_argument("--receipts", type=Path, default=None, help="append a JSON line per generation to this file")
    life.add_argument("--log-level", default=None, choices=cfgmod.LOG_LEVELS, help="default info")
    # --- OpenAI API and telemetry (skippyd/openai/, skippyd/telemetry.py) ---
    api = p.add_argument_group("OpenAI API and telemetry")
    api.add_argument("--openai", type=_hostport, default=None, metavar="HOST:PORT",
                     help="serve the OpenAI-compatible HTTP API (and /metrics) here; only the head serves it")
    api.add_argument("--model-id", default=None,
                     help="model name the OpenAI API serves (default: the GGUF file name without .gguf)")
    api.add_argument("--telemetry", default=None, choices=("off", "summary", "debug"),
                     help="timing spans: off (default), summary (totals), debug (one JSON line per span on stderr)")
    # --- end OpenAI API and telemetry ---
    return p


class _JournalFormatter(logging.Formatter):
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
    handler.setFormatter(_JournalFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class Daemon:
    def __init__(self, args: argparse.Namespace, *, settings: Settings | None = None):
        from skippyd.openai.metrics import Metrics  # prometheus_client only, no HTTP server

        self.args = args
        self.settings = settings
        self.metrics = Metrics(self)
        self.stages: list[StageServer] = []
        self._link_auth = b""  # the link secret's Hello auth (status probes present it too)
        self.head = None
        self.control = None
        self.openai = None
        self.started = time.time()
        self.ready = False
        self.draining = False
        self.topology = None
        self._stopping = False
        self._probes: dict[int, tuple[float, dict]] = {}
        self.machines = Machines()  # the topology's hosts as machines (each resolved once, when asked)

    # ---------------------------------------------------------------- what to run
    def _stage_indices(self) -> list[int]:
        n = len(self.topology.stages)
        if self.args.stage in (None, "all"):
            return list(range(n))
        try:
            k = int(self.args.stage)
        except ValueError:
            raise SystemExit(f"skippyd: --stage must be a number or 'all', got {self.args.stage!r}")
        if not 0 <= k < n:
            raise SystemExit(f"skippyd: --stage {k} is outside the topology's {n} stages (0..{n - 1})")
        return [k]

    def _stages_on_this_host(self) -> int:
        """Stages of the topology on this machine: by address (loopback, this machine's own addresses, and
        names that resolve to them), or bound to the same host as this daemon's stage."""
        machines = self.machines
        here = {THIS_MACHINE, machines.of(self.topology.stage(self._stage_indices()[0]).host)}
        return sum(1 for s in self.topology.stages if machines.of(s.host) in here)

    def _decode_groups(self) -> int:
        """--decode-groups, or (0) one group per machine of the topology: stages on one machine take turns
        at its cores, stages on machines of their own compute at the same time, each on another group's
        steps."""
        a = self.args
        if a.decode_groups:
            return a.decode_groups
        if self.topology is None or a.stage in (None, "all"):
            return 1  # a whole model, or every stage in this process
        return self.machines.count([s.host for s in self.topology.stages])

    def _config(self, n_local: int) -> StageConfig:
        a = self.args
        cores = usable_cores()  # affinity and cgroup quota: what a container was given, not the host's
        if a.threads and a.threads > cores:
            then = (f"computing with {cores} and trying more now and then (kept only if faster)"
                    if a.adapt_threads == "on" else f"give --threads {cores} or fewer")
            log.warning("--threads %d is more than the %d cores this daemon may use: ggml's threads wait for each "
                        "other at every barrier, which slows a step down several times; %s", a.threads, cores, then)
        poll = a.thread_poll if a.thread_poll >= 0 else None
        if a.keep_warm_ms and n_local > 1:
            log.warning("--keep-warm-ms with %d stages of the topology on this host: each one's keep-warm thread "
                        "takes the cores from the others' computes now and then, which holds up their threads at "
                        "every barrier (3 stages on loopback: 10 ms a token became 17, BENCHMARKS.md); it is for "
                        "hosts that run one stage", n_local)
        # ggml's workers spin at every barrier, so stages computing on the same cores at once slow each
        # other down badly (two 2-thread stages on 2 cores: a third of the speed, BENCHMARKS.md). Taking
        # turns (the compute lock; pool workers sleep between graphs) every stage can use every core.
        # A lone thread never spins: one-thread stages need no turns. With the lock off, the stages on
        # this host split its cores.
        if a.compute_lock == "off":
            threads = a.threads or max(1, cores // max(1, n_local))
            lock = False
        else:
            threads = a.threads or cores
            lock = a.compute_lock == "on" or threads > 1
        cfg = StageConfig(n_ctx_per_seq=a.ctx, lanes=a.lanes, n_batch=a.batch, n_threads=threads, thread_poll=poll,
                          compute_lock=lock, adapt_threads=a.adapt_threads == "on", flash_attn=a.flash_attn,
                          keep_warm_ms=a.keep_warm_ms,
                          decode_groups=self._decode_groups(),
                          credit_limit=a.credit, reply_timeout_s=a.reply_timeout,
                          direct_return=getattr(a, "direct_return", None) is not False,
                          link_delay_ms=getattr(a, "link_delay_ms", None) or 0.0,
                          link_mbps=getattr(a, "link_mbps", None) or 0.0)
        if a.listen:
            cfg.listen_host, cfg.listen_port = a.listen
        if getattr(a, "upstream_allow", None) is not None:
            cfg.upstream_allow = tuple(a.upstream_allow)
        if getattr(a, "frame_timeout", None) is not None:
            cfg.frame_timeout_s = a.frame_timeout
        cfg.link_auth = self._link_auth
        return cfg

    def _check_links(self) -> bytes:
        """Check the stage-link settings; returns the link secret's Hello auth (b"": none)."""
        a = self.args
        if getattr(a, "frame_timeout", None) is not None and a.frame_timeout < 0.1:
            raise SystemExit(f"skippyd: --frame-timeout must be at least 0.1 s, got {a.frame_timeout:g}")
        if getattr(a, "link_secret_file", None) is None:
            return b""
        from skippyd.stage.access import LinkSecretError, load_link_secret

        try:
            return load_link_secret(a.link_secret_file)
        except LinkSecretError as exc:
            raise SystemExit(f"skippyd: {exc}") from None

    # ---------------------------------------------------------------- lifetime
    async def run(self) -> None:
        from skippyd.head.node import HeadNode
        from skippyd.topology import Topology, TopologyError

        a = self.args
        if (a.topology is None) == (a.model is None):
            raise SystemExit("skippyd: give either --topology FILE (with --stage) or --model FILE "
                             "(or [pipeline] topology / model in the config file)")
        indices: list[int] = []
        if a.topology is not None:
            try:
                self.topology = Topology.load(a.topology)
            except (TopologyError, OSError) as exc:
                raise SystemExit(f"skippyd: {exc}")
            indices = self._stage_indices()
        self._link_auth = self._check_links()  # before any task: a bad setting is a usage error (exit 2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_signals, nursery)
            if a.model is not None:
                _notify(f"STATUS=loading {a.model}")
                cfg = self._config(1)
                self.head = await nursery.start(HeadNode(cfg, model_path=a.model, prefill_chunk=a.prefill_chunk,
                                                         receipts_file=a.receipts, **self._head_options()).run)
            else:
                cfg = self._config(self._stages_on_this_host())
                # downstream stages first, so the head's lanes find them listening
                for k in sorted(indices, reverse=True):
                    spec = self.topology.stage(k)
                    _notify(f"STATUS=loading stage {k} (layers {spec.layer_start}-{spec.layer_end})")
                    if k == 0:
                        self.head = await nursery.start(HeadNode(cfg, topology=self.topology,
                                                                 prefill_chunk=a.prefill_chunk,
                                                                 receipts_file=a.receipts,
                                                                 **self._head_options()).run)
                    else:
                        self.stages.append(await nursery.start(StageServer(self.topology, k, cfg).run))
            if not a.no_control:
                from skippyd.control.server import ControlServer

                self.control = ControlServer(self, *a.control, token_file=a.control_token_file)
                await nursery.start(self.control.run)
            # --- OpenAI API and telemetry (skippyd/openai/, skippyd/telemetry.py) ---
            from skippyd import telemetry

            telemetry.configure(getattr(a, "telemetry", None) or "off")
            if self.head is not None and getattr(a, "openai", None):
                from skippyd.openai.server import OpenAIServer

                self.openai = await nursery.start(OpenAIServer(self, *a.openai,
                                                               model_id=getattr(a, "model_id", None)).run)
            elif getattr(a, "openai", None):
                log.info("--openai: this daemon runs no head (stage 0): no OpenAI API here")
            # --- end OpenAI API and telemetry ---
            # Every listener started above accepts work: only now may systemd hear READY=1.
            self.ready = True
            _notify(f"READY=1\nSTATUS={self.describe_load()}")
            log.info("ready: %s", self.describe_role())
            nursery.start_soon(self._report_status)

    def _head_options(self) -> dict:
        a = self.args
        return {"queue_timeout": 30.0 if a.queue_timeout is None else a.queue_timeout,
                "resume_window": (30.0 if a.resume_window is None else a.resume_window) if a.resume else None}

    def describe_role(self) -> str:
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
                _notify(f"STATUS={line}")
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
                             self.args.drain_grace)
                    _notify("STOPPING=1\nSTATUS=draining")
                    nursery.start_soon(self._shutdown, nursery.cancel_scope)

    async def _shutdown(self, scope: trio.CancelScope) -> None:
        if not await self.drain(self.args.drain_grace):
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
        if self.head is not None and self.head.pool is not None:
            await self.head.pool.drain()
        last = None
        with trio.move_on_after(grace_s):
            while (running := self._running()) > 0:
                if running != last:
                    _notify(f"STATUS={self.describe_load()}")
                    last = running
                await trio.sleep(0.05)
        return self._running() == 0

    async def _cancel_running(self) -> None:
        """Kill every running generation through the engine's cleanup path, and wait a moment for it (and for
        its client to be told)."""
        engine = self.head.engine if self.head is not None else None
        if engine is None:
            return
        for session_id in list(engine.live):
            engine.kill(session_id, f"the daemon is shutting down (its drain grace of {self.args.drain_grace:g} s "
                                    f"is over)")
        with trio.move_on_after(KILL_WAIT_S):
            while self._running():
                await trio.sleep(0.02)

    def reload(self) -> None:
        """SIGHUP: re-read the config file; apply what can change while running, log the rest."""
        settings = self.settings
        if settings is None or settings.path is None:
            log.info("SIGHUP: no configuration file to re-read (running on flags and defaults)")
            return
        _notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            result = settings.reload()
        except ConfigError as exc:
            log.error("SIGHUP: %s is invalid; keeping the running configuration:\n%s", settings.path, exc)
            _notify("READY=1")
            return
        if "daemon.log_level" in result.applied:
            logging.getLogger().setLevel(self.args.log_level.upper())
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
        _notify(f"READY=1\nSTATUS={self.describe_load()}")

    # ---------------------------------------------------------------- status
    def _model(self):
        if self.head is not None and self.head.model is not None:
            return self.head.model
        return next((s.model for s in self.stages if s.model is not None), None)

    async def status(self) -> dict:
        """Role, model, local stages, the topology with each stage's reachability and version, uptime, load."""
        snap = self.snapshot()
        model = self._model()
        snap["model"] = None if model is None else {
            "name": self.head.model_name if self.head is not None else self.topology.model_name,
            "gguf_name": model.name, "path": str(model.path), "architecture": model.architecture,
            "n_layer_total": model.stage.n_layer_total}
        local = []
        if self.head is not None and self.head.model is not None:
            st = self.head.model.stage
            hub = self.head.hub
            local.append({"index": 0, "layers": [st.layer_start, st.layer_end],
                          "listen": hub.address if hub is not None else None})
        for s in sorted(self.stages, key=lambda s: s.index):
            local.append({"index": s.index, "layers": [s.spec.layer_start, s.spec.layer_end],
                          "listen": f"{s.config.listen_host or s.spec.host}:{s.port}"})
        snap["local_stages"] = local
        snap["listeners"] = self._listeners()
        snap["load"] = self._load()
        snap["topology"] = await self._topology_status() if self.topology is not None else None
        return snap

    def _listeners(self) -> list[dict]:
        """Every address this daemon listens on, and whether only this host can reach it (loopback)."""
        out = []

        def add(what: str, host: str | None, port: int | None) -> None:
            if host is None or port is None:
                return
            out.append({"what": what, "address": f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                        "loopback": _is_loopback(host)})

        if self.control is not None:
            add("control", self.control.host, self.control.port)
        if getattr(self.args, "openai", None) and self.head is not None:
            add("openai", *self.args.openai)
        hub = self.head.hub if self.head is not None else None
        if hub is not None and hub.address:
            add("token-return", *hub.address.rsplit(":", 1))
        for s in sorted(self.stages, key=lambda s: s.index):
            add(f"stage {s.index}", s.config.listen_host or s.spec.host, s.port)
        return out

    def _load(self) -> dict:
        engine = self.head.engine if self.head is not None else None
        pool = self.head.pool if self.head is not None else None
        schedulers = ([engine.scheduler] if engine else []) + [s.scheduler for s in self.stages if s.scheduler]
        return {
            "live_generations": len(engine.live) if engine else 0,
            "stage_sessions": {str(s.index): s.sessions.snapshot()["live_sessions"] for s in self.stages},
            "busy_lanes": pool.busy if pool else 0,
            "queued": sum(s.queued for s in schedulers),
            "totals": dict(engine.totals) if engine else {},
        }

    async def _topology_status(self) -> dict:
        topo = self.topology
        local = {s.index for s in self.stages} | ({0} if self.head is not None else set())
        stages: list[dict] = []

        async def one(spec) -> None:
            entry = {"index": spec.index, "address": f"{spec.host}:{spec.port}",
                     "layers": [spec.layer_start, spec.layer_end], "local": spec.index in local}
            if spec.index in local:
                entry.update(reachable=True, version=PROTOCOL_VERSION, node="this daemon")
            elif spec.index == 0:  # the head dials out; it has no listener to probe
                entry.update(reachable=None, version=None, node=None)
            else:
                entry.update(await self._probe(spec))
            stages.append(entry)

        async with trio.open_nursery() as nursery:
            for spec in topo.stages:
                nursery.start_soon(one, spec)
        return {"model": topo.model_name, "source_sha256": topo.source_sha256, "protocol_version": PROTOCOL_VERSION,
                "stages": sorted(stages, key=lambda s: s["index"])}

    async def _probe(self, spec) -> dict:
        """Reachability and protocol version of a remote stage: a live lane's handshake, or a probe (cached)."""
        pool = self.head.pool if self.head is not None else None
        watch = self.head.watch if self.head is not None else None
        # down by the last liveness check: check again now rather than report a stale state (the head's first
        # check may have run before the stage listened, and the watch re-checks only with backoff)
        if watch is not None and watch.down and spec.index == watch.down_stage and not await watch.check():
            return {"reachable": False, "version": None, "node": None, "state": "down", "error": watch.last_error}
        if pool is not None and spec.index == 1:  # a working lane already went through the handshake
            for lane in list(pool.lanes.values()):
                if lane.state == "busy" or (lane.state == "idle" and lane.link.looks_alive()):
                    return {"reachable": True, "version": lane.link.peer.version, "node": lane.link.peer.node}
        now = trio.current_time()
        cached = self._probes.get(spec.index)
        if cached is not None and now - cached[0] < PROBE_TTL_S:
            return cached[1]
        result = await probe_stage(self.topology, spec, auth=self._link_auth)
        self._probes[spec.index] = (trio.current_time(), result)
        return result

    def snapshot(self) -> dict:
        from importlib.metadata import PackageNotFoundError, version

        try:
            ours = version("skippy")
        except PackageNotFoundError:
            ours = None
        return {
            "role": self.describe_role(),
            "version": ours,
            "protocol_version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "ready": self.ready,
            "draining": self.draining,
            "config": str(self.settings.path) if self.settings and self.settings.path else None,
            "head": self.head.snapshot() if self.head else None,
            "stages": [s.snapshot() for s in self.stages],
        }


async def probe_stage(topology, spec, *, timeout: float = 1.0, auth: bytes = b"") -> dict:
    """Connect to a stage and read its handshake Hello (protocol version, node name), then decline politely.

    The probe presents itself as the stage's upstream neighbour, so the stage
    answers with its own Hello; we then refuse ("status probe") and close:
    no session is opened and nothing is forwarded downstream.
    """
    from skippyd.wire.codec import HANDSHAKE_KINDS
    from skippyd.wire.errors import WireError
    from skippyd.wire.messages import DEFAULT_LIMITS, Hello, HelloReply
    from skippyd.wire.stream import ReceiveBuffer, read_frame, write_frame

    prev = topology.stage(spec.index - 1)
    hello = Hello(fingerprint=topology.source_sha256, stage_index=prev.index, layer_start=prev.layer_start,
                  layer_end=prev.layer_end, n_layer=topology.n_layer, n_embd=topology.n_embd,
                  node="skippyd status probe", auth=auth)
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(spec.host, spec.port)
    except (OSError, trio.TooSlowError) as exc:
        return {"reachable": False, "version": None, "node": None, "error": str(exc) or "connect timed out"}
    try:
        await write_frame(stream, hello, timeout=timeout)
        frame = await read_frame(ReceiveBuffer(stream, read_size=0), DEFAULT_LIMITS, timeout=timeout,
                                 accept=set(HANDSHAKE_KINDS))
        if isinstance(frame, Hello):
            await write_frame(stream, HelloReply(accepted=False, reason="status probe"), timeout=timeout)
            return {"reachable": True, "version": frame.version, "node": frame.node}
        return {"reachable": True, "version": None, "node": None, "error": f"refused the probe: {frame.reason}"}
    except (WireError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        return {"reachable": True, "version": None, "node": None, "error": f"handshake failed: {exc}"}
    finally:
        await trio.aclose_forcefully(stream)


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _notify(state: str) -> None:
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


def check_config(settings: Settings) -> None:
    """--check-config: the settings in force, as TOML, each with where it came from."""
    print(f"# {settings.path or 'no configuration file: built-in defaults'}")
    section = None
    for key, value in settings.effective().items():
        sec, name = key.split(".")
        if sec != section:
            print(f"{'' if section is None else chr(10)}[{sec}]")
            section = sec
        source = settings.source(key)
        if value is None:
            print(f"# {name} is not set")
        else:
            print(f"{name} = {cfgmod.toml_value(value)}" + (f"  # {source}" if source != "default" else ""))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = Settings.load(args, parser)
    except ConfigError as exc:
        print(f"skippyd: bad configuration:\n{exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.check_config:
        check_config(settings)
        return EXIT_OK
    setup_logging(settings.args.log_level)
    if settings.path is not None:
        log.info("configuration: %s", settings.path)
    try:
        trio.run(Daemon(settings.args, settings=settings).run)
    except KeyboardInterrupt:
        pass
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return EXIT_USAGE
        raise
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
