"""`skippyctl plan`, `deploy` and `undeploy`: from one model file to a pipeline across hosts.

Every host runs ``skippyd`` with neither a topology nor a model (as the
systemd unit does on a fresh host): it waits, serving its control channel.
``deploy`` asks each host what it offers (cores, memory), times a slice of a
few of the model's layers there (the calibration), plans the split
(skippyd.deploy.planner), cuts the model into the planned slices here, sends
each host its slice over the control channel (authenticated by the same
token; checksummed; resumed where an interrupted transfer stopped; nothing
sent to a host that holds it already), and the head's host the model's
multimodal projector (``--mmproj``) the same way, starts the stages from the
last to the head, and waits until the head answers a generation. Nothing is
sent before the plan fits every host's memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import attrs
import trio
import typer
from rich.table import Table

from skippyctl.client import ControlError, open_control, read_token
from skippyctl.render import EXIT_USAGE, emit, fail, host_progress, human_bytes, listing
from skippyd.control import messages as m
from skippyd.deploy import transfer
from skippyd.deploy.planner import HostInfo, PlanError, make_plan, model_shape, place
from skippyd.deploy.transfer import Sent
from skippyd.runtime.gguf_info import ModelFileError
from skippyd.runtime.pypi import cache_root
from skippyd.runtime.slicing import RangeError, SliceError, parse_ranges
from skippyd.topology import TOPOLOGY_VERSION, Topology, TopologyError, format_address, parse_address

DEFAULT_CONTROL_PORT = 7390
DEFAULT_STAGE_PORT = 7400
READY_TIMEOUT_S = 120.0

ModelArg = Annotated[Path, typer.Argument(metavar="MODEL.gguf", help="The GGUF model to place.", show_default=False)]
HostsOption = Annotated[str, typer.Option(
    "--hosts", help="The hosts' control addresses, HOST[:PORT] (port 7390 by default), comma-separated, in "
    "pipeline order: the head goes on the first host the plan uses.")]
StagesOption = Annotated[int | None, typer.Option(
    "--stages", min=1, help="Exactly this many stages (default: the fewest the model fits in; one host when it "
    "fits on one, as a split would only add hops).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print plain JSON on stdout instead of a table.")]
RecalibrateOption = Annotated[bool, typer.Option(
    "--recalibrate", help="Time every host again (a host remembers its timing of a model until it restarts, so "
    "that the same deployment planned twice gives the same plan).")]
HopOption = Annotated[float, typer.Option("--hop-ms", min=0.0, help="What one hop between hosts adds to a "
                                          "token's time (ms), for choosing how many stages.")]


def _state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local/state")
    return Path(base) / "skippy" / "deployment"


def _cache_dir() -> Path:
    """Where the slices deploy cuts are kept: beside the fetched models (~/.cache/skippy, $SKIPPY_CACHE_DIR)."""
    return cache_root() / "deploy"


OutOption = Annotated[Path | None, typer.Option(
    "--out", help="Where deploy writes the topology it deployed and deployment.json (undeploy reads it) "
    "[default: ~/.local/state/skippy/deployment].", show_default=False)]


@attrs.frozen
class Target:
    """One host as the user named it: its control channel and the address its stage listens on."""

    name: str  # HOST:PORT
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"ws://{format_address(self.host, self.port)}"


def parse_hosts(text: str) -> list[Target]:
    targets = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        host, port = item, DEFAULT_CONTROL_PORT
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            if rest:
                port = _port(item, rest.removeprefix(":"))
        elif item.count(":") == 1:
            host, raw = item.split(":")
            port = _port(item, raw)
        if not host:
            fail(f"--hosts: {item!r} names no host", EXIT_USAGE)
        targets.append(Target(format_address(host, port), host, port))
    if not targets:
        fail("--hosts: give at least one host", EXIT_USAGE)
    if len({t.name for t in targets}) != len(targets):
        fail("--hosts: a host is named twice", EXIT_USAGE)
    return targets


def _port(item: str, raw: str) -> int:
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        fail(f"--hosts: bad port in {item!r}", EXIT_USAGE)
    return int(raw)


# ---------------------------------------------------------------- talking to the hosts
class HostError(ControlError):
    """A host's failure, named."""

    def __init__(self, target: Target, message: str, code: str = "failed"):
        super().__init__(f"{target.name}: {message}", code=code)


