"""Fault injection against real skippyd processes: how fast a fault is noticed, and what is left afterwards.

Each fault runs on a 2- or 3-stage pipeline of the default model (every
stage its own process, `--lanes 2 --ctx 256`, prefill_chunk 32 and
reply_timeout 2 in its configuration file): SIGKILL of each stage in turn
mid-prefill and mid-decode (the middle stage of three is the "link closed from the middle"), SIGSTOP of a
stage mid-decode then SIGCONT, a stage restarted from another split (the
handshake must refuse it), every lane busy with more requests waiting (and
waiting past the queue timeout, `--queue-timeout 2`), a new generation
started the moment a kill frees a slot, and generations that cannot fit in
the KV cache.

For each fault the test measures the time to detection (from the injection
to the client's error), then checks the state afterwards: every surviving
stage reports zero sessions and every slot free within 2 s, and once the
pipeline is whole again a new generation gives the same tokens as before the
fault. Every fault adds a row (fault, detection_s, outcome, state after) to
a report printed at the end of the module and written to
``<pytest base temp>/fault-report.json`` (or ``$SKIPPY_FAULT_REPORT``).

A fault that happens while a generation runs must be detected within 2 s.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import time
from pathlib import Path

import attrs
import pytest
import trio

from skippyctl.client import ControlError, open_control
from skippyd.control import messages as m
from skippyd.head.lane_client import ACKED_DECODE_STEPS
from tests.procs import Daemon, Pipeline, retarget, split_for_test

pytestmark = pytest.mark.slow  # real daemon processes killed and stopped

DETECT_S = 2.0  # a fault is detected within 2 s while a generation runs
RELEASE_S = 2.0  # every surviving stage frees its sessions within 2 s
REPLY_TIMEOUT_S = 2.0
CTX = 256
# mid-decode faults come once the decode steps go without stage 1's acks (DIRECT_RETURN, 3 stages)
MID_DECODE_PIECES = ACKED_DECODE_STEPS + 3
LANES = 2
FLAGS = ["--lanes", str(LANES), "--ctx", str(CTX)]
# compute_lock off: the host-wide compute lock is shared with every other skippy process of this user (another
# test run, a benchmark): its long computes would stall these stages past the 2 s reply deadline for no fault
BASE_CONFIG = {"runtime.prefill_chunk": 32, "runtime.compute_lock": "off"}
CONFIG = {**BASE_CONFIG, "runtime.reply_timeout": REPLY_TIMEOUT_S}
# greedy continues it for hundreds of tokens (no early end of generation)
COUNT = "Count from 1 to 1000: 1, 2, 3, 4,"
# ~190 tokens: ~3 s of prefill in 32-token chunks (the head computes each chunk before sending it)
LONG = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying oil for the lamp. "
        "Ships passing the rocky headland depended on the beam to find the channel between the reefs. ") * 5
PROBE = dict(prompt="The capital of France is", raw=True, max_tokens=8)  # the "works again" generation


# ---------------------------------------------------------------------------- the report
@attrs.define
class Row:
    fault: str
    detection_s: float | None  # injection → the client's error (None: no error was expected or seen)
    outcome: str  # what the client got
    state_after: str  # surviving stages' sessions, and whether the next generation worked
    release_s: float | None = None  # detection (or resume) → every surviving stage released
    recovery_s: float | None = None  # restart of the stage → first good generation


REPORT: list[Row] = []


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(rows: list[Row]) -> str:
    head = ("fault", "detect s", "release s", "recover s", "outcome", "state after")
    table = [head] + [(r.fault, _fmt(r.detection_s), _fmt(r.release_s), _fmt(r.recovery_s), r.outcome[:90],
                       r.state_after) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def fault_report(request, tmp_path_factory):
    REPORT.clear()
    yield REPORT
    if not REPORT:
        return
    out = Path(os.environ.get("SKIPPY_FAULT_REPORT") or tmp_path_factory.getbasetemp() / "fault-report.json")
    out.write_text(json.dumps([attrs.asdict(r) for r in REPORT], indent=1))
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\n\nfault report ({out}):\n{render(REPORT)}\n", flush=True)


# ---------------------------------------------------------------------------- pipelines
class Faulty(Pipeline):
    """A pipeline that remembers the tokens of PROBE before any fault."""

    reference: list[int]


def _start(topology: Path, tmp_path_factory, name: str, config: dict) -> Faulty:
    """Start every stage (sync: module fixtures cannot be trio fixtures) and record PROBE's tokens."""
    work = tmp_path_factory.mktemp(name)
    pipe = Faulty(retarget(topology, work), work, extra=FLAGS, config=config)
    try:
        pipe.start()
        pipe.reference = trio.run(functools.partial(pipe.generate, **PROBE))["tokens"]
    except BaseException:
        pipe.stop()
        raise
    return pipe


