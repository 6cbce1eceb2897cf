"""Resume after a stage restart (`--resume`), against real skippyd processes.

A stage is killed (SIGKILL) in the middle of a streamed generation (greedy,
or seeded sampling) and started again; the generation pauses, is replayed on the restored
pipeline from the head's record (prompt + tokens so far) and completes with
exactly the tokens of an uninterrupted run, and the stream repeats nothing.
A stage that does not come back within the window fails the generation
with the usual retryable error.
"""

from __future__ import annotations

import signal
import time

import attrs
import pytest
import trio

from skippyctl.client import ControlError, open_control
from skippyd.control import messages as m
from tests.procs import Pipeline, retarget
from tests.test_faults import COUNT, LONG, wait_prefilling

pytestmark = pytest.mark.slow  # real daemon processes killed and restarted

# compute_lock off: a stage stopped (SIGSTOP) while it holds the host-wide compute lock would make every
# other skippy process of this user on the host (other test runs) compute without the lock for a while
FLAGS = ["--lanes", "2", "--ctx", "512"]
CONFIG = {"runtime.prefill_chunk": 32, "runtime.compute_lock": "off"}
DECODE = dict(prompt=COUNT, raw=True, max_tokens=96)
# seeded sampling: the final stage's sampler is new after the replay, and the replayed steps draw from it
# exactly as the first time (same logits, same seed), so the continuation is the uninterrupted run's too
SEEDED = dict(DECODE, prompt="Once upon a time", temperature=0.9, top_k=40, top_p=0.95, seed=1234)
PREFILL = dict(prompt=LONG + COUNT, raw=True, max_tokens=24)  # ~200 prompt tokens: 7 chunks of 32


async def start(topology, tmp_path, *flags, config: dict | None = None) -> Pipeline:
    pipe = Pipeline(retarget(topology, tmp_path), tmp_path, extra=[*FLAGS, *flags],
                    config={**CONFIG, **(config or {})})
    await trio.to_thread.run_sync(pipe.start)
    return pipe


@attrs.define(eq=False)
class Streamed:
    pieces: list[str] = attrs.field(factory=list)
    times: list[float] = attrs.field(factory=list)  # when each piece arrived (monotonic)
    result: dict | None = None
    error: ControlError | None = None
    done: trio.Event = attrs.field(factory=trio.Event)


async def stream(pipe: Pipeline, nursery: trio.Nursery, **kw) -> Streamed:
    s = Streamed()

    async def run() -> None:
        try:
            async with open_control(pipe.head.url, pipe.head.token_file) as client:
                async for reply in client.replies(m.Generate(id=client.new_id(), **kw)):
                    if isinstance(reply, m.Piece):
                        s.pieces.append(reply.text)
                        s.times.append(time.monotonic())
                    elif isinstance(reply, m.Error):
                        s.error = ControlError(reply.message, code=reply.code)
                    else:
                        s.result = reply.result
        except ControlError as exc:
            s.error = exc
        finally:
            s.done.set()

    nursery.start_soon(run)
    return s


