"""skippy's benchmark suite: plain llama.cpp, single-stage skippyd and 2-/3-stage pipelines, same run.

    .venv/bin/python bench/bench_pipeline.py [--rounds 3] [--json out.json] [--delay-ms 10] [--no-reference]

Configurations, each measured in every round, in interleaved order (a
shared VM drifts by ±10% over a minute, so only same-run figures are compared):

* ``llama-cpp-python``: plain llama.cpp through its Python binding, built
  from the same pinned source (bench/reference.py installs it; a fresh
  process per round, bench/llama_cpp_reference.py), including its batched
  decode of 1, 2, 4 and 8 sequences in one process (the ceiling for the
  pipelines' aggregate figures: stages on one host take turns at the cores);
* ``single``: ``skippyd --model`` (the whole model, one stage);
* ``2-stage`` and ``3-stage``: one skippyd process per stage on loopback.

Every skippyd runs with its defaults except ``--lanes 8 --ctx 2048``; the
threads are ``--threads`` (default 2) everywhere. Per configuration and
round: decode tokens/s of one session (64 tokens after the first; the median
of 3 generations), time to first token and prefill tokens/s of a ~500-token
prompt and decode tokens/s after it (32 tokens), aggregate decode tokens/s
of 1, 2, 4 and 8 concurrent sessions (the streamed tokens that arrive while
all of them decode, over that window; also end-to-end: completion tokens of
all / wall time, prefill included), and each stage's Python time per decode
step (its own ``hot_path`` counters: wall time handling a step, less waits
on other stages and for the host compute lock, less native compute; the
event loop thread's CPU time over it, with and without the CPU time of the
head's waits for replies, which a later stage's window does not hold). Then,
once per round, one session's decode again with the skippyd configurations'
generations interleaved one by one (4 each), and each one's ratio to
single-stage in that round: the 2-stage/single target is read both ways.

Stages on hosts of their own (default on; ``--no-overlap`` skips it),
emulated here: a 2-stage pipeline split by compute (``--balance compute``)
whose stages have one thread each and no compute lock, so each computes on
its own core, with ``decode_groups = 1`` (every session in one batch, the
stages taking turns) and ``2`` (two groups, one in flight on each stage):
aggregate decode of 1, 2, 4 and 8 sessions, in interleaved rounds.

With ``--delay-ms D`` (default 10; 0 skips it) the 2- and 3-stage pipelines
run again with D ms one-way delay on every link and the time per output
token is set against compute + the one-way delays around the loop + 1.5 ms
(2 stages: 2 links; 3 stages with direct return: 3, not 4); and once more
each with ``runtime.keep_warm_ms`` (this script's ``--keep-warm-ms``, default 100; 0 skips them): cores left idle
between a stage's steps compute the next one more slowly, and the ratio of
the time per token kept warm to not is what that option gives.

Prints tables of medians (min-max) with ratios, then the targets (ratios to llama-cpp-python and to a
single stage, Python time per decode step, the delay bound; each with its bound marked met or NOT met),
and writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippyctl.client import open_control  # noqa: E402
from skippyd.control import messages as m  # noqa: E402
from skippyd.runtime.models import fetch_default_model  # noqa: E402
from tests.procs import Pipeline, SingleStage, split_for_test  # noqa: E402

LONG = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil and a "
        "cloth for the great lens. Ships passing the rocky headland depended on the beam to find the channel "
        "between the reefs, and in winter storms the light was the only thing a sailor could trust. ")
LONG_PROMPT = LONG * 9  # ~500 tokens
DECODE_PROMPT = "Write a long story about a dragon who learns to sail."
DECODE_TOKENS = 65  # the first token, then 64 decode steps
AGGREGATE_TOKENS = 64  # per session, concurrent sessions
INTERLEAVED_REPEATS = 4  # one session's decode, configurations in turn: generations of each per round
DECODE_REPEATS = 3  # one session's decode: the median of this many generations per round (the VM drifts)
LONG_DECODE_TOKENS = 33  # after the ~500-token prompt: its first token, then 32 decode steps
CONCURRENCY = (1, 2, 4, 8)
PY_BUDGET_MS = 0.3  # the target: Python time per decode step per stage
LOOP_SLACK_MS = 1.5  # the target with link delay: compute + delays around the loop + this


async def generate(client, **kw) -> dict:
    return await client.call(m.Generate(id=client.new_id(), stream=False, raw=True, **kw))


async def stage_status(pipe: Pipeline, field: str) -> list[dict]:
    """Each stage's `field` of its status (``hot_path``, ``threads``, ...), stage 0 first."""
    out = []
    for k in sorted(pipe.stages):
        status = await pipe.stages[k].astatus()
        out.append(status["head"][field] if k == 0 else status["stages"][0][field])
    return out


