"""Soak: many generations with random lengths, cancellations and client disconnects; nothing may leak.

    .venv/bin/python bench/soak.py [-n 1000] [--concurrency 6] [--stages 2] [--seed 1] [--json out.json]

A 2-stage pipeline of the default model (each stage its own skippyd process)
serves N generations with bounded concurrency, each on its own control
connection: random prompts (raw and chat) and random max_tokens; a share is
cancelled with `sessions kill` after a random number of pieces, and a share is
abandoned by the client (the websocket closed, cleanly or with a TCP reset)
after a random number of pieces. Every greedy generation that runs to its end
must give a prefix of the prompt's reference tokens (a KV sequence not cleared
on release would change them).

The warm-up fills every slot's context at once (the largest graphs the
pipeline will compute, whose buffers stay allocated) and runs a few random
generations; then the daemons' open file descriptors (/proc/PID/fd) and
resident memory (VmRSS) are recorded. At the end every stage must report zero
sessions and every slot free, the descriptors must be back to their count
after the warm-up (give or take the head's lanes, which the pool closes and
reopens: each is one descriptor on the head and on stage 1) and the memory
within 10 % of it. Prints a summary; exits 1 on any violation, unexpected
errors included. `tests/test_soak_short.py` runs a short soak through `soak()`.

Stage 1 has as many sequence slots as the head has lanes (the default): a
cancelled generation stops its session on every stage before its lane and slot
are free again, so the next one is never refused with `no_capacity`
(`--stage-lanes` gives stage 1 more slots all the same).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import attrs
import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from skippyctl.client import ControlError, open_control  # noqa: E402
from skippyd.control import messages as m  # noqa: E402
from tests.procs import Pipeline, split_for_test  # noqa: E402

CTX, LANES = 512, 4
FLAGS = ["--lanes", str(LANES), "--ctx", str(CTX)]
CONFIG = {"runtime.prefill_chunk": 64}
RSS_TOLERANCE = 0.10
SETTLE_S = 10.0  # how long the descriptor count gets to settle (lanes are reopened in the background)
RAW_PROMPTS = [
    "Count from 1 to 1000: 1, 2, 3, 4,",
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying oil for the lamp. "
     "Ships passing the rocky headland depended on the beam to find the channel between the reefs. ") * 3,
]
CHAT_PROMPTS = ["Name three colours.", "What is the capital of France?", "Write a haiku about the sea."]


@attrs.define
class Plan:
    """What one generation does: its prompt and length, and whether it is cancelled or abandoned (after
    `after` pieces)."""

    index: int
    prompt: str
    raw: bool
    max_tokens: int
    action: str  # complete | cancel | disconnect | reset
    after: int


@attrs.define
class SoakReport:
    generations: int = 0
    outcomes: Counter = attrs.field(factory=Counter)  # finish reasons, "disconnected", "error"
    kills_sent: int = 0
    kills_missed: int = 0  # the session had already finished
    errors: list[str] = attrs.field(factory=list)
    wrong_tokens: list[str] = attrs.field(factory=list)
    fds: dict[int, tuple[int, int]] = attrs.field(factory=dict)  # stage → (after warm-up, at the end)
    links: dict[int, tuple[int, int]] = attrs.field(factory=dict)  # of those, pipeline links (lanes come and go)
    rss_kib: dict[int, tuple[int, int]] = attrs.field(factory=dict)
    sessions_after: dict = attrs.field(factory=dict)
    violations: list[str] = attrs.field(factory=list)
    wall_s: float = 0.0

    def summary(self) -> str:
        lines = [f"generations {self.generations} in {self.wall_s:.1f} s "
                 f"({self.generations / max(self.wall_s, 1e-9):.1f}/s)",
                 "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())),
                 f"cancellations: {self.kills_sent} kills sent ({self.kills_missed} found the session finished), "
                 f"{self.outcomes['cancelled']} generations cancelled",
                 f"disconnects: {self.outcomes['disconnected']} (clean close and TCP reset)",
                 f"errors: {len(self.errors)}" + (f" (first: {self.errors[0]})" if self.errors else ""),
                 f"wrong tokens: {len(self.wrong_tokens)}"]
        for k in sorted(self.fds):
            (f0, f1), (l0, l1), (r0, r1) = self.fds[k], self.links[k], self.rss_kib[k]
            lines.append(f"stage {k}: fds {f0} -> {f1} (of which pipeline links {l0} -> {l1}), "
                         f"VmRSS {r0 / 1024:.1f} -> {r1 / 1024:.1f} MiB ({(r1 - r0) / r0:+.1%})")
        lines.append("sessions after: " + ", ".join(f"stage {k}: {s['live']} live, {s['free']}/{s['n_seq_max']} free"
                                                    for k, s in sorted(self.sessions_after.items())))
        lines.append("violations: " + ("; ".join(self.violations) if self.violations else "none"))
        return "\n".join(lines)

    def to_json(self) -> dict:
        d = attrs.asdict(self)
        d["outcomes"] = dict(self.outcomes)
        d["fds"] = {str(k): v for k, v in self.fds.items()}
        d["links"] = {str(k): v for k, v in self.links.items()}
        d["rss_kib"] = {str(k): v for k, v in self.rss_kib.items()}
        d["sessions_after"] = {str(k): v for k, v in self.sessions_after.items()}
        return d


# ---------------------------------------------------------------- /proc
def fd_count(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def daemons(pipe: Pipeline) -> dict[int, int]:
    """Stage index → pid (one entry per process)."""
    return {k: d.proc.pid for k, d in sorted(pipe.stages.items())}


# ---------------------------------------------------------------- one generation
def make_plans(n: int, rng: random.Random, *, max_tokens: int, cancel_rate: float, disconnect_rate: float,
               start: int = 0) -> list[Plan]:
    plans = []
    for i in range(start, start + n):
        raw = rng.random() < 0.7
        prompt = rng.choice(RAW_PROMPTS if raw else CHAT_PROMPTS)
        r = rng.random()
        if r < cancel_rate:
            action = "cancel"
        elif r < cancel_rate + disconnect_rate:
            action = rng.choice(["disconnect", "reset"])
        else:
            action = "complete"
        plans.append(Plan(i, prompt, raw, rng.randint(1, max_tokens), action, rng.randint(0, 6)))
    return plans


async def _reset(client) -> None:
    """Drop the control connection with a TCP reset (no websocket close)."""
    stream = client.ws._stream
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await trio.aclose_forcefully(stream)


async def _kill_one(pipe: Pipeline, report: SoakReport) -> None:
    """`sessions kill` of one running generation (any: the control channel does not tell a client its
    session id before the result)."""
    head = pipe.head
    async with open_control(head.url, head.token_file) as client:
        live = [g for g in await client.call(m.SessionsList(id=client.new_id())) if g["state"] != "queued"]
        if not live:
            report.kills_missed += 1
            return
        target = max(live, key=lambda g: g["age_s"])
        try:
            await client.call(m.SessionKill(id=client.new_id(), session_id=target["session_id"]))
            report.kills_sent += 1
        except ControlError as exc:
            if exc.code != "not_found":
                raise
            report.kills_missed += 1


async def run_one(pipe: Pipeline, plan: Plan, report: SoakReport, reference: dict) -> None:
    head = pipe.head
    req = m.Generate(id="g", prompt=plan.prompt, raw=plan.raw, max_tokens=plan.max_tokens)
    pieces = 0
    try:
        async with open_control(head.url, head.token_file) as client:
            if plan.action in ("disconnect", "reset") and plan.after == 0:
                await client.ws.send_message(m.dump(req))  # gone before the first piece
                if plan.action == "reset":
                    await _reset(client)
                report.outcomes["disconnected"] += 1
                return
            async for reply in client.replies(req):
                if isinstance(reply, m.Piece):
                    pieces += 1
                    if pieces == plan.after:
                        if plan.action == "cancel":
                            await _kill_one(pipe, report)
                        elif plan.action in ("disconnect", "reset"):
                            if plan.action == "reset":
                                await _reset(client)
                            report.outcomes["disconnected"] += 1
                            return
                elif isinstance(reply, m.Error):
                    report.outcomes["error"] += 1
                    report.errors.append(f"#{plan.index} {reply.code}: {reply.message}")
                else:
                    result = reply.result
                    report.outcomes[result["finish_reason"]] += 1
                    _check_tokens(plan, result, reference, report)
    except ControlError as exc:
        if plan.action == "reset":  # our own reset can surface as a closed connection
            report.outcomes["disconnected"] += 1
            return
        report.outcomes["error"] += 1
        report.errors.append(f"#{plan.index} client: {exc}")
    except Exception:  # trio-websocket on a connection we reset ourselves
        if plan.action == "reset":
            report.outcomes["disconnected"] += 1
            return
        raise
    finally:
        report.generations += 1


def _check_tokens(plan: Plan, result: dict, reference: dict, report: SoakReport) -> None:
    if result["finish_reason"] not in ("stop", "length"):
        return
    want = reference.get((plan.prompt, plan.raw))
    if want is None:
        return
    got = result["tokens"]
    expected = want["tokens"][:plan.max_tokens]
    if got != expected:
        report.wrong_tokens.append(f"#{plan.index} {plan.prompt[:30]!r} max_tokens {plan.max_tokens}: "
                                   f"{got[:8]}... != {expected[:8]}...")


async def run_plans(pipe: Pipeline, plans: list[Plan], concurrency: int, report: SoakReport,
                    reference: dict) -> None:
    todo = iter(plans)

    async def worker() -> None:
        for plan in todo:
            await run_one(pipe, plan, report, reference)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)


async def references(pipe: Pipeline, max_tokens: int) -> dict:
    """Each prompt's greedy tokens alone, up to the longest a soak generation asks for."""
    out = {}
    for raw, prompts in ((True, RAW_PROMPTS), (False, CHAT_PROMPTS)):
        for prompt in prompts:
            out[(prompt, raw)] = await pipe.generate(prompt=prompt, raw=raw, max_tokens=max_tokens)
    return out


