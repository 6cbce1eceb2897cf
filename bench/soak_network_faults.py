"""Soak: random network faults between two hosts, cut and healed in a row; nothing may leak.

    sudo .venv/bin/python bench/soak_network_faults.py [-n 100] [--seed 1] [--flap 60] [--json out.json]

The head runs in one network namespace, stage 1 in another, joined by a veth
pair (tests/netns.py: needs root, `ip` and `nft`), each stage its own skippyd
(`--lanes 2 --ctx 512`, one thread, prefill chunk 32, the default reply
deadline of 30 s). Each of the `-n` cuts picks at random:

- the fault: the link down, every packet from the head to stage 1 lost, or
  every packet from stage 1 to the head lost;
- when (`--when`): mid-decode (a streamed generation, cut after 3 to 40 pieces) or idle
  (no generation running: only the idle lanes and the liveness connection);
- how long it lasts: 0.5 to 6 s (past runtime.peer_timeout, 3 s, in about
  half the cuts).

A mid-decode cut must give the client an error naming stage 1 within 2 s.
After each heal the script asks for a generation until one succeeds: the
recover time, from the heal, must be within 3 s (reported, counted). Every
10 cuts, and at the start (after a warm-up) and the end, it samples each
daemon's resident memory (VmRSS) and open descriptors. At the end every stage
must hold no session and every slot free, the connections to stage 1 must be
as many on both sides, and the descriptors back to their count at the start
(give or take one for a lane the head is reopening).

`--flap SECONDS` runs, after the cuts (`-n 0`: instead of them), the
flapping link of tests/test_network_faults.py for that long under four
clients, on the pipeline above and on a second one with `--resume` (four
lanes): every call complete or a clear error; with --resume every call the
head accepted complete with the tokens of an uninterrupted run.

Prints a table; exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import attrs
import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from skippyctl.client import ControlError  # noqa: E402
from tests import netns  # noqa: E402
from tests.procs import split_for_test  # noqa: E402
from tests.test_faults import COUNT  # noqa: E402
from tests.test_network_faults import (  # noqa: E402
    ERROR_S,
    FLAGS,
    LANES,
    PROBE,
    RECOVER_S,
    RESUME_FLAGS,
    RESUME_LANES,
    RESUME_PORT,
    STAGE_PORT,
    NetPipeline,
    flap,
    links_to_stage1,
    stage1_held,
    start_net_pipeline,
    start_stream,
)

KINDS = ("link down", "loss head->stage1", "loss stage1->head")
SAMPLE_EVERY = 10


@attrs.define
class Cut:
    index: int
    kind: str
    when: str  # "decode" | "idle"
    lasted_s: float
    error_s: float | None = None  # mid-decode: fault -> the client's error
    close_s: float | None = None  # ... -> the control connection closed after it
    error: str | None = None
    stage1_held_at_heal: int | None = None  # sessions stage 1 still held when the link came back
    recover_s: float | None = None  # heal -> a generation succeeded
    violations: list[str] = attrs.field(factory=list)


@attrs.define
class Report:
    cuts: list[Cut] = attrs.field(factory=list)
    samples: list[dict] = attrs.field(factory=list)  # {"cut": i, "rss_kib": {k: ..}, "fds": {k: ..}}
    sessions_after: dict = attrs.field(factory=dict)
    links_after: tuple[int, int] = (0, 0)
    flaps: dict = attrs.field(factory=dict)
    violations: list[str] = attrs.field(factory=list)
    wall_s: float = 0.0


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def fd_count(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def sample(pipe: NetPipeline, cut: int) -> dict:
    return {"cut": cut, "rss_kib": {k: rss_kib(d.proc.pid) for k, d in pipe.stages.items()},
            "fds": {k: fd_count(d.proc.pid) for k, d in pipe.stages.items()}}


def inject(net: netns.Network, kind: str) -> None:
    if kind == "link down":
        net.link_down(1)
    elif kind == "loss head->stage1":
        net.drop(0, 1)
    else:
        net.drop(1, 0)


def arm(net: netns.Network, kind: str) -> None:
    """Make the rule chain beforehand: the fault itself is then one quick command."""
    if kind == "loss head->stage1":
        net.arm(1)
    elif kind == "loss stage1->head":
        net.arm(0)


async def recover(pipe: NetPipeline, timeout: float = 30.0) -> float | None:
    """Seconds until a generation succeeds (retrying after errors); None if none did within `timeout`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            with trio.fail_after(max(0.1, timeout - (time.monotonic() - started))):
                await pipe.generate(**PROBE)
            return time.monotonic() - started
        except ControlError:
            await trio.sleep(0.05)
        except trio.TooSlowError:
            return None
    return None


