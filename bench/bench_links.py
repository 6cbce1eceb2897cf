"""Links between stages: activations as f16 against f32, prefill on cores of their own, a ~1B model's decode.

    .venv/bin/python bench/bench_links.py [--sections wire,slow-link,prefill,1b] [--rounds 3]
        [--prompt-tokens 2000] [--rate 1mbit] [--json out.json]

Every figure is a median over ``--rounds`` rounds whose configurations run interleaved (a shared machine
drifts), and every ratio is of two figures of the same run. Each skippyd runs with its defaults except
those named below (and, as in every bench on tests/procs.py, the prefix cache and speculation off, so that
each prompt is computed whole and each token is one step).

Sections:

* ``wire``: a 2-stage pipeline of the default model on loopback, twice: ``runtime.activation_wire`` "f32"
  and "f16". Per configuration: the bytes the stages sent per token of a generation (its
  ``stage_stats.bytes_sent`` over its prompt and decoded rows), time to first token of a
  ``--prompt-tokens`` prompt and decode ms/token after it. Targets: f16 bytes 0.5x; time to first token
  and decode not slower (ratio <= 1.03, the noise of a shared machine).
* ``slow-link``: the same two with each stage in a network namespace of its own (tests/netns.py), the veth
  pair between them shaped by ``tc qdisc ... tbf rate --rate`` (1mbit) on both ends. Targets: time to
  first token f16 <= 0.6x f32; decode ms/token lower by about the transfer saved (2 bytes a value of a row
  at the link's rate), printed beside it.
* ``prefill``: time to first token of the long prompt (one token out) on one stage confined to one core
  (``taskset -c 0``, ``--threads 1``) against 2 stages confined to a core each (``taskset -c 0`` and
  ``-c 1``, one thread each, no compute lock): the stages of separate machines. Target <= 0.6x (ideal
  0.5). Beside it, the cores the daemons kept busy on average (their CPU time over the wall time): near 2
  with a ratio far from 0.5 means the two cores are slower when both compute (not the stages' alone).
* ``1b``: decode tokens/s of one session, 2 stages (loopback, defaults: the stages take turns at the
  cores) against a single stage, on the default model and on bench/bench_model.py's ~1B model (written
  once into the cache). Target >= 0.97x on the ~1B model.

Needs root, ``ip`` and ``tc`` for ``slow-link`` (skipped otherwise, with the reason), and 2 cores for
``prefill``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippyd.runtime.models import fetch_default_model  # noqa: E402
from skippyd.topology import Topology  # noqa: E402
from tests import netns  # noqa: E402
from tests.procs import Pipeline, SingleStage, retarget, split_for_test  # noqa: E402
from tests.test_network_faults import NetPipeline  # noqa: E402

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil and a "
             "cloth for the great lens. Ships passing the rocky headland depended on the beam to find the channel "
             "between the reefs, and in winter storms the light was the only thing a sailor could trust. ")
DECODE_TOKENS = 33  # after the long prompt: its first token, then 32 decode steps
COMMON = ["--lanes", "2"]
SECTIONS = ("wire", "slow-link", "prefill", "1b")


async def _generate(pipe: Pipeline, prompt: str, max_tokens: int) -> dict:
    return await pipe.generate(prompt=prompt, raw=True, max_tokens=max_tokens)


def generate(pipe: Pipeline, prompt: str, max_tokens: int) -> dict:
    result = trio.run(_generate, pipe, prompt, max_tokens)
    if result.get("error"):
        raise RuntimeError(f"generation failed: {result['error']}")
    return result


def long_prompt(pipe: Pipeline, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens (measured on ``pipe``)."""
    per = generate(pipe, PARAGRAPH, 1)["usage"]["prompt_tokens"]
    return PARAGRAPH * max(1, round(tokens / per))


def one_run(pipe: Pipeline, prompt: str) -> dict:
    r = generate(pipe, prompt, DECODE_TOKENS)
    usage, timings = r["usage"], r["timings"]
    rows = usage["prompt_tokens"] + usage["completion_tokens"] - 1  # each crossed every link once
    rate = timings["decode_tokens_per_s"]
    return {"ttft_ms": timings["ttft_ms"], "decode_ms": 1e3 / rate if rate else None,
            "bytes_per_token": r["stage_stats"]["bytes_sent"] / rows, "prompt_tokens": usage["prompt_tokens"]}


