"""Several stage slices chained in one process.

The reference for the networked pipeline: tests compare the daemon's output
with this, and the benchmarks measure it against the unsplit model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from skippyd.runtime.llama import Context, ContextParams, InvalidArgumentError, Model, Sampler
from skippyd.sampling import SamplingParams


class LocalPipeline:
    """Stage models (a whole model counts as one stage) run one after another."""

    def __init__(self, paths: Sequence[str | os.PathLike], params: ContextParams = ContextParams()):
        self.models: list[Model] = []
        self.contexts: list[Context] = []
        try:
            for path in paths:
                self.models.append(Model(path))
            _check_chain(self.models)
            self.contexts = [Context(m, params) for m in self.models]
        except BaseException:
            self.close()
            raise

    @property
    def head(self) -> Model:
        return self.models[0]

    def close(self) -> None:
        for ctx in reversed(self.contexts):
            ctx.close()
        for model in reversed(self.models):
            model.close()

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def decode(self, tokens: np.ndarray | None, pos: np.ndarray, seq: np.ndarray, *, embd: np.ndarray | None = None,
               causal: bool = True) -> None:
        """One batch through every stage; the last stage then holds logits. The first stage takes `tokens`, or
        input embeddings `embd` (an image's rows); every stage gets the same positions `pos` (``[4, n]`` for an
        image's rows on an M-RoPE model) and `causal`."""
        hidden = embd
        for ctx in self.contexts:
            if ctx.token_input and tokens is not None:
                ctx.decode(pos, seq, tokens=tokens, causal=causal)
            elif ctx.token_input:
                ctx.decode(pos, seq, input_embd=hidden, causal=causal)
            else:
                ctx.decode(pos, seq, embd=hidden, causal=causal)
            if ctx.hidden_output:
                hidden = ctx.hidden()

    @property
    def last(self) -> Context:
        return self.contexts[-1]

    def prefill(self, tokens: Sequence[int], *, seq: int = 0, start: int = 0, chunk: int = 512) -> None:
        tokens = np.asarray(tokens, dtype=np.int32)
        for lo in range(0, len(tokens), chunk):
            part = tokens[lo:lo + chunk]
            pos = np.arange(start + lo, start + lo + len(part), dtype=np.int32)
            self.decode(part, pos, np.full(len(part), seq, dtype=np.int32))

    def prefill_chunks(self, chunks: Sequence, *, seq: int = 0, start: int = 0, chunk: int = 512) -> int:
        """A multimodal prompt (skippyd.runtime.mtmd's text and image chunks) in prompt order, as llama.cpp's
        ``mtmd_helper_eval_chunks`` evaluates it: a text chunk's tokens, an image chunk's rows encoded and given
        to the first stage as embeddings (causal attention off where the chunk says so), each at its rows'
        positions, `chunk` rows per batch. Returns the position decoding goes on from."""
        position = start
        for c in chunks:
            rows = c.encode() if hasattr(c, "encode") else None
            pos = c.positions(position)
            for lo in range(0, c.n_tokens, chunk):
                hi = min(lo + chunk, c.n_tokens)
                seqs = np.full(hi - lo, seq, dtype=np.int32)
                if rows is None:
                    self.decode(c.tokens[lo:hi], pos[lo:hi], seqs)
                else:
                    self.decode(None, pos[..., lo:hi], seqs, embd=rows[lo:hi], causal=not c.non_causal)
            position += c.n_pos
        return position

    def generate(self, prompt: Sequence[int], max_tokens: int, *, sampling: SamplingParams | None = None,
                 seq: int = 0, chunk: int = 512, stop_at_eog: bool = True) -> list[int]:
        """Prefill `prompt` into an empty `seq`, then decode up to `max_tokens` tokens."""
        if len(prompt) == 0:
            raise InvalidArgumentError("generate", "empty prompt")
        for ctx in self.contexts:
            ctx.kv_clear_seq(seq)
        sampler = None
        if sampling is not None and not sampling.is_plain_greedy:
            sampler = Sampler(self.models[-1], sampling)
        try:
            self.prefill(prompt, seq=seq, chunk=chunk)
            return self.continue_decode(len(prompt), max_tokens, sampler=sampler, seq=seq, stop_at_eog=stop_at_eog)
        finally:
            if sampler is not None:
                sampler.close()

    def continue_decode(self, position: int, max_tokens: int, *, sampler: Sampler | None = None, seq: int = 0,
                        stop_at_eog: bool = True) -> list[int]:
        """Sample from the last decode's logits and keep decoding from `position`."""
        out: list[int] = []
        one_seq = np.array([seq], dtype=np.int32)
        while True:
            token = self.last.sample({seq: sampler})[seq]
            out.append(token)
            if len(out) >= max_tokens or (stop_at_eog and self.head.is_eog(token)):
                return out
            self.decode(np.array([token], dtype=np.int32), np.array([position], dtype=np.int32), one_seq)
            position += 1


def _check_chain(models: list[Model]) -> None:
    if not models:
        raise InvalidArgumentError("build pipeline", "no stages")
    if not models[0].stage.is_first:
        raise InvalidArgumentError("build pipeline", f"{models[0].path} does not start at layer 0")
    if not models[-1].stage.is_last:
        raise InvalidArgumentError("build pipeline", f"{models[-1].path} does not output logits")
    for a, b in zip(models, models[1:]):
        if a.stage.is_last or a.stage.layer_end != b.stage.layer_start:
            raise InvalidArgumentError(
                "build pipeline",
                f"{a.path} [{a.stage.layer_start},{a.stage.layer_end}) is not followed by "
                f"{b.path} [{b.stage.layer_start},{b.stage.layer_end})",
            )
