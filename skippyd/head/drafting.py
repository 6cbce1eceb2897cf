"""Drafts for speculative decoding, taken from the session's own context, and how many of them to verify.

A verify window is the current token plus k drafted tokens, computed by every
stage as one batch; the final stage predicts the token after each position
and accepts drafts while they equal its prediction (``Context.sample_window``),
answering with the drafts accepted and the token after them. Whether that
pays depends on two numbers:

- the acceptance ``a``: the chance that a draft equals the target's choice
  given that the ones before it did. A window of k drafts then yields
  ``1 + a + a^2 + ... + a^k`` tokens on average;
- the window's cost against one decode step, ``1 + b * k``: a batch of k+1
  rows costs more compute than one row (about 1.9x for 4 rows, 2.9x for 8 on
  two CPU cores), while the trip round the pipeline is paid once (over a
  link with a long round trip a window costs less than that, relatively:
  the model is on the safe side there).

:class:`WindowSizer` picks the k that maximises tokens per unit of cost and
drafts nothing (k = 0) when even the best k would not beat a plain step.
It decides from the tokens alone, never from the clock: the acceptance is
counted over the tokens the generation produced (would the proposer's first
draft have been each one?), whatever the windows were, and the cost is a
fixed model of a window's batch (``DRAFT_COST``); a session whose steps share
the head's batches with others' also weighs what its window's rows cost them. A window's rows and a plain
step round differently (one row of a sequence in a batch against several;
any number of rows from two up rounds alike), so the choice between a plain
step and a window decides the output at a near-tie: made from the tokens,
the same request to the same pipeline gives the same tokens every time, and
a seeded run draws the same numbers as the token-by-token loop at every
position. While it drafts nothing it keeps counting (a plain step's token
judges the proposer all the same), so a session whose output starts
repeating its input turns drafting back on without paying for a window to
find out.

Proposers sit behind :class:`Proposer` so that a draft model can be added
beside the n-gram one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

MAX_DRAFT = 16  # drafts in one window at most (a batch of 17 rows)
MIN_GAIN = 1.05  # draft only when the model expects at least this speed-up over a plain step
PRIOR_DRAFTS = 2  # the weight, in judged drafts, of the acceptance a session starts from
# a window of k drafts costs 1 + DRAFT_COST * k plain steps: a batch of k+1 rows against one row on two CPU
# cores (about 1.9x for 4 rows, 2.9x for 8). Fixed, not measured: windows chosen from measured times would
# differ from run to run, and with them the rounding (see the module's docstring)
DRAFT_COST = 0.25


class Proposer(Protocol):
    """Proposes tokens to follow a session's context."""

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the context (the prompt, then every accepted token)."""

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow the context (fewer, or none, when it has no idea)."""