class Pipes:
    """The module's 2- and 3-stage pipelines, each started the first time a test asks for it."""

    def __init__(self, splits: dict[int, Path], tmp_path_factory):
        self.splits, self.tmp_path_factory = splits, tmp_path_factory
        self.started: dict[int, Faulty] = {}

    async def get(self, n: int) -> Faulty:
        """The n-stage pipeline, whole: a stage left dead by an earlier failed test is restarted first."""
        if n not in self.started:
            # in a worker thread: starting waits synchronously and runs trio itself
            self.started[n] = await trio.to_thread.run_sync(
                _start, self.splits[n], self.tmp_path_factory, f"pipe{n}", CONFIG)
        pipe = self.started[n]
        for k, d in sorted(pipe.stages.items()):
            if d.proc.poll() is not None:
                await pipe.astart_stage(k)
        return pipe

    def stop(self) -> None:
        for pipe in self.started.values():
            pipe.stop()


@pytest.fixture(scope="module")
def pipes(splits, tmp_path_factory):
    p = Pipes(splits, tmp_path_factory)
    yield p
    p.stop()


@pytest.fixture
async def pipe2(pipes):
    return await pipes.get(2)


# ---------------------------------------------------------------------------- helpers
@attrs.define(eq=False)
class Stream:
    """A streamed generation in the background: its pieces, then its result or error, and when it ended."""

    pieces: int = 0
    result: dict | None = None
    error: ControlError | None = None
    retryable: bool | None = None  # the error reply's flag (None: the connection itself failed)
    ended_at: float | None = None
    done: trio.Event = attrs.field(factory=trio.Event)

    async def wait_pieces(self, n: int, timeout: float = 30.0) -> None:
        with trio.fail_after(timeout):
            while self.pieces < n and not self.done.is_set():
                await trio.sleep(0.005)
        assert not self.done.is_set(), f"the generation ended before {n} pieces: {self.result or self.error}"

    async def wait_done(self, timeout: float) -> bool:
        with trio.move_on_after(timeout):
            await self.done.wait()
        return self.done.is_set()


async def start_stream(pipe: Pipeline, nursery: trio.Nursery, **kw) -> Stream:
    s = Stream()
    head = pipe.head

    async def run() -> None:
        try:
            async with open_control(head.url, head.token_file) as client:
                async for reply in client.replies(m.Generate(id=client.new_id(), **kw)):
                    if isinstance(reply, m.Piece):
                        s.pieces += 1
                    elif isinstance(reply, m.Error):
                        s.error, s.retryable = ControlError(reply.message, code=reply.code), reply.retryable
                    else:
                        s.result = reply.result
        except ControlError as exc:  # the head itself went away
            s.error = exc
        finally:
            s.ended_at = time.monotonic()
            s.done.set()

    nursery.start_soon(run)
    return s


async def wait_prefilling(pipe: Pipeline, victim: int, at_least: int = 64, timeout: float = 20.0) -> None:
    """Until the victim stage holds a session in prefill with `at_least` positions computed."""
    d = pipe.stages[victim]
    async with open_control(d.url, d.token_file) as client:
        with trio.fail_after(timeout):
            while True:
                live = await client.call(m.SessionsList(id=client.new_id()))
                if live and live[0]["state"] == "prefill" and (live[0]["position"] or 0) >= at_least:
                    return
                await trio.sleep(0.01)


