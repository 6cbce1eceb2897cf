"""Running a batch on a stage's llama context, and the host compute lock around it.

A batch computes in one of three ways:

- a few decode steps of a small model on the event loop's thread (``inline_turn``): a worker-thread
  round trip costs from 0.1 ms (an idle core to wake on) to over 1 ms (both cores computing), up to three
  times what a decode step may spend outside llama.cpp;
- a lone decode step whose answer's frame is prepared (``Job.out``) through one fused native call, which
  writes the frame the moment the compute ends, before any Python;
- anything else (prefill chunks, slow steps, a batch that would wait for the host lock) in a worker
  thread, so that the loop keeps serving the network meanwhile (cffi releases the GIL).

Stages that share a host take turns at its cores (``HostComputeLock``): ggml's workers spin at every
barrier inside a graph, so two stages computing at once with all cores each would take each other's time
slices. This module alone takes and releases that lock; the fused native call is handed it and releases it
itself, as the compute ends and before the frame's write, so that the next stage starts computing sooner.
Other programs on the cores cannot take turns: while they slow the stage's threads down, it computes with
fewer (``ThreadChooser``, threads.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import attrs
import numpy as np
import trio

from skippyd.runtime.llama import Context, GuidedSampler, Sampler
from skippyd.stage.host_lock import HostComputeLock
from skippyd.stage.threads import ThreadChooser
from skippyd.telemetry import span
from skippyd.wire.stream import PreparedFrame

# Decode batches up to this many sessions compute on the event loop's thread, while the last such batch's
# compute took less than INLINE_MAX_US: short enough that a ping, or an HTTP request (which takes the loop
# several turns, each of which may wait for one inline compute), is answered within a fraction of a second
# while steps come back to back; a bigger model's decode step (tens of milliseconds) stays off the loop.
INLINE_MAX_SEQS = 8
INLINE_MAX_US = 20_000

T = TypeVar("T")


@attrs.define(eq=False)
class Job:
    """One session's input for one decode. Result: hidden rows, or a sampled token."""

    seq: int
    pos_start: int
    tokens: np.ndarray | None  # first stage
    embd: np.ndarray | None  # later stages; on a first stage, media rows' input embeddings (an image's)
    sampler: Sampler | GuidedSampler | None = None  # final stage: None = greedy; guided: sampled in Python
    want_token: bool = False  # final stage: sample after this job (the last prefill chunk or a decode step)
    # a verify window (the current token, then drafts): every row computed in one batch; on a final stage with
    # want_token, its rows are sampled while they confirm the drafts (``window_tokens``): result = list[int]
    window: bool = False
    window_tokens: np.ndarray | None = None
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
    # step's compute ends (then its done_ns is set; a hidden state's result is a view of the frame's float32
    # activation, or a copy of the row when the frame carries half floats); other computes leave it, and so does
    # a row beyond half's range (it goes as float32 through the ordinary write)
    out: PreparedFrame | None = None
    # media rows (an image's): their positions as given, int32 (sections, n), not counted from pos_start; and
    # whether they attend to each other causally. Such a job computes alone (see ``solo``)
    positions: np.ndarray | None = None
    causal: bool = True

    def __attrs_post_init__(self) -> None:
        self.n = len(self.tokens) if self.tokens is not None else len(self.embd)

    @property
    def solo(self) -> bool:
        """Media rows: a llama_decode of their own. A first stage's batch holds token ids or embeddings, not
        both; rows without causal attention must be the whole batch; and given positions (four per row with
        M-RoPE) are not merged with other jobs' counted ones."""
        return self.positions is not None or not self.causal


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


