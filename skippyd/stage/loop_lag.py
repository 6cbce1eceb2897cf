"""How late the event loop runs, and how long a ping may take before its peer counts as gone.

:class:`LoopLag` is a task that sleeps ``period`` again and again and
measures how late it wakes: whatever held the loop (or the GIL, in any
thread) that long held every other task too, a ping's answer included. It
keeps the lateness as a histogram (``skippy_event_loop_lag_seconds`` by
stage, through :class:`LoopLagCollector`), remembers the worst of the last
``RECENT_S``, and logs a warning for a stall over ``warn_s`` (at most one
line per ``warn_every_s``, counting the rest).

:class:`PingDeadline` decides how long a liveness ping waits for its
answer: a high percentile of the recent round trips (times a margin),
between a floor and a ceiling, counted in time the waiting loop was free
to run (:meth:`PingDeadline.within`): a stall of the waiting loop itself
held the answer unread, so it is not the peer's time. A peer that answers
at once keeps the floor, so a dead one is found as fast as with a fixed
deadline; one that answers late, alive but busy, earns a longer wait;
nothing waits longer than the ceiling (plus a stall still in progress).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import math
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import trio
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("skippyd.stage")

PERIOD_S = 0.05  # the monitor's sleep: lateness is measured this often
WARN_S = 0.25  # a stall this long is logged
WARN_EVERY_S = 10.0  # ... at most once this often (the line counts the others)
RECENT_S = 30.0  # the lag deadlines take into account: the worst of this long
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# a liveness ping waits at least PING_FLOOR_S (a peer that answers at once), at most PING_CEILING_S (one
# that has been answering slowly); a stage relaying it waits a fraction of that (skippyd/stage/roles.py)
PING_FLOOR_S = 1.0
PING_CEILING_S = 4.0

STEP_S = 0.05  # a ping's wait wakes this often to tell its own loop's stalls from the peer's time
T = TypeVar("T")

_running: weakref.WeakSet[LoopLag] = weakref.WeakSet()  # every monitor serving in this process (the collector's)


class LoopLag:
    """The lateness of this trio loop, as one stage (``label``) measures it; :meth:`serve` runs it."""

    def __init__(self, label: str, *, period: float = PERIOD_S, warn_s: float = WARN_S,
                 warn_every_s: float = WARN_EVERY_S):
        self.label = label
        self.period = period
        self.warn_s = warn_s
        self.warn_every_s = warn_every_s
        self.counts = [0] * (len(LAG_BUCKETS) + 1)  # per bucket (not cumulative); the last: over the top bound
        self.total_s = 0.0
        self.samples = 0
        self.last_s = 0.0
        self.max_s = 0.0
        self.stalls = 0  # lags over warn_s
        self._recent: collections.deque[tuple[float, float]] = collections.deque()  # (when, lag) over period
        self._warned_at = -math.inf
        self._unlogged = 0  # stalls since the last warning line

    def observe(self, lag: float, now: float) -> None:
        """One measured lateness (seconds) at trio time ``now``."""
        lag = max(0.0, lag)
        self.counts[bisect.bisect_left(LAG_BUCKETS, lag)] += 1
        self.total_s += lag
        self.samples += 1
        self.last_s = lag
        self.max_s = max(self.max_s, lag)
        recent = self._recent
        while recent and recent[0][0] < now - RECENT_S:
            recent.popleft()
        if lag >= self.period:  # shorter ones are noise to a deadline of a second
            while recent and recent[-1][1] <= lag:  # kept decreasing: the first is the worst
                recent.pop()
            recent.append((now, lag))
        if lag >= self.warn_s:
            self.stalls += 1
            self._unlogged += 1
            if now - self._warned_at >= self.warn_every_s:
                more = f" ({self._unlogged - 1} more over {self.warn_s:g} s since the last report)" \
                    if self._unlogged > 1 else ""
                log.warning("stage %s: the event loop was held for %.3f s%s", self.label, lag, more)
                self._warned_at, self._unlogged = now, 0

    def recent(self, now: float) -> float:
        """The worst lateness of the last RECENT_S at trio time ``now`` (0: none over ``period``)."""
        return next((lag for when, lag in self._recent if when >= now - RECENT_S), 0.0)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Measure until cancelled."""
        _running.add(self)
        task_status.started(self)
        try:
            while True:
                asleep = trio.current_time()
                await trio.sleep(self.period)
                now = trio.current_time()
                self.observe(now - asleep - self.period, now)
        finally:
            _running.discard(self)

    def describe(self) -> dict:
        """For status: the lag now, the worst of the last RECENT_S and ever, the stalls over warn_s."""
        try:
            now = trio.current_time()
        except RuntimeError:  # outside the loop: nothing is recent
            now = math.inf
        return {"last_ms": round(self.last_s * 1e3, 3), "recent_max_ms": round(self.recent(now) * 1e3, 3),
                "max_ms": round(self.max_s * 1e3, 3), "samples": self.samples, "stalls": self.stalls}