async def sigkill(d: Daemon) -> float:
    """SIGKILL `d`; returns the injection time (monotonic). Reaps it without blocking trio."""
    injected = time.monotonic()
    d.proc.send_signal(signal.SIGKILL)
    await trio.to_thread.run_sync(d.proc.wait)
    return injected


def describe_error(err: ControlError | None, retryable: bool | None = None) -> str:
    if err is None:
        return "no error"
    return f"{err.code}{' retryable' if retryable else ''}: {err}"


async def released(pipe: Pipeline, since: float) -> tuple[float, str]:
    """Wait until every surviving stage freed everything; (seconds since `since`, a line for the report)."""
    snap = await pipe.wait_all_released(RELEASE_S)
    took = time.monotonic() - since
    return took, "stages " + ",".join(str(k) for k in snap) + ": 0 sessions, all slots free"


async def works_again(pipe: Faulty) -> None:
    got = await pipe.generate(**PROBE)
    assert got["tokens"] == pipe.reference
    await pipe.wait_all_released(RELEASE_S)


async def restart_and_check(pipe: Faulty, victim: int) -> float:
    """Restart the victim stage; seconds from the restart to the first good generation."""
    started = time.monotonic()
    await pipe.astart_stage(victim)
    await works_again(pipe)
    return time.monotonic() - started


def check_clean_error(s: Stream, victim: int) -> None:
    """The client got an error (not a hang, not a result) that says what failed."""
    assert s.result is None, f"a generation with a dead stage {victim} finished: {s.result}"
    assert s.error is not None
    if victim == 0:
        assert "closed the connection abruptly (the daemon stopped or crashed" in str(s.error)  # the head is gone
    else:  # the head's own link failed (or the token-return connection), or a stage says its downstream did
        assert str(s.error).startswith(("pipeline failed: ", "stage error (downstream_failed): stage ")), \
            describe_error(s.error, s.retryable)


def check_retryable(s: Stream, victim: int) -> None:
    """A stage that died or hung is worth retrying once it is back: `unavailable`, retryable."""
    if victim > 0:
        assert s.error.code == "unavailable" and s.retryable, describe_error(s.error, s.retryable)


# ---------------------------------------------------------------------------- kill -9
KILLS = [(n, k, when) for n in (2, 3) for when in ("prefill", "decode") for k in range(n)]


@pytest.mark.parametrize(("n", "victim", "when"), KILLS, ids=[f"{n}stage-kill{k}-mid-{w}" for n, k, w in KILLS])
async def test_sigkill(pipes, n, victim, when):
    pipe = await pipes.get(n)
    kw = dict(prompt=LONG + COUNT, raw=True, max_tokens=8) if when == "prefill" else \
        dict(prompt=COUNT, raw=True, max_tokens=CTX)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            s = await start_stream(pipe, nursery, **kw)
            if when == "prefill":
                await wait_prefilling(pipe, victim)
            else:
                await s.wait_pieces(MID_DECODE_PIECES)
            injected = await sigkill(pipe.stages[victim])
            assert await s.wait_done(10), "no answer 10 s after the kill"
        if when == "prefill":
            assert s.pieces == 0, "the kill came after the prefill"
        detection = s.ended_at - injected
        check_clean_error(s, victim)
        if victim > 0:  # the operator learns of it too: a line in the head's log with what the client got
            assert re.search(r"warning skippyd\.head: head: session \d+ \(request \d+\) failed after \d+ "
                             r"tokens: " + re.escape(str(s.error)), pipe.stages[0].log()), pipe.stages[0].log()[-2000:]
        release_s, state = await released(pipe, s.ended_at)
        recovery = await restart_and_check(pipe, victim)
    kind = "link closed from the middle (kill -9 middle stage)" if n == 3 and victim == 1 else "kill -9"
    REPORT.append(Row(f"{n}-stage {kind} stage {victim} mid-{when}", detection, describe_error(s.error, s.retryable),
                      state + "; restarted: generation OK", release_s, recovery))
    assert detection < DETECT_S
    check_retryable(s, victim)


