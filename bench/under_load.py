"""Decode speed while other programs keep the cores busy: a single-stage skippyd (or a 2-stage pipeline on
loopback, --stages 2) with 2 threads per stage and adapt_threads on (the default), the same with it off,
and one with 1 thread.

    .venv/bin/python bench/under_load.py [--stages 1] [--hogs 0,1,2] [--rounds 3] [--tokens 64] [--json out.json]

ggml's threads meet at a barrier after every op; a busy program that takes a core from one of them holds
the others up, so a multi-threaded decode slows down far more than a single thread that shares its core
(skippyd/stage/threads.py). Each round runs, for every number of hogs (busy-looping processes, started
before and killed after the round's generations), one greedy generation of --tokens tokens on each
configuration in turn (order reversed every other round). Printed: decode tokens/s, median (min-max) over the
rounds, and each configuration's ratio to "2 threads, adapt off" with the same hogs.

Then, each round, the load going away while no session decodes: under --hogs' highest number of hogs every
configuration generates a few tokens (the adaptive one moves to fewer threads), the hogs stop, and after a
pause of RECHECK_S + 1 s each computes a ~500-token prompt: its time to first token (the prefill). The
adaptive stage should be on all its threads again for it (the reference's x1.00), not on the count the load
left it on (the "1 thread" row's).

Last, each round, a load that begins while no session decodes: --hogs' highest number of hogs start, a pause
of ONSET_PAUSE_S, then each configuration computes a ~500-token prompt and --tokens tokens under the load: its
time to first token and decode tokens/s. The thread count is judged by decode steps only, so the adaptive stage
computes the prompt on all its threads (the "adapt off" row's time to first token); its first decode steps
under the load should move it to fewer (decode tokens/s near the "1 thread" row's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_pipeline import LONG_PROMPT  # noqa: E402
from skippyd.runtime.models import fetch_default_model  # noqa: E402
from skippyd.stage.threads import RECHECK_S  # noqa: E402
from tests.procs import Pipeline, SingleStage, split_for_test  # noqa: E402

PROMPT = "Write a long story about a dragon who learns to sail."
CONFIGS = {  # name: (flags, configuration keys)
    "2 threads, adapt on": (["--threads", "2"], {}),
    "2 threads, adapt off": (["--threads", "2"], {"runtime.adapt_threads": "off"}),
    "1 thread": (["--threads", "1"], {}),
}
REFERENCE = "2 threads, adapt off"


def hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def start(work: Path, stages: int) -> dict[str, Pipeline]:
    model = fetch_default_model()
    common = ["--lanes", "1", "--ctx", "1024"]
    out: dict[str, Pipeline] = {}
    try:
        for i, (name, (flags, config)) in enumerate(CONFIGS.items()):
            where = work / f"d{i}"
            if stages == 1:
                out[name] = SingleStage(model, where, [*flags, *common], config)
            else:
                split_for_test(model, stages, where)
                out[name] = Pipeline(where / "topology.toml", where, extra=[*flags, *common], config=config).start()
    except BaseException:
        for pipe in out.values():
            pipe.stop()
        raise
    return out


AFTER = "after"  # results' key of the prefill after the load
ONSET, ONSET_TTFT = "onset", "onset ttft"  # ... of decode and the prefill under a load that began while idle
ONSET_PAUSE_S = 0.5  # the hogs are running before the prompt arrives


async def measure(args, daemons: dict[str, Pipeline]) -> dict[int | str, dict[str, list[float]]]:
    levels = [int(h) for h in args.hogs.split(",")]
    results: dict[int | str, dict[str, list[float]]] = {h: {name: [] for name in CONFIGS} for h in levels}
    for key in (AFTER, ONSET_TTFT, ONSET):
        results[key] = {name: [] for name in CONFIGS}
    for pipe in daemons.values():  # warm-up, and the adaptive chooser's unloaded baseline
        await pipe.generate(prompt=PROMPT, raw=True, max_tokens=32)
    for r in range(args.rounds):
        for h in levels:
            order = list(daemons.items())
            if r % 2:
                order.reverse()
            running = hogs(h)
            try:
                await trio.sleep(0.5)
                for name, pipe in order:
                    got = await pipe.generate(prompt=PROMPT, raw=True, max_tokens=args.tokens)
                    results[h][name].append(got["timings"]["decode_tokens_per_s"])
            finally:
                stop(running)
        if max(levels):
            await prefill_after_load(daemons, max(levels), results[AFTER])
            await load_begun_while_idle(daemons, max(levels), args.tokens, results[ONSET], results[ONSET_TTFT])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    return results


def stop(running: list[subprocess.Popen]) -> None:
    for p in running:
        p.kill()
        p.wait()


async def prefill_after_load(daemons: dict[str, Pipeline], n_hogs: int, ttft_ms: dict[str, list[float]]) -> None:
    """A short generation on each configuration under `n_hogs` hogs, the hogs gone, a pause, then each one's
    time to first token for a ~500-token prompt."""
    running = hogs(n_hogs)
    try:
        await trio.sleep(0.5)
        for pipe in daemons.values():
            await pipe.generate(prompt=PROMPT, raw=True, max_tokens=32)
    finally:
        stop(running)
    await trio.sleep(RECHECK_S + 1)
    for name, pipe in daemons.items():  # one after the other: each one's pause is longer than RECHECK_S
        got = await pipe.generate(prompt=LONG_PROMPT, raw=True, max_tokens=1)
        ttft_ms[name].append(got["timings"]["ttft_ms"])


async def load_begun_while_idle(daemons: dict[str, Pipeline], n_hogs: int, tokens: int,
                                 tps: dict[str, list[float]], ttft_ms: dict[str, list[float]]) -> None:
    """`n_hogs` hogs start while every configuration idles; after ONSET_PAUSE_S each one in turn computes a
    ~500-token prompt and `tokens` tokens under them."""
    running = hogs(n_hogs)
    try:
        await trio.sleep(ONSET_PAUSE_S)
        for name, pipe in daemons.items():
            got = await pipe.generate(prompt=LONG_PROMPT, raw=True, max_tokens=tokens)
            ttft_ms[name].append(got["timings"]["ttft_ms"])
            tps[name].append(got["timings"]["decode_tokens_per_s"])
    finally:
        stop(running)


def report(results: dict[int | str, dict[str, list[float]]], shape: str) -> None:
    print(f"decode tok/s, {shape}, median (min-max); ratio to 2 threads with adapt off, same hogs")
    for h, by_name in results.items():
        if h == AFTER:
            if by_name[REFERENCE]:
                print("  time to first token (ms) of a ~500-token prompt, after the load went away and a pause:")
        elif h == ONSET_TTFT:
            if by_name[REFERENCE]:
                print("  time to first token (ms) of a ~500-token prompt under a load that began while idle:")
        elif h == ONSET:
            if by_name[REFERENCE]:
                print("  decode tok/s after that prompt:")
        else:
            print(f"  {h} busy program(s):")
        ref = statistics.median(by_name[REFERENCE]) if by_name[REFERENCE] else 0.0
        for name, values in by_name.items():
            if values:
                med = statistics.median(values)
                print(f"    {name:22} {med:7.2f} ({min(values):.1f}-{max(values):.1f})  x{med / ref:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=1, choices=(1, 2, 3), help="1: skippyd --model; 2-3: a pipeline")
    ap.add_argument("--hogs", default="0,1,2", help="comma-separated numbers of busy programs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="skippy-load-") as tmp:
        work = Path(tmp)
        for i in range(len(CONFIGS)):
            (work / f"d{i}").mkdir()
        daemons = start(work, args.stages)
        try:
            results = trio.run(measure, args, daemons)
        finally:
            for pipe in daemons.values():
                pipe.stop()
    report(results, "single stage" if args.stages == 1 else f"{args.stages}-stage pipeline")
    if args.json:
        args.json.write_text(json.dumps({str(h): v for h, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
