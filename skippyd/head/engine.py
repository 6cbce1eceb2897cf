"""Generation on the head (stage 0): prompt → prefill → decode loop → text.

The head runs the first slice itself (through its own scheduler, so that
concurrent generations batch their decode steps), sends hidden states down a
lane, and gets the predicted token back. With no downstream (single-stage
mode) it samples locally with the same code path.

Whatever ends a generation (finish, stop string, cancellation, an error) the
``finally`` of :meth:`_Run.execute` stops the session down the lane
(shielded, time-bounded) and releases the head's own KV sequence. A
generation cancelled mid-request first finishes that request (reads the
reply or acks stage 1 still owes), then sends Stop and waits for its ack, so
every stage has freed the session's slot before the head frees its own; only
a lane that cannot be finished in time (a half-written frame, a silent
stage) is closed instead, which makes stage 1 release the session when it
notices.

In a pipeline, each decode step goes down the lane before the previous
token is detokenized and streamed, so that work overlaps the other stages'
compute instead of adding to every token's time.

Direct token return (three or more stages, ``hub`` given): a generation
asks for it in its ConfigureGeneration; if the final stage accepts, each
prediction-bearing message (the final prefill chunk, every decode step) is
sent without waiting for its reply, its ack is collected from the lane (it
comes from stage 1, before the prediction could), and the prediction
arrives on the session's channel from the :class:`TokenReturnHub`. If the
final stage answers DIRECT_RETURN_UNAVAILABLE the generation configures
again without it and uses the relayed path (logged once per change).

Liveness (``watch``, a :class:`~skippyd.head.liveness.StageWatch`): every
wait on the pipeline is watched, so a stage that stops answering pings (the
ping goes through the whole pipeline; the stage before a hung one names it)
fails the generation within about 1.5 s, whatever the reply deadline; while
the watch says a stage is down, new generations are refused (retryable).

Resume (``resume_window`` set: ``--resume``): a generation that a stage
failure interrupts is not failed. Its lane is dropped, and once stage 1
answers again and a new lane leads through the whole pipeline (within the
window), the generation is replayed from the head's record: the head
recomputes its own KV from scratch and sends the prompt in the same chunks,
then every token generated so far as the same decode steps, so each stage
computes exactly what it computed the first time (greedy output equals an
uninterrupted run; so does seeded sampling, as the final stage's new sampler
draws for the replayed steps as the first one did); the replayed predictions
are not emitted again, so a stream only pauses.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import secrets
import time
from collections import deque
from pathlib import Path
from typing import Callable, NoReturn

import attrs
import numpy as np
import trio

from skippyd.head.chunking import PrefillChunker
from skippyd.head.lanes import Lane, LanePool
from skippyd.head.liveness import StageDown, StageWatch
from skippyd.head.stops import StopMatcher
from skippyd.head.token_return import LaneSpoke, ReturnLost, TokenReturnHub
from skippyd.telemetry import span
from skippyd.runtime import llama
from skippyd.runtime.text import Detokenizer
from skippyd.stage.downstream import DownstreamError
from skippyd.stage.scheduler import Job, Scheduler
from skippyd.stage.sessions import SessionTable
from skippyd.wire.codec import decode_step_head
from skippyd.wire.stream import PreparedFrame
from skippyd.wire.messages import (
    DEFAULT_SEED,
    Ack,
    ConfigureGeneration,
    DecodeStep,
    ErrorCode,
    ErrorReply,
    PredictedToken,
    PrefillChunk,
    SamplingParams as WireSampling,
    StageStats,
    TRUSTED,
    StatsTotal,
    Stop,
)

log = logging.getLogger("skippyd.head")

_trusted_step = TRUSTED[DecodeStep]

STOP_TIMEOUT_S = 2.0
RESUME_BACKOFF_MIN_S = 0.1  # resume: first try this long after the failure, doubling ...
RESUME_BACKOFF_MAX_S = 1.0  # ... up to this
# direct return: a generation's first decode steps are acknowledged by stage 1 (their round trips, less the
# stages' compute that the acks report, size later prompts' prefill chunks); the rest go with DIRECT_RETURN
ACKED_DECODE_STEPS = 4


class GenerationError(Exception):
    """A generation failed; `retryable` says whether trying again later may work."""

    def __init__(self, message: str, *, retryable: bool = False, status: int = 500, stage_failure: bool = False):
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.stage_failure = stage_failure  # a stage died, hung or was cut off (not the request's fault)


class PromptTooLong(GenerationError):
    def __init__(self, message: str):
        super().__init__(message, status=400)


@attrs.frozen
class GenerationRequest:
    prompt: str | None = None  # used as is with raw=True, else as the user message
    messages: tuple[dict, ...] = ()  # chat messages ({role, content}); wins over prompt
    system: str | None = None
    raw: bool = False
    prompt_tokens: tuple[int, ...] | None = None  # pre-tokenized prompt (tests, benchmarks)
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def sampling(self) -> llama.SamplingParams:
        return llama.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            repeat_penalty=self.repeat_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, logit_bias=self.logit_bias)


@attrs.define
class GenerationResult:
    request_id: int
    session_id: int
    text: str
    tokens: list[int]
    finish_reason: str  # stop | length | cancelled | error
    prompt_tokens: int
    ttft_ms: float
    decode_tokens_per_s: float
    elapsed_ms: float
    stage_stats: dict = attrs.field(factory=dict)
    error: str | None = None

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "session_id": self.session_id,
            "text": self.text,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens),
                      "total_tokens": self.prompt_tokens + len(self.tokens)},
            "timings": {"ttft_ms": round(self.ttft_ms, 3), "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
                        "elapsed_ms": round(self.elapsed_ms, 3)},
            "error": self.error,
            "stage_stats": self.stage_stats,
        }


@attrs.define
class Receipt:
    request_id: int
    session_id: int
    prompt_sha256: str
    prompt_tokens: int
    tokens: list[int]
    final_position: int
    termination: str
    ttft_ms: float
    elapsed_ms: float
    finished_at: float


@attrs.define(eq=False)
class LiveGeneration:
    """What the control plane sees of a running generation (and how it kills one)."""

    request_id: int
    session_id: int
    prompt_tokens: int
    started: float
    cancel_scope: trio.CancelScope
    seq: int = -1
    lane_id: int | None = None
    generated: int = 0
    position: int = 0
    state: str = "queued"
    killed: str | None = None  # why it was killed (see HeadEngine.kill)
    resumes: int = 0  # replays after a stage failure
    first_token_at: float | None = None  # perf_counter: the first token in hand ...
    last_token_at: float | None = None  # ... and the latest (the decode rate so far)

    def describe(self) -> dict:
        return {"session_id": self.session_id, "request_id": self.request_id, "state": self.state,
                "prompt_tokens": self.prompt_tokens, "generated": self.generated, "position": self.position,
                "age_s": round(time.monotonic() - self.started, 3), "lane": self.lane_id, "resumes": self.resumes,
                "decode_tokens_per_s": None if (rate := self.decode_rate()) is None else round(rate, 2),
                "stages": {"0": {"seq": self.seq}}}

    def decode_rate(self) -> float | None:
        """Tokens after the first over the time from the first to the latest (to the last, once it ended:
        not to now, as the session's Stop, a round trip through every stage, is no token's time); None before
        the second token."""
        if self.first_token_at is None or self.last_token_at is None or self.last_token_at <= self.first_token_at:
            return None
        return (self.generated - 1) / (self.last_token_at - self.first_token_at)


PieceCallback = Callable[[str], None]  # must not wait: see skippyd/head/piece_relay.py


class HeadEngine:
    def __init__(self, model: llama.Model, context: llama.Context, scheduler: Scheduler,
                 pool: LanePool | None, *, prefill_chunk: int = 256, receipts_file: Path | None = None,
                 receipts_kept: int = 256, queue_timeout: float = 30.0, hub: TokenReturnHub | None = None,
                 watch: StageWatch | None = None, resume_window: float | None = None):
        self.model = model
        self.context = context
        self.scheduler = scheduler
        self.pool = pool
        self.prefill_chunk = max(1, min(prefill_chunk, context.n_batch))
        # the chunk grows past the configured one when the link's round trip needs it
        self.chunker = PrefillChunker(self.prefill_chunk, context.n_batch, pool.credit_limit if pool else 1)
        # admission: a generation waits (up to queue_timeout) for one of the head's sequence slots; the
        # table then assigns which one (it never runs out: the semaphore holds the others back)
        self.sessions = SessionTable(context.n_seq_max)
        self.slots = trio.Semaphore(context.n_seq_max)
        self.queue_timeout = queue_timeout
        self.live: dict[int, LiveGeneration] = {}
        self.receipts: deque[Receipt] = deque(maxlen=receipts_kept)
        self.receipts_file = receipts_file
        self._request_ids = itertools.count(1)
        self.totals = {"generations": 0, "prompt_tokens": 0, "completion_tokens": 0, "errors": 0}
        self.last_stage_stats = StageStats()
        self.hub = hub  # direct token return (3+ stages), None: every prediction is relayed
        self.resume_window = resume_window  # None: a stage failure fails the generation (no replay)
        self.watch = watch  # stage 1's liveness (None: single stage)
        # where the predictions of pipeline generations came from, and configures that fell back
        self.token_paths = {"direct": 0, "relayed": 0, "fallbacks": 0}
        self._fallback_reason: str | None = None

    @property
    def wants_direct_return(self) -> bool:
        return self.hub is not None and self.hub.address is not None

    def note_direct_return(self, fallback_reason: str | None) -> None:
        """Log when direct return stops or starts working (not once per generation)."""
        if fallback_reason is not None:
            self.token_paths["fallbacks"] += 1
            if fallback_reason != self._fallback_reason:
                log.warning("head: %s; using the relayed path", fallback_reason)
        elif self._fallback_reason is not None:
            log.info("head: direct token return works again")
        self._fallback_reason = fallback_reason

    def describe_token_return(self) -> dict | None:
        if self.pool is None:
            return None
        hub = self.hub.describe() if self.hub is not None else {"listen": None}
        return {**hub, **self.token_paths, "enabled": self.wants_direct_return}

    # ------------------------------------------------------------------ prompt
    def prompt_tokens(self, req: GenerationRequest) -> np.ndarray:
        if req.prompt_tokens is not None:
            return np.asarray(req.prompt_tokens, dtype=np.int32)
        if req.raw:
            return self.model.tokenize(req.prompt or "", add_special=True, parse_special=False)
        messages = list(req.messages)
        if not messages:
            messages = [{"role": "user", "content": req.prompt or ""}]
        if req.system and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": req.system})
        try:
            text = self.model.apply_chat_template(messages, add_assistant=True)
        except llama.InvalidArgumentError as exc:
            raise GenerationError(f"{exc} (send a raw prompt instead)", status=400) from exc
        return self.model.tokenize(text, add_special=False, parse_special=True)

    # ------------------------------------------------------------------ generate
    async def generate(self, req: GenerationRequest, on_piece: PieceCallback | None = None) -> GenerationResult:
        started = time.perf_counter()
        try:
            sampling = req.sampling()
            sampling.validate(self.model.n_vocab)
        except llama.InvalidArgumentError as exc:
            raise GenerationError(str(exc), status=400) from exc
        if req.max_tokens < 1:
            raise GenerationError("max_tokens must be >= 1", status=400)
        prompt = self.prompt_tokens(req)
        n_ctx = self.context.n_ctx_seq
        if len(prompt) == 0:
            raise GenerationError("the prompt is empty", status=400)
        if len(prompt) >= n_ctx:
            raise PromptTooLong(f"the prompt has {len(prompt)} tokens; the context holds {n_ctx} per session")
        max_tokens = min(req.max_tokens, n_ctx - len(prompt))
        request_id = self.new_request_id()
        session_id = secrets.randbits(63)
        live = LiveGeneration(request_id, session_id, len(prompt), time.monotonic(), trio.CancelScope())
        self.live[session_id] = live
        run = _Run(self, req, live, prompt, max_tokens, sampling, on_piece, started)
        try:
            with live.cancel_scope, span("head.generation", request=request_id, session=session_id) as sp:
                await run.execute()
                sp.set(tokens=len(run.tokens), finish=run.finish_reason)
            if live.cancel_scope.cancelled_caught:
                run.finish_reason = "cancelled"
                run.error = live.killed
        except GenerationError as exc:
            self.totals["errors"] += 1
            run.error = str(exc)
            # the client gets the error; the operator, a line: a busy or recovering pipeline (503) is routine
            log.log(logging.INFO if exc.status == 503 else logging.WARNING,
                    "head: session %d (request %d) failed after %d tokens: %s", session_id, request_id,
                    len(run.tokens), exc)
            raise
        except trio.Cancelled:
            run.finish_reason = "cancelled"
            raise
        finally:
            self.live.pop(session_id, None)
            self._record(run)
        return run.result()

    def new_request_id(self) -> int:
        return next(self._request_ids)

    def kill(self, session_id: int, why: str) -> bool:
        """Cancel the generation; it ends through its normal cleanup, "cancelled", with `why` as its error."""
        live = self.live.get(session_id)
        if live is None:
            return False
        live.killed = why
        live.cancel_scope.cancel()
        return True

    def _record(self, run: _Run) -> None:
        if run.finish_reason is None:
            run.finish_reason = "error"
        self.totals["generations"] += 1
        self.totals["prompt_tokens"] += len(run.prompt)
        self.totals["completion_tokens"] += len(run.tokens)
        receipt = Receipt(
            request_id=run.live.request_id, session_id=run.live.session_id,
            prompt_sha256=hashlib.sha256(np.asarray(run.prompt, dtype="<i4").tobytes()).hexdigest(),
            prompt_tokens=len(run.prompt), tokens=list(run.tokens), final_position=run.position,
            termination=run.finish_reason, ttft_ms=run.ttft_ms, elapsed_ms=run.elapsed_ms(),
            finished_at=time.time())
        self.receipts.append(receipt)
        if self.receipts_file is not None:
            try:
                with open(self.receipts_file, "a") as f:
                    f.write(json.dumps(attrs.asdict(receipt)) + "\n")
            except OSError as exc:
                log.warning("head: cannot append receipt to %s: %s", self.receipts_file, exc)


class _Run:
    """The state of one generation while it runs."""

    def __init__(self, engine: HeadEngine, req: GenerationRequest, live: LiveGeneration, prompt: np.ndarray,
                 max_tokens: int, sampling: llama.SamplingParams, on_piece: PieceCallback | None, started: float):
        self.engine, self.req, self.live = engine, req, live
        # the request id on the wire: a new one for each replay, so that a reply owed to an attempt given up
        # (a stopped final stage sends it once it runs again, on the token-return connection, which outlives
        # lanes) is told apart from the replay's own replies, which carry the same session id
        self.wire_request_id = live.request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.on_piece = on_piece
        # a PieceRelay: a generation computing on the loop's thread lets its text out first (see let_out)
        self._let_out = getattr(on_piece, "let_out", None)
        self.started = started
        self.tokens: list[int] = []
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.position = 0
        self.ttft_ms = 0.0
        self._stats = StatsTotal()  # every stage's reports for this generation, merged as they come
        self.detok = Detokenizer(engine.model.token_piece)
        self.stops = StopMatcher(req.stop)
        self.lane: Lane | None = None
        self.session = None
        self.sampler: llama.Sampler | None = None
        self.error: str | None = None
        self.returns: trio.MemoryReceiveChannel | None = None  # direct return: this session's predictions
        self._lane_watched: tuple[object, _PipelineFailures] | None = None  # see _watched
        self._returns_watched: _PipelineFailures | None = None
        self._silent_lane: Lane | None = None  # the lane whose decode steps owe no ack (see _unacked_step)
        self._acked_steps = 0
        self.resume_deadline: float | None = None  # trio time: while resuming, the end of the window
        # this decode step so far (HotPath): native compute here, and waits on the other stages
        self.native_us = 0
        self.waited_us = 0
        self.waited_cpu_s = 0.0  # the event loop thread's CPU time in those waits (see HotPath)
        self.loop_native_cpu_us = 0
        self.batched = False  # the last compute was one llama_decode with other sessions' steps
        # this generation's prefill chunk, chosen once: a replay (resume) must chunk the prompt the same way,
        # or its logits (and so a greedy replay's tokens) could differ from the first time
        self.chunk: int | None = None

    @property
    def stats(self) -> StageStats:
        """Every stage's reports for this generation, merged."""
        return self._stats.total()

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1e3

    def result(self) -> GenerationResult:
        tps = self.live.decode_rate() or 0.0
        return GenerationResult(
            request_id=self.live.request_id, session_id=self.live.session_id, text="".join(self.text_parts),
            tokens=list(self.tokens), finish_reason=self.finish_reason or "error", prompt_tokens=len(self.prompt),
            ttft_ms=self.ttft_ms, decode_tokens_per_s=tps, elapsed_ms=self.elapsed_ms(),
            stage_stats=attrs.asdict(self.stats), error=self.error)

    # ------------------------------------------------------------------ steps
    async def execute(self) -> None:
        engine = self.engine
        watch = engine.watch
        if watch is not None and watch.down and not await watch.check():
            raise GenerationError(f"{watch.down_name} is down ({watch.last_error}); try again once it is back",
                                  retryable=True, status=503)
        with trio.move_on_after(engine.queue_timeout) as waited:
            await engine.slots.acquire()
        if waited.cancelled_caught:
            raise GenerationError(f"no free session slot within {engine.queue_timeout:g} s (all "
                                  f"{engine.context.n_seq_max} busy)", retryable=True, status=503)
        try:
            self.session = engine.sessions.open(0, self.live.session_id, self.live.request_id)
            self.live.seq = self.session.seq
            if engine.pool is None:
                if not self.sampling.is_plain_greedy:
                    self.sampler = llama.Sampler(engine.model, self.sampling)
                self.live.state = "prefill"
                token = await self._prefill()
                self.live.state = "decode"
                await self._decode_loop(token)
                return
            while True:
                try:
                    token = await self._catch_up()
                    self.resume_deadline = None  # the pipeline is whole again
                    self.live.state = "decode"
                    await self._decode_loop(token)
                    return
                except GenerationError as exc:
                    if not self._may_resume(exc):
                        raise
                    await self._wait_to_resume(exc)
        finally:
            # shielded: a kill must not cut the cleanup short; each step that waits has its own bound
            with trio.CancelScope(shield=True):
                try:
                    await self._cleanup()
                finally:
                    engine.slots.release()

    async def _catch_up(self) -> int:
        """Open the session down a new lane and bring every stage to where the generation is: the prompt,
        then (a replay) each token generated so far, in the same chunks and steps as the first time.
        Returns the next new token."""
        engine = self.engine
        if self.live.resumes:
            self.wire_request_id = engine.new_request_id()
        self.lane = await self._checkout()
        self.lane.session_id = self.live.session_id
        self.live.lane_id = self.lane.lane_id
        await self._configure()
        if self.position:  # a replay: recompute the head's hidden states from position 0, as the first time
            seq = self.session.seq
            await engine.scheduler.run_kv(lambda: engine.context.kv_clear_seq(seq))
            self.position = 0
        self.live.state = "prefill"
        token = await self._prefill()
        for replayed in list(self.tokens):  # already emitted: their predictions are not emitted again
            token = await self._step(replayed)
        return token

    def _may_resume(self, exc: GenerationError) -> bool:
        """Replay after this failure? A stage failure with resume on; while resuming (stage 1 back, the rest
        of the pipeline perhaps not yet, or a slot still held by the lost lane), any retryable error."""
        if self.engine.resume_window is None or self.live.killed:
            return False
        return exc.stage_failure or (self.resume_deadline is not None and exc.retryable)

    async def _wait_to_resume(self, exc: GenerationError) -> None:
        """Drop the failed lane and wait until stage 1 answers again; raises `exc` once the window is over."""
        engine = self.engine
        now = trio.current_time()
        if self.resume_deadline is None:
            self.resume_deadline = now + engine.resume_window
            self._backoff = RESUME_BACKOFF_MIN_S
            log.warning("head: session %d interrupted after %d tokens (%s); resuming within %g s",
                        self.live.session_id, len(self.tokens), exc, engine.resume_window)
        self.live.state = "resuming"
        self.live.lane_id = None
        self._close_returns()
        if self.lane is not None:
            lane, self.lane = self.lane, None
            lane.dirty = True  # it carried a failed pipeline: closing it releases whatever is left downstream
            with trio.CancelScope(shield=True):
                await engine.pool.checkin(lane)
        while True:
            if trio.current_time() + self._backoff > self.resume_deadline:
                raise GenerationError(f"{exc} (the pipeline was not back within the {engine.resume_window:g} s "
                                      f"resume window)", retryable=True, status=exc.status) from exc
            await trio.sleep(self._backoff)
            self._backoff = min(self._backoff * 2, RESUME_BACKOFF_MAX_S)
            # a hung stage 1 would hold a new lane's handshake for the whole connect timeout: ping it first
            if engine.watch is None or await engine.watch.check():
                break
        self.live.resumes += 1
        log.info("head: session %d: resuming (replay %d: %d prompt + %d generated tokens)",
                 self.live.session_id, self.live.resumes, len(self.prompt), len(self.tokens))

    async def _checkout(self) -> Lane:
        from skippyd.head.lanes import Draining, NoLaneAvailable

        try:
            with span("head.lane_wait", request=self.live.request_id, session=self.live.session_id):
                return await self.engine.pool.checkout()
        except Draining as exc:
            raise GenerationError(str(exc), retryable=True, status=503) from exc
        except NoLaneAvailable as exc:
            raise GenerationError(str(exc), retryable=True, status=503) from exc
        except DownstreamError as exc:
            if self.engine.watch is not None:
                self.engine.watch.suspect()
            raise GenerationError(f"stage 1 is unreachable: {exc}", retryable=True, status=503,
                                  stage_failure=True) from exc

    def _watched(self) -> _PipelineFailures:
        """Around a wait on the lane: a lane failure, or stage 1 not answering liveness pings, becomes a
        retryable GenerationError (a stage failure). A failed ping gives the lane up (its link's
        ``interrupt``), which wakes the wait without a cancel scope per wait."""
        link = self.lane.link
        if not link.interruptible:  # its waiter cancels a scope of its own, which is entered once only
            return _PipelineFailures(self, self.engine.watch)
        kept = self._lane_watched  # one per link while no check has failed it: entered for every token
        if kept is None or kept[0] is not link or kept[1].failed:
            kept = self._lane_watched = (link, _PipelineFailures(self, self.engine.watch, link.interrupt))
        return kept[1]

    def _watched_returns(self) -> _PipelineFailures:
        """Around the wait for a prediction on the token-return connection: as :meth:`_watched`, a failed
        ping waking the wait through the hub (a ReturnLost on the session's channel)."""
        kept = self._returns_watched
        if kept is None or kept.failed:
            kept = self._returns_watched = _PipelineFailures(self, self.engine.watch, self._interrupt_returns)
        return kept

    def _interrupt_returns(self, why: str) -> None:
        self.engine.hub.interrupt(self.live.session_id, why)

    def _sending(self) -> _PipelineFailures:
        """Around a send down the lane (which waits on no stage: no liveness watch): a lane failure becomes
        a retryable GenerationError (a stage failure)."""
        return _PipelineFailures(self, None)

    async def _compute(self, tokens: np.ndarray, pos: int, *, want_token: bool, out: PreparedFrame | None = None):
        job = Job(self.session.seq, pos, tokens=tokens, embd=None, sampler=self.sampler, want_token=want_token,
                  out=out)
        try:
            with span("head.compute", request=self.live.request_id, session=self.live.session_id, pos=pos,
                      tokens=len(tokens)):
                result = await self.engine.scheduler.submit(job)
        except llama.LlamaError as exc:
            raise GenerationError(f"head compute failed: {exc}") from exc
        self.native_us += job.native_us
        self.loop_native_cpu_us += job.loop_native_cpu_us
        self.waited_us += job.lock_wait_us
        self.batched = job.batch_jobs > 1
        self.position = pos + len(tokens)
        self.live.position = self.position
        self._stats.add_compute(0, job.compute_us, job.queue_us)
        return result

    async def _configure(self) -> None:
        """Open the session down the lane: with direct token return if the pipeline offers it."""
        engine = self.engine
        msg = ConfigureGeneration(self.wire_request_id, self.live.session_id, _wire_sampling(self.sampling))
        if engine.wants_direct_return:
            self.returns = engine.hub.open_session(self.live.session_id, self.wire_request_id)
            reply = await self._request(attrs.evolve(msg, direct_return=True),
                                        tolerate=ErrorCode.DIRECT_RETURN_UNAVAILABLE)
            if not isinstance(reply, ErrorReply):
                engine.note_direct_return(None)
                return
            self._close_returns()
            engine.note_direct_return(reply.message)
        await self._request(msg)

    def _close_returns(self) -> None:
        if self.returns is not None:
            self.engine.hub.close_session(self.live.session_id)
            self.returns = None

    async def _request(self, msg, *, tolerate: ErrorCode | None = None):
        """One request down the lane. An interruption leaves the reply owed (the link knows): the cleanup
        collects it before it sends Stop.

        An ErrorReply becomes a GenerationError, except one with the code ``tolerate``, which is returned.
        """
        return await self._request_finish(await self._request_begin(msg), tolerate=tolerate)

    async def _request_begin(self, msg, prepared: PreparedFrame | None = None) -> _InFlight:
        with self._sending():
            sent, write_us = await self.lane.link.begin(msg, prepared)
        return _InFlight(msg, sent, write_us)

    async def _request_finish(self, sent: _InFlight, *, tolerate: ErrorCode | None = None):
        lane, msg = self.lane, sent.msg
        with self._watched(), span("head.hop", request=self.live.request_id, session=self.live.session_id,
                                   kind=type(msg).__name__, lane=lane.lane_id):
            cpu = time.thread_time()
            reply, wait_us = await lane.link.finish()
            self.waited_cpu_s += time.thread_time() - cpu
        self.waited_us += wait_us
        if isinstance(msg, DecodeStep):
            self.engine.chunker.observe_round_trip(wait_us, reply.stats.compute_us + reply.stats.queue_us)
        # the head's own hop (stage_count 0: it is not another stage's report)
        self._stats.add_hop(sent.write_us, wait_us, sent.bytes)
        self._stats.add(reply.stats)
        if isinstance(reply, ErrorReply):
            if reply.code == tolerate:
                return reply
            raise _stage_error(reply)
        return reply

    async def _predict(self, msg) -> int:
        """Send a prediction-bearing message (final prefill chunk, decode step); the predicted token."""
        return await self._predict_finish(await self._predict_begin(msg))

    async def _predict_begin(self, msg, prepared: PreparedFrame | None = None) -> _InFlight:
        """The sending half of :meth:`_predict`: the message is on its way, its prediction owed (``prepared``:
        its frame, which the compute may have written already)."""
        if self.returns is None:
            return await self._request_begin(msg, prepared)
        # direct return: stage 1 acks as soon as it has forwarded the message, so the ack arrives before the
        # prediction can; the prediction comes on the session's channel, which the token-return connection feeds
        started = time.perf_counter()
        acked = not (type(msg) is DecodeStep and msg.direct_return)  # else it owes no ack (see _unacked_step)
        with self._sending():
            if acked:
                sent, write_us = await self.lane.link.send_expecting_ack(msg, prepared)
            else:
                sent, write_us = await self.lane.link.send(msg, prepared)
        return _InFlight(msg, sent, write_us, started, acked)

    async def _predict_finish(self, sent: _InFlight) -> int:
        """The waiting half of :meth:`_predict`: the predicted token."""
        token = await self._await_prediction(sent)
        self.engine.scheduler.back(self.session.seq)  # its next step follows (decode groups: see Scheduler)
        return token

    async def _await_prediction(self, sent: _InFlight) -> int:
        msg = sent.msg
        if self.returns is None:
            reply = await self._request_finish(sent)
            if not isinstance(reply, PredictedToken):
                raise GenerationError(f"stage 1 answered {type(msg).__name__} with {type(reply).__name__}")
            self.engine.token_paths["relayed"] += 1
            return int(reply.token)
        lane = self.lane
        acked = sent.acked
        if acked:
            with self._watched(), span("head.hop", request=self.live.request_id, session=self.live.session_id,
                                       kind=type(msg).__name__, lane=lane.lane_id, direct=1):
                cpu = time.thread_time()
                await lane.link.drain()
                self.waited_cpu_s += time.thread_time() - cpu
            folded, error = lane.link.take_folded()
            self._stats.add(folded)
            if error is not None:
                raise _stage_error(error)
        hub, session_id = self.engine.hub, self.live.session_id
        with span("head.token_return_wait", request=self.live.request_id, session=session_id):
            with self._watched_returns():
                hub.begin_wait(session_id)  # the reply deadline: kept by the hub (keep_deadlines)
                cpu = time.thread_time()
                try:
                    item = await self.returns.receive()
                finally:
                    hub.end_wait(session_id)
                    self.waited_cpu_s += time.thread_time() - cpu
        wait_us = int((time.perf_counter() - sent.started) * 1e6) - sent.write_us
        self.waited_us += wait_us
        if isinstance(item, ReturnLost):  # the connection was lost, or the prediction is overdue
            lane.dirty = True  # the final stage may be gone or wedged: close the lane, no Stop
            raise GenerationError(f"pipeline failed: {item}", retryable=True, status=502, stage_failure=True)
        if isinstance(item, LaneSpoke):
            await self._read_unasked(item)
        if isinstance(msg, DecodeStep) and acked:  # the middle stages' compute: from the acks just folded
            others = folded.compute_us + folded.queue_us + item.stats.compute_us + item.stats.queue_us
            self.engine.chunker.observe_round_trip(wait_us, others)
        self._stats.add_hop(sent.write_us, wait_us, sent.bytes)
        self._stats.add(item.stats)
        if isinstance(item, ErrorReply):
            raise _stage_error(item)
        if not isinstance(item, PredictedToken) or item.session_id != session_id:
            raise GenerationError(f"the token-return connection answered {type(msg).__name__} with "
                                  f"{type(item).__name__}")
        self.engine.token_paths["direct"] += 1
        return int(item.token)

    async def _prefill(self) -> int:
        chunker = self.engine.chunker
        if self.chunk is None:  # single-stage: never measured, so the configured chunk
            self.chunk = chunker.size
        chunk = self.chunk
        prompt = self.prompt
        n = len(prompt)
        compute_us = 0  # the head's compute for this prompt
        for lo in range(0, n, chunk):
            part = prompt[lo:lo + chunk]
            final = lo + chunk >= n
            if self.lane is None:
                token = await self._compute(part, lo, want_token=final)
                if final:
                    return int(token)
                continue
            native_before = self.native_us
            hidden = await self._compute(part, lo, want_token=False)
            compute_us += self.native_us - native_before
            msg = PrefillChunk(self.wire_request_id, self.live.session_id, lo, part, hidden, final=final)
            if not final:
                with self._watched(), span("head.forward_write", request=self.live.request_id,
                                           session=self.live.session_id, pos=lo, tokens=len(part)):
                    await self.lane.link.send_deferred(msg)
            else:
                chunker.observe_prefill(n, compute_us)
                return await self._predict(msg)
        raise AssertionError("unreachable: the prompt is not empty")

    async def _decode_loop(self, token: int) -> None:
        model = self.engine.model
        hot_path = self.engine.scheduler.hot_path
        step_started = step_cpu = None
        while True:
            if step_started is not None:  # one step: from having a token to having the next
                cpu_s = time.thread_time() - step_cpu - self.loop_native_cpu_us / 1e6
                hot_path.note(time.perf_counter() - step_started - self.waited_us / 1e6, self.native_us, cpu_s,
                              self.waited_cpu_s)
            step_started, step_cpu = time.perf_counter(), time.thread_time()
            self.waited_us = self.native_us = self.loop_native_cpu_us = 0
            self.waited_cpu_s = 0.0
            if self.live.first_token_at is None:  # (with last_token_at, the decode rate: see LiveGeneration)
                self.live.first_token_at = step_started
                self.ttft_ms = (step_started - self.started) * 1e3
            self.tokens.append(token)
            self.live.generated = len(self.tokens)
            if not self.req.ignore_eos and model.is_eog(token):
                self.tokens.pop()  # end-of-generation is not part of the answer
                self.live.generated -= 1  # (nor of the rate so far, while the session is released)
                self._emit(self.detok.flush(), final=True)
                self.finish_reason = "stop"
                return
            self.live.last_token_at = step_started
            in_flight = None
            if self.lane is not None and len(self.tokens) < self.max_tokens:
                # the next step goes down the pipeline first (it is the critical path); this token's text is
                # made and streamed while the other stages compute. A stop string found below leaves that
                # step in flight: the cleanup collects its reply before it stops the session.
                in_flight = await self._step_begin(token)
            text, hit = self.stops.push(self.detok.push(token))
            self._emit(text)
            if hit:
                self.finish_reason = "stop"
                return
            if len(self.tokens) >= self.max_tokens:
                self._emit(self.detok.flush(), final=True)
                self.finish_reason = "length"
                return
            token = await (self._predict_finish(in_flight) if in_flight is not None else self._step(token))

    async def _step(self, token: int) -> int:
        if self.lane is None:
            if self._let_out is not None:
                await self._let_out()  # the text so far goes out before the compute may block the loop
            token = int(await self._compute(np.array([token], dtype=np.int32), self.position, want_token=True))
            if self._let_out is None:
                await trio.lowlevel.checkpoint()  # the compute may not have been one (Scheduler.submit)
            return token
        return await self._predict_finish(await self._step_begin(token))

    async def _step_begin(self, token: int) -> _InFlight:
        """Compute the head's slice for `token` and send the decode step on (its prediction owed)."""
        tokens = np.array([token], dtype=np.int32)
        pos = self.position
        unacked = self.returns is not None and self._unacked_step()
        n = self.engine.context.n_embd * 4  # the step's frame goes as the compute ends (see Job.out)
        prepared = self.lane.link.prepare_step(
            decode_step_head(self.wire_request_id, self.live.session_id, pos, token, unacked, n), n)
        hidden = await self._compute(tokens, pos, want_token=False, out=prepared)
        # built without the class's checks: the head made every value (its ids, its position, an int32 array of
        # its token, the context's float32 rows of the hidden state), and the checks would cost as much again
        # as building and sending the frame
        sent = await self._predict_begin(_trusted_step(self.wire_request_id, self.live.session_id, pos, tokens,
                                                       hidden, unacked), prepared)
        if self.batched:
            # the other sessions of this batch send their steps before any of them goes on (streams its
            # text): back to back, they reach the next stage within its gather window and are decoded there
            # as one batch too. One by one, with each one's text in between, they could take longer, and a
            # group split on stage 1 comes back to the head split too.
            await trio.lowlevel.checkpoint()
        return sent

    def _unacked_step(self) -> bool:
        """Direct return: send this decode step with DIRECT_RETURN, which stage 1 does not acknowledge? Not
        the first ACKED_DECODE_STEPS; from then on, once the lane is watched for anything stage 1 says
        (an Error instead of forwarding the step): the head then wakes once per token, for the prediction,
        instead of twice."""
        lane = self.lane
        if self._silent_lane is lane and lane.link.watching_silence:
            return True
        if self._acked_steps < ACKED_DECODE_STEPS or not lane.link.settled:
            self._acked_steps += 1
            return False
        hub, session_id = self.engine.hub, self.live.session_id

        def spoke() -> None:
            if self.lane is lane:  # not a lane this session has left (resumed on another)
                hub.wake(session_id, LaneSpoke(lane.lane_id))

        if not lane.link.watch_silence(spoke):
            return False
        self._silent_lane = lane
        return True

    async def _read_unasked(self, spoke: LaneSpoke) -> NoReturn:
        """Stage 1 spoke on the lane, where the decode steps owe nothing: read what it said, and fail."""
        lane = self.lane
        with self._watched():
            reply = await lane.link.read_unasked()
        self._stats.add(reply.stats)
        if isinstance(reply, ErrorReply):
            raise _stage_error(reply)
        lane.dirty = True
        raise GenerationError(f"stage 1 sent {type(reply).__name__} on lane {spoke.lane_id}, where nothing was "
                              f"owed", status=502)

    def _emit(self, text: str, *, final: bool = False) -> None:
        if final:
            text += self.stops.flush()
            if self.stops.stops:  # a stop string may only be completed by what was held back
                cut = min((i for i in (text.find(s) for s in self.stops.stops) if i >= 0), default=-1)
                if cut >= 0:
                    text = text[:cut]
        if text:
            self.text_parts.append(text)
            if self.on_piece is not None:
                self.on_piece(text)  # queued for the client's own task: a generation never waits for its client

    async def _cleanup(self) -> None:
        """Runs shielded. Stop the session down the lane (bounded), then free the head's own sequence (whatever
        the stop raised: a bug there must not leak a session slot)."""
        engine = self.engine
        self._close_returns()
        if self.session is not None:
            engine.scheduler.forget(self.session.seq)  # now: the other sessions' batches wait for it no more
        try:
            if self.lane is not None:
                lane, self.lane = self.lane, None
                stopped = False
                try:
                    with trio.move_on_after(STOP_TIMEOUT_S) as bounded:
                        stopped = await self._stop_lane(lane)
                    if bounded.cancelled_caught:
                        log.warning("head: stop for session %d not acknowledged within %g s: closing lane %d",
                                    self.live.session_id, STOP_TIMEOUT_S, lane.lane_id)
                finally:
                    if not stopped:
                        # closing the lane makes stage 1 (and every stage after it) release the session
                        lane.dirty = True
                    await engine.pool.checkin(lane)
        finally:
            if self.sampler is not None:
                self.sampler.close()
            if self.session is not None:
                seq = self.session.seq
                try:
                    with trio.move_on_after(STOP_TIMEOUT_S):
                        await engine.scheduler.run_kv(lambda: engine.context.kv_clear_seq(seq))
                finally:
                    engine.sessions.forget(self.session)

    async def _stop_lane(self, lane: Lane) -> bool:
        """Finish the request a cancellation interrupted, then Stop the session; True once stage 1
        acknowledged the Stop (its relay means every later stage did too)."""
        if lane.dirty or lane.link is None or lane.link.broken:
            return False  # known to be wedged or gone: a Stop would only wait for it
        try:
            if not lane.link.settled:
                await lane.link.settle()
            reply, *_ = await lane.link.request(Stop(self.wire_request_id, self.live.session_id))
        except DownstreamError as exc:
            log.warning("head: stop for session %d failed: %s", self.live.session_id, exc)
            return False
        self._stats.add(reply.stats)  # with the reports of the decode steps that owed no ack
        if not isinstance(reply, Ack):
            log.warning("head: stop for session %d answered with %s", self.live.session_id, reply)
            return False
        return True


