"""A single stage's lane: the head's own context samples, and nothing leaves the process.

The head computes every step on the event loop's thread when it can (see
Scheduler._direct), which blocks the loop for the step: a step is computed
only once its answer is awaited (:meth:`LocalLane.finish`), after the text
of the token before it was handed on and let out (the sink's ``let_out``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import trio

from skippyd.head.prompt import PromptPart
from skippyd.head.sequence import HeadSequence
from skippyd.head.sink import GenerationSink
from skippyd.runtime import llama
from skippyd.sampling import SamplingParams


class LocalLanes:
    """The lanes of a single stage's head (a LaneSource)."""

    def __init__(self, model: llama.Model):
        self.model = model

    def lane_for(self, sequence: HeadSequence, sampling: SamplingParams, sink: GenerationSink) -> LocalLane:
        return LocalLane(self.model, sequence, sampling, sink)


class LocalLane:
    """A generation on a single stage (a GenerationLane): its sampler, used by the head's computes."""

    def __init__(self, model: llama.Model, sequence: HeadSequence, sampling: SamplingParams, sink: GenerationSink):
        self.model, self.sequence, self.sampling, self.sink = model, sequence, sampling, sink
        self.sampler: llama.Sampler | llama.GuidedSampler | None = None  # None: greedy, the argmax in native code
        self._guided: llama.GuidedSampler | None = None  # the sampler, sampling in Python (constraint, logprobs)
        self._prompt_unrecorded = False  # the prompt goes to the prefix cache once the first token is out
        self._step_tokens = np.empty(1, dtype=np.int32)  # a plain step's input (its compute ends before the next)

    @property
    def logprobs(self) -> llama.TokenLogprobs | None:
        return self._guided.last if self._guided is not None else None

    async def connect(self, deadline: float) -> None:
        if self.sampler is not None:
            return
        if self.sampling.guided:  # a constraint compiles off the event loop
            self.sampler = self._guided = await trio.to_thread.run_sync(llama.sampler_for, self.model, self.sampling)
        else:
            self.sampler = llama.sampler_for(self.model, self.sampling)

    async def restore(self, keys: np.ndarray) -> int:
        return len(keys)  # no other stage

    async def prompt_part(self, part: PromptPart, *, final: bool) -> int | None:
        token = await self.sequence.compute_part(part, want_token=final, sampler=self.sampler)
        if not final:
            return None
        self._prompt_unrecorded = True  # not before the first token is out: a record is not its client's wait
        return int(token)

    window_depth = 1  # the head computes and samples each step itself: nothing to keep in flight

    async def begin(self, token: int, drafts: Sequence[int], *, chained: bool = False) -> tuple[int, Sequence[int]]:
        return token, drafts  # computed when its answer is awaited

    async def abandon(self) -> None:
        pass  # never a step behind another (window_depth 1)

    async def finish(self, step: tuple[int, Sequence[int]]) -> list[int]:
        token, drafts = step
        sequence = self.sequence
        await self.sink.let_out()  # the text so far goes out before the compute may block the loop
        if self._prompt_unrecorded:
            self._prompt_unrecorded = False
            await sequence.record()
        if self._guided is not None:
            self._guided.advance(token)  # the constraint follows the tokens the sequence is given
        pos = sequence.position
        if not drafts:
            tokens = self._step_tokens
            tokens[0] = token
            return [int(await sequence.compute(tokens, pos, want_token=True, sampler=self.sampler))]
        window = np.array([token, *drafts], dtype=np.int32)
        predicted = await sequence.compute(window, pos, want_token=True, sampler=self.sampler, window=True)
        await sequence.keep(pos + len(predicted))  # the window's token and the accepted drafts
        return predicted

    async def leave(self) -> None:
        pass  # nothing fails under a single stage but the head itself

    async def end(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
