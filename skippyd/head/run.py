"""One generation on the head while it runs: configure → prefill → decode → cleanup.

The head runs the first slice itself (through its own scheduler, so that
concurrent generations batch their decode steps), sends hidden states down a
lane (:mod:`skippyd.head.lane_client`), and gets the predicted token back.
With no downstream (single-stage mode) it samples locally with the same code
path.

In a pipeline, each decode step goes down the lane before the previous
token is detokenized and streamed, so that work overlaps the other stages'
compute instead of adding to every token's time.

Whatever ends a generation (finish, stop string, cancellation, an error)
:meth:`GenerationRun._cleanup` stops the session down the lane (shielded,
time-bounded) and releases the head's own KV sequence. A generation
cancelled mid-request first finishes that request (reads the reply or acks
stage 1 still owes), then sends Stop and waits for its ack, so every stage
has freed the session's slot before the head frees its own; only a lane that
cannot be finished in time (a half-written frame, a silent stage) is closed
instead, which makes stage 1 release the session when it notices.

A stage failure with ``--resume`` replays the generation on a new lane
(:mod:`skippyd.head.resume`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import attrs
import numpy as np
import trio

from skippyd.head.chunking import PrefillChunker
from skippyd.head.errors import GenerationError, QueueTimeout
from skippyd.head.lane_client import InFlight, LaneClient, LaneServices, RelayedLane
from skippyd.head.lanes import Draining, Lane, LanePool, NoLaneAvailable
from skippyd.head.live import LiveGeneration
from skippyd.head.resume import ResumePolicy
from skippyd.head.sink import GenerationSink
from skippyd.head.speculation import Speculation, SpeculationTotals
from skippyd.head.step_clock import StepClock
from skippyd.head.text_output import TextOutput
from skippyd.runtime import llama
from skippyd.sampling import SamplingParams
from skippyd.stage.downstream import DownstreamError
from skippyd.stage.execution import Job
from skippyd.stage.prefix_cache import PrefixCache, record_from, restore_into
from skippyd.stage.scheduler import Scheduler
from skippyd.stage.sessions import SessionTable
from skippyd.telemetry import span
from skippyd.wire.messages import MAX_TOKENS, PrefillChunk, StageStats, StatsTotal, VerifyWindow
from skippyd.wire.stream import PreparedFrame

log = logging.getLogger("skippyd.head")

STOP_TIMEOUT_S = 2.0  # the cleanup's Stop down the lane, and the release of the head's sequence, each


@attrs.frozen
class HeadParts:
    """What a generation uses of the head: its model, context, scheduler and sequence table, the lanes (None:
    single stage) and what their clients share, and the resume window (None: no replay)."""

    model: llama.Model
    context: llama.Context
    scheduler: Scheduler
    sessions: SessionTable
    pool: LanePool | None
    chunker: PrefillChunker
    lane_services: LaneServices
    resume_window: float | None
    new_request_id: Callable[[], int]
    prefix_cache: PrefixCache  # the KV of stage 0's layers for prompts the head has computed
    speculation: SpeculationTotals  # speculative decoding: the daemon's setting, and its counters


class GenerationRun:
    """The state of one generation while it runs (admitted: it holds one of the engine's places)."""

    def __init__(self, head: HeadParts, live: LiveGeneration, prompt: np.ndarray, max_tokens: int,
                 sampling: SamplingParams, stops: tuple[str, ...],
                 ignore_eos: bool, sink: GenerationSink, started: float, *, max_draft: int = 0):
        self.head, self.live = head, live
        self.scheduler = head.scheduler
        # the request id on the wire: a new one for each replay, so that a reply owed to an attempt given up
        # (a stopped final stage sends it once it runs again, on the token-return connection, which outlives
        # lanes) is told apart from the replay's own replies, which carry the same session id
        self.wire_request_id = live.request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos  # end-of-generation tokens are generated like any other
        self.sampling = sampling
        self.started = started
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.position = 0
        self.cached_tokens = 0  # prompt positions restored from the prefix caches, not computed
        self._prompt_unrecorded = False  # a single stage: the prompt goes to the prefix cache after the 1st token
        self.ttft_ms = 0.0
        self.sink = sink
        self.text = TextOutput(head.model.token_piece, stops, sink.piece)
        self.clock = StepClock(head.scheduler.hot_path)
        self.resume = ResumePolicy(head.resume_window, head.lane_services.watch)
        self._stats = StatsTotal()  # every stage's reports for this generation, merged as they come
        self.lane: LaneClient | None = None
        self.session = None
        self.sampler: llama.Sampler | llama.GuidedSampler | None = None
        # each generated token's logprobs (sampling.logprobs set), in order; the sink gets each too, before the
        # token's text
        self.logprobs: list[llama.TokenLogprobs] | None = [] if sampling.logprobs is not None else None
        self.acked_steps = 0  # direct return: a generation's first decode steps are acknowledged (DirectLane)
        self.batched = False  # the last compute was one llama_decode with other sessions' steps
        # this generation's prefill chunk, chosen once: a replay (resume) must chunk the prompt the same way,
        # or its logits (and so a greedy replay's tokens) could differ from the first time
        self.chunk: int | None = None
        # speculative decoding: drafts per window at most (0: token by token); not with logprobs, which the
        # final stage reports per decode step
        self.max_draft = max_draft if sampling.logprobs is None else 0
        self.speculation: Speculation | None = None  # its state, from the first decode on

    @property
    def stats(self) -> StageStats:
        """Every stage's reports for this generation, merged."""
        return self._stats.total()

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1e3

    # ------------------------------------------------------------------ the run
    async def execute(self, deadline: float) -> None:
        """Run to the end; `deadline` (trio time): the admission's, which the wait for a lane shares."""
        head = self.head
        self.session = head.sessions.open(0, self.live.session_id, self.live.request_id)
        self.live.seq = self.session.seq
        try:
            if head.pool is None:
                if self.sampling.guided:  # a constraint compiles off the event loop
                    self.sampler = await trio.to_thread.run_sync(llama.sampler_for, head.model, self.sampling)
                else:
                    self.sampler = llama.sampler_for(head.model, self.sampling)
                self.live.state = "prefill"
                token = await self._prefill(await self._restore())
                self.live.state = "decode"
                await self._decode(token)
                return
            while True:
                try:
                    token = await self._catch_up(deadline)
                    self.resume.recovered()  # the pipeline is whole again
                    self.live.state = "decode"
                    await self._decode(token)
                    return
                except GenerationError as exc:
                    if not self.resume.may_resume(exc, self.live):
                        raise
                    self.resume.interrupted(exc, self.live)
                    await self._leave_lane()
                    await self.resume.wait(exc, self.live)
                    deadline = self.resume.deadline
        finally:
            # shielded: a kill must not cut the cleanup short; each step that waits has its own bound
            with trio.CancelScope(shield=True):
                await self._cleanup()

    async def _catch_up(self, deadline: float) -> int:
        """Configure the session down a new lane and bring every stage to where the generation is: the
        prompt, then (a replay) each token generated so far, in the same chunks and steps as the first time.
        Returns the next new token."""
        head = self.head
        if self.live.resumes:
            self.wire_request_id = head.new_request_id()
        lane = await self._checkout(deadline)
        lane.session_id = self.live.session_id
        self.live.lane_id = lane.lane_id
        self.lane = RelayedLane(lane, head.lane_services, session_id=self.live.session_id,
                                request_id=self.live.request_id, wire_request_id=self.wire_request_id,
                                stats=self._stats, clock=self.clock, acked_steps=self.acked_steps)
        self.lane = await self.lane.configure(self.sampling)
        if self.position:  # a replay: recompute the head's hidden states from position 0, as the first time
            seq = self.session.seq
            await head.scheduler.run_kv(lambda: head.context.kv_clear_seq(seq))
            self.position = 0
        self.live.state = "prefill"
        token = await self._prefill(await self._restore())
        for replayed in list(self.tokens):  # already emitted: their predictions are not emitted again
            token = await self._step(replayed)
        return token

    async def _checkout(self, deadline: float) -> Lane:
        head = self.head
        try:
            with span("head.lane_wait", request=self.live.request_id, session=self.live.session_id):
                return await head.pool.checkout(deadline)
        except Draining as exc:
            raise GenerationError(str(exc), retryable=True, status=503) from exc
        except NoLaneAvailable as exc:
            raise QueueTimeout(str(exc)) from exc
        except DownstreamError as exc:
            watch = head.lane_services.watch
            if watch is not None:
                watch.suspect()
            raise GenerationError(f"stage 1 is unreachable: {exc}", retryable=True, status=503,
                                  stage_failure=True) from exc

    # ------------------------------------------------------------------ prefill
    async def _restore(self) -> int:
        """Restore the longest prefix of the prompt that every stage has in its prefix cache (the head's own
        hit, then the hit the rest of the chain answers to it); returns its length, where the prefill
        starts (0: a miss, the whole prompt is computed). A stage that restored more than that trims itself
        when the prefill comes (positions are authoritative)."""
        cache = self.head.prefix_cache
        # the prompt's last token is always computed: its logits give the first generated token
        hit = cache.lookup(self.prompt, min(len(self.prompt) - 1, MAX_TOKENS))  # MAX_TOKENS: one RestorePrefix
        if hit is None:
            return 0
        length = hit.length
        if self.lane is not None:
            length = min(length, await self.lane.restore(self.prompt[:length]))
            if length < cache.min_hit:
                return 0
        if not await restore_into(self.scheduler, self.head.context, self.session.seq, hit, length):
            return 0
        cache.note_restored(length)
        self.position = self.live.position = self.cached_tokens = length
        return length

    async def _prefill(self, start: int = 0) -> int:
        """The prompt from position ``start`` (what the prefix caches restored), in chunks; returns the first
        generated token."""
        chunker = self.head.chunker
        if self.chunk is None:  # single-stage: never measured, so the configured chunk
            self.chunk = chunker.size
        chunk, prompt, lane = self.chunk, self.prompt, self.lane
        n = len(prompt)
        compute_us = 0  # the head's compute for this prompt
        for lo in range(start, n, chunk):
            part = prompt[lo:lo + chunk]
            final = lo + chunk >= n
            if lane is None:
                token = await self._compute(part, lo, want_token=final)
                if final:
                    self._prompt_unrecorded = True  # once the first token is out (see _step)
                    return int(token)
                continue
            native_before = self.clock.native_us
            hidden = await self._compute(part, lo, want_token=False)
            compute_us += self.clock.native_us - native_before
            msg = PrefillChunk(self.wire_request_id, self.live.session_id, lo, part, hidden, final=final)
            if not final:
                await lane.send_chunk(msg)
            else:
                chunker.observe_prefill(n - start, compute_us)
                sent = await lane.send(msg)
                await self._record()  # while the other stages compute
                return await self._predict_finish(sent)
        raise AssertionError("unreachable: the prompt is not empty")

    def _held_tokens(self) -> np.ndarray:
        """The token ids of the positions the head's sequence holds."""
        if self.position <= len(self.prompt):
            return self.prompt[:self.position]
        return np.concatenate([self.prompt, np.asarray(self.tokens, dtype=np.int32)])[:self.position]

    async def _record(self, *, clear: bool = False) -> None:
        """Keep what the head's sequence holds in its prefix cache (if the cache wants it); with ``clear``,
        then empty the sequence."""
        cache, seq, context = self.head.prefix_cache, self.session.seq, self.head.context
        if cache.enabled:
            await record_from(cache, self.scheduler, context, seq, self._held_tokens(), clear=clear)
        elif clear:
            await self.scheduler.run_kv(lambda: context.kv_clear_seq(seq))

    # ------------------------------------------------------------------ decode
    async def _decode(self, token: int) -> None:
        """Token by token until end-of-generation, a stop string or max_tokens (sets finish_reason)."""
        if self.max_draft:
            await self._decode_speculative(token)
            return
        live, tokens, text, clock, lane = self.live, self.tokens, self.text, self.clock, self.lane
        is_eog = self.head.model.is_eog
        clock.restart()
        while True:
            now = clock.tick()
            if live.first_token_at is None:  # (with last_token_at, the decode rate: see LiveGeneration)
                live.first_token_at = now
                self.ttft_ms = (now - self.started) * 1e3
            if not self.ignore_eos and is_eog(token):  # end-of-generation is not part of the answer
                text.finish()
                self.finish_reason = "stop"
                return
            tokens.append(token)
            if self.logprobs is not None:
                self._keep_logprobs(token)
            live.generated = len(tokens)
            live.last_token_at = now
            in_flight = None
            if lane is not None and len(tokens) < self.max_tokens:
                # the next step goes down the pipeline first (it is the critical path); this token's text is
                # made and streamed while the other stages compute. A stop string found below leaves that
                # step in flight: the cleanup collects its reply before it stops the session.
                in_flight = await self._step_begin(token)
            if self._text_ends(token):
                return
            token = await (self._predict_finish(in_flight) if in_flight is not None else self._step(token))

    def _text_ends(self, token: int) -> bool:
        """Push the token's text; True if the generation ends with it (a stop string, max_tokens), its
        finish_reason set."""
        if self.text.push(token):
            self.finish_reason = "stop"
            return True
        if len(self.tokens) >= self.max_tokens:
            self.text.finish()
            self.finish_reason = "length"
            return True
        return False

    async def _decode_speculative(self, token: int) -> None:
        """As _decode, several tokens per trip round the pipeline where drafts pay. Each answer (a window's: the
        drafts the final stage accepted, which every stage has computed already, then the next token; or a
        plain step's token) is counted first; unless the generation ends within it, the next window (or step,
        when no drafts are worth one) goes out for its last token at once, and its text is made and streamed
        while the other stages compute, as in _decode."""
        live, tokens, text, clock = self.live, self.tokens, self.text, self.clock
        is_eog = self.head.model.is_eog
        if self.speculation is None:
            self.speculation = live.speculation = Speculation(self.max_draft, self.head.speculation)
        spec = self.speculation
        spec.begin([*self.prompt.tolist(), *tokens])  # (again after a replay: the context so far)
        answer = [token]  # predicted, not yet emitted; the last one's hidden state is owed
        clock.restart()
        while True:
            now = clock.tick()
            if live.first_token_at is None:
                live.first_token_at = now
                self.ttft_ms = (now - self.started) * 1e3
            emitted, end = len(tokens), None
            for t in answer:
                tokens.append(t)
                spec.extend(t)
                if not self.ignore_eos and is_eog(t):
                    tokens.pop()  # end-of-generation is not part of the answer
                    end = "stop"
                    break
                if len(tokens) >= self.max_tokens:
                    end = "length"
                    break
            live.generated = len(tokens)
            live.last_token_at = now
            sent = drafts = None
            began = time.perf_counter()  # a window's or a step's time: what sizes the windows
            if end is None:
                drafts = spec.drafts(self.max_tokens - len(tokens) - 1)
                last = tokens[-1]
                sent = await (self._window_begin(last, drafts) if drafts else self._step_begin_any(last))
            for i in range(emitted, len(tokens)):
                if text.push(tokens[i]):  # a stop string: the generation ends with this token
                    del tokens[i + 1:]
                    live.generated = len(tokens)
                    self.finish_reason = "stop"
                    return
            if end is not None:
                text.finish()
                self.finish_reason = end
                return
            if drafts:
                answer = await self._window_finish(sent)
                spec.window_done(len(drafts), len(answer) - 1, time.perf_counter() - began)
            else:
                answer = [await self._step_finish_any(sent)]
                spec.plain_step_done(answer[0], time.perf_counter() - began)

    async def _window_begin(self, token: int, drafts: list[int]):
        """Compute the head's slice for the window [token, drafts...] and send it on (its answer owed); on a
        single stage, compute and sample it (the answer)."""
        window = np.array([token, *drafts], dtype=np.int32)
        pos = self.position
        if self.lane is None:
            await self.sink.let_out()
            await self._record_prompt()
            if isinstance(self.sampler, llama.GuidedSampler):
                self.sampler.advance(token)
            return pos, await self._compute(window, pos, want_token=True, window=True)
        hidden = await self._compute(window, pos, want_token=False, window=True)
        return pos, await self.lane.send(VerifyWindow(self.wire_request_id, self.live.session_id, pos, window, hidden))

    async def _window_finish(self, sent) -> list[int]:
        """The window's answer (its accepted drafts, then the next token); the head's sequence keeps only the
        positions of the token and the accepted drafts (the other stages trim at the next message)."""
        pos, answer = sent
        predicted = answer if self.lane is None else await self._predict_window(answer)
        held = pos + len(predicted)  # the window's token and its accepted drafts
        if held < self.position:
            seq, context = self.session.seq, self.head.context
            await self.scheduler.run_kv(lambda: context.kv_trim(seq, held))
            self.position = self.live.position = held
        return predicted

    async def _predict_window(self, sent: InFlight) -> list[int]:
        predicted = await self.lane.window_predictions(sent)
        self.scheduler.back(self.session.seq)
        return predicted

    async def _step_begin_any(self, token: int):
        """A plain decode step of a speculative generation: sent on (a pipeline), or computed (single stage)."""
        if self.lane is None:
            return await self._step(token)
        return await self._step_begin(token)

    async def _step_finish_any(self, sent) -> int:
        return sent if self.lane is None else await self._predict_finish(sent)

    def _keep_logprobs(self, token: int) -> None:
        """The logprobs of the token just appended: its prediction's (a lane's reply, or the head's own sampler
        on a single stage)."""
        got = self.lane.logprobs if self.lane is not None else getattr(self.sampler, "last", None)
        if got is None or got.token != token:
            got = llama.TokenLogprobs(token, float("nan"))  # not reported: never expected, kept in step
        self.logprobs.append(got)
        self.sink.logprobs(got)

    async def _step(self, token: int) -> int:
        """One decode step, whole: its token's prediction."""
        if self.lane is None:
            await self.sink.let_out()  # the text so far goes out before the compute may block the loop
            await self._record_prompt()
            if isinstance(self.sampler, llama.GuidedSampler):
                self.sampler.advance(token)  # the constraint follows the tokens the sequence is given
            return int(await self._compute(np.array([token], dtype=np.int32), self.position, want_token=True))
        return await self._predict_finish(await self._step_begin(token))

    async def _record_prompt(self) -> None:
        """A single stage: the prompt goes to the prefix cache once the first token is out (not before it: a
        record is not its client's wait)."""
        if self._prompt_unrecorded:
            self._prompt_unrecorded = False
            await self._record()

    async def _step_begin(self, token: int) -> InFlight:
        """Compute the head's slice for `token` and send the decode step on (its prediction owed)."""
        tokens = np.array([token], dtype=np.int32)
        pos, lane = self.position, self.lane
        prepared = lane.prepare_step(pos, token)  # the step's frame goes as the compute ends (see Job.out)
        hidden = await self._compute(tokens, pos, want_token=False, out=prepared)
        sent = await lane.send_step(pos, tokens, hidden, prepared)
        if self.batched:
            # the other sessions of this batch send their steps before any of them goes on (streams its
            # text): back to back, they reach the next stage within its gather window and are decoded there
            # as one batch too. One by one, with each one's text in between, they could take longer, and a
            # group split on stage 1 comes back to the head split too.
            await trio.lowlevel.checkpoint()
        return sent

    async def _predict_finish(self, sent: InFlight) -> int:
        token = await self.lane.prediction(sent)
        self.scheduler.back(self.session.seq)  # its next step follows (decode groups: see Scheduler)
        return token

    async def _compute(self, tokens: np.ndarray, pos: int, *, want_token: bool, out: PreparedFrame | None = None,
                       window: bool = False):
        job = Job(self.session.seq, pos, tokens=tokens, embd=None, sampler=self.sampler, want_token=want_token,
                  out=out, window=window, window_tokens=tokens if window else None)
        try:
            with span("head.compute", request=self.live.request_id, session=self.live.session_id, pos=pos,
                      tokens=len(tokens)):
                result = await self.scheduler.submit(job)
        except llama.LlamaError as exc:
            raise GenerationError(f"head compute failed: {exc}") from exc
        clock = self.clock
        clock.native_us += job.native_us
        clock.loop_native_cpu_us += job.loop_native_cpu_us
        clock.waited_us += job.lock_wait_us
        self.batched = job.batch_jobs > 1
        self.position = pos + len(tokens)
        self.live.position = self.position
        self._stats.add_compute(0, job.compute_us, job.queue_us)
        return result

    # ------------------------------------------------------------------ cleanup
    async def _leave_lane(self) -> None:
        """Resume: drop the lane that carried the failed pipeline (closing it releases whatever is left
        downstream)."""
        client, self.lane = self.lane, None
        if client is not None:
            self.acked_steps = client.acked_steps  # counted over the generation, not the lane
            client.close()
            client.lane.dirty = True
            with trio.CancelScope(shield=True):
                await self.head.pool.checkin(client.lane)

    async def _cleanup(self) -> None:
        """Runs shielded. Stop the session down the lane (bounded), then free the head's own sequence (whatever
        the stop raised: a bug there must not leak a session slot)."""
        head = self.head
        client, self.lane = self.lane, None
        if client is not None:
            client.close()
        if self.session is not None:
            head.scheduler.forget(self.session.seq)  # now: the other sessions' batches wait for it no more
        try:
            if client is not None:
                stopped = False
                try:
                    with trio.move_on_after(STOP_TIMEOUT_S) as bounded:
                        stopped = await client.stop()
                    if bounded.cancelled_caught:
                        log.warning("head: stop for session %d not acknowledged within %g s: closing lane %d",
                                    self.live.session_id, STOP_TIMEOUT_S, client.lane.lane_id)
                finally:
                    if not stopped:
                        # closing the lane makes stage 1 (and every stage after it) release the session
                        client.lane.dirty = True
                    await head.pool.checkin(client.lane)
        finally:
            if self.sampler is not None:
                self.sampler.close()
            if self.session is not None:
                try:
                    with trio.move_on_after(STOP_TIMEOUT_S):
                        await self._record(clear=True)  # the prompt and the reply: the next turn begins so
                finally:
                    head.sessions.forget(self.session)