async def test_the_head_logs_stage_1_going_away_and_coming_back(pipes):
    """An operator reading the head's log sees stage 1 go (a lane cannot be opened) and come back, whoever
    opens the first lane after it: the background task that keeps lanes warm, or a generation's checkout."""
    pipe = await pipes.get(2)
    head = pipe.stages[0]
    mark = len(head.log())
    await sigkill(pipe.stages[1])
    with trio.fail_after(20):  # the head notices at its next attempt to open a lane (the warm task's, <= 10 s)
        while "could not open a lane" not in head.log()[mark:]:
            await trio.sleep(0.05)
    await restart_and_check(pipe, 1)
    text = head.log()[mark:]
    assert "is reachable again" in text[text.index("could not open a lane"):], text


# ---------------------------------------------------------------------------- SIGSTOP / SIGCONT
STOPS = [(2, 1), (3, 1), (3, 2)]


@pytest.mark.parametrize(("n", "victim"), STOPS, ids=[f"{n}stage-stop{k}" for n, k in STOPS])
async def test_sigstop_mid_decode(pipes, n, victim):
    """A hung stage (SIGSTOP) is detected by the reply deadline (reply_timeout 2), then SIGCONT heals it."""
    pipe = await pipes.get(n)
    d = pipe.stages[victim]
    with trio.fail_after(60):
        try:
            async with trio.open_nursery() as nursery:
                s = await start_stream(pipe, nursery, prompt=COUNT, raw=True, max_tokens=CTX)
                await s.wait_pieces(MID_DECODE_PIECES)
                injected = time.monotonic()
                d.signal(signal.SIGSTOP)
                detected = await s.wait_done(REPLY_TIMEOUT_S + 5)
        finally:
            d.signal(signal.SIGCONT)
        resumed = time.monotonic()
        assert detected, "no answer while the stage was stopped"
        detection = s.ended_at - injected
        check_clean_error(s, victim)
        release_s, state = await released(pipe, resumed)  # the stopped stage frees its sessions once it runs
        await works_again(pipe)
    REPORT.append(Row(f"{n}-stage SIGSTOP stage {victim} mid-decode (reply_timeout 2), SIGCONT after",
                      detection, describe_error(s.error, s.retryable), state + " (after SIGCONT); generation OK",
                      release_s))
    assert detection < REPLY_TIMEOUT_S + 0.5
    check_retryable(s, victim)


async def test_sigstop_head_mid_decode(pipe2):
    """Nothing but the client could notice a hung head; after SIGCONT the generation just goes on."""
    head = pipe2.head
    with trio.fail_after(60):
        try:
            async with trio.open_nursery() as nursery:
                s = await start_stream(pipe2, nursery, prompt=COUNT, raw=True, max_tokens=64)
                await s.wait_pieces(3)
                head.signal(signal.SIGSTOP)
                ended_while_stopped = await s.wait_done(REPLY_TIMEOUT_S + 1)
                head.signal(signal.SIGCONT)
                await s.wait_done(30)
        finally:
            head.signal(signal.SIGCONT)
        assert not ended_while_stopped
        assert s.error is None and s.result["finish_reason"] == "length", describe_error(s.error, s.retryable)
        release_s, state = await released(pipe2, s.ended_at)
        await works_again(pipe2)
    REPORT.append(Row("2-stage SIGSTOP head mid-decode for 3 s, SIGCONT after", None,
                      "no error while stopped (no client deadline); completed after SIGCONT",
                      state + "; generation OK", release_s))


@pytest.fixture
def pipe2_default_timeout(splits, tmp_path_factory):
    """The same 2-stage split with the default reply deadline (30 s)."""
    pipe = _start(splits[2], tmp_path_factory, "pipe2default", BASE_CONFIG)
    yield pipe
    pipe.stop()


