"""One upstream connection of a stage: the read loop and one handler per message kind.

Each upstream connection owns its downstream connection (so a lane is a
chain through the whole pipeline) and the sessions it created. Whatever ends
the connection (the peer closing, a protocol violation, a dead downstream,
daemon shutdown) runs ``_release_all`` in a shielded, time-bounded scope, so
every KV sequence and slot the connection held is freed on this stage, and
closing our downstream connection makes the next stage do the same.

Direct token return (sessions configured with DIRECT_RETURN, three or more
stages): the final stage sends the session's predictions on its
token-return connection to the head and answers the lane message with an
Ack; a middle stage forwards such a decode step (or final prefill chunk) and
acknowledges it upstream at once, collecting the next stage's ack later, so
no middle stage waits for a prediction. Decode steps that come with
DIRECT_RETURN owe no reply on the lane at all (``_returns_only``): the final
stage answers them on the token-return connection only, and a middle stage
says something upstream only when it fails (see ``_forward_direct``).

The connection's tasks (the conditioned links' transmit tasks, when link
conditioning is on) run in the nursery of :meth:`UpstreamConnection.serve`.
"""

from __future__ import annotations

import itertools
import time
import logging
from typing import TYPE_CHECKING

import attrs
import trio

from skippyd.runtime import llama
from skippyd.stage.conditioning import ShapedSendStream, shaped
from skippyd.stage.downstream import DownstreamError, DownstreamLink
from skippyd.stage.scheduler import Job
from skippyd.telemetry import span
from skippyd.stage.sessions import NoFreeSlot, StageSession
from skippyd.stage.token_return import TokenReturnLost
from skippyd.wire.codec import REPLY_COMPUTE_US_AT, decode_step_head, frame_bytes
from skippyd.wire.errors import HandshakeRefused, PeerClosed, ProtocolError, ReadTimeout, WireError
from skippyd.wire.handshake import handshake_server, refuse_handshake
from skippyd.wire.messages import (
    DEFAULT_SEED,
    NO_STATS,
    Ack,
    ConfigureGeneration,
    DecodeStep,
    ErrorCode,
    ErrorReply,
    Limits,
    Ping,
    PredictedToken,
    PrefillChunk,
    Reply,
    SamplingParams as WireSampling,
    StageStats,
    Stop,
    TRUSTED,
    TrimSession,
    VerifyWindow,
    merge,
    with_stats,
)
from skippyd.wire.stream import PreparedFrame, ReceiveBuffer, WaitWatch, read_message, write_frame

if TYPE_CHECKING:
    from skippyd.stage.server import StageServer

log = logging.getLogger("skippyd.stage")

_conn_ids = itertools.count(1)
CLEANUP_TIMEOUT_S = 5.0
# A middle stage k relays a Ping and waits PING_RELAY_S ** k for the answer of the stages after it: less
# than whoever pinged it waits (the head: 1 s), so the stage before a hung one is the one that names it.
PING_RELAY_S = 0.8


