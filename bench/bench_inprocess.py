"""Unsplit model vs. a 2-stage split in one process: prefill and decode tokens/s.

    .venv/bin/python bench/bench_inprocess.py [--rounds 5] [--threads 2] [--json out.json]

The configurations run in interleaved rounds (A, B, A, B, …) because this
kind of machine drifts by ±10% over a minute; the table shows medians, the
spread (min–max) and the split/unsplit ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skippyd.runtime.llama import ContextParams
from skippyd.runtime.models import fetch_default_model
from skippyd.runtime.slicing import split_model
from tests.local_pipeline import LocalPipeline

LONG_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil and a "
    "cloth for the great lens. Ships passing the rocky headland depended on the beam to find the channel "
    "between the reefs, and in winter storms the light was the only thing a sailor could trust. "
)


def measure(pipe: LocalPipeline, prompt: np.ndarray, n_decode: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) for one fresh sequence."""
    for ctx in pipe.contexts:
        ctx.kv_clear_seq(0)
    t0 = time.perf_counter()
    pipe.prefill(prompt, chunk=512)
    t1 = time.perf_counter()
    token = pipe.last.sample({0: None})[0]
    pos = len(prompt)
    one = np.zeros(1, dtype=np.int32)
    t2 = time.perf_counter()
    for _ in range(n_decode):
        pipe.decode(np.array([token], dtype=np.int32), np.array([pos], dtype=np.int32), one)
        token = pipe.last.sample({0: None})[0]
        pos += 1
    t3 = time.perf_counter()
    return len(prompt) / (t1 - t0), n_decode / (t3 - t2)


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--thread-poll", type=int, default=0,
                    help="each context's ggml thread pool polls this long before sleeping, as skippyd's "
                         "runtime.thread_poll (default 0, skippyd's default); -1: llama.cpp's threads per graph")
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()

    model = fetch_default_model()
    params = ContextParams(n_ctx_per_seq=2048, n_seq_max=1, n_batch=512, n_ubatch=512, n_threads=args.threads,
                           threadpool_poll=None if args.thread_poll < 0 else args.thread_poll)
    with tempfile.TemporaryDirectory() as tmp:
        topo = split_model(model, None, tmp, stages=2)
        configs = {"unsplit": [model], "split-2": [s.file for s in topo.stages]}
        pipes = {name: LocalPipeline(paths, params) for name, paths in configs.items()}
        try:
            head = pipes["unsplit"].head
            ids = head.tokenize(LONG_TEXT * 12)[: args.prompt_tokens]
            for pipe in pipes.values():  # warm-up
                measure(pipe, ids[:64], 8)
            results = {name: {"prefill": [], "decode": []} for name in pipes}
            for _ in range(args.rounds):
                for name, pipe in pipes.items():
                    prefill, decode = measure(pipe, ids, args.decode_tokens)
                    results[name]["prefill"].append(prefill)
                    results[name]["decode"].append(decode)
        finally:
            for pipe in pipes.values():
                pipe.close()

    out = {
        "model": Path(model).name,
        "threads": args.threads,
        "prompt_tokens": int(len(ids)),
        "decode_tokens": args.decode_tokens,
        "rounds": args.rounds,
        "results": {n: {k: summarize(v) for k, v in r.items()} for n, r in results.items()},
    }
    base = out["results"]["unsplit"]
    split = out["results"]["split-2"]
    out["ratios"] = {k: split[k]["median"] / base[k]["median"] for k in ("prefill", "decode")}

    print(f"model {out['model']}, {args.threads} threads, prompt {out['prompt_tokens']} tokens, "
          f"decode {args.decode_tokens} tokens, {args.rounds} interleaved rounds")
    print(f"{'config':10} {'prefill tok/s (min-max)':>28} {'decode tok/s (min-max)':>28}")
    for name, r in out["results"].items():
        p, d = r["prefill"], r["decode"]
        print(f"{name:10} {p['median']:10.1f} ({p['min']:6.1f}-{p['max']:6.1f})     "
              f"{d['median']:10.1f} ({d['min']:6.1f}-{d['max']:6.1f})")
    print(f"split/unsplit: prefill {out['ratios']['prefill']:.3f}, decode {out['ratios']['decode']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
