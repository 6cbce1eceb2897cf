"""A/B of the hot path's CPU between two versions of the code: event-loop CPU per decode step on every stage,
the two versions' pipelines measured in interleaved rounds in the same run (a shared VM's noise drowns a
difference of 10% between runs minutes apart).

    .venv/bin/python bench/ab_trees.py --base HEAD~1 [--rounds 5] [--stages 2,3] [--link-delay-ms 10]
                                       [--streamed 4] [--model PATH] [--json out.json]

``--base`` is a git revision, checked out in a temporary worktree; the other side is this working tree
(with ``--this-args``' skippyd options and ``--this-config``' configuration keys too: ``--base HEAD
--this-config runtime.keep_warm_ms=100`` is an A/B of a setting).
Both run on this tree's native build (skippyd/_native): the comparison is of the Python. For each stage
count, a pipeline of each version (one skippyd per stage, loopback, the default model or ``--model``) stays up
for the whole run; each round measures every pipeline in turn (order reversed every other round) over two 96-token
generations, after one of the same as warm-up. Printed: medians (min-max) of the event loop's CPU per step
outside llama.cpp (``loop_cpu_s`` less ``loop_native_cpu_s`` of each stage's ``hot_path``), the handler's
CPU per step, native compute per step, the generations' decode time per token, and this tree's ratio to
the base. With ``--link-delay-ms`` every daemon delays what it sends by that much (link conditioning), and
each version's time per token beyond its compute and the one-way delays around the loop is printed too
(as the suite's WAN rows: 2 delays for 2 stages, one per stage from 3 on, with direct return). With
``--streamed N`` each round also measures N concurrent streamed generations (the suite's aggregate decode
tok/s: the pieces that arrive while all N decode, over that window). ``--stages 1`` is a single skippyd.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tests.procs as procs  # noqa: E402
from bench.bench_pipeline import concurrent_decode, hot_paths, per_step, stage_status  # noqa: E402
from skippyctl.client import open_control  # noqa: E402
from skippyd.control import messages as m  # noqa: E402
from skippyd.runtime.models import fetch_default_model  # noqa: E402

PROMPT = "Write a long story about a dragon who learns to sail."
TOKENS = 96


async def generate(client, **kw) -> dict:
    """A raw generation, its request holding only the fields given: a base older than this tree's messages
    refuses the keys it does not know."""
    request = {"type": "generate", "id": client.new_id(), "stream": False, "raw": True, **kw}
    await client.ws.send_message(json.dumps(request))
    reply = m.parse_reply(await client.ws.get_message())
    if isinstance(reply, m.Error):
        raise RuntimeError(reply.message)
    return reply.result if isinstance(reply, m.Result) else reply.data


async def measure(pipe: procs.Pipeline, streamed: int = 0) -> dict[str, list[float]]:
    head = pipe.head
    async with open_control(head.url, head.token_file) as client:
        await generate(client, prompt=PROMPT, max_tokens=TOKENS)  # warm-up
        before = await hot_paths(pipe)
        rates = [(await generate(client, prompt=PROMPT, max_tokens=TOKENS))["timings"]["decode_tokens_per_s"]
                 for _ in range(2)]
        _py, cpu, _handling, loop, native = per_step(before, await hot_paths(pipe))
    threads = await stage_status(pipe, "threads")  # the thread chooser's counts so far (each stage's, as all)
    out = {"loop_cpu_ms": loop, "handler_cpu_ms": cpu, "native_ms": native,
           "ms_per_token": [1e3 / statistics.median(rates)],
           "thread_trials": [t["trials"] for t in threads], "thread_switches": [t["switches"] for t in threads]}
    if streamed:
        out["streamed_tok_s"] = [(await concurrent_decode(head, streamed))[0]]
    return out


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.2f}-{max(values):.2f})"


def _keys(pairs: list[str]) -> dict:
    """["runtime.decode_groups=2", ...] → {"runtime.decode_groups": 2}: each value as TOML, else a string."""
    out = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        try:
            out[key] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = text
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision to compare this working tree with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stages", default="2,3", help="comma-separated stage counts")
    ap.add_argument("--link-delay-ms", type=float, default=0.0, help="one-way delay on every link (0: none)")
    ap.add_argument("--streamed", type=int, default=0, help="also N concurrent streamed generations per round")
    ap.add_argument("--model", type=Path, default=None,
                    help="GGUF to measure (default: the embedded default model), as bench_pipeline.py's")
    ap.add_argument("--daemon-args", default="", metavar="ARGS",
                    help='more skippyd options for both sides, one string (e.g. "--threads 1 --lanes 2")')
    ap.add_argument("--this-args", default="", metavar="ARGS",
                    help="skippyd options for this tree's side only: with --base HEAD, an A/B of an option")
    ap.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", dest="daemon_config",
                    help="a skippyd.toml key for both sides (e.g. runtime.decode_groups=2); repeatable")
    ap.add_argument("--this-config", action="append", default=[], metavar="KEY=VALUE",
                    help="a skippyd.toml key for this tree's side only (e.g. runtime.keep_warm_ms=100)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    extra = ["--lanes", str(max(2, args.streamed)), "--ctx", "1024", *shlex.split(args.daemon_args)]
    config = _keys(args.daemon_config)
    if args.link_delay_ms > 0:
        config["stage.link_delay_ms"] = args.link_delay_ms
    stage_counts = [int(n) for n in args.stages.split(",")]
    model = args.model or fetch_default_model()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = tmp / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base), args.base], check=True)
        trees = {"base": base, "this": ROOT}
        pipes: dict[tuple[str, int], procs.Pipeline] = {}
        results: dict[tuple[str, int], list[dict]] = {}
        try:
            for n in stage_counts:
                for name, tree in trees.items():
                    work = tmp / f"{name}-{n}"
                    work.mkdir()
                    procs.split_for_test(model, n, work)
                    procs.REPO = tree  # the daemons run `python -m skippyd.daemon` from this tree
                    own = shlex.split(args.this_args) if name == "this" else []
                    own_config = _keys(args.this_config) if name == "this" else {}
                    pipes[(name, n)] = procs.Pipeline(work / "topology.toml", work, extra=extra + own,
                                                      config={**config, **own_config}).start()
                    results[(name, n)] = []
            for r in range(args.rounds):
                order = list(pipes) if r % 2 == 0 else list(reversed(list(pipes)))
                for key in order:
                    results[key].append(trio.run(measure, pipes[key], args.streamed))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            for pipe in pipes.values():
                pipe.stop()
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    out = {}
    for n in stage_counts:
        print(f"{n} stages, per decode step, median (min-max) over {args.rounds} rounds; base {args.base}")
        medians = {}
        for name in trees:
            rows = results[(name, n)]
            per_stage = {field: [[row[field][k] for row in rows] for k in range(len(rows[0][field]))]
                         for field in rows[0]}
            medians[name] = [statistics.median(v) for v in per_stage["loop_cpu_ms"]]
            out[f"{name}_{n}"] = per_stage
            print(f"  {name:5} event loop CPU ms " + " / ".join(fmt(v) for v in per_stage["loop_cpu_ms"]))
            print(f"  {'':5} handler CPU ms    " + " / ".join(fmt(v) for v in per_stage["handler_cpu_ms"]))
            print(f"  {'':5} native ms         " + " / ".join(fmt(v) for v in per_stage["native_ms"]))
            print(f"  {'':5} ms per token      " + fmt(per_stage["ms_per_token"][0]))
            print(f"  {'':5} thread trials / switches over the run  "
                  + " / ".join(f"{t} {s}" for t, s in zip(rows[-1]["thread_trials"], rows[-1]["thread_switches"])))
            if args.streamed:
                print(f"  {'':5} {args.streamed} streamed, tok/s " + fmt(per_stage["streamed_tok_s"][0]))
            if args.link_delay_ms > 0:
                delays = args.link_delay_ms * max(n, 2)
                beyond = [ms - sum(row["native_ms"]) - delays
                          for ms, row in zip(per_stage["ms_per_token"][0], rows)]
                print(f"  {'':5} beyond compute + {delays:g} ms of delays: " + fmt(beyond))
        print("  this / base (event loop CPU)  " + " / ".join(f"{t / b:.2f}" for t, b in zip(medians["this"],
                                                                                             medians["base"])))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
