"""A short soak (bench/soak.py's `soak`): 28 generations with random lengths, cancellations and disconnects
over a 2-stage pipeline leave no session, no descriptor and no memory behind.

The stage after the head gets more sequence slots than the head has lanes, so
that slots never limit the run: the point here is what is left at the end
(`test_faults.py::test_slot_freed_by_a_kill_is_usable_at_once` covers equal
slot counts).

Memory: the head's RSS rises in one or two steps of 12-15 MiB at ctx 512
(then stays flat over 1000 generations: bench/soak.py), from glibc's
per-thread arenas and from the compute buffer's pages, touched once by the
largest attention graph. That is most of the 10 % bound on a 135M model's
~160 MiB, so this short run uses MALLOC_ARENA_MAX=2 and a 128-token context;
the soak's warm-up prefills every slot to the full context first.
"""

from __future__ import annotations

import pytest
import trio

from bench.soak import soak, start_pipeline

pytestmark = pytest.mark.slow  # a soak of a real pipeline

N = 28
CTX, LANES, CONCURRENCY = 128, 4, 6


@pytest.fixture
def pipe(default_model_path, tmp_path):
    p = start_pipeline(default_model_path, 2, tmp_path, ["--lanes", str(LANES), "--ctx", str(CTX)],
                       config={"runtime.prefill_chunk": 64}, stage_lanes=LANES + CONCURRENCY,
                       env={"MALLOC_ARENA_MAX": "2"})
    yield p
    p.stop_cleanly()


async def test_short_soak_leaves_nothing_behind(pipe):
    with trio.fail_after(150):
        report = await soak(pipe, N, ctx=CTX, lanes=LANES, concurrency=CONCURRENCY, seed=7, max_tokens=24,
                            cancel_rate=0.15, disconnect_rate=0.15, warmup=24)
    print(report.summary())
    assert report.generations == N
    assert report.outcomes["cancelled"] > 0 and report.outcomes["disconnected"] > 0, report.summary()
    assert report.violations == [], report.summary()