class PingDeadline:
    """How long a ping waits for its answer: ``margin`` times the ``percentile`` of the last ``keep`` answered
    round trips, within ``[floor, ceiling]``, all of it times ``scale`` (a relaying stage's fraction of what its
    upstream waits); :meth:`within` waits so long, not counting the time the waiting loop itself was held."""

    def __init__(self, floor: float = PING_FLOOR_S, ceiling: float = PING_CEILING_S, *, scale: float = 1.0,
                 margin: float = 2.0, percentile: float = 0.95, keep: int = 64):
        if not 0 < floor <= ceiling:
            raise ValueError(f"a ping deadline needs 0 < floor <= ceiling, got {floor}, {ceiling}")
        self.floor, self.ceiling, self.scale = floor, ceiling, scale
        self.margin, self.percentile = margin, percentile
        self._rtts: collections.deque[float] = collections.deque(maxlen=keep)

    def observe(self, rtt: float) -> None:
        """An answered ping's round trip (seconds)."""
        self._rtts.append(max(0.0, rtt))

    def rtt_high(self) -> float:
        """The percentile of the recent round trips (0: none yet)."""
        if not self._rtts:
            return 0.0
        ordered = sorted(self._rtts)
        return ordered[max(0, math.ceil(self.percentile * len(ordered)) - 1)]

    def timeout(self) -> float:
        """The wait of the next ping, in time its loop is free to run (seconds)."""
        return self.scale * min(self.ceiling, max(self.floor, self.margin * self.rtt_high()))

    async def within(self, op: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        """``await op()``, cancelled with :class:`trio.TooSlowError` once it has waited ``timeout`` (default
        :meth:`timeout`) of time this loop was free to run, or ``scale * ceiling`` in all, whichever is first.
        The wait wakes every STEP_S: a step that took longer than asked was a stall of this loop (the answer
        may have been in, unread), so only the step's own length counts."""
        allowed = self.timeout() if timeout is None else timeout
        outcome: list = []

        async def run(cancel_scope: trio.CancelScope) -> None:
            try:
                outcome.append((True, await op()))
            except Exception as exc:  # re-raised below, outside the nursery
                outcome.append((False, exc))
            cancel_scope.cancel()

        started = trio.current_time()
        last_wall = started
        counted = 0.0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, nursery.cancel_scope)
            while counted < allowed and last_wall - started < self.scale * self.ceiling:
                step = min(STEP_S, allowed - counted)
                await trio.sleep(step)
                now = trio.current_time()
                counted += min(now - last_wall, step + 0.01)  # 10 ms: a busy but free loop's own jitter
                last_wall = now
            nursery.cancel_scope.cancel()
        if not outcome:
            raise trio.TooSlowError
        ok, value = outcome[0]
        if not ok:
            raise value
        return value


class LoopLagCollector(Collector):
    """``skippy_event_loop_lag_seconds``: every running monitor's histogram of this process, by stage."""

    def describe(self) -> Iterable:
        return []  # unchecked: its samples depend on the stages running

    def collect(self) -> Iterable:
        family = HistogramMetricFamily("skippy_event_loop_lag_seconds", "How late the event loop woke from a "
                                       f"{PERIOD_S:g} s sleep (the longest anything held it), by stage",
                                       labels=["stage"])
        by_stage: dict[str, tuple[list[int], float]] = {}  # a stage's monitors summed (one per stage, usually)
        for monitor in list(_running):
            counts, total = by_stage.get(monitor.label, ([0] * len(monitor.counts), 0.0))
            by_stage[monitor.label] = ([a + b for a, b in zip(counts, monitor.counts)], total + monitor.total_s)
        for label, (counts, total) in sorted(by_stage.items()):
            cumulative = list(itertools.accumulate(counts))
            family.add_metric([label], list(zip((*map(str, LAG_BUCKETS), "+Inf"), cumulative)), total)
        yield family
