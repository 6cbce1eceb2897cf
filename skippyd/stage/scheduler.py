"""The per-stage scheduler: the one task that owns the stage's llama context.

Sessions submit work (a prefill chunk or a decode step for their sequence)
and wait for the result. The scheduler gathers whatever is ready into one
``llama_decode``: every pending decode step of every session (batched decode),
plus prefill chunks while there is room in the batch, so that a long prompt
is interleaved with running generations instead of stalling them. Prefill
and slow batches compute in a worker thread (cffi releases the GIL), so the
event loop keeps serving the network meanwhile; a few decode steps of a
small model compute on the loop's thread (``_inline``), and a lone
session's step right in the task that submits it (``_direct``).

KV operations (trim, release) are queued too and run between two computes,
since llama.cpp allows one thread at a time per context.

Stages on hosts of their own compute at the same time: then the sessions
decoding at once are kept in groups, one in flight on each stage
(``Scheduler.decode_groups``).

Stages that share a host may take turns at the cores (``HostComputeLock``):
ggml's workers spin at every barrier inside a graph, so two stages computing
at once with all cores each would take each other's time slices; taking turns,
each graph runs with every core and nothing spins against a descheduled peer.
Other programs on the cores cannot take turns: while they slow the stage's
threads down, it computes with fewer (``ThreadChooser``, threads.py).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from typing import Callable

import attrs
import numpy as np
import trio

from skippyd.runtime.llama import Context, LlamaError, Sampler
from skippyd.stage.conditioning import next_release
from skippyd.stage.host_lock import HostComputeLock
from skippyd.stage.threads import ThreadChooser, usable_cores
from skippyd.telemetry import span
from skippyd.wire.stream import PreparedFrame

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
    done: trio.Event | None = None  # set by submit when the job is queued (a job computed at once needs none)
    abandoned: bool = False
    submitted: float = 0.0
    queue_us: int = 0  # waiting for the scheduler
    compute_us: int = 0  # the llama_decode this job was part of, with the worker-thread round trip
    native_us: int = 0  # inside llama.cpp only (decode and sampling)
    lock_wait_us: int = 0  # waiting for the host compute lock
    loop_native_cpu_us: int = 0  # CPU time the event loop's thread spent in llama.cpp (inline computes)
    batch_jobs: int = 0  # jobs in the llama_decode this job was part of
    # the frame of its answer (a hidden state's, or a prediction's), written natively the moment a lone decode
    # step's compute ends (then its done_ns is set; a hidden state's result is a view of the frame's activation);
    # other computes leave it
    out: PreparedFrame | None = None

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
    decode_batches: int = 0  # batches of decode steps only (no prefill chunk): how well sessions decode together
    decode_jobs: int = 0  # ... and the steps they held
    compute_s: float = 0.0
    lock_wait_s: float = 0.0  # waiting for the host compute lock (other stages computing)
    inline_batches: int = 0  # computed on the event loop's thread (small decode batches)
    lock_timeouts: int = 0  # waits for the host lock that gave up (its holder stopped or stuck)
    gathers: int = 0  # decode batches that waited for the last batch's other sessions
    sent_at_compute_end: int = 0  # decode steps whose frame native code wrote as the compute ended


# Decode batches up to this many sessions compute on the event loop's thread, while the last such
# batch's compute took less than INLINE_MAX_US. The worker-thread round trip costs a lone session ~1 ms
# of wall time per step on 2 cores busy with the compute (the loop's thread waits for a core to wake on),
# 3% of a 463 MB model's 40 ms step; a tenth of the liveness ping's 1 s timeout keeps pings answered
# in time (a very big model's decode step still stays off the loop).
INLINE_MAX_SEQS = 8
INLINE_MAX_US = 100_000
GATHER_MAX_S = 0.002  # a decode batch waits at most this long for the last batch's other sessions ...
GATHER_SHARE = 0.2  # ... and at most this share of that batch's compute
GATHER_MAX_LOCKED_S = 0.02  # the head with the host lock: this long (see _gather) ...
GATHER_LOCKED_COMPUTES = 3  # ... or this many times its last decode's compute, if longer
GATHER_GROUP_S = 0.0005  # a later stage with decode groups: the head sends a group's steps back to back
@attrs.define
class HotPath:
    """Python's share of each decode step on this stage.

    Whoever handles a step reports its wall time here (from having the message
    to having sent the answer), less the waits on other stages; what remains
    after native compute (llama_decode and sampling) is Python: framing,
    dispatch, the worker-thread round trip, bookkeeping. On a busy host the
    wall time also holds the time the process waited for a core, so the
    event loop thread's CPU time outside llama.cpp is kept too (``cpu_s``):
    Python's own cost, whatever the load.

    Those windows leave out what a step costs before its handler runs (the
    wait in trio's event loop, reading and decoding the frame) on a stage
    after the head, whose window starts with the message in hand. For a
    figure comparable between stages, ``describe`` also gives the event loop
    thread's whole CPU time so far (``loop_cpu_s``, read on that thread) and
    its CPU time in llama.cpp (``loop_native_cpu_s``, computes run inline):
    between two reads, their difference over the decode steps is all the
    Python, trio and kernel time of the process's event loop per step. The
    head's window runs from one token to the next, so it holds its waits for
    the other stages' replies, and the CPU time those cost (the wake-up, trio's
    loop, reading and decoding the reply) is kept too (``wait_cpu_s``): less
    it, the head's handling is measured as a later stage's is.
    """

    steps: int = 0
    wall_s: float = 0.0
    native_s: float = 0.0
    cpu_s: float = 0.0
    loop_native_cpu_s: float = 0.0
    wait_cpu_s: float = 0.0

    def note(self, wall_s: float, native_us: int, cpu_s: float = 0.0, wait_cpu_s: float = 0.0) -> None:
        """One step: its wall time less waits (on other stages, for the host lock), its native time, the
        event loop thread's CPU time outside llama.cpp, and the share of that spent in the waits."""
        self.steps += 1
        self.wall_s += wall_s
        self.native_s += native_us / 1e6
        self.cpu_s += cpu_s
        self.wait_cpu_s += wait_cpu_s

    def describe(self) -> dict:
        """The counters; call it on the event loop thread (``loop_cpu_s`` is the calling thread's CPU time)."""
        n = max(1, self.steps)
        return {"decode_steps": self.steps, "wall_s": self.wall_s, "native_s": self.native_s, "cpu_s": self.cpu_s,
                "loop_cpu_s": time.thread_time(), "loop_native_cpu_s": self.loop_native_cpu_s,
                "wait_cpu_s": self.wait_cpu_s,
                "python_ms_per_step": (self.wall_s - self.native_s) * 1e3 / n,
                "python_cpu_ms_per_step": self.cpu_s * 1e3 / n,
                "handling_cpu_ms_per_step": (self.cpu_s - self.wait_cpu_s) * 1e3 / n,
                "native_ms_per_step": self.native_s * 1e3 / n}


