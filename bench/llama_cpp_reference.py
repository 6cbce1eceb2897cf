"""Plain llama.cpp through llama-cpp-python: the figures skippyd is compared with.

    .venv/bin/python bench/llama_cpp_reference.py MODEL --threads 2 --long-prompt-file F [--json]

Run by bench/bench_pipeline.py in its own process (so the two never share a
process), with the same model, threads, prompts and token counts as the
skippyd measurements: decode tokens/s of one session (64 tokens after the
first; the median of --repeats runs), time to first token and prefill
tokens/s of a ~500-token prompt, and decode tokens/s after it (32 tokens
after the first).
Greedy, through ``Llama.generate``, the loop its completion API runs.

With ``--batched-tokens N``, also llama.cpp's own batched decode: 1, 2, 4
and 8 sequences (the decode prompt with a different suffix each) decoding N
greedy steps together, one ``llama_decode`` per step, through the binding's
low-level API (its ``Llama`` class decodes one sequence); flash attention
off; the median of 3 interleaved rounds. Aggregate decode tokens/s for
each: what batching gives on this CPU with no pipeline at all,
the ceiling for skippy's aggregate figures on one host, where the stages take
turns at the cores.
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


BATCHED_SEQS = (1, 2, 4, 8)
BATCHED_ROUNDS = 3  # each k this many times, interleaved; the median


def batched_decode(llama_cpp, model_path: str, threads: int, ctx_per_seq: int, prompt: str, steps: int) -> dict:
    """Aggregate greedy decode tokens/s of k sequences stepping together, for each k in BATCHED_SEQS."""
    import ctypes

    import numpy as np

    lib = llama_cpp
    model = lib.llama_model_load_from_file(model_path.encode(), lib.llama_model_default_params())
    params = lib.llama_context_default_params()
    n_seq = max(BATCHED_SEQS)
    params.n_ctx, params.n_seq_max = ctx_per_seq * n_seq, n_seq
    params.n_batch = params.n_ubatch = 512
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = 0  # off, as in the rest of the suite (skippyd's default, Llama's default)
    ctx = lib.llama_init_from_model(model, params)
    batch = lib.llama_batch_init(512, 0, 1)
    try:
        vocab = lib.llama_model_get_vocab(model)
        n_vocab = lib.llama_vocab_n_tokens(vocab)
        memory = lib.llama_get_memory(ctx)

        def tokenize(text: str) -> list[int]:
            raw = text.encode()
            buf = (lib.llama_token * (len(raw) + 8))()
            n = lib.llama_tokenize(vocab, raw, len(raw), buf, len(buf), True, False)
            return list(buf[:n])

        def decode(rows: list[tuple[int, int, int]]) -> list[int]:
            """rows of (token, pos, seq); every row's logits; the greedy token of each."""
            for i, (token, pos, seq) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, True
                batch.seq_id[i][0] = seq
            batch.n_tokens = len(rows)
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            logits = (ctypes.c_float * n_vocab)
            return [int(np.argmax(np.frombuffer(logits.from_address(ctypes.addressof(
                lib.llama_get_logits_ith(ctx, i).contents)), dtype=np.float32))) for i in range(len(rows))]

        def run(k: int) -> float:
            lib.llama_memory_clear(memory, True)
            nexts, positions = [], []
            for seq in range(k):
                ids = tokenize(f"{prompt} Chapter {seq}.")
                last = decode([(t, p, seq) for p, t in enumerate(ids)])[-1]  # prefill: not timed
                nexts.append(last)
                positions.append(len(ids))
            started = time.perf_counter()
            for _ in range(steps):
                nexts = decode([(nexts[s], positions[s], s) for s in range(k)])
                positions = [p + 1 for p in positions]
            return k * steps / (time.perf_counter() - started)

        run(1)  # warm-up
        rates: dict[int, list[float]] = {k: [] for k in BATCHED_SEQS}
        for _ in range(BATCHED_ROUNDS):  # interleaved: the machine drifts
            for k in BATCHED_SEQS:
                rates[k].append(run(k))
        return {f"aggregate_tps_{k}": statistics.median(v) for k, v in rates.items()}
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)


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
    ap.add_argument("--batched-tokens", type=int, default=0,
                    help="also measure batched decode of 1, 2, 4 and 8 sequences, this many steps (0: skip)")
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
    if args.batched_tokens > 0:
        llm.close()
        out.update(batched_decode(llama_cpp, args.model, args.threads, args.ctx, args.decode_prompt,
                                  args.batched_tokens))
        out["aggregate_4_over_1"] = out["aggregate_tps_4"] / out["aggregate_tps_1"]
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