async def _call(target: Target, token_file: Path | None, make) -> Any:
    try:
        async with open_control(target.url, token_file) as client:
            return await client.call(make(client.new_id()))
    except HostError:
        raise
    except ControlError as exc:
        message = str(exc).replace("(is it running? see --url)", "(is skippyd running there, its control channel "
                                   "on that address?)")
        raise HostError(target, message, exc.code) from None


async def probe(targets: list[Target], token_file: Path | None) -> dict[str, dict]:
    """Every host's `host` report, asked at once."""
    reports: dict[str, dict] = {}

    async def one(target: Target) -> None:
        reports[target.name] = await _call(target, token_file, lambda i: m.Host(id=i))

    async with trio.open_nursery() as nursery:
        for target in targets:
            nursery.start_soon(one, target)
    for target in targets:
        if not reports[target.name]["accepts_stages"]:
            raise HostError(target, "its skippyd runs the stages its own command line gave it; start it with "
                                    "neither --topology nor --model to deploy to it", "bad_request")
    return reports


class Sender:
    """Sends slices to hosts over their control channels, `max_rate` bytes/s at most in all (0: no cap)."""

    def __init__(self, token_file: Path | None, max_rate: float = 0.0):
        self.token_file = token_file
        self.max_rate = max_rate
        self._next_at = 0.0  # rate limit: when the next chunk may go

    async def send(self, target: Target, path: Path, sha256: str, update=lambda done, total: None) -> Sent:
        try:
            async with open_control(target.url, self.token_file) as client:
                return await transfer.send_slice(client, path, sha256, update=update,
                                                 pace=self._pace if self.max_rate > 0 else None)
        except ControlError as exc:
            raise HostError(target, f"sending {path.name}: {exc}", exc.code) from None
        except transfer.DamagedThrice as exc:
            raise HostError(target, str(exc)) from None

    async def _pace(self, n: int) -> None:
        now = trio.current_time()
        self._next_at = max(self._next_at, now)
        await trio.sleep_until(self._next_at)
        self._next_at += n / self.max_rate


# ---------------------------------------------------------------- calibration and the plan
def _source_key(model: Path) -> str:
    st = model.stat()
    return f"{model.name.removesuffix('.gguf')}-{st.st_size}-{st.st_mtime_ns}"


def calibration_slice(model: Path, n_layer: int) -> tuple[Path, str]:
    """A middle slice of a few layers (cut once per model file, kept in the cache): what every host times."""
    start, end = transfer.calibration_range(n_layer)
    if end <= start:
        raise PlanError(f"{model.name} has {n_layer} layers: too few to time a middle slice of them")
    return transfer.calibration_slice(model, n_layer, _cache_dir() / _source_key(model))


async def calibrate(targets: list[Target], token_file: Path | None, model: Path, n_layer: int,
                    fresh: bool = False) -> dict[str, dict]:
    """Each host's ms per layer of this model, timed one host after the other (so that they do not share
    cores while timed, where hosts do)."""
    path, sha = await trio.to_thread.run_sync(calibration_slice, model, n_layer)
    sender = Sender(token_file)
    out = {}
    for target in targets:
        await sender.send(target, path, sha)
        out[target.name] = await _call(target, token_file, lambda i: m.Calibrate(id=i, sha256=sha, fresh=fresh))
    return out


def _host_infos(targets: list[Target], reports: dict[str, dict], timings: dict[str, dict] | None) -> list[HostInfo]:
    return [HostInfo(name=t.name, memory_bytes=reports[t.name]["memory_bytes"],
                     ms_per_layer=timings[t.name]["ms_per_layer"] if timings else 1.0,
                     prefix_cache_bytes=reports[t.name].get("prefix_cache_mb", 0) << 20) for t in targets]


async def plan_on(model: Path, targets: list[Target], token_file: Path | None, stages: int | None,
                  hop_ms: float, recalibrate: bool = False, ranges: list[tuple[int, int]] | None = None
                  ) -> tuple[Any, dict, dict]:
    """Probe, check that a plan fits the hosts' memory (before anything is sent), calibrate, plan (or, with
    `ranges`, place those on the hosts in the order given)."""
    shape = await trio.to_thread.run_sync(model_shape, model)
    reports = await probe(targets, token_file)
    ctx = max(r["ctx"] for r in reports.values())
    lanes = max(r["lanes"] for r in reports.values())

    def choose(timings):
        hosts = _host_infos(targets, reports, timings)
        if ranges is not None:
            return place(shape, hosts, ranges, ctx=ctx, lanes=lanes, hop_ms=hop_ms)
        return make_plan(shape, hosts, ctx=ctx, lanes=lanes, stages=stages, hop_ms=hop_ms)

    choose(None)
    timings = await calibrate(targets, token_file, model, shape.n_layer, recalibrate)
    return choose(timings), reports, timings


