"""A stage: its model slice, its scheduler, its listener, its sessions.

``StageServer.run`` is the stage's lifetime. It reports ready through
``task_status.started()`` only once the model is loaded and the listener
accepts connections; cancelling it closes every connection, whose cleanup
releases every session, then frees the context and the model.

The final stage of a pipeline of three or more stages also owns the
token-return connection to the head (:mod:`skippyd.stage.token_return`),
dialed when the first session asks for direct return.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import attrs
import trio

from skippyd.listening import explain_bind_errors
from skippyd.runtime.llama import Context, ContextParams, Model
from skippyd.stage.access import UpstreamAllow
from skippyd.stage.conditioning import LinkShape
from skippyd.stage.connection import UpstreamConnection
from skippyd.stage.host_lock import HostComputeLock
from skippyd.stage.scheduler import Scheduler
from skippyd.stage.sessions import SessionTable, StageSession
from skippyd.stage.token_return import TokenReturnLink
from skippyd.topology import StageSpec, Topology
from skippyd.wire.messages import Hello
from skippyd.wire.stream import DEFAULT_FRAME_TIMEOUT, DEFAULT_MIN_RATE, keep_alive

log = logging.getLogger("skippyd.stage")


@attrs.define
class StageConfig:
    """How one stage runs. Times are seconds."""

    n_ctx_per_seq: int = 4096
    lanes: int = 4  # sequence slots (n_seq_max): concurrent sessions on this stage
    n_batch: int = 512
    n_threads: int = 2
    credit_limit: int = 2  # outstanding prefill acks towards the next stage
    handshake_timeout_s: float = 5.0
    connect_timeout_s: float = 5.0
    idle_timeout_s: float = 600.0  # an idle lane with no message at all for this long is closed
    frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT  # a frame, once its first byte is here, must be complete
    frame_min_rate: float = DEFAULT_MIN_RATE  # ... within frame_timeout_s + its bytes / this (bytes/s)
    upstream_allow: tuple[str, ...] | None = None  # who may connect (see stage/access.py); None: the topology's
    link_auth: bytes = b""  # the Hello auth of the shared link secret (stage/access.py link_auth); b"": none
    max_handshakes: int = 64  # connections in their handshake at once; more are closed at once
    reply_timeout_s: float = 30.0  # the next stage must answer within this
    write_timeout_s: float = 10.0
    listen_host: str | None = None  # default: the topology's host for this stage
    listen_port: int | None = None
    direct_return: bool = True  # 3+ stages: predictions go from the final stage straight to the head
    link_delay_ms: float = 0.0  # link conditioning (tests, benchmarks): one-way delay on what we send
    link_mbps: float = 0.0  # ... and a bandwidth cap (0: none)
    # A persistent ggml thread pool whose workers poll this long (0-100) and then sleep between graphs;
    # None: llama.cpp's default, worker threads created per graph, which spin and starve a stage
    # sharing the cores (two 2-thread stages on 2 cores: a third of the speed; see BENCHMARKS.md).
    thread_poll: int | None = 0
    compute_lock: bool = False  # take turns at the cores with the other stages on this host (HostComputeLock)
    adapt_threads: bool = True  # fewer threads while that is much faster (skippyd/stage/threads.py)
    flash_attn: str = "off"  # llama.cpp's flash attention: off | on | auto (see ContextParams)
    keep_warm_ms: float = 0.0  # idle-class spinning after each compute (ContextParams.keep_warm_ms); 0: off
    # the stages compute at the same time (hosts of their own): keep this many groups of sessions in flight
    # (Scheduler.decode_groups; the daemon resolves 0, auto, from the topology's hosts)
    decode_groups: int = 1

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
    def __init__(self, topology: Topology, index: int, config: StageConfig = StageConfig(), *,
                 model_path: Path | None = None):
        self.topology = topology
        self.index = index
        self.spec: StageSpec = topology.stage(index)
        self.config = config
        self.model_path = model_path or self.spec.file
        self.is_final = index == len(topology.stages) - 1
        self.next_is_final = index == len(topology.stages) - 2
        self.next_stage: StageSpec | None = None if self.is_final else topology.stage(index + 1)
        self.model: Model | None = None
        self.context: Context | None = None
        self.scheduler: Scheduler | None = None
        self.sessions = SessionTable(config.lanes)
        self.connections: dict[int, UpstreamConnection] = {}
        self.port: int | None = None
        self.draining = False  # see begin_drain
        self.hello = Hello(
            fingerprint=topology.source_sha256,
            stage_index=index,
            layer_start=self.spec.layer_start,
            layer_end=self.spec.layer_end,
            n_layer=topology.n_layer,
            n_embd=topology.n_embd,
            node=f"stage-{index}",
            auth=config.link_auth,
        )
        self.upstream_allow = UpstreamAllow.for_stage(topology, index, config.upstream_allow) if index else None
        self.refused_upstreams = 0  # upstream connections this stage refused at the handshake (any reason)
        self.handshaking = 0  # connections in their handshake now
        self.dropped_handshakes = 0  # connections closed unheard because max_handshakes were in progress
        # decode steps with DIRECT_RETURN: sent to the final stage (no ack owed), answered by the final stage
        # on the token-return connection only, and taken by a middle stage without a reply on its lane
        self.returns_only = {"forwarded": 0, "answered": 0, "unacked": 0}
        self._drop_logged = (-math.inf, 0)  # when the last "dropped" line was logged, and the count then
        self.token_return: TokenReturnLink | None = None
        if self.is_final and len(topology.stages) >= 3 and config.direct_return:
            head = topology.stage(0)
            self.token_return = TokenReturnLink(self.hello, head.host, head.port,
                                                connect_timeout=config.connect_timeout_s,
                                                write_timeout=config.write_timeout_s, shape=config.link_shape)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        self.model = await trio.to_thread.run_sync(Model, self.model_path)
        try:
            stage = self.model.stage
            if (stage.layer_start, stage.layer_end) != (self.spec.layer_start, self.spec.layer_end):
                raise ValueError(f"{self.model_path} holds layers [{stage.layer_start},{stage.layer_end}), "
                                 f"the topology says [{self.spec.layer_start},{self.spec.layer_end})")
            self.context = await trio.to_thread.run_sync(Context, self.model, cfg.context_params())
            self.scheduler = cfg.scheduler(self.context)
            async with trio.open_nursery() as nursery:
                await nursery.start(self.scheduler.serve)
                if self.token_return is not None:
                    await nursery.start(self.token_return.run)
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
                if cfg.link_shape.active:
                    log.info("stage %d: link conditioning on what this stage sends: %s", self.index,
                             cfg.link_shape.describe())
                task_status.started(self)
        finally:
            if self.context is not None:
                self.context.close()
            self.model.close()

    def begin_drain(self) -> None:
        """Refuse new sessions (SHUTTING_DOWN); running ones go on until they end or the stage is cancelled."""
        if not self.draining:
            log.info("stage %d: draining: no new sessions (%d running)", self.index, len(self.sessions.live))
        self.draining = True

    def note_dropped_handshake(self) -> None:
        """Count a connection closed because max_handshakes were in progress; log at most every 10 s."""
        self.dropped_handshakes += 1
        now = trio.current_time()
        if now - self._drop_logged[0] >= 10.0:
            log.warning("stage %d: %d handshakes in progress: closed %d new connections unheard", self.index,
                        self.handshaking, self.dropped_handshakes - self._drop_logged[1])
            self._drop_logged = (now, self.dropped_handshakes)

    async def _handle(self, stream: trio.SocketStream) -> None:
        keep_alive(stream)
        await UpstreamConnection(self, stream).serve()

    async def release(self, session: StageSession) -> None:
        """Clear the session's KV sequence, then free its slot and sampler. Idempotent."""
        if self.sessions.get(session.conn_id, session.session_id) is not session:
            return
        seq = session.seq
        self.scheduler.forget(seq)
        # shielded: a slot must never be freed with its KV sequence still full
        with trio.CancelScope(shield=True):
            try:
                await self.scheduler.run_kv(lambda: self.context.kv_clear_seq(seq))
            finally:
                self.sessions.forget(session)

    def snapshot(self) -> dict:
        """Live sessions and slots (for the control plane and the tests)."""
        snap = self.sessions.snapshot()
        snap.update(
            stage_index=self.index,
            layers=[self.spec.layer_start, self.spec.layer_end],
            connections=len(self.connections),
            draining=self.draining,
            scheduler=attrs.asdict(self.scheduler.stats) if self.scheduler else {},
            hot_path=self.scheduler.hot_path.describe() if self.scheduler else None,
            threads=self.scheduler.threads.describe() if self.scheduler else None,
            compute=self.config.describe_compute(self.context),
            queued=self.scheduler.queued if self.scheduler else 0,
            token_return=self.token_return.describe() if self.token_return else None,
            upstream_allow=self.upstream_allow.describe() if self.upstream_allow else None,
            refused_upstreams=self.refused_upstreams,
            dropped_handshakes=self.dropped_handshakes,
            returns_only=dict(self.returns_only),
            link_secret=bool(self.config.link_auth),
        )
        return snap
