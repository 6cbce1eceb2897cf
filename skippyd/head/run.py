"""One generation on the head while it runs: connect → prefill → decode → cleanup.

The head computes the first slice itself (:class:`~skippyd.head.sequence.HeadSequence`)
and its lane (:mod:`skippyd.head.generation_lane`: a single stage's own
sampler, or a lane down the pipeline) answers with predictions; the reply is
made by the one decode loop (:class:`~skippyd.head.decode.Decoder`).

Whatever ends a generation (finish, stop string, cancellation, an error)
:meth:`GenerationRun._cleanup` ends it on its lane (shielded, time-bounded)
and releases the head's own KV sequence.

A stage failure with ``--resume`` replays the generation on a new lane
(:mod:`skippyd.head.resume`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import trio

from skippyd.head.availability import Availability
from skippyd.head.chunking import PrefillChunker
from skippyd.head.decode import Decoder, Reply
from skippyd.head.errors import GenerationError
from skippyd.head.generation_lane import GenerationLane, LaneSource
from skippyd.head.live import LiveGeneration
from skippyd.head.liveness import StageWatch
from skippyd.head.prompt import ImagePiece, Prompt
from skippyd.head.resume import ResumePolicy
from skippyd.head.sequence import HeadCompute, HeadSequence
from skippyd.head.sink import GenerationSink
from skippyd.head.speculation import PLAIN_STEPS, Drafts, Speculation, SpeculationTotals
from skippyd.head.states import GenerationState
from skippyd.head.step_clock import StepClock
from skippyd.sampling import SamplingParams
from skippyd.wire.messages import StageStats, StatsTotal


@attrs.frozen
class HeadParts:
    """What a generation uses of the head: its compute (context, scheduler, sequences, prefix cache), where
    its lanes come from, the tokens' text, the prefill chunker, stage 1's liveness (None: single stage), the
    resume window (None: no replay) and the speculation setting and counters."""

    compute: HeadCompute
    lanes: LaneSource
    token_piece: Callable[[int], bytes]
    is_eog: Callable[[int], bool]
    chunker: PrefillChunker
    watch: StageWatch | None
    resume_window: float | None
    speculation: SpeculationTotals
    availability: Availability | None = None  # a supervising deployment's say on whether the pipeline serves


class GenerationRun:
    """The state of one generation while it runs (admitted: it holds one of the engine's places)."""

    def __init__(self, head: HeadParts, live: LiveGeneration, prompt: Prompt, max_tokens: int,
                 sampling: SamplingParams, stops: tuple[str, ...], ignore_eos: bool, sink: GenerationSink,
                 started: float, *, max_draft: int = 0):
        self.head, self.live, self.prompt, self.sampling, self.sink = head, live, prompt, sampling, sink
        self.started = started
        self.reply = Reply(head.token_piece, head.is_eog, stops, sink, max_tokens=max_tokens, ignore_eos=ignore_eos,
                           logprobs=sampling.logprobs is not None)
        self.error: str | None = None
        # prompt tokens (and image rows) that no stage computed: restored from every stage's prefix cache
        self.cached_tokens = 0
        self.clock = StepClock(head.compute.scheduler.hot_path)
        self.resume = ResumePolicy(head.resume_window, head.watch, head.availability)
        self._stats = StatsTotal()  # every stage's reports for this generation, merged as they come
        # this generation's prefill chunk, chosen once: a replay (resume) must chunk the prompt the same way,
        # or its logits (and so a greedy replay's tokens) could differ from the first time
        self.chunk: int | None = None
        # speculative decoding: drafts per window at most (0: plain steps); not with logprobs, which the final
        # stage reports per decode step
        self.max_draft = max_draft if sampling.logprobs is None else 0
        self.speculation: Speculation | None = None  # its state, from the first decode on
        self.sequence: HeadSequence | None = None  # from the start of execute

    def prefix_cache(self) -> list[dict]:
        """Per stage, the prompt's tokens (and image rows) it held from its prefix cache rather than computed:
        the head's own, then each later stage's as its Stop's answer said (a stage whose answer did not come
        is left out)."""
        sequence = self.sequence
        if sequence is None:
            return []
        counts = [sequence.prompt_cached or 0, *sequence.stages_cached]
        return [{"stage": k, "cached_tokens": self.prompt.rows_before(n)} for k, n in enumerate(counts)]

    @property
    def stats(self) -> StageStats:
        """Every stage's reports for this generation, merged."""
        return self._stats.total()

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1e3

    async def execute(self, deadline: float) -> None:
        """Run to the end; `deadline` (trio time): the admission's, which the wait for a lane shares."""
        sequence = self.sequence = HeadSequence(self.head.compute, self.live, self.prompt, self._stats, self.clock)
        lane = self.head.lanes.lane_for(sequence, self.sampling, self.sink)
        try:
            while True:
                try:
                    token = await self._catch_up(lane, deadline)
                    self.resume.recovered()  # the pipeline is whole again
                    self.live.state = GenerationState.DECODE
                    decoder = Decoder(self.reply, self.live, self.clock, self._drafts(), self.started)
                    # drafts come from the prompt's text (an image's rows are no tokens) and the reply
                    await decoder.run(lane, token, [*self.prompt.text_tokens.tolist(), *self.reply.tokens])
                    return
                except GenerationError as exc:
                    if not self.resume.may_resume(exc, self.live):
                        raise
                    self.resume.interrupted(exc, self.live)
                    await lane.leave()
                    await self.resume.wait(exc, self.live)
                    deadline = self.resume.deadline
        finally:
            # shielded: a kill must not cut the cleanup short; each step that waits has its own bound
            with trio.CancelScope(shield=True):
                sequence.leave_batches()  # now: the other sessions' batches wait for it no more
                try:
                    await lane.end()
                finally:  # whatever the lane's end raised: a bug there must not leak a session slot
                    await sequence.release(self.reply.tokens)

    async def _catch_up(self, lane: GenerationLane, deadline: float) -> int:
        """Connect the lane and bring every stage to where the generation is: the prompt, then (a replay) each
        token generated so far, in the same chunks and steps as the first time. Returns the next new token."""
        await lane.connect(deadline)
        sequence = self.sequence
        if sequence.position:  # a replay: the head's hidden states again from position 0, as the first time
            await sequence.clear()
        self.live.state = GenerationState.PREFILL
        prompt = self.prompt
        start = await sequence.restore(lane.restore)
        if start:
            self.cached_tokens = self.live.cached_tokens = prompt.rows_before(start)
        if self.chunk is None:
            self.chunk = self.head.chunker.size
        parts = list(prompt.parts(start, self.chunk))
        for i, (piece, lo, hi) in enumerate(parts):
            if isinstance(piece, ImagePiece) and piece.rows is None:
                self.live.state = GenerationState.ENCODE
                await sequence.encode(piece)
                self.live.state = GenerationState.PREFILL
            token = await lane.prompt_part(prompt.part(piece, lo, hi), final=i == len(parts) - 1)
        for replayed in list(self.reply.tokens):  # already emitted: their predictions are not emitted again
            (token,) = await lane.finish(await lane.begin(replayed, ()))
        return token

    def _drafts(self) -> Drafts:
        if not self.max_draft:
            return PLAIN_STEPS
        if self.speculation is None:
            sequence = self.sequence
            self.speculation = self.live.speculation = Speculation(self.max_draft, self.head.speculation,
                                                                   sharing=lambda: sequence.sharing)
        return self.speculation
