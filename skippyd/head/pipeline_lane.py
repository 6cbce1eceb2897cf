"""A pipeline's lane for one generation: the head computes its slice, the hidden states go down the lane.

Each step's frame is sent as soon as the head's compute ends (a plain step
as the wire's compact decode frame, a step with drafts as a VerifyWindow),
before the run hands on the text of the token before it, so that work
overlaps the other stages' compute instead of adding to every token's time.
The predictions come back as the lane's client was configured, relayed or
directly (:mod:`skippyd.head.lane_client`).

Whatever ends the generation, :meth:`PipelineLane.end` stops the session down
the lane (time-bounded) before the lane goes back to the pool. A generation
cancelled mid-request first finishes that request (reads the reply or acks
stage 1 still owes), then sends Stop and waits for its ack, so every stage
has freed the session's slot before the head frees its own; only a lane that
cannot be finished in time (a half-written frame, a silent stage) is closed
instead, which makes stage 1 release the session when it notices.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import trio

from skippyd.head.errors import GenerationError, QueueTimeout
from skippyd.head.lane_client import InFlight, LaneClient, LaneServices, RelayedLane
from skippyd.head.lanes import Lane, LanePool, NoLaneAvailable, PoolDraining
from skippyd.head.prompt import PromptPart
from skippyd.head.sequence import STOP_TIMEOUT_S, HeadSequence
from skippyd.head.sink import GenerationSink
from skippyd.runtime.llama import TokenLogprobs
from skippyd.sampling import SamplingParams
from skippyd.stage.downstream import DownstreamError
from skippyd.telemetry import span
from skippyd.wire.messages import PrefillChunk, VerifyWindow

log = logging.getLogger("skippyd.head")


class PipelineLanes:
    """The lanes of a pipeline's head (a LaneSource): its pool, what their clients share, the request ids."""

    def __init__(self, pool: LanePool, services: LaneServices, new_request_id: Callable[[], int]):
        self.pool, self.services, self.new_request_id = pool, services, new_request_id

    def lane_for(self, sequence: HeadSequence, sampling: SamplingParams, sink: GenerationSink) -> PipelineLane:
        return PipelineLane(self, sequence, sampling)