async def test_sigstop_default_reply_timeout_detected_within_2s(pipe2_default_timeout):
    pipe = pipe2_default_timeout
    d = pipe.stages[1]
    with trio.fail_after(60):
        try:
            async with trio.open_nursery() as nursery:
                s = await start_stream(pipe, nursery, prompt=COUNT, raw=True, max_tokens=64)
                await s.wait_pieces(3)
                injected = time.monotonic()
                d.signal(signal.SIGSTOP)
                detected = await s.wait_done(DETECT_S + 1)
                d.signal(signal.SIGCONT)
                await s.wait_done(40)
        finally:
            d.signal(signal.SIGCONT)
        release_s, state = await released(pipe, time.monotonic())
        await works_again(pipe)
    after = describe_error(s.error, s.retryable) if s.error else f"completed ({s.result['finish_reason']})"
    REPORT.append(Row("2-stage SIGSTOP stage 1 mid-decode (default reply_timeout 30), SIGCONT after 3 s",
                      s.ended_at - injected if detected else None,
                      after if detected else f"not detected within {DETECT_S + 1:g} s; after SIGCONT: {after}",
                      state + "; generation OK", release_s))
    assert detected and s.ended_at - injected < DETECT_S


# ---------------------------------------------------------------------------- a stage from another split
# (pipeline, victim, the other split, the stage of it that takes the victim's place, why it is refused)
WRONG = [(2, 1, "smol3", 1, "non-adjacent stage"), (3, 1, "smol2", 1, "non-adjacent stage"),
         (3, 2, "smol2", 1, "non-adjacent stage"), (2, 1, "tiny2", 1, "model fingerprint mismatch")]


@pytest.mark.parametrize(("n", "victim", "other", "other_stage", "why"), WRONG,
                         ids=[f"{n}stage-stage{k}-replaced-by-stage{j}-of-{o}" for n, k, o, j, _ in WRONG])
async def test_restart_from_another_split_is_refused(request, pipes, splits, tmp_path, n, victim, other,
                                                     other_stage, why):
    """Stage `victim` is replaced, on its address, by a stage of another split (of the same model with other
    layers, or of another model): the handshake refuses it, generations fail with an error that says why, and
    no session is left; restarting the right stage heals the pipeline."""
    pipe = await pipes.get(n)
    if other == "tiny2":  # a 4-layer random model with the same tokenizer
        other_topology = tmp_path / "tiny" / "topology.toml"
        other_topology.parent.mkdir()
        split_for_test(request.getfixturevalue("tiny_model_path"), 2, other_topology.parent)
    else:
        other_topology = splits[int(other[-1])]
    spec = pipe.topology.stage(victim)
    with trio.fail_after(90):
        await sigkill(pipe.stages[victim])
        wrong = Daemon(["--topology", str(other_topology), "--stage", str(other_stage), "--listen",
                        f"{spec.host}:{spec.port}", *FLAGS], tmp_path, "wrong", config=CONFIG)
        try:
            await trio.to_thread.run_sync(wrong.wait_ready)
            started = time.monotonic()
            with pytest.raises(ControlError) as err:
                await pipe.generate(**PROBE)
            detection = time.monotonic() - started
            snap = await pipe.stage_sessions()
            assert all(s["live"] == 0 for s in snap.values()), snap
            assert (await wrong.astatus())["stages"][0]["live_sessions"] == 0
        finally:
            wrong.kill()
        # the reason comes through whichever way the refusal reached the head: its own handshake, or a stage
        # whose downstream handshake failed
        assert err.value.code == "unavailable", describe_error(err.value)
        assert "refused by peer" in str(err.value) and why in str(err.value), str(err.value)
        recovery = await restart_and_check(pipe, victim)
    theirs = Pipeline(other_topology, tmp_path).topology.stage(other_stage)
    REPORT.append(Row(f"{n}-stage: stage {victim} replaced by stage {other_stage} [{theirs.layer_start},"
                      f"{theirs.layer_end}) of {other}", detection,
                      describe_error(err.value), "no session anywhere; right stage restarted: generation OK",
                      None, recovery))


