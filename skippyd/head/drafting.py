"""Drafts for speculative decoding, taken from the session's own context, and how many of them to verify.

A verify window is the current token plus k drafted tokens, computed by every
stage as one batch; the final stage predicts the token after each position
and accepts drafts while they equal its prediction (``Context.sample_window``),
answering with the drafts accepted and the token after them. Whether that
pays depends on two numbers the session measures as it goes:

- the acceptance ``a``: the chance that a draft equals the target's choice
  given that the ones before it did. A window of k drafts then yields
  ``1 + a + a^2 + ... + a^k`` tokens on average;
- the window's cost against one decode step, ``1 + b * k``: a batch of k+1
  rows costs more compute than one row (about 1.9x for 4 rows, 2.9x for 8 on
  two CPU cores), while the trip round the pipeline is paid once. Over a link
  with a long round trip ``b`` is small and wide windows pay.

:class:`WindowSizer` picks the k that maximises tokens per unit of cost and
drafts nothing (k = 0) when even the best k would not beat a plain step.
While it drafts nothing it keeps measuring for free: every plain step checks
whether the proposer's first draft would have been right (a shadow
acceptance), so a session whose output starts repeating its input turns
drafting back on without paying for a window to find out.

Proposers sit behind :class:`Proposer` so that a draft model can be added
beside the n-gram one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

MAX_DRAFT = 16  # drafts in one window at most (a batch of 17 rows)
MIN_GAIN = 1.05  # draft only when the model expects at least this speed-up over a plain step
PRIOR_DRAFTS = 2  # the weight, in judged drafts, of the acceptance a session starts from


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

    def propose(self, k: int) -> list[int]:
        toks = self.tokens
        if k <= 0:
            return []
        end = len(toks)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            at = self._ends.get(tuple(toks[end - n:end]))
            if at is not None:
                # what followed it, continued through the proposal itself where it runs into the present
                out = []
                i = at
                while len(out) < k:
                    if i < end:
                        out.append(toks[i])
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
    """Chooses each step's number of drafts from the acceptance and window cost the session measured.

    ``a`` is accepted over judged drafts, each count decayed by ``1 - alpha`` at every observation (a window,
    or a plain step's shadow draft) and started from ``a0`` over PRIOR_DRAFTS: a window of 8 accepted drafts
    weighs 8 judged drafts, so a copy reaches wide windows within a few of them. ``b`` is a moving average
    (weight ``alpha`` on the newest); it starts from the cost of a batch on two CPU cores and learns from
    measured windows against measured plain steps."""

    def __init__(self, *, max_draft: int = MAX_DRAFT, a0: float = 0.5, b0: float = 0.3, alpha: float = 0.2,
                 min_gain: float = MIN_GAIN):
        self.max_draft = max_draft
        self.b, self.alpha, self.min_gain = b0, alpha, min_gain
        self._accepted, self._judged = a0 * PRIOR_DRAFTS, float(PRIOR_DRAFTS)  # decayed counts
        self.step_s: float | None = None  # a plain decode step's time (moving average)
        self.windows = self.drafted = self.accepted = 0

    @property
    def a(self) -> float:
        """The acceptance: the chance that a draft equals the target's choice given that the ones before did."""
        return self._accepted / self._judged if self._judged > 0 else 0.0

    def _judge(self, accepted: int, judged: int) -> None:
        keep = 1.0 - self.alpha
        self._accepted = keep * self._accepted + accepted
        self._judged = keep * self._judged + judged

    # ---------------------------------------------------------------- choosing
    def gain(self, k: int) -> float:
        """Expected speed-up of a window of k drafts over plain steps: tokens per plain step's cost."""
        return expected_tokens(self.a, k) / (1.0 + self.b * k)

    def choose(self) -> int:
        """Drafts for the next step: the k in 1..max_draft with the best expected gain, or 0 when that gain is
        below ``min_gain`` (drafting off: plain steps, shadow-measured)."""
        best_k, best = 0, 1.0
        for k in range(1, self.max_draft + 1):
            g = self.gain(k)
            if g > best:
                best_k, best = k, g
        return best_k if best >= self.min_gain else 0

    @property
    def drafting(self) -> bool:
        return self.choose() > 0

    # ---------------------------------------------------------------- measuring
    def _blend(self, old: float, new: float) -> float:
        return old + self.alpha * (new - old)

    def window_done(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """A verified window: ``accepted`` of its ``drafted`` drafts taken, in ``seconds`` (None: not timed)."""
        if drafted <= 0:
            return
        self.windows += 1
        self.drafted += drafted
        self.accepted += accepted
        # drafts after the first rejection were not judged
        self._judge(accepted, accepted + (1 if accepted < drafted else 0))
        if seconds is not None and self.step_s:
            self.b = max(0.0, self._blend(self.b, (seconds / self.step_s - 1.0) / drafted))

    def plain_step(self, shadow_draft: int | None, produced: int, seconds: float | None = None) -> None:
        """A plain decode step produced ``produced``; ``shadow_draft`` is what the proposer would have drafted
        first (None: no proposal). Keeps the acceptance current while drafting is off."""
        if seconds is not None:
            self.step_s = seconds if self.step_s is None else self._blend(self.step_s, seconds)
        if shadow_draft is not None:
            self._judge(1 if shadow_draft == produced else 0, 1)

    @property
    def acceptance(self) -> float | None:
        """Accepted over drafted so far (None before the first window)."""
        return self.accepted / self.drafted if self.drafted else None
