"""The two roles of a connection to a stage, chosen once when it starts (:func:`handlers_for`).

- :class:`FinalStage`: computes and samples; answers on the lane, or for a
  session with direct token return on the token-return connection to the head.
- :class:`MiddleStage`: computes and forwards on its own downstream link (so a
  lane is a chain through the whole pipeline); relays the next stage's answers,
  or for a session with direct token return acknowledges at once.

What both share, and the handling of each message kind, is
:class:`~skippyd.stage.handlers.StageHandlers`.
"""

from __future__ import annotations

import logging
import time

import attrs
import numpy as np
import trio

from skippyd.runtime import llama
from skippyd.stage.downstream import DownstreamError, DownstreamLink
from skippyd.stage.execution import Job
from skippyd.stage.handlers import AnswerPath, ReplyError, StageHandlers, returns_only
from skippyd.stage.loop_lag import PingDeadline
from skippyd.stage.sessions import StageSession
from skippyd.stage.token_return import TokenReturnLost
from skippyd.telemetry import span
from skippyd.wire.codec import REPLY_COMPUTE_US_AT, frame_bytes
from skippyd.wire.messages import (
    MAX_CACHE_REPORT_STAGES,
    NO_STATS,
    TRUSTED,
    Ack,
    CacheQuery,
    CacheReport,
    ConfigureGeneration,
    DecodeStep,
    ErrorCode,
    ErrorReply,
    Ping,
    PredictedToken,
    PredictedTokenLogprobs,
    PredictedTokens,
    PrefillChunk,
    PrefixRestored,
    Reply,
    RestorePrefix,
    StageQuery,
    StageReport,
    StageStats,
    Stop,
    Stopped,
    VerifyWindow,
    merge,
    with_stats,
)
from skippyd.wire.stream import PreparedFrame

log = logging.getLogger("skippyd.stage")

# A middle stage k relays a Ping and waits PING_RELAY_S ** k times what the head would (1 s for an answer that
# comes at once, see PingDeadline) for the answer of the stages after it: less than whoever pinged it waits, so
# the stage before a hung one is the one that names it.
PING_RELAY_S = 0.8
_NO_TOKENS = np.empty(0, dtype=np.int32)  # a dropped window's answer


