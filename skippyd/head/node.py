"""The head node: stage 0's model and context, its multimodal projector, its scheduler, the lane pool and the
engine.

A projector (``--mmproj``, else the topology's stage 0 ``mmproj``) is loaded
against the model at start; one that does not fit it (another width, a file
that is no projector, a text model without the tokens that frame its images)
stops the head with one line. Only the head loads it: the other stages get
an image's rows as hidden states like any other.

With three or more stages (and direct return on) the head also listens on
stage 0's address in the topology for the final stage's token-return
connection (:mod:`skippyd.head.token_return`). If it cannot listen there it
says so and every prediction takes the relayed path.
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio

from skippyd import sampling
from skippyd.head import cache_admin
from skippyd.head.engine import HeadEngine
from skippyd.head.images import ImageLimits
from skippyd.head.lanes import LanePool
from skippyd.head.liveness import StageWatch
from skippyd.head.token_return import TokenReturnHub
from skippyd.runtime import mtmd
from skippyd.runtime.llama import Model
from skippyd.stage.access import UpstreamAllow
from skippyd.stage.link_choice import WirePolicy, time_prompt_rows, untimed
from skippyd.stage.loop_lag import LoopLag
from skippyd.stage.prefix_cache import PrefixCache
from skippyd.stage.prefix_disk import model_digest
from skippyd.stage.server import StageConfig
from skippyd.topology import Topology
from skippyd.wire.messages import CacheStats, Hello, wire_formats

log = logging.getLogger("skippyd.head")


class HeadNode:
    def __init__(self, config: StageConfig, *, topology: Topology | None = None, model_path: Path | None = None,
                 prefill_chunk: int = 256, receipts_file: Path | None = None, queue_timeout: float = 30.0,
                 resume_window: float | None = None, speculate_max_draft: int = 0, speculate_in_flight: int = 4,
                 chat_template: str | None = None, mmproj: Path | None = None, image_max_bytes: int = 20 << 20,
                 image_max_pixels: int = 1 << 25):
        if topology is None and model_path is None:
            raise ValueError("the head needs a topology or a model file")
        self.config = config
        self.topology = topology
        self.model_path = Path(model_path) if model_path else topology.stage(0).file
        self.prefill_chunk = prefill_chunk
        self.receipts_file = receipts_file
        self.queue_timeout = queue_timeout
        self.resume_window = resume_window  # None: a stage failure fails the generation
        self.speculate_max_draft = speculate_max_draft  # 0: no speculative decoding unless a request asks
        self.speculate_in_flight = speculate_in_flight  # verify windows in flight at most
        self.chat_template = chat_template  # the operator's chat template (None: the model's own)
        self.mmproj = mmproj if mmproj is not None or topology is None else topology.stage(0).mmproj
        self.image_limits = ImageLimits(image_max_bytes, image_max_pixels)
        self.projector: mtmd.Projector | None = None
        self.vision: dict | None = None  # what the projector takes (status, /v1/models); None: no images
        self.engine: HeadEngine | None = None
        self.pool: LanePool | None = None
        self.hub: TokenReturnHub | None = None
        self.watch: StageWatch | None = None
        self.model: Model | None = None
        # the lanes task's unexpected errors (bugs): logged, and shown in status (head.lanes_task)
        self.lanes_task_failures = 0
        self.lanes_task_error: str | None = None
        self.loop_lag = LoopLag("0")  # how late the head's event loop runs (its pings' deadlines count it)

    @property
    def model_name(self) -> str:
        """The name the operator gave the model: the topology's (the source GGUF's file name, as `model split`
        wrote it), else the model file's; not the GGUF's general.name, often a training run's label."""
        return self.topology.model_name if self.topology is not None else self.model_path.name.removesuffix(".gguf")

    @property
    def single_stage(self) -> bool:
        return self.topology is None or len(self.topology.stages) == 1

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        self.model = await trio.to_thread.run_sync(cfg.load_model, self.model_path)
        try:
            if not self.model.stage.is_first:
                raise ValueError(f"{self.model_path} does not start at layer 0: it cannot be the head")
            if self.single_stage and not self.model.stage.is_last:
                raise ValueError(f"{self.model_path} is a non-final slice: give the whole model or a topology")
            if self.mmproj is not None:
                self.projector, self.vision = await trio.to_thread.run_sync(self._load_projector)
            async with trio.open_nursery() as loading:
                loading.start_soon(trio.to_thread.run_sync, sampling.preload)  # requests' constraints are checked here
                if self.model.stage.is_last:  # what a constraint needs of the vocabulary, made before serving
                    loading.start_soon(trio.to_thread.run_sync, self.model.prepare)
                context = await trio.to_thread.run_sync(cfg.open_context, self.model)
            scheduler = cfg.scheduler(context)
            stage = self.model.stage
            sha256 = self.topology.stage(0).sha256 if self.topology is not None else None
            disk = await trio.to_thread.run_sync(cfg.open_disk_tier, 0, model_digest(sha256, self.model_path),
                                                 (stage.layer_start, stage.layer_end), context)
            if not self.single_stage:
                topo = self.topology
                s0, s1 = topo.stage(0), topo.stage(1)
                hello = Hello(fingerprint=topo.source_sha256, stage_index=0, layer_start=s0.layer_start,
                              layer_end=s0.layer_end, n_layer=topo.n_layer, n_embd=topo.n_embd, node="head",
                              auth=cfg.link_auth,  # the shared link secret, if any (stage/access.py)
                              wire_formats=wire_formats(cfg.activation_wire))
                policy = WirePolicy(cfg.activation_wire, topo.n_embd)
                if cfg.activation_wire == "auto":  # what the lanes' encoding is chosen against
                    policy = WirePolicy(cfg.activation_wire, topo.n_embd,
                                        await trio.to_thread.run_sync(time_prompt_rows, context))
                    log.info("head: %.3f ms of compute per prompt row: links slower than %.1f Mbit/s carry f16 "
                             "(runtime.activation_wire = auto)", policy.row_compute_s * 1e3,
                             (policy.threshold_Bps or 0) * 8 / 1e6)
                self.pool = LanePool(s1.host, s1.port, hello, capacity=cfg.lanes, credit_limit=cfg.credit_limit,
                                     connect_timeout=cfg.connect_timeout_s, reply_timeout=cfg.reply_timeout_s,
                                     wrap=cfg.link_shape.wrap, peer_timeout=cfg.peer_timeout_s, policy=policy)
                # (its pings carry no activations: its link is not timed)
                self.watch = StageWatch(s1.host, s1.port, untimed(hello), peer_timeout=cfg.peer_timeout_s)
                if len(topo.stages) >= 3 and cfg.direct_return:
                    self.hub = TokenReturnHub(hello, handshake_timeout=cfg.handshake_timeout_s,
                                              allow=UpstreamAllow.for_stage(topo, 0, cfg.upstream_allow),
                                              prediction_timeout=cfg.reply_timeout_s)
            self.engine = HeadEngine(self.model, context, scheduler, self.pool, prefill_chunk=self.prefill_chunk,
                                     receipts_file=self.receipts_file, queue_timeout=self.queue_timeout,
                                     hub=self.hub, watch=self.watch, resume_window=self.resume_window,
                                     prefix_cache=PrefixCache(cfg.prefix_cache_mb << 20, stage_index=0, disk=disk),
                                     speculate_max_draft=self.speculate_max_draft,
                                     speculate_in_flight=self.speculate_in_flight,
                                     chat_template=self.chat_template, projector=self.projector,
                                     image_limits=self.image_limits)
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.loop_lag.serve)
                    await nursery.start(scheduler.serve)
                    if self.hub is not None:
                        await self._listen_for_token_return(nursery)
                    if self.watch is not None:
                        await nursery.start(self.watch.serve)
                    if self.pool is not None:
                        self.pool.nursery = nursery
                        if cfg.link_shape.active:
                            log.info("head: link conditioning on what the head sends: %s",
                                     cfg.link_shape.describe())
                        await self.pool.warm()
                        nursery.start_soon(self._keep_lanes_warm)
                    log.info("head: %s ready (%s)", self.model_name,
                             "single stage" if self.single_stage else f"{len(self.topology.stages)} stages")
                    task_status.started(self)
            finally:
                with trio.CancelScope(shield=True):
                    if self.pool is not None:
                        await self.pool.aclose()
                    # what the cache holds goes to the disk tier (written already after a drain)
                    await self.engine.prefix_cache.write_through(timeout=30)
                self.engine.prefix_cache.close()
                context.close()
        finally:
            if self.projector is not None:
                self.projector.close()
            self.model.close()

    def _load_projector(self) -> tuple[mtmd.Projector, dict]:
        """The projector, checked against the model, and what it takes: an image of its own input size is
        tokenized once (which fails for a text model without the tokens that frame its images)."""
        projector = mtmd.Projector(self.model, self.mmproj, n_threads=self.config.n_threads)
        try:
            width = height = projector.image_size
            rows = projector.image_rows(width, height)
        except BaseException:
            projector.close()
            raise
        log.info("head: projector %s (%s): an image of %d x %d pixels takes %d tokens", self.mmproj.name,
                 projector.projector_type, width, height, rows)
        return projector, {"projector": self.mmproj.name, "projector_type": projector.projector_type,
                           "marker": projector.marker, "tokens_per_image": rows, "image_size": [width, height],
                           "mrope": projector.uses_mrope, "max_bytes": self.image_limits.max_bytes,
                           "max_pixels": self.image_limits.max_pixels}

    async def _listen_for_token_return(self, nursery: trio.Nursery) -> None:
        cfg = self.config
        s0 = self.topology.stage(0)
        host = cfg.listen_host or s0.host
        port = s0.port if cfg.listen_port is None else cfg.listen_port
        try:
            await nursery.start(self.hub.serve, host, port)
        except OSError as exc:
            log.warning("head: cannot listen for the token-return connection on %s:%d (%s): predictions take "
                        "the relayed path", host, port, exc.strerror or exc)

    async def _keep_lanes_warm(self) -> None:
        """Reopen lanes in the background, with backoff, while the next stage is away."""
        backoff = 0.5
        while True:
            await trio.sleep(backoff)
            pool = self.pool
            if pool.draining:
                backoff = 1.0
                continue
            try:
                await pool.prune()
                await pool.warm()
            except Exception as exc:  # best effort: a bug here must not take the head down
                log.exception("head: keeping the lanes warm failed; trying again")
                self.lanes_task_failures += 1
                self.lanes_task_error = f"{type(exc).__name__}: {exc}"
            backoff = 1.0 if pool.last_error is None else min(backoff * 2, 10.0)

    async def retarget(self, topology: Topology) -> None:
        """A re-planned pipeline (skippyd/deploy/supervisor.py): the lanes and the liveness watch go to its
        stage 1, and the head serves that topology from now on."""
        s1 = topology.stage(1)
        if self.pool is not None:
            await self.pool.retarget(s1.host, s1.port)
        if self.watch is not None:
            await self.watch.retarget(s1.host, s1.port)
        self.topology = topology

    def take_token_return_from(self, topology: Topology):
        """Take the token-return connection from the final stage of `topology` (3 stages or more, with a
        token-return listener); returns what puts the rule before back."""
        hub = self.hub
        if hub is None or len(topology.stages) < 3:
            return lambda: None
        before = hub.allow
        hub.allow = UpstreamAllow.for_stage(topology, 0, self.config.upstream_allow)

        def undo() -> None:
            hub.allow = before

        return undo

    async def cache_report(self, clear: bool = False, disk: bool = False) -> list[CacheStats]:
        """Every stage's prefix cache, stage 0 first (with ``clear``: each emptied first, with ``disk`` its disk
        tier too); see skippyd/head/cache_admin.py. Raises CacheReportError naming a stage that did not
        answer."""
        return await cache_admin.cache_report(self, clear=clear, disk=disk)

    def snapshot(self) -> dict:
        snap = self.engine.sessions.snapshot() if self.engine else {}
        snap.update(stage_index=0, scheduler=_stats(self.engine),
                    downstream=self.watch.describe() if self.watch is not None else None,
                    hot_path=self.engine.scheduler.hot_path.describe() if self.engine else None,
                    threads=self.engine.scheduler.threads.describe() if self.engine else None,
                    compute=self.config.describe_compute(self.engine.context if self.engine else None),
                    device=self.model.placement() if self.model is not None else None,
                    prefill=self.engine.chunker.describe() if self.engine and self.engine.pool else None,
                    token_return=self.engine.describe_token_return() if self.engine else None,
                    link=self.pool.describe_link() if self.pool is not None else None,
                    # the live sessions' boundary rows (skippyd/stage/boundary.py), beside the KV and prefix cache
                    boundary_rows_bytes=sum(s.rows.nbytes for s in self.engine.sessions.live) if self.engine else 0,
                    lanes_task=None if self.pool is None else {"failures": self.lanes_task_failures,
                                                               "last_error": self.lanes_task_error},
                    prefix_cache=self.engine.prefix_cache.stats().to_json() if self.engine else None,
                    speculation=self._speculation(), vision=self.vision, loop_lag=self.loop_lag.describe())
        return snap

    def _speculation(self) -> dict | None:
        """The daemon's totals, and the acceptance of every running generation that drafts."""
        if self.engine is None:
            return None
        sessions = {str(sid): live.speculation.describe()["acceptance"]
                    for sid, live in self.engine.live.items() if live.speculation is not None}
        return {**self.engine.speculation.describe(), "sessions": sessions}


def _stats(engine: HeadEngine | None) -> dict:
    import attrs

    return attrs.asdict(engine.scheduler.stats) if engine else {}
