"""A generation's end of its lane: send a request or a step, await its reply or its prediction.

How predictions come back is chosen once, when the generation is configured
on the lane (:meth:`LaneClient.configure`):

* :class:`RelayedLane`: every prediction comes back on the lane, relayed by
  each stage in turn.
* :class:`DirectLane` (three or more stages, the head's ``hub`` listening,
  the final stage willing): each prediction-bearing message (the final
  prefill chunk, every decode step) is sent without waiting for its reply;
  its ack, if it owes one, is collected from the lane (it comes from stage 1,
  before the prediction could), and the prediction arrives on the session's
  channel from the :class:`TokenReturnHub`. If the final stage answers
  DIRECT_RETURN_UNAVAILABLE the generation configures again without it.

Liveness (``watch``, a :class:`~skippyd.head.liveness.StageWatch`): every
wait on the pipeline is watched, so a stage that stops answering pings
fails the wait within INTERVAL_S plus the ping's deadline (1.3 s for a stage
that was answering at once, at most INTERVAL_S + PING_TIMEOUT_MAX_S for one
that was answering late), whatever the reply deadline. Any lane
failure becomes a retryable :class:`GenerationError` (a stage failure), and
a lane that cannot be trusted any more is marked ``dirty`` (closed on
return, which makes stage 1 release the session).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NoReturn

import attrs
import numpy as np
import trio

from skippyd.head.chunking import PrefillChunker
from skippyd.head.errors import GenerationError, pipeline_failed, stage_error
from skippyd.head.lanes import Lane
from skippyd.head.liveness import StageDown, StageWatch
from skippyd.head.step_clock import StepClock
from skippyd.head.token_return import LaneSpoke, ReturnLost, TokenReturnHub
from skippyd.runtime.llama import TokenLogprobs
from skippyd.sampling import SamplingParams
from skippyd.stage.downstream import DownstreamError
from skippyd.telemetry import span
from skippyd.wire.messages import (
    TRUSTED,
    ConfigureGeneration,
    DecodeStep,
    ErrorCode,
    ErrorReply,
    PredictedToken,
    PredictedTokenLogprobs,
    PredictedTokens,
    PrefillChunk,
    RestorePrefix,
    StatsTotal,
    Stop,
    Stopped,
)
from skippyd.wire.stream import PreparedFrame

log = logging.getLogger("skippyd.head")

_trusted_step = TRUSTED[DecodeStep]

# direct return: a generation's first decode steps are acknowledged by stage 1 (their round trips, less the
# stages' compute that the acks report, size later prompts' prefill chunks); the rest go with DIRECT_RETURN
ACKED_DECODE_STEPS = 4


class TokenPaths:
    """Where the predictions of pipeline generations came from, and the configures that fell back to relaying
    (logged when direct return stops or starts working, not once per generation)."""

    def __init__(self) -> None:
        self.direct = 0
        self.relayed = 0
        self.fallbacks = 0
        self._fallback_reason: str | None = None

    def note_configured(self, fallback_reason: str | None) -> None:
        if fallback_reason is not None:
            self.fallbacks += 1
            if fallback_reason != self._fallback_reason:
                log.warning("head: %s; using the relayed path", fallback_reason)
        elif self._fallback_reason is not None:
            log.info("head: direct token return works again")
        self._fallback_reason = fallback_reason

    def describe(self) -> dict:
        return {"direct": self.direct, "relayed": self.relayed, "fallbacks": self.fallbacks}


class WindowTimes:
    """A verify window's round trip while alone in flight, from its begin to its answer (an average over the
    head's generations): with the link's own round trip, what sizes the windows kept in flight."""

    EWMA = 0.2  # weight of the newest window

    def __init__(self) -> None:
        self.round_trip_us = 0.0

    def observe(self, us: float) -> None:
        old = self.round_trip_us
        self.round_trip_us = us if old == 0.0 else (1 - self.EWMA) * old + self.EWMA * us


@attrs.frozen
class LaneServices:
    """What the head's lane clients share: stage 1's liveness, the token-return hub, the prefill chunker
    (fed the decode steps' round trips) and the token-path counters."""

    watch: StageWatch | None
    hub: TokenReturnHub | None
    chunker: PrefillChunker
    paths: TokenPaths
    n_embd: int
    max_in_flight: int = 4  # verify windows a generation keeps in flight at most (runtime.speculate_in_flight)
    windows: WindowTimes = attrs.field(factory=WindowTimes)

    @property
    def wants_direct_return(self) -> bool:
        return self.hub is not None and self.hub.address is not None


@attrs.frozen
class InFlight:
    """A request sent down the lane whose reply (or prediction) is still owed."""

    msg: object
    bytes: int
    write_us: int
    started: float = 0.0  # direct return: when the send began
    acked: bool = True  # ... and whether stage 1 acknowledges it on the lane (not a DIRECT_RETURN decode step)


class LaneClient:
    """A lane carrying one generation (one attempt of it: a replay gets a new client)."""

    def __init__(self, lane: Lane, services: LaneServices, *, session_id: int, request_id: int,
                 wire_request_id: int, stats: StatsTotal, clock: StepClock, acked_steps: int = 0):
        self.lane = lane
        self.link = lane.link
        self.services = services
        self.watch = services.watch
        self.chunker = services.chunker
        self.paths = services.paths
        self.session_id = session_id
        self.request_id = request_id  # the engine's, as spans name it
        self.wire_request_id = wire_request_id  # this attempt's, on the wire
        self.logprobs: TokenLogprobs | None = None  # the last prediction's (a session configured with logprobs)
        self.stats = stats  # every stage's reports for the generation, merged as they come
        self.clock = clock
        # direct return: the generation's decode steps so far that stage 1 acknowledged (see DirectLane)
        self.acked_steps = acked_steps
        self.n_embd = services.n_embd  # a decode step's activation's width
        self.closed = False  # the generation left the lane
        # the Stop's answer: per stage from stage 1 on, the leading prompt positions it held rather than computed
        self.stages_cached: tuple[int, ...] = ()
        self._sending = _PipelineFailures(self, None)
        self._lane_watched: _PipelineFailures | None = None  # see _watched

    # ------------------------------------------------------------ configure
    async def configure(self, sampling: SamplingParams) -> LaneClient:
        """Open the session down the lane, with direct token return if the pipeline offers it. Called on the
        RelayedLane made for a lane just checked out; returns the client for the rest of the attempt: this
        one, or a DirectLane."""
        msg = ConfigureGeneration(self.wire_request_id, self.session_id, sampling)
        hub = self.services.hub
        if self.services.wants_direct_return:
            returns = hub.open_session(self.session_id, self.wire_request_id)
            try:
                reply = await self.request(attrs.evolve(msg, direct_return=True),
                                           tolerate=ErrorCode.DIRECT_RETURN_UNAVAILABLE)
            except BaseException:
                hub.close_session(self.session_id)
                raise
            if not isinstance(reply, ErrorReply):
                self.paths.note_configured(None)
                return DirectLane(self, hub, returns)
            hub.close_session(self.session_id)
            self.paths.note_configured(reply.message)
        await self.request(msg)
        return self

    # ------------------------------------------------------------ requests (a reply on the lane)
    async def request(self, msg, *, tolerate: ErrorCode | None = None):
        """One request down the lane. An interruption leaves the reply owed (the link knows): :meth:`stop`
        collects it before it sends Stop.

        An ErrorReply becomes a GenerationError, except one with the code ``tolerate``, which is returned.
        """
        return await self._finish(await self._begin(msg), tolerate=tolerate)

    async def _begin(self, msg, prepared: PreparedFrame | None = None) -> InFlight:
        with self._sending:
            sent, write_us = await self.link.begin(msg, prepared)
        return InFlight(msg, sent, write_us)

    async def _finish(self, sent: InFlight, *, tolerate: ErrorCode | None = None):
        msg = sent.msg
        clock = self.clock
        with self._watched(), span("head.hop", request=self.request_id, session=self.session_id,
                                   kind=type(msg).__name__, lane=self.lane.lane_id):
            cpu = time.thread_time()
            reply, wait_us = await self.link.finish()
            clock.waited_cpu_s += time.thread_time() - cpu
        clock.waited_us += wait_us
        if isinstance(msg, DecodeStep):
            self.chunker.observe_round_trip(wait_us, reply.stats.compute_us + reply.stats.queue_us)
        # the head's own hop (stage_count 0: it is not another stage's report)
        self.stats.add_hop(sent.write_us, wait_us, sent.bytes)
        self.stats.add(reply.stats)
        if isinstance(reply, ErrorReply):
            if reply.code == tolerate:
                return reply
            raise stage_error(reply)
        return reply

    # ------------------------------------------------------------ the prompt
    async def restore(self, keys: np.ndarray) -> int:
        """Ask every stage to restore the longest prefix of the positions keyed ``keys`` (token ids, media
        keys) it has cached; how many positions all of them hold now (see RestorePrefix in
        skippy-protocol(7))."""
        reply = await self.request(RestorePrefix(self.wire_request_id, self.session_id, keys))
        return int(reply.restored)

    async def send_chunk(self, msg: PrefillChunk) -> None:
        """A prompt chunk that is not the last: its ack may come later (up to the link's credit)."""
        with self._watched(), span("head.forward_write", request=self.request_id, session=self.session_id,
                                   pos=msg.pos_start, tokens=len(msg.tokens)):
            await self.link.send_deferred(msg)

    # ------------------------------------------------------------ predictions (RelayedLane, DirectLane)
    async def send(self, msg) -> InFlight:
        """Send a prediction-bearing message (the final prefill chunk); its prediction is then owed."""
        raise NotImplementedError

    def prepare_step(self, pos: int, token: int) -> PreparedFrame | None:
        """The frame of the decode step for `token` at `pos`, for the compute to write its activation into
        (see Job.out); None if the link cannot take one now. :meth:`send_step` sends it."""
        raise NotImplementedError

    async def send_step(self, pos: int, tokens: np.ndarray, hidden: np.ndarray,
                        prepared: PreparedFrame | None) -> InFlight:
        """Send the decode step :meth:`prepare_step` framed; its prediction is then owed."""
        raise NotImplementedError

    async def prediction(self, sent: InFlight) -> int:
        """The predicted token of a message sent with :meth:`send` or :meth:`send_step`."""
        raise NotImplementedError

    async def window_predictions(self, sent: InFlight, *, dropped_ok: bool = False) -> list[int]:
        """The final stage's answer to a VerifyWindow sent with :meth:`send`: the drafts it accepted, then the
        next token; none if it dropped the window (``dropped_ok``: a chained one, else an error)."""
        raise NotImplementedError

    @property
    def pipelines_windows(self) -> bool:
        """Each stage takes the next message while the stages after it compute the one before, so windows
        sent behind one another overlap: not on a relayed lane through a middle stage, which waits for each
        answer before it reads on."""
        raise NotImplementedError

    # ------------------------------------------------------------ the end
    def close(self) -> None:
        """The generation leaves the lane (it ends, or resumes on another)."""
        self.closed = True

    async def stop(self) -> bool:
        """Finish the request a cancellation interrupted, then Stop the session; True once stage 1
        acknowledged the Stop (its relay means every later stage did too), with each stage's prompt positions
        held rather than computed (``stages_cached``)."""
        lane, link = self.lane, self.link
        if lane.dirty or link is None or link.broken:
            return False  # known to be wedged or gone: a Stop would only wait for it
        try:
            if not link.settled:
                await link.settle()
            reply, *_ = await link.request(Stop(self.wire_request_id, self.session_id))
        except DownstreamError as exc:
            log.warning("head: stop for session %d failed: %s", self.session_id, exc)
            return False
        self.stats.add(reply.stats)  # with the reports of the decode steps that owed no ack
        if not isinstance(reply, Stopped):
            log.warning("head: stop for session %d answered with %s", self.session_id, reply)
            return False
        self.stages_cached = reply.cached
        return True

    # ------------------------------------------------------------ liveness
    def _watched(self) -> _PipelineFailures:
        """Around a wait on the lane: a lane failure, or stage 1 not answering liveness pings, becomes a
        retryable GenerationError (a stage failure). A failed ping gives the lane up (its link's
        ``interrupt``), which wakes the wait without a cancel scope per wait."""
        link = self.link
        if not link.interruptible:  # its waiter cancels a scope of its own, which is entered once only
            return _PipelineFailures(self, self.watch)
        kept = self._lane_watched  # one while no check has failed it: entered for every token
        if kept is None or kept.failed:
            kept = self._lane_watched = _PipelineFailures(self, self.watch, link.interrupt)
        return kept


def _logprobs_of(reply: PredictedToken) -> TokenLogprobs | None:
    """The logprobs a prediction carries (a session configured with them), or None."""
    if isinstance(reply, PredictedTokenLogprobs):
        return TokenLogprobs(int(reply.token), reply.logprob, reply.top)
    return None


def _window_tokens(sent: InFlight, reply, who: str, dropped_ok: bool) -> list[int]:
    """The tokens of a VerifyWindow's answer: one more than the drafts accepted, at most one per position;
    none if the final stage dropped it (``dropped_ok``: a chained window)."""
    least = 0 if dropped_ok else 1
    if not isinstance(reply, PredictedTokens) or not least <= len(reply.tokens) <= len(sent.msg.tokens):
        got = type(reply).__name__ if not isinstance(reply, PredictedTokens) else f"{len(reply.tokens)} tokens"
        raise GenerationError(f"{who} answered a verify window of {len(sent.msg.tokens)} positions with {got}",
                              status=502)
    return reply.tokens.tolist()


class RelayedLane(LaneClient):
    """Every prediction comes back on the lane, relayed by each stage in turn."""

    async def send(self, msg) -> InFlight:
        return await self._begin(msg)

    def prepare_step(self, pos: int, token: int) -> PreparedFrame | None:
        return self.link.prepare_step(self.wire_request_id, self.session_id, pos, token, False, self.n_embd)

    async def send_step(self, pos: int, tokens: np.ndarray, hidden: np.ndarray,
                        prepared: PreparedFrame | None) -> InFlight:
        # built without the class's checks: the head made every value (its ids, its position, an int32 array of
        # its token, the context's float32 rows of the hidden state), and the checks would cost as much again
        # as building and sending the frame
        return await self._begin(_trusted_step(self.wire_request_id, self.session_id, pos, tokens, hidden, False),
                                 prepared)

    async def prediction(self, sent: InFlight) -> int:
        reply = await self._finish(sent)
        if not isinstance(reply, PredictedToken):
            raise GenerationError(f"stage 1 answered {type(sent.msg).__name__} with {type(reply).__name__}")
        self.paths.relayed += 1
        self.logprobs = _logprobs_of(reply)
        return int(reply.token)

    async def window_predictions(self, sent: InFlight, *, dropped_ok: bool = False) -> list[int]:
        reply = await self._finish(sent)
        return _window_tokens(sent, reply, "stage 1", dropped_ok)

    @property
    def pipelines_windows(self) -> bool:
        peer = self.link.peer
        return peer.layer_end >= peer.n_layer  # stage 1 is the final stage


class DirectLane(LaneClient):
    """Predictions come on the session's channel from the token-return hub (see the module's docstring)."""

    def __init__(self, configured: LaneClient, hub: TokenReturnHub, returns: trio.MemoryReceiveChannel):
        super().__init__(configured.lane, configured.services, session_id=configured.session_id,
                         request_id=configured.request_id, wire_request_id=configured.wire_request_id,
                         stats=configured.stats, clock=configured.clock, acked_steps=configured.acked_steps)
        self.hub = hub
        self.returns = returns  # this session's predictions
        self._returns_watched: _PipelineFailures | None = None
        self._silent = False  # the lane is watched for anything stage 1 says (see _unacked_step)
        self._unacked = False  # the step prepare_step framed owes no ack
        self._acks_owed = 0  # messages in flight whose ack stage 1 owes (windows behind one another: several)

    async def send(self, msg) -> InFlight:
        # stage 1 acks as soon as it has forwarded the message, so the ack arrives before the prediction can
        started = time.perf_counter()
        with self._sending:
            sent, write_us = await self.link.send_expecting_ack(msg)
        self._acks_owed += 1
        return InFlight(msg, sent, write_us, started, True)

    def prepare_step(self, pos: int, token: int) -> PreparedFrame | None:
        unacked = self._unacked = self._unacked_step()
        return self.link.prepare_step(self.wire_request_id, self.session_id, pos, token, unacked, self.n_embd)

    async def send_step(self, pos: int, tokens: np.ndarray, hidden: np.ndarray,
                        prepared: PreparedFrame | None) -> InFlight:
        unacked = self._unacked
        msg = _trusted_step(self.wire_request_id, self.session_id, pos, tokens, hidden, unacked)  # see LaneClient
        started = time.perf_counter()
        with self._sending:
            if unacked:
                sent, write_us = await self.link.send(msg, prepared)
            else:
                sent, write_us = await self.link.send_expecting_ack(msg, prepared)
                self._acks_owed += 1
        return InFlight(msg, sent, write_us, started, not unacked)

    def _unacked_step(self) -> bool:
        """Send this decode step with DIRECT_RETURN, which stage 1 does not acknowledge? Not the first
        ACKED_DECODE_STEPS; from then on, once the lane is watched for anything stage 1 says (an Error
        instead of forwarding the step): the head then wakes once per token, for the prediction, instead
        of twice."""
        link = self.link
        if self._silent and link.watching_silence:
            return True
        if self.acked_steps < ACKED_DECODE_STEPS or not link.settled:
            self.acked_steps += 1
            return False
        hub, session_id, lane_id = self.hub, self.session_id, self.lane.lane_id

        def spoke() -> None:
            if not self.closed:  # not a lane this session has left (resumed on another)
                hub.wake(session_id, LaneSpoke(lane_id))

        if not link.watch_silence(spoke):
            return False
        self._silent = True
        return True

    async def prediction(self, sent: InFlight) -> int:
        item = await self._returned(sent)
        if not isinstance(item, PredictedToken):
            raise GenerationError(f"the token-return connection answered {type(sent.msg).__name__} with "
                                  f"{type(item).__name__}")
        self.paths.direct += 1
        self.logprobs = _logprobs_of(item)
        return int(item.token)

    async def window_predictions(self, sent: InFlight, *, dropped_ok: bool = False) -> list[int]:
        return _window_tokens(sent, await self._returned(sent), "the token-return connection", dropped_ok)

    pipelines_windows = True  # every middle stage acknowledges a window once it forwarded it

    async def _returned(self, sent: InFlight):
        """What the token-return connection brought for `sent` (an ErrorReply raised as a GenerationError)."""
        msg, lane, link, clock = sent.msg, self.lane, self.link, self.clock
        acked = sent.acked
        if acked:
            self._acks_owed -= 1
            with self._watched(), span("head.hop", request=self.request_id, session=self.session_id,
                                       kind=type(msg).__name__, lane=lane.lane_id, direct=1):
                cpu = time.thread_time()
                await link.drain(keep=self._acks_owed)  # (the acks of the windows sent behind it come later)
                clock.waited_cpu_s += time.thread_time() - cpu
            folded, error = link.take_folded()
            self.stats.add(folded)
            if error is not None:
                raise stage_error(error)
        hub, session_id = self.hub, self.session_id
        with span("head.token_return_wait", request=self.request_id, session=session_id):
            with self._watched_returns():
                hub.begin_wait(session_id)  # the reply deadline: kept by the hub (keep_deadlines)
                cpu = time.thread_time()
                try:
                    item = await self.returns.receive()
                finally:
                    hub.end_wait(session_id)
                    clock.waited_cpu_s += time.thread_time() - cpu
        wait_us = int((time.perf_counter() - sent.started) * 1e6) - sent.write_us
        clock.waited_us += wait_us
        if isinstance(item, ReturnLost):  # the connection was lost, or the prediction is overdue
            lane.dirty = True  # the final stage may be gone or wedged: close the lane, no Stop
            raise pipeline_failed(item)
        if isinstance(item, LaneSpoke):
            await self._read_unasked(item)
        if isinstance(msg, DecodeStep) and acked:  # the middle stages' compute: from the acks just folded
            others = folded.compute_us + folded.queue_us + item.stats.compute_us + item.stats.queue_us
            self.chunker.observe_round_trip(wait_us, others)
        self.stats.add_hop(sent.write_us, wait_us, sent.bytes)
        self.stats.add(item.stats)
        if isinstance(item, ErrorReply):
            raise stage_error(item)
        return item

    async def _read_unasked(self, spoke: LaneSpoke) -> NoReturn:
        """Stage 1 spoke on the lane, where the decode steps owe nothing: read what it said, and fail."""
        with self._watched():
            reply = await self.link.read_unasked()
        self.stats.add(reply.stats)
        if isinstance(reply, ErrorReply):
            raise stage_error(reply)
        self.lane.dirty = True
        raise GenerationError(f"stage 1 sent {type(reply).__name__} on lane {spoke.lane_id}, where nothing was "
                              f"owed", status=502)

    def close(self) -> None:
        if not self.closed:
            self.hub.close_session(self.session_id)
        self.closed = True

    def _watched_returns(self) -> _PipelineFailures:
        """Around the wait for a prediction on the token-return connection: as :meth:`_watched`, a failed
        ping waking the wait through the hub (a ReturnLost on the session's channel)."""
        kept = self._returns_watched
        if kept is None or kept.failed:
            kept = self._returns_watched = _PipelineFailures(self, self.watch, self._interrupt_returns)
        return kept

    def _interrupt_returns(self, why: str) -> None:
        self.hub.interrupt(self.session_id, why)


class _PipelineFailures:
    """Around a wait on the pipeline (with ``watch``) or a send down the lane (without: a send waits on no
    stage): a lane failure, or a stage that stopped answering pings, becomes a retryable GenerationError (a
    stage failure). A class, not a generator: entered two or three times per decode step."""

    __slots__ = ("client", "waiter")

    def __init__(self, client: LaneClient, watch: StageWatch | None, interrupt: Callable[[str], None] | None = None):
        self.client = client
        self.waiter = watch.watching(interrupt) if watch is not None else None

    @property
    def failed(self) -> bool:
        """A liveness check failed a wait in it: it fails every later one, so make a new one."""
        return self.waiter is not None and self.waiter.failure is not None

    def __enter__(self) -> None:
        if self.waiter is not None:
            self.waiter.__enter__()

    def __exit__(self, etype, exc, tb) -> bool:
        if self.waiter is not None:
            try:
                if self.waiter.__exit__(etype, exc, tb):
                    return True
            except StageDown as down:
                exc = down
        if isinstance(exc, StageDown):
            self.client.lane.dirty = True  # a Stop would wait for the same silent stage: close the lane instead
            raise pipeline_failed(exc) from exc
        if isinstance(exc, DownstreamError):
            watch = self.client.watch
            if watch is not None:
                watch.suspect()  # dead or cut off? status learns it now, not at the next generation
            raise pipeline_failed(exc) from exc
        return False