async def hot_paths(pipe: Pipeline) -> list[dict]:
    """Each stage's hot_path counters, stage 0 first."""
    return await stage_status(pipe, "hot_path")


def per_step(before: list[dict], after: list[dict]) -> tuple[list[float], ...]:
    """Per decode step of each stage between two hot_paths(), in ms: Python wall time and CPU time of the
    steps' handling (the head's window with its waits for replies), the same CPU time less those waits
    (every stage's window from the message in hand), the event loop thread's whole CPU time outside
    llama.cpp, and native compute."""
    py, cpu, handling, loop, native = [], [], [], [], []
    for b, a in zip(before, after):
        steps = max(1, a["decode_steps"] - b["decode_steps"])
        nat = a["native_s"] - b["native_s"]
        py.append((a["wall_s"] - b["wall_s"] - nat) * 1e3 / steps)
        cpu.append((a["cpu_s"] - b["cpu_s"]) * 1e3 / steps)
        waits = a.get("wait_cpu_s", 0.0) - b.get("wait_cpu_s", 0.0)  # (bench/ab_trees.py: older trees lack it)
        handling.append(cpu[-1] - waits * 1e3 / steps)
        loop.append((a["loop_cpu_s"] - b["loop_cpu_s"] - a["loop_native_cpu_s"] + b["loop_native_cpu_s"]) * 1e3 / steps)
        native.append(nat * 1e3 / steps)
    return py, cpu, handling, loop, native


async def concurrent_decode(head, conc: int) -> tuple[float, float]:
    """`conc` sessions at once, each streaming AGGREGATE_TOKENS: (aggregate decode tok/s, end-to-end tok/s).

    Aggregate decode counts the streamed pieces that arrive while every session
    is decoding (from the last session's first piece to the first session's
    last) over that window: the steady state, without the prompts' prefill
    (which batching cannot speed up; each prompt is computed once). A piece
    holds the text of one token or, rarely, a few, so this never over-counts;
    a message holds ``pieces`` of them (several when they queued up while the
    head sent the previous one). End-to-end is
    all completion tokens over the wall time from the first request to the
    last answer, prefill included.
    """
    arrivals: list[list[tuple[float, int]]] = []
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        times: list[tuple[float, int]] = []
        arrivals.append(times)
        async with open_control(head.url, head.token_file) as c:
            request = m.Generate(id=c.new_id(), stream=True, raw=True, prompt=f"{DECODE_PROMPT} Chapter {i}.",
                                 max_tokens=AGGREGATE_TOKENS)
            async for reply in c.replies(request):
                if isinstance(reply, m.Piece):
                    times.append((time.perf_counter(), reply.pieces))
                elif isinstance(reply, m.Result):
                    tokens += len(reply.result["tokens"])
                else:
                    raise RuntimeError(f"generation failed: {reply}")

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(conc):
            nursery.start_soon(one, i)
    e2e = tokens / (time.perf_counter() - started)
    lo, hi = max(t[0][0] for t in arrivals), min(t[-1][0] for t in arrivals)
    if hi <= lo:
        raise RuntimeError(f"{conc} sessions never decoded at the same time")
    pieces = sum(sum(n for x, n in t if lo < x <= hi) for t in arrivals)
    return pieces / (hi - lo), e2e