async def one_cut(pipe: NetPipeline, net: netns.Network, rng: random.Random, index: int,
                  whens: tuple[str, ...] = ("decode", "idle")) -> Cut:
    cut = Cut(index, rng.choice(KINDS), rng.choice(whens), round(rng.uniform(0.5, 6.0), 2))
    arm(net, cut.kind)
    async with trio.open_nursery() as nursery:
        if cut.when == "decode":
            s = await start_stream(pipe, nursery, prompt=COUNT, raw=True, max_tokens=400)
            await s.wait_pieces(rng.randint(3, 40))
        inject(net, cut.kind)
        injected = time.monotonic()
        if cut.when == "decode":
            if await s.wait_done(max(ERROR_S + 1, cut.lasted_s)):
                cut.error_s = round(s.ended_at - injected, 2)
                cut.close_s = round(s.closed_at - injected, 2)
                cut.error = str(s.error) if s.error is not None else None
            if s.result is not None:
                cut.violations.append("the generation finished through the fault")
            elif cut.error is None:
                cut.violations.append("no error while the fault lasted")
            elif cut.error_s > ERROR_S or "stage 1" not in cut.error:
                cut.violations.append(f"error after {cut.error_s} s: {cut.error}")
        await trio.sleep(max(0.0, injected + cut.lasted_s - time.monotonic()))
        cut.stage1_held_at_heal = (await stage1_held(pipe))[0]
        healed_at = time.monotonic()
        net.heal()
        took = await recover(pipe)
        cut.recover_s = None if took is None else round(time.monotonic() - healed_at, 2)
        if cut.recover_s is None:
            cut.violations.append("no generation succeeded within 30 s of the heal")
        elif cut.recover_s > RECOVER_S:
            cut.violations.append(f"recovered {cut.recover_s} s after the heal")
        nursery.cancel_scope.cancel()  # (the cut stream ended already; nothing else runs)
    await trio.sleep(rng.uniform(0.0, 1.0))
    return cut