# ---------------------------------------------------------------- the soak
async def links(pipe: Pipeline) -> dict[int, int]:
    """Per daemon, its sockets that are pipeline links: the head's lanes (their number floats with the pool),
    a stage's upstream connections (twice for a middle stage, which owns one downstream per upstream)."""
    out = {}
    n = len(pipe.topology.stages)
    for k, d in sorted(pipe.stages.items()):
        async with open_control(d.url, d.token_file) as client:
            if k == 0:
                out[k] = len((await client.call(m.LanesList(id=client.new_id())))["lanes"])
            else:
                st = await client.call(m.Status(id=client.new_id()))
                out[k] = st["stages"][0]["connections"] * (2 if k < n - 1 else 1)
    return out


async def quiet_fds(pipe: Pipeline, *, stable_s: float = 1.5) -> dict[int, int]:
    """Descriptor counts once they stopped changing for `stable_s` (control connections closed, lanes reopened)."""
    pids = daemons(pipe)
    last, stable_since = None, trio.current_time()
    while True:
        now = {k: fd_count(pid) for k, pid in pids.items()}
        if now != last:
            last, stable_since = now, trio.current_time()
        elif trio.current_time() - stable_since >= stable_s:
            return now
        await trio.sleep(0.1)


async def settled_fds(pipe: Pipeline, timeout: float = SETTLE_S) -> tuple[dict[int, int], dict[int, int]]:
    """(descriptors, pipeline links) per daemon, counted while the links did not change."""
    deadline = trio.current_time() + timeout
    while True:
        before = await links(pipe)
        fds = await quiet_fds(pipe)
        after = await links(pipe)
        if before == after or trio.current_time() > deadline:
            return fds, after


