"""The per-stage scheduler: the one task that owns the stage's llama context.

Sessions submit work (a prefill chunk or a decode step for their sequence)
and wait for the result. The scheduler gathers whatever is ready into one
``llama_decode``: every pending decode step of every session (batched decode),
plus prefill chunks while there is room in the batch, so that a long prompt
is interleaved with running generations instead of stalling them. Compute
runs in a worker thread (cffi releases the GIL), so the event loop keeps
serving the network meanwhile.

KV operations (trim, release) are queued too and run between two computes,
since llama.cpp allows one thread at a time per context.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

import attrs
import numpy as np
import trio

from skippyd.runtime.llama import Context, LlamaError, Sampler
from skippyd.telemetry import span

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class Job:
    """One session's input for one decode. Result: hidden rows, or a sampled token."""

    seq: int
    pos_start: int
    tokens: np.ndarray | None  # first stage
    embd: np.ndarray | None  # later stages
    sampler: Sampler | None = None  # final stage: None = greedy
    want_token: bool = False  # final stage: sample after this job (the last prefill chunk or a decode step)
    n: int = 0
    result: object = None
    error: BaseException | None = None
    done: trio.Event = attrs.field(factory=trio.Event)
    abandoned: bool = False
    submitted: float = 0.0
    queue_us: int = 0  # waiting for the scheduler
    compute_us: int = 0  # the llama_decode this job was part of

    def __attrs_post_init__(self) -> None:
        self.n = len(self.tokens) if self.tokens is not None else len(self.embd)


@attrs.define
class SchedulerStats:
    """Counters for inspection and tests (batched decode shows as max_batch_seqs > 1)."""

    batches: int = 0
    jobs: int = 0
    tokens: int = 0
    max_batch_seqs: int = 0
    multi_seq_batches: int = 0
    compute_s: float = 0.0
    lock_wait_s: float = 0.0


class Scheduler:
    def __init__(self, ctx: Context, *, max_batch_tokens: int | None = None):
        self.ctx = ctx
        self.max_batch_tokens = max_batch_tokens or ctx.n_batch
        self._jobs: deque[Job] = deque()
        self._kv_ops: deque[tuple[Callable[[], None], trio.Event]] = deque()
        self._wakeup = trio.Event()
        self._closed = False
        self.stats = SchedulerStats()

    # ---------------------------------------------------------------- clients
    async def submit(self, job: Job) -> object:
        """Queue `job` and wait for its result. Cancelling the caller abandons the job."""
        if self._closed:
            raise trio.ClosedResourceError("scheduler stopped")
        job.submitted = time.perf_counter()
        self._jobs.append(job)
        self._wakeup.set()
        try:
            await job.done.wait()
        except BaseException:
            job.abandoned = True
            try:
                self._jobs.remove(job)
            except ValueError:
                pass  # already in the worker thread: its result is dropped
            raise
        if job.error is not None:
            raise job.error
        return job.result

    async def run_kv(self, op: Callable[[], None]) -> None:
        """Run a KV operation between two computes (never concurrently with one)."""
        if self._closed:  # no compute can be running any more
            op()
            return
        done = trio.Event()
        self._kv_ops.append((op, done))
        self._wakeup.set()
        await done.wait()

    @property
    def queued(self) -> int:
        return len(self._jobs)

    # ---------------------------------------------------------------- the task
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup = trio.Event()
                while self._kv_ops or self._jobs:
                    self._run_kv_ops()
                    batch = self._take_batch()
                    if batch:
                        await self._compute(batch)
        finally:
            self._closed = True
            self._run_kv_ops()
            for job in self._jobs:
                job.error = trio.ClosedResourceError("scheduler stopped")
                job.done.set()
            self._jobs.clear()

    def _run_kv_ops(self) -> None:
        while self._kv_ops:
            op, done = self._kv_ops.popleft()
            try:
                op()
            except LlamaError as exc:
                log.warning("KV operation failed: %s", exc)
            done.set()

    def _take_batch(self) -> list[Job]:
        """Decode steps first (all of them), then prefill chunks while they fit; one job per sequence."""
        budget = self.max_batch_tokens
        batch: list[Job] = []
        seqs: set[int] = set()
        for job in sorted(self._jobs, key=lambda j: j.n):
            if job.seq in seqs or job.n > budget:
                continue
            if batch and job.n > 1 and batch[0].n > 1:
                continue  # at most one prefill chunk per batch keeps decode latency low
            batch.append(job)
            seqs.add(job.seq)
            budget -= job.n
        for job in batch:
            self._jobs.remove(job)
        return batch

    async def _compute(self, batch: list[Job]) -> None:
        started = time.perf_counter()
        try:
            with span("scheduler.decode", seqs=len(batch), tokens=sum(j.n for j in batch),
                      wait_us=max(int((started - j.submitted) * 1e6) for j in batch)):
                results = await trio.to_thread.run_sync(self._compute_sync, batch)
        except BaseException as exc:  # noqa: BLE001 - every waiter must be woken
            for job in batch:
                job.error = exc if isinstance(exc, Exception) else trio.ClosedResourceError("scheduler stopped")
                job.done.set()
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            self.stats.compute_s += time.perf_counter() - started
        compute_us = int((time.perf_counter() - started) * 1e6)
        for job, result in zip(batch, results):
            job.result = result
            job.queue_us = int((started - job.submitted) * 1e6)
            job.compute_us = compute_us
            job.done.set()

    def _compute_sync(self, batch: list[Job]) -> list[object]:
        """Worker thread: one llama_decode for the whole batch, then split the outputs."""
        ctx = self.ctx
        pos = np.concatenate([np.arange(j.pos_start, j.pos_start + j.n, dtype=np.int32) for j in batch])
        seq = np.concatenate([np.full(j.n, j.seq, dtype=np.int32) for j in batch])
        if ctx.token_input:
            tokens = batch[0].tokens if len(batch) == 1 else np.concatenate([j.tokens for j in batch])
            ctx.decode(pos, seq, tokens=tokens)
        else:
            embd = batch[0].embd if len(batch) == 1 else np.concatenate([j.embd for j in batch])
            ctx.decode(pos, seq, embd=embd)
        self.stats.batches += 1
        self.stats.jobs += len(batch)
        self.stats.tokens += len(pos)
        self.stats.max_batch_seqs = max(self.stats.max_batch_seqs, len(batch))
        if len(batch) > 1:
            self.stats.multi_seq_batches += 1
        if ctx.hidden_output:
            hidden = ctx.hidden()
            out, row = [], 0
            for j in batch:
                out.append(hidden[row:row + j.n])
                row += j.n
            return out
        wanted = {j.seq: j.sampler for j in batch if j.want_token}
        tokens = ctx.sample(wanted) if wanted else {}
        return [tokens.get(j.seq) for j in batch]
