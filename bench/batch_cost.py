"""What a batch of k rows of one session costs against one row: the price of a verify window.

    .venv/bin/python bench/batch_cost.py [--threads 2] [--context 256] [--rounds 9] [--model FILE]

The whole default model in one context (libllama through skippy's runtime, as a single-stage skippyd
computes), a prompt of --context tokens, then k rows at the next positions, each time after trimming them
again: once with logits for the last row only (a prefill chunk), once with logits for every row (a verify
window, which the final stage samples row by row). Printed: the median ms of --rounds computes per k and
its ratio to one row. Speculative decoding pays when a window's tokens outnumber this ratio: a window of
k drafts yields 1 + a + ... + a^k tokens at acceptance a (skippyd/head/drafting.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skippyd.runtime.llama import Context, ContextParams, Model, backend_init
from skippyd.runtime.models import fetch_default_model

ROWS = (1, 2, 3, 5, 9, 17)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the rows (default 256)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded default model)")
    args = ap.parse_args()
    backend_init()
    model = Model(args.model or fetch_default_model())
    prompt = np.resize(model.tokenize("The quick brown fox jumps over the lazy dog. "), args.context).astype(np.int32)
    print(f"{Path(args.model or fetch_default_model()).name}, {args.threads} threads, {args.context} "
          f"tokens of context; median of {args.rounds}")
    print(f"{'rows':>5} {'last-row logits ms':>19} {'x one row':>10} {'every-row logits ms':>20} {'x one row':>10}")
    results = {}
    for windows in (False, True):
        ctx = Context(model, ContextParams(n_ctx_per_seq=args.context + 64, n_seq_max=1, n_threads=args.threads))
        try:
            ctx.decode(np.arange(args.context, dtype=np.int32), np.zeros(args.context, dtype=np.int32), tokens=prompt)
            pos = args.context
            for k in ROWS:
                times = []
                for _ in range(args.rounds):
                    ctx.kv_trim(0, pos)
                    began = time.perf_counter()
                    ctx.decode(np.arange(pos, pos + k, dtype=np.int32), np.zeros(k, dtype=np.int32),
                               tokens=prompt[:k], windows=(0,) if windows else ())
                    times.append(time.perf_counter() - began)
                results[(windows, k)] = statistics.median(times)
        finally:
            ctx.close()
    for k in ROWS:
        last, every = results[(False, k)], results[(True, k)]
        print(f"{k:>5} {last * 1e3:>19.2f} {last / results[(False, 1)]:>10.2f} {every * 1e3:>20.2f} "
              f"{every / results[(True, 1)]:>10.2f}")


if __name__ == "__main__":
    main()