class FinalStage(StageHandlers):
    """The final stage: samples each session's next token and answers with it, on the lane or (direct
    token return) on the token-return connection to the head."""

    want_token = True

    def __init__(self, core, conn_id: int, out: trio.abc.SendStream, nursery: trio.Nursery | None = None):
        super().__init__(core, conn_id, out, nursery)
        self.on_lane = AnswerPath("on the lane", self._prepare_on_lane, self._predict_on_lane)
        self.on_return = AnswerPath("on the token-return connection", self._prepare_on_return,
                                    self._predict_on_return)
        self.default_answer = self.on_lane

    async def on_configure(self, msg: ConfigureGeneration) -> None:
        session = self._session(msg, create=True)
        session.request_id = msg.request_id
        session.prompt_cached = None  # a generation begins: its prompt is to come
        self._deferred.pop(msg.session_id, None)
        if msg.direct_return:
            await self._check_direct_return(session)
        session.direct_return = msg.direct_return
        session.answer = self.on_return if msg.direct_return else self.on_lane
        if session.sampler is not None:
            session.sampler.close()
            session.sampler = None
        try:
            if msg.sampling.guided:  # a constraint compiles (and the vocabulary's first matcher is made) off the loop
                session.sampler = await trio.to_thread.run_sync(llama.sampler_for, self.core.model, msg.sampling)
            else:
                session.sampler = llama.sampler_for(self.core.model, msg.sampling)
        except llama.InvalidArgumentError as exc:  # the head checks them: a peer of another make sent these
            raise ReplyError(ErrorCode.UNSUPPORTED_REQUEST, str(exc)) from exc
        await self.reply(Ack(msg.request_id, msg.session_id, stats=self._own_stats()))

    async def on_ping(self, msg: Ping) -> None:
        """Answer for this stage (the last one)."""
        await self.reply(Ack(msg.request_id, 0, stats=self._own_stats()))

    async def _pass_down(self, msg, unreported: StageStats = NO_STATS) -> None:
        await self.reply(Ack(msg.request_id, msg.session_id, stats=self._own_stats()))

    async def _pass_stop(self, msg: Stop, cached: int, unreported: StageStats) -> None:
        await self.reply(Stopped(msg.request_id, msg.session_id, (cached,), stats=self._own_stats()))

    async def _pass_restore(self, msg: RestorePrefix, restored: int) -> None:
        await self.reply(PrefixRestored(msg.request_id, msg.session_id, restored, stats=self._own_stats()))

    async def on_cache_query(self, msg: CacheQuery) -> None:
        await self.reply(CacheReport(msg.request_id, 0, (self._cache_report(msg),), stats=self._own_stats()))

    async def on_stage_query(self, msg: StageQuery) -> None:
        started = time.perf_counter_ns()
        await self.reply(StageReport(msg.request_id, 0, (self._stage_load(started),), stats=self._own_stats()))

    async def _check_direct_return(self, session: StageSession) -> None:
        """Direct return needs a live token-return connection (dialed now if need be); without one the
        configure fails with DIRECT_RETURN_UNAVAILABLE and the head uses the relayed path."""
        link = self.core.token_return
        if link is not None and await link.ensure():
            return
        await self.core.release(session)
        raise ReplyError(ErrorCode.DIRECT_RETURN_UNAVAILABLE,
                         f"direct token return unavailable: {self.core.no_direct_return()}")

    # ------------------------------------------------------------------ answer paths
    def _prediction(self, msg, job: Job) -> PredictedToken:
        # the final stage's reply to every token: its ids were decoded from a frame (u64 by its format) and the
        # token is the sampler's (a vocabulary id), so attrs' checks are spared
        sampler = job.sampler
        if isinstance(sampler, llama.GuidedSampler) and sampler.top_n is not None and sampler.last is not None:
            last = sampler.last
            return PredictedTokenLogprobs(msg.request_id, msg.session_id, int(job.result), self._own_stats(job),
                                          last.logprob, last.top)
        return TRUSTED[PredictedToken](msg.request_id, msg.session_id, int(job.result), self._own_stats(job))

    def _prepare_on_lane(self, session: StageSession, msg: DecodeStep) -> PreparedFrame | None:
        # the token and the compute's times are the compute's to fill in; a guided session's are sampled in Python
        if isinstance(session.sampler, llama.GuidedSampler):
            return None
        frame = frame_bytes(TRUSTED[PredictedToken](msg.request_id, msg.session_id, 0,
                                                    StageStats.single(self.core.index)))
        return PreparedFrame.for_stream(self.out, frame, 0, REPLY_COMPUTE_US_AT)

    async def _predict_on_lane(self, session: StageSession, msg, job: Job) -> None:
        session.generated += 1
        await self.reply(self._prediction(msg, job), job.out)

    def _prepare_on_return(self, session: StageSession, msg: DecodeStep) -> PreparedFrame | None:
        if isinstance(session.sampler, llama.GuidedSampler):
            return None
        frame = frame_bytes(TRUSTED[PredictedToken](msg.request_id, msg.session_id, 0,
                                                    StageStats.single(self.core.index)))
        return self.core.token_return.prepare(frame, REPLY_COMPUTE_US_AT)

    async def on_verify_window(self, msg: VerifyWindow) -> None:
        """A chained window that does not start where the last window's answer left the session (a draft
        before it was rejected, or its first token was not the one predicted) is dropped: answered with no
        tokens, neither computed nor sampled here (its random draws stay for the tokens that are kept). The
        stages before this one computed it; the next message's position trims them."""
        if msg.chained:
            session = self._session(msg, create=False)
            if session.follows != (msg.pos_start, int(msg.tokens[0])):
                self._take_deferred(msg.session_id)
                self.core.counters.windows_dropped += 1
                await self._send_window_answer(session, PredictedTokens(msg.request_id, msg.session_id, _NO_TOKENS,
                                                                        self._own_stats()))
                return
        await super().on_verify_window(msg)

    async def _answer_window(self, session: StageSession, msg: VerifyWindow, job: Job) -> None:
        """The window's PredictedTokens (the drafts accepted, then the next token), on the lane or, for a
        direct-return session, on the token-return connection with an Ack on the lane."""
        tokens = job.result
        session.generated += len(tokens)
        session.follows = (msg.pos_start + len(tokens), int(tokens[-1]))
        await self._send_window_answer(session, PredictedTokens(msg.request_id, msg.session_id,
                                                                np.asarray(tokens, dtype=np.int32),
                                                                self._own_stats(job)))

    async def _send_window_answer(self, session: StageSession, reply: PredictedTokens) -> None:
        if not session.direct_return:
            await self.reply(reply)
            return
        try:
            await self.core.token_return.send(reply)
        except TokenReturnLost as exc:
            raise ReplyError(ErrorCode.DOWNSTREAM_FAILED, f"stage {self.core.index}: {exc}") from exc
        await self.reply(Ack(reply.request_id, reply.session_id, stats=NO_STATS))

    async def _predict_on_return(self, session: StageSession, msg, job: Job) -> None:
        """The prediction goes to the head on the token-return connection (with this stage's report); the
        lane gets a plain Ack, unless the message says that the upstream stage expects none (a decode step
        with DIRECT_RETURN)."""
        session.generated += 1
        token = self._prediction(msg, job)
        try:
            await self.core.token_return.send(token, job.out)
        except TokenReturnLost as exc:
            raise ReplyError(ErrorCode.DOWNSTREAM_FAILED, f"stage {self.core.index}: {exc}") from exc
        if returns_only(msg):
            self._returns_only["answered"] += 1
        else:
            await self.reply(TRUSTED[Ack](msg.request_id, msg.session_id, NO_STATS))  # every token: as above

    # ------------------------------------------------------------------ failures
    async def _failed(self, msg, error: ErrorReply) -> None:
        if not returns_only(msg):  # those are answered on the token-return connection only
            await self.reply(error)
        await self._report_on_return(msg, error)

    async def _report_on_return(self, msg, error: ErrorReply) -> None:
        """A failed prediction of a direct-return session is reported to the head on the token-return
        connection too (the head waits there; the lane's error reaches it later). So is the failure of a
        session this stage does not know: the head drops a reply for a session not waiting."""
        link = self.core.token_return
        if link is None or not link.connected or not isinstance(msg, (DecodeStep, PrefillChunk, VerifyWindow)):
            return
        if isinstance(msg, PrefillChunk) and not msg.final:
            return
        session = self.core.sessions.get(self.conn_id, msg.session_id)
        if session is not None and not session.direct_return and not returns_only(msg):
            return
        try:
            await link.send(error)
        except TokenReturnLost:
            pass  # the head learns from the lost connection


