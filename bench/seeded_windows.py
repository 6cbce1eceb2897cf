"""Seeded sampling with verify windows: are the random draws or the rounding what parts a speculative reply
from the token-by-token one?

    .venv/bin/python bench/seeded_windows.py [--tokens 128] [--seeds 8] [--window 8] [--threads 2]
    .venv/bin/python bench/seeded_windows.py --tokens 24 --seeds 2          # smoke run

In this process, on the default model, for bench/bench_speculative.py's code edit and prose prompts (its chat
template), ``--seeds`` seeds at its seeded sampling (temperature 0.8):

* **free-running**: the token-by-token loop (one decode step per token, a llama.cpp chain with the seed)
  against the speculative loop (n-gram drafts from the context, ``--window`` at most, verified with
  ``Context.sample_window`` as the final stage verifies them), both to ``--tokens``: identical, or the first
  position where they part;
* **teacher-forced**: the token-by-token loop's reply computed again as windows of ``--window`` + 1 rows, each
  row sampled by a chain with the same seed in the same order (its draws those of the loop at every
  position): a row whose token differs is a draw that the window's rounding moved across a boundary.
  Reported per 1000 sampled positions, beside the same count for greedy choices (the argmax) and the largest
  logit difference between a row and its single step.

``--flash-attn`` (off, the daemon's default, or on) is llama.cpp's flash attention for both loops.

Every figure is printed as it is; nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_speculative import SEEDED_TEMPERATURE, SINGLE_PROMPTS, messages  # noqa: E402
from skippyd.head.drafting import NgramProposer  # noqa: E402
from skippyd.runtime import llama  # noqa: E402
from skippyd.runtime.llama.context import ContextParams  # noqa: E402
from skippyd.runtime.models import fetch_default_model  # noqa: E402
from skippyd.sampling import SamplingParams  # noqa: E402

SEQ = 0


class Loops:
    """One context and the prompt in it; each loop starts again from the prompt's KV."""

    def __init__(self, model: llama.Model, prompt: np.ndarray, threads: int, flash_attn: str):
        self.model, self.prompt = model, prompt
        self.ctx = llama.Context(model, ContextParams(n_ctx_per_seq=2048, n_seq_max=1, n_threads=threads,
                                                      flash_attn=flash_attn))
        n = len(prompt)
        self.ctx.decode(np.arange(n - 2), np.full(n - 2, SEQ), tokens=prompt[:-2])

    def _restart(self) -> None:
        """Back to the prompt: its last two rows computed again (a chunk, as the prefill's last), whose last
        row's logits give the first token (sampled by the loop's sampler, as the final stage samples it)."""
        n = len(self.prompt)
        self.ctx.kv_trim(SEQ, n - 2)
        self.ctx.decode(np.arange(n - 2, n), np.full(2, SEQ), tokens=self.prompt[-2:])

    def plain(self, params: SamplingParams, n: int) -> tuple[list[int], list[np.ndarray]]:
        """The token-by-token loop: its tokens and each step's logits."""
        self._restart()
        sampler = llama.Sampler(self.model, params)
        tokens, logits = [int(self.ctx.sample_row(SEQ, sampler))], []
        pos = len(self.prompt)
        while len(tokens) < n:
            self.ctx.decode_row(pos, SEQ, token=tokens[-1])
            logits.append(self.ctx.logits(SEQ))
            tokens.append(int(self.ctx.sample_row(SEQ, sampler)))
            pos += 1
        sampler.close()
        return tokens, logits

    def speculative(self, params: SamplingParams, n: int, window: int) -> list[int]:
        """The speculative loop: n-gram drafts, each window verified by sample_window."""
        self._restart()
        sampler = llama.Sampler(self.model, params)
        tokens = [int(self.ctx.sample_row(SEQ, sampler))]
        proposer = NgramProposer()
        proposer.extend([*self.prompt.tolist(), tokens[0]])
        pos = len(self.prompt)
        while len(tokens) < n:
            drafts = proposer.propose(min(window, n - len(tokens) - 1))
            rows = [tokens[-1], *drafts]
            if drafts:
                self.ctx.decode(np.arange(pos, pos + len(rows)), np.full(len(rows), SEQ), tokens=np.array(rows),
                                windows=[SEQ])
                answer = self.ctx.sample_window(SEQ, sampler, rows)
                self.ctx.kv_trim(SEQ, pos + len(answer))
            else:
                self.ctx.decode_row(pos, SEQ, token=rows[0])
                answer = [int(self.ctx.sample_row(SEQ, sampler))]
            pos += len(answer)
            tokens.extend(answer)
            proposer.extend(answer)
        sampler.close()
        return tokens[:n]

    def forced(self, params: SamplingParams, tokens: list[int], step_logits: list[np.ndarray],
               window: int) -> dict:
        """``tokens`` (the plain loop's) computed again as windows of ``window`` + 1 rows; every row sampled in
        order by a chain with the same seed (GuidedSampler: the chain on the row's logits), greedy and seeded
        flips counted against the plain loop's tokens and the argmax of its steps."""
        self._restart()
        chain = llama.GuidedSampler(self.model, params)
        chain.sample(self.ctx.logits(SEQ))  # the first token's draw, as the prefill's
        seeded = greedy = 0
        worst = 0.0
        pos, i = len(self.prompt), 0
        n = len(tokens) - 1  # positions sampled after the first token
        while i < n:
            rows = tokens[i:i + window + 1][:n - i]
            self.ctx.decode(np.arange(pos, pos + len(rows)), np.full(len(rows), SEQ), tokens=np.array(rows),
                            windows=[SEQ])
            for j, row in enumerate(self.ctx._window_rows[SEQ]):
                logits = self.ctx._logits_row(row, "forced")
                want = tokens[i + j + 1]
                seeded += chain.sample(logits) != want
                # the chain accepted its own token: penalties off (the bench's sampling), so its state is the
                # loop's whatever it drew
                greedy += int(np.argmax(logits)) != int(np.argmax(step_logits[i + j]))
                worst = max(worst, float(np.max(np.abs(logits - step_logits[i + j]))))
            pos += len(rows)
            i += len(rows)
        chain.close()
        return {"positions": n, "seeded": seeded, "greedy": greedy, "max_logit_diff": worst}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--window", type=int, default=8, help="drafts per window at most")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flash-attn", choices=("off", "on"), default="off")
    args = ap.parse_args()
    model = llama.Model(fetch_default_model())
    print(f"{args.seeds} seeds, temperature {SEEDED_TEMPERATURE}, {args.tokens} tokens, windows of up to "
          f"{args.window} drafts, {args.threads} threads, flash attention {args.flash_attn}")
    for name, prompt_text in SINGLE_PROMPTS.items():
        prompt = model.tokenize(model.apply_chat_template(messages(prompt_text)), parse_special=True)
        loops = Loops(model, prompt, args.threads, args.flash_attn)
        parted, totals = [], {"positions": 0, "seeded": 0, "greedy": 0, "max_logit_diff": 0.0}
        for seed in range(1, args.seeds + 1):
            params = SamplingParams(temperature=SEEDED_TEMPERATURE, seed=seed)
            plain, step_logits = loops.plain(params, args.tokens)
            parted.append(first_difference(plain, loops.speculative(params, args.tokens, args.window)))
            got = loops.forced(params, plain, step_logits, args.window)
            for k in ("positions", "seeded", "greedy"):
                totals[k] += got[k]
            totals["max_logit_diff"] = max(totals["max_logit_diff"], got["max_logit_diff"])
        same = sum(p is None for p in parted)
        where = ", ".join(str(p) for p in parted if p is not None) or "-"
        per = 1000 / max(1, totals["positions"])
        print(f"{name}: free-running identical {same}/{len(parted)} (parted at tokens {where})")
        print(f"  teacher-forced: {totals['positions']} positions, seeded draws moved {totals['seeded']} "
              f"({totals['seeded'] * per:.1f} per 1000), greedy choices moved {totals['greedy']} "
              f"({totals['greedy'] * per:.1f} per 1000), largest logit difference {totals['max_logit_diff']:.3g}")
        loops.ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