async def measure(pipe: Pipeline, *, concurrency: tuple[int, ...] = CONCURRENCY) -> dict:
    head = pipe.head
    out: dict = {}
    async with open_control(head.url, head.token_file) as client:
        before = await hot_paths(pipe)
        rates = []
        for _ in range(DECODE_REPEATS):
            r = await generate(client, prompt=DECODE_PROMPT, max_tokens=DECODE_TOKENS)
            rates.append(r["timings"]["decode_tokens_per_s"])
        py, cpu, handling, loop, native = per_step(before, await hot_paths(pipe))
        out["decode_tps"] = statistics.median(rates)
        out["ms_per_token"] = 1e3 / out["decode_tps"]
        out["compute_ms_per_token"] = sum(native)
        for k, v in enumerate(native):
            out[f"native_ms_per_step_stage{k}"] = v
        out["python_ms_per_step_max"] = max(py)
        out["python_cpu_ms_per_step_max"] = max(cpu)
        out["handling_cpu_ms_per_step_max"] = max(handling)
        out["loop_cpu_ms_per_step_max"] = max(loop)
        for k, (v, c, h, lp) in enumerate(zip(py, cpu, handling, loop)):
            out[f"python_ms_per_step_stage{k}"] = v
            out[f"python_cpu_ms_per_step_stage{k}"] = c
            out[f"handling_cpu_ms_per_step_stage{k}"] = h
            out[f"loop_cpu_ms_per_step_stage{k}"] = lp
        r = await generate(client, prompt=LONG_PROMPT, max_tokens=LONG_DECODE_TOKENS)
        out["ttft_ms_500"] = r["timings"]["ttft_ms"]
        out["decode_tps_500"] = r["timings"]["decode_tokens_per_s"]
        out["prompt_tokens"] = r["usage"]["prompt_tokens"]
        out["prefill_tps_500"] = out["prompt_tokens"] / (out["ttft_ms_500"] / 1e3)
    out.update(await aggregates(pipe, concurrency))
    return out


async def interleaved_decode(configs: dict[str, Pipeline]) -> dict[str, float]:
    """One session's decode tokens/s of every configuration, generation by generation in turn (A, B, C, A,
    B, C, ...; INTERLEAVED_REPEATS each): the median of each. Ratios between these are not moved by the
    VM's drift over the half minute between one configuration's measure() and the next one's."""
    rates: dict[str, list[float]] = {name: [] for name in configs}
    async with AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(open_control(pipe.head.url, pipe.head.token_file))
                   for name, pipe in configs.items()}
        for _ in range(INTERLEAVED_REPEATS):
            for name, client in clients.items():
                r = await generate(client, prompt=DECODE_PROMPT, max_tokens=DECODE_TOKENS)
                rates[name].append(r["timings"]["decode_tokens_per_s"])
    return {name: statistics.median(v) for name, v in rates.items()}


async def aggregates(pipe: Pipeline, concurrency: tuple[int, ...] = CONCURRENCY) -> dict:
    """Aggregate (and end-to-end) decode tokens/s of each number of concurrent sessions (see
    concurrent_decode), and 4 sessions' over 1's (0 unless both were measured)."""
    out = {}
    for conc in concurrency:
        out[f"aggregate_tps_{conc}"], out[f"e2e_tps_{conc}"] = await concurrent_decode(pipe.head, conc)
    out["aggregate_4_over_1"] = (out["aggregate_tps_4"] / out["aggregate_tps_1"]
                                 if {1, 4} <= set(concurrency) else 0.0)
    return out


def measure_overlap(model: Path, tmp: Path, common: list[str], rounds: int) -> dict[str, list[dict]]:
    """The own-cores section: 2 stages, one thread each, no compute lock, decode groups 1 and 2."""
    base = [*common, "--threads", "1"]
    configs = {}
    for g in (1, 2):
        work = tmp / f"overlap{g}"
        work.mkdir()
        split_for_test(model, 2, work, balance="compute")  # ports of its own: both pipelines run at once
        configs[f"decode groups {g}"] = Pipeline(work / "topology.toml", work, extra=base,
                                                 config={"runtime.compute_lock": "off", "runtime.decode_groups": g})
    results: dict[str, list[dict]] = {name: [] for name in configs}
    try:
        for pipe in configs.values():
            pipe.start()
            trio.run(concurrent_decode, pipe.head, 2)  # warm-up
        for _ in range(rounds):
            for name, pipe in configs.items():
                results[name].append(trio.run(aggregates, pipe))
    finally:
        for pipe in configs.values():
            pipe.stop()
    return results


