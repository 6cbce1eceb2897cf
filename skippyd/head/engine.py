"""Generation on the head (stage 0): the engine, and what a generation is asked and answers.

:class:`HeadEngine` admits a generation (:mod:`skippyd.head.admission`: one
wait with one queue timeout, whichever way the request came in), checks its
prompt (its images too: held to the limits, decoded and cut into chunks by
the projector, :meth:`HeadEngine.prepare`), runs it (:class:`~skippyd.head.run.GenerationRun`: configure →
prefill → decode → cleanup), and keeps what the control plane shows of it:
the live table (and a kill for each entry), receipts and totals.

Liveness (``watch``, a :class:`~skippyd.head.liveness.StageWatch`): while
the watch says a stage is down, new generations are refused (retryable);
every wait on the pipeline is watched (:mod:`skippyd.head.lane_client`).
Direct token return (``hub``) and resume (``resume_window``) are described
in :mod:`skippyd.head.lane_client` and :mod:`skippyd.head.resume`.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import math
import secrets
import time
from collections import deque
from pathlib import Path

import attrs
import numpy as np
import trio

from skippyd.head.admission import AdmissionGate
from skippyd.head.availability import Availability
from skippyd.head.chunking import PrefillChunker
from skippyd.head.errors import Draining, GenerationError, ImageRefused, PromptTooLong, QueueTimeout
from skippyd.head.images import ImageInput, ImageLimits, image_prompt
from skippyd.head.lane_client import LaneServices, TokenPaths
from skippyd.head.lanes import LanePool
from skippyd.head.live import LiveGeneration
from skippyd.head.liveness import StageWatch
from skippyd.head.local_lane import LocalLanes
from skippyd.head.pipeline_lane import PipelineLanes
from skippyd.head.prompt import Prompt
from skippyd.head.run import GenerationRun, HeadParts
from skippyd.head.sequence import HeadCompute
from skippyd.head.sink import DISCARD, GenerationSink
from skippyd.head.speculation import DEFAULT_MAX_DRAFT, SpeculationTotals
from skippyd.head.states import FinishReason
from skippyd.head.token_return import TokenReturnHub
from skippyd.runtime import chat_template, llama, mtmd
from skippyd.sampling import InvalidSampling, SamplingParams
from skippyd.stage.prefix_cache import PrefixCache
from skippyd.stage.scheduler import Scheduler
from skippyd.stage.sessions import SessionTable
from skippyd.telemetry import span
from skippyd.wire.messages import StageStats

__all__ = ["Draining", "FinishReason", "GenerationError", "GenerationRequest", "GenerationResult", "GenerationSink",
           "HeadEngine", "ImageInput", "ImageRefused", "LiveGeneration", "PromptTooLong", "QueueTimeout", "Receipt"]

log = logging.getLogger("skippyd.head")
# a prompt of this many characters or more is rendered and tokenized in a worker thread (~1,000 tokens, ~5 ms)
LONG_PROMPT_CHARS = 4096


def _text_size(req: GenerationRequest) -> int:
    """About how many characters the request's prompt has (its messages' contents, or the raw prompt)."""
    return len(req.prompt or "") + len(req.system or "") + sum(
        len(c) if isinstance(c := m.get("content"), str) else len(str(c)) for m in req.messages)


@attrs.frozen
class GenerationRequest:
    prompt: str | None = None  # used as is with raw=True, else as the user message
    messages: tuple[dict, ...] = ()  # chat messages ({role, content}); wins over prompt
    system: str | None = None
    raw: bool = False
    prompt_tokens: tuple[int, ...] | None = None  # the prompt as token ids (a completion may send them)
    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    tools: tuple[dict, ...] = ()  # OpenAI function tools, for a chat template that presents them itself
    speculate: bool | None = None  # speculative decoding for this generation (None: the daemon's setting)
    origin: str = "control"  # who asked (the console shows it): "control" or "openai"
    # images, in prompt order: those of the messages' {"type": "image"} parts, or of the prompt's media markers
    # (none in the prompt: they go before its text)
    images: tuple[ImageInput, ...] = ()
    prepared: Prompt | None = attrs.field(default=None, eq=False)  # the prompt, made already (HeadEngine.prepare)


@attrs.define
class GenerationResult:
    request_id: int
    session_id: int
    text: str
    tokens: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    ttft_ms: float
    decode_tokens_per_s: float
    elapsed_ms: float
    stage_stats: dict = attrs.field(factory=dict)
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens no stage computed: every stage held them in its prefix cache
    # per stage, {"stage", "cached_tokens"}: the prompt tokens that stage held rather than computed
    prefix_cache: list[dict] = attrs.field(factory=list)
    image_encode_ms: float = 0.0  # the projector's time on the prompt's images
    # with sampling.logprobs: one TokenLogprobs per token of ``tokens`` (the final stage's, from the distribution
    # it sampled from); None without
    logprobs: list | None = None
    speculation: dict | None = None  # a speculative generation's windows, drafted and accepted tokens

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "session_id": self.session_id,
            "text": self.text,
            "tokens": self.tokens,
            "finish_reason": str(self.finish_reason),
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens),
                      "total_tokens": self.prompt_tokens + len(self.tokens), "cached_tokens": self.cached_tokens,
                      "prefix_cache": self.prefix_cache,
                      **({} if self.speculation is None else {"speculation": self.speculation})},
            "timings": {"ttft_ms": round(self.ttft_ms, 3), "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
                        "elapsed_ms": round(self.elapsed_ms, 3), "image_encode_ms": round(self.image_encode_ms, 3),
                        # speculative decoding: draft tokens verified, those accepted, verify windows sent
                        "drafted": self.speculation["drafted"] if self.speculation else 0,
                        "accepted": self.speculation["accepted"] if self.speculation else 0,
                        "windows": self.speculation["windows"] if self.speculation else 0},
            "error": self.error,
            "stage_stats": self.stage_stats,
            **({} if self.logprobs is None else {"logprobs": [
                {"token": e.token, "logprob": _finite(e.logprob), "top": [[t, _finite(lp)] for t, lp in e.top]}
                for e in self.logprobs]}),
        }


def _finite(x: float) -> float | None:
    """JSON has no NaN nor infinity: null."""
    return x if math.isfinite(x) else None


@attrs.define
class Receipt:
    request_id: int
    session_id: int
    prompt_sha256: str
    prompt_tokens: int
    tokens: list[int]
    final_position: int
    termination: FinishReason
    ttft_ms: float
    elapsed_ms: float
    finished_at: float


class HeadEngine:
    def __init__(self, model: llama.Model, context: llama.Context, scheduler: Scheduler,
                 pool: LanePool | None, *, prefill_chunk: int = 256, receipts_file: Path | None = None,
                 receipts_kept: int = 256, queue_timeout: float = 30.0, hub: TokenReturnHub | None = None,
                 watch: StageWatch | None = None, resume_window: float | None = None,
                 prefix_cache: PrefixCache | None = None, speculate_max_draft: int = 0, speculate_in_flight: int = 4,
                 chat_template: str | None = None, projector: mtmd.Projector | None = None,
                 image_limits: ImageLimits | None = None):
        self.model = model
        self.projector = projector  # images in prompts (None: this model takes none)
        self.image_limits = image_limits or ImageLimits()
        self.chat_template = chat_template  # the operator's, in place of the model's own (None: the model's)
        self.context = context
        self.scheduler = scheduler
        self.pool = pool
        self.prefill_chunk = max(1, min(prefill_chunk, context.n_batch))
        # the chunk grows past the configured one when the link's round trip needs it
        self.chunker = PrefillChunker(self.prefill_chunk, context.n_batch, pool.credit_limit if pool else 1)
        # admission: a generation waits (up to queue_timeout) for one of the head's sequence slots; the
        # table then assigns which one (it never runs out: the gate holds the others back)
        self.sessions = SessionTable(context.n_seq_max)
        self.gate = AdmissionGate(context.n_seq_max, queue_timeout)
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
        self.token_paths = TokenPaths()
        self.lane_services = LaneServices(watch, hub, self.chunker, self.token_paths, context.n_embd,
                                          max_in_flight=speculate_in_flight)
        # the KV of stage 0's layers for prompts the head has computed (none: budget 0)
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(0, stage_index=0)
        # speculative decoding: on for every generation with a max_draft (a request may say otherwise)
        self.speculation = SpeculationTotals(max_draft=speculate_max_draft)
        # a single stage's generations sample on the head; a pipeline's go down lanes (chosen here, once)
        lanes = LocalLanes(model) if pool is None else PipelineLanes(pool, self.lane_services, self.new_request_id)
        # a pipeline's head records the hidden states it sends on, so that it can send them again without
        # computing for a stage after it that lost a prefix the head holds (skippyd/stage/boundary.py)
        compute = HeadCompute(context, scheduler, self.sessions, self.prefix_cache,
                              boundary=pool is not None and self.prefix_cache.enabled)
        # whether the pipeline serves, as a supervising deployment says (skippyd/deploy/supervisor.py)
        self.availability = Availability()
        self.parts = HeadParts(compute, lanes, model.token_piece, model.is_eog, self.chunker, watch, resume_window,
                               self.speculation, self.availability)

    def describe_token_return(self) -> dict | None:
        if self.pool is None:
            return None
        hub = self.hub.describe() if self.hub is not None else {"listen": None}
        return {**hub, **self.token_paths.describe(), "enabled": self.lane_services.wants_direct_return}

    # ------------------------------------------------------------------ prompt
    def prompt_tokens(self, req: GenerationRequest) -> np.ndarray:
        """The prompt the request asks for, without images, tokenized (through the chat template unless raw)
        and checked: not empty, and leaving room in a session's context. Raises GenerationError (status 400),
        PromptTooLong when it does not fit; LlamaError if it cannot be tokenized. (A prompt with images:
        :meth:`prepare`.)"""
        tokens = self._tokenize(req)
        n_ctx = self.context.n_ctx_seq
        if len(tokens) == 0:
            raise GenerationError("the prompt is empty", status=400)
        if len(tokens) >= n_ctx:
            raise PromptTooLong(f"the prompt has {len(tokens)} tokens; the context holds {n_ctx} per session",
                                tokens=len(tokens), n_ctx=n_ctx)
        return tokens

    async def tokenize_prompt(self, req: GenerationRequest) -> np.ndarray:
        """:meth:`prompt_tokens`, in a worker thread for a long prompt: rendering and tokenizing take some
        5 µs a token, which the event loop (and every ping it answers) would otherwise wait out."""
        if _text_size(req) < LONG_PROMPT_CHARS:
            return self.prompt_tokens(req)
        return await trio.to_thread.run_sync(self.prompt_tokens, req)

    def _tokenize(self, req: GenerationRequest) -> np.ndarray:
        if req.prompt_tokens is not None:
            return np.asarray(req.prompt_tokens, dtype=np.int32)
        if req.raw:
            return self.model.tokenize(req.prompt or "", add_special=True, parse_special=False)
        return self.model.tokenize(self._chat_text(req), add_special=False, parse_special=True)

    def _chat_text(self, req: GenerationRequest, marker: str | None = None) -> str:
        """The chat the request asks for, through the chat template; image parts become `marker`."""
        messages = list(req.messages)
        if not messages:
            messages = [{"role": "user", "content": req.prompt or ""}]
        if req.system and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": req.system})
        try:
            return chat_template.render_chat(self.model, messages, tools=req.tools or None,
                                             template_source=self.chat_template, media_marker=marker)
        except llama.InvalidArgumentError as exc:
            raise GenerationError(f"{exc} (send a raw prompt instead)", status=400) from exc

    async def prepare(self, req: GenerationRequest) -> Prompt:
        """The request's prompt, checked (see :meth:`prompt_tokens`), with its images: each held to the image
        limits before it is decoded, then decoded and cut into chunks in a worker thread. Raises
        ImageRefused (400, 413) for an image this head cannot take, PromptTooLong (its tokens and image rows
        counted) when it does not fit a session's context. The caller owns the prompt (``close`` it)."""
        if req.prepared is not None:
            return req.prepared
        if not req.images:
            return Prompt.of_tokens(await self.tokenize_prompt(req))
        if self.projector is None:
            raise ImageRefused("this model takes no images: start the head with --mmproj", source=req.images[0].source)
        for image in req.images:
            self.image_limits.check(image)
        text = self._image_text(req)
        prompt = await trio.to_thread.run_sync(functools.partial(image_prompt, self.projector, text, req.images,
                                                                 raw=req.raw))
        try:
            self._check_fits(prompt)
        except BaseException:
            prompt.close()
            raise
        return prompt

    def _image_text(self, req: GenerationRequest) -> str:
        """The prompt's text with one media marker per image: the chat's (its image parts), or the raw prompt's
        own markers, or, if it has none, the markers before its text."""
        marker = self.projector.marker
        if req.messages:
            return self._chat_text(req, marker)
        text, n = req.prompt or "", len(req.images)
        found = text.count(marker)
        if found not in (0, n):
            raise ImageRefused(f"the prompt has {found} image markers ({marker}) for {n} images: none (the images "
                               f"go first) or one per image", source="prompt")
        if not found:
            if not req.raw:  # the chat's user message: its images, then its text
                content = [*({"type": "image"} for _ in req.images), {"type": "text", "text": text}]
                return self._chat_text(attrs.evolve(req, messages=({"role": "user", "content": content},)), marker)
            text = marker * n + text
        return self._chat_text(req, marker) if not req.raw else text

    def _check_fits(self, prompt: Prompt) -> None:
        n_ctx = self.context.n_ctx_seq
        # every row (a token, an image's row) takes a KV cell, and a session has n_ctx of them; an image may
        # take fewer positions than rows (M-RoPE), never more
        if prompt.n_rows >= n_ctx:
            raise PromptTooLong(f"the prompt has {prompt.n_rows} tokens ({prompt.image_rows} of them for its "
                                f"{len(prompt.images)} image parts); the context holds {n_ctx} per session",
                                tokens=prompt.n_rows, n_ctx=n_ctx)
        batch = self.context.n_batch
        for piece in prompt.images:
            if not piece.causal and piece.n_rows > batch:
                raise ImageRefused(f"an image of {piece.n_rows} rows computed in one batch (its rows attend to each "
                                   f"other both ways) exceeds the batch of {batch} (runtime.batch)")

    # ------------------------------------------------------------------ generate
    async def generate(self, req: GenerationRequest, sink: GenerationSink = DISCARD) -> GenerationResult:
        """Check, admit and run one generation, its output handed to ``sink`` as it is made. Raises
        GenerationError: QueueTimeout when it found no place within the queue timeout."""
        started = time.perf_counter()
        sampling = req.sampling
        try:
            sampling.validate(self.model.n_vocab)
            if sampling.constraint is not None:
                sampling.constraint.check()  # a schema or grammar that does not compile goes to no stage
        except InvalidSampling as exc:
            raise GenerationError(f"sampling parameters: {exc}", status=400) from exc
        if req.max_tokens < 1:
            raise GenerationError("max_tokens must be >= 1", status=400)
        prompt = await self.prepare(req)
        try:
            return await self._generate(req, prompt, sink, started)
        finally:
            prompt.close()

    async def _generate(self, req: GenerationRequest, prompt: Prompt, sink: GenerationSink,
                        started: float) -> GenerationResult:
        sampling = req.sampling
        max_tokens = min(req.max_tokens, self.context.n_ctx_seq - prompt.n_rows)
        request_id = self.new_request_id()
        session_id = secrets.randbits(63)
        live = LiveGeneration(request_id, session_id, prompt.n_rows, time.monotonic(), trio.CancelScope(),
                              origin=req.origin)
        self.live[session_id] = live
        run = GenerationRun(self.parts, live, prompt, max_tokens, sampling, req.stop, req.ignore_eos, sink,
                            started, max_draft=self._max_draft(req.speculate))
        try:
            with live.cancel_scope, span("head.generation", request=request_id, session=session_id) as sp:
                deadline = await self._admit()
                try:
                    await run.execute(deadline)
                finally:
                    self.gate.leave()
                sp.set(tokens=len(run.reply.tokens), finish=run.reply.finish_reason)
            if live.cancel_scope.cancelled_caught:
                run.reply.finish_reason = FinishReason.CANCELLED
                run.error = live.killed
        except GenerationError as exc:
            self.totals["errors"] += 1
            run.error = str(exc)
            # the client gets the error; the operator, a line: a busy or recovering pipeline (503) is routine
            log.log(logging.INFO if exc.status == 503 else logging.WARNING,
                    "head: session %d (request %d) failed after %d tokens: %s", session_id, request_id,
                    len(run.reply.tokens), exc)
            raise
        except trio.Cancelled:
            run.reply.finish_reason = FinishReason.CANCELLED
            raise
        finally:
            self.live.pop(session_id, None)
            self._record(run)
        return self._result(run)

    def supervise(self, resume_window: float, max_wait: float) -> None:
        """A deployment supervises this head: a generation a lost stage interrupts is replayed within
        `resume_window` (at least), and new ones wait up to `max_wait` while it recovers rather than fail."""
        window = max(resume_window, self.resume_window or 0.0)
        self.resume_window = window
        self.parts = attrs.evolve(self.parts, resume_window=window)
        self.availability.supervised = True
        self.availability.max_wait = max_wait

    async def _admit(self) -> float:
        """Refuse while stage 1 is down (under a supervisor: wait while it recovers), else wait for a place;
        the admission's deadline (trio time)."""
        watch = self.watch
        if self.availability.supervised:
            await self.availability.wait_serving(watch)
        elif watch is not None and watch.down and not await watch.check():
            raise GenerationError(f"{watch.down_name} is down ({watch.last_error}); try again once it is back",
                                  retryable=True, status=503)
        return await self.gate.enter()

    def _max_draft(self, speculate: bool | None) -> int:
        """Drafts per verify window for a generation that asks ``speculate`` (None: the daemon's setting)."""
        configured = self.speculation.max_draft
        if speculate is None:
            return configured
        return (configured or DEFAULT_MAX_DRAFT) if speculate else 0

    def new_request_id(self) -> int:
        return next(self._request_ids)

    def begin_drain(self) -> None:
        """Take no new generation, those waiting for a place included; running ones go on."""
        self.gate.close("the daemon is draining: no new generations")

    def kill(self, session_id: int, why: str) -> bool:
        """Cancel the generation; it ends through its normal cleanup, "cancelled", with `why` as its error."""
        live = self.live.get(session_id)
        if live is None:
            return False
        live.killed = why
        live.cancel_scope.cancel()
        return True

    @staticmethod
    def _result(run: GenerationRun) -> GenerationResult:
        live, reply = run.live, run.reply
        return GenerationResult(
            request_id=live.request_id, session_id=live.session_id, text=reply.text.text, tokens=list(reply.tokens),
            finish_reason=reply.finish_reason or FinishReason.ERROR, prompt_tokens=run.prompt.n_rows,
            ttft_ms=reply.ttft_ms,
            decode_tokens_per_s=live.decode_rate() or 0.0, elapsed_ms=run.elapsed_ms(),
            stage_stats=attrs.asdict(run.stats), error=run.error, cached_tokens=run.cached_tokens,
            prefix_cache=run.prefix_cache(),
            logprobs=None if reply.logprobs is None else list(reply.logprobs),
            speculation=None if run.speculation is None else run.speculation.describe(),
            image_encode_ms=run.prompt.encode_ms)

    def _record(self, run: GenerationRun) -> None:
        reply = run.reply
        if reply.finish_reason is None:
            reply.finish_reason = FinishReason.ERROR
        self.totals["generations"] += 1
        self.totals["prompt_tokens"] += run.prompt.n_rows
        self.totals["completion_tokens"] += len(reply.tokens)
        receipt = Receipt(
            request_id=run.live.request_id, session_id=run.live.session_id,
            prompt_sha256=hashlib.sha256(np.asarray(run.prompt.keys, dtype="<i4").tobytes()).hexdigest(),
            prompt_tokens=run.prompt.n_rows, tokens=list(reply.tokens), final_position=run.live.position,
            termination=reply.finish_reason, ttft_ms=reply.ttft_ms, elapsed_ms=run.elapsed_ms(),
            finished_at=time.time())
        self.receipts.append(receipt)
        if self.receipts_file is not None:
            try:
                with open(self.receipts_file, "a") as f:
                    f.write(json.dumps(attrs.asdict(receipt)) + "\n")
            except OSError as exc:
                log.warning("head: cannot append receipt to %s: %s", self.receipts_file, exc)

