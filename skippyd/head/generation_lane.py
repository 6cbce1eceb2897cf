"""What a generation's run asks of the rest of the pipeline, whatever that is.

A :class:`GenerationLane` takes what the head computes for one generation
and answers with predictions. On a single stage it is a
:class:`~skippyd.head.local_lane.LocalLane` (the head's own context samples:
nothing leaves the process); in a pipeline, a
:class:`~skippyd.head.pipeline_lane.PipelineLane` (the hidden states go down
a lane, the final stage's predictions come back). The engine picks the
:class:`LaneSource` once; a run never asks which it has.

Every decode step is a verify window: the current token and its drafts,
none for a plain step (which the wire sends as its compact decode frame).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from skippyd.head.prompt import PromptPart
from skippyd.head.sequence import HeadSequence
from skippyd.head.sink import GenerationSink
from skippyd.runtime.llama import TokenLogprobs
from skippyd.sampling import SamplingParams


class GenerationLane(Protocol):
    """One generation's way to its predictions, from its admission to its cleanup (a replay after a stage
    failure connects it again)."""

    @property
    def logprobs(self) -> TokenLogprobs | None:
        """The last prediction's logprobs (a generation configured with them), or None."""

    async def connect(self, deadline: float) -> None:
        """Make ready for the generation, from a (re)start: a lane checked out (waiting until ``deadline``,
        trio time, at most) and configured, or the head's sampler."""

    async def restore(self, keys: np.ndarray) -> int:
        """How many of the positions keyed ``keys`` (a prefix the head restored) the rest of the pipeline holds
        now, from its prefix caches."""

    async def prompt_part(self, part: PromptPart, *, final: bool) -> int | None:
        """Compute a part of the prompt (text tokens, or an image's rows); the final one's answer is the first
        generated token (None for the others)."""

    @property
    def window_depth(self) -> int:
        """How many steps to keep in flight at most (1: each one's answer before the next goes out): what
        covers the lane's round trip, from its measured times."""

    async def begin(self, token: int, drafts: Sequence[int], *, chained: bool = False) -> object:
        """Begin the step for ``token`` with ``drafts`` (none: a plain step); what :meth:`finish` takes.
        ``chained``: a window sent behind a step not yet answered, valid only if that step's drafts are all
        accepted and ``token`` is its next token (the final stage drops it otherwise)."""

    async def finish(self, step: object) -> list[int]:
        """The step's answer: the drafts the final stage accepted, then the next token (none: a chained
        window the final stage dropped). Answers come in the order the steps began. After a rejected draft
        the head's sequence holds the positions of the step's token and the accepted drafts only."""

    async def abandon(self) -> None:
        """The chained steps in flight were drafted on an answer that did not come: the head's sequence holds
        only what the last answer confirmed (their answers are still read, each empty)."""

    async def leave(self) -> None:
        """The pipeline failed under the generation: give what it holds up (a replay connects again)."""

    async def end(self) -> None:
        """The generation ended (runs shielded): release what it holds down the pipeline, bounded."""


class LaneSource(Protocol):
    """Where the engine's generations get their lanes (chosen once: single stage or pipeline)."""

    def lane_for(self, sequence: HeadSequence, sampling: SamplingParams, sink: GenerationSink) -> GenerationLane:
        """A generation's lane (not yet connected)."""