def measure_reference(model: Path, threads: int, long_prompt_file: Path) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "llama_cpp_reference.py"), str(model),
                           "--threads", str(threads), "--decode-prompt", DECODE_PROMPT,
                           "--decode-tokens", str(DECODE_TOKENS), "--long-prompt-file", str(long_prompt_file),
                           "--long-decode-tokens", str(LONG_DECODE_TOKENS), "--repeats", str(DECODE_REPEATS),
                           "--batched-tokens", str(AGGREGATE_TOKENS)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-cpp-python reference failed:\n{proc.stderr[-2000:]}")
    r = json.loads(proc.stdout)
    r["ms_per_token"] = 1e3 / r["decode_tps"]
    return r


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def table(results: dict[str, list[dict]]) -> dict[str, dict[str, dict]]:
    return {name: {k: summarize([r[k] for r in runs if k in r]) for k in runs[0] if isinstance(runs[0][k], float)}
            for name, runs in results.items() if runs}


def print_table(title: str, tab: dict, rows: list[tuple[str, str]], base: str | None) -> None:
    names = list(tab)
    print(f"\n{title}")
    print(f"{'':38}" + "".join(f"{n:>30}" for n in names))
    for key, label in rows:
        cells = []
        for n in names:
            s = tab[n].get(key)
            if s is None:
                cells.append(f"{'-':>30}")
                continue
            ratio = ""
            if base is not None and key in tab.get(base, {}) and tab[base][key]["median"]:
                ratio = f" x{s['median'] / tab[base][key]['median']:.2f}"
            digits = 0 if s["median"] >= 1000 else 2
            spread = max(digits - 1, 0)
            cells.append(f"{s['median']:.{digits}f} ({s['min']:.{spread}f}-{s['max']:.{spread}f})"
                         f"{ratio}")
        print(f"{label:38}" + "".join(f"{c:>30}" for c in cells))