def _plan_data(plan, reports: dict[str, dict], timings: dict[str, dict]) -> dict:
    data = plan.as_dict()
    data["hosts"] = {name: {"cores": r["cores"], "memory_bytes": r["memory_bytes"],
                            "ms_per_layer": round(timings[name]["ms_per_layer"], 4),
                            "features": r["features"]} for name, r in reports.items()}
    return data


def _plan_table(data: dict) -> Table:
    table = listing(title=f"{data['model']}: {len(data['stages'])} stage(s), "
                          f"{data['ms_per_token']:.2f} ms per token expected")
    # the link to the next stage takes f16 at or below this rate (runtime.activation_wire = "auto", measured
    # when each link opens: skippyctl status shows what it chose)
    for column in ("stage", "host", "layers", "memory", "of which cache", "ms/token", "ms/layer there",
                   "link f16 at or below"):
        table.add_column(column, justify="left" if column in ("host", "layers") else "right")
    for s in data["stages"]:
        below = s.get("f16_below_mbps")
        table.add_row(str(s["index"]), s["host"], f"{s['layer_start']}:{s['layer_end']}",
                      human_bytes(s["memory_bytes"]), human_bytes(s.get("prefix_cache_bytes", 0)),
                      f"{s['ms_per_token']:.2f}",
                      f"{data['hosts'][s['host']]['ms_per_layer']:.3f}",
                      "-" if below is None else f"{below:.3g} Mbit/s")
    return table


_EXPECTED = (PlanError, ModelFileError, SliceError, RangeError, TopologyError, ControlError, OSError)


def _run(fn, *args):
    """Run the command; an expected failure (of any host's task) is one line on stderr, not a traceback."""
    try:
        return trio.run(fn, *args)
    except (*_EXPECTED, BaseExceptionGroup) as exc:
        leaf = _first_expected(exc)
        if leaf is None:
            raise
        if isinstance(leaf, OSError) and not isinstance(leaf, ControlError):
            fail(f"{leaf.filename or ''}{': ' if leaf.filename else ''}{leaf.strerror or leaf}")
        fail(str(leaf), EXIT_USAGE if getattr(leaf, "code", None) == "bad_request" else 1)


def _first_expected(exc: BaseException) -> BaseException | None:
    if isinstance(exc, BaseExceptionGroup):
        return next((leaf for e in exc.exceptions if (leaf := _first_expected(e)) is not None), None)
    return exc if isinstance(exc, _EXPECTED) else None


def plan(
    ctx: typer.Context,
    model: ModelArg,
    hosts: HostsOption,
    stages: StagesOption = None,
    hop_ms: HopOption = 1.0,
    recalibrate: RecalibrateOption = False,
    json_mode: JsonOption = False,
) -> None:
    """Plan where MODEL's layers go: each host's memory and measured speed, the slowest stage as fast as it can be.

    Asks every host what it offers, times a slice of a few layers on each, and prints each stage's host, layers,
    memory and expected ms per token. Sends nothing but the small calibration slice."""
    targets = parse_hosts(hosts)

    async def go():
        plan_, reports, timings = await plan_on(model, targets, ctx.obj.token_file, stages, hop_ms, recalibrate)
        return _plan_data(plan_, reports, timings)

    emit(_run(go), json_mode, _plan_table)


# ---------------------------------------------------------------- deploy
def _slices_for(model: Path, ranges: list[tuple[int, int]], addresses: list[str]) -> Topology:
    """The plan's stage files, cut here once per model file and ranges (kept in the cache), with the stages'
    addresses."""
    return transfer.cut_slices(model, ranges, _cache_dir() / _source_key(model), addresses)


def file_sha256(path: Path) -> str:
    """A file's sha256, remembered in the cache by its name, size and modification time (a projector is hashed
    once, not at every deploy)."""
    record = _cache_dir() / f"{_source_key(path)}.sha256"
    if record.exists():
        return record.read_text().strip()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(4 << 20):
            digest.update(block)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(digest.hexdigest() + "\n")
    return digest.hexdigest()


