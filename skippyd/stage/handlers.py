"""The messages of one upstream connection: one handler per kind, in the class of the stage's role.

The role (``FinalStage`` or ``MiddleStage``, skippyd/stage/roles.py) is chosen
once, when the connection starts (``handlers_for``, same file).
:class:`StageHandlers` holds what both share: ``dispatch``, ``on_prefill``,
``on_decode``, ``on_trim``, ``on_stop``, ``on_verify_window``; each role adds
``on_configure`` and ``on_ping``. How a session's computed messages are
answered (relayed or direct) is chosen when the session is configured: an
:class:`AnswerPath` kept in the session, so no decode step tests a flag for it.

Direct token return (sessions configured with DIRECT_RETURN, three or more
stages): the final stage sends the session's predictions on its
token-return connection to the head and answers the lane message with an
Ack; a middle stage forwards such a decode step (or final prefill chunk) and
acknowledges it upstream at once, collecting the next stage's ack later, so
no middle stage waits for a prediction. Decode steps that come with
DIRECT_RETURN owe no reply on the lane at all (:func:`returns_only`): the
final stage answers them on the token-return connection only, and a middle
stage says something upstream only when it fails (see
:meth:`~skippyd.stage.roles.MiddleStage._forward_direct`).

Handlers see the stage through a :class:`~skippyd.stage.core.StageCore`
only, and answer on ``out``; tests drive them with a fake core.
"""

from __future__ import annotations

import logging
import time

import attrs
import numpy as np
import trio

from skippyd.runtime import llama
from skippyd.stage.downstream import DownstreamError
from skippyd.stage.execution import Job
from skippyd.stage.load import stage_load
from skippyd.stage.prefix_cache import record_from, restore_into
from skippyd.stage.sessions import NoFreeSlot, SessionState, StageSession
from skippyd.telemetry import span
from skippyd.wire.messages import (
    NO_STATS,
    Ack,
    CacheQuery,
    ConfigureGeneration,
    DecodeStep,
    ErrorCode,
    ErrorReply,
    MediaRows,
    Ping,
    PrefillChunk,
    Reply,
    RestorePrefix,
    StageLoad,
    StageQuery,
    StageStats,
    Stop,
    TrimSession,
    VerifyWindow,
)
from skippyd.wire.stream import PreparedFrame, write_frame

log = logging.getLogger("skippyd.stage")