class Execution:
    """Computes batches on ``ctx`` (see the module docstring) and fills in their jobs' results and times.

    ``on_decoded`` is told the sequences of every batch's decode steps as soon as it is computed, before
    any of its jobs' waiters runs. The caller runs one compute at a time.
    """

    def __init__(self, ctx: Context, *, threads: ThreadChooser, stats: SchedulerStats, hot_path: HotPath,
                 host_lock: HostComputeLock | None = None,
                 on_decoded: Callable[[set[int]], None] = lambda seqs: None):
        self.ctx = ctx
        self.host_lock = host_lock
        self.threads = threads
        self.stats = stats
        self.hot_path = hot_path
        self._on_decoded = on_decoded
        self.decode_native_us = 0  # the last batch of decode steps only: its native time decides inline_turn
        self._native_us = self._lock_wait_us = 0  # the last compute's (set by the worker thread)
        self._native_cpu_us = 0  # ... CPU time of the computing thread in llama.cpp
        self._threads_now = ctx.params.n_threads

    # ---------------------------------------------------------------- the host lock (here only)
    def _try_turn(self) -> bool:
        return self.host_lock is None or self.host_lock.try_acquire()

    def _wait_turn(self) -> bool:
        """Wait for the host lock (blocking this thread); whether it is held now (none: False)."""
        if self.host_lock is None:
            return False
        if self.host_lock.acquire():
            return True
        self.stats.lock_timeouts = self.host_lock.timeouts  # its holder stopped or stuck: computed without it
        return False

    def _end_turn(self) -> None:
        if self.host_lock is not None:
            self.host_lock.release()

    def in_turn(self, fn: Callable[[], T]) -> T:
        """``fn()`` (other native compute: a projector's encode) holding the host's compute turn, if stages
        take turns here, so that it does not compute beside another stage. Blocking: call it in a worker
        thread."""
        holding = self._wait_turn()
        try:
            return fn()
        finally:
            if holding:
                self._end_turn()

    # ---------------------------------------------------------------- computes
    def inline_turn(self, batch: list[Job]) -> bool:
        """Whether to compute `batch` on the event loop's thread; True: holding the host lock (if any), which
        the compute that follows (``compute_row``, or ``compute``) releases. Prefill chunks, decode steps
        measured slower than INLINE_MAX_US or not measured yet, and any batch that would have to wait for the
        host lock go to the worker thread."""
        if len(batch) > INLINE_MAX_SEQS or any(j.n != 1 or j.window or j.solo for j in batch):
            return False
        if not 0 < self.decode_native_us < INLINE_MAX_US:
            return False
        return self._try_turn()

    async def compute(self, batch: list[Job]) -> None:
        """Compute `batch` (inline or in the worker thread) and wake its jobs (a failure is each job's error)."""
        started = time.perf_counter()
        if self.inline_turn(batch):
            self._compute_inline(batch, started)
            await trio.lowlevel.checkpoint()  # let the network in between two inline computes
            return
        try:
            with span("scheduler.decode", seqs=len(batch), tokens=sum(j.n for j in batch)):
                results = await trio.to_thread.run_sync(self.compute_sync, batch)
        except BaseException as exc:  # every waiter must be woken
            self._fail(batch, exc, started)
            if not isinstance(exc, Exception):
                raise
            return
        self._finish(batch, results, started, inline=False)

    def _compute_inline(self, batch: list[Job], started: float) -> None:
        """Compute `batch` on this thread (``inline_turn`` took the host lock, if any) and wake its jobs."""
        self.stats.inline_batches += 1
        try:
            with span("scheduler.decode", seqs=len(batch), tokens=len(batch)):
                results = self.compute_sync(batch, locked=True)
        except Exception as exc:  # every waiter must be woken
            self._fail(batch, exc, started)
            return
        self._finish(batch, results, started, inline=True)

    def compute_row(self, job: Job) -> None:
        """Compute one decode step on this thread (``inline_turn`` took the host lock, if any): what
        compute_sync and _finish do for a batch, without their loops over it (a session decoding alone comes
        here for every token, on every stage). A failure is the job's error."""
        ctx, stats, out = self.ctx, self.stats, job.out
        started = time.perf_counter()
        stats.inline_batches += 1
        handed = computed = False
        try:
            with span("scheduler.decode", seqs=1, tokens=1):
                try:
                    threads = self.use_threads()
                    native, native_cpu = time.perf_counter(), time.thread_time()
                    if out is not None and (ctx.hidden_output or job.want_token):
                        # the frame leaves (and the host lock is released) as the compute ends, before the Python
                        # below: the next stage's wake-up and compute do not wait for it
                        lock_fd = self.host_lock.fd if self.host_lock is not None else -1
                        inputs = {"token": int(job.tokens[0])} if ctx.token_input else {"embd": job.embd}
                        handed = True  # to the native call, which releases it
                        if ctx.hidden_output:
                            out.sent, out.done_ns = ctx.decode_row_send(job.pos_start, job.seq, out.frame,
                                                                        out.head_len, lock_fd=lock_fd, fd=out.fd,
                                                                        **inputs)
                            if len(out.frame) - out.head_len == 4 * ctx.n_embd:
                                result = np.frombuffer(out.frame, np.float32, offset=out.head_len).reshape(1, -1)
                            else:  # half floats on the wire: the row itself, as the next layers would take it
                                result = ctx.hidden()
                        else:
                            result, out.sent, out.done_ns = ctx.decode_row_sample_send(
                                job.pos_start, job.seq, job.sampler, out.frame, out.us_at, lock_fd=lock_fd,
                                fd=out.fd, **inputs)
                        if out.done_ns:
                            # to the compute's end, without the write after it (perf_counter is CLOCK_MONOTONIC)
                            native_us = max(0, int((out.done_ns / 1e9 - native) * 1e6))
                            stats.sent_at_compute_end += 1
                        else:  # a row beyond half's range: not written, the forward sends it as float32
                            native_us = int((time.perf_counter() - native) * 1e6)
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
                    computed = True
                finally:
                    # a fused call releases the lock as its compute ends, whatever the result; one that refused its
                    # arguments computed nothing and released nothing (a second release of a lock this file no
                    # longer holds does nothing)
                    if not (handed and computed):
                        self._end_turn()
        except Exception as exc:  # as _compute_inline
            self._fail([job], exc, started)
            return
        self._native_us, self._native_cpu_us, self._lock_wait_us = native_us, native_cpu_us, 0
        self.threads.observe(threads, 1, native_us / 1e6)
        self._count_batch(1, 1)
        now = time.perf_counter()
        self.hot_path.loop_native_cpu_s += native_cpu_us / 1e6
        stats.compute_s += now - started
        self.decode_native_us = native_us
        self._on_decoded({job.seq})
        job.result = result
        job.native_us, job.lock_wait_us, job.loop_native_cpu_us = native_us, 0, native_cpu_us
        job.queue_us = int((started - job.submitted) * 1e6)
        job.compute_us = int((now - started) * 1e6)
        job.batch_jobs = 1

    def compute_sync(self, batch: list[Job], locked: bool = False) -> list[object]:
        """One llama_decode for the whole batch, then its outputs split (one per job). In the worker thread,
        or on the loop's thread holding the host lock (`locked`); releases the lock it holds."""
        ctx = self.ctx
        holding = locked
        try:
            # a lone decode step: decode_row (never a verify window, whose rows all output logits)
            first = batch[0]
            row = first if len(batch) == 1 and first.n == 1 and not first.window and not first.solo else None
            windows = [j.seq for j in batch if j.window]
            n_tokens = 1
            causal = True
            if first.solo:  # media rows, alone (BatchPolicy): their own positions, an image's embeddings
                pos = first.positions[0] if len(first.positions) == 1 else first.positions
                seq = np.full(first.n, first.seq, dtype=np.int32)
                n_tokens, causal = first.n, first.causal
                inputs = {"input_embd" if ctx.token_input else "embd": first.embd}
            elif row is None:
                pos = np.concatenate([np.arange(j.pos_start, j.pos_start + j.n, dtype=np.int32) for j in batch])
                seq = np.concatenate([np.full(j.n, j.seq, dtype=np.int32) for j in batch])
                n_tokens = len(seq)
                key = "tokens" if ctx.token_input else "embd"
                rows = [j.tokens if ctx.token_input else j.embd for j in batch]
                inputs = {key: rows[0] if len(batch) == 1 else np.concatenate(rows)}
            elif ctx.token_input:
                inputs = {"token": int(row.tokens[0])}
            else:
                inputs = {"embd": row.embd}
            waiting = time.perf_counter()
            holding = holding or self._wait_turn()
            threads = self.use_threads()
            native = time.perf_counter()
            native_cpu = time.thread_time()
            if row is None:
                ctx.decode(pos, seq, windows=windows, causal=causal, **inputs)
            else:
                ctx.decode_row(row.pos_start, row.seq, **inputs)
        finally:
            if holding:
                self._end_turn()
        self._lock_wait_us = int((native - waiting) * 1e6)  # the other stages' turns
        self.stats.lock_wait_s += native - waiting
        native = time.perf_counter() - native
        native_cpu = time.thread_time() - native_cpu
        if n_tokens == len(batch) and not first.solo:  # decode steps only: what the thread count is judged by
            self.threads.observe(threads, n_tokens, native)
        self._count_batch(len(batch), n_tokens)
        if ctx.hidden_output:
            hidden = ctx.hidden()
            out, first = [], 0
            for j in batch:
                out.append(hidden[first:first + j.n])
                first += j.n
            self._native_us, self._native_cpu_us = int(native * 1e6), int(native_cpu * 1e6)
            return out
        wanted = {j.seq: j.sampler for j in batch if j.want_token and not j.window}
        started, started_cpu = time.perf_counter(), time.thread_time()
        tokens: dict[int, object] = ctx.sample(wanted) if wanted else {}
        for j in batch:
            if j.window and j.want_token:
                tokens[j.seq] = ctx.sample_window(j.seq, j.sampler, j.window_tokens)
        self._native_us = int((native + time.perf_counter() - started) * 1e6)
        self._native_cpu_us = int((native_cpu + time.thread_time() - started_cpu) * 1e6)
        return [tokens.get(j.seq) for j in batch]

    def use_threads(self) -> int:
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

    # ---------------------------------------------------------------- results
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
        # decoding sessions: their steps and windows
        decoded = {j.seq for j in batch if (j.n == 1 and not j.solo) or j.window}
        if len(decoded) == len(batch) and not any(j.window for j in batch):
            # decode steps only (one job per sequence): its time decides inline_turn
            self.decode_native_us = self._native_us
        if decoded:
            self._on_decoded(decoded)
        for job, result in zip(batch, results):
            job.result = result
            job.native_us, job.lock_wait_us = self._native_us, self._lock_wait_us
            job.loop_native_cpu_us = self._native_cpu_us if inline else 0
            job.queue_us = int((started - job.submitted) * 1e6)
            job.compute_us = compute_us
            job.batch_jobs = len(batch)
            if job.done is not None:
                job.done.set()

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