async def soak(pipe: Pipeline, n: int, *, ctx: int = CTX, lanes: int = LANES, concurrency: int = 6, seed: int = 1,
               max_tokens: int = 32,
               cancel_rate: float = 0.1, disconnect_rate: float = 0.1, warmup: int = 24,
               progress=None) -> SoakReport:
    """Run the soak on a started pipeline (whose head has `lanes` slots of `ctx` tokens); the report lists every
    violation."""
    rng = random.Random(seed)
    report = SoakReport()
    reference = await references(pipe, max_tokens)
    # first every slot prefilled to a full context at once, in step: the last chunks batch together over the
    # whole KV cache, the largest attention graph the pipeline will compute; the pages of the compute buffer it
    # touches stay resident (a high-water mark that would look like a leak)
    fill = [Plan(-1, "word" + " word" * (ctx - 2), True, 1, "complete", 0) for _ in range(lanes)]
    for _ in range(2):
        await run_plans(pipe, fill, lanes, SoakReport(), reference)
    warm = make_plans(warmup, rng, max_tokens=max_tokens, cancel_rate=0.2, disconnect_rate=0.2, start=-warmup)
    await run_plans(pipe, warm, concurrency, SoakReport(), reference)
    await pipe.wait_all_released(5.0)
    pids = daemons(pipe)
    fds0, links0 = await settled_fds(pipe)
    rss0 = {k: rss_kib(pid) for k, pid in pids.items()}

    plans = make_plans(n, rng, max_tokens=max_tokens, cancel_rate=cancel_rate, disconnect_rate=disconnect_rate)
    started = time.monotonic()
    if progress is None:
        await run_plans(pipe, plans, concurrency, report, reference)
    else:
        for lo in range(0, n, 100):
            await run_plans(pipe, plans[lo:lo + 100], concurrency, report, reference)
            progress(report, time.monotonic() - started, {k: fd_count(pid) for k, pid in pids.items()},
                     {k: rss_kib(pid) for k, pid in pids.items()})
    report.wall_s = time.monotonic() - started

    try:
        report.sessions_after = await pipe.wait_all_released(5.0)
    except AssertionError as exc:
        report.sessions_after = await pipe.stage_sessions()
        report.violations.append(str(exc))
    fds1, links1 = await settled_fds(pipe)
    rss1 = {k: rss_kib(pid) for k, pid in pids.items()}
    for k in pids:
        report.fds[k] = (fds0[k], fds1[k])
        report.links[k] = (links0[k], links1[k])
        report.rss_kib[k] = (rss0[k], rss1[k])
        if fds1[k] - links1[k] != fds0[k] - links0[k]:
            report.violations.append(f"stage {k}: {fds1[k]} open descriptors with {links1[k]} pipeline links, "
                                     f"{fds0[k]} with {links0[k]} after the warm-up")
        if rss1[k] > rss0[k] * (1 + RSS_TOLERANCE):
            report.violations.append(f"stage {k}: VmRSS {rss1[k]} KiB, more than {RSS_TOLERANCE:.0%} above "
                                     f"{rss0[k]} KiB after the warm-up")
    if report.errors:
        report.violations.append(f"{len(report.errors)} unexpected errors")
    if report.wrong_tokens:
        report.violations.append(f"{len(report.wrong_tokens)} generations with wrong tokens")
    for k, pid in pids.items():
        if pipe.stages[k].proc.poll() is not None:
            report.violations.append(f"stage {k} (pid {pid}) died")
    return report