async def wait_for(predicate, timeout: float = 30.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


async def head_sessions(pipe: Pipeline) -> list[dict]:
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        return await client.call(m.SessionsList(id=client.new_id()))


async def kill_and_restart(pipe: Pipeline, victim: int, *, down_for: float = 0.5) -> float:
    """SIGKILL the victim, wait `down_for`, start it again; seconds it was gone."""
    d = pipe.stages[victim]
    killed = time.monotonic()
    d.proc.send_signal(signal.SIGKILL)
    await trio.to_thread.run_sync(d.proc.wait)
    await trio.sleep(down_for)
    await pipe.astart_stage(victim)
    return time.monotonic() - killed


async def check_resumed(pipe: Pipeline, victim: int, kw: dict, *, when: str) -> None:
    reference = await pipe.generate(**kw)
    if "seed" in kw:  # the sampling is live: another seed gives other tokens
        assert (await pipe.generate(**dict(kw, seed=kw["seed"] + 1)))["tokens"] != reference["tokens"]
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            s = await stream(pipe, nursery, **kw)
            if when == "decode":
                await wait_for(lambda: len(s.pieces) >= 10 or s.done.is_set())
            else:  # mid-prefill: the victim holds part of the prompt, nothing is emitted yet
                await wait_prefilling(pipe, victim, at_least=64)
            assert not s.done.is_set(), s.result or s.error
            emitted_before = len(s.pieces)
            killed = time.monotonic()
            gone = await kill_and_restart(pipe, victim)
            await s.done.wait()
    assert s.error is None, f"the generation failed instead of resuming: {s.error}"
    got = s.result
    assert got["tokens"] == reference["tokens"], "the replayed generation differs from an uninterrupted run"
    assert got["text"] == reference["text"]
    assert "".join(s.pieces) == got["text"], "the stream repeated or lost text across the replay"
    if when == "decode":
        assert emitted_before >= 10
    assert "resuming (replay 1:" in pipe.head.log(), "the generation was not interrupted: the test proves nothing"
    pause = s.times[emitted_before] - killed
    print(f"\n{len(pipe.stages)}-stage kill -9 stage {victim} mid-{when}: stage gone {gone:.2f} s, "
          f"stream paused {pause:.2f} s, {len(got['tokens'])} tokens as uninterrupted")
    assert await head_sessions(pipe) == []
    await pipe.wait_all_released()


@pytest.mark.parametrize("n_stages, victim, when, kw", [
    (2, 1, "decode", DECODE),
    (3, 2, "decode", DECODE),  # the final stage of three: direct token return, the prediction is lost there
    (2, 1, "prefill", PREFILL),
    (3, 2, "decode", SEEDED),  # the sampler is on the killed stage
], ids=["2stage-kill1-mid-decode", "3stage-kill2-mid-decode", "2stage-kill1-mid-prefill",
        "3stage-kill2-mid-decode-seeded"])
async def test_killed_stage_restarted_resumes_with_the_same_tokens(splits, tmp_path, n_stages, victim, when, kw):
    pipe = await start(splits[n_stages], tmp_path, "--resume", config={"runtime.resume_window": 30})
    try:
        await check_resumed(pipe, victim, kw, when=when)
    finally:
        await trio.to_thread.run_sync(pipe.stop)


async def test_a_stage_not_back_within_the_window_fails_the_generation(splits, tmp_path):
    pipe = await start(splits[2], tmp_path, "--resume", config={"runtime.resume_window": 2})
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                s = await stream(pipe, nursery, **DECODE)
                await wait_for(lambda: len(s.pieces) >= 3 or s.done.is_set())
                d = pipe.stages[1]
                killed = time.monotonic()
                d.proc.send_signal(signal.SIGKILL)
                await trio.to_thread.run_sync(d.proc.wait)
                assert (await head_sessions(pipe))[0]["state"] in ("decode", "resuming")
                await s.done.wait()
                took = time.monotonic() - killed
        assert s.error is not None and s.error.code == "unavailable", s.error
        assert str(s.error).startswith("pipeline failed: ") and "resume window" in str(s.error), str(s.error)
        assert 1.5 < took < 4.0, took
        await pipe.astart_stage(1)
        assert (await pipe.generate(**DECODE))["finish_reason"] == "length"
        await pipe.wait_all_released()
    finally:
        await trio.to_thread.run_sync(pipe.stop)


@pytest.mark.parametrize("n_stages, victim, named", [
    (2, 1, ""),
    # the final stage of three (direct return): stage 1 names it within the ping deadline
    (3, 2, "stage 2 failed: "),
], ids=["2stage-stage1", "3stage-final-stage"])
async def test_hung_stage_resumes_after_sigcont_with_the_same_tokens(splits, tmp_path, n_stages, victim, named):
    """SIGSTOP a stage for 3 s: the liveness ping fails the step (1.5 s), the head waits for the pipeline to
    answer again, replays, and the generation ends as an uninterrupted one would."""
    pipe = await start(splits[n_stages], tmp_path, "--resume", config={"runtime.resume_window": 30})
    try:
        reference = await pipe.generate(**DECODE)
        d = pipe.stages[victim]
        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                s = await stream(pipe, nursery, **DECODE)
                await wait_for(lambda: len(s.pieces) >= 10 or s.done.is_set())
                try:
                    d.signal(signal.SIGSTOP)
                    await trio.sleep(3)
                    assert (await head_sessions(pipe))[0]["state"] == "resuming"
                finally:
                    d.signal(signal.SIGCONT)
                await s.done.wait()
        assert s.error is None, f"the generation failed instead of resuming: {s.error}"
        assert s.result["tokens"] == reference["tokens"]
        assert "".join(s.pieces) == s.result["text"] == reference["text"]
        assert "resuming (replay 1:" in pipe.head.log() and named in pipe.head.log()
        await pipe.wait_all_released()
    finally:
        await trio.to_thread.run_sync(pipe.stop)