# ---------------------------------------------------------------------------- every lane busy
async def test_every_lane_busy_extras_wait_then_complete(pipe2):
    """--lanes 2: two long generations hold both slots; two more wait in the head's queue, then complete."""
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            long = [await start_stream(pipe2, nursery, prompt=COUNT, raw=True, max_tokens=96) for _ in range(LANES)]
            for s in long:
                await s.wait_pieces(1)
            submitted = time.monotonic()
            extra = [await start_stream(pipe2, nursery, **PROBE) for _ in range(2)]
            async with open_control(pipe2.head.url, pipe2.head.token_file) as client:
                with trio.fail_after(5):
                    while True:
                        live = await client.call(m.SessionsList(id=client.new_id()))
                        if sorted(g["state"] for g in live) == ["decode", "decode", "queued", "queued"]:
                            break
                        await trio.sleep(0.01)
            lanes = await _lanes(pipe2)
            assert [lane["state"] for lane in lanes["lanes"]].count("busy") == LANES
        long_end = max(s.ended_at for s in long)
        for s in long + extra:
            assert s.error is None and s.result is not None, describe_error(s.error, s.retryable)
        assert [s.result["tokens"] for s in extra] == [pipe2.reference] * 2
        assert all(s.ended_at >= min(x.ended_at for x in long) for s in extra)  # they waited for a slot
        waited = min(s.ended_at for s in extra) - submitted
        release_s, state = await released(pipe2, max(s.ended_at for s in extra))
    REPORT.append(Row(f"--lanes {LANES}: {LANES} long generations + 2 more", None,
                      f"extras queued, then completed {waited:.2f} s after submission (longs done at "
                      f"{long_end - submitted:.2f} s); queue limit 30 s (--queue-timeout)",
                      state, release_s))


QUEUE_TIMEOUT_S = 2.0


async def test_queue_timeout_is_a_clear_retryable_error(splits, tmp_path):
    """--lanes 1: one long generation holds the only slot; another waits the head's queue timeout
    (--queue-timeout 2), then gets a retryable `unavailable` error that says so."""
    pipe = Pipeline(retarget(splits[2], tmp_path), tmp_path,
                    extra=["--lanes", "1", "--ctx", "4096", "--queue-timeout", f"{QUEUE_TIMEOUT_S:g}"])
    await trio.to_thread.run_sync(pipe.start)
    try:
        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                long = await start_stream(pipe, nursery, prompt=COUNT, raw=True, max_tokens=4000)
                await long.wait_pieces(1)
                started = time.monotonic()
                with pytest.raises(ControlError) as err:
                    await pipe.generate(**PROBE)
                waited = time.monotonic() - started
                assert long.error is None and not long.done.is_set()
                async with open_control(pipe.head.url, pipe.head.token_file) as client:
                    live = await client.call(m.SessionsList(id=client.new_id()))
                    await client.call(m.SessionKill(id=client.new_id(), session_id=live[0]["session_id"], wait=True))
            release_s, state = await released(pipe, time.monotonic())
    finally:
        await trio.to_thread.run_sync(pipe.stop)
    REPORT.append(Row("--lanes 1: a second generation while the only slot is busy", waited,
                      describe_error(err.value), state, release_s))
    assert err.value.code == "unavailable"
    assert f"no free session slot within {QUEUE_TIMEOUT_S:g} s (all 1 busy)" in str(err.value)
    assert QUEUE_TIMEOUT_S <= waited < QUEUE_TIMEOUT_S + 1.5


async def _lanes(pipe: Pipeline) -> dict:
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        return await client.call(m.LanesList(id=client.new_id()))


