"""The head's own share of a generation: its KV sequence in stage 0's context, and the slice it computes.

Every compute of the generation on the head goes through
:meth:`HeadSequence.compute` (a decode step or a verify window) or
:meth:`HeadSequence.compute_part` (a part of the prompt: text tokens, or an
image's rows as input embeddings at their own positions), through the head's
scheduler, so that concurrent generations batch their decode steps; the lanes
decide what it computes (hidden states to send on, or, on a single stage, the
sampled token). The sequence also encodes the prompt's images (the projector,
off the event loop), restores the longest cached prefix of the prompt,
records what it holds in the head's prefix cache and, once the generation
ends, gives its slot back.

``position`` is the positions the sequence holds, where its next compute
starts: after the prompt, its position count (:attr:`Prompt.n_pos`), which
an image makes differ from its token count.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import attrs
import numpy as np
import trio

from skippyd.head.errors import GenerationError
from skippyd.head.live import LiveGeneration
from skippyd.head.prompt import ImagePiece, Prompt, PromptPart
from skippyd.head.step_clock import StepClock
from skippyd.runtime import llama, mtmd
from skippyd.stage.execution import Job
from skippyd.stage.prefix_cache import PrefixCache, record_from, restore_into
from skippyd.stage.scheduler import Scheduler
from skippyd.stage.sessions import SessionTable
from skippyd.telemetry import span
from skippyd.wire.messages import MAX_TOKENS, StatsTotal
from skippyd.wire.stream import PreparedFrame

STOP_TIMEOUT_S = 2.0  # a generation's cleanup: the Stop down its lane, and the release of its sequence, each


@attrs.frozen
class HeadCompute:
    """What the head's sequences share: stage 0's context, its scheduler, its sequence table and prefix
    cache."""

    context: llama.Context
    scheduler: Scheduler
    sessions: SessionTable
    prefix_cache: PrefixCache
    boundary: bool = False  # a pipeline: record the hidden states sent on (skippyd/stage/boundary.py)


class HeadSequence:
    """One generation's sequence on the head (open from admission to cleanup) and its position in it."""

    def __init__(self, head: HeadCompute, live: LiveGeneration, prompt: Prompt, stats: StatsTotal,
                 clock: StepClock):
        self.head, self.live, self.prompt = head, live, prompt
        self.scheduler = head.scheduler
        self.stats = stats  # every stage's reports for the generation: the head's computes are added here
        self.clock = clock
        self.session = head.sessions.open(0, live.session_id, live.request_id)
        live.seq = self.seq = self.session.seq
        # the hidden states sent on for positions [0, rows.held) (a pipeline's head; None: not recorded)
        self.rows = self.session.rows if head.boundary else None
        self.position = 0  # positions the sequence holds
        self.batched = False  # the last compute was one llama_decode with other sessions' steps
        self.sharing = 1  # the sessions in that llama_decode, this one's included
        # the leading positions of the prompt the head held (restored) rather than computed: where its first
        # compute of the prompt began (None: not yet); and each later stage's, from its Stop's answer
        self.prompt_cached: int | None = None
        self.stages_cached: tuple[int, ...] = ()
        # the keys the later stages look their prefixes up by, for the prompt's first chunk to carry (a head
        # that holds none of the prompt: see restore); None: they were asked already, or are not to be
        self.restore_block: np.ndarray | None = None

    async def compute(self, tokens: np.ndarray, pos: int, *, want_token: bool, sampler=None,
                      out: PreparedFrame | None = None, window: bool = False):
        """Compute ``tokens`` from ``pos`` (the sequence then holds ``pos + len(tokens)`` positions): the hidden
        states, or (``want_token``, a single stage) the sampled token, or a window's tokens."""
        job = Job(self.seq, pos, tokens=tokens, embd=None, sampler=sampler, want_token=want_token, out=out,
                  window=window, window_tokens=tokens if window else None)
        return self._note_rows(pos, await self._run(job, pos + len(tokens)))

    async def compute_part(self, part: PromptPart, *, want_token: bool, sampler=None):
        """Compute a part of the prompt (the sequence then holds ``part.pos_end`` positions): its hidden states
        or (``want_token``, a single stage) the sampled token. Media rows go in as input embeddings at their
        own positions."""
        media = part.media
        held = self._held(part, want_token)
        rows = self.rows.view(part.pos_start, part.pos_start + held).copy() if held else None
        if held and held == len(part.tokens):  # held already (restored past where the prefill starts): the
            return rows                         # hidden states recorded for them
        if self.prompt_cached is None:
            self.prompt_cached = part.pos_start + held
        await self.keep(part.pos_start + held)  # what it holds past them is computed again (an image's rows)
        if held:
            rest = await self.compute(part.tokens[held:], part.pos_start + held, want_token=False)
            return np.concatenate([rows, rest])
        if media is None:
            return await self.compute(part.tokens, part.pos_start, want_token=want_token, sampler=sampler)
        job = Job(self.seq, part.pos_start, tokens=None, embd=part.rows, sampler=sampler, want_token=want_token,
                  positions=media.positions, causal=media.causal)
        return self._note_rows(part.pos_start, await self._run(job, media.pos_end))

    def _held(self, part: PromptPart, want_token: bool) -> int:
        """Leading positions of a text part the sequence holds with their recorded hidden states (an image's
        rows are never held past where the prefill starts: a restore ends at an image's edge)."""
        if self.rows is None or want_token or part.media is not None or part.pos_start >= self.position:
            return 0
        return max(0, min(self.position, self.rows.held, part.pos_start + len(part.tokens)) - part.pos_start)

    def _note_rows(self, pos: int, result):
        """Record a compute's hidden states (a pipeline's head), for the positions from ``pos``."""
        if self.rows is not None:
            if isinstance(result, np.ndarray) and result.ndim == 2 and len(result) == self.position - pos:
                self.rows.wrote(pos, result)
            else:
                self.rows.trim(pos)
        return result

    async def _run(self, job: Job, end: int):
        live = self.live
        try:
            with span("head.compute", request=live.request_id, session=live.session_id, pos=job.pos_start,
                      tokens=job.n):
                result = await self.scheduler.submit(job)
        except llama.LlamaError as exc:
            raise GenerationError(f"head compute failed: {exc}") from exc
        clock = self.clock
        clock.native_us += job.native_us
        clock.loop_native_cpu_us += job.loop_native_cpu_us
        clock.waited_us += job.lock_wait_us
        self.batched = job.batch_jobs > 1
        self.sharing = max(1, job.batch_jobs)
        live.position = self.position = end
        self.stats.add_compute(0, job.compute_us, job.queue_us)
        return result

    async def encode(self, piece: ImagePiece) -> None:
        """The image's rows from the projector, once (a replay keeps them), in a worker thread: the event loop
        and the other sessions' steps go on meanwhile. The host's compute turn (stages sharing its cores) is
        held while it encodes. A cancellation waits for the encode under way (the chunk's native memory is in
        use until it returns)."""
        if piece.rows is not None:
            return
        live = self.live
        started = time.perf_counter()
        try:
            with span("head.encode_image", request=live.request_id, session=live.session_id,
                      rows=piece.n_rows):
                piece.rows = await trio.to_thread.run_sync(self.scheduler.execution.in_turn, piece.chunk.encode)
        except mtmd.MtmdError as exc:
            raise GenerationError(f"the projector could not encode an image: {exc}") from exc
        self.prompt.encode_ms += (time.perf_counter() - started) * 1e3

    async def keep(self, n: int) -> None:
        """Hold only the first ``n`` positions (a verify window's token and its accepted drafts)."""
        if n < self.position:
            context, seq = self.head.context, self.seq
            await self.scheduler.run_kv(lambda: context.kv_trim(seq, n))
            self.live.position = self.position = n
            if self.rows is not None:
                self.rows.trim(n)

    async def clear(self) -> None:
        """Hold nothing (a replay computes the prompt again from position 0, as the first time)."""
        context, seq = self.head.context, self.seq
        await self.scheduler.run_kv(lambda: context.kv_clear_seq(seq))
        self.live.position = self.position = 0
        self.prompt_cached = None
        if self.rows is not None:
            self.rows.trim(0)

    # ------------------------------------------------------------------ the prefix cache
    async def restore(self, held_downstream: Callable[[np.ndarray], Awaitable[int]]) -> int:
        """Every stage restores the longest prefix of the prompt it has in its prefix cache: the head its own
        hit, each later stage its own (``held_downstream`` asks them and says how much all of them hold).
        Returns where the prefill starts: the least of those (0: the whole prompt is computed). A stage that
        holds more answers the positions it holds with the hidden states it recorded for them and computes
        only the rest (on a pipeline; see skippyd/stage/boundary.py); without them it trims itself when the
        prefill comes (positions are authoritative).

        A head that holds no prefix of the prompt worth restoring starts the prefill at 0 whatever the later
        stages hold: it does not ask them, and the prompt's first chunk carries the keys instead
        (``restore_block``), so that each of them restores what it holds as that chunk comes, with no trip of
        its own through the stages."""
        cache, prompt = self.head.prefix_cache, self.prompt
        self.restore_block = None
        keys = prompt.keys
        # the prompt's last position is always computed: its logits give the first generated token (and a
        # restore never ends inside an image: its rows are computed together); MAX_TOKENS: one RestorePrefix
        limit = prompt.resume_point(min(prompt.n_pos - 1, MAX_TOKENS))
        if not cache.enabled or limit < cache.min_hit:
            return 0
        hit = await cache.lookup_tiers(keys, limit)
        own = prompt.resume_point(hit.length) if hit is not None else 0
        if self.rows is None and own < cache.min_hit:  # a single stage, or no boundary: a miss here is all
            return 0
        if own < cache.min_hit:
            self.restore_block = keys[:limit]
            return 0
        start = prompt.resume_point(min(own, await held_downstream(keys[:limit])))
        if start < cache.min_hit:
            start = 0
        if self.rows is not None:  # held past the start: only where the hidden states sent on are recorded
            own = max(start, min(own, hit.entry.boundary_len if hit is not None else 0))
        else:
            own = start
        own = prompt.resume_point(own)
        if own < cache.min_hit or not await restore_into(self.scheduler, self.head.context, self.seq, hit, own):
            return 0
        cache.note_restored(own)
        self.live.position = self.position = own
        if self.rows is not None:
            self.rows.load(hit.entry.boundary, own)
        return start

    def take_restore_block(self, part: PromptPart) -> np.ndarray | None:
        """The restore block for ``part``, the prompt's first (once: None after): the keys of restore, if the
        part is text (a prompt that begins with an image is computed from 0 on every stage: its rows are never
        held past where a prefill starts)."""
        block, self.restore_block = self.restore_block, None
        return block if block is not None and part.pos_start == 0 and part.media is None else None

    async def record(self, generated: Sequence[int] = (), *, clear: bool = False) -> None:
        """Keep what the sequence holds (the prompt, then ``generated``) in the head's prefix cache, if the
        cache wants it; with ``clear``, then empty the sequence."""
        head, seq = self.head, self.seq
        if head.prefix_cache.enabled:
            await record_from(head.prefix_cache, self.scheduler, head.context, seq, self._held_keys(generated),
                              clear=clear, rows=self.rows)
        elif clear:
            await self.scheduler.run_kv(lambda: head.context.kv_clear_seq(seq))

    def _held_keys(self, generated: Sequence[int]) -> np.ndarray:
        """The keys of the positions the sequence holds (the prompt's, then the generated tokens)."""
        keys = self.prompt.keys
        if self.position <= len(keys):
            return keys[:self.position]
        return np.concatenate([keys, np.asarray(generated, dtype=np.int32)])[:self.position]

    # ------------------------------------------------------------------ the end
    def leave_batches(self) -> None:
        """The generation ends: the other sessions' batches wait for its steps no more."""
        self.scheduler.forget(self.seq)

    async def release(self, generated: Sequence[int]) -> None:
        """Keep the prompt and the reply in the prefix cache (the next turn begins so; bounded), then give the
        sequence's slot back, whatever the record did."""
        try:
            with trio.move_on_after(STOP_TIMEOUT_S):
                await self.record(generated, clear=True)
        finally:
            self.head.sessions.forget(self.session)
