"""What ``skippyctl status`` shows of a daemon: role, model, local stages, listeners, load, and the topology
with each stage's reachability and protocol version (a live lane's handshake, or a probe)."""

from __future__ import annotations

import os
import time
from typing import Protocol

import trio

from skippyd.config import Settings, parse_hostport
from skippyd.head.lanes import LaneState
from skippyd.listening import is_loopback
from skippyd.ports import NodeView
from skippyd.wire.messages import PROTOCOL_VERSION

PROBE_TTL_S = 1.0  # a stage's reachability is probed at most this often


class Listener(Protocol):
    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


class StatusSource(NodeView, Protocol):
    """What the status report reads of a node besides its view: its start, its listeners, where its settings
    came from, the settings its stages run with."""

    @property
    def started(self) -> float: ...

    @property
    def ready(self) -> bool: ...

    @property
    def settings(self) -> Settings | None: ...

    @property
    def link_auth(self) -> bytes: ...

    @property
    def control(self) -> Listener | None: ...

    def warnings(self) -> list[str]: ...

    def describe_settings(self) -> dict | None: ...


class StatusReport:
    """The status of one node."""

    def __init__(self, node: StatusSource):
        self.node = node
        self._probes: dict[int, tuple[float, dict]] = {}

    async def status(self) -> dict:
        """Role, model, local stages, the topology with each stage's reachability and version, uptime, load."""
        d = self.node
        snap = self.snapshot()
        model = self._model()
        snap["model"] = None if model is None else {
            "name": d.head.model_name if d.head is not None else d.topology.model_name,
            "gguf_name": model.name, "path": str(model.path), "architecture": model.architecture,
            "n_layer_total": model.stage.n_layer_total}
        local = []
        if d.head is not None and d.head.model is not None:
            st = d.head.model.stage
            hub = d.head.hub
            local.append({"index": 0, "layers": [st.layer_start, st.layer_end],
                          "listen": hub.address if hub is not None else None})
        for s in sorted(d.stages, key=lambda s: s.index):
            local.append({"index": s.index, "layers": [s.spec.layer_start, s.spec.layer_end],
                          "listen": f"{s.config.listen_host or s.spec.host}:{s.port}"})
        snap["local_stages"] = local
        snap["listeners"] = self.listeners()
        snap["warnings"] = self.warnings()
        snap["load"] = self.load()
        snap["topology"] = await self.topology() if d.topology is not None else None
        snap["settings"] = d.describe_settings()
        return snap

    def snapshot(self) -> dict:
        from importlib.metadata import PackageNotFoundError, version

        d = self.node
        try:
            ours = version("skippy")
        except PackageNotFoundError:
            ours = None
        return {
            "role": d.describe_role(),
            "version": ours,
            "protocol_version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - d.started, 1),
            "ready": d.ready,
            "draining": d.draining,
            "config": str(d.settings.path) if d.settings and d.settings.path else None,
            "head": d.head.snapshot() if d.head else None,
            "stages": [s.snapshot() for s in d.stages],
            "deployment": self.deployment(),
        }

    def deployment(self) -> dict | None:
        """What `skippyctl deploy` gave this daemon (None: it runs what its command line gave it)."""
        assignment = self.node.deployment
        if assignment is None or not assignment.accepts_stages:
            return None
        supervisor = assignment.supervisor
        return {"assigned": assignment.describe(), "last_failure": assignment.failure,
                "slices_dir": str(assignment.slices.dir),
                "supervised": supervisor.describe() if supervisor is not None else None}

    def _model(self):
        d = self.node
        if d.head is not None and d.head.model is not None:
            return d.head.model
        return next((s.model for s in d.stages if s.model is not None), None)

    def listeners(self) -> list[dict]:
        """Every address this daemon listens on, and whether only this host can reach it (loopback)."""
        d = self.node
        out = []

        def add(what: str, host: str | None, port: int | None) -> None:
            if host is None or port is None:
                return
            out.append({"what": what, "address": f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                        "loopback": is_loopback(host)})

        if d.control is not None:
            add("control", d.control.host, d.control.port)
        if d.config.openai.listen and d.head is not None:
            add("openai", *parse_hostport(d.config.openai.listen))
            out[-1]["api_key"] = d.config.openai.api_key_file is not None
        hub = d.head.hub if d.head is not None else None
        if hub is not None and hub.address:
            add("token-return", *hub.address.rsplit(":", 1))
        for s in sorted(d.stages, key=lambda s: s.index):
            add(f"stage {s.index}", s.config.listen_host or s.spec.host, s.port)
        return out

    def warnings(self) -> list[str]:
        """What the operator should know: an OpenAI listener other hosts reach with no API key."""
        return self.node.warnings()

    def load(self) -> dict:
        d = self.node
        engine = d.head.engine if d.head is not None else None
        pool = d.head.pool if d.head is not None else None
        schedulers = ([engine.scheduler] if engine else []) + [s.scheduler for s in d.stages if s.scheduler]
        return {
            "live_generations": len(engine.live) if engine else 0,
            "stage_sessions": {str(s.index): s.sessions.snapshot()["live_sessions"] for s in d.stages},
            "busy_lanes": pool.busy if pool else 0,
            "queued": sum(s.queued for s in schedulers),
            "totals": dict(engine.totals) if engine else {},
        }

    async def topology(self) -> dict:
        d = self.node
        topo = d.topology
        local = {s.index for s in d.stages} | ({0} if d.head is not None else set())
        stages: list[dict] = []

        async def one(spec) -> None:
            entry = {"index": spec.index, "address": f"{spec.host}:{spec.port}",
                     "layers": [spec.layer_start, spec.layer_end], "local": spec.index in local}
            if spec.index in local:
                entry.update(reachable=True, version=PROTOCOL_VERSION, node="this daemon")
                entry["link"] = self._link(spec.index)  # its link to the next stage: encoding, measured rate
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

    def _link(self, index: int) -> dict | None:
        """How a local stage's link to the next one carries activations (runtime.activation_wire; see
        skippyd/stage/link_choice.py); None: the final stage, or no lane is open."""
        d = self.node
        if index == 0 and d.head is not None:
            return d.head.pool.describe_link() if d.head.pool is not None else None
        stage = next((s for s in d.stages if s.index == index), None)
        return stage.describe_link() if stage is not None else None

    async def _probe(self, spec) -> dict:
        """Reachability and protocol version of a remote stage: a live lane's handshake, or a probe (cached)."""
        d = self.node
        pool = d.head.pool if d.head is not None else None
        watch = d.head.watch if d.head is not None else None
        # down by the last liveness check: check again now rather than report a stale state (the head's first
        # check may have run before the stage listened, and the watch re-checks only with backoff)
        if watch is not None and watch.down and spec.index == watch.down_stage and not await watch.check():
            return {"reachable": False, "version": None, "node": None, "state": "down", "error": watch.last_error}
        if pool is not None and spec.index == 1:  # a working lane already went through the handshake
            for lane in list(pool.lanes.values()):
                if lane.state == LaneState.BUSY or (lane.state == LaneState.IDLE and lane.link.looks_alive()):
                    return {"reachable": True, "version": lane.link.peer.version, "node": lane.link.peer.node}
        now = trio.current_time()
        cached = self._probes.get(spec.index)
        if cached is not None and now - cached[0] < PROBE_TTL_S:
            return cached[1]
        result = await probe_stage(d.topology, spec, auth=d.link_auth)
        self._probes[spec.index] = (trio.current_time(), result)
        return result


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