class RequestFailed(Exception):
    """A request error: answered with an ErrorReply, the connection stays usable."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def runtime_sampling(wire: WireSampling) -> llama.SamplingParams:
    return llama.SamplingParams(
        temperature=wire.temperature,
        top_k=max(0, wire.top_k),
        top_p=wire.top_p if 0.0 < wire.top_p <= 1.0 else 1.0,
        min_p=min(max(wire.min_p, 0.0), 1.0),
        repeat_penalty=wire.repeat_penalty,
        presence_penalty=wire.presence_penalty,
        frequency_penalty=wire.frequency_penalty,
        penalty_last_n=wire.penalty_last_n,
        seed=None if wire.seed == DEFAULT_SEED else wire.seed,
        logit_bias=wire.logit_bias,
    )


class UpstreamConnection:
    def __init__(self, server: StageServer, stream: trio.SocketStream):
        self.server = server
        self.stream = stream
        self.conn_id = next(_conn_ids)
        self.down: DownstreamLink | None = None
        self.peer_ip, self.peer_desc = _peer_address(stream)
        self._out: trio.abc.SendStream = stream  # replies: the stream, or a conditioned link over it
        self._nursery: trio.Nursery | None = None
        self._waited_us = 0  # this message's wait on the next stage (not ours to count as overhead)
        # errors of chunks that were acked before compute, reported on the session's next reply
        self._deferred: dict[int, ErrorReply] = {}

    # ------------------------------------------------------------------ lifetime
    async def serve(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._serve()

    async def _serve(self) -> None:
        cfg = self.server.config
        receive = ReceiveBuffer(self.stream)
        idle: WaitWatch | None = None
        try:
            if self.server.handshaking >= cfg.max_handshakes:
                # a flood of connections that never finish their handshake must not use up this stage's
                # descriptors: beyond the cap they are closed at once (lanes are long-lived, so few handshake)
                self.server.note_dropped_handshake()
                return
            self.server.handshaking += 1
            try:
                allow = self.server.upstream_allow
                if allow is not None and not await allow.allows(self.peer_ip):
                    # not the handshake's full deadline: a refused peer only needs to finish its Hello
                    await refuse_handshake(self.stream, f"upstream address not allowed: {self.peer_ip} may not "
                                           f"connect to stage {self.server.index}", receive=receive,
                                           timeout=min(cfg.handshake_timeout_s, 2.0))
                await handshake_server(self.stream, self.server.hello, timeout=cfg.handshake_timeout_s,
                                       receive=receive, admit=self._admit)
            except HandshakeRefused as exc:
                if exc.by_peer:  # e.g. a status probe, which declines once it has seen our Hello
                    log.info("stage %d: upstream %s declined: %s", self.server.index, self.peer_desc, exc.reason)
                else:
                    self.server.refused_upstreams += 1
                    log.warning("stage %d: refused upstream %s: %s", self.server.index, self.peer_desc, exc.reason)
                return
            finally:
                self.server.handshaking -= 1
            self._out = shaped(self.stream, cfg.link_shape, self._nursery)
            self.server.connections[self.conn_id] = self
            limits = Limits(max_tokens=min(self.server.context.n_batch, 8192))
            min_rate = cfg.frame_min_rate
            if cfg.link_mbps > 0:  # conditioned links (given to every daemon) may be slower than the default rate
                min_rate = min(min_rate, cfg.link_mbps * 1e6 / 8 / 2)
            # idle_timeout_s bounds the wait for a frame's first byte only (kept by a task: no cancel scope per
            # read); a frame once started must be complete within frame_timeout_s (plus its size at
            # frame_min_rate): a peer that starts a frame and trickles it is dropped in seconds, with its
            # sessions, not after the idle deadline
            idle = WaitWatch(receive, cfg.idle_timeout_s)
            self._nursery.start_soon(idle.run)
            n_embd = self.server.model.n_embd_inp
            while True:
                msg = await read_message(receive, limits, timeout=cfg.idle_timeout_s, watch=idle,
                                         frame_timeout=cfg.frame_timeout_s, min_rate=min_rate, n_embd=n_embd)
                await self.dispatch(msg)
        except ProtocolError as exc:
            log.warning("stage %d: protocol error from %s: %s", self.server.index, self.peer_desc, exc)
            await self._fail_connection(exc.code, exc.message, exc.request_id, exc.session_id)
        except DownstreamError as exc:
            log.warning("stage %d: downstream failed: %s", self.server.index, exc)
        except ReadTimeout as exc:
            if exc.mid_frame:
                log.warning("stage %d: upstream %s: %s; closing", self.server.index, self.peer_desc, exc)
            else:
                log.info("stage %d: upstream %s idle past the deadline; closing", self.server.index, self.peer_desc)
        except (PeerClosed, WireError, trio.BrokenResourceError, trio.ClosedResourceError):
            log.info("stage %d: upstream %s closed", self.server.index, self.peer_desc)
        except Exception:  # a bug must cost one connection, never the daemon
            log.exception("stage %d: connection from %s failed", self.server.index, self.peer_desc)
        finally:
            if idle is not None:
                idle.close()
            self.server.connections.pop(self.conn_id, None)
            with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
                await self._release_all()
            if self.down is not None:
                await self.down.aclose()
            if isinstance(self._out, ShapedSendStream):  # let the last replies (an error, say) arrive
                with trio.move_on_after(1.0 + cfg.link_delay_ms / 1e3, shield=True):
                    await self._out.flush()
                self._out.close()
            await trio.aclose_forcefully(self.stream)

    async def _admit(self, peer) -> str | None:
        """Handshake hook: a middle stage opens its downstream connection before accepting an upstream.

        So a lane is accepted only when it leads all the way to the final
        stage; otherwise the upstream is refused with the reason (and a head
        backs off instead of holding lanes that lead nowhere).
        """
        if self.server.is_final:
            return None
        try:
            self.down = await self._connect_downstream()
        except DownstreamError as exc:  # logged as the refusal
            return f"downstream unavailable: stage {self.server.index + 1} at {exc.address}: {exc.detail}"
        return None

    async def _connect_downstream(self) -> DownstreamLink:
        cfg = self.server.config
        nxt = self.server.next_stage
        # inside our own handshake: leave the upstream time to hear why, if we fail
        timeout = min(cfg.connect_timeout_s, 0.8 * cfg.handshake_timeout_s)
        return await DownstreamLink.connect(nxt.host, nxt.port, self.server.hello, connect_timeout=timeout,
                                            credit_limit=cfg.credit_limit, reply_timeout=cfg.reply_timeout_s,
                                            write_timeout=cfg.write_timeout_s, shape=cfg.link_shape,
                                            nursery=self._nursery)

    async def _ensure_downstream(self) -> None:
        """Before a lane's next generation: reopen the downstream connection if the next stage dropped it.

        An idle lane does not notice that the next stage went away (restarted,
        say) until it forwards something; a new generation on this lane would
        then fail for nothing. Only done while this connection holds no
        session, so no downstream state is lost. Raises DownstreamError.
        """
        down = self.down
        if down is None or self.server.sessions.owned_by(self.conn_id) or down.looks_alive():
            return
        log.info("stage %d: the connection to stage %d was closed; reconnecting", self.server.index,
                 self.server.index + 1)
        self.down = None
        await down.aclose()
        self.down = await self._connect_downstream()

    async def _release_all(self) -> None:
        for session in self.server.sessions.owned_by(self.conn_id):
            try:
                await self.server.release(session)
            except Exception:  # a bug releasing one session must not keep the others (and the links) held
                log.exception("stage %d: releasing session %d failed", self.server.index, session.session_id)
                continue
            log.info("stage %d: released session %d (connection closed)", self.server.index, session.session_id)

    async def _fail_connection(self, code: ErrorCode, message: str, request_id: int = 0, session_id: int = 0):
        with trio.move_on_after(1.0, shield=True):
            try:
                await write_frame(self._out, ErrorReply(request_id, session_id, code, message[:4000]))
                if isinstance(self._out, ShapedSendStream):
                    await self._out.flush()  # let it arrive before the connection closes
            except (WireError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def reply(self, reply: Reply, prepared: PreparedFrame | None = None) -> None:
        """Answer upstream (``prepared``: the reply's frame, which the compute may have written already)."""
        await write_frame(self._out, reply, timeout=self.server.config.write_timeout_s, prepared=prepared)

    # ------------------------------------------------------------------ dispatch
    _HANDLERS = {
        ConfigureGeneration: "on_configure",
        PrefillChunk: "on_prefill",
        DecodeStep: "on_decode",
        VerifyWindow: "on_verify_window",
        TrimSession: "on_trim",
        Stop: "on_stop",
        Ping: "on_ping",
    }

    _SPANS = {kind: f"stage.{name[3:]}" for kind, name in _HANDLERS.items()}

    async def dispatch(self, msg) -> None:
        handler = getattr(self, self._HANDLERS[type(msg)])
        session_id = getattr(msg, "session_id", 0)
        try:
            with span(self._SPANS[type(msg)], stage=self.server.index, request=msg.request_id, session=session_id):
                await handler(msg)
        except RequestFailed as exc:
            error = ErrorReply(msg.request_id, session_id, exc.code, exc.message[:4000], stats=self._own_stats())
            if not (_returns_only(msg) and self.server.is_final):  # the final stage answers those on the
                await self.reply(error)  # token-return connection only; a middle stage's failure goes up
            await self._report_on_return(msg, error)
        except DownstreamError as exc:
            if not (isinstance(msg, PrefillChunk) and not msg.final):  # a non-final chunk was acked already
                await self.reply(ErrorReply(msg.request_id, session_id, ErrorCode.DOWNSTREAM_FAILED,
                                            f"stage {self.server.index + 1} failed: {exc}"[:4000]))
            raise

    def _own_stats(self, job: Job | None = None, *, write_us: int = 0, wait_us: int = 0,
                   sent: int = 0) -> StageStats:
        return StageStats.single(self.server.index, compute_us=job.compute_us if job else 0,
                                 queue_us=job.queue_us if job else 0, forward_write_us=write_us,
                                 downstream_wait_us=wait_us, bytes_sent=sent)

    def _prediction(self, msg, job: Job) -> PredictedToken:
        # the final stage's reply to every token: its ids were decoded from a frame (u64 by its format) and the
        # token is the sampler's (a vocabulary id), so attrs' checks are spared
        return TRUSTED[PredictedToken](msg.request_id, msg.session_id, int(job.result), self._own_stats(job))

    async def _relay(self, msg, job: Job | None, unreported: StageStats = NO_STATS) -> Reply:
        """Forward `msg` and answer upstream with the downstream reply plus our own stats (and the session's
        `unreported` ones); returns that reply."""
        with span("stage.downstream_wait", stage=self.server.index, request=msg.request_id,
                  session=getattr(msg, "session_id", 0)):
            down_reply, sent, write_us, wait_us = await self.down.request(msg)
        self._waited_us += wait_us
        own = self._own_stats(job, write_us=write_us, wait_us=wait_us, sent=sent)
        if unreported is not NO_STATS:
            own = merge(own, unreported)
        await self.reply(with_stats(down_reply, merge(own, down_reply.stats)))
        return down_reply

    async def _forward_direct(self, session: StageSession, msg, job: Job) -> None:
        """A middle stage, direct-return session: forward and acknowledge at once (never wait for the
        prediction). The next stage's ack is collected later; its stats, or the first error an earlier
        ack reported, go up with this reply. A decode step to the final stage owes no ack: it goes with
        DIRECT_RETURN, and the final stage answers it on the token-return connection only (its report
        travels with the prediction), which spares both stages a frame and a wake-up per token.

        A decode step that came with DIRECT_RETURN (from the head) owes no ack either: this stage's
        report waits in the session for its next reply on the lane, and only a failure goes up now (an
        Error, which the head watches the lane for). So a failure further down must be known now too: a
        step to a stage that is not the final one waits for that stage's ack."""
        to_final = type(msg) is DecodeStep and self.server.next_is_final
        unacked = _returns_only(msg)
        forward = self._forwarded(msg, job, direct_return=to_final)
        with span("stage.forward_direct", stage=self.server.index, request=msg.request_id,
                  session=msg.session_id):
            if to_final:
                sent, write_us = await self.down.send(forward, job.out)
                self.server.returns_only["forwarded"] += 1
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
            unreported.add_compute(self.server.index, job.compute_us, job.queue_us)
            unreported.add_hop(write_us, 0, sent)
            if folded is not NO_STATS:
                unreported.add(folded)
            self.server.returns_only["unacked"] += 1
        else:  # every token: the ids are the message's
            own = self._own_stats(job, write_us=write_us, sent=sent)
            await self.reply(TRUSTED[Ack](msg.request_id, msg.session_id, merge(own, folded)))

    async def _return_direct(self, session: StageSession, msg, job: Job) -> None:
        """The final stage, direct-return session: the prediction goes to the head on the token-return
        connection (with this stage's report); the lane gets a plain Ack, unless the message says that
        the upstream stage expects none (a decode step with DIRECT_RETURN)."""
        token = self._prediction(msg, job)
        try:
            await self.server.token_return.send(token, job.out)
        except TokenReturnLost as exc:
            raise RequestFailed(ErrorCode.DOWNSTREAM_FAILED, f"stage {self.server.index}: {exc}") from exc
        if _returns_only(msg):
            self.server.returns_only["answered"] += 1
        else:
            await self.reply(TRUSTED[Ack](msg.request_id, msg.session_id, NO_STATS))  # every token: as above

    async def _report_on_return(self, msg, error: ErrorReply) -> None:
        """The final stage: a failed prediction of a direct-return session is reported to the head on the
        token-return connection too (the head waits there; the lane's error reaches it later). So is the
        failure of a session this stage does not know: the head drops a reply for a session not waiting."""
        link = self.server.token_return
        if link is None or not link.connected or not isinstance(msg, (DecodeStep, PrefillChunk)):
            return
        if isinstance(msg, PrefillChunk) and not msg.final:
            return
        session = self.server.sessions.get(self.conn_id, msg.session_id)
        if session is not None and not session.direct_return and not _returns_only(msg):
            return
        try:
            await link.send(error)
        except TokenReturnLost:
            pass  # the head learns from the lost connection

    # ------------------------------------------------------------------ sessions
    def _session(self, msg, *, create: bool) -> StageSession:
        session = self.server.sessions.get(self.conn_id, msg.session_id)
        if session is None:
            if not create:
                raise RequestFailed(ErrorCode.UNKNOWN_SESSION, f"unknown session {msg.session_id}")
            if self.server.draining:
                raise RequestFailed(ErrorCode.SHUTTING_DOWN, f"stage {self.server.index} is shutting down")
            try:
                session = self.server.sessions.open(self.conn_id, msg.session_id, msg.request_id)
            except NoFreeSlot as exc:
                raise RequestFailed(ErrorCode.NO_CAPACITY, f"stage {self.server.index}: {exc}") from exc
        return session

    async def _align(self, session: StageSession, pos_start: int) -> None:
        """Positions are authoritative: a stage that is ahead trims itself first."""
        if session.position > pos_start:
            await self.server.scheduler.run_kv(lambda: self.server.context.kv_trim(session.seq, pos_start))
            session.position = pos_start
        elif session.position < pos_start:
            raise RequestFailed(ErrorCode.POSITION_GAP,
                                f"session {session.session_id} holds {session.position} positions, "
                                f"message starts at {pos_start}")

    async def _compute(self, session: StageSession, msg, *, want_token: bool, out: PreparedFrame | None = None) -> Job:
        ctx = self.server.context
        if msg.pos_start + len(msg.tokens) > ctx.n_ctx_seq:
            raise RequestFailed(ErrorCode.CONTEXT_FULL,
                                f"positions up to {msg.pos_start + len(msg.tokens)} exceed the context of "
                                f"{ctx.n_ctx_seq} per session")
        if ctx.token_input:
            job = Job(session.seq, msg.pos_start, tokens=msg.tokens, embd=None)
        else:
            if msg.activation is None:
                raise RequestFailed(ErrorCode.MISSING_ACTIVATION, "this stage needs the hidden states")
            job = Job(session.seq, msg.pos_start, tokens=None, embd=msg.activation)
        job.sampler = session.sampler
        job.want_token = want_token
        job.out = out
        try:
            job.result = await self.server.scheduler.submit(job)
        except llama.KvCacheFullError as exc:
            raise RequestFailed(ErrorCode.CONTEXT_FULL, str(exc)) from exc
        except llama.LlamaError as exc:
            raise RequestFailed(ErrorCode.COMPUTE_FAILED, str(exc)) from exc
        session.position = msg.pos_start + len(msg.tokens)
        return job

    def _prepared_answer(self, session: StageSession, msg: DecodeStep) -> PreparedFrame | None:
        """The frame of this decode step's answer (the final stage's prediction, on the token-return
        connection or the lane; a middle stage's forward of a direct-return step, as _forward_direct sends
        it), made before the compute so that the compute writes it as it ends; None where the answer goes
        otherwise."""
        if self.server.is_final:  # the token and the compute's times are the compute's to fill in
            frame = frame_bytes(TRUSTED[PredictedToken](msg.request_id, msg.session_id, 0,
                                                        StageStats.single(self.server.index)))
            if session.direct_return:
                return self.server.token_return.prepare(frame, REPLY_COMPUTE_US_AT)
            return PreparedFrame.for_stream(self._out, frame, 0, REPLY_COMPUTE_US_AT)
        if not session.direct_return or self.down is None:
            return None
        n = self.server.context.n_embd * 4
        return self.down.prepare_step(decode_step_head(msg.request_id, msg.session_id, msg.pos_start,
                                                       int(msg.tokens[0]), self.server.next_is_final, n), n)

    def _forwarded(self, msg, job: Job, *, direct_return: bool = False):
        """The same message for the next stage, carrying our hidden states (a decode step: with
        ``direct_return`` as given)."""
        if type(msg) is DecodeStep:  # every token: built without attrs.evolve and the class's checks (the
            # message passed them, and the activation is our context's float32 rows for its one token)
            return TRUSTED[DecodeStep](msg.request_id, msg.session_id, msg.pos_start, msg.tokens, job.result,
                                       direct_return)
        return attrs.evolve(msg, activation=job.result)

    def _take_deferred(self, session_id: int) -> None:
        err = self._deferred.pop(session_id, None)
        if err is not None:
            raise RequestFailed(err.code, err.message)

    # ------------------------------------------------------------------ handlers
    async def on_configure(self, msg: ConfigureGeneration) -> None:
        await self._ensure_downstream()
        session = self._session(msg, create=True)
        session.request_id = msg.request_id
        self._deferred.pop(msg.session_id, None)
        if self.server.is_final:
            if msg.direct_return:
                await self._check_direct_return(session)
            session.direct_return = msg.direct_return
            params = runtime_sampling(msg.sampling)
            if session.sampler is not None:
                session.sampler.close()
                session.sampler = None
            try:
                if not params.is_plain_greedy:
                    session.sampler = llama.Sampler(self.server.model, params)
            except llama.InvalidArgumentError as exc:
                raise RequestFailed(ErrorCode.INTERNAL, str(exc)) from exc
            await self.reply(Ack(msg.request_id, msg.session_id, stats=self._own_stats()))
        else:
            reply = await self._relay(msg, None)
            session.direct_return = msg.direct_return and isinstance(reply, Ack)

    async def _check_direct_return(self, session: StageSession) -> None:
        """The final stage: direct return needs a live token-return connection (dialed now if need be);
        without one the configure fails with DIRECT_RETURN_UNAVAILABLE and the head uses the relayed path."""
        link = self.server.token_return
        if link is not None and await link.ensure():
            return
        await self.server.release(session)
        if link is not None:
            why = f"no connection to the head at {link.address}: {link.last_error or 'retrying later'}"
        elif len(self.server.topology.stages) < 3:
            why = "the pipeline has fewer than three stages"
        else:
            why = "turned off on this stage (--no-direct-return)"
        raise RequestFailed(ErrorCode.DIRECT_RETURN_UNAVAILABLE, f"direct token return unavailable: {why}")

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
            await self._align(session, msg.pos_start)
            session.state = "prefill"
            job = await self._compute(session, msg, want_token=False)
            if self.down is not None:
                await self.down.send_deferred(self._forwarded(msg, job))
        except RequestFailed as exc:
            self._deferred[msg.session_id] = ErrorReply(msg.request_id, msg.session_id, exc.code, exc.message)

    async def _on_final_prefill(self, msg: PrefillChunk) -> None:
        self._take_deferred(msg.session_id)
        session = self._session(msg, create=True)
        await self._align(session, msg.pos_start)
        job = await self._compute(session, msg, want_token=self.server.is_final)
        session.state = "decode"
        await self._answer_with_token(session, msg, job)

    async def on_decode(self, msg: DecodeStep) -> None:
        started, started_cpu = time.perf_counter(), time.thread_time()
        self._waited_us = 0
        self._take_deferred(msg.session_id)
        session = self._session(msg, create=False)
        if msg.direct_return and not session.direct_return:
            raise RequestFailed(ErrorCode.DIRECT_RETURN_UNAVAILABLE,
                                f"session {msg.session_id} was not configured with direct return")
        await self._align(session, msg.pos_start)
        job = await self._compute(session, msg, want_token=self.server.is_final,
                                  out=self._prepared_answer(session, msg))
        await self._answer_with_token(session, msg, job)
        waited_us = self._waited_us + job.lock_wait_us
        cpu_s = time.thread_time() - started_cpu - job.loop_native_cpu_us / 1e6
        self.server.scheduler.hot_path.note(time.perf_counter() - started - waited_us / 1e6, job.native_us, cpu_s)

    async def _answer_with_token(self, session: StageSession, msg, job: Job) -> None:
        if self.server.is_final:
            session.generated += 1
            if session.direct_return:
                await self._return_direct(session, msg, job)
            else:
                await self.reply(self._prediction(msg, job), job.out)
        elif session.direct_return:
            await self._forward_direct(session, msg, job)
        else:
            await self._relay(self._forwarded(msg, job), job)

    async def on_verify_window(self, msg: VerifyWindow) -> None:
        raise RequestFailed(ErrorCode.INTERNAL, "verify windows (speculative decoding) are not supported yet")

    async def on_trim(self, msg: TrimSession) -> None:
        session = self._session(msg, create=False)
        if session.position > msg.pos_start:
            await self._align(session, msg.pos_start)
        if self.down is not None:
            await self._relay(msg, None)
        else:
            await self.reply(Ack(msg.request_id, msg.session_id, stats=self._own_stats()))

    async def on_stop(self, msg: Stop) -> None:
        """End the session (idempotent: stopping an unknown session is not an error)."""
        self._deferred.pop(msg.session_id, None)
        session = self.server.sessions.get(self.conn_id, msg.session_id)
        unreported = NO_STATS
        if session is not None:
            unreported = session.unreported.total()
            await self.server.release(session)
        if self.down is not None:
            await self._relay(msg, None, unreported)
        else:
            await self.reply(Ack(msg.request_id, msg.session_id, stats=self._own_stats()))

    async def on_ping(self, msg: Ping) -> None:
        """Answer for this stage and every stage after it (a middle stage relays the ping). A stage computes
        in a worker thread, so a busy one answers at once; one that does not answer in time is named in a
        DOWNSTREAM_FAILED reply (by dispatch), and this connection ends (a reply is owed on its link)."""
        if self.server.is_final:
            await self.reply(Ack(msg.request_id, 0, stats=self._own_stats()))
            return
        await self._ensure_downstream()  # the next stage restarted since the last ping: reconnect first
        wait = PING_RELAY_S ** self.server.index
        with trio.move_on_after(wait):
            await self._relay(msg, None)
            return
        self.down.broken = True
        raise DownstreamError(self.down.address, f"no answer to a liveness ping within {wait:.2g} s")


def _returns_only(msg) -> bool:
    """A decode step with DIRECT_RETURN: nothing on the lane but a middle stage's failure (the final stage
    answers it on the token-return connection only)."""
    return type(msg) is DecodeStep and msg.direct_return


def _peer_address(stream: trio.SocketStream) -> tuple[str, str]:
    """(IP address, "HOST:PORT" for the log); "?" when unknown (never allowed by an allow-list)."""
    try:
        host, port = stream.socket.getpeername()[:2]
        return host, f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    except (OSError, AttributeError, ValueError):
        return "?", "?"
