"""The compute path's own accounting and the host compute lock, on real processes.

Performance itself is measured by bench/bench_pipeline.py, never asserted
here; these tests check that the counters the benchmark reads count the
right things and that the lock excludes what it must.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from skippyd.stage.scheduler import HostComputeLock
from tests.procs import Pipeline, split_for_test

PROMPT = "Write a long story about a dragon who learns to sail."


def test_host_lock_excludes_other_handles_and_processes(tmp_path):
    path = tmp_path / "compute.lock"
    a, b = HostComputeLock(path), HostComputeLock(path)
    try:
        assert a.try_acquire()
        assert not b.try_acquire()  # another open file description: a second stage in this process
        probe = ("import sys; from skippyd.stage.scheduler import HostComputeLock; "
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
    assert all(code == 0 for code in pipe.stop().values())


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


async def test_stages_sharing_a_host_use_every_core_and_take_turns(two):
    import os

    for snap in await _snapshots(two):
        assert snap["compute"] == {"threads": os.cpu_count(), "thread_poll": 0, "compute_lock": os.cpu_count() > 1}