class SoakPipeline(Pipeline):
    """A pipeline whose stages after the head may get their own extra flags (e.g. more sequence slots)."""

    def __init__(self, *args, stage_extra: list[str] = (), **kw):
        super().__init__(*args, **kw)
        self.stage_extra = list(stage_extra)

    def start_stage(self, k: int, *, wait: bool = True):
        base = self.extra
        self.extra = base + (self.stage_extra if k > 0 else [])
        try:
            return super().start_stage(k, wait=wait)
        finally:
            self.extra = base


def start_pipeline(model: Path, n_stages: int, workdir: Path, extra: list[str] = FLAGS, *,
                   stage_lanes: int | None = None, env: dict | None = None, config: dict = CONFIG) -> Pipeline:
    """Split and start; `stage_lanes` gives the stages after the head that many sequence slots."""
    split_for_test(model, n_stages, workdir)
    pipe = SoakPipeline(workdir / "topology.toml", workdir, extra=list(extra), env=env, config=config,
                        stage_extra=["--lanes", str(stage_lanes)] if stage_lanes else [])
    return pipe.start()


def main(argv: list[str] | None = None) -> int:
    from skippyd.runtime.models import fetch_default_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--generations", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cancel-rate", type=float, default=0.1)
    p.add_argument("--disconnect-rate", type=float, default=0.1)
    p.add_argument("--stage-lanes", type=int, default=None,
                   help="sequence slots of the stages after the head (default: the head's 4); more slots hide "
                        "the race of a cancelled session released late on stage 1 (see tests/test_faults.py)")
    p.add_argument("--malloc-arena-max", type=int, default=None,
                   help="run the daemons with MALLOC_ARENA_MAX=N (glibc's per-thread arenas grow the head's RSS "
                        "in steps of ~12 MiB before it levels off)")
    p.add_argument("--model", type=Path, default=None,
                   help="GGUF to split (default: the embedded default model). A random-weight model's logits are "
                        "near ties, which batching with other sessions flips in llama.cpp itself (a single stage "
                        "too): its 'wrong tokens' are no pipeline fault")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)

    def progress(report: SoakReport, elapsed: float, fds: dict, rss: dict) -> None:
        print(f"  {report.generations} generations, {elapsed:.0f} s, errors {len(report.errors)}, fds "
              f"{list(fds.values())}, VmRSS MiB {[round(r / 1024, 1) for r in rss.values()]}", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="skippy-soak-") as tmp:
        env = {"MALLOC_ARENA_MAX": str(args.malloc_arena_max)} if args.malloc_arena_max else None
        pipe = start_pipeline(args.model or fetch_default_model(), args.stages, Path(tmp),
                              stage_lanes=args.stage_lanes, env=env)
        try:
            report = trio.run(lambda: soak(pipe, args.generations, concurrency=args.concurrency, seed=args.seed,
                                           max_tokens=args.max_tokens, cancel_rate=args.cancel_rate,
                                           disconnect_rate=args.disconnect_rate, progress=progress))
        finally:
            codes = pipe.stop()
        if any(c != 0 for c in codes.values()):
            report.violations.append(f"exit codes on SIGTERM: {codes}")
    print(report.summary())
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=1))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