class NgramProposer:
    """Prompt-lookup drafting: find the longest recent n-gram (``min_n`` to ``max_n`` tokens) that ends the
    context and occurred before, and propose what followed its latest earlier occurrence.

    The index maps every n-gram of the context to where it last ended, updated as tokens arrive, so a proposal
    costs ``max_n - min_n + 1`` dictionary lookups whatever the context's length."""

    def __init__(self, *, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest occurrence
        self._pending: dict[tuple[int, ...], int] = {}  # n-grams ending the context: indexed once one follows

    def extend(self, tokens: Sequence[int]) -> None:
        toks = self.tokens
        for t in tokens:
            # the n-grams that ended the context before t now have a follower: index them
            self._ends.update(self._pending)
            toks.append(int(t))
            end = len(toks)
            self._pending = {tuple(toks[end - n:end]): end for n in range(self.min_n, min(self.max_n, end) + 1)}

    def propose(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """``after``: tokens not in the context yet (drafts in flight), which the proposal follows as if they
        were: the n-gram that ends them is looked up among the context's, and what followed it is copied."""
        toks = self.tokens
        if k <= 0:
            return []
        after = list(after)
        tail = toks[-self.max_n:] + after if after else toks  # where the n-gram is taken from
        real, end = len(toks), len(toks) + len(after)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            at = self._ends.get(tuple(tail[len(tail) - n:]))
            if at is not None:
                # what followed it, continued through ``after`` and the proposal itself where it runs into the
                # present
                out = []
                i = at
                while len(out) < k:
                    if i < real:
                        out.append(toks[i])
                    elif i < end:
                        out.append(after[i - real])
                    else:
                        out.append(out[i - end])
                    i += 1
                return out
        return []


def expected_tokens(a: float, k: int) -> float:
    """Tokens a window of k drafts yields on average at per-draft acceptance ``a``: 1 + a + ... + a^k."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class WindowSizer:
    """Chooses each step's number of drafts from the acceptance the generation's tokens show.

    ``a`` is the share of produced tokens that the proposer's first draft would have been, over the tokens it
    had a draft for, each count decayed by ``1 - alpha`` at every judged token and started from ``a0`` over
    PRIOR_DRAFTS (below what a window needs: a generation drafts once a token has shown the proposer right):
    what the tokens say, the same whatever windows carried them (a run's choices follow its tokens only, so a
    run reproduces itself). ``b`` is a draft's cost in plain steps (DRAFT_COST)."""

    def __init__(self, *, max_draft: int = MAX_DRAFT, a0: float = 0.3, b: float = DRAFT_COST, alpha: float = 0.1,
                 min_gain: float = MIN_GAIN):
        self.max_draft = max_draft
        self.b, self.alpha, self.min_gain = b, alpha, min_gain
        self._accepted, self._judged = a0 * PRIOR_DRAFTS, float(PRIOR_DRAFTS)  # decayed counts
        self.windows = self.drafted = self.accepted = 0

    @property
    def a(self) -> float:
        """The acceptance: the chance that a draft equals the target's choice given that the ones before did."""
        return self._accepted / self._judged if self._judged > 0 else 0.0

    # ---------------------------------------------------------------- choosing
    def gain(self, k: int, sharing: int = 1) -> float:
        """Expected speed-up of a window of k drafts over plain steps: tokens per plain step's cost. With
        ``sharing`` sessions in the batch (this one's included), each a row costing ``b`` more than the first,
        the window's rows slow every one of them: the gain is the batch's tokens per unit of its cost."""
        n = max(1, sharing)
        base = 1.0 + self.b * (n - 1)
        return (n - 1 + expected_tokens(self.a, k)) / n * base / (base + self.b * k)

    def choose(self, sharing: int = 1) -> int:
        """Drafts for the next step: the k in 1..max_draft with the best expected gain, or 0 when that gain is
        below ``min_gain`` (drafting off: plain steps, still judged)."""
        best_k, best = 0, 1.0
        for k in range(1, self.max_draft + 1):
            g = self.gain(k, sharing)
            if g > best:
                best_k, best = k, g
        return best_k if best >= self.min_gain else 0

    @property
    def drafting(self) -> bool:
        return self.choose() > 0

    # ---------------------------------------------------------------- counting
    def judge(self, first_draft: int | None, produced: int) -> None:
        """A token the generation produced, and what the proposer's first draft for its position was (None: it
        had none, nothing is learnt)."""
        if first_draft is not None:
            keep = 1.0 - self.alpha
            self._accepted = keep * self._accepted + (1.0 if first_draft == produced else 0.0)
            self._judged = keep * self._judged + 1.0

    def window_done(self, drafted: int, accepted: int) -> None:
        """A verified window: ``accepted`` of its ``drafted`` drafts taken (the totals; the acceptance is
        judged token by token, :meth:`judge`)."""
        if drafted > 0:
            self.windows += 1
            self.drafted += drafted
            self.accepted += accepted

    @property
    def acceptance(self) -> float | None:
        """Accepted over drafted so far (None before the first window)."""
        return self.accepted / self.drafted if self.drafted else None
