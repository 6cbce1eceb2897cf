"""When a generation that a stage failure interrupted is replayed (``--resume``), and how long it waits.

A replay recomputes the head's KV from scratch and sends the prompt in the
same chunks, then every token generated so far as the same decode steps, so
each stage computes exactly what it computed the first time (greedy output
equals an uninterrupted run; so does seeded sampling, as the final stage's
new sampler draws for the replayed steps as the first one did). The
replayed predictions are not emitted again: a stream only pauses.

The window runs from the first failure: every retry within it (stage 1 back,
the rest of the pipeline perhaps not yet, or a slot still held by the lost
lane) must end before it does. While stage 1 is down a retry waits for the
liveness watch to find it up (or for its own backoff, at most a second, and a
check of its own), so a replay begins as soon as the link is back.
"""

from __future__ import annotations

import logging

import trio

from skippyd.head.availability import SERVING, Availability, Unavailable
from skippyd.head.errors import GenerationError
from skippyd.head.live import LiveGeneration
from skippyd.head.liveness import StageWatch
from skippyd.head.states import GenerationState

log = logging.getLogger("skippyd.head")

RESUME_BACKOFF_MIN_S = 0.1  # first try this long after the failure, doubling ...
RESUME_BACKOFF_MAX_S = 1.0  # ... up to this


class ResumePolicy:
    def __init__(self, window: float | None, watch: StageWatch | None, availability: Availability | None = None):
        self.window = window  # None: a stage failure fails the generation (no replay)
        self.watch = watch
        self.availability = availability  # a supervising deployment's say (it may be re-planning the pipeline)
        self.deadline: float | None = None  # trio time: while resuming, the end of the window
        self._backoff = RESUME_BACKOFF_MIN_S

    def may_resume(self, exc: GenerationError, live: LiveGeneration) -> bool:
        """Replay after this failure? With resume on: a stage failure, or a stage whose slots are still held by
        sessions of lanes lost to an earlier fault (it lets go of them within its peer timeout); while
        resuming, any retryable error."""
        if self.window is None or live.killed:
            return False
        return exc.stage_failure or exc.slots_held or (self.deadline is not None and exc.retryable)

    def interrupted(self, exc: GenerationError, live: LiveGeneration) -> None:
        """The generation lost its pipeline: the window starts (at the first failure only)."""
        if self.deadline is None:
            self.deadline = trio.current_time() + self.window
            self._backoff = RESUME_BACKOFF_MIN_S
            log.warning("head: session %d interrupted after %d tokens (%s); resuming within %g s",
                        live.session_id, live.generated, exc, self.window)
        live.state = GenerationState.RESUMING
        live.lane_id = None

    async def wait(self, exc: GenerationError, live: LiveGeneration) -> None:
        """Until stage 1 answers again; raises `exc`'s story once the window is over."""
        availability = self.availability
        while True:
            if availability is not None and (refusal := availability.refusal()) is not None:
                raise Unavailable(refusal) from exc
            if trio.current_time() + self._backoff > self.deadline:
                raise GenerationError(f"{exc} (the pipeline was not back within the {self.window:g} s "
                                      f"resume window)", retryable=True, status=exc.status) from exc
            watch = self.watch
            if availability is not None and availability.supervised and availability.state != SERVING:
                with trio.move_on_after(self._backoff):  # the supervisor is moving the pipeline: wait for it
                    await availability.wait_changed()
                continue
            if watch is not None and watch.down:
                # the watch re-checks too: wake as soon as any check finds stage 1 up, so that the replay starts
                # at once (a link that comes back for a few seconds at a time leaves no time to lose)
                with trio.move_on_after(self._backoff):
                    await watch.wait_answering()
            else:
                await trio.sleep(self._backoff)
            self._backoff = min(self._backoff * 2, RESUME_BACKOFF_MAX_S)
            # a hung stage 1 would hold a new lane's handshake for the whole connect timeout: ping it first
            if self.watch is None or await self.watch.check():
                break
        live.resumes += 1
        if availability is not None:
            availability.resumed += 1
        log.info("head: session %d: resuming (replay %d: %d prompt + %d generated tokens)",
                 live.session_id, live.resumes, live.prompt_tokens, live.generated)

    def recovered(self) -> None:
        """The pipeline is whole again: a later failure starts a new window."""
        self.deadline = None
