"""Interpreted bytecode instructions per decode step on every stage: a deterministic measure of the hot
path's Python work, for comparing two versions of the code where CPU timings drown in the VM's noise.

    .venv/bin/python bench/opcodes.py [--stages 2] [--tokens 200] [--top 25] [--stream] [--json out.json]

Starts a pipeline of the default model (one skippyd per stage, loopback), generates once to warm up,
then counts what each daemon's main thread runs (trio's loop included) during one generation of
``--tokens`` tokens, through the ``sitecustomize`` in bench/opcount (sys.settrace with opcode events,
switched on and off by SIGUSR1 / SIGUSR2). The counts are per decode step: the generation's prefill,
configure and stop are spread over its steps, as they are in real use. Tracing slows the daemons down
many times, so the figures are instructions, never time. ``--stream``: the generation's text comes piece
by piece over the control channel (as ``skippyctl generate`` and OpenAI streams get it), which the head
pays for on every token.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippyctl.client import open_control  # noqa: E402
from skippyd.control import messages as m  # noqa: E402
from skippyd.runtime.models import fetch_default_model  # noqa: E402
from tests.procs import Pipeline, split_for_test  # noqa: E402

PROMPT = "Write a long story about a dragon who learns to sail."


async def streamed(pipe: Pipeline, **kw) -> dict:
    """A generation whose text comes piece by piece over the control channel, as skippyctl and the OpenAI
    endpoint's streams get it; its result."""
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        async for reply in client.replies(m.Generate(id=client.new_id(), stream=True, **kw)):
            if isinstance(reply, m.Result):
                return reply.result
            if not isinstance(reply, m.Piece):
                raise RuntimeError(f"generation failed: {reply}")
    raise RuntimeError("the stream ended without a result")


async def count(pipe: Pipeline, out_dir: Path, tokens: int, stream: bool = False) -> dict[int, dict]:
    await pipe.generate(prompt=PROMPT, raw=True, max_tokens=16)  # warm-up: lanes open, caches filled
    before = await pipe.stage_sessions()
    for daemon in pipe.stages.values():
        daemon.signal(signal.SIGUSR1)
    await trio.sleep(0.5)
    generate = functools.partial(streamed, pipe) if stream else pipe.generate
    result = await generate(prompt=PROMPT, raw=True, max_tokens=tokens)
    await trio.sleep(0.5)
    for daemon in pipe.stages.values():
        daemon.signal(signal.SIGUSR2)
    await trio.sleep(1.0)
    steps = len(result["tokens"]) - 1
    after = await pipe.stage_sessions()
    out = {}
    for k, daemon in pipe.stages.items():
        counts = json.loads((out_dir / f"ops-{daemon.proc.pid}.json").read_text())
        # a stage's own decode steps (its scheduler's), the head's: the generation's
        decoded = after[k]["scheduler"]["decode_jobs"] - before[k]["scheduler"]["decode_jobs"] or steps
        out[k] = {"steps": decoded, "per_step": sum(counts.values()) / decoded,
                  "functions": {name: n / decoded for name, n in sorted(counts.items(), key=lambda kv: -kv[1])}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--top", type=int, default=25, help="functions to list per stage")
    ap.add_argument("--stream", action="store_true", help="stream the generation's text (as skippyctl does)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = fetch_default_model()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        split_for_test(model, args.stages, work)
        env = {"SKIPPY_OPCOUNT_DIR": str(work),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "bench" / "opcount"),
                                                            os.environ.get("PYTHONPATH")]))}
        pipe = Pipeline(work / "topology.toml", work, extra=["--lanes", "2", "--ctx", "1024"], env=env).start()
        try:
            result = trio.run(count, pipe, work, args.tokens, args.stream)
        finally:
            pipe.stop()
    for k, r in result.items():
        print(f"stage {k}: {r['per_step']:.0f} instructions per decode step ({r['steps']} steps)")
        for name, n in list(r["functions"].items())[:args.top]:
            print(f"  {n:8.1f}  {name}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
