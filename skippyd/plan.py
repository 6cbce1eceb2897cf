"""From settings to what this daemon runs: which stages, how each computes, the head's options.

:func:`plan_daemon` reads the topology (or takes a whole model), picks the
stages to run, resolves the automatic settings (threads from the cores this
process may use, the compute lock, decode groups from the topology's machines)
into one :class:`~skippyd.stage.server.StageConfig`, and loads the link
secret. Whatever it refuses is a usage error (:class:`SettingsRefused`, exit 2),
raised before anything is loaded.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs

from skippyd.config import Config, parse_hostport
from skippyd.hosts import THIS_MACHINE, Machines
from skippyd.openai.auth import ApiKey, KeyFileError
from skippyd.stage.prefix_disk import default_dir as default_prefix_dir
from skippyd.stage.server import StageConfig
from skippyd.stage.threads import usable_cores
from skippyd.topology import Topology, TopologyError

log = logging.getLogger("skippyd")


class SettingsRefused(Exception):
    """The settings cannot be run; one line for the operator (exit status 2)."""


@attrs.frozen
class HeadOptions:
    """What the head (stage 0) takes besides its StageConfig."""

    prefill_chunk: int
    receipts_file: Path | None
    queue_timeout: float
    resume_window: float | None  # None: a generation a stage failure interrupts fails (no replay)
    speculate_max_draft: int = 0  # drafts per verify window at most; 0: no speculative decoding
    speculate_in_flight: int = 4  # verify windows in flight at most (1: each answered before the next)
    chat_template: str | None = None  # the operator's chat template (Jinja source); None: the model's own
    mmproj: Path | None = None  # the operator's projector; None: the topology's stage 0 mmproj, if any
    image_max_bytes: int = 20 << 20
    image_max_pixels: int = 1 << 25

    def kwargs(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False)


@attrs.frozen
class Plan:
    topology: Topology | None  # None: `model`, a whole model as one stage
    model: Path | None  # neither: the daemon waits to be assigned a stage (skippyctl deploy)
    indices: tuple[int, ...]  # the topology's stages this daemon runs (0 is the head)
    stage: StageConfig  # how each of them computes and listens
    head: HeadOptions
    link_auth: bytes  # the link secret's Hello auth (b"": none); status probes present it too
    api_key: ApiKey | None = None  # what the OpenAI API and the console's views ask for (None: nothing)


def plan_daemon(config: Config, machines: Machines | None = None) -> Plan:
    """Raises SettingsRefused for settings that cannot run (no model, a stage outside the topology, a bad secret)."""
    machines = machines if machines is not None else Machines()
    pipeline = config.pipeline
    if pipeline.topology is not None and pipeline.model is not None:
        raise SettingsRefused("give either --topology FILE (with --stage) or --model FILE "
                              "(or [pipeline] topology / model in the config file), not both")
    if pipeline.topology is None and pipeline.model is None and not config.control.enabled:
        raise SettingsRefused("nothing to run: give --topology FILE (with --stage) or --model FILE, or keep the "
                              "control channel on to wait for `skippyctl deploy` to assign a stage")
    topology = None
    indices: tuple[int, ...] = ()
    if pipeline.topology is not None:
        try:
            topology = Topology.load(pipeline.topology)
        except (TopologyError, OSError) as exc:
            raise SettingsRefused(str(exc)) from None
        indices = stage_indices(topology, pipeline.stage)
    link_auth = _link_auth(config)
    api_key = _api_key(config)
    n_local = 1 if topology is None else stages_on_this_host(topology, indices[0], machines)
    groups = decode_groups(config, topology, machines)
    return Plan(topology, pipeline.model, indices, stage_config(config, n_local, groups, link_auth),
                head_options(config), link_auth, api_key)


def stage_indices(topology: Topology, stage: int | str | None) -> tuple[int, ...]:
    n = len(topology.stages)
    if stage in (None, "all"):
        return tuple(range(n))
    if not 0 <= stage < n:
        raise SettingsRefused(f"--stage {stage} is outside the topology's {n} stages (0..{n - 1})")
    return (stage,)


def stages_on_this_host(topology: Topology, first: int, machines: Machines) -> int:
    """Stages of the topology on this machine: by address (loopback, this machine's own addresses, and
    names that resolve to them), or bound to the same host as this daemon's stage `first`."""
    here = {THIS_MACHINE, machines.of(topology.stage(first).host)}
    return sum(1 for s in topology.stages if machines.of(s.host) in here)


def decode_groups(config: Config, topology: Topology | None, machines: Machines) -> int:
    """runtime.decode_groups, or (0) one group per machine of the topology: stages on one machine take turns
    at its cores, stages on machines of their own compute at the same time, each on another group's steps."""
    if config.runtime.decode_groups:
        return config.runtime.decode_groups
    if topology is None or config.pipeline.stage in (None, "all"):
        return 1  # a whole model, or every stage in this process
    return machines.count([s.host for s in topology.stages])