def cpu_s(pipe: Pipeline) -> float:
    """CPU time (user and system) the pipeline's daemon processes have had so far."""
    total = 0
    for d in {id(d): d for d in pipe.stages.values()}.values():
        fields = Path(f"/proc/{d.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


def prefill_run(pipe: Pipeline, prompt: str) -> dict:
    """The prompt alone (one token out): time to first token, and the cores the pipeline's processes had
    on average meanwhile (their CPU time over the wall time: near 1 for one stage; near 2 for two stages
    that compute at once on cores of their own). Two stages near 2 whose time is far from half a single
    stage's share their cores' speed with something else (another VM on the sibling hyperthreads)."""
    before, started = cpu_s(pipe), time.perf_counter()
    r = generate(pipe, prompt, 1)
    wall = time.perf_counter() - started
    return {"ttft_ms": r["timings"]["ttft_ms"], "cores_busy": (cpu_s(pipe) - before) / wall}


def rounds(configs: dict[str, Pipeline], prompt: str, n: int, measure=one_run) -> dict[str, list[dict]]:
    for pipe in configs.values():  # warm-up: a daemon's first generation pays one-off costs
        generate(pipe, "Hello", 4)
    out: dict[str, list[dict]] = {name: [] for name in configs}
    names = list(configs)
    for rnd in range(n):
        for name in names if rnd % 2 == 0 else names[::-1]:
            out[name].append(measure(configs[name], prompt))
        print(f"  round {rnd + 1}/{n}: " + ", ".join(f"{k} {json.dumps(v[-1])}" for k, v in out.items()),
              file=sys.stderr, flush=True)
    return out


def med(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def report(title: str, runs: dict[str, list[dict]], base: str, keys: tuple[str, ...]) -> dict:
    print(f"\n{title}")
    out = {}
    for key in keys:
        ref = med(runs[base], key)
        cells = []
        for name in runs:
            value = med(runs[name], key)
            out.setdefault(name, {})[key] = value
            cells.append(f"{name} {value:.1f}" + ("" if name == base else f" ({value / ref:.2f}x)"))
        print(f"  {key:>16}: " + ", ".join(cells))
    return out


def verdict(label: str, value: float, bound: float, *, at_most: bool) -> str:
    met = value <= bound if at_most else value >= bound
    line = f"  {label}: {value:.2f}x ({'<=' if at_most else '>='} {bound:g}: {'met' if met else 'NOT met'})"
    print(line)
    return line


# ---------------------------------------------------------------- sections
def wire_configs(split: Path, work: Path, make) -> dict[str, Pipeline]:
    """f32 and f16 pipelines of `split`: ``make(topology, workdir, config)`` builds each."""
    configs = {}
    for wire in ("f32", "f16"):
        where = work / f"wire-{wire}"
        where.mkdir(parents=True)
        configs[wire] = make(split, where, {"runtime.activation_wire": wire})
    return configs


def run_wire_rounds(configs: dict, args, probe: str = "f32") -> list:
    """Start both pipelines, time the long prompt (its length measured on `probe`) on each in interleaved
    rounds, stop them."""
    try:
        for pipe in configs.values():
            pipe.start()
        return rounds(configs, long_prompt(configs[probe], args.prompt_tokens), args.rounds)
    finally:
        for pipe in configs.values():
            pipe.stop()


def section_wire(split: Path, work: Path, args) -> dict:
    configs = wire_configs(split, work, lambda split, where, config: Pipeline(retarget(split, where), where,
                                                                              extra=COMMON, config=config))
    runs = run_wire_rounds(configs, args)
    table = report("activations on loopback, 2 stages (f16 against f32)", runs, "f32",
                   ("bytes_per_token", "ttft_ms", "decode_ms"))
    lines = [verdict("bytes per token f16/f32", table["f16"]["bytes_per_token"] / table["f32"]["bytes_per_token"],
                     0.55, at_most=True),
             verdict("time to first token f16/f32 (not slower)", table["f16"]["ttft_ms"] / table["f32"]["ttft_ms"],
                     1.03, at_most=True),
             verdict("decode ms/token f16/f32 (not slower)", table["f16"]["decode_ms"] / table["f32"]["decode_ms"],
                     1.03, at_most=True)]
    return {"runs": runs, "table": table, "verdicts": lines}


def tc_unavailable() -> str | None:
    return netns.unavailable() or (None if shutil.which("tc") else "no `tc` command (Debian package iproute2)")


def section_slow_link(split: Path, work: Path, args) -> dict:
    if why := tc_unavailable():
        print(f"\nslow-link: skipped: {why}")
        return {"skipped": why}
    net = netns.Network(2)
    try:
        for host in net.hosts:
            # a bucket of one packet: a decode step's frame (two packets as f32, one as f16) waits for the
            # rate, as on a link that is busy, rather than passing in a burst
            host.run("tc", "qdisc", "add", "dev", host.data_dev, "root", "tbf", "rate", args.rate,
                     "burst", "1600", "latency", "400ms")
        ports = iter((7461, 7462))  # each namespace has ports of its own: one a pipeline

        def make(split: Path, where: Path, config: dict) -> Pipeline:
            topo = Topology.load(split)
            port = next(ports)
            stages = [attrs.evolve(s, host=h.address, port=port) for s, h in zip(topo.stages, net.hosts)]
            attrs.evolve(topo, stages=stages).dump(where / "topology.toml")
            # a prompt's chunks queue behind each other on the slow link: time for each frame and reply
            config = {**config, "stage.frame_timeout": 120.0, "runtime.reply_timeout": 300.0}
            return NetPipeline(where / "topology.toml", where, net, port=port, lanes=2, extra=COMMON, config=config)

        configs = wire_configs(split, work, make)
        runs = run_wire_rounds(configs, args, probe="f16")  # the faster of the two over the slow link
    finally:
        net.close()
    table = report(f"activations over a {args.rate} link (tbf), 2 stages in namespaces (f16 against f32)", runs,
                   "f32", ("bytes_per_token", "ttft_ms", "decode_ms"))
    n_embd = Topology.load(split).n_embd
    saved_ms = 2 * n_embd * 8 / _rate_bits(args.rate) * 1e3
    print(f"  decode: f32 - f16 = {table['f32']['decode_ms'] - table['f16']['decode_ms']:.1f} ms/token; "
          f"transfer saved at the link's rate: {saved_ms:.1f} ms/token")
    lines = [verdict("time to first token f16/f32", table["f16"]["ttft_ms"] / table["f32"]["ttft_ms"], 0.6,
                     at_most=True),
             verdict("decode ms/token f16/f32", table["f16"]["decode_ms"] / table["f32"]["decode_ms"], 1.0,
                     at_most=True)]
    return {"runs": runs, "table": table, "verdicts": lines, "transfer_saved_ms": saved_ms}


def _rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"--rate: a tc rate such as 1mbit, got {rate!r}")


def section_prefill(model: Path, split: Path, work: Path, args) -> dict:
    if (os.cpu_count() or 1) < 2:
        print("\nprefill: skipped: needs 2 cores")
        return {"skipped": "one core"}
    one = ["--threads", "1"]
    config = {"runtime.compute_lock": "off"}
    (work / "single").mkdir()
    (work / "own-cores").mkdir()
    configs: dict[str, Pipeline] = {}
    try:
        configs["single, 1 core"] = SingleStage(model, work / "single", [*COMMON, *one], config,
                                                prefix=["taskset", "-c", "0"])
        pipe = Pipeline(retarget(split, work / "own-cores"), work / "own-cores", extra=[*COMMON, *one],
                        config=config, prefixes={0: ["taskset", "-c", "0"], 1: ["taskset", "-c", "1"]})
        configs["2 stages, a core each"] = pipe.start()
        prompt = long_prompt(configs["single, 1 core"], args.prompt_tokens)
        runs = rounds(configs, prompt, args.rounds, measure=prefill_run)
    finally:
        for pipe in configs.values():
            pipe.stop()
    table = report("prefill on cores of their own (taskset, one thread a stage)", runs, "single, 1 core",
                   ("ttft_ms", "cores_busy"))
    ratio = table["2 stages, a core each"]["ttft_ms"] / table["single, 1 core"]["ttft_ms"]
    return {"runs": runs, "table": table, "verdicts": [verdict("time to first token 2 stages/single", ratio, 0.6,
                                                               at_most=True)]}


def decode_run(pipe: Pipeline, prompt: str) -> dict:
    r = generate(pipe, prompt, 65)
    rate = r["timings"]["decode_tokens_per_s"]
    return {"decode_tok_s": rate, "decode_ms": 1e3 / rate if rate else None}


def section_1b(model: Path, work: Path, args) -> dict:
    big = Path(subprocess.run([sys.executable, str(ROOT / "bench" / "bench_model.py")], check=True,
                              capture_output=True, text=True).stdout.strip())
    out = {}
    for name, path in (("default model", model), ("~1B model", big)):
        where = work / name.replace(" ", "-").replace("~", "")
        where.mkdir()
        split_for_test(path, 2, where)
        configs: dict[str, Pipeline] = {}
        try:
            configs["single"] = SingleStage(path, where, COMMON)
            configs["2-stage"] = Pipeline(where / "topology.toml", where, extra=COMMON).start()
            runs = rounds(configs, "Write a long story about a dragon who learns to sail.", args.rounds,
                          measure=decode_run)
        finally:
            for pipe in configs.values():
                pipe.stop()
        table = report(f"decode, one session: 2 stages against a single stage ({name})", runs, "single",
                       ("decode_tok_s", "decode_ms"))
        ratio = table["2-stage"]["decode_tok_s"] / table["single"]["decode_tok_s"]
        out[name] = {"runs": runs, "table": table,
                     "verdicts": [verdict(f"2-stage/single decode ({name})", ratio, 0.97, at_most=False)]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=2000, help="the long prompt's tokens (about)")
    ap.add_argument("--rate", default="1mbit", help="the slow link's rate (a tc rate)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := set(sections) - set(SECTIONS):
        ap.error(f"unknown sections: {', '.join(sorted(unknown))}")
    model = fetch_default_model()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="skippy-links-") as tmp:
        work = Path(tmp)
        split = work / "split"
        split.mkdir()
        split_for_test(model, 2, split)
        split_toml = split / "topology.toml"
        for section in sections:
            where = work / section
            where.mkdir()
            print(f"[{section}]", file=sys.stderr, flush=True)
            if section == "wire":
                results[section] = section_wire(split_toml, where, args)
            elif section == "slow-link":
                results[section] = section_slow_link(split_toml, where, args)
            elif section == "prefill":
                results[section] = section_prefill(model, split_toml, where, args)
            else:
                results[section] = section_1b(model, where, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