async def _wait_answering(head: Target, token_file: Path | None, timeout: float) -> float:
    """Until the head generates a token through the whole pipeline; the seconds it took."""
    started = time.monotonic()
    last = None
    with trio.move_on_after(timeout):
        while True:
            try:
                await _call(head, token_file, lambda i: m.Generate(id=i, prompt="Hello", raw=True, max_tokens=1))
                return time.monotonic() - started
            except HostError as exc:
                last = exc
                await trio.sleep(0.5)
    raise HostError(head, f"the pipeline did not answer within {timeout:g} s: {last}")


def deploy(
    ctx: typer.Context,
    model: Annotated[Path | None, typer.Argument(metavar="MODEL.gguf", help="The GGUF model to place.",
                                                 show_default=False)] = None,
    hosts: Annotated[str | None, typer.Option(
        "--hosts", help="The hosts' control addresses, HOST[:PORT] (port 7390 by default), comma-separated, in "
        "pipeline order: the head goes on the first host the plan uses.")] = None,
    stages: StagesOption = None,
    stage_port: Annotated[int, typer.Option("--stage-port", min=1, max=65535,
                                            help="Stage K listens on its host at this port + K.")]
    = DEFAULT_STAGE_PORT,
    max_rate: Annotated[float, typer.Option("--max-rate", min=0.0, help="Send slices at this many MB/s at most, "
                                            "all hosts together (0: as fast as the links go).")] = 0.0,
    hop_ms: HopOption = 1.0,
    recalibrate: RecalibrateOption = False,
    ranges: Annotated[str | None, typer.Option(
        "--ranges", help="These layer ranges (0:10,10:20,20:30) on the first hosts, in the order given, "
        "instead of a plan (their memory is still checked).")] = None,
    mmproj: Annotated[Path | None, typer.Option(
        "--mmproj", help="The model's multimodal projector (llama.cpp's mmproj GGUF): sent to the head's host "
        "as a slice is, for images in prompts.", metavar="FILE")] = None,
    supervise: Annotated[bool, typer.Option(
        "--supervise/--no-supervise", help="Leave a copy of the model on the head's host and have the head "
        "supervise the deployment: a host unreachable longer than its deploy.rejoin_grace_s is dropped and the "
        "pipeline re-planned over the hosts left; a host back (or added with --add) is taken in again.")] = True,
    add: Annotated[str | None, typer.Option(
        "--add", help="Offer one more host, HOST[:PORT] (a waiting skippyd), to the running deployment (its head "
        "from --out): the head times it and switches to a plan with it when that is faster. Takes no MODEL.",
        metavar="HOST")] = None,
    out: OutOption = None,
    json_mode: JsonOption = False,
) -> None:
    """Plan, slice, send each host its slice, start every stage, and wait until the pipeline answers.

    A host that holds its slice already is sent nothing; an interrupted transfer resumes where it stopped;
    a slice that arrives damaged is sent again. Writes the topology it deployed (and deployment.json, which
    `skippyctl undeploy` reads) to --out. Unless --no-supervise, the model file is also sent to the head's host
    (once: it keeps it), from which the head cuts the slices of a new plan when hosts go and come."""
    token_file = ctx.obj.token_file
    out_dir = out or _state_dir()
    if add is not None:
        return _add_host(add, token_file, out_dir, json_mode)
    if model is None or hosts is None:
        fail("deploy: give MODEL.gguf and --hosts (or --add HOST to a running deployment)", EXIT_USAGE)
    targets = parse_hosts(hosts)
    chosen = None
    if ranges is not None:
        if stages is not None:
            fail("give --stages or --ranges, not both", EXIT_USAGE)
        try:
            chosen = parse_ranges(ranges)
        except RangeError as exc:
            fail(f"--ranges: {exc}", EXIT_USAGE)
        if len(chosen) > len(targets):
            fail(f"--ranges: {len(chosen)} stages need {len(chosen)} hosts, {len(targets)} given", EXIT_USAGE)
    if mmproj is not None and not mmproj.is_file():
        fail(f"--mmproj: {mmproj}: no such file", EXIT_USAGE)

    async def go():
        started = time.monotonic()
        plan_, reports, timings = await plan_on(model, targets, token_file, stages, hop_ms, recalibrate, chosen)
        by_name = {t.name: t for t in targets}
        placed = [by_name[s.host] for s in plan_.stages]
        addresses = [format_address(t.host, stage_port + k) for k, t in enumerate(placed)]
        topology = await trio.to_thread.run_sync(_slices_for, model, plan_.ranges, addresses)
        if mmproj is not None:  # the head's: beside its slice, named by its sha256 as slices are
            head = attrs.evolve(topology.stage(0), mmproj=mmproj.resolve(),
                                mmproj_sha256=await trio.to_thread.run_sync(file_sha256, mmproj))
            topology = attrs.evolve(topology, stages=[head, *topology.stages[1:]])
        sender = Sender(token_file, max_rate * 1e6)
        sent: dict[str, Sent] = {}
        with host_progress([t.name for t in placed], "sending to") as update:
            async def send(k: int, target: Target) -> None:
                spec = topology.stage(k)
                size = spec.file.stat().st_size
                extra = spec.mmproj.stat().st_size if spec.mmproj is not None else 0
                sent[target.name] = await sender.send(target, spec.file, spec.sha256,
                                                      lambda done, total: update(target.name, done, total + extra))
                if spec.mmproj is not None:
                    projector = await sender.send(target, spec.mmproj, spec.mmproj_sha256,
                                                  lambda done, total: update(target.name, size + done, size + total))
                    sent[target.name] = attrs.evolve(sent[target.name], size=size + extra,
                                                     held=sent[target.name].held and projector.held,
                                                     sent=sent[target.name].sent + projector.sent,
                                                     resent=sent[target.name].resent + projector.resent)

            async with trio.open_nursery() as nursery:
                for k, target in enumerate(placed):
                    nursery.start_soon(send, k, target)
        text = transfer.wire_topology(topology)
        try:
            for k in reversed(range(len(placed))):  # downstream first: each stage finds the next one listening
                await _call(placed[k], token_file, lambda i, k=k: m.StageAssign(id=i, topology=text, stage=k))
            ready_s = await _wait_answering(placed[0], token_file, READY_TIMEOUT_S)
        except ControlError:
            await _release_quietly(placed, token_file)  # no half pipeline left running
            raise
        for target in targets:  # hosts the plan left out: released, should they run an older deployment
            if target not in placed:
                await _call(target, token_file, lambda i: m.StageRelease(id=i))
        supervised = None
        if supervise and len(placed) > 1:
            supervised = await _supervise(model, targets, placed, plan_, reports, timings, token_file,
                                          stage_port, hop_ms, sender)
        return _record(out_dir, model, topology, plan_, reports, timings, placed, sent, ready_s,
                       time.monotonic() - started, supervised)

    emit(_run(go), json_mode, _deploy_table)