class PipelineLane:
    """A generation in a pipeline (a GenerationLane): the lane it holds, and what outlives a replay."""

    def __init__(self, lanes: PipelineLanes, sequence: HeadSequence, sampling: SamplingParams):
        self.lanes, self.sequence, self.sampling = lanes, sequence, sampling
        self.session_id = sequence.live.session_id
        # the request id on the wire: a new one for each replay, so that a reply owed to an attempt given up
        # (a stopped final stage sends it once it runs again, on the token-return connection, which outlives
        # lanes) is told apart from the replay's own replies, which carry the same session id
        self.wire_request_id = sequence.live.request_id
        self.client: LaneClient | None = None
        self.acked_steps = 0  # direct return: the generation's decode steps stage 1 acknowledged (DirectLane)
        # a prediction came back: the sequence's next step follows at once (decode groups: Scheduler.back)
        self._back = functools.partial(sequence.scheduler.back, sequence.seq)
        self._prompt_tokens = self._prompt_us = 0  # the prompt's tokens computed so far, and their compute
        # windows in flight: when the last window alone in flight began (its round trip is measured), and the
        # positions the last answer confirmed
        self._window_began = 0.0
        self._confirmed = 0

    @property
    def logprobs(self) -> TokenLogprobs | None:
        return self.client.logprobs

    async def connect(self, deadline: float) -> None:
        sequence, live = self.sequence, self.sequence.live
        if live.resumes:
            self.wire_request_id = self.lanes.new_request_id()
        lane = await self._checkout(deadline)
        lane.session_id = self.session_id
        live.lane_id = lane.lane_id
        # held before it is configured: a configure that fails still gives the lane back (leave, end)
        self.client = RelayedLane(lane, self.lanes.services, session_id=self.session_id, request_id=live.request_id,
                                  wire_request_id=self.wire_request_id, stats=sequence.stats, clock=sequence.clock,
                                  acked_steps=self.acked_steps)
        self.client = await self.client.configure(self.sampling)
        self._prompt_tokens = self._prompt_us = 0

    async def _checkout(self, deadline: float) -> Lane:
        live, services = self.sequence.live, self.lanes.services
        try:
            with span("head.lane_wait", request=live.request_id, session=live.session_id):
                return await self.lanes.pool.checkout(deadline)
        except PoolDraining as exc:
            raise GenerationError(str(exc), retryable=True, status=503) from exc
        except NoLaneAvailable as exc:
            raise QueueTimeout(str(exc)) from exc
        except DownstreamError as exc:
            if services.watch is not None:
                services.watch.suspect()
            raise GenerationError(f"stage 1 is unreachable: {exc}", retryable=True, status=503,
                                  stage_failure=True) from exc

    async def restore(self, keys: np.ndarray) -> int:
        return await self.client.restore(keys)

    async def prompt_part(self, part: PromptPart, *, final: bool) -> int | None:
        sequence, client = self.sequence, self.client
        native_before = sequence.clock.native_us
        hidden = await sequence.compute_part(part, want_token=False)
        if part.media is None:  # what sizes the chunks: the head's compute per text token
            self._prompt_us += sequence.clock.native_us - native_before
            self._prompt_tokens += len(part.tokens)
        msg = PrefillChunk(self.wire_request_id, self.session_id, part.pos_start, part.tokens, hidden, final=final,
                           media=part.media, restore=sequence.take_restore_block(part))
        if not final:
            await client.send_chunk(msg)  # its ack may come later (up to the link's credit)
            return None
        self.lanes.services.chunker.observe_prefill(self._prompt_tokens, self._prompt_us)
        sent = await client.send(msg)
        await sequence.record()  # while the other stages compute
        token = await client.prediction(sent)
        self._back()
        return token

    @property
    def window_depth(self) -> int:
        """1, plus a window behind for each window's service time (the stages' compute, measured as the
        round trip less the link's) that the link's round trip covers, from a quarter of one on: on a link
        much shorter than the compute there is nothing to hide, and the void windows would cost compute.
        Only on a lane where each stage takes the next window while a later one computes the last (two
        stages, or direct return)."""
        client, services = self.client, self.lanes.services
        window_us = services.windows.round_trip_us
        if client is None or not client.pipelines_windows or window_us <= 0.0:
            return 1
        link_us = services.chunker.round_trip_us
        service_us = max(window_us - link_us, 1.0)
        return min(services.max_in_flight, 1 + max(0, math.ceil(link_us / service_us - 0.25)))

    async def begin(self, token: int, drafts: Sequence[int], *, chained: bool = False) -> InFlight:
        sequence, client = self.sequence, self.client
        pos = sequence.position
        if drafts or chained:
            window = np.array([token, *drafts], dtype=np.int32)
            if not chained:
                self._window_began = time.perf_counter()
            hidden = await sequence.compute(window, pos, want_token=False, window=True)
            return await client.send(VerifyWindow(self.wire_request_id, self.session_id, pos, window, hidden,
                                                  chained))
        tokens = np.array([token], dtype=np.int32)
        prepared = client.prepare_step(pos, token)  # the step's frame goes as the compute ends (see Job.out)
        hidden = await sequence.compute(tokens, pos, want_token=False, out=prepared)
        sent = await client.send_step(pos, tokens, hidden, prepared)
        if sequence.batched:
            # the other sessions of this batch send their steps before any of them goes on (streams its
            # text): back to back, they reach the next stage within its gather window and are decoded there
            # as one batch too. One by one, with each one's text in between, they could take longer, and a
            # group split on stage 1 comes back to the head split too.
            await trio.lowlevel.checkpoint()
        return sent

    async def finish(self, step: InFlight) -> list[int]:
        if type(step.msg) is not VerifyWindow:
            token = await self.client.prediction(step)
            self._back()
            return [token]
        predicted = await self.client.window_predictions(step, dropped_ok=step.msg.chained)
        self._back()
        if not predicted:
            return predicted  # dropped: the sequence was trimmed when the answer ahead of it came (abandon)
        window = step.msg
        if not window.chained and self._window_began:  # alone in flight as it began: its whole round trip
            self.lanes.services.windows.observe((time.perf_counter() - self._window_began) * 1e6)
            self._window_began = 0.0
        self._confirmed = window.pos_start + len(predicted)
        if len(predicted) < len(window.tokens):
            # a rejected draft: the head's sequence keeps the window's token and its accepted drafts (and drops
            # whatever was computed behind them); the other stages trim at the next message (positions are
            # authoritative)
            await self.sequence.keep(self._confirmed)
        return predicted

    async def abandon(self) -> None:
        await self.sequence.keep(self._confirmed)

    async def leave(self) -> None:
        """Drop the lane that carried the failed pipeline (closing it releases whatever is left downstream)."""
        client, self.client = self.client, None
        if client is not None:
            self.acked_steps = client.acked_steps  # counted over the generation, not the lane
            client.close()
            client.lane.dirty = True
            with trio.CancelScope(shield=True):
                await self.lanes.pool.checkin(client.lane)

    async def end(self) -> None:
        client, self.client = self.client, None
        if client is None:
            return
        client.close()
        stopped = False
        try:
            with trio.move_on_after(STOP_TIMEOUT_S) as bounded:
                stopped = await client.stop()
            self.sequence.stages_cached = client.stages_cached
            if bounded.cancelled_caught:
                log.warning("head: stop for session %d not acknowledged within %g s: closing lane %d",
                            self.session_id, STOP_TIMEOUT_S, client.lane.lane_id)
        finally:
            if not stopped:
                client.lane.dirty = True  # closing the lane makes stage 1 (and every later stage) release the session
            await self.lanes.pool.checkin(client.lane)
