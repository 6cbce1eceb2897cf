"""How many threads a stage computes with: the configured count while it is fast, fewer while other
programs hold the cores.

ggml's threads meet at a barrier after every op of a graph (hundreds per decode step). When another
program takes a core from one of them, the others wait at the next barrier until it runs again, so a
multi-threaded step slows down many times over where one thread merely shares its core: on the 2-core
development VM, with two busy programs beside it, a single stage decoded 8 tokens/s with 2 threads and
26 with one (bench/under_load.py, BENCHMARKS.md). Operators cannot be expected to watch for that, so the
scheduler times every decode batch (native time, no lock wait) and :class:`ThreadChooser` decides,
between the configured count and its halves down to one (8, 4, 2, 1):

- a configured count above the host's cores starts on as many threads as there are cores (and, being
  below the configured count, tries it now and then: see the last point);
- once, as soon as the configured count has its first baseline (the median of its first WINDOW decode
  batches), it tries half as many: a stage may start on a busy host; and again after FEWER_RECHECK_S of
  decode steps (their compute time, idle time not counted) without a trial of fewer threads (a first
  trial lost to noise under a load there from the start left the load's steps for the baseline, which
  they never exceeded SLOWER times: the configured count for as long as the load lasted; on an idle host
  such a trial costs one slow step: see the end);
- once the recent median of the count in use is SLOWER times that count's baseline, it tries half as
  many threads for TRIAL_STEPS batches and keeps them if they undid that slowdown (FEWER_GAIN, 1 /
  SLOWER: under a real load one thread of two is 2-3x faster, while on a wandering VM a switch for less
  costs more in the steps back than it gains during a spell), then, after WINDOW batches, tries half as
  many again; if not (a longer context slows every step too), the slow median becomes the baseline, so
  it takes another such slowdown to try again; a median below the baseline becomes the baseline too
  (the first one may have been measured under load). When the load began within the window (its newer
  half SLOWER times its older half), the trial is compared with the newer half's median (against the
  whole window's, a median of steps from before and under the load, a trial could lose, that median became
  the baseline, and the stage kept two threads while the load lasted);
- a load that makes every step many times slower (ALARM times the count's baseline, ALARM_STEPS steps in a
  row) starts that trial at once, judged against those steps, without waiting for a window of them: with
  two busy programs on a 2-core host a step of two threads took ~20 times as long, so the window's wait was
  ~2.5 s of crawling at each onset of a load (a 32-token generation of a 2-stage pipeline: 13.9 tok/s against
  36 on one thread). A lone slow step (a VM's hiccup) starts nothing;
- below the configured count, it tries twice as many RECHECK_MIN_S after the switch, then twice as long
  after each lost try, up to every RECHECK_S, and keeps them once faster by GAIN. Where it can look at the
  host's cores (Linux), a try is made only if the cores the extra threads need were free since the last
  look (otherwise it looks again RECHECK_MIN_S later): under a load that stays, each try cost a step on
  more threads, several times slower (two busy programs on two cores: ~120 ms against ~20 on one thread,
  at 0.25, 0.5, 1 and every 2 s). On a shared VM other
  guests take a core for a second or so now and then: the stage halves near the end of such a spell and,
  with a fixed 2 s, computed at ~0.55 of its speed for 2 s after it (a 2-stage pipeline of a 463 MB model
  decoded 17% slower than with the chooser off in a round with two such switches).
- below the configured count and not decoding for RECHECK_S, it looks at the host's cores every TICK_S
  (``tick``, from the scheduler's idle wait; ``host_cpu_times``, /proc/stat, steal counting as busy): if
  as many as twice the count were free over the last TICK_S, the next compute is a trial of twice as many
  threads. What the host's stages computed holding the host compute lock counts as free (``shared_cpu``,
  the lock's tally): the stage would take turns with them (a stage idle while the stage before it
  prefilled the next prompt saw the cores busy, and computed its share of the prompt on fewer threads).
  A compute adds to the tally only when it ends, so while one holds the lock (``shared_busy``) the look
  waits for the next tick, up to POSTPONE_TICKS times: a look in the middle of the previous stage's
  first prefill chunk saw the chunk's cores busy and called off the trial the prompt was about to start.
  A prompt that arrives once the load has gone is computed on all threads, not on the count its last
  decode steps were left on (the decode steps after it judge the trial); under a load that stays,
  nothing changes. Elsewhere than on Linux, such a stage waits for decode steps as before. A compute that
  comes after IDLE_GAP_S without one, before any such look (the load ended just before the work came), is a
  trial of twice as many threads if no other thread runs on the host at that moment (/proc/loadavg, as
  below).
- on more than one thread and idle, where /proc/stat's cores are this process's (no narrower CPU affinity,
  no cgroup quota), it looks at them every TICK_S too: BUSY_LOOKS looks in a row whose windows held no
  compute of its own and found fewer cores free than its count (less FREE_SLACK; the host lock's turns count
  as free) halve the count. A load that began while the stage idled then meets the next prompt and decode
  steps on a count that suits it: on the configured one the prompt was prefilled on two threads (~500 tokens
  under two busy programs: 7.9 s against 3.5 on one, 2 stages) and its first ALARM_STEPS decode steps crawled
  (~20 times as slow). A look that finds the cores free again restores the count at once (no decode step
  measured the lower one), and so does the first compute on it if no other thread runs on the host then
  (/proc/loadavg: the load ended as the work came, as a benchmark's reference does; besides this thread, the
  one that sent the work may run, the client or the stage before on this host, which goes on with its own);
  once decode steps have run on it, the rules above apply. A command starting or a page loading keeps the
  cores busy for fewer looks than BUSY_LOOKS.

A trial ends at once, lost, on a step slower than the current count's median: a count that wins is
faster step by step (under load, by 2-3 times), and one that loses costs one slow step instead of
TRIAL_STEPS of them. That matters on a host whose speed wanders by more than SLOWER (a shared VM): a
step of a 50 ms model, tried on one thread of two, took 1.8 times as long, four times per trial, 7 trials
in ~400 steps. While a load lasts, a try of more threads costs one slow step, at most every RECHECK_S once
the load has lasted a few seconds; once it is gone the stage is back on all its threads within RECHECK_S.

Batches are compared only with batches of as many rows (sessions).
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

SLOWER = 1.5  # recent median / the count's baseline that makes it try half as many threads
GAIN = 0.8  # a count on trial is kept when its median is below GAIN x the current count's ...
FEWER_GAIN = 1 / SLOWER  # ... or below this, for fewer threads: they must undo the slowdown that starts a trial
TRIAL_STEPS = 4  # decode batches of one size a trial measures
TRIAL_MAX_STEPS = 16  # a trial that saw no TRIAL_STEPS batches of one size by then ends with no change
WINDOW = 8  # recent decode batches kept per thread count and batch size
JUDGE_EVERY = 4  # decode batches between two looks at the recent median
ALARM = 3.0  # a step this many times its count's baseline ...
ALARM_STEPS = 2  # ... this many in a row start a trial of half as many threads at once
ABORT = 1.0  # a trial's step this many times slower than the current count's median ends it, lost
FEWER_RECHECK_S = 30.0  # the most decode compute time between two trials of fewer threads
RECHECK_MIN_S = 0.25  # below the configured count: the first try of twice as many threads, after a switch
RECHECK_S = 2.0  # ... and the longest wait between two tries (each lost one doubles it)
TICK_S = 1.0  # idle (below the configured count, or on more threads than one: tick): how often it looks ...
FREE_SLACK = 0.5  # ... for twice as many free cores, less this, over the last TICK_S
POSTPONE_TICKS = 3  # looks put off in a row while a stage sharing the host computes under the lock
BUSY_LOOKS = 2  # idle on more than one thread: looks in a row with the cores busy that halve the count
IDLE_GAP_S = 0.25  # below the configured count: a compute this long after the last one asks /proc/loadavg ...
QUIET_RUNNABLE = 2  # ... whether no more threads than this run: this one and the one that sent the work (the
# client, or the stage before on this host, which goes on with its own part of the step)

try:
    _CLK_TCK = os.sysconf("SC_CLK_TCK")  # /proc/stat's unit
except (AttributeError, ValueError, OSError):
    _CLK_TCK = 100


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


def host_runnable() -> int | None:
    """Threads runnable on the host now, the caller's included (/proc/loadavg); None where that cannot be read."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