async def test_slot_freed_by_a_kill_is_usable_at_once(pipe2):
    """--lanes 2 on every stage: kill one of two running generations, start another at once; it must run.
    (Up to 20 tries: the race is lost about every other time.)"""
    outcomes = []
    with trio.fail_after(120):
        for _attempt in range(20):
            async with trio.open_nursery() as nursery:
                running = [await start_stream(pipe2, nursery, prompt=COUNT, raw=True, max_tokens=CTX)
                           for _ in range(LANES)]
                for s in running:
                    await s.wait_pieces(2)
                async with open_control(pipe2.head.url, pipe2.head.token_file) as client:
                    live = await client.call(m.SessionsList(id=client.new_id()))
                    await client.call(m.SessionKill(id=client.new_id(), session_id=live[0]["session_id"], wait=True))
                    try:
                        got = await pipe2.generate(**PROBE)
                        outcomes.append(None if got["tokens"] == pipe2.reference else f"wrong tokens {got}")
                    except ControlError as exc:
                        outcomes.append(describe_error(exc))
                    for g in await client.call(m.SessionsList(id=client.new_id())):
                        await client.call(m.SessionKill(id=client.new_id(), session_id=g["session_id"], wait=True))
            await pipe2.wait_all_released(RELEASE_S)
            if outcomes[-1] is not None:
                break
        release_s, state = await released(pipe2, time.monotonic())
        await works_again(pipe2)
    failed = [o for o in outcomes if o is not None]
    REPORT.append(Row(f"--lanes {LANES}: kill 1 of {LANES} running, start another at once", None,
                      f"attempt {len(outcomes)}: {failed[0]}" if failed else f"{len(outcomes)} attempts OK",
                      state + "; generation OK", release_s))
    assert not failed


# ---------------------------------------------------------------------------- the KV cache
async def test_kv_cache_max_tokens_clamped_to_the_context(pipe2):
    with trio.fail_after(60):
        got = await pipe2.generate(prompt=LONG + COUNT, raw=True, max_tokens=500)
        usage = got["usage"]
        assert got["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == CTX, usage
        release_s, state = await released(pipe2, time.monotonic())
    REPORT.append(Row(f"--ctx {CTX}: {usage['prompt_tokens']}-token prompt + max_tokens 500", None,
                      f"clamped: {usage['completion_tokens']} tokens, finish length", state, release_s))


def words(n: int) -> str:
    """A raw prompt of exactly n tokens (the default model tokenizes " word" as one token, no BOS)."""
    return "word" + " word" * (n - 1)


async def test_kv_cache_prompt_one_short_of_the_context_gets_one_token(pipe2):
    with trio.fail_after(30):
        got = await pipe2.generate(prompt=words(CTX - 1), raw=True, max_tokens=8)
        usage = dict(got["usage"])
        assert [s["stage"] for s in usage.pop("prefix_cache")] == [0, 1]
        assert usage == {"prompt_tokens": CTX - 1, "completion_tokens": 1, "total_tokens": CTX, "cached_tokens": 0}
        assert got["finish_reason"] == "length"
        release_s, state = await released(pipe2, time.monotonic())
    REPORT.append(Row(f"--ctx {CTX}: {CTX - 1}-token prompt + max_tokens 8", None, "clamped: 1 token, finish length",
                      state, release_s))


@pytest.mark.parametrize("n_prompt", [CTX, 4 * CTX])
async def test_kv_cache_prompt_that_does_not_fit_is_refused(pipe2, n_prompt):
    with trio.fail_after(30):
        started = time.monotonic()
        with pytest.raises(ControlError) as err:
            await pipe2.generate(prompt=words(n_prompt), raw=True, max_tokens=8)
        took = time.monotonic() - started
        assert err.value.code == "bad_request", describe_error(err.value)
        assert f"the prompt has {n_prompt} tokens; the context holds {CTX} per session" in str(err.value)
        release_s, state = await released(pipe2, time.monotonic())
        await works_again(pipe2)
    REPORT.append(Row(f"--ctx {CTX}: {n_prompt}-token prompt", took, describe_error(err.value),
                      state + "; generation OK", release_s))
