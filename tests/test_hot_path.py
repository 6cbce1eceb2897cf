"""The compute path's own accounting and the host compute lock, on real processes.

Performance itself is measured by bench/bench_pipeline.py, never asserted
here; these tests check that the counters the benchmark reads count the
right things and that the lock excludes what it must.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from skippyd.head.chunking import MARGIN
from skippyd.stage.host_lock import HostComputeLock
from skippyd.stage.threads import usable_cores
from tests.procs import Pipeline, split_for_test

pytestmark = pytest.mark.slow  # real daemon processes

PROMPT = "Write a long story about a dragon who learns to sail."
CORES = usable_cores()  # what the daemon computes with by default (affinity, cgroup quota)


def test_host_lock_excludes_other_handles_and_processes(tmp_path):
    path = tmp_path / "compute.lock"
    a, b = HostComputeLock(path), HostComputeLock(path)
    try:
        assert a.try_acquire()
        assert not b.try_acquire()  # another open file description: a second stage in this process
        probe = ("import sys; from skippyd.stage.host_lock import HostComputeLock; "
                 "sys.exit(0 if HostComputeLock(sys.argv[1]).try_acquire() else 3)")
        assert subprocess.run([sys.executable, "-c", probe, str(path)]).returncode == 3
        a.release()
        assert b.try_acquire()
        b.release()
        assert subprocess.run([sys.executable, "-c", probe, str(path)]).returncode == 0
    finally:
        a.close()
        b.close()


@pytest.fixture(scope="module")
def two(default_model_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("hotpath")
    split_for_test(default_model_path, 2, work)
    pipe = Pipeline(work / "topology.toml", work, extra=["--lanes", "2", "--ctx", "512"]).start()
    yield pipe
    pipe.stop_cleanly()


async def _snapshots(pipe: Pipeline) -> list[dict]:
    head = await pipe.stages[0].astatus()
    stage1 = await pipe.stages[1].astatus()
    return [head["head"], stage1["stages"][0]]


async def test_every_stage_counts_its_decode_steps_and_python_time(two):
    before = await _snapshots(two)
    result = await two.generate(prompt=PROMPT, raw=True, max_tokens=33)
    after = await _snapshots(two)
    steps = len(result["tokens"]) - 1  # the first token comes from the prefill
    assert steps >= 8, result
    for b, a in zip(before, after):
        hb, ha = b["hot_path"], a["hot_path"]
        assert ha["decode_steps"] - hb["decode_steps"] == steps
        native = ha["native_s"] - hb["native_s"]
        python = (ha["wall_s"] - hb["wall_s"]) - native
        assert native > 0 and python > 0
        assert native < result["timings"]["elapsed_ms"] / 1e3  # a share of the generation, not more
        # the event loop thread's own CPU: lone decode steps compute inline, on that thread, so part of it is
        # llama.cpp's; what is left is the loop's Python, trio and kernel time, at least the steps' handling
        loop = ha["loop_cpu_s"] - hb["loop_cpu_s"]
        loop_native = ha["loop_native_cpu_s"] - hb["loop_native_cpu_s"]
        assert 0 < loop_native < loop
        assert loop - loop_native >= 0.9 * (ha["cpu_s"] - hb["cpu_s"]) > 0
    # the head's window holds its waits for stage 1's replies (the wake-up, reading each reply): part of its
    # CPU time, kept apart; a later stage's window starts with the message in hand and holds none
    head_waits = after[0]["hot_path"]["wait_cpu_s"] - before[0]["hot_path"]["wait_cpu_s"]
    assert 0 < head_waits < after[0]["hot_path"]["cpu_s"] - before[0]["hot_path"]["cpu_s"]
    assert after[1]["hot_path"]["wait_cpu_s"] == 0


async def test_stages_sharing_a_host_use_every_core_and_take_turns(two):
    # one host (loopback): one group of decoding sessions, the stages take turns at the cores
    for snap in await _snapshots(two):
        assert snap["compute"] == {"threads": CORES, "thread_poll": 0, "compute_lock": CORES > 1,
                                   "adapt_threads": True, "flash_attn": "off", "decode_groups": 1,
                                   "keep_warm_ms": 0.0, "keep_warm_spun_s": 0.0}
        assert snap["threads"]["configured"] == CORES and snap["threads"]["adaptive"] == (CORES > 1)


def _idle_class_threads(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [int(t.name) for t in tasks.iterdir() if os.sched_getscheduler(int(t.name)) == os.SCHED_IDLE]


@pytest.fixture
def two_kept_warm(default_model_path, tmp_path):
    split_for_test(default_model_path, 2, tmp_path)
    pipe = Pipeline(tmp_path / "topology.toml", tmp_path,
                    extra=["--lanes", "1", "--ctx", "512"], config={"runtime.keep_warm_ms": 30}).start()
    yield pipe
    pipe.stop_cleanly()


async def test_keep_warm_gives_every_stage_one_idle_class_spinner(two_kept_warm, two):
    """runtime.keep_warm_ms: the head and stage 1 each run one SCHED_IDLE thread, which spins after their computes
    (status: compute.keep_warm_spun_s), and the answer is the one without it (the module's pipeline)."""
    pipe = two_kept_warm
    for daemon in pipe.stages.values():
        assert len(_idle_class_threads(daemon.proc.pid)) == 1
        # both on this host: told that their spinners slow each other down (it is for hosts of their own)
        assert "runtime.keep_warm_ms with 2 stages of the topology on this host" in daemon.log()
    result = await pipe.generate(prompt=PROMPT, raw=True, max_tokens=16)
    await trio.sleep(0.2)  # a spin is counted when it ends: the last one, 30 ms after the last compute
    for snap in await _snapshots(pipe):
        assert snap["compute"]["keep_warm_ms"] == 30
        # how long an idle-class thread gets a core depends on what else the host runs: that it spun at all
        assert snap["compute"]["keep_warm_spun_s"] > 0
    assert result["tokens"] == (await two.generate(prompt=PROMPT, raw=True, max_tokens=16))["tokens"]


@pytest.fixture
def two_threads(default_model_path, tmp_path):
    from tests.procs import SingleStage

    pipe = SingleStage(default_model_path, tmp_path, ["--threads", "2", "--lanes", "1", "--ctx", "512"])
    yield pipe
    pipe.stop_cleanly()


def _confine(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` on `cores` only (threads it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task.name), cores)


async def test_a_stage_times_its_steps_for_its_thread_chooser_and_its_tokens_do_not_depend_on_the_count(
        two_threads):
    """The real stage gives its chooser the native time of every decode step: as soon as it has a baseline it
    tries one thread (status: trials), and the tokens are those of the configured count. Its threads confined
    to one core, as when other programs hold the rest, it generates the same tokens on whichever count it
    then chooses, and again once it has both cores back.

    Whether one thread beats two on a shared core depends on the host's scheduler and on what else runs:
    when the chooser switches is tested on given step times (test_threads.py) and measured under real load
    by bench/under_load.py, not asserted here."""
    pipe = two_threads
    pid = pipe.stages[0].proc.pid
    cores = os.sched_getaffinity(pid)
    if len(cores) < 2:
        pytest.skip("a host of one core: no core to take from the stage")

    async def threads() -> dict:
        return (await pipe.stages[0].astatus())["head"]["threads"]

    want = await pipe.generate(prompt=PROMPT, raw=True, max_tokens=48)
    before = await threads()
    assert before["configured"] == 2 and before["adaptive"] and before["trials"] >= 1, before
    _confine(pid, {min(cores)})
    try:
        confined = await pipe.generate(prompt=PROMPT, raw=True, max_tokens=48)
        during = await threads()
    finally:
        _confine(pid, cores)
    assert confined["tokens"] == want["tokens"]
    assert during["now"] in (1, 2) and during["trials"] >= before["trials"], during
    again = await pipe.generate(prompt=PROMPT, raw=True, max_tokens=48)
    assert again["tokens"] == want["tokens"]


@pytest.fixture
def twice_the_cores(default_model_path, tmp_path):
    from tests.procs import SingleStage

    pipe = SingleStage(default_model_path, tmp_path, ["--threads", str(2 * CORES), "--lanes", "1", "--ctx", "512"])
    yield pipe
    pipe.stop_cleanly()


async def test_more_threads_than_cores_are_warned_of_and_computed_with_as_many_as_cores(twice_the_cores):
    """Twice as many threads as cores: the daemon says so at startup, and the stage computes with as many
    threads as cores (it tries the configured count now and then, and keeps it only if it is faster)."""
    pipe, cores = twice_the_cores, CORES
    assert f"--threads {2 * cores} is more than the {cores} cores this daemon may use" in pipe.stages[0].log()
    assert (await pipe.stages[0].astatus())["head"]["threads"]["now"] == cores
    first = await pipe.generate(prompt=PROMPT, raw=True, max_tokens=48)
    threads = (await pipe.stages[0].astatus())["head"]["threads"]
    # it tried the configured count and kept the cores; a busy host may take it lower still (a halving that
    # wins), never above the cores
    assert threads["configured"] == 2 * cores and threads["now"] <= cores and threads["trials"] >= 1, threads
    assert (await pipe.generate(prompt=PROMPT, raw=True, max_tokens=48))["tokens"] == first["tokens"]


def test_chunk_grows_to_cover_the_link_round_trip_and_no_further():
    from skippyd.head.chunking import PrefillChunker

    c = PrefillChunker(64, 512, credit=2)
    assert c.size == 64  # nothing measured yet: the configured chunk
    c.observe_prefill(256, 256 * 100)  # 100 us per token
    c.observe_round_trip(wait_us=1_000, downstream_compute_us=800)  # a fast link: 200 us
    assert c.size == 64
    for _ in range(30):  # a 20 ms link: 2 chunks must cover 20 ms of round trip at 100 us per token
        c.observe_round_trip(wait_us=25_000, downstream_compute_us=5_000)
    assert c.size == int(1.25 * c.round_trip_us / (2 * 100))
    assert 120 <= c.size <= 130
    for _ in range(30):  # a 200 ms link: capped at the batch size
        c.observe_round_trip(wait_us=205_000, downstream_compute_us=5_000)
    assert c.size == 512


async def test_a_delayed_link_makes_the_head_measure_it_and_grow_its_chunk(default_model_path, tmp_path):
    import trio

    split_for_test(default_model_path, 2, tmp_path)
    pipe = Pipeline(tmp_path / "topology.toml", tmp_path,
                    extra=["--lanes", "1", "--ctx", "512"],
                    config={"runtime.prefill_chunk": 1, "stage.link_delay_ms": 50})
    await trio.to_thread.run_sync(pipe.start)
    try:
        await pipe.generate(prompt=PROMPT, raw=True, max_tokens=8)
        prefill = (await pipe.stages[0].astatus())["head"]["prefill"]
        assert 95_000 <= prefill["round_trip_us"] <= 150_000, prefill  # 50 ms each way, plus a little
        assert prefill["us_per_token"] > 0
        # the chunk covers the measured round trip at the measured compute per token: one-token chunks cannot
        # keep the head busy over a 100 ms round trip, unless one token takes ~30 ms to compute (a host
        # crawling at 20x its speed: the chunk rightly stays at 1 there)
        covering = MARGIN * prefill["round_trip_us"] / (prefill["credit"] * prefill["us_per_token"])
        assert prefill["prefill_chunk"] == pytest.approx(min(prefill["ceiling"], max(1, covering)), abs=1), prefill
        assert prefill["prefill_chunk"] > prefill["floor"] == 1 or prefill["us_per_token"] > 20_000, prefill
    finally:
        await trio.to_thread.run_sync(pipe.stop)


HOLDER = """
import fcntl, os, signal, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
if sys.argv[2] == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
else:
    time.sleep(float(sys.argv[2]))
"""


@contextlib.contextmanager
def lock_held_by_another_process(path, how: str):
    """A process that takes the lock at `path`, then stops itself ("stop") or holds it for `how` seconds."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), how], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def timed_acquire(lock: HostComputeLock) -> tuple[bool, float]:
    """`lock.acquire()` and how long it took."""
    started = time.monotonic()
    got = lock.acquire()
    return got, time.monotonic() - started


def test_a_stopped_holder_is_bypassed_at_once_and_left_alone_for_bypass_s(tmp_path):
    """A stage that stops while it holds the lock (SIGSTOP) must not stall the others: a waiter sees it is
    stopped (well before max_wait_s) and computes without the lock for bypass_s."""
    from skippyd.stage.host_lock import lock_holder, process_stopped

    path = tmp_path / "compute.lock"
    waiter = HostComputeLock(path, max_wait_s=30, bypass_s=60)
    try:
        with lock_held_by_another_process(path, "stop") as holder:
            while not process_stopped(holder.pid):
                time.sleep(0.01)
            assert lock_holder(waiter._fd) == holder.pid
            got, took = timed_acquire(waiter)
            assert got is False and took < 1.0
            got, took = timed_acquire(waiter)
            assert got is False and took < 0.05  # bypassed: no second wait
            assert waiter.timeouts == 1
    finally:
        waiter.close()


def test_a_running_holder_is_waited_for_beyond_max_wait_s_up_to_running_max_s(tmp_path):
    """One compute of a big model takes seconds: a holder that runs is waited for (computing beside it would
    slow both), and taken to be wedged only after running_max_s."""
    path = tmp_path / "compute.lock"
    waiter = HostComputeLock(path, max_wait_s=0.2, running_max_s=30)
    wedged = HostComputeLock(path, max_wait_s=0.2, running_max_s=0.6)
    try:
        with lock_held_by_another_process(path, "1.2"):
            got, took = timed_acquire(waiter)
            assert got is True and 0.8 <= took < 10
            waiter.release()
        assert waiter.timeouts == 0
        with lock_held_by_another_process(path, "30"):
            got, took = timed_acquire(wedged)
            assert got is False and 0.6 <= took < 5
        assert wedged.timeouts == 1
    finally:
        waiter.close()
        wedged.close()


def test_a_holder_that_cannot_be_looked_at_is_bypassed_after_max_wait_s(tmp_path, monkeypatch):
    """No /proc/locks entry to name the holder (another pid namespace): the bounded wait of old."""
    from skippyd.stage import host_lock

    monkeypatch.setattr(host_lock, "lock_holder", lambda fd: None)
    path = tmp_path / "compute.lock"
    waiter = HostComputeLock(path, max_wait_s=0.3, bypass_s=60)
    try:
        with lock_held_by_another_process(path, "30"):
            got, took = timed_acquire(waiter)
            assert got is False and 0.3 <= took < 2
    finally:
        waiter.close()


def test_a_free_lock_is_taken_at_once_and_a_busy_one_after_its_release(tmp_path):
    import threading

    path = tmp_path / "compute.lock"
    holder, waiter = HostComputeLock(path), HostComputeLock(path)
    try:
        assert holder.try_acquire()
        threading.Timer(0.2, holder.release).start()
        started = time.monotonic()
        assert waiter.acquire() is True
        assert 0.15 <= time.monotonic() - started < 0.5
        waiter.release()
    finally:
        holder.close()
        waiter.close()
