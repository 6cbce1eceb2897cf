"""The head's decode steps as the HotPath counts them (see :class:`skippyd.stage.execution.HotPath`)."""

from __future__ import annotations

import time

from skippyd.stage.execution import HotPath


class StepClock:
    """One decode step on the head runs from having a token to having the next. Its compute and the lane
    client add what the step spent in native code and waiting on other stages (and the host lock), which
    :meth:`tick` leaves out of the step's own time."""

    __slots__ = ("hot_path", "started", "cpu", "native_us", "loop_native_cpu_us", "waited_us", "waited_cpu_s")

    def __init__(self, hot_path: HotPath):
        self.hot_path = hot_path
        self.started: float | None = None  # perf_counter: this step began (None: no step yet)
        self.cpu = 0.0  # the event loop thread's CPU time then
        self.native_us = 0  # this step so far: native compute ...
        self.loop_native_cpu_us = 0  # ... of which on the event loop's thread
        self.waited_us = 0  # waits on the other stages and the host lock
        self.waited_cpu_s = 0.0  # the event loop thread's CPU time in those waits

    def restart(self) -> None:
        """A decode loop begins (again, after a replay): the next tick starts its first step."""
        self.started = None

    def tick(self) -> float:
        """A token is in hand: note the step that led to it (none before the first) and begin the next.
        Returns when (perf_counter)."""
        if self.started is not None:
            cpu_s = time.thread_time() - self.cpu - self.loop_native_cpu_us / 1e6
            self.hot_path.note(time.perf_counter() - self.started - self.waited_us / 1e6, self.native_us, cpu_s,
                               self.waited_cpu_s)
        started = self.started = time.perf_counter()
        self.cpu = time.thread_time()
        self.waited_us = self.native_us = self.loop_native_cpu_us = 0
        self.waited_cpu_s = 0.0
        return started