async def _release_quietly(targets: list[Target], token_file: Path | None) -> None:
    """Release what a failed deploy started (in pipeline order); a host that does not answer is left as it is."""
    for target in targets:
        with trio.move_on_after(10):
            try:
                await _call(target, token_file, lambda i: m.StageRelease(id=i))
            except ControlError:
                pass


async def _supervise(model: Path, targets: list[Target], placed: list[Target], plan_, reports, timings,
                     token_file: Path | None, stage_port: int, hop_ms: float, sender: Sender) -> dict:
    """Leave the model on the head's host and hand the head the deployment to supervise (a new plan keeps as
    many stages as this one at most)."""
    head = placed[0]
    sha = await trio.to_thread.run_sync(file_sha256, model)
    copy = await sender.send(head, model, sha)
    hosts = [m.DeployHost(name=t.name, url=t.url, memory_bytes=reports[t.name]["memory_bytes"],
                          ms_per_layer=timings[t.name]["ms_per_layer"]) for t in targets]
    state = await _call(head, token_file, lambda i: m.Supervise(
        id=i, model_sha256=sha, model_name=model.name, hosts=hosts, plan=_plan_data(plan_, reports, timings),
        token=read_token(token_file), stage_port=stage_port, stages=len(plan_.stages), hop_ms=hop_ms,
        ctx=max(r["ctx"] for r in reports.values()), lanes=max(r["lanes"] for r in reports.values())))
    return {"model_copy": f"{head.name}: slice {sha}", "model_copy_sent": copy.sent,
            "rejoin_grace_s": state["rejoin_grace_s"], "generation": state["generation"]}