def verdict(label: str, value: float) -> str:
    """'  met' / '  NOT met' for a target row whose label ends with its bound (">= 0.95"); '' for the rows
    beside them (ceilings, the same figure another way)."""
    bound = re.search(r"(>=|<=) (-?[0-9.]+)$", label)
    if bound is None:
        return ""
    limit = float(bound.group(2))
    met = value >= limit if bound.group(1) == ">=" else value <= limit
    return "  met" if met else "  NOT met"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="compute threads of every stage and of the reference")
    ap.add_argument("--delay-ms", type=float, default=10.0, help="one-way link delay for the WAN section (0: skip)")
    ap.add_argument("--keep-warm-ms", type=float, default=100.0,
                    help="the WAN section also measures the pipelines with skippyd's keep_warm_ms this long (0: not)")
    ap.add_argument("--no-reference", action="store_true", help="skip llama-cpp-python")
    ap.add_argument("--no-overlap", action="store_true", help="skip the stages-on-their-own-cores section")
    ap.add_argument("--model", type=Path, default=None,
                    help="GGUF to measure (default: the embedded default model); a bigger one shows the compute-"
                         "bound regime of the models a pipeline is for")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = args.model or fetch_default_model()
    if not args.no_reference:
        from bench.reference import ensure_reference

        ensure_reference()
    common = ["--lanes", "8", "--ctx", "2048", "--threads", str(args.threads)]
    results: dict[str, list[dict]] = {}
    delayed: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        long_file = tmp / "long.txt"
        long_file.write_text(LONG_PROMPT)
        configs: dict[str, Pipeline] = {}
        try:
            (tmp / "single").mkdir()
            configs["single"] = SingleStage(model, tmp / "single", common)
            for n in (2, 3):
                work = tmp / f"split{n}"
                work.mkdir()
                split_for_test(model, n, work)
                configs[f"{n}-stage"] = Pipeline(work / "topology.toml", work, extra=common).start()
            if not args.no_reference:
                results["llama-cpp-python"] = []
            results.update({name: [] for name in configs})
            for pipe in configs.values():  # warm-up
                trio.run(lambda p=pipe: measure(p, concurrency=(1,)))
            for rnd in range(args.rounds):
                if not args.no_reference:
                    results["llama-cpp-python"].append(measure_reference(model, args.threads, long_file))
                for name, pipe in configs.items():
                    results[name].append(trio.run(measure, pipe))
                paired = trio.run(interleaved_decode, configs)
                for name, tps in paired.items():
                    results[name][-1]["decode_tps_interleaved"] = tps
                    results[name][-1]["decode_over_single_interleaved"] = tps / paired["single"]
                print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            for pipe in configs.values():
                pipe.stop()
        overlap = {} if args.no_overlap else measure_overlap(model, tmp, common, args.rounds)
        if args.delay_ms > 0:
            configs = {}
            try:
                warm = [("", {})] + ([(" kept warm", {"runtime.keep_warm_ms": args.keep_warm_ms})]
                                     if args.keep_warm_ms > 0 else [])
                for n in (2, 3):
                    for label, keys in warm:  # each pipeline its own topology (ports)
                        work = tmp / f"delay{n}{label.replace(' ', '-')}"
                        work.mkdir()
                        split_for_test(model, n, work)
                        configs[f"{n}-stage{label}"] = Pipeline(
                            work / "topology.toml", work,
                            extra=common, config={"stage.link_delay_ms": args.delay_ms, **keys}).start()
                delayed = {name: [] for name in configs}
                for pipe in configs.values():
                    trio.run(lambda p=pipe: measure(p, concurrency=()))
                for _ in range(args.rounds):
                    for name, pipe in configs.items():
                        r = trio.run(lambda p=pipe: measure(p, concurrency=()))
                        links = int(name[0])  # around the loop: n links (direct return from 3 stages on)
                        r["loop_delay_ms"] = links * args.delay_ms
                        r["bound_ms"] = r["compute_ms_per_token"] + r["loop_delay_ms"] + LOOP_SLACK_MS
                        r["excess_ms"] = r["ms_per_token"] - r["compute_ms_per_token"] - r["loop_delay_ms"]
                        delayed[name].append(r)
            finally:
                for pipe in configs.values():
                    pipe.stop()

    tab = table(results)
    cores = os.cpu_count()
    print(f"model {model.name}, {cores} cores, {args.threads} threads per stage, {args.rounds} interleaved rounds; "
          f"medians (min-max), xratio to single-stage skippyd")
    rows = [("decode_tps", "decode tok/s (1 session)"),
            ("decode_tps_interleaved", "  the same, configs interleaved"),
            ("decode_over_single_interleaved", "  ... / single, per round"), ("ms_per_token", "ms / token"),
            ("prefill_tps_500", "prefill tok/s (~500 tokens)"), ("ttft_ms_500", "TTFT ms (~500 tokens)"),
            ("decode_tps_500", "decode tok/s after ~500 tokens")]
    rows += [(f"aggregate_tps_{c}", f"aggregate decode tok/s, {c} sessions") for c in CONCURRENCY]
    rows += [(f"e2e_tps_{c}", f"end-to-end tok/s, {c} sessions") for c in CONCURRENCY]
    rows += [("aggregate_4_over_1", "aggregate 4 / 1 session"), ("compute_ms_per_token", "native compute ms / token")]
    rows += [(f"python_ms_per_step_stage{k}", f"Python ms / step, stage {k} (wall)") for k in range(3)]
    rows += [(f"python_cpu_ms_per_step_stage{k}", f"Python ms / step, stage {k} (CPU)") for k in range(3)]
    rows += [(f"handling_cpu_ms_per_step_stage{k}", f"  the same, less waits: stage {k}") for k in range(3)]
    rows += [(f"loop_cpu_ms_per_step_stage{k}", f"event loop CPU ms / step, stage {k}") for k in range(3)]
    print_table("throughput and latency", tab, rows, "single")
    report: dict = {"model": model.name, "cores": cores, "threads": args.threads, "rounds": args.rounds,
                    "results": tab, "targets": {}}
    if delayed:
        dtab = table(delayed)
        print_table(f"{args.delay_ms:g} ms one-way on every link", dtab,
                    [("ms_per_token", "ms / token"), ("compute_ms_per_token", "native compute ms / token"),
                     ("loop_delay_ms", "one-way delays around the loop"), ("excess_ms", "beyond compute + delays"),
                     ("bound_ms", f"target: compute + delays + {LOOP_SLACK_MS}")], None)
        report["delayed"] = {"delay_ms": args.delay_ms, "results": dtab}

    if overlap:
        otab = table(overlap)
        print_table("2 stages on cores of their own (1 thread each, no compute lock, split by compute)", otab,
                    [(f"aggregate_tps_{c}", f"aggregate decode tok/s, {c} sessions") for c in CONCURRENCY]
                    + [("aggregate_4_over_1", "aggregate 4 / 1 session")], "decode groups 1")
        report["overlap"] = {"results": otab}

    def med(name: str, key: str, where: dict = tab) -> float:
        return where[name][key]["median"]

    targets = report["targets"]
    if "llama-cpp-python" in tab:
        targets["single decode / llama-cpp-python >= 0.95"] = med("single", "decode_tps") / med(
            "llama-cpp-python", "decode_tps")
        targets["single prefill / llama-cpp-python >= 0.95"] = med("single", "prefill_tps_500") / med(
            "llama-cpp-python", "prefill_tps_500")
    targets["2-stage decode / single >= 0.92"] = med("2-stage", "decode_tps") / med("single", "decode_tps")
    targets["  the same, generations interleaved (per round)"] = med("2-stage", "decode_over_single_interleaved")
    targets["2-stage TTFT / single <= 1.10"] = med("2-stage", "ttft_ms_500") / med("single", "ttft_ms_500")
    targets[f"max Python ms (wall) per step per stage <= {PY_BUDGET_MS}"] = max(
        med(n, "python_ms_per_step_max") for n in ("single", "2-stage", "3-stage"))
    targets[f"max Python ms (CPU) per step per stage <= {PY_BUDGET_MS}"] = max(
        med(n, "python_cpu_ms_per_step_max") for n in ("single", "2-stage", "3-stage"))
    # the head's window holds its waits for replies (the wake-up, reading the reply) which a later stage's
    # does not: less those, every stage's handling is measured from the message in hand
    targets[f"  the same, less the head's waits <= {PY_BUDGET_MS}"] = max(
        med(n, "handling_cpu_ms_per_step_max") for n in ("single", "2-stage", "3-stage"))
    targets[f"  the same, stages after the head <= {PY_BUDGET_MS}"] = max(
        med(n, f"python_cpu_ms_per_step_stage{k}") for n, k in (("2-stage", 1), ("3-stage", 1), ("3-stage", 2)))
    targets[f"max event loop CPU ms per step per stage <= {PY_BUDGET_MS}"] = max(
        med(n, "loop_cpu_ms_per_step_max") for n in ("single", "2-stage", "3-stage"))
    targets["2-stage aggregate 4 sessions / 1 >= 1.8"] = med("2-stage", "aggregate_4_over_1")
    if "aggregate_4_over_1" in tab.get("llama-cpp-python", {}):
        # what batching gives plain llama.cpp here, no pipeline: the stages on one host take turns at the cores,
        # so this bounds the ratio above
        targets["  ceiling: llama-cpp-python batched, 4 seqs / 1"] = med("llama-cpp-python", "aggregate_4_over_1")
    if overlap:
        targets["  2 stages on their own cores, decode groups 2"] = med("decode groups 2", "aggregate_4_over_1", otab)
    if delayed:
        for name in delayed:
            # each round against its own bound (its own compute), then the median
            label = f"{name} with delay: ms/token - bound" + (" <= 0" if "warm" not in name else "")
            targets[label] = med(name, "excess_ms", dtab) - LOOP_SLACK_MS
        for n in (2, 3):  # what keeping the cores warm gives the user: time per token, same run
            if f"{n}-stage kept warm" in delayed:
                targets[f"  {n}-stage with delay, kept warm / not: ms/token"] = (
                    med(f"{n}-stage kept warm", "ms_per_token", dtab) / med(f"{n}-stage", "ms_per_token", dtab))
    print("\ntargets, same-run medians:")
    for label, value in targets.items():
        print(f"  {label:52} {value:.3f}{verdict(label, value)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in a fresh clone
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
