"""How many threads a stage computes with: the configured count while it is fast, fewer while other
programs hold the cores.

ggml's threads meet at a barrier after every op of a graph, so a program that takes a core from one of them
holds up the others: a multi-threaded decode step slows down many times over where one thread merely shares
its core. :class:`ThreadChooser` is told the native time of every decode batch (batches of one size are
compared with each other). When the count in use gets SLOWER than its baseline, it tries half as many threads
and keeps them if they undo the slowdown; below the configured count it tries twice as many now and then,
and at the first compute after an idle pause, so that the stage is back on all its threads soon after the
load has gone. A trial's step slower than the current count's median ends it at once: a try that loses costs
one slow step.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

SLOWER = 1.5  # the recent median over the count's baseline that starts a trial of half as many threads
GAIN = 0.8  # more threads are kept below this share of the current count's median (fewer: below 1 / SLOWER)
TRIAL_STEPS = 4  # decode batches of one size that judge a trial
TRIAL_MAX_STEPS = 16  # a trial that saw no TRIAL_STEPS batches of one size by then ends with no change
WINDOW = 8  # recent decode batches kept per thread count and batch size: their median is what is judged
JUDGE_EVERY = 4  # decode batches between two looks at that median (a median per step would cost every step)
ALARM = 3.0  # steps this many times their count's baseline ...
ALARM_STEPS = 2  # ... this many in a row start the trial at once (a heavy load would crawl for a window)
FEWER_RECHECK_S = 30.0  # decode compute time between two trials of fewer threads (a load there from the start)
RECHECK_MIN_S = 0.25  # below the configured count, a switch's first try of twice as many comes this soon ...
RECHECK_S = 2.0  # ... each lost try doubles the wait, up to this; an idle pause this long makes the next compute one


def usable_cores(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The cores this process may compute on: its CPU affinity, capped by its cgroup's CPU quota, rounded
    (at least 1). ``os.cpu_count()`` is the host's: in a container given two CPUs of a 16-core host it says 16,
    and 16 threads under a 2-CPU quota are throttled in turn, each one holding the others up at every barrier."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
    if quota is not None:
        cores = min(cores, int(quota + 0.5))
    return max(1, cores)


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs' worth of time this process's cgroup and its ancestors allow (the smallest quota), from
    cgroup v2's cpu.max or v1's cpu.cfs_quota_us / cpu.cfs_period_us; None if there is no quota or no cgroup."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:  # "0::/user.slice/x.scope" (v2), "4:cpu,cpuacct:/docker/abc" (v1)
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            found = _smallest_quota(os.path.join(cgroup_root, path.lstrip("/")), cgroup_root, _v2_quota)
        elif "cpu" in controllers.split(","):
            # mounted under the controllers' names as listed, or (another order, a symlink missing) as "cpu"
            mount = next((m for m in (os.path.join(cgroup_root, controllers), os.path.join(cgroup_root, "cpu"))
                          if os.path.isdir(m)), None)
            found = None if mount is None else _smallest_quota(os.path.join(mount, path.lstrip("/")), mount,
                                                               _v1_quota)
        else:
            continue
        if found is not None:
            return found
    return None


def _smallest_quota(directory: str, root: str, read: Callable[[str], float | None]) -> float | None:
    """The smallest quota from `directory` up to `root` (a parent's limit holds its children too)."""
    smallest = None
    root = os.path.normpath(root)
    directory = os.path.normpath(directory)
    while True:
        quota = read(directory)
        if quota is not None and (smallest is None or quota < smallest):
            smallest = quota
        if directory == root or not directory.startswith(root):
            return smallest
        directory = os.path.dirname(directory)


def _v2_quota(directory: str) -> float | None:
    try:
        with open(os.path.join(directory, "cpu.max")) as f:
            quota, period = (f.read().split() + ["100000"])[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(directory: str) -> float | None:
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


class ThreadChooser:
    """The thread count of each compute (``pick``), from the decode batches' native times (``observe``)."""

    def __init__(self, configured: int, *, enabled: bool = True, cores: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.configured = configured
        self.enabled = enabled and configured > 1
        # more threads than cores wait for each other at every barrier: start on the cores, and try the
        # configured count as any count above the current one
        self.current = min(configured, cores) if self.enabled and cores else configured
        self.switches = 0  # changes of the current count
        self.trials = 0
        self._cores = cores
        self._clock = clock
        self._trial: int | None = None  # the count on trial
        self._trial_times: dict[int, list[float]] = {}  # rows -> the trial's times
        self._trial_steps = 0
        self._trial_ref: float | None = None  # what a trial started by an alarm is compared with
        self._recent: dict[tuple[int, int], deque[float]] = {}  # (threads, rows) -> recent times
        self._baseline: dict[tuple[int, int], float] = {}  # (threads, rows) -> the median when judged fine
        self._recheck_at = 0.0
        self._recheck_s = RECHECK_MIN_S  # the wait before the next try of more threads
        self._observed = 0
        self._descending = False  # half as many just won: try half again after a WINDOW of them
        self._last_step = -math.inf  # the clock at the last decode batch below the configured count, or on trial
        self._since_fewer_s = 0.0  # compute time of the decode batches since the last trial of fewer threads
        self._alarms: list[float] = []  # the latest steps in a row of ALARM times their baseline (one key)
        self._alarm_key: tuple[int, int] | None = None

    def pick(self) -> int:
        """The thread count for the next compute."""
        if (self._trial is None and self.current < self.configured and self._recent
                and self._clock() - self._last_step >= RECHECK_S):
            # the load may have gone during the pause (its steps on the current count judge the trial)
            more = min(self.configured, self.current * 2)
            if self._cores is None or more <= self._cores:
                self._start_trial(more)
        return self._trial if self._trial is not None else self.current

    def describe(self) -> dict:
        return {"configured": self.configured, "now": self.current, "trying": self._trial, "adaptive": self.enabled,
                "switches": self.switches, "trials": self.trials}

    def observe(self, threads: int, rows: int, seconds: float) -> None:
        """A decode batch of `rows` sessions took `seconds` of native compute with `threads` threads."""
        if not self.enabled:
            return
        if self.current < self.configured or self._trial is not None:  # (a trial may end in a switch down)
            self._last_step = self._clock()
        if self._trial is not None:
            if threads == self._trial:
                self._observe_trial(rows, seconds)
            return
        if threads != self.current:
            return
        key = (threads, rows)
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = deque(maxlen=WINDOW)
        recent.append(seconds)
        self._observed += 1
        self._since_fewer_s += seconds
        if self._alarmed(key, seconds):
            return
        if len(recent) < WINDOW or self._observed % JUDGE_EVERY:  # a median per step would cost every step
            return
        if self._descending and threads > 1:  # half as many just won: not necessarily the last halving
            self._start_trial(threads // 2)
            return
        if threads < self.configured and self._clock() >= self._recheck_at:
            self._start_trial(min(self.configured, threads * 2))
            return
        now = statistics.median(recent)
        base = self._baseline.get(key)
        if base is None:
            self._baseline[key] = now
            if not self.trials and threads > 1:
                self._start_trial(threads // 2)  # the first baseline may have been measured under load
        elif now > SLOWER * base and threads > 1:
            log.debug("compute threads: trying %d: a decode step of %d session(s) took %.1f ms with %d (median), "
                      "%.1fx its baseline", threads // 2, rows, now * 1e3, threads, now / base)
            self._start_trial(threads // 2)
        elif threads > 1 and self._since_fewer_s >= FEWER_RECHECK_S:
            self._start_trial(threads // 2)
        elif now < base:
            # faster than its baseline: that was measured under load (a stage that started on a busy host and
            # lost its first trial to noise), or on a longer context; a later load is judged from this one
            self._baseline[key] = now

    def _alarmed(self, key: tuple[int, int], seconds: float) -> bool:
        """Count a step ALARM times its baseline; the ALARM_STEPS-th in a row starts a trial of half as many
        threads, compared with those steps' median (the window still holds the steps from before the load)."""
        base = self._baseline.get(key)
        if base is None or key[0] <= 1 or seconds < ALARM * base:
            if self._alarms:  # (every decode step comes here: no new list unless one is owed)
                self._alarms = []
            return False
        if self._alarm_key != key:
            self._alarms, self._alarm_key = [], key
        self._alarms.append(seconds)
        if len(self._alarms) < ALARM_STEPS:
            return False
        slow = statistics.median(self._alarms)
        log.debug("compute threads: trying %d: %d decode steps of %d session(s) in a row took %.1f ms (median) "
                  "with %d, %.1fx its baseline", key[0] // 2, len(self._alarms), key[1], slow * 1e3, key[0],
                  slow / base)
        self._start_trial(key[0] // 2)
        self._trial_ref, self._alarms = slow, []
        return True

    def _start_trial(self, threads: int) -> None:
        self._trial, self._trial_times, self._trial_steps = threads, {}, 0
        if threads < self.current:
            self._since_fewer_s = 0.0
        self.trials += 1

    def _observe_trial(self, rows: int, seconds: float) -> None:
        times = self._trial_times.setdefault(rows, [])
        times.append(seconds)
        self._trial_steps += 1
        current = self._compared_with(rows)
        # a step slower than the current count's median ends it, lost: a count that wins is faster step by step
        if current is not None and (len(times) >= TRIAL_STEPS or seconds > current):
            self._judge(rows, statistics.median(times), current)
        elif self._trial_steps >= TRIAL_MAX_STEPS:
            self._end_trial()

    def _compared_with(self, rows: int) -> float | None:
        """The median a trial's steps of `rows` sessions are compared with: the current count's recent one, or,
        for fewer threads when a load began within the window (its newer half SLOWER times its older half),
        that of the newer half: the whole window's would mix steps from before the load with steps under it,
        and taken for the baseline after a lost trial, the load's steps would never be SLOWER times it."""
        if self._trial_ref is not None and rows == self._alarm_key[1]:
            return self._trial_ref
        recent = self._recent.get((self.current, rows))
        if not recent:
            return None
        if self._trial < self.current:
            steps = list(recent)
            half = len(steps) // 2
            newer = statistics.median(steps[half:])
            if half and newer > SLOWER * statistics.median(steps[:half]):
                return newer
        return statistics.median(recent)

    def _judge(self, rows: int, trial: float, current: float) -> None:
        tried, steps = self._trial, len(self._trial_times.get(rows, ()))
        self._end_trial()
        # fewer threads must undo the slowdown that started their trial: a switch back costs steps too
        won = trial < (1 / SLOWER if tried < self.current else GAIN) * current
        self._descending = tried < self.current and won
        if won:
            log.info("compute threads %d -> %d: a decode step of %d session(s) took %.1f ms with %d, %.1f ms with "
                     "%d%s", self.current, tried, rows, current * 1e3, self.current, trial * 1e3, tried,
                     " (other programs on the cores, or steps too small to share?)" if tried < self.current else "")
            self.current = tried
            self.switches += 1
            # what was measured before the switch is stale: the load has changed
            self._recent = {}
            self._baseline = {(tried, rows): trial}
        else:
            log.debug("compute threads: kept %d: a decode step of %d session(s) took %.1f ms with it, %.1f ms with "
                      "%d (%d steps tried)", self.current, rows, current * 1e3, trial * 1e3, tried, steps)
            if tried < self.current:
                self._baseline[(self.current, rows)] = current  # slower, but fewer threads are no help
        if won:
            self._recheck_s = RECHECK_MIN_S
        elif tried > self.current:  # more threads lost: the load stays, so try less often
            self._recheck_s = min(RECHECK_S, 2 * self._recheck_s)
        if self.current < self.configured:
            self._recheck_at = self._clock() + self._recheck_s

    def _end_trial(self) -> None:
        self._trial, self._trial_times, self._trial_steps, self._trial_ref = None, {}, 0, None