def _add_host(name: str, token_file: Path | None, out_dir: Path, json_mode: bool) -> None:
    record = out_dir / "deployment.json"
    try:
        head_url = json.loads(record.read_text())["head"]
    except (OSError, ValueError, KeyError) as exc:
        fail(f"--add: no deployment record at {record} ({exc}): deploy first", EXIT_USAGE)
    target = parse_hosts(name)
    if len(target) != 1:
        fail("--add: give one host", EXIT_USAGE)
    head = Target(head_url, *parse_address(head_url.removeprefix("ws://")))

    async def go():
        await probe(target, token_file)  # a waiting skippyd that takes this token
        return await _call(head, token_file, lambda i: m.AddHost(id=i, name=target[0].name, url=target[0].url))

    emit(_run(go), json_mode, lambda data: f"{data['name']}: {data['state']} (the head plans with it from now on)")


def _record(out_dir: Path, model: Path, topology: Topology, plan_, reports, timings, placed: list[Target],
            sent: dict[str, Sent], ready_s: float, took_s: float, supervised: dict | None = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    topology.dump(out_dir / "topology.toml")
    data = {
        "model": str(model.resolve()),
        "topology": str((out_dir / "topology.toml").resolve()),
        "head": placed[0].url,
        "hosts": [t.name for t in placed],
        "plan": _plan_data(plan_, reports, timings),
        "transfers": {name: attrs.asdict(s) for name, s in sent.items()},
        "bytes_sent": sum(s.sent for s in sent.values()),
        "ready_s": round(ready_s, 2),
        "took_s": round(took_s, 2),
        "topology_version": TOPOLOGY_VERSION,
        "supervised": supervised,
    }
    (out_dir / "deployment.json").write_text(json.dumps(data, indent=2) + "\n")
    return data


def _deploy_table(data: dict) -> Table:
    table = listing(title=f"deployed {Path(data['model']).name}: {len(data['hosts'])} stage(s), "
                          f"{human_bytes(data['bytes_sent'])} sent, answering after {data['took_s']:.1f} s",
                    caption=f"head: {data['head']}   topology: {data['topology']}")
    for column in ("stage", "host", "layers", "memory", "ms/token", "sent"):
        table.add_column(column, justify="left" if column in ("host", "layers", "sent") else "right")
    for s in data["plan"]["stages"]:
        t = data["transfers"][s["host"]]
        how = ("held already" if t["held"] else human_bytes(t["sent"])
               + (f" (resumed at {human_bytes(t['resumed_from'])})" if t["resumed_from"] else "")
               + (f" ({t['resent']}x again: arrived damaged)" if t["resent"] else ""))
        table.add_row(str(s["index"]), s["host"], f"{s['layer_start']}:{s['layer_end']}",
                      human_bytes(s["memory_bytes"]), f"{s['ms_per_token']:.2f}", how)
    return table


def undeploy(
    ctx: typer.Context,
    hosts: Annotated[str | None, typer.Option(
        "--hosts", help="The hosts to release (default: those of the last deploy, from --out).")] = None,
    out: OutOption = None,
    json_mode: JsonOption = False,
) -> None:
    """Release every stage a deploy started: sessions end through the normal cleanup; the hosts wait again
    (and keep the slices, so that the next deploy of the same plan sends nothing)."""
    record = (out or _state_dir()) / "deployment.json"
    if hosts is None:
        try:
            hosts = ",".join(json.loads(record.read_text())["hosts"])  # in pipeline order
        except (OSError, ValueError, KeyError) as exc:
            fail(f"no --hosts, and no deployment record at {record} ({exc})", EXIT_USAGE)
    targets = parse_hosts(hosts)

    async def go():
        released = {}
        # in pipeline order: the head first, whose generations end with a clear reason before the stages
        # after it go
        for target in targets:
            reply = await _call(target, ctx.obj.token_file, lambda i: m.StageRelease(id=i))
            released[target.name] = reply["released"]
        return {"released": released}

    def table(data: dict) -> Table:
        t = listing(title="released")
        t.add_column("host")
        t.add_column("stage")
        for name, was in data["released"].items():
            t.add_row(name, "-" if was is None else f"{was['stage']} (layers {was['layers'][0]}:{was['layers'][1]})")
        return t

    emit(_run(go), json_mode, table)
