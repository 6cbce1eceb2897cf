"""A stage: its model slice, its scheduler, its listener, its sessions.

``StageServer.run`` is the stage's lifetime. It reports ready through
``task_status.started()`` only once the model is loaded and the listener
accepts connections; cancelling it closes every connection, whose cleanup
releases every session, then frees the context and the model.

The stage's place and resources (model, context, scheduler, sessions, the
final stage's token-return connection to the head, dialed when the first
session asks for direct return) are a :class:`~skippyd.stage.core.StageCore`;
the server owns admission and the set of connections
(:class:`~skippyd.stage.connection.UpstreamConnection`, whose handlers are in
skippyd/stage/handlers.py and roles.py).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import attrs
import trio

from skippyd.config import DEFAULTS
from skippyd.listening import explain_bind_errors
from skippyd.runtime.llama import Context, ContextParams, Model
from skippyd.runtime.llama.devices import offload_layers
from skippyd.stage.access import UpstreamAllow
from skippyd.stage.conditioning import LinkShape
from skippyd.stage.connection import UpstreamConnection
from skippyd.stage.core import StageCore
from skippyd.stage.downstream import DownstreamError, DownstreamLink
from skippyd.stage.host_lock import HostComputeLock
from skippyd.stage.link_choice import describe_links, describe_upstream, time_prompt_rows
from skippyd.stage.loop_lag import LoopLag
from skippyd.stage.prefix_cache import PrefixCache
from skippyd.stage.prefix_disk import model_digest, open_disk_tier
from skippyd.stage.scheduler import Scheduler
from skippyd.stage.sessions import SessionTable
from skippyd.stage.token_return import TokenReturnLink
from skippyd.topology import StageSpec, Topology
from skippyd.wire.errors import HandshakeRefused, PeerClosed, ReadTimeout, WireError
from skippyd.wire.handshake import handshake_server, refuse_handshake
from skippyd.wire.messages import Hello, LinkProbe, link_timed, wire_formats
from skippyd.wire.stream import DEFAULT_MIN_RATE, ReceiveBuffer, keep_alive

log = logging.getLogger("skippyd.stage")


_RUNTIME, _STAGE = DEFAULTS.runtime, DEFAULTS.stage  # skippyd.toml's defaults, the one place they are set


@attrs.define
class StageConfig:
    """How one stage runs (skippyd.plan makes it from skippyd.toml; its defaults are the file's). Times are
    seconds."""

    n_ctx_per_seq: int = _RUNTIME.ctx
    lanes: int = _RUNTIME.lanes  # sequence slots (n_seq_max): concurrent sessions on this stage
    n_batch: int = _RUNTIME.batch
    n_threads: int = 2  # skippyd.plan resolves runtime.threads (0: automatic) to a count
    credit_limit: int = _RUNTIME.credit  # outstanding prefill acks towards the next stage
    handshake_timeout_s: float = 5.0
    connect_timeout_s: float = 5.0
    idle_timeout_s: float = 600.0  # an idle lane with no message at all for this long is closed
    frame_timeout_s: float = _STAGE.frame_timeout  # a frame, once its first byte is here, must be complete
    frame_min_rate: float = DEFAULT_MIN_RATE  # ... within frame_timeout_s + its bytes / this (bytes/s)
    upstream_allow: tuple[str, ...] | None = None  # who may connect (see stage/access.py); None: the topology's
    link_auth: bytes = b""  # the Hello auth of the shared link secret (stage/access.py link_auth); b"": none
    max_handshakes: int = 64  # connections in their handshake at once; more are closed at once
    reply_timeout_s: float = _RUNTIME.reply_timeout  # the next stage must answer within this
    write_timeout_s: float = 10.0
    # a peer host silent this long (no answer to keepalive probes, replies unacknowledged) is given up
    peer_timeout_s: float = _RUNTIME.peer_timeout
    listen_host: str | None = None  # default: the topology's host for this stage
    listen_port: int | None = None
    direct_return: bool = _RUNTIME.direct_return  # 3+ stages: predictions go from the final stage to the head
    link_delay_ms: float = _STAGE.link_delay_ms  # link conditioning (tests, benchmarks): one-way delay
    link_mbps: float = _STAGE.link_mbps  # ... and a bandwidth cap (0: none)
    # A persistent ggml thread pool whose workers poll this long (0-100) and then sleep between graphs;
    # None: llama.cpp's worker threads created per graph, which spin and starve a stage sharing the cores.
    thread_poll: int | None = _RUNTIME.thread_poll
    compute_lock: bool = False  # take turns at the cores with the other stages on this host (HostComputeLock)
    adapt_threads: bool = _RUNTIME.adapt_threads == "on"  # fewer threads while that is much faster
    flash_attn: str = _RUNTIME.flash_attn  # llama.cpp's flash attention: off | on | auto (see ContextParams)
    keep_warm_ms: float = _RUNTIME.keep_warm_ms  # idle-class spinning after each compute; 0: off
    # the stages compute at the same time (hosts of their own): keep this many groups of sessions in flight
    # (Scheduler.decode_groups; the daemon resolves 0, auto, from the topology's hosts)
    decode_groups: int = 1
    prefix_cache_mb: int = _RUNTIME.prefix_cache_mb  # the prefix cache's budget (MiB); 0: no cache
    prefix_cache_dir: Path | None = None  # its disk tier's directory (each stage in DIR/stage-K); None: no tier
    prefix_cache_disk_mb: int = _RUNTIME.prefix_cache_disk_mb  # ... and that tier's budget (MiB)
    # how activations travel on this stage's links: auto (f32 unless a link, timed when it opens, is slow), f16, f32
    activation_wire: str = _RUNTIME.activation_wire
    gpu_layers: int | str = _RUNTIME.gpu_layers  # the last N of the stage's layers on the GPU, or "all"; 0: none

    def open_context(self, model: Model) -> Context:
        """The stage's context (blocking): refused first, naming the device, where its layers on the GPU and
        their KV cache would not fit the device's memory (GpuMemoryError)."""
        params = self.context_params()
        model.check_gpu_room(params.n_ctx_per_seq, params.n_seq_max, params.n_ubatch)
        return Context(model, params)

    def load_model(self, path: Path) -> Model:
        """The stage's GGUF with its gpu_layers on the GPU (blocking). Raises GpuLayersError where this build or
        host has no GPU for them, LlamaError where the load fails (a device out of memory among others)."""
        return Model(path, n_gpu_layers=offload_layers(self.gpu_layers))

    def open_disk_tier(self, stage_index: int, model: str, layers: tuple[int, int], context: Context):
        """The prefix cache's disk tier for a stage (blocking; None: no tier)."""
        return open_disk_tier(self.prefix_cache_dir, self.prefix_cache_disk_mb if self.prefix_cache_mb else 0,
                              stage_index=stage_index, model=model, layers=layers, context=context)

    def context_params(self) -> ContextParams:
        return ContextParams(n_ctx_per_seq=self.n_ctx_per_seq, n_seq_max=self.lanes, n_batch=self.n_batch,
                             n_ubatch=self.n_batch, n_threads=self.n_threads, threadpool_poll=self.thread_poll,
                             flash_attn=self.flash_attn, keep_warm_ms=self.keep_warm_ms)

    def describe_compute(self, context: Context | None = None) -> dict:
        return {"threads": self.n_threads, "thread_poll": self.thread_poll, "compute_lock": self.compute_lock,
                "adapt_threads": self.adapt_threads, "flash_attn": self.flash_attn,
                "decode_groups": self.decode_groups, "keep_warm_ms": self.keep_warm_ms,
                "keep_warm_spun_s": round(context.keep_warm_spun_s, 3) if context is not None else 0.0}

    def scheduler(self, context: Context) -> Scheduler:
        return Scheduler(context, host_lock=HostComputeLock() if self.compute_lock else None,
                         decode_groups=self.decode_groups, adapt_threads=self.adapt_threads)

    @property
    def link_shape(self) -> LinkShape:
        return LinkShape(self.link_delay_ms, self.link_mbps)


class StageServer:
    """The listener of one stage: loads its slice, admits upstream connections (the handshake cap, the
    allow-list, the handshake, whose admit hook opens a middle stage's link to the next stage) and keeps the
    set of connections; each connection gets the stage's core (:class:`~skippyd.stage.core.StageCore`),
    its stream and its peer."""

    def __init__(self, topology: Topology, index: int, config: StageConfig | None = None, *,
                 model_path: Path | None = None):
        config = config if config is not None else StageConfig()
        self.topology = topology
        self.index = index
        self.spec: StageSpec = topology.stage(index)
        self.config = config
        self.model_path = model_path or self.spec.file
        self.connections: dict[int, UpstreamConnection] = {}
        self.port: int | None = None
        self.hello = Hello(
            fingerprint=topology.source_sha256,
            stage_index=index,
            layer_start=self.spec.layer_start,
            layer_end=self.spec.layer_end,
            n_layer=topology.n_layer,
            n_embd=topology.n_embd,
            node=f"stage-{index}",
            auth=config.link_auth,
            wire_formats=wire_formats(config.activation_wire),
        )
        self.upstream_allow = UpstreamAllow.for_stage(topology, index, config.upstream_allow) if index else None
        self._drop_logged = (-math.inf, 0)  # when the last "dropped" line was logged, and the count then
        self.loop_lag = LoopLag(str(index))  # how late this stage's event loop runs
        # link conditioning (tests, benchmarks): put around every stage link this stage makes, where it makes it
        self._shape = config.link_shape
        n_stages = len(topology.stages)
        token_return = None
        if index == n_stages - 1 and n_stages >= 3 and config.direct_return:
            head = topology.stage(0)
            token_return = TokenReturnLink(self.hello, head.host, head.port, connect_timeout=config.connect_timeout_s,
                                           write_timeout=config.write_timeout_s, wrap=self._shape.wrap)
        min_rate = config.frame_min_rate
        if config.link_mbps > 0:  # conditioned links (given to every daemon) may be slower than the default rate
            min_rate = min(min_rate, config.link_mbps * 1e6 / 8 / 2)
        self.core = StageCore(index, n_stages, self.hello, config,
                              next_stage=None if index == n_stages - 1 else topology.stage(index + 1),
                              sessions=SessionTable(config.lanes), token_return=token_return,
                              wrap=self._shape.wrap, frame_min_rate=min_rate,
                              prefix_cache=PrefixCache(config.prefix_cache_mb << 20, stage_index=index))

    # the core's, for the daemon, the control plane and the tests
    is_final = property(lambda self: self.core.is_final)
    sessions = property(lambda self: self.core.sessions)
    model = property(lambda self: self.core.model)
    context = property(lambda self: self.core.context)
    scheduler = property(lambda self: self.core.scheduler)
    token_return = property(lambda self: self.core.token_return)
    draining = property(lambda self: self.core.draining)
    counters = property(lambda self: self.core.counters)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        cfg, core = self.config, self.core
        core.model = model = await trio.to_thread.run_sync(cfg.load_model, self.model_path)
        try:
            stage = model.stage
            if (stage.layer_start, stage.layer_end) != (self.spec.layer_start, self.spec.layer_end):
                raise ValueError(f"{self.model_path} holds layers [{stage.layer_start},{stage.layer_end}), "
                                 f"the topology says [{self.spec.layer_start},{self.spec.layer_end})")
            async with trio.open_nursery() as loading:
                if stage.is_last:  # what a constraint needs of the vocabulary, made before serving (Model.prepare)
                    loading.start_soon(trio.to_thread.run_sync, model.prepare)
                core.context = await trio.to_thread.run_sync(cfg.open_context, model)
            core.scheduler = cfg.scheduler(core.context)
            if not core.is_final and cfg.activation_wire == "auto":  # what its links' encoding is chosen against
                core.wire_policy = attrs.evolve(core.wire_policy, row_compute_s=await trio.to_thread.run_sync(
                    time_prompt_rows, core.context))
                log.info("stage %d: %.3f ms of compute per prompt row: links slower than %.1f Mbit/s carry f16 "
                         "(runtime.activation_wire = auto)", self.index, core.wire_policy.row_compute_s * 1e3,
                         (core.wire_policy.threshold_Bps or 0) * 8 / 1e6)
            spec = self.spec
            core.prefix_cache.disk = await trio.to_thread.run_sync(
                cfg.open_disk_tier, self.index, model_digest(spec.sha256, self.model_path),
                (spec.layer_start, spec.layer_end), core.context)
            async with trio.open_nursery() as nursery:
                await nursery.start(self.loop_lag.serve)
                await nursery.start(core.scheduler.serve)
                if core.token_return is not None:
                    await nursery.start(core.token_return.run)
                host = cfg.listen_host or self.spec.host
                port = self.spec.port if cfg.listen_port is None else cfg.listen_port
                # trio's SocketStream turns on TCP_NODELAY for every accepted connection
                with explain_bind_errors(f"stage {self.index}", host, port, "--listen HOST:PORT (or the topology)"):
                    listeners = await trio.open_tcp_listeners(port, host=host)
                self.port = listeners[0].socket.getsockname()[1]
                nursery.start_soon(trio.serve_listeners, self._handle, listeners)
                log.info("stage %d: layers [%d,%d) of %s listening on %s:%d", self.index, self.spec.layer_start,
                         self.spec.layer_end, self.topology.model_name, host, self.port)
                if self.upstream_allow is not None:
                    log.info("stage %d: upstream connections allowed from %s (%s)%s", self.index,
                             self.upstream_allow.describe(), self.upstream_allow.source,
                             "; link secret required" if cfg.link_auth else "")
                if self._shape.active:
                    log.info("stage %d: link conditioning on what this stage sends: %s", self.index,
                             self._shape.describe())
                task_status.started(self)
        finally:
            with trio.CancelScope(shield=True):  # what it holds goes to the disk tier (written already after a
                await core.prefix_cache.write_through(timeout=30)  # drain), off the event loop
            core.prefix_cache.close()
            if core.context is not None:
                core.context.close()
            model.close()

    def begin_drain(self) -> None:
        """Refuse new sessions (SHUTTING_DOWN); running ones go on until they end or the stage is cancelled."""
        if not self.core.draining:
            log.info("stage %d: draining: no new sessions (%d running)", self.index, len(self.sessions.live))
        self.core.draining = True

    # ------------------------------------------------------------------ connections
    async def _handle(self, stream: trio.SocketStream) -> None:
        """One accepted connection: admission, then the connection's life (its links' tasks run in the
        nursery opened here)."""
        keep_alive(stream)
        peer_ip, peer = _peer_address(stream)
        try:
            async with trio.open_nursery() as nursery:
                out = self._shape.wrap(stream, nursery)
                admitted = await self._admit(stream, peer_ip, peer, nursery, out)
                if admitted is not None:
                    receive, down, timed = admitted
                    conn = UpstreamConnection(self.core, stream, peer, receive=receive, down=down, out=out)
                    if timed is not None:  # its dialer timed the link: frames get the time its rate needs
                        conn.upstream_link = (timed.wire, timed.rate_kbps)
                        conn.frame_min_rate = frame_min_rate(self.core.frame_min_rate, timed.rate_kbps)
                    self.connections[conn.conn_id] = conn
                    try:
                        await conn.serve()
                    finally:
                        self.connections.pop(conn.conn_id, None)
                nursery.cancel_scope.cancel()
        finally:
            await trio.aclose_forcefully(stream)

    async def _admit(self, stream: trio.SocketStream, peer_ip: str, peer: str, nursery: trio.Nursery,
                     out: trio.abc.SendStream,
                     ) -> tuple[ReceiveBuffer, DownstreamLink | None, LinkProbe | None] | None:
        """Admission: the handshake cap, the allow-list, then the handshake (and a timed link's timing, its
        answers through ``out``). Returns the connection's reads (with what the handshake read ahead), a middle
        stage's link to the next stage and the dialer's timing RESULT (None: the link was not timed); None when
        the connection is refused or gone (logged)."""
        cfg, counters = self.config, self.core.counters
        if counters.handshaking >= cfg.max_handshakes:
            # a flood of connections that never finish their handshake must not use up this stage's
            # descriptors: beyond the cap they are closed at once (lanes are long-lived, so few handshake)
            self._note_dropped_handshake()
            return None
        receive = ReceiveBuffer(stream)
        opened: list[DownstreamLink] = []
        timed: list[LinkProbe] = []

        async def open_downstream(hello: Hello) -> str | None:
            """The handshake's admit hook: a middle stage opens its downstream connection before accepting
            an upstream, so a lane is accepted only when it leads all the way to the final stage; otherwise
            the upstream is refused with the reason (and a head backs off instead of holding lanes that
            lead nowhere)."""
            if self.core.is_final:
                return None
            try:  # timed if the upstream times its own link: a lane, not a connection for a query
                opened.append(await self.core.open_downstream(nursery, timed=link_timed(hello, self.hello)))
            except DownstreamError as exc:  # logged as the refusal
                return f"downstream unavailable: stage {self.index + 1} at {exc.address}: {exc.detail}"
            return None

        counters.handshaking += 1
        try:
            allow = self.upstream_allow
            if allow is not None and not await allow.allows(peer_ip):
                # not the handshake's full deadline: a refused peer only needs to finish its Hello
                await refuse_handshake(stream, f"upstream address not allowed: {peer_ip} may not "
                                       f"connect to stage {self.index}", receive=receive,
                                       timeout=min(cfg.handshake_timeout_s, 2.0))
            await handshake_server(stream, self.hello, timeout=cfg.handshake_timeout_s, receive=receive,
                                   admit=open_downstream, probe_out=out, timed=timed.append)
        except HandshakeRefused as exc:
            if exc.by_peer:  # e.g. a status probe, which declines once it has seen our Hello
                log.info("stage %d: upstream %s declined: %s", self.index, peer, exc.reason)
            else:
                counters.refused_upstreams += 1
                log.warning("stage %d: refused upstream %s: %s", self.index, peer, exc.reason)
        except ReadTimeout as exc:
            if exc.mid_frame:
                log.warning("stage %d: upstream %s: %s; closing", self.index, peer, exc)
            else:
                log.info("stage %d: upstream %s idle past the deadline; closing", self.index, peer)
        except (PeerClosed, WireError, trio.BrokenResourceError, trio.ClosedResourceError):
            log.info("stage %d: upstream %s closed", self.index, peer)
        except Exception:  # a bug must cost one connection, never the daemon
            log.exception("stage %d: connection from %s failed", self.index, peer)
        else:
            return receive, (opened[0] if opened else None), (timed[0] if timed else None)
        finally:
            counters.handshaking -= 1
        for down in opened:  # refused or gone after the next stage accepted us: that lane leads nowhere
            await down.aclose()
        return None

    def _note_dropped_handshake(self) -> None:
        """Count a connection closed because max_handshakes were in progress; log at most every 10 s."""
        counters = self.core.counters
        counters.dropped_handshakes += 1
        now = trio.current_time()
        if now - self._drop_logged[0] >= 10.0:
            log.warning("stage %d: %d handshakes in progress: closed %d new connections unheard", self.index,
                        counters.handshaking, counters.dropped_handshakes - self._drop_logged[1])
            self._drop_logged = (now, counters.dropped_handshakes)

    def snapshot(self) -> dict:
        """Live sessions and slots (for the control plane and the tests)."""
        core, counters = self.core, self.core.counters
        snap = core.sessions.snapshot()
        snap.update(
            stage_index=self.index,
            layers=[self.spec.layer_start, self.spec.layer_end],
            connections=len(self.connections),
            draining=core.draining,
            scheduler=attrs.asdict(core.scheduler.stats) if core.scheduler else {},
            hot_path=core.scheduler.hot_path.describe() if core.scheduler else None,
            threads=core.scheduler.threads.describe() if core.scheduler else None,
            compute=self.config.describe_compute(core.context),
            device=core.model.placement() if core.model is not None else None,
            queued=core.scheduler.queued if core.scheduler else 0,
            token_return=core.token_return.describe() if core.token_return else None,
            upstream_allow=self.upstream_allow.describe() if self.upstream_allow else None,
            refused_upstreams=counters.refused_upstreams,
            dropped_handshakes=counters.dropped_handshakes,
            returns_only=dict(counters.returns_only),
            windows_dropped=counters.windows_dropped,
            restores=dict(counters.restores),
            link_secret=bool(self.config.link_auth),
            prefix_cache=core.prefix_cache.stats().to_json(),
            link=self.describe_link(),
            # the live sessions' boundary rows (skippyd/stage/boundary.py), beside the KV and the prefix cache
            boundary_rows_bytes=sum(s.rows.nbytes for s in core.sessions.live),
            upstream_link=describe_upstream((c.upstream_link for c in list(self.connections.values())
                                             if c.upstream_link is not None), origin=self.index - 1),
            loop_lag=self.loop_lag.describe(),
        )
        return snap


    def describe_link(self) -> dict | None:
        """What this stage's connections to the next stage carry (see link_choice.describe_links); None: the
        final stage, or none is open."""
        if self.core.is_final:
            return None
        downs = [getattr(c.handlers, "down", None) for c in list(self.connections.values())]
        return describe_links((d.describe_choice() for d in downs if d is not None), to=self.index + 1)


def frame_min_rate(configured: float, rate_kbps: int) -> float:
    """The least rate (bytes/s) a frame must keep arriving at on a link measured at ``rate_kbps``: half of it
    where that is below ``configured`` (a frame of a slow link gets the time its size needs there), never
    more than ``configured`` (the deadline is never shorter than an untimed link's)."""
    return min(configured, max(1.0, rate_kbps * 1e3 / 8 / 2))


def _peer_address(stream: trio.SocketStream) -> tuple[str, str]:
    """(IP address, "HOST:PORT" for the log); "?" when unknown (never allowed by an allow-list)."""
    try:
        host, port = stream.socket.getpeername()[:2]
        return host, f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    except (OSError, AttributeError, ValueError):
        return "?", "?"