def host_cpu_times() -> tuple[float, float] | None:
    """(idle, all) time of every core of the host so far, in seconds, from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat", "rb") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    if len(ticks) < 5:
        return None
    return (ticks[3] + ticks[4]) / _CLK_TCK, sum(ticks) / _CLK_TCK


class ThreadChooser:
    def __init__(self, configured: int, *, enabled: bool = True, cores: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 cpu_times: Callable[[], tuple[float, float] | None] | None = host_cpu_times,
                 shared_cpu: Callable[[], float | None] | None = None,
                 shared_busy: Callable[[], bool] | None = None, whole_host: bool = True,
                 runnable: Callable[[], int | None] | None = None):
        self.configured = configured
        self.enabled = enabled and configured > 1
        # more threads than cores wait for each other at every barrier: start on as many as there are cores
        # and try the configured count now and then, as after a halving (a single lost trial of fewer
        # threads kept a stage of 8 threads on 2 cores at 40% of its speed)
        self.current = min(configured, cores) if self.enabled and cores else configured
        self.switches = 0  # changes of the current count
        self.trials = 0
        self._clock = clock
        self._trial: int | None = None  # the count on trial
        self._trial_times: dict[int, list[float]] = {}  # rows -> the trial's times
        self._trial_steps = 0
        self._recent: dict[tuple[int, int], deque[float]] = {}  # (threads, rows) -> recent times
        self._baseline: dict[tuple[int, int], float] = {}  # (threads, rows) -> the median when judged fine
        self._recheck_at = 0.0
        self._recheck_s = RECHECK_MIN_S  # the wait before the next try of more threads
        self._observed = 0
        self._descending = False  # half as many won the last trial: try half again after a WINDOW of them
        self._cores = cores
        self._cpu_times = cpu_times  # None: no looks at the cores while idle
        self._cpu_mark: tuple | None = None  # the host's cpu times and the lock's tally at the last tick
        self._recheck_mark: tuple | None = None  # ... at the last switch or look before a trial of more threads
        self.skipped_tries = 0  # tries of more threads called off: the cores they need were busy
        self._shared_cpu = shared_cpu  # the host compute lock's tally (CPU s computed under it), if any
        self._shared_busy = shared_busy  # whether a stage of this host holds the lock (computes) now
        self._postponed = 0  # looks put off in a row for that
        self._last_step = -math.inf  # the clock at the last decode batch below the configured count, or on trial
        self._since_fewer_s = 0.0  # compute time of the decode batches since the last trial of fewer threads
        self._armed: int | None = None  # a trial the next compute starts (the cores were free while idle)
        self._alarms: list[float] = []  # the latest steps in a row of ALARM times their baseline (one key)
        self._alarm_key: tuple[int, int] | None = None
        self._trial_ref: float | None = None  # what a trial started by an alarm is compared with
        # idle on more than one thread, it looks at the cores for a load beginning (whole_host: /proc/stat's
        # cores are this process's; under a narrower affinity or a cgroup quota they are not)
        self._look_for_load = whole_host
        self._picks = 0  # computes so far (pick): a look's window is idle if none came since the last look
        self._picks_at_mark = -1
        self._busy_looks = 0  # idle looks in a row that found the cores busy
        self._idle_set = False  # the count was set by idle looks, with no decode step on it since
        self._unconfirmed = False  # ... lowered, and no compute on it yet (see _after_idle)
        self._before_idle = configured  # the count the idle looks lowered
        # /proc/loadavg with /proc/stat (a test's made-up host gives its own or none)
        self._runnable = runnable if runnable is not None or cpu_times is not host_cpu_times else host_runnable
        self._last_pick = clock()  # the clock at the last compute below the configured count (or switch)

    def pick(self) -> int:
        """The thread count for the next compute."""
        self._picks += 1
        if self.current < self.configured and self._look_for_load:
            self._after_idle()
        if self._armed is not None:
            self._start_trial(self._armed)
            self._armed = None
        return self._trial if self._trial is not None else self.current

    def tick_s(self) -> float:
        """How long the scheduler may wait for work before calling ``tick`` (inf: no need)."""
        if (self.enabled and self._cores and self._cpu_times is not None
                and (self.current < self.configured or (self.current > 1 and self._look_for_load))):
            return TICK_S
        return math.inf

    def tick(self) -> None:
        """The scheduler waited TICK_S for work. Below the configured count and not decoding for RECHECK_S: arm a
        trial of twice as many threads for the next compute if as many cores were free since the last tick
        (called off if not any more); or, on a count set by idle looks alone, take it at once. On more than one
        thread, with no compute since the last tick: BUSY_LOOKS such windows in a row with fewer cores free than
        the count (less FREE_SLACK) halve it, so that the next prompt and decode steps do not meet the load on
        all threads first (two busy programs: a decode step of two threads ~20 times as slow as of one)."""
        if not math.isfinite(self.tick_s()):
            return
        if self._trial is not None and self._trial > self.current and not self._trial_steps:
            # a trial of more threads that a prompt started and no decode step has judged (a one-token answer
            # ends without any): armed again, so that the looks keep it for the next compute or call it off
            self._armed = self._trial
            self._end_trial()
            self.trials -= 1  # (counted again when it starts)
        clear = self._trial is None and self._cpu_mark is not None
        due = clear and self.current < self.configured and self._clock() - self._last_step >= RECHECK_S
        watch = (clear and self.current > 1 and self._look_for_load and self._armed is None
                 and self._picks == self._picks_at_mark)
        if ((due or watch) and self._shared_busy is not None and self._postponed < POSTPONE_TICKS
                and self._shared_busy()):
            self._postponed += 1  # its compute is not in the tally yet: look once it is
            return
        self._postponed = 0
        last, self._cpu_mark = self._cpu_mark, self._host_mark()
        self._picks_at_mark = self._picks
        free = self._free_cores(last, self._cpu_mark) if due or watch else None
        if due:
            more = min(self.configured, self.current * 2)
            if free is not None and free >= more - FREE_SLACK:
                self._busy_looks = 0
                if self._idle_set:  # no decode step measured the count the looks set: they undo it alone
                    self._switch_idle(more, f"{free:.1f} of {self._cores} cores free while idle (the load has gone)")
                    return
                if self._armed is None:
                    log.debug("compute threads: %d next (%.1f cores free while idle)", more, free)
                self._armed = more
                return
            self._armed = None
        if not watch or free is None or free >= self.current - FREE_SLACK:
            self._busy_looks = 0
            return
        self._busy_looks += 1
        if self._busy_looks >= BUSY_LOOKS:
            self._switch_idle(self.current // 2, f"{free:.1f} of {self._cores} cores free while idle (other programs "
                                                 f"on the cores)")

    def _after_idle(self) -> None:
        """Below the configured count, the first compute on a count idle looks lowered, or a compute after the
        stage idled IDLE_GAP_S or more. If nothing runs on the host now but this thread and the one that sent the
        work (QUIET_RUNNABLE), the load ended as (or just before) the work came: a count the looks lowered goes
        back at once (their windows still hold the load, and decode steps would take a window of them and a
        trial); another is tried twice as high (a look would wait for RECHECK_S of idle time, and decode steps
        for a window of them), lost at its first slower step if the load is still there. Otherwise the decode
        steps judge from here, and a look before their try of more counts the cores from this compute on, not
        from the pause (which may have had another load)."""
        now = self._clock()
        last, self._last_pick = self._last_pick, now
        if not self._unconfirmed and (now - last < IDLE_GAP_S or self._trial is not None or self._armed is not None):
            return
        running = self._runnable() if self._runnable is not None else None
        if running is None or running > QUIET_RUNNABLE:
            self._unconfirmed = False
            self._recheck_mark = self._host_mark()
        elif self._unconfirmed:
            self._switch_idle(self._before_idle, "nothing else runs on the host as work comes")
        else:
            self._armed = min(self.configured, self.current * 2)
            log.debug("compute threads: trying %d: nothing else runs on the host after a pause", self._armed)

    def _switch_idle(self, threads: int, why: str) -> None:
        """Idle looks at the cores (or the first compute after them) change the count to `threads` (no decode step
        judged it)."""
        # debug, not info: no compute is affected yet, status shows the count, and a load that comes and goes
        # while the stage idles would switch it back and forth every few seconds
        log.debug("compute threads %d -> %d: %s", self.current, threads, why)
        if threads < self.current and not self._idle_set:
            self._before_idle = self.current
        self._unconfirmed = threads < self.current
        self.current = threads
        self.switches += 1
        self._idle_set = threads < self.configured
        self._busy_looks = 0
        self._armed = None
        self._descending = False
        self._alarms = []
        self._recent = {}  # steps of another load; the baselines (unloaded) stay, for the alarm once back
        self._recheck_s = RECHECK_MIN_S
        self._recheck_at = self._clock() + RECHECK_MIN_S
        self._recheck_mark = self._cpu_mark

    def _host_mark(self) -> tuple[tuple[float, float], float | None] | None:
        """The host's (idle, all) core time and the host lock's tally now; None where there is no /proc/stat."""
        times = self._cpu_times() if self._cpu_times is not None and self._cores else None
        if times is None:
            return None
        return times, self._shared_cpu() if self._shared_cpu is not None else None

    def _free_cores(self, since: tuple | None, now: tuple | None) -> float | None:
        """Cores free between two marks, the host's stages' turns under the lock counted as free (this one
        would take turns with them); None if that cannot be told."""
        if since is None or now is None:
            return None
        (times, shared), (last, shared_last) = now, since
        idle, total = times[0] - last[0], times[1] - last[1]
        if total <= 0:
            return None
        if shared is not None and shared_last is not None:
            idle += max(0.0, shared - shared_last)  # the turns of the stages taking turns with this one
        return min(self._cores, self._cores * idle / total)

    def _cores_for(self, more: int) -> bool:
        """Before a trial of `more` threads while decoding on fewer: whether the cores the extra ones need were
        free (less FREE_SLACK) since the last such look or switch; True where that cannot be told."""
        last, self._recheck_mark = self._recheck_mark, self._host_mark()
        free = self._free_cores(last, self._recheck_mark)
        return free is None or free >= more - self.current - FREE_SLACK

    def describe(self) -> dict:
        return {"configured": self.configured, "now": self.current, "trying": self._trial, "adaptive": self.enabled,
                "switches": self.switches, "trials": self.trials, "skipped_tries": self.skipped_tries}

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
        self._idle_set = False
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
            more = min(self.configured, threads * 2)
            if self._cores_for(more):
                self._start_trial(more)
            else:  # the load stays: no trial, no slow step; a look costs nothing, so look again soon
                self.skipped_tries += 1
                self._recheck_at = self._clock() + RECHECK_MIN_S
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
        if current is not None and (len(times) >= TRIAL_STEPS or seconds > ABORT * current):
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
        won = trial < (FEWER_GAIN if tried < self.current else GAIN) * current
        self._descending = tried < self.current and won
        if won:
            log.info("compute threads %d -> %d: a decode step of %d session(s) took %.1f ms with %d, %.1f ms with "
                     "%d%s", self.current, tried, rows, current * 1e3, self.current, trial * 1e3, tried,
                     " (other programs on the cores, or steps too small to share?)" if tried < self.current else "")
            self.current = tried
            self.switches += 1
            self._last_pick = self._clock()
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
            self._recheck_mark = self._host_mark()

    def _end_trial(self) -> None:
        self._trial, self._trial_times, self._trial_steps, self._trial_ref = None, {}, 0, None
