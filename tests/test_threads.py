"""ThreadChooser: the configured thread count while it is fast, fewer (half, down to one) while other
programs hold the cores (its decisions, from given step times; tests/test_hot_path.py runs it on a real
stage under load)."""

from __future__ import annotations

from skippyd.stage.threads import (
    ALARM_STEPS,
    FEWER_RECHECK_S,
    JUDGE_EVERY,
    RECHECK_MIN_S,
    RECHECK_S,
    WINDOW,
    ThreadChooser,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(chooser: ThreadChooser, steps: int, ms: dict[int, float], rows: int = 1) -> list[int]:
    """`steps` decode batches, each taking ms[threads]; the thread counts picked."""
    picked = []
    for _ in range(steps):
        threads = chooser.pick()
        picked.append(threads)
        chooser.observe(threads, rows, ms[threads] / 1e3)
    return picked


def run_timed(chooser: ThreadChooser, clock: Clock, seconds: float, ms: dict[int, float]) -> list[tuple[float, int]]:
    """Decode batches of one session for `seconds` of `clock`, each advancing it by ms[threads]; (time, count)
    of each."""
    picked = []
    end = clock.now + seconds
    while clock.now < end:
        threads = chooser.pick()
        picked.append((clock.now, threads))
        chooser.observe(threads, 1, ms[threads] / 1e3)
        clock.now += ms[threads] / 1e3
    return picked


def halved_by_a_load(loaded: dict[int, float]) -> tuple[ThreadChooser, Clock]:
    """A stage of two threads, idle for a second, then under `loaded` step times until it moved to one."""
    clock = Clock()
    chooser = ThreadChooser(2, clock=clock, cores=2)
    run_timed(chooser, clock, 1.0, {2: 13.0, 1: 22.0})
    while chooser.current == 2:
        run_timed(chooser, clock, loaded[chooser.pick()] / 1e3, loaded)  # one step
    return chooser, clock


def test_a_steady_stage_keeps_its_threads_and_tries_one_only_once_per_fewer_recheck_s():
    clock = Clock()
    chooser = ThreadChooser(2, clock=clock)
    picked = [n for _, n in run_timed(chooser, clock, 2.5 * FEWER_RECHECK_S, {2: 13.0, 1: 22.0})]
    assert picked[WINDOW] == 1  # once it has a baseline; the trial's step is slower than two threads': lost
    # then once per FEWER_RECHECK_S, each lost at its first step
    assert picked.count(1) == 3 and chooser.trials == 3 and chooser.current == 2


def test_a_stage_started_on_a_busy_host_moves_to_one_thread_at_once():
    chooser = ThreadChooser(2)
    picked = run(chooser, 40, {2: 120.0, 1: 30.0})
    assert chooser.current == 1 and set(picked[WINDOW:]) == {1}


def test_under_load_it_moves_to_one_thread_and_back_when_the_load_goes():
    clock = Clock()
    chooser = ThreadChooser(2, clock=clock)
    run(chooser, 20, {2: 13.0, 1: 22.0})
    picked = run(chooser, 40, {2: 120.0, 1: 30.0})  # two busy programs on the cores
    assert picked[-1] == 1 and chooser.current == 1 and chooser.switches == 1
    assert picked.count(1) >= 40 - WINDOW - JUDGE_EVERY  # it tried after a window of slow steps, kept one thread
    assert set(run(chooser, 50, {2: 13.0, 1: 22.0})) == {1}  # rechecks wait for RECHECK_S ...
    clock.now += RECHECK_S
    picked = run(chooser, 20, {2: 13.0, 1: 22.0})
    first = picked.index(2)  # the next look at the median after RECHECK_S starts the trial
    assert first <= JUDGE_EVERY and set(picked[first:]) == {2}
    assert chooser.current == 2 and chooser.switches == 2


def test_while_the_load_stays_it_stays_on_one_thread_and_rechecks_rarely():
    clock = Clock()
    chooser = ThreadChooser(2, clock=clock)
    run(chooser, 20, {2: 13.0, 1: 22.0})
    run(chooser, 40, {2: 120.0, 1: 30.0})
    for _ in range(5):
        clock.now += RECHECK_S
        picked = run(chooser, 40, {2: 120.0, 1: 30.0})
        assert picked.count(2) == 1  # one trial per RECHECK_S, lost at its first step (ABORT)
    assert chooser.current == 1 and chooser.switches == 1


def test_after_a_short_spell_of_load_it_is_back_on_all_threads_within_a_fraction_of_a_second():
    """Another guest of a shared VM takes a core for a while: the stage halves, and once the spell is over it
    is back on two threads after RECHECK_MIN_S and the window of steps it takes to judge, not after RECHECK_S."""
    idle = {2: 13.0, 1: 22.0}
    chooser, clock = halved_by_a_load({2: 120.0, 1: 30.0})  # the spell lasts until the stage has halved
    switched = clock.now
    picked = run_timed(chooser, clock, RECHECK_S, idle)
    back = next(t for t, threads in picked if threads == 2)
    assert back - switched < RECHECK_MIN_S + (WINDOW + JUDGE_EVERY) * idle[1] / 1e3 < RECHECK_S / 2
    assert chooser.current == 2 and chooser.switches == 2


def test_while_a_load_stays_the_tries_of_more_threads_thin_out_to_one_per_recheck_s():
    loaded = {2: 120.0, 1: 30.0}
    chooser, clock = halved_by_a_load(loaded)
    tries = [t for t, threads in run_timed(chooser, clock, 6 * RECHECK_S, loaded) if threads == 2]
    gaps = [round(b - a, 2) for a, b in zip(tries, tries[1:])]
    assert 4 <= len(tries) <= 9, tries  # 0.25, 0.5, 1, 2, 2, ... s apart (each lost at its first step)
    assert gaps == sorted(gaps) and gaps[-1] >= RECHECK_S and gaps[0] < RECHECK_S / 2, gaps
    assert chooser.current == 1


def test_after_a_pause_the_next_compute_is_on_all_threads():
    """The load went while no session decoded: the next prompt's prefill is computed with two threads, and
    the decode steps after it keep them."""
    chooser, clock = halved_by_a_load({2: 120.0, 1: 30.0})
    clock.now += RECHECK_S / 2
    assert chooser.pick() == 1  # a short pause: decode steps decide, as before
    run_timed(chooser, clock, 0.1, {2: 120.0, 1: 30.0})
    clock.now += RECHECK_S
    assert chooser.pick() == 2 and chooser.pick() == 2  # the prefill's chunks
    run_timed(chooser, clock, 0.5, {2: 13.0, 1: 22.0})
    assert chooser.current == 2 and chooser.switches == 2


def test_after_a_pause_under_a_load_that_stays_the_try_of_all_threads_costs_one_step():
    loaded = {2: 120.0, 1: 30.0}
    chooser, clock = halved_by_a_load(loaded)
    run_timed(chooser, clock, 0.1, loaded)
    clock.now += RECHECK_S
    picked = [n for _, n in run_timed(chooser, clock, 0.5, loaded)]
    assert picked[0] == 2 and set(picked[1:]) == {1} and chooser.current == 1
    # more threads than the cores: not tried after a pause, only by the decode steps now and then
    chooser = ThreadChooser(8, cores=2, clock=clock)
    clock.now += 2 * RECHECK_S
    assert chooser.pick() == 2


def test_fewer_threads_must_undo_the_slowdown_that_started_their_trial():
    """One thread a little faster than two slowed down (a noisy spell of a shared VM, or steps too small to
    share well): a switch would cost more in the steps it takes to come back than it gains while the spell
    lasts, so two are kept. Under a real load one thread is 2-3x faster, and wins."""
    chooser = ThreadChooser(2)
    run(chooser, 20, {2: 13.0, 1: 22.0})
    run(chooser, 40, {2: 21.0, 1: 15.0})  # 1.6x slower; one thread 0.71x of it, not 1 / SLOWER
    assert chooser.current == 2 and chooser.trials == 2
    run(chooser, 40, {2: 60.0, 1: 30.0})
    assert chooser.current == 1 and chooser.switches == 1


def test_a_load_that_begins_within_the_window_is_judged_on_the_steps_under_it():
    """Two threads 3x slower, one 1.6x faster than them: it moves to one thread, wherever the load begins
    within the window. (A trial judged against the whole window, half of it from before the load, once lost
    there and took the mixed median for the baseline, which the load's steps never exceeded 1.5 times.)"""
    for before in range(WINDOW + 1, WINDOW + 1 + JUDGE_EVERY):  # each place of the load's start between looks
        chooser = ThreadChooser(2)
        run(chooser, before, {2: 15.0, 1: 25.0})
        picked = run(chooser, 60, {2: 45.0, 1: 28.0})
        assert chooser.current == 1 and chooser.switches == 1 and set(picked[-40:]) == {1}, before


def test_a_load_that_makes_every_step_many_times_slower_is_met_after_alarm_steps():
    """Two busy programs on two cores: a step of two threads takes ~20 times as long. The trial of one thread
    starts after ALARM_STEPS such steps, not after a window of them, and is judged against them."""
    chooser = ThreadChooser(2)
    run(chooser, 20, {2: 13.0, 1: 22.0})
    picked = run(chooser, 20, {2: 260.0, 1: 30.0})
    assert picked[:ALARM_STEPS] == [2] * ALARM_STEPS and set(picked[ALARM_STEPS:]) == {1}
    assert chooser.current == 1 and chooser.switches == 1


def test_a_lone_slow_step_starts_no_trial():
    """A VM's hiccup: one step in five ten times as long. Only the trial after the first baseline is made."""
    chooser = ThreadChooser(2)
    picked = run(chooser, 20, {2: 13.0, 1: 22.0})
    for _ in range(40):
        picked += run(chooser, 4, {2: 13.0, 1: 22.0}) + run(chooser, 1, {2: 130.0, 1: 22.0})
    assert chooser.trials == 1 and picked.count(1) == 1 and chooser.current == 2


def test_a_many_times_slower_step_that_one_thread_does_not_help_costs_one_step():
    """An alarm's trial of one thread that is slower still ends at its first step, and the slow steps become
    the baseline: no alarm again while they last."""
    chooser = ThreadChooser(2)
    run(chooser, 20, {2: 13.0, 1: 22.0})
    picked = run(chooser, 100, {2: 50.0, 1: 90.0})
    assert picked.count(1) == 1 and chooser.trials == 2 and chooser.current == 2


def test_a_slowdown_that_one_thread_does_not_help_is_the_new_baseline():
    """A longer context slows every step: one trial, then no more until it slows as much again."""
    chooser = ThreadChooser(2)
    run(chooser, 20, {2: 13.0, 1: 22.0})
    picked = run(chooser, 200, {2: 21.0, 1: 36.0})
    assert picked.count(1) == 1 and chooser.current == 2 and chooser.trials == 2  # lost at its first step
    run(chooser, 100, {2: 33.0, 1: 55.0})
    assert chooser.trials == 3 and chooser.current == 2


def test_a_stage_that_started_under_load_judges_a_later_load_from_its_idle_speed():
    """Its first baseline was measured under load and its first trial lost (noise: one thread no faster then);
    once the load went, the faster steps are the baseline, so when the load comes back it halves."""
    chooser = ThreadChooser(2)
    run(chooser, 20, {2: 60.0, 1: 55.0})  # busy at the start; the trial of one thread is lost
    assert chooser.current == 2 and chooser.trials == 1
    run(chooser, 40, {2: 13.0, 1: 22.0})  # the load is gone
    assert chooser.current == 2 and chooser.trials == 1
    run(chooser, 40, {2: 60.0, 1: 30.0})  # back: not 1.5x the first baseline, 4.6x the idle one
    assert chooser.current == 1 and chooser.switches == 1


def test_idle_time_does_not_count_towards_the_next_trial_of_fewer_threads():
    clock = Clock()
    chooser = ThreadChooser(2, clock=clock)
    run_timed(chooser, clock, FEWER_RECHECK_S / 2, {2: 13.0, 1: 22.0})
    clock.now += 10 * FEWER_RECHECK_S  # no decode steps meanwhile
    run_timed(chooser, clock, FEWER_RECHECK_S / 3, {2: 13.0, 1: 22.0})
    assert chooser.trials == 1  # the first baseline's only
    run_timed(chooser, clock, FEWER_RECHECK_S / 3, {2: 13.0, 1: 22.0})
    assert chooser.trials == 2


def test_a_stage_whose_first_trial_was_lost_under_a_load_from_its_start_halves_within_fewer_recheck_s():
    """Busy from the start, and one thread no faster in its first trial (noise): the load's steps are the
    baseline, and as long as the load lasts they are never SLOWER times it; the next trial of one thread comes
    FEWER_RECHECK_S later, and wins once one thread is faster."""
    clock = Clock()
    chooser = ThreadChooser(2, clock=clock)
    run_timed(chooser, clock, 1.0, {2: 60.0, 1: 55.0})
    assert chooser.current == 2 and chooser.trials == 1
    picked = run_timed(chooser, clock, FEWER_RECHECK_S + 1.0, {2: 60.0, 1: 30.0})
    assert chooser.current == 1 and chooser.switches == 1
    assert all(n == 2 for at, n in picked if at < FEWER_RECHECK_S - 0.5)


def test_batch_sizes_are_judged_apart():
    """A batch of 4 sessions takes longer than one session's step: no slowdown, no trial."""
    chooser = ThreadChooser(2)
    for _ in range(30):
        run(chooser, 3, {2: 13.0, 1: 22.0}, rows=1)
        run(chooser, 3, {2: 24.0, 1: 40.0}, rows=4)
    assert chooser.trials == 1 and chooser.current == 2  # the first baseline's


def test_one_configured_thread_or_adapt_off_never_changes():
    for chooser in (ThreadChooser(1), ThreadChooser(2, enabled=False)):
        run(chooser, 20, {1: 13.0, 2: 13.0})
        assert set(run(chooser, 50, {1: 200.0, 2: 200.0})) == {chooser.configured}
        assert chooser.trials == 0


def test_with_eight_threads_it_steps_down_to_the_fastest_count_and_back_up():
    clock = Clock()
    chooser = ThreadChooser(8, clock=clock)
    idle = {8: 10.0, 4: 14.0, 2: 22.0, 1: 40.0}
    run(chooser, 40, idle)
    assert chooser.current == 8
    run(chooser, 80, {8: 200.0, 4: 60.0, 2: 35.0, 1: 50.0})  # busy programs on some of the cores
    assert chooser.current == 2 and chooser.switches == 2  # 8 -> 4 -> 2; 1 was tried, and slower
    for want in (4, 8):  # the load gone: twice as many every RECHECK_S
        clock.now += RECHECK_S
        run(chooser, 20, idle)
        assert chooser.current == want
    assert set(run(chooser, 100, idle)) == {8}


def test_more_threads_than_cores_start_on_the_cores_and_try_the_configured_count_now_and_then():
    clock = Clock()
    chooser = ThreadChooser(8, cores=2, clock=clock)
    assert chooser.pick() == 2 and chooser.describe()["now"] == 2 and chooser.describe()["configured"] == 8
    over = {8: 36.0, 4: 31.0, 2: 15.0, 1: 25.0}  # 8 threads on 2 cores: each barrier waits for a core
    assert set(run(chooser, 100, over)) <= {2, 4}  # 4 is tried once (lost at once: ABORT), 8 never yet
    assert chooser.current == 2 and chooser.trials == 1
    for _ in range(3):
        clock.now += RECHECK_S
        run(chooser, 40, over)
    assert chooser.current == 2 and chooser.trials == 4 and chooser.switches == 0
    # a host where more threads do help after all (cores the count did not see): it climbs to them
    faster = {8: 8.0, 4: 11.0, 2: 15.0, 1: 25.0}
    for want in (4, 8):
        clock.now += RECHECK_S
        run(chooser, 20, faster)
        assert chooser.current == want
    # cores not known, or adapting off: the configured count
    assert ThreadChooser(8).pick() == 8 and ThreadChooser(8, cores=2, enabled=False).pick() == 8


def test_the_scheduler_sets_prefill_threads_with_decode_ones(monkeypatch):
    """A reduced count applies to prefill (the batch count) too, also where a batch count is configured;
    back on the configured count, the configured batch count returns."""
    from types import SimpleNamespace

    from skippyd.runtime.llama import ContextParams
    from skippyd.stage import scheduler as scheduler_module
    from skippyd.stage.scheduler import Scheduler

    calls = []
    ctx = SimpleNamespace(n_batch=512, params=ContextParams(n_threads=4, n_threads_batch=6), token_input=True,
                          set_threads=lambda n, nb: calls.append((n, nb)))
    monkeypatch.setattr(scheduler_module, "usable_cores", lambda: 8)  # 4 threads fit: the scheduler starts on them
    scheduler = Scheduler(ctx)
    scheduler.threads._trial = 2  # a trial of half as many (the chooser's decisions are tested above)
    assert scheduler.execution.use_threads() == 2
    scheduler.threads._trial = None
    assert scheduler.execution.use_threads() == 4
    assert calls == [(2, 2), (4, 6)]


def test_usable_cores_follow_the_cgroup_cpu_quota(tmp_path):
    """A container given 2 CPUs of a bigger host computes with 2 threads by default, not the host's count:
    cgroup v2 (cpu.max, the smallest limit from the process's group up), v1 (cfs quota / period), none."""
    import os

    from skippyd.stage.threads import cgroup_cpu_quota, usable_cores

    affinity = len(os.sched_getaffinity(0))
    proc = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    (v2 / "box" / "inner").mkdir(parents=True)
    (v2 / "cpu.max").write_text("max 100000\n")
    (v2 / "box" / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs for the container ...
    (v2 / "box" / "inner" / "cpu.max").write_text("max 100000\n")  # ... and no limit of its own below it
    proc.write_text("0::/box/inner\n")
    assert cgroup_cpu_quota(str(proc), str(v2)) == 1.5
    assert usable_cores(str(proc), str(v2)) == min(affinity, 2)
    (v2 / "box" / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one thread
    assert usable_cores(str(proc), str(v2)) == 1

    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "docker" / "abc").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us").write_text("100000\n")
    proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_cpu_quota(str(proc), str(v1)) == 1.0 and usable_cores(str(proc), str(v1)) == 1
    (v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert cgroup_cpu_quota(str(proc), str(v1)) is None and usable_cores(str(proc), str(v1)) == affinity

    assert usable_cores(str(tmp_path / "no such file"), str(v2)) == affinity  # no cgroup: the affinity
    proc.write_text("garbage\n4:cpuacct,cpu:/docker/abc\n")  # a line without fields; v1 mounted as "cpu"
    (v1 / "cpu,cpuacct").rename(v1 / "cpu")
    (v1 / "cpu" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("200000\n")
    assert cgroup_cpu_quota(str(proc), str(v1)) == 2.0