class Scheduler:
    """See the module docstring.

    ``decode_groups`` > 1: the stages of the pipeline compute at the same
    time (hosts of their own), so the sessions decoding at once are kept in
    that many groups, each in flight on a different stage: the head computes
    one group's steps while the next stage computes another's. The head
    (``token_input``) caps a decode batch at ceil(decoding sessions /
    decode_groups), waits for the sessions back from the pipeline (not for
    those whose step is down it, see ``back``), and merges groups while
    more than decode_groups are in flight (sessions that started apart).
    Later stages wait at most GATHER_GROUP_S for a group's steps, which the
    head sends back to back. With 1 (stages sharing cores, or a single
    stage) all the sessions decode as one batch, which costs less than
    several when the stages take turns at the cores.
    """

    def __init__(self, ctx: Context, *, max_batch_tokens: int | None = None,
                 host_lock: HostComputeLock | None = None, decode_groups: int = 1, adapt_threads: bool = True):
        self.ctx = ctx
        self.host_lock = host_lock  # owned: closed when serve() ends
        self.max_batch_tokens = max_batch_tokens or ctx.n_batch
        self._jobs: deque[Job] = deque()
        self._kv_ops: deque[tuple[Callable[[], None], trio.Event]] = deque()
        self._wakeup = trio.Event()
        self._closed = False
        self.stats = SchedulerStats()
        self.hot_path = HotPath()
        self._native_us = self._lock_wait_us = 0  # the last compute's (set by the worker thread)
        self._native_cpu_us = 0  # ... CPU time of the computing thread in llama.cpp
        self._decode_native_us = 0  # the last decode-only batch's
        self._expected: set[int] = set()  # sequences of the last two batches' decode steps (see _gather)
        self._previous: set[int] = set()
        self.decode_groups = max(1, decode_groups)  # see the class docstring
        self._decoding: set[int] = set()  # decode_groups > 1, the head: sequences decoding, not ended (forget)
        self._away: set[int] = set()  # ... the head: those whose step is down the pipeline (see back())
        self._batch_no: dict[int, int] = {}  # ... the head: each one's last decode batch (a group), numbered
        self._batches_done = 0
        self._arrived: trio.Event | None = None  # set by submit() while _gather waits
        self._busy = False  # the serve task is between its wake-up and its next wait
        # decode (and prefill) with the configured threads, or fewer while that is much faster (threads.py)
        cores = usable_cores()
        self.threads = ThreadChooser(ctx.params.n_threads, enabled=adapt_threads, cores=cores,
                                     shared_cpu=host_lock.compute_cpu_s if host_lock is not None else None,
                                     shared_busy=host_lock.held if host_lock is not None else None,
                                     whole_host=cores == os.cpu_count())
        self._threads_now = ctx.params.n_threads

    # ---------------------------------------------------------------- clients
    async def submit(self, job: Job) -> object:
        """Queue `job` and wait for its result. Cancelling the caller abandons the job.

        Not always a schedule point: a lone session's decode step computes
        right here and returns (see ``_direct``). A caller whose loop has no
        other wait must checkpoint itself; a pipeline stage's loop waits on
        the network every step anyway, and a pass of trio's scheduler right
        after a compute costs a decode step ~20 us (cold caches).
        """
        if self._closed:
            raise trio.ClosedResourceError("scheduler stopped")
        job.submitted = time.perf_counter()
        if self._direct(job):
            if job.error is not None:
                raise job.error
            return job.result
        job.done = trio.Event()
        self._jobs.append(job)
        self._wakeup.set()
        if self._arrived is not None:
            self._arrived.set()
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

    def _direct(self, job: Job) -> bool:
        """One session decoding alone, the scheduler idle: compute `job` right here (inline), without the
        hand-off to the scheduler's task and back (two task switches per step). True if it did."""
        if (self._busy or self._closed or self._jobs or self._kv_ops or job.n != 1
                or not self._gathered({job.seq}) or not self._inline([job])):
            return False
        self._compute_row(job)  # awaits nothing: no other job can slip in
        return True

    def _compute_row(self, job: Job) -> None:
        """Compute one decode step on this thread (``_inline`` took the host lock, if any): what
        _compute_inline, _compute_sync and _finish do for a batch, without their loops over it (a session
        decoding alone comes here for every token, on every stage)."""
        ctx, stats, out = self.ctx, self.stats, job.out
        started = time.perf_counter()
        stats.inline_batches += 1
        released = False
        try:
            with span("scheduler.decode", seqs=1, tokens=1):
                try:
                    threads = self._use_threads()
                    native, native_cpu = time.perf_counter(), time.thread_time()
                    if out is not None and (ctx.hidden_output or job.want_token):
                        # the frame leaves (and the host lock is released) as the compute ends, before the Python
                        # below: the next stage's wake-up and compute no longer wait for it
                        lock_fd = self.host_lock.fd if self.host_lock is not None else -1
                        inputs = {"token": int(job.tokens[0])} if ctx.token_input else {"embd": job.embd}
                        released = True  # by the call below, whatever its result
                        if ctx.hidden_output:
                            out.sent, out.done_ns = ctx.decode_row_send(job.pos_start, job.seq, out.frame,
                                                                        out.head_len, lock_fd=lock_fd, fd=out.fd,
                                                                        **inputs)
                            result = np.frombuffer(out.frame, np.float32, offset=out.head_len).reshape(1, -1)
                        else:
                            result, out.sent, out.done_ns = ctx.decode_row_sample_send(
                                job.pos_start, job.seq, job.sampler, out.frame, out.us_at, lock_fd=lock_fd,
                                fd=out.fd, **inputs)
                        # to the compute's end, without the write after it (perf_counter is CLOCK_MONOTONIC)
                        native_us = max(0, int((out.done_ns / 1e9 - native) * 1e6))
                        stats.sent_at_compute_end += 1
                    else:
                        if ctx.token_input:
                            ctx.decode_row(job.pos_start, job.seq, token=int(job.tokens[0]))
                        else:
                            ctx.decode_row(job.pos_start, job.seq, embd=job.embd)
                        if ctx.hidden_output:
                            native_us = int((time.perf_counter() - native) * 1e6)
                            result = ctx.hidden()
                        else:
                            result = ctx.sample_row(job.seq, job.sampler) if job.want_token else None
                            native_us = int((time.perf_counter() - native) * 1e6)
                    native_cpu_us = int((time.thread_time() - native_cpu) * 1e6)
                finally:
                    if self.host_lock is not None and not released:
                        self.host_lock.release()
        except Exception as exc:  # noqa: BLE001 - as _compute_inline
            self._fail([job], exc, started)
            return
        self._native_us, self._native_cpu_us, self._lock_wait_us = native_us, native_cpu_us, 0
        self.threads.observe(threads, 1, native_us / 1e6)
        self._count_batch(1, 1)
        now = time.perf_counter()
        self.hot_path.loop_native_cpu_s += native_cpu_us / 1e6
        stats.compute_s += now - started
        self._decode_native_us = native_us
        self._decoded({job.seq})
        job.result = result
        job.native_us, job.lock_wait_us, job.loop_native_cpu_us = native_us, 0, native_cpu_us
        job.queue_us = int((started - job.submitted) * 1e6)
        job.compute_us = int((now - started) * 1e6)
        job.batch_jobs = 1

    def forget(self, seq: int) -> None:
        """`seq` ended: a gather waits for it no more."""
        self._expected.discard(seq)
        self._previous.discard(seq)
        self._decoding.discard(seq)
        self._away.discard(seq)
        self._batch_no.pop(seq, None)
        if self._arrived is not None:
            self._arrived.set()

    def back(self, seq: int) -> None:
        """The head: `seq`'s prediction came back from the pipeline; its next step follows at once."""
        self._away.discard(seq)

    @property
    def queued(self) -> int:
        return len(self._jobs)

    # ---------------------------------------------------------------- the task
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                await self._wait_for_work()
                self._wakeup = trio.Event()
                self._busy = True
                while self._kv_ops or self._jobs:
                    self._run_kv_ops()
                    await self._gather()
                    batch = self._take_batch()
                    if batch:
                        await self._compute(batch)
                self._busy = False
        finally:
            self._closed = True
            if self.host_lock is not None:
                self.host_lock.close()
            self._run_kv_ops()
            for job in self._jobs:
                job.error = trio.ClosedResourceError("scheduler stopped")
                job.done.set()
            self._jobs.clear()

    async def _wait_for_work(self) -> None:
        """Until a job or a KV operation arrives. The chooser looks at the host's cores every tick_s meanwhile
        (for a load, or its end: ThreadChooser.tick); only then does the wait take a cancel scope (10-20 us per
        wake-up here: a session decoding alone computes inline and never wakes this task)."""
        while True:
            tick_s = self.threads.tick_s()
            if tick_s == math.inf:
                await self._wakeup.wait()
                return
            with trio.move_on_after(tick_s):
                await self._wakeup.wait()
                return
            self.threads.tick()

    async def _gather(self) -> None:
        """Before a decode batch: give the sessions of the last two decode batches a moment to send their
        next step (with decode_groups > 1 at the head: see ``_gathered``).

        Sessions decoding together come back at slightly different times (each
        has its own bookkeeping, frames arrive one after the other); starting
        the batch with the first one back would split them into a batch of one
        and a batch of the rest, every step (and a group split once stays split
        unless the last two batches are gathered again). The wait is at most
        GATHER_MAX_S and a GATHER_SHARE of the last decode's compute (see below
        for the head with the host lock), and ends as soon as every expected
        session is back or has ended (``forget``).
        """
        queued = {j.seq for j in self._jobs if j.n == 1}
        if not queued or self._gathered(queued):
            return
        if self.decode_groups > 1 and not self.ctx.token_input:
            # the head keeps groups apart and sends each group's steps back to back: wait for those only
            window = min(GATHER_GROUP_S, GATHER_SHARE * self._decode_native_us / 1e6)
        elif self.decode_groups > 1:
            window = self._locked_window()  # the head merging groups: the next one is a stage's compute away
        elif self.host_lock is not None and self.ctx.token_input:
            # the head, taking turns at the cores (the host lock): a group that is not here is on another stage,
            # using the cores, so waiting for it costs no compute, and one batch of both groups costs much less
            # than two (here a batch of 8 ~1.2 of 4). Only the head waits this long: groups form here, and a
            # later stage waiting for a group the head holds would hold the head's group in turn.
            window = self._locked_window()
        else:
            window = min(GATHER_MAX_S, GATHER_SHARE * self._decode_native_us / 1e6)
        self._arrived = trio.Event()
        with trio.move_on_after(window):
            while not self._gathered(queued):
                await self._arrived.wait()
                self._arrived = trio.Event()
                queued = {j.seq for j in self._jobs if j.n == 1}
        self._arrived = None
        self._expected &= queued  # one that did not come back is not waited for again
        self._previous &= queued
        self.stats.gathers += 1

    def _locked_window(self) -> float:
        """How long the head waits for a group on another stage: that stage's compute of it, which is about the
        head's own (a bigger model, or a busy host, takes longer than GATHER_MAX_LOCKED_S: a fixed 20 ms split
        8 sessions into two groups for good when two busy programs slowed every step beyond it)."""
        return max(GATHER_MAX_LOCKED_S, GATHER_LOCKED_COMPUTES * self._decode_native_us / 1e6)

    def _gathered(self, queued: set[int]) -> bool:
        """Whether a decode batch may start with the sessions `queued`: every session of the last two decode
        batches is here (a group split by chance gets together again), or, at the head with decode_groups
        > 1, a group's worth is here or every session not down the pipeline is."""
        if self.decode_groups > 1 and self.ctx.token_input:
            if len(queued) >= self._group_size(queued):
                return True
            if not (self._decoding - self._away) <= queued:
                return False  # back from the pipeline, about to send its step
            # more groups in flight than stages (sessions that started apart): wait for the next one to merge
            in_flight = {self._batch_no[seq] for seq in self._away if seq in self._batch_no}
            return len(in_flight) < self.decode_groups
        return self._expected <= queued

    def _group_size(self, queued: set[int]) -> int:
        return -(-len(self._decoding | queued) // self.decode_groups)

    def _run_kv_ops(self) -> None:
        while self._kv_ops:
            op, done = self._kv_ops.popleft()
            try:
                op()
            except LlamaError as exc:
                log.warning("KV operation failed: %s", exc)
            done.set()

    def _take_batch(self) -> list[Job]:
        """Decode steps first (all of them; at the head with decode groups, a group's worth), then prefill
        chunks while they fit; one job per sequence."""
        budget = self.max_batch_tokens
        batch: list[Job] = []
        seqs: set[int] = set()
        steps_left = len(self._jobs)
        if self.decode_groups > 1 and self.ctx.token_input:  # the head: this group; the rest go next
            steps_left = self._group_size({j.seq for j in self._jobs if j.n == 1})
        for job in sorted(self._jobs, key=lambda j: j.n):
            if job.seq in seqs or job.n > budget:
                continue
            if job.n == 1:
                if steps_left == 0:
                    continue
                steps_left -= 1
            if batch and job.n > 1 and batch[0].n > 1:
                continue  # at most one prefill chunk per batch keeps decode latency low
            batch.append(job)
            seqs.add(job.seq)
            budget -= job.n
        for job in batch:
            self._jobs.remove(job)
        batch.sort(key=lambda j: j.seq)  # rows in sequence order: llama.cpp decodes that faster (see sessions.py)
        return batch

    def _inline(self, batch: list[Job]) -> bool:
        """Whether to compute `batch` on the event loop's thread (then holding the host lock, if any).

        A worker-thread round trip costs from 0.1 ms (an idle core to wake on)
        to over 1 ms (both cores computing), up to three times what a decode
        step may spend outside llama.cpp, so a batch of a few decode steps
        (up to INLINE_MAX_US of compute) runs inline; the loop is blocked only
        that long. Prefill chunks, decode steps measured slower than INLINE_MAX_US,
        any batch that would have to wait for the host lock, and (link
        conditioning) any during which a conditioned link's chunk falls due go to
        the worker thread so that the loop keeps serving the network.
        """
        if len(batch) > INLINE_MAX_SEQS or any(j.n != 1 for j in batch):
            return False
        if not 0 < self._decode_native_us < INLINE_MAX_US:  # unmeasured yet, or too slow
            return False
        if (due := next_release()) != math.inf and due < trio.current_time() + self._decode_native_us / 1e6:
            return False
        return self.host_lock is None or self.host_lock.try_acquire()

    async def _compute(self, batch: list[Job]) -> None:
        started = time.perf_counter()
        if self._inline(batch):
            self._compute_inline(batch, started)
            await trio.lowlevel.checkpoint()  # let the network in between two inline computes
            return
        try:
            with span("scheduler.decode", seqs=len(batch), tokens=sum(j.n for j in batch)):
                results = await trio.to_thread.run_sync(self._compute_sync, batch)
        except BaseException as exc:  # noqa: BLE001 - every waiter must be woken
            self._fail(batch, exc, started)
            if not isinstance(exc, Exception):
                raise
            return
        self._finish(batch, results, started, inline=False)

    def _compute_inline(self, batch: list[Job], started: float) -> None:
        """Compute `batch` on this thread (``_inline`` took the host lock, if any) and wake its jobs."""
        self.stats.inline_batches += 1
        try:
            with span("scheduler.decode", seqs=len(batch), tokens=len(batch)):
                try:
                    results = self._compute_sync(batch, locked=True)
                finally:
                    if self.host_lock is not None:
                        self.host_lock.release()
        except Exception as exc:  # noqa: BLE001 - every waiter must be woken
            self._fail(batch, exc, started)
            return
        self._finish(batch, results, started, inline=True)

    def _fail(self, batch: list[Job], exc: BaseException, started: float) -> None:
        self.stats.compute_s += time.perf_counter() - started
        for job in batch:
            job.error = exc if isinstance(exc, Exception) else trio.ClosedResourceError("scheduler stopped")
            if job.done is not None:
                job.done.set()

    def _finish(self, batch: list[Job], results: list[object], started: float, *, inline: bool) -> None:
        now = time.perf_counter()
        if inline:
            self.hot_path.loop_native_cpu_s += self._native_cpu_us / 1e6
        self.stats.compute_s += now - started
        compute_us = int((now - started) * 1e6)
        decoded = {j.seq for j in batch if j.n == 1}
        if len(decoded) == len(batch):  # decode steps only (one job per sequence): its time decides _inline
            self._decode_native_us = self._native_us
        if decoded:
            self._decoded(decoded)
        for job, result in zip(batch, results):
            job.result = result
            job.native_us, job.lock_wait_us = self._native_us, self._lock_wait_us
            job.loop_native_cpu_us = self._native_cpu_us if inline else 0
            job.queue_us = int((started - job.submitted) * 1e6)
            job.compute_us = compute_us
            job.batch_jobs = len(batch)
            if job.done is not None:
                job.done.set()

    def _decoded(self, decoded: set[int]) -> None:
        """The sequences of a decode batch just computed: the sessions of the last two decode batches (a
        split group is gathered again), and at the head with decode groups, which group each one is in."""
        self._expected, self._previous = decoded | self._previous, decoded
        if self.decode_groups > 1 and self.ctx.token_input:
            self._decoding |= decoded
            self._away |= decoded  # their steps go down the pipeline now
            self._batches_done += 1
            for seq in decoded:
                self._batch_no[seq] = self._batches_done

    def _count_batch(self, n_jobs: int, n_tokens: int) -> None:
        stats = self.stats
        stats.batches += 1
        stats.jobs += n_jobs
        stats.tokens += n_tokens
        stats.max_batch_seqs = max(stats.max_batch_seqs, n_jobs)
        if n_jobs > 1:
            stats.multi_seq_batches += 1
        if n_tokens == n_jobs:
            stats.decode_batches += 1
            stats.decode_jobs += n_jobs

    def _use_threads(self) -> int:
        """Set the context's thread count to the chooser's pick (for decode and prefill alike: other programs
        on the cores slow a prefill's threads as much); the count."""
        threads = self.threads.pick()
        if threads != self._threads_now:
            params = self.ctx.params
            # the configured batch count while on the configured count, else the reduced one for prefill too
            batch_threads = (params.n_threads_batch or params.n_threads) if threads == params.n_threads else threads
            self.ctx.set_threads(threads, batch_threads)
            self._threads_now = threads
        return threads

    def _compute_sync(self, batch: list[Job], locked: bool = False) -> list[object]:
        """Worker thread: one llama_decode for the whole batch, then split the outputs (one per job)."""
        ctx = self.ctx
        row = batch[0] if len(batch) == 1 and batch[0].n == 1 else None  # a lone decode step: decode_row
        n_tokens = 1
        if row is None:
            pos = np.concatenate([np.arange(j.pos_start, j.pos_start + j.n, dtype=np.int32) for j in batch])
            seq = np.concatenate([np.full(j.n, j.seq, dtype=np.int32) for j in batch])
            n_tokens = len(pos)
            if ctx.token_input:
                inputs = {"tokens": batch[0].tokens if len(batch) == 1 else np.concatenate([j.tokens for j in batch])}
            else:
                inputs = {"embd": batch[0].embd if len(batch) == 1 else np.concatenate([j.embd for j in batch])}
        elif ctx.token_input:
            inputs = {"token": int(row.tokens[0])}
        else:
            inputs = {"embd": row.embd}
        waiting = time.perf_counter()
        take_lock = not locked and self.host_lock is not None
        holding = take_lock and self.host_lock.acquire()
        if take_lock and not holding:
            self.stats.lock_timeouts = self.host_lock.timeouts
        # computed under the lock: its CPU time goes to the host's tally (see ThreadChooser.tick). Not a lone
        # decode step's (_compute_row): a prefill chunk or a batch holds the cores for long, a step for a few ms
        tally = self.host_lock is not None and (locked or holding)
        try:
            threads = self._use_threads()
            native = time.perf_counter()
            native_cpu = time.thread_time()
            process_cpu = time.process_time() if tally else 0.0
            if row is None:
                ctx.decode(pos, seq, **inputs)
            else:
                ctx.decode_row(row.pos_start, row.seq, **inputs)
            if tally:
                self.host_lock.add_compute_cpu(time.process_time() - process_cpu)
        finally:
            if holding:
                self.host_lock.release()
        self._lock_wait_us = int((native - waiting) * 1e6)  # the other stages' turns
        self.stats.lock_wait_s += native - waiting
        native = time.perf_counter() - native
        native_cpu = time.thread_time() - native_cpu
        if n_tokens == len(batch):  # decode steps only: what the thread count is judged by
            self.threads.observe(threads, n_tokens, native)
        self._count_batch(len(batch), n_tokens)
        if ctx.hidden_output:
            hidden = ctx.hidden()
            out, row = [], 0
            for j in batch:
                out.append(hidden[row:row + j.n])
                row += j.n
            self._native_us, self._native_cpu_us = int(native * 1e6), int(native_cpu * 1e6)
            return out
        wanted = {j.seq: j.sampler for j in batch if j.want_token}
        started, started_cpu = time.perf_counter(), time.thread_time()
        tokens = ctx.sample(wanted) if wanted else {}
        self._native_us = int((native + time.perf_counter() - started) * 1e6)
        self._native_cpu_us = int((native_cpu + time.thread_time() - started_cpu) * 1e6)
        return [tokens.get(j.seq) for j in batch]
