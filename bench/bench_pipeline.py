"""skippyd as separate processes on loopback vs. single-stage skippyd, measured in the same run.

    .venv/bin/python bench/bench_pipeline.py [--rounds 3] [--json out.json]

For each configuration (single-stage `skippyd --model`, a 2-process and a
3-process pipeline, each with its default thread budget, plus a 2-process
pipeline forced to 2 threads per stage) and each round, in interleaved order:

* decode tokens/s of one session (64 tokens),
* time to first token of a ~500-token prompt,
* aggregate decode tokens/s of 1, 2, 4 and 8 concurrent sessions
  (completion tokens of all sessions / wall time from first request to last result),
* compute and non-compute time per decode step from the stages' own stats.

Medians, spread (min-max) and ratios to single-stage are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippyctl.client import open_control  # noqa: E402
from skippyd.control import messages as m  # noqa: E402
from skippyd.runtime.models import fetch_default_model  # noqa: E402
from tests.procs import Daemon, Pipeline, split_for_test  # noqa: E402

LONG = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil and a "
        "cloth for the great lens. Ships passing the rocky headland depended on the beam to find the channel "
        "between the reefs, and in winter storms the light was the only thing a sailor could trust. ")
DECODE_PROMPT = "Write a long story about a dragon who learns to sail."
CONCURRENCY = (1, 2, 4, 8)


class Single(Pipeline):
    def __init__(self, model: Path, workdir: Path, extra: list[str]):
        self.workdir = workdir
        self.stages = {0: Daemon(["--model", str(model), *extra], workdir, "single")}
        self.stages[0].wait_ready()


async def generate(client, **kw) -> dict:
    return await client.call(m.Generate(id=client.new_id(), stream=False, **kw))


async def measure(pipe: Pipeline, long_prompt: str) -> dict:
    head = pipe.head
    out: dict = {}
    async with open_control(head.url, head.token_file) as client:
        # the same prompt for 1 and for 65 tokens: the difference is 64 decode steps
        short = await generate(client, prompt=DECODE_PROMPT, max_tokens=1)
        r = await generate(client, prompt=DECODE_PROMPT, max_tokens=65)
        steps = max(1, len(r["tokens"]) - 1)
        out["decode_tps"] = r["timings"]["decode_tokens_per_s"]
        wall_ms = (r["timings"]["elapsed_ms"] - short["timings"]["elapsed_ms"]) / steps
        compute_ms = (r["stage_stats"]["compute_us"] - short["stage_stats"]["compute_us"]) / 1000.0 / steps
        out["compute_ms_per_token"] = compute_ms
        out["noncompute_ms_per_token"] = wall_ms - compute_ms
        r = await generate(client, prompt=long_prompt, raw=True, max_tokens=1)
        out["ttft_ms_500"] = r["timings"]["ttft_ms"]
        out["prompt_tokens"] = r["usage"]["prompt_tokens"]
    for conc in CONCURRENCY:
        tokens = 0

        async def one(i: int) -> None:
            nonlocal tokens
            async with open_control(head.url, head.token_file) as c:
                res = await generate(c, prompt=f"{DECODE_PROMPT} Chapter {i}.", max_tokens=32)
                tokens += len(res["tokens"])

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(conc):
                nursery.start_soon(one, i)
        out[f"aggregate_tps_{conc}"] = tokens / (time.perf_counter() - started)
    return out


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = fetch_default_model()
    common = ["--lanes", "8", "--ctx", "2048", "--prefill-chunk", "256"]
    cores = os.cpu_count() or 2
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        configs: dict[str, Pipeline] = {}
        threads: dict[str, str] = {}
        try:
            (tmp / "single").mkdir()
            configs["single"] = Single(model, tmp / "single", common)
            threads["single"] = f"{cores}"
            for n in (2, 3):
                work = tmp / f"split{n}"
                work.mkdir()
                split_for_test(model, n, work)
                configs[f"{n}-stage"] = Pipeline(work / "topology.toml", work, extra=common).start()
                threads[f"{n}-stage"] = f"{max(1, cores // n)} per stage"
            work = tmp / "split2t"
            work.mkdir()
            split_for_test(model, 2, work)
            configs["2-stage-2t"] = Pipeline(work / "topology.toml", work,
                                             extra=[*common, "--threads", str(cores)]).start()
            threads["2-stage-2t"] = f"{cores} per stage (oversubscribed)"
            long_prompt = LONG * 9
            results: dict[str, list[dict]] = {name: [] for name in configs}
            for name, pipe in configs.items():  # warm-up
                trio.run(measure, pipe, LONG)
            for rnd in range(args.rounds):
                for name, pipe in configs.items():
                    results[name].append(trio.run(measure, pipe, long_prompt))
                    print(f"round {rnd + 1}/{args.rounds} {name}: done", file=sys.stderr)
        finally:
            for pipe in configs.values():
                if pipe is not None:
                    pipe.stop()

    keys = list(results["single"][0])
    table = {name: {k: summarize([r[k] for r in runs]) for k in keys} for name, runs in results.items()}
    base = table["single"]
    ratios = {name: {k: t[k]["median"] / base[k]["median"] for k in keys if base[k]["median"]}
              for name, t in table.items()}
    report = {"model": model.name, "cores": cores, "threads": threads, "rounds": args.rounds, "results": table,
              "ratio_to_single": ratios}
    print(f"model {model.name}, {cores} cores, {args.rounds} interleaved rounds; medians (min-max), ratio to single")
    rows = [("decode_tps", "decode tok/s (1 session)"), ("ttft_ms_500", "TTFT ms (~500-token prompt)")]
    rows += [(f"aggregate_tps_{c}", f"aggregate tok/s, {c} sessions") for c in CONCURRENCY]
    rows += [("compute_ms_per_token", "compute ms / token"), ("noncompute_ms_per_token", "non-compute ms / token")]
    names = list(table)
    print(f"{'':32}" + "".join(f"{n:>26}" for n in names))
    print(f"{'threads':32}" + "".join(f"{threads[n]:>26}" for n in names))
    for key, label in rows:
        cells = []
        for n in names:
            s = table[n][key]
            cells.append(f"{s['median']:8.1f} ({s['min']:.1f}-{s['max']:.1f}) x{ratios[n].get(key, 0):.2f}")
        print(f"{label:32}" + "".join(f"{c:>26}" for c in cells))
    print(f"prompt tokens for TTFT: {results['single'][0]['prompt_tokens']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