def stage_config(config: Config, n_local: int, decode_groups: int, link_auth: bytes = b"") -> StageConfig:
    """The StageConfig of every stage this daemon runs, `n_local` stages of the topology sharing this host."""
    rt = config.runtime
    cores = usable_cores()  # affinity and cgroup quota: what a container was given, not the host's
    if rt.threads and rt.threads > cores:
        then = (f"computing with {cores} and trying more now and then (kept only if faster)"
                if rt.adapt_threads == "on" else f"give --threads {cores} or fewer")
        log.warning("--threads %d is more than the %d cores this daemon may use: ggml's threads wait for each "
                    "other at every barrier, which slows a step down several times; %s", rt.threads, cores, then)
    if rt.keep_warm_ms and n_local > 1:
        log.warning("runtime.keep_warm_ms with %d stages of the topology on this host: each one's keep-warm "
                    "thread takes the cores from the others' computes now and then, which holds up their "
                    "threads at every barrier; it is for hosts that run one stage", n_local)
    # ggml's workers spin at every barrier, so stages computing on the same cores at once slow each other
    # down badly; taking turns (the compute lock), every stage can use every core. A lone thread never
    # spins: one-thread stages need no turns. With the lock off, the stages on this host split its cores.
    if rt.compute_lock == "off":
        threads = rt.threads or max(1, cores // max(1, n_local))
        lock = False
    else:
        threads = rt.threads or cores
        lock = rt.compute_lock == "on" or threads > 1
    stage = config.stage
    cfg = StageConfig(n_ctx_per_seq=rt.ctx, lanes=rt.lanes, n_batch=rt.batch, n_threads=threads,
                      thread_poll=rt.thread_poll if rt.thread_poll >= 0 else None, compute_lock=lock,
                      adapt_threads=rt.adapt_threads == "on", flash_attn=rt.flash_attn,
                      keep_warm_ms=rt.keep_warm_ms, decode_groups=decode_groups, credit_limit=rt.credit,
                      reply_timeout_s=rt.reply_timeout, peer_timeout_s=rt.peer_timeout,
                      direct_return=rt.direct_return, activation_wire=rt.activation_wire, gpu_layers=rt.gpu_layers,
                      link_delay_ms=stage.link_delay_ms, link_mbps=stage.link_mbps,
                      frame_timeout_s=stage.frame_timeout, link_auth=link_auth,
                      prefix_cache_mb=rt.prefix_cache_mb, prefix_cache_disk_mb=rt.prefix_cache_disk_mb,
                      prefix_cache_dir=rt.prefix_cache_dir or default_prefix_dir())
    if stage.listen:
        cfg.listen_host, cfg.listen_port = parse_hostport(stage.listen)
    if stage.upstream_allow is not None:
        cfg.upstream_allow = tuple(stage.upstream_allow)
    return cfg


def head_options(config: Config) -> HeadOptions:
    rt = config.runtime
    return HeadOptions(prefill_chunk=rt.prefill_chunk, receipts_file=config.daemon.receipts,
                       queue_timeout=rt.queue_timeout, resume_window=rt.resume_window if rt.resume else None,
                       speculate_max_draft=rt.speculate_max_draft if rt.speculate != "off" else 0,
                       speculate_in_flight=rt.speculate_in_flight,
                       chat_template=_chat_template(config.pipeline.chat_template_file),
                       mmproj=config.pipeline.mmproj, image_max_bytes=rt.image_max_mb << 20,
                       image_max_pixels=rt.image_max_pixels)


def _chat_template(path: Path | None) -> str | None:
    """The operator's chat template file, read and compiled now: a missing file or a template that does not
    compile stops the daemon with one line, not the first chat request."""
    if path is None:
        return None
    from skippyd.runtime.chat_template import TemplateRefused, check_template

    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsRefused(f"chat template {path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        check_template(source)
    except TemplateRefused as exc:
        raise SettingsRefused(f"chat template {path}: {exc}") from None
    return source


def _api_key(config: Config) -> ApiKey | None:
    if config.openai.api_key_file is None:
        return None
    try:
        return ApiKey.load(config.openai.api_key_file)
    except KeyFileError as exc:
        raise SettingsRefused(str(exc)) from None


def _link_auth(config: Config) -> bytes:
    """The link secret's Hello auth (b"": no secret)."""
    if config.stage.link_secret_file is None:
        return b""
    from skippyd.stage.access import LinkSecretError, load_link_secret

    try:
        return load_link_secret(config.stage.link_secret_file)
    except LinkSecretError as exc:
        raise SettingsRefused(str(exc)) from None