class ReplyError(Exception):
    """A request error: answered with an ErrorReply, the connection stays usable."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def returns_only(msg) -> bool:
    """A decode step with DIRECT_RETURN: nothing on the lane but a middle stage's failure (the final stage
    answers it on the token-return connection only)."""
    return type(msg) is DecodeStep and msg.direct_return


class AnswerPath:
    """How a session's computed messages (final prefill chunks, decode steps) are answered.

    ``prepare(session, msg)``: a decode step's answer frame, made before the compute so that the compute
    writes it as it ends (see PreparedFrame), or None; ``send(session, msg, job)``: the answer."""

    __slots__ = ("name", "prepare", "send")

    def __init__(self, name: str, prepare, send):
        self.name = name
        self.prepare = prepare
        self.send = send

    def __repr__(self) -> str:
        return f"AnswerPath({self.name})"


class StageHandlers:
    """One upstream connection's message handlers (see the module docstring); subclassed by role."""

    want_token = False  # the compute of a final prefill chunk or a decode step samples a token

    def __init__(self, core, conn_id: int, out: trio.abc.SendStream, nursery: trio.Nursery | None = None):
        self.core = core
        self.conn_id = conn_id
        self.out = out  # replies: the stream, or a wrapper put around it where it was accepted
        self._nursery = nursery  # where links this connection opens run their tasks
        self._write_timeout = core.config.write_timeout_s
        self._returns_only = core.counters.returns_only  # counted on every direct-return step
        self._waited_us = 0  # this message's wait on the next stage (not ours to count as overhead)
        # errors of chunks that were acked before compute, reported on the session's next reply
        self._deferred: dict[int, ErrorReply] = {}
        self.default_answer: AnswerPath  # a session's until its ConfigureGeneration says otherwise

    async def aclose(self) -> None:
        """Close what the handlers opened (a middle stage's downstream link)."""

    async def reply(self, reply: Reply, prepared: PreparedFrame | None = None) -> None:
        """Answer upstream (``prepared``: the reply's frame, which the compute may have written already)."""
        await write_frame(self.out, reply, timeout=self._write_timeout, prepared=prepared)

    # ------------------------------------------------------------------ dispatch
    _HANDLERS = {
        ConfigureGeneration: "on_configure",
        PrefillChunk: "on_prefill",
        DecodeStep: "on_decode",
        VerifyWindow: "on_verify_window",
        TrimSession: "on_trim",
        Stop: "on_stop",
        Ping: "on_ping",
        RestorePrefix: "on_restore_prefix",
        CacheQuery: "on_cache_query",
        StageQuery: "on_stage_query",
    }

    _SPANS = {kind: f"stage.{name[3:]}" for kind, name in _HANDLERS.items()}

    async def dispatch(self, msg) -> None:
        """Handle one message. A request error is answered (the connection goes on); DownstreamError is
        answered, then raised (the connection ends: its lane leads nowhere)."""
        handler = getattr(self, self._HANDLERS[type(msg)])
        session_id = getattr(msg, "session_id", 0)
        try:
            with span(self._SPANS[type(msg)], stage=self.core.index, request=msg.request_id, session=session_id):
                await handler(msg)
        except ReplyError as exc:
            await self._failed(msg, ErrorReply(msg.request_id, session_id, exc.code, exc.message[:4000],
                                               stats=self._own_stats()))
        except DownstreamError as exc:
            if not (isinstance(msg, PrefillChunk) and not msg.final):  # a non-final chunk was acked already
                await self.reply(ErrorReply(msg.request_id, session_id, ErrorCode.DOWNSTREAM_FAILED,
                                            f"stage {self.core.index + 1} failed: {exc}"[:4000]))
            raise

    async def _failed(self, msg, error: ErrorReply) -> None:
        """Report a failed request."""
        await self.reply(error)

    # ------------------------------------------------------------------ handlers
    async def on_configure(self, msg: ConfigureGeneration) -> None:
        raise NotImplementedError

    async def on_ping(self, msg: Ping) -> None:
        raise NotImplementedError

    async def on_prefill(self, msg: PrefillChunk) -> None:
        if msg.final:
            await self._on_final_prefill(msg)
            return
        # A non-final chunk is acked before compute so upstream can go on; an
        # error is remembered and reported on the session's next reply.
        await self.reply(Ack(msg.request_id, msg.session_id, stats=self._own_stats()))
        if msg.session_id in self._deferred:
            return
        try:
            session = self._session(msg, create=True)
            session.state = SessionState.PREFILL
            if msg.restore is not None:
                await self._restore_with_prefill(session, msg)
            job = await self._prefill(session, msg, want_token=False)
            await self._pass_on_chunk(msg, job)
        except ReplyError as exc:
            self._deferred[msg.session_id] = ErrorReply(msg.request_id, msg.session_id, exc.code, exc.message)

    async def _on_final_prefill(self, msg: PrefillChunk) -> None:
        self._take_deferred(msg.session_id)
        session = self._session(msg, create=True)
        if msg.restore is not None:
            await self._restore_with_prefill(session, msg)
        job = await self._prefill(session, msg, want_token=self.want_token)
        session.state = SessionState.DECODE
        await session.answer.send(session, msg, job)
        await self._record(session)  # the prompt, for the sessions that begin with it while this one runs

    async def on_decode(self, msg: DecodeStep) -> None:
        started, started_cpu = time.perf_counter(), time.thread_time()
        self._waited_us = 0
        self._take_deferred(msg.session_id)
        session = self._session(msg, create=False)
        if msg.direct_return and not session.direct_return:
            raise ReplyError(ErrorCode.DIRECT_RETURN_UNAVAILABLE,
                             f"session {msg.session_id} was not configured with direct return")
        await self._align(session, msg.pos_start)
        answer = session.answer
        job = await self._compute(session, msg, want_token=self.want_token, out=answer.prepare(session, msg))
        await answer.send(session, msg, job)
        waited_us = self._waited_us + job.lock_wait_us
        cpu_s = time.thread_time() - started_cpu - job.loop_native_cpu_us / 1e6
        self.core.scheduler.hot_path.note(time.perf_counter() - started - waited_us / 1e6, job.native_us, cpu_s)

    async def on_verify_window(self, msg: VerifyWindow) -> None:
        """A verify window (speculative decoding): the current token and its drafts, computed as one batch at
        the authoritative ``pos_start`` (a stage that holds more positions trims first, as for a decode step),
        then answered by the role (:meth:`_answer_window`). The session holds pos_start + len(tokens)
        positions after it; the head trims the rejected drafts with its next message's position."""
        self._waited_us = 0
        self._take_deferred(msg.session_id)
        session = self._session(msg, create=False)
        sampler = session.sampler
        if isinstance(sampler, llama.GuidedSampler) and sampler.top_n is not None:
            raise ReplyError(ErrorCode.UNSUPPORTED_REQUEST, f"session {msg.session_id} was configured with logprobs: "
                                                  "verify windows are not answered with logprobs")
        await self._align(session, msg.pos_start)
        job = await self._compute(session, msg, want_token=self.want_token, window=True)
        await self._answer_window(session, msg, job)

    async def _answer_window(self, session: StageSession, msg: VerifyWindow, job: Job) -> None:
        """After a verify window's compute: forward it (a middle stage, on the session's answer path)."""
        await session.answer.send(session, msg, job)

    async def on_restore_prefix(self, msg: RestorePrefix) -> None:
        """Restore the longest prefix of the message's tokens this stage has cached (see _restore), then let
        the role answer with the chain's hit. (A prompt's first chunk may carry the same lookup: its restore
        block, handled in on_prefill.)"""
        session = self._session(msg, create=True)
        self.core.counters.restores["queries"] += 1
        await self._pass_restore(msg, await self._restore(session, msg.tokens))

    async def on_cache_query(self, msg: CacheQuery) -> None:
        raise NotImplementedError

    async def on_stage_query(self, msg: StageQuery) -> None:
        raise NotImplementedError

    async def on_trim(self, msg: TrimSession) -> None:
        session = self._session(msg, create=False)
        if session.position > msg.pos_start:
            await self._align(session, msg.pos_start)
        await self._pass_down(msg)

    async def on_stop(self, msg: Stop) -> None:
        """End the session (idempotent: stopping an unknown session is not an error); the answer says how
        much of its prompt each stage held rather than computed."""
        self._deferred.pop(msg.session_id, None)
        session = self.core.sessions.get(self.conn_id, msg.session_id)
        unreported = NO_STATS
        cached = 0
        if session is not None:
            unreported = session.unreported.total()
            cached = session.prompt_cached or 0
            await self.core.release(session)
        await self._pass_stop(msg, cached, unreported)

    # ------------------------------------------------------------------ what the roles do
    async def _pass_restore(self, msg: RestorePrefix, restored: int) -> None:
        """Answer a RestorePrefix this stage restored ``restored`` positions of."""
        raise NotImplementedError

    async def _pass_on_chunk(self, msg: PrefillChunk, job: Job) -> None:
        """After a non-final prefill chunk's compute (acked already)."""

    async def _pass_down(self, msg, unreported: StageStats = NO_STATS) -> None:
        """Answer a message this stage has done its part of (a trim)."""
        raise NotImplementedError

    async def _pass_stop(self, msg: Stop, cached: int, unreported: StageStats) -> None:
        """Answer a Stop this stage has done its part of: a Stopped with ``cached`` (this stage's count) first."""
        raise NotImplementedError

    # ------------------------------------------------------------------ sessions and compute
    def _session(self, msg, *, create: bool) -> StageSession:
        core = self.core
        session = core.sessions.get(self.conn_id, msg.session_id)
        if session is None:
            if not create:
                raise ReplyError(ErrorCode.UNKNOWN_SESSION, f"unknown session {msg.session_id}")
            if core.draining:
                raise ReplyError(ErrorCode.SHUTTING_DOWN, f"stage {core.index} is shutting down")
            try:
                session = core.sessions.open(self.conn_id, msg.session_id, msg.request_id)
            except NoFreeSlot as exc:
                raise ReplyError(ErrorCode.NO_CAPACITY, f"stage {core.index}: {exc}") from exc
            session.answer = self.default_answer
        return session

    async def _align(self, session: StageSession, pos_start: int) -> None:
        """Positions are authoritative: a stage that is ahead trims itself first."""
        if session.position > pos_start:
            context = self.core.context
            await self.core.scheduler.run_kv(lambda: context.kv_trim(session.seq, pos_start))
            session.position = pos_start
            session.rows.trim(pos_start)
        elif session.position < pos_start:
            raise ReplyError(ErrorCode.POSITION_GAP,
                             f"session {session.session_id} holds {session.position} positions, "
                             f"message starts at {pos_start}")

    async def _compute(self, session: StageSession, msg, *, want_token: bool, out: PreparedFrame | None = None,
                       window: bool = False) -> Job:
        ctx = self.core.context
        media = msg.media if type(msg) is PrefillChunk else None
        end = msg.pos_start + len(msg.tokens) if media is None else media.pos_end
        if end > ctx.n_ctx_seq:
            raise ReplyError(ErrorCode.CONTEXT_FULL,
                             f"positions up to {end} exceed the context of {ctx.n_ctx_seq} per session")
        if window and len(msg.tokens) > self.core.scheduler.policy.max_batch_tokens:  # one batch, never split
            raise ReplyError(ErrorCode.UNSUPPORTED_REQUEST, f"a verify window of {len(msg.tokens)} tokens exceeds this "
                             f"stage's batch of {self.core.scheduler.policy.max_batch_tokens}")
        if media is not None:
            job = self._media_job(session, msg, media)
        elif ctx.token_input:
            job = Job(session.seq, msg.pos_start, tokens=msg.tokens, embd=None)
        else:
            if msg.activation is None:
                raise ReplyError(ErrorCode.MISSING_ACTIVATION, "this stage needs the hidden states")
            job = Job(session.seq, msg.pos_start, tokens=None, embd=msg.activation)
        job.sampler = session.sampler
        if window:
            job.window, job.window_tokens = True, msg.tokens
            if isinstance(job.sampler, llama.GuidedSampler):
                job.sampler.advance(int(msg.tokens[0]))  # the window's current token, as a decode step's
        elif type(msg) is DecodeStep and isinstance(job.sampler, llama.GuidedSampler):
            job.sampler.advance(msg.token)  # the constraint follows the tokens the sequence is given
        job.want_token = want_token
        job.out = out
        try:
            job.result = await self.core.scheduler.submit(job)
        except llama.KvCacheFullError as exc:
            raise ReplyError(ErrorCode.CONTEXT_FULL, str(exc)) from exc
        except llama.LlamaError as exc:
            raise ReplyError(ErrorCode.COMPUTE_FAILED, str(exc)) from exc
        session.computed(msg.pos_start, msg.tokens if media is None else media.keys)
        if not self.core.is_final and self.core.prefix_cache.enabled:  # what the cache keeps with an entry
            result = job.result
            if isinstance(result, np.ndarray) and result.ndim == 2 and len(result) == end - msg.pos_start:
                session.rows.wrote(msg.pos_start, result)
            else:
                session.rows.trim(msg.pos_start)
        return job

    async def _prefill(self, session: StageSession, msg: PrefillChunk, *, want_token: bool) -> Job:
        """A prompt chunk: the positions of it this stage holds already (restored from its prefix cache past
        where the prefill starts, because an earlier stage held less) are answered with the hidden states this
        stage recorded for them (see skippyd/stage/boundary.py), only the rest is computed; without those, the
        stage trims itself to the chunk's start and computes it all."""
        held = self._held_part(session, msg)
        if not held:
            await self._align(session, msg.pos_start)
            if session.prompt_cached is None:
                session.prompt_cached = msg.pos_start
            return await self._compute(session, msg, want_token=want_token)
        keep = msg.pos_start + held
        await self._align(session, keep)
        rows = None if self.core.is_final else session.rows.view(msg.pos_start, keep).copy()
        if held == len(msg.tokens):
            job = Job(session.seq, msg.pos_start, tokens=msg.tokens, embd=None)
            job.result = rows
            return job
        if session.prompt_cached is None:
            session.prompt_cached = keep
        rest = attrs.evolve(msg, pos_start=keep, tokens=msg.tokens[held:], restore=None,
                            activation=None if msg.activation is None else msg.activation[held:])
        job = await self._compute(session, rest, want_token=want_token)
        if rows is not None:
            job.result = np.concatenate([rows, job.result])
        return job

    def _held_part(self, session: StageSession, msg: PrefillChunk) -> int:
        """How many leading positions of the chunk this stage holds and may keep: the same keys, and (a stage
        before the final one) their recorded hidden states; never the final chunk's last position (its
        prediction is computed)."""
        pos, n = msg.pos_start, len(msg.tokens)
        if session.position <= pos or msg.media is not None:
            return 0
        keep = min(session.position, pos + n)
        if not self.core.is_final:
            keep = min(keep, session.rows.held)
        if msg.final:
            keep = min(keep, pos + n - 1)
        if keep <= pos or not np.array_equal(session.held_keys()[pos:keep], msg.tokens[:keep - pos]):
            return 0
        return keep - pos

    def _media_job(self, session: StageSession, msg: PrefillChunk, media: MediaRows) -> Job:
        """Media rows (an image's): their hidden states (a first stage: their input embeddings) at the positions
        the message gives, in a batch of their own; without causal attention, all of them in one batch."""
        ctx = self.core.context
        if msg.activation is None:
            raise ReplyError(ErrorCode.MISSING_ACTIVATION, "media rows come with their hidden states")
        if media.sections != ctx.n_pos_per_embd:
            raise ReplyError(ErrorCode.UNSUPPORTED_REQUEST, f"media rows with {media.sections} positions each: this "
                                                            f"model takes {ctx.n_pos_per_embd} per row")
        batch = self.core.scheduler.policy.max_batch_tokens
        if not media.causal and len(msg.tokens) > batch:
            raise ReplyError(ErrorCode.UNSUPPORTED_REQUEST, f"{len(msg.tokens)} media rows without causal attention "
                                                            f"exceed this stage's batch of {batch} (they are computed "
                                                            "in one)")
        return Job(session.seq, msg.pos_start, tokens=None, embd=msg.activation, positions=media.positions,
                   causal=media.causal)

    # ------------------------------------------------------------------ the prefix cache
    async def _restore(self, session: StageSession, tokens) -> int:
        """The session holds the longest prefix of ``tokens`` this stage has cached (nothing on a miss, as it
        starts over from position 0); returns its length."""
        core = self.core
        await self._align(session, 0)
        hit = await core.prefix_cache.lookup_tiers(tokens, min(len(tokens), core.context.n_ctx_seq - 1))
        if hit is None or not await restore_into(core.scheduler, core.context, session.seq, hit, hit.length):
            return 0
        core.prefix_cache.note_restored(hit.length)
        session.computed(0, hit.entry.keys[:hit.length])
        if not core.is_final:
            session.rows.load(hit.entry.boundary, hit.length)
        return hit.length

    async def _restore_with_prefill(self, session: StageSession, msg: PrefillChunk) -> None:
        """A prompt's first chunk with a restore block: the lookup a RestorePrefix would have made, before the
        chunk (whose positions this stage then holds are answered from what it recorded, see _prefill)."""
        self.core.counters.restores["with_prefill"] += 1
        await self._restore(session, msg.restore)

    async def _record(self, session: StageSession) -> None:
        """Keep what the session holds in the prefix cache, if the cache wants it."""
        core = self.core
        if core.prefix_cache.enabled:
            await record_from(core.prefix_cache, core.scheduler, core.context, session.seq, session.held_keys(),
                              rows=None if core.is_final else session.rows)

    def _cache_report(self, msg: CacheQuery):
        """This stage's line of a CacheReport (after emptying the cache, if the query says so)."""
        cache = self.core.prefix_cache
        if msg.clear or msg.clear_disk:
            dropped = cache.clear(disk=msg.clear_disk)
            log.info("stage %d: prefix cache cleared (%d entries%s)", self.core.index, dropped,
                     ", the disk tier's included" if msg.clear_disk else "")
        return cache.stats()

    def _stage_load(self, started_ns: int, downstream_rtt_us: int = 0) -> StageLoad:
        """This stage's line of a StageReport; ``started_ns``: when the query came (perf_counter_ns)."""
        core = self.core
        return stage_load(core.index, (core.hello.layer_start, core.hello.layer_end), core.sessions, core.scheduler,
                          core.context, core.prefix_cache, downstream_rtt_us=downstream_rtt_us,
                          answer_us=(time.perf_counter_ns() - started_ns) // 1000)

    def _take_deferred(self, session_id: int) -> None:
        err = self._deferred.pop(session_id, None)
        if err is not None:
            raise ReplyError(err.code, err.message)

    def _own_stats(self, job: Job | None = None, *, write_us: int = 0, wait_us: int = 0,
                   sent: int = 0) -> StageStats:
        return StageStats.single(self.core.index, compute_us=job.compute_us if job else 0,
                                 queue_us=job.queue_us if job else 0, forward_write_us=write_us,
                                 downstream_wait_us=wait_us, bytes_sent=sent)