async def settle(pipe: NetPipeline, timeout: float = 15.0) -> tuple[dict, tuple[int, int]]:
    """Wait for every stage to hold nothing and the connections to stage 1 to match; (sessions, links)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = await pipe.stage_sessions()
        links = links_to_stage1(pipe)
        held = any(s["live"] or s["free"] != s["n_seq_max"] for s in snap.values())
        if (not held and links[0] == links[1] <= pipe.lanes + 1) or time.monotonic() > deadline:
            return snap, links
        await trio.sleep(0.2)


async def soak(pipe: NetPipeline, net: netns.Network, n: int, seed: int, report: Report,
               whens: tuple[str, ...] = ("decode", "idle")) -> None:
    rng = random.Random(seed)
    for _ in range(3):  # warm-up: the largest graphs, lanes in use
        await pipe.generate(prompt=COUNT, raw=True, max_tokens=64)
    await settle(pipe)
    report.samples.append(sample(pipe, 0))
    for i in range(1, n + 1):
        cut = await one_cut(pipe, net, rng, i, whens)
        report.cuts.append(cut)
        mark = "!" if cut.violations else " "
        if cut.violations:
            print(pipe.head.log()[-3000:])
        print(f"{mark} cut {i:3d}: {cut.kind:18s} {cut.when:6s} {cut.lasted_s:4.1f} s  error "
              f"{'-' if cut.error_s is None else cut.error_s:>5} (closed {cut.close_s})  recover {cut.recover_s}"
              + (f"  {cut.violations}" if cut.violations else ""), flush=True)
        if i % SAMPLE_EVERY == 0 or i == n:
            if i == n:
                await settle(pipe)
            report.samples.append(sample(pipe, i))
    report.sessions_after, report.links_after = await settle(pipe)
    for k, s in report.sessions_after.items():
        if s["live"] or s["free"] != s["n_seq_max"]:
            report.violations.append(f"stage {k} holds {s['live']} session(s), {s['free']}/{s['n_seq_max']} free")
    a, b = report.links_after
    if a != b or b > pipe.lanes + 1:
        report.violations.append(f"connections to stage 1: the head has {a}, stage 1 {b}")
    first, last = report.samples[0], report.samples[-1]
    for k in first["fds"]:
        if last["fds"][k] > first["fds"][k] + 1:
            report.violations.append(f"stage {k}: {first['fds'][k]} descriptors at the start, {last['fds'][k]} at "
                                     "the end")
    report.violations += [f"cut {c.index}: {v}" for c in report.cuts for v in c.violations]


async def flapping(pipes: dict[str, NetPipeline], net: netns.Network, seconds: float, report: Report) -> None:
    for name, pipe in pipes.items():
        resume = name == "resume"
        before = {k: fd_count(d.proc.pid) for k, d in pipe.stages.items()}
        started = time.monotonic()
        got = await flap(pipe, net, seconds, resume=resume, seed=11)
        took = await recover(pipe)
        sessions, links = await settle(pipe)
        after = {k: fd_count(d.proc.pid) for k, d in pipe.stages.items()}
        report.flaps[name] = {"seconds": round(time.monotonic() - started, 1), "complete": got.complete,
                              "errors": len(got.errors), "refused": got.refused, "replays": got.resumed,
                              "differs": len(got.differs), "recover_s": None if took is None else round(took, 2),
                              "fds": {k: (before[k], after[k]) for k in before}, "links": links}
        if resume and got.differs:
            report.violations.append(f"flap --resume: {len(got.differs)} complete calls differ: {got.differs[:2]}")
        if any(s["live"] or s["free"] != s["n_seq_max"] for s in sessions.values()):
            report.violations.append(f"flap {name}: sessions held after: {sessions}")
        if any(after[k] > before[k] + 1 for k in before):
            report.violations.append(f"flap {name}: descriptors {before} -> {after}")


def table(report: Report) -> str:
    cuts = report.cuts
    lines = []
    if cuts:
        mid = [c for c in cuts if c.when == "decode"]
        errs = [c.error_s for c in mid if c.error_s is not None]
        recs = [c.recover_s for c in cuts if c.recover_s is not None]
        rows = [("cuts", f"{len(cuts)} ({len(mid)} mid-decode, {len(cuts) - len(mid)} idle; "
                         + ", ".join(f"{k} {sum(c.kind == k for c in cuts)}" for k in KINDS) + ")"),
                ("client errors (mid-decode)", f"{len(errs)} of {len(mid)}, "
                 + (f"max {max(errs):.2f} s, median {sorted(errs)[len(errs) // 2]:.2f} s" if errs else "-")),
                ("recoveries", f"{len(recs)} of {len(cuts)}, within {RECOVER_S:g} s: "
                 f"{sum(r <= RECOVER_S for r in recs)}"),
                ("max recover time", f"{max(recs):.2f} s (median {sorted(recs)[len(recs) // 2]:.2f} s)" if recs
                 else "-"),
                ("stage 1 already released at the heal", f"{sum(c.stage1_held_at_heal == 0 for c in cuts)} of "
                 f"{len(cuts)} (all {sum(c.lasted_s > 5 for c in cuts)} cuts over 5 s: "
                 f"{all(c.stage1_held_at_heal == 0 for c in cuts if c.lasted_s > 5)})"),
                ("held sessions at end", ", ".join(f"stage {k}: {s['live']}" for k, s in
                                                   sorted(report.sessions_after.items()))),
                ("connections to stage 1 at end", f"head {report.links_after[0]}, stage 1 {report.links_after[1]}")]
        first, last = report.samples[0], report.samples[-1]
        for k in sorted(first["rss_kib"]):
            r0, r1 = first["rss_kib"][k], last["rss_kib"][k]
            rows.append((f"stage {k} RSS start/end", f"{r0 / 1024:.1f} / {r1 / 1024:.1f} MiB ({(r1 - r0) / r0:+.1%}); "
                         "every 10 cuts: " + " ".join(f"{s['rss_kib'][k] / 1024:.1f}" for s in report.samples)))
            rows.append((f"stage {k} fds start/end", f"{first['fds'][k]} / {last['fds'][k]}"))
        w = max(len(r[0]) for r in rows)
        lines += [f"{a.ljust(w)} | {b}" for a, b in rows]
    for name, f in report.flaps.items():
        lines.append(f"flap {f['seconds']:.0f} s, 4 clients, {name}: {f['complete']} complete, {f['errors']} clear "
                     f"errors, {f['refused']} refused while down, {f['replays']} replays, {f['differs']} differ; "
                     f"recovered in {f['recover_s']} s; fds {f['fds']}; links {f['links']}")
    lines.append(f"wall {report.wall_s:.0f} s; violations: " + ("; ".join(report.violations) if report.violations
                                                                 else "none"))
    return "\n".join(lines)


async def run(args) -> Report:
    from skippyd.runtime.models import fetch_default_model

    report = Report()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="skippy-netsoak-") as tmp, netns.Network() as net:
        work = Path(tmp)
        split_for_test(fetch_default_model(), 2, work / "split")
        split = work / "split" / "topology.toml"
        (work / "plain").mkdir()
        pipes = {"plain": await trio.to_thread.run_sync(lambda: start_net_pipeline(
            net, split, work / "plain", port=STAGE_PORT, flags=FLAGS, lanes=LANES))}
        try:
            if args.cuts:
                await soak(pipes["plain"], net, args.cuts, args.seed, report,
                           ("decode", "idle") if args.when == "both" else (args.when,))
            if args.flap:
                (work / "resume").mkdir()
                pipes["resume"] = await trio.to_thread.run_sync(lambda: start_net_pipeline(
                    net, split, work / "resume", port=RESUME_PORT, flags=RESUME_FLAGS, lanes=RESUME_LANES))
                await flapping(pipes, net, args.flap, report)
        except Exception as exc:  # a check of the flapping (a hung call...): reported with the rest
            report.violations.append(f"{type(exc).__name__}: {exc!r}"[:2000])
        finally:
            net.heal()
            for name, pipe in pipes.items():
                for k, d in pipe.stages.items():
                    if d.proc.poll() is not None:
                        report.violations.append(f"{name} stage {k} died")
                pipe.stop()
            if report.violations and args.logs:  # the daemons' logs, before the work directory goes
                args.logs.mkdir(parents=True, exist_ok=True)
                for name, pipe in pipes.items():
                    for k, d in pipe.stages.items():
                        (args.logs / f"{name}-stage{k}.log").write_text(d.log())
    report.wall_s = time.monotonic() - started
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--cuts", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--when", choices=("both", "decode", "idle"), default="both", help="the cuts' timing")
    p.add_argument("--flap", type=float, default=0.0, help="then flap the link this many seconds (4 clients)")
    p.add_argument("--json", type=Path)
    p.add_argument("--logs", type=Path, help="after a violation, copy the daemons' logs into this directory")
    args = p.parse_args(argv)
    if why := netns.unavailable(need_nft=True):
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    report = trio.run(run, args)
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(attrs.asdict(report), indent=1))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