@attrs.frozen
class _InFlight:
    """A request sent down the lane whose reply (or prediction) is still owed."""

    msg: object
    bytes: int
    write_us: int
    started: float = 0.0  # direct return: when the send began
    acked: bool = True  # ... and whether stage 1 acknowledges it on the lane (not a DIRECT_RETURN decode step)


# stage errors worth retrying shortly: a full or draining stage, or one further down that died or hung
_RETRYABLE = (ErrorCode.NO_CAPACITY, ErrorCode.SHUTTING_DOWN, ErrorCode.DOWNSTREAM_FAILED)
# ... of which a stage further down failed (died, hung, cut off)
_STAGE_FAILED = (ErrorCode.DOWNSTREAM_FAILED,)


class _PipelineFailures:
    """What :meth:`_Run._watched` and :meth:`_Run._sending` return (a class, not a generator: entered two or
    three times per decode step)."""

    __slots__ = ("run", "waiter")

    def __init__(self, run: _Run, watch: StageWatch | None, interrupt: Callable[[str], None] | None = None):
        self.run = run
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
            self.run.lane.dirty = True  # a Stop would wait for the same silent stage: close the lane instead
            raise GenerationError(f"pipeline failed: {exc}", retryable=True, status=502,
                                  stage_failure=True) from exc
        if isinstance(exc, DownstreamError):
            watch = self.run.engine.watch
            if watch is not None:
                watch.suspect()  # dead or cut off? status learns it now, not at the next generation
            raise GenerationError(f"pipeline failed: {exc}", retryable=True, status=502,
                                  stage_failure=True) from exc
        return False


def _stage_error(reply: ErrorReply) -> GenerationError:
    return GenerationError(f"stage error ({reply.code.name.lower()}): {reply.message}",
                           retryable=reply.code in _RETRYABLE,
                           status=400 if reply.code == ErrorCode.CONTEXT_FULL else 502,
                           stage_failure=reply.code in _STAGE_FAILED)


def _wire_sampling(p: llama.SamplingParams) -> WireSampling:
    return WireSampling(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, repeat_penalty=p.repeat_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        penalty_last_n=p.penalty_last_n, seed=DEFAULT_SEED if p.seed is None else p.seed,
        logit_bias=p.logit_bias)
