"""The per-stage scheduler: the one task that owns the stage's llama context.

Sessions submit work (a prefill chunk or a decode step for their sequence)
and wait for the result. The scheduler gathers whatever is ready into one
``llama_decode``: every pending decode step of every session (batched decode),
plus a prefill chunk while there is room in the batch, so that a long prompt
is interleaved with running generations instead of stalling them. Which jobs
form a batch, and how long it waits for more, is ``BatchPolicy``'s
(batching.py); how a batch computes, and the host compute lock, is
``Execution``'s (execution.py). A lone session's decode step computes right
in the task that submits it (``_direct``).

KV operations (trim, release) are queued too and run between two computes,
since llama.cpp allows one thread at a time per context.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import trio

from skippyd.runtime.llama import Context, LlamaError
from skippyd.stage.batching import BatchPolicy, decode_steps
from skippyd.stage.execution import Execution, HotPath, Job, SchedulerStats
from skippyd.stage.host_lock import HostComputeLock
from skippyd.stage.threads import ThreadChooser, usable_cores

log = logging.getLogger(__name__)


class Scheduler:
    """See the module docstring; ``decode_groups``: see batching.py."""

    def __init__(self, ctx: Context, *, max_batch_tokens: int | None = None,
                 host_lock: HostComputeLock | None = None, decode_groups: int = 1, adapt_threads: bool = True):
        self.ctx = ctx
        self.host_lock = host_lock  # owned: closed when serve() ends
        self.policy = BatchPolicy(max_batch_tokens=max_batch_tokens or ctx.n_batch, decode_groups=decode_groups,
                                  head=ctx.token_input, takes_turns=host_lock is not None)
        self.stats = SchedulerStats()
        self.hot_path = HotPath()
        # decode (and prefill) with the configured threads, or fewer while that is much faster (threads.py)
        threads = ThreadChooser(ctx.params.n_threads, enabled=adapt_threads, cores=usable_cores())
        self.execution = Execution(ctx, threads=threads, stats=self.stats, hot_path=self.hot_path,
                                   host_lock=host_lock, on_decoded=self.policy.decoded)
        self._jobs: deque[Job] = deque()
        self._kv_ops: deque[tuple[Callable[[], None], trio.Event]] = deque()
        self._wakeup = trio.Event()
        self._closed = False
        self._arrived: trio.Event | None = None  # set by submit() while _gather waits
        self._busy = False  # the serve task is between its wake-up and its next wait

    @property
    def threads(self) -> ThreadChooser:
        return self.execution.threads

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
        if (self._busy or self._closed or self._jobs or self._kv_ops or job.n != 1 or job.solo
                or not self.policy.ready({job.seq}) or not self.execution.inline_turn([job])):
            return False
        self.execution.compute_row(job)  # awaits nothing: no other job can slip in
        return True

    def forget(self, seq: int) -> None:
        """`seq` ended: a gather waits for it no more."""
        self.policy.forget(seq)
        if self._arrived is not None:
            self._arrived.set()

    def back(self, seq: int) -> None:
        """The head: `seq`'s prediction came back from the pipeline; its next step follows at once."""
        self.policy.back(seq)

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
                self._busy = True
                while self._kv_ops or self._jobs:
                    self._run_kv_ops()
                    await self._gather()
                    batch = self.policy.take(self._jobs)
                    for job in batch:
                        self._jobs.remove(job)
                    if batch:
                        await self.execution.compute(batch)
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

    async def _gather(self) -> None:
        """Before a decode batch: give the sessions the policy expects a moment to send their next step (at
        most its ``wait_s``; over as soon as it is ``ready``)."""
        steps = decode_steps(self._jobs)
        if not steps or self.policy.ready(steps):
            return
        self._arrived = trio.Event()
        with trio.move_on_after(self.policy.wait_s(self.execution.decode_native_us / 1e6)):
            while not self.policy.ready(steps):
                await self._arrived.wait()
                self._arrived = trio.Event()
                steps = decode_steps(self._jobs)
        self._arrived = None
        self.policy.stopped_waiting(steps)
        self.stats.gathers += 1

    def _run_kv_ops(self) -> None:
        while self._kv_ops:
            op, done = self._kv_ops.popleft()
            try:
                op()
            except LlamaError as exc:
                log.warning("KV operation failed: %s", exc)
            done.set()
