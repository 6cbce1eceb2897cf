"""A generation's speculative decoding: what it drafts, how many drafts a window holds, what it got.

The head drafts from the session's own context (:class:`~skippyd.head.drafting.NgramProposer`) and sizes
each window from the acceptance its tokens show (:class:`~skippyd.head.drafting.WindowSizer`), never from
the clock, so that a run reproduces itself; while a window would not pay it sends plain decode steps and
keeps judging the proposer against every token, so drafting switches itself back on when the output starts
repeating its context. The loop that sends the
windows is the one decode loop (:class:`skippyd.head.decode.Decoder`); a generation that does not speculate
has :data:`PLAIN_STEPS` for drafts: none, ever.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

from skippyd.head.drafting import NgramProposer, WindowSizer

DEFAULT_MAX_DRAFT = 16  # drafts per window at most for a request that asks for speculation on a daemon without
# a window goes behind those in flight only while the chance that they are all accepted, and its first token
# guessed right, is at least this: one that is not costs the stages before the last its compute
CHAIN_MIN_VALID = 0.3


@attrs.define
class SpeculationTotals:
    """The head's counters over every speculative generation (status, Prometheus)."""

    max_draft: int = 0  # 0: off unless a request asks for it
    generations: int = 0
    windows: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0  # decode steps of speculative generations that drafted nothing
    chained: int = 0  # windows sent before the one ahead of them was answered
    dropped: int = 0  # ... that a rejected draft ahead of them made void

    def describe(self) -> dict:
        return {"enabled": self.max_draft > 0, "max_draft": self.max_draft, "generations": self.generations,
                "windows": self.windows, "drafted": self.drafted, "accepted": self.accepted,
                "plain_steps": self.plain_steps, "chained": self.chained, "dropped": self.dropped,
                "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None}


class Drafts(Protocol):
    """What the decode loop asks for each step's drafts, and tells of each step."""

    def begin(self, context: Sequence[int]) -> None:
        """Draft from ``context`` (the prompt and the reply so far, the predicted token last) on."""

    def drafts(self, room: int) -> Sequence[int]:
        """Drafts for the next step (at most ``room``; none: a plain step). The step begins now."""

    def chained(self, ahead: Sequence[int], room: int) -> Sequence[int]:
        """A window to send behind the steps in flight, drafted as if each of them were accepted in full:
        ``ahead``, their drafts and tokens past the current one. Its tokens: the guess of the token after
        them, then at most ``room`` drafts; none while the chance that it is still valid when its turn comes
        is too low to pay."""

    def done(self, drafts: Sequence[int], answer: Sequence[int]) -> None:
        """The step with ``drafts`` answered ``answer`` (the accepted drafts, then the next token), which the
        context goes on with."""

    def dropped(self, n: int) -> None:
        """``n`` chained windows were dropped: a draft of a window ahead of them was rejected."""

    def describe(self) -> dict | None:
        """What the generation reports of its speculation (None: it did not speculate)."""


class _PlainSteps:
    """No drafts: every step is a plain one."""

    def begin(self, context: Sequence[int]) -> None:
        pass

    def drafts(self, room: int) -> Sequence[int]:
        return ()

    def chained(self, ahead: Sequence[int], room: int) -> Sequence[int]:
        return ()

    def done(self, drafts: Sequence[int], answer: Sequence[int]) -> None:
        pass

    def dropped(self, n: int) -> None:
        pass

    def describe(self) -> None:
        return None


PLAIN_STEPS: Drafts = _PlainSteps()


class Speculation:
    """One generation's drafting state (its Drafts): the proposer over its context, the window sizer, its
    counters."""

    def __init__(self, max_draft: int, totals: SpeculationTotals, sharing: Callable[[], int] = lambda: 1):
        self.proposer: NgramProposer | None = None  # made by begin, over the context
        self.sizer = WindowSizer(max_draft=max_draft)
        # the sessions in the head's last batch with this one: a window's rows slow them all (a session alone
        # is 1, and its choices follow its tokens only)
        self.sharing = sharing
        self.totals = totals
        totals.generations += 1
        self.windows = self.drafted = self.accepted = 0
        self.chained_windows = self.dropped_windows = 0  # windows sent behind others, and those dropped
        self.rejected = 0  # windows with a draft rejected (each costs a round trip no window in flight hides)
        self.plain_steps = 0  # steps without drafts (nothing worth drafting: a round trip each too)

    def begin(self, context: Sequence[int]) -> None:
        self.proposer = NgramProposer()
        self.proposer.extend(context)

    def drafts(self, room: int) -> list[int]:
        k = min(self.sizer.choose(self.sharing()), room)
        return self.proposer.propose(k) if k > 0 else []

    def chained(self, ahead: Sequence[int], room: int) -> list[int]:
        # valid only if every draft ahead is accepted and the guess that follows them is the next token
        if room < 0 or self.sharing() > 1 or self.sizer.a ** (len(ahead) + 1) < CHAIN_MIN_VALID:
            return []
        k = min(self.sizer.choose(), room)
        window = self.proposer.propose(1 + k, ahead)
        if window:
            self.chained_windows += 1
            self.totals.chained += 1
        return window

    def dropped(self, n: int) -> None:
        self.dropped_windows += n
        self.totals.dropped += n

    def done(self, drafts: Sequence[int], answer: Sequence[int]) -> None:
        # every token judges the proposer (its first draft there), whatever the step that carried it: the
        # acceptance then follows the tokens only (past the reply's end too, if the answer ends it: then
        # nothing drafts again)
        proposer, sizer = self.proposer, self.sizer
        for token in answer:
            first = proposer.propose(1)
            sizer.judge(first[0] if first else None, token)
            proposer.extend((token,))
        if drafts:
            self._window_done(len(drafts), len(answer) - 1)
        else:
            self.plain_steps += 1
            self.totals.plain_steps += 1

    def _window_done(self, drafted: int, accepted: int) -> None:
        self.sizer.window_done(drafted, accepted)
        self.windows += 1
        self.rejected += accepted < drafted
        self.drafted += drafted
        self.accepted += accepted
        totals = self.totals
        totals.windows += 1
        totals.drafted += drafted
        totals.accepted += accepted

    def describe(self) -> dict:
        sizer = self.sizer
        return {"windows": self.windows, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None,
                "plain_steps": self.plain_steps, "rejected": self.rejected,
                "chained": self.chained_windows, "dropped": self.dropped_windows,
                # what the next window is sized from: the acceptance the tokens show, a draft's cost in plain
                # steps
                "acceptance_estimate": round(sizer.a, 4), "draft_cost": round(sizer.b, 4)}