class MiddleStage(StageHandlers):
    """A stage before the final one: forwards each computed message on its own downstream link ``down`` and
    relays the next stage's answer, or (direct token return) acknowledges at once."""

    def __init__(self, core, conn_id: int, out: trio.abc.SendStream, nursery: trio.Nursery | None = None, *,
                 down: DownstreamLink | None = None):
        super().__init__(core, conn_id, out, nursery)
        self.down = down
        self.relayed = AnswerPath("relayed", self._prepare_nothing, self._relay_answer)
        self.direct = AnswerPath("forwarded, direct return", self._prepare_forward, self._forward_direct)
        self.default_answer = self.relayed
        self.ping_deadline = PingDeadline(scale=PING_RELAY_S ** core.index)  # below what its upstream waits

    async def aclose(self) -> None:
        if self.down is not None:
            await self.down.aclose()  # the next stage then releases this lane's sessions too

    async def on_configure(self, msg: ConfigureGeneration) -> None:
        await self._ensure_downstream()
        session = self._session(msg, create=True)
        session.request_id = msg.request_id
        session.prompt_cached = None  # a generation begins: its prompt is to come
        self._deferred.pop(msg.session_id, None)
        reply = await self._relay(msg, None)
        session.direct_return = msg.direct_return and isinstance(reply, Ack)
        session.answer = self.direct if session.direct_return else self.relayed

    async def on_ping(self, msg: Ping) -> None:
        """Answer for this stage and every stage after it (the ping is relayed). A stage computes in a worker
        thread, so a busy one answers at once; one that does not answer in time is named in a
        DOWNSTREAM_FAILED reply (by dispatch), and this connection ends (a reply is owed on its link)."""
        await self._ensure_downstream()  # the next stage restarted since the last ping: reconnect first
        wait = self.ping_deadline.timeout()
        sent = trio.current_time()
        try:
            await self.ping_deadline.within(lambda: self._relay(msg, None), wait)
        except trio.TooSlowError:
            self.down.broken = True
            raise DownstreamError(self.down.address, f"no answer to a liveness ping within {wait:.2g} s") from None
        self.ping_deadline.observe(trio.current_time() - sent)

    async def _pass_restore(self, msg: RestorePrefix, restored: int) -> None:
        """Every stage restores what it holds of the tokens, whatever this one holds: the reply going up is the
        smaller hit, where the prefill starts; a stage that holds more answers those positions from what it
        recorded (see StageHandlers._prefill), so only the stages that miss compute them."""
        if self.down is None:
            await self.reply(PrefixRestored(msg.request_id, msg.session_id, 0, stats=self._own_stats()))
            return
        with span("stage.downstream_wait", stage=self.core.index, request=msg.request_id, session=msg.session_id):
            down_reply, sent, write_us, wait_us = await self.down.request(msg)
        stats = merge(self._own_stats(write_us=write_us, wait_us=wait_us, sent=sent), down_reply.stats)
        if isinstance(down_reply, PrefixRestored):
            down_reply = PrefixRestored(msg.request_id, msg.session_id, min(restored, down_reply.restored))
        await self.reply(with_stats(down_reply, stats))

    async def on_cache_query(self, msg: CacheQuery) -> None:
        """This stage's line, then every later stage's."""
        own = self._cache_report(msg)
        await self._ensure_downstream()
        if self.down is None:
            await self.reply(CacheReport(msg.request_id, 0, (own,), stats=self._own_stats()))
            return
        reply, sent, write_us, wait_us = await self.down.request(msg)
        stats = merge(self._own_stats(write_us=write_us, wait_us=wait_us, sent=sent), reply.stats)
        if isinstance(reply, CacheReport):
            reply = CacheReport(msg.request_id, 0, (own, *reply.stages), stats=stats)
        await self.reply(with_stats(reply, stats))

    async def on_stage_query(self, msg: StageQuery) -> None:
        """This stage's line, then every later stage's; alone if the next stage does not answer (the report says
        where the pipeline ends, as far as this stage can see)."""
        started = time.perf_counter_ns()
        later: tuple = ()
        rtt_us = wait_us = 0
        try:
            await self._ensure_downstream()
            if self.down is not None:
                reply, _sent, _write_us, wait_us = await self.down.request(msg)
                if isinstance(reply, StageReport) and reply.stages:
                    later = reply.stages
                    rtt_us = wait_us - later[0].answer_us
        except DownstreamError as exc:
            log.debug("stage %d: the next stage did not answer a stage query: %s", self.core.index, exc)
        own = self._stage_load(started, rtt_us)
        await self.reply(StageReport(msg.request_id, 0, (own, *later), stats=self._own_stats(wait_us=wait_us)))

    async def _pass_on_chunk(self, msg: PrefillChunk, job: Job) -> None:
        if self.down is not None:
            await self.down.send_deferred(self._forwarded(msg, job))

    async def _pass_down(self, msg, unreported: StageStats = NO_STATS) -> None:
        if self.down is not None:
            await self._relay(msg, None, unreported)
        else:
            await self.reply(Ack(msg.request_id, msg.session_id, stats=self._own_stats()))

    async def _pass_stop(self, msg: Stop, cached: int, unreported: StageStats) -> None:
        """Relay the Stop; the next stage's Stopped goes up with this stage's count put first."""
        if self.down is None:
            await self.reply(Stopped(msg.request_id, msg.session_id, (cached,), stats=merge(self._own_stats(),
                                                                                            unreported)))
            return
        with span("stage.downstream_wait", stage=self.core.index, request=msg.request_id, session=msg.session_id):
            down_reply, sent, write_us, wait_us = await self.down.request(msg)
        stats = merge(merge(self._own_stats(write_us=write_us, wait_us=wait_us, sent=sent), unreported),
                      down_reply.stats)
        if isinstance(down_reply, Stopped):
            down_reply = Stopped(msg.request_id, msg.session_id,
                                 (cached, *down_reply.cached[:MAX_CACHE_REPORT_STAGES - 1]))
        await self.reply(with_stats(down_reply, stats))

    async def _ensure_downstream(self) -> None:
        """Before a lane's next generation: reopen the downstream connection if the next stage dropped it.

        An idle lane does not notice that the next stage went away (restarted,
        say) until it forwards something; a new generation on this lane would
        then fail for nothing. Only done while this connection holds no
        session, so no downstream state is lost. Raises DownstreamError.
        """
        down = self.down
        if down is None or self.core.sessions.owned_by(self.conn_id) or down.looks_alive():
            return
        log.info("stage %d: the connection to stage %d was closed; reconnecting", self.core.index,
                 self.core.index + 1)
        self.down = None
        await down.aclose()
        self.down = await self.core.open_downstream(self._nursery)

    # ------------------------------------------------------------------ answer paths
    def _forwarded(self, msg, job: Job, *, direct_return: bool = False):
        """The same message for the next stage, carrying our hidden states (a decode step: with
        ``direct_return`` as given)."""
        if type(msg) is DecodeStep:  # every token: built without attrs.evolve and the class's checks (the
            # message passed them, and the activation is our context's float32 rows for its one token)
            return TRUSTED[DecodeStep](msg.request_id, msg.session_id, msg.pos_start, msg.tokens, job.result,
                                       direct_return)
        return attrs.evolve(msg, activation=job.result)

    async def _relay(self, msg, job: Job | None, unreported: StageStats = NO_STATS) -> Reply:
        """Forward `msg` and answer upstream with the downstream reply plus our own stats (and the session's
        `unreported` ones); returns that reply."""
        with span("stage.downstream_wait", stage=self.core.index, request=msg.request_id,
                  session=getattr(msg, "session_id", 0)):
            down_reply, sent, write_us, wait_us = await self.down.request(msg)
        self._waited_us += wait_us
        own = self._own_stats(job, write_us=write_us, wait_us=wait_us, sent=sent)
        if unreported is not NO_STATS:
            own = merge(own, unreported)
        await self.reply(with_stats(down_reply, merge(own, down_reply.stats)))
        return down_reply

    @staticmethod
    def _prepare_nothing(session: StageSession, msg: DecodeStep) -> None:
        return None  # a relayed step's forward is built after its compute

    async def _relay_answer(self, session: StageSession, msg, job: Job) -> None:
        await self._relay(self._forwarded(msg, job), job)

    def _prepare_forward(self, session: StageSession, msg: DecodeStep) -> PreparedFrame | None:
        """The frame of the step's forward, as _forward_direct sends it."""
        if self.down is None:
            return None
        return self.down.prepare_step(msg.request_id, msg.session_id, msg.pos_start, int(msg.tokens[0]),
                                      self.core.next_is_final, self.core.context.n_embd)

    async def _forward_direct(self, session: StageSession, msg, job: Job) -> None:
        """Forward and acknowledge at once (never wait for the prediction). The next stage's ack is collected
        later; its stats, or the first error an earlier ack reported, go up with this reply. A decode step to
        the final stage owes no ack: it goes with DIRECT_RETURN, and the final stage answers it on the
        token-return connection only (its report travels with the prediction), which spares both stages a
        frame and a wake-up per token.

        A decode step that came with DIRECT_RETURN (from the head) owes no ack either: this stage's
        report waits in the session for its next reply on the lane, and only a failure goes up now (an
        Error, which the head watches the lane for). So a failure further down must be known now too: a
        step to a stage that is not the final one waits for that stage's ack."""
        to_final = type(msg) is DecodeStep and self.core.next_is_final
        unacked = returns_only(msg)
        forward = self._forwarded(msg, job, direct_return=to_final)
        with span("stage.forward_direct", stage=self.core.index, request=msg.request_id,
                  session=msg.session_id):
            if to_final:
                sent, write_us = await self.down.send(forward, job.out)
                self._returns_only["forwarded"] += 1
            elif unacked:
                sent, write_us = await self.down.send_expecting_ack(forward, job.out)
                waited = time.perf_counter()
                await self.down.drain()
                self._waited_us += int((time.perf_counter() - waited) * 1e6)
            else:
                sent, write_us = await self.down.send_deferred(forward, job.out)
        folded, error = self.down.take_folded()
        if error is not None:  # reported now, as the answer to this message
            own = self._own_stats(job, write_us=write_us, sent=sent)
            await self.reply(ErrorReply(msg.request_id, msg.session_id, error.code, error.message,
                                        stats=merge(own, folded)))
        elif unacked:  # every token: our report, then the folded acks', added up in place
            unreported = session.unreported
            unreported.add_compute(self.core.index, job.compute_us, job.queue_us)
            unreported.add_hop(write_us, 0, sent)
            if folded is not NO_STATS:
                unreported.add(folded)
            self._returns_only["unacked"] += 1
        else:  # every token: the ids are the message's
            own = self._own_stats(job, write_us=write_us, sent=sent)
            await self.reply(TRUSTED[Ack](msg.request_id, msg.session_id, merge(own, folded)))


def handlers_for(core, conn_id: int, out: trio.abc.SendStream, nursery: trio.Nursery | None = None, *,
                 down: DownstreamLink | None = None) -> StageHandlers:
    """The handlers of a connection to this stage, for its role (chosen once, here)."""
    if core.is_final:
        return FinalStage(core, conn_id, out, nursery)
    return MiddleStage(core, conn_id, out, nursery, down=down)
