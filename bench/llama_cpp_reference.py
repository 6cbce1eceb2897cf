"""Plain llama.cpp through llama-cpp-python: the figures skippyd is compared with.

    .venv/bin/python bench/llama_cpp_reference.py MODEL --threads 2 --long-prompt-file F [--json]

Run by bench/bench_pipeline.py in its own process (so the two never share a
process), with the same model, threads, prompts and token counts as the
skippyd measurements: decode tokens/s of one session (64 tokens after the
first; the median of --repeats runs), time to first token and prefill
tokens/s of a ~500-token prompt, and decode tokens/s after it (32 tokens
after the first).
Greedy, through ``Llama.generate``, the loop its completion API runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def first_and_rest(llm, tokens: list[int], n: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds for the next n-1, tokens produced) from a cold cache."""
    llm.reset()  # no prefix reuse: every run prefills the whole prompt, as skippyd does
    started = time.perf_counter()
    first_at = None
    produced = 0
    for _ in llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        produced += 1
        if first_at is None:
            first_at = time.perf_counter()
        if produced >= n:
            break
    return first_at - started, time.perf_counter() - first_at, produced


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--decode-prompt", required=True)
    ap.add_argument("--long-prompt-file", required=True)
    ap.add_argument("--decode-tokens", type=int, default=65)
    ap.add_argument("--repeats", type=int, default=3, help="decode runs; their median is reported")
    ap.add_argument("--long-decode-tokens", type=int, default=33, help="tokens after the long prompt")
    args = ap.parse_args()

    import llama_cpp

    llm = llama_cpp.Llama(args.model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=args.ctx,
                          n_batch=512, n_ubatch=512, verbose=False)
    # raw prompts (no chat template) on both sides, tokenized the same way
    decode_tokens = llm.tokenize(args.decode_prompt.encode(), add_bos=True, special=False)
    long_text = open(args.long_prompt_file, encoding="utf-8").read()
    long_tokens = llm.tokenize(long_text.encode(), add_bos=True, special=False)
    first_and_rest(llm, decode_tokens, 8)  # warm-up
    rates = []
    for _ in range(args.repeats):
        _, rest_s, produced = first_and_rest(llm, decode_tokens, args.decode_tokens)
        rates.append((produced - 1) / rest_s if produced > 1 else 0.0)
    ttft_s, long_rest_s, long_produced = first_and_rest(llm, long_tokens, args.long_decode_tokens)
    out = {
        "version": llama_cpp.__version__,
        "decode_tps": statistics.median(rates),
        "ttft_ms_500": ttft_s * 1e3,
        "prefill_tps_500": len(long_tokens) / ttft_s,
        "decode_tps_500": (long_produced - 1) / long_rest_s if long_produced > 1 else 0.0,
        "prompt_tokens": len(long_tokens),
        "decode_tokens": produced,
    }
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
