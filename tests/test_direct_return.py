"""Direct token return: with three or more stages the final stage sends predictions straight to the head.

In-process: the head's TokenReturnHub and the final stage's TokenReturnLink
on loopback: predictions reach the waiting session's channel, a lane that
dials the return listener is refused, a lost connection fails the waiting
sessions (never a hang) and the next configure dials again.

Real processes: 3-stage pipelines (tiny and default model) with direct
return on give exactly the unsplit model's greedy tokens, and the head's
and the final stage's counters show that every prediction took the return
connection; after a generation's first ACKED_DECODE_STEPS, stage 1
acknowledges no decode step (DIRECT_RETURN from the head), and its failure
still reaches the head at once, on the lane the head watches; with direct
return turned off on the final stage the head falls back to the relayed path
(and says so) with the same tokens.
"""

from __future__ import annotations

import functools
import socket

import pytest
import trio

from skippyctl.client import ControlError
from skippyd.head.lane_client import ACKED_DECODE_STEPS
from skippyd.head.token_return import ReturnLost, TokenReturnHub
from skippyd.runtime.llama import ContextParams
from skippyd.stage.downstream import DownstreamError, DownstreamLink
from skippyd.stage.token_return import TokenReturnLink, TokenReturnLost
from skippyd.wire.messages import ErrorCode, ErrorReply, Hello, PredictedToken
from tests.local_pipeline import LocalPipeline
from tests.procs import Pipeline, free_ports, split_for_test

pytestmark = pytest.mark.slow  # real daemon processes

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
LONG_PROMPT = ("In the beginning the universe was created. This has made a lot of people very angry and been "
               "widely regarded as a bad move. Many were increasingly of the opinion that they'd all made a big "
               "mistake in coming down from the trees in the first place.")
CHUNK = 16
FINGERPRINT = bytes(range(32))


# ---------------------------------------------------------------------------- in-process


def hello(index: int, start: int, end: int) -> Hello:
    return Hello(fingerprint=FINGERPRINT, stage_index=index, layer_start=start, layer_end=end, n_layer=30,
                 n_embd=64, node=f"test-{index}")


@pytest.fixture
async def hub(nursery):
    hub = TokenReturnHub(hello(0, 0, 10), read_deadline=5.0)
    await nursery.start(hub.serve, "127.0.0.1", 0)
    return hub


@pytest.fixture
async def final_link(hub, nursery):
    host, port = hub.address.rsplit(":", 1)
    link = TokenReturnLink(hello(2, 20, 30), host, int(port), connect_timeout=2.0)
    await nursery.start(link.run)
    return link


async def wait_until(predicate, timeout: float = 2.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


async def test_predictions_reach_the_waiting_session(hub, final_link):
    assert await final_link.ensure()
    returns = hub.open_session(7, 1)
    await final_link.send(PredictedToken(1, 7, 42))
    await final_link.send(PredictedToken(1, 99, 1))  # nobody waits for session 99: dropped, counted
    await final_link.send(ErrorReply(1, 7, ErrorCode.COMPUTE_FAILED, "boom"))
    with trio.fail_after(2):
        first, second = await returns.receive(), await returns.receive()
    assert first == PredictedToken(1, 7, 42)
    assert isinstance(second, ErrorReply) and second.message == "boom"
    assert hub.stats.tokens == 1 and hub.stats.errors == 1
    await wait_until(lambda: hub.stats.unknown == 1)
    assert hub.connections == 1 and final_link.stats.dials == 1
    assert await final_link.ensure() and final_link.stats.dials == 1  # reused, not dialed again
    # a prediction must not wait for Nagle on either end; an idle connection is probed from both
    for stream in [final_link._conn.stream, *hub._streams]:
        assert stream.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)


async def test_a_prediction_goes_out_without_a_schedule_point_while_the_connection_is_free(hub, final_link):
    """The final stage's per-token send: the connection's lock, when free, is taken without the pass of
    trio's scheduler an uncontended Lock.acquire makes (a cold pass on every token); a send that finds
    another one writing still waits its turn, and both frames arrive whole."""
    assert await final_link.ensure()
    returns = hub.open_session(7, 1)

    class Yields(trio.abc.Instrument):
        """Counts the times this task gives the scheduler a turn (ends a step) while installed."""

        def __init__(self) -> None:
            self.task, self.count = trio.lowlevel.current_task(), 0

        def after_task_step(self, task) -> None:
            self.count += task is self.task

    yields = Yields()
    trio.lowlevel.add_instrument(yields)
    try:
        await final_link.send(PredictedToken(1, 7, 42))
    finally:
        trio.lowlevel.remove_instrument(yields)
    assert yields.count == 0
    conn = final_link._conn
    conn.lock.acquire_nowait()  # as another lane's send halfway through its frame
    async with trio.open_nursery() as nursery:
        nursery.start_soon(final_link.send, PredictedToken(1, 7, 43))
        await trio.testing.wait_all_tasks_blocked()
        assert conn.lock.statistics().tasks_waiting == 1
        conn.lock.release()
    with trio.fail_after(2):
        assert [await returns.receive(), await returns.receive()] == [PredictedToken(1, 7, 42),
                                                                      PredictedToken(1, 7, 43)]


async def test_a_reply_owed_to_an_attempt_given_up_does_not_reach_the_replay(hub, final_link):
    """A final stage stopped mid-step (SIGSTOP) sends the step's prediction once it runs again, on the return
    connection, which outlives the lane the head gave up; by then the generation may be replaying, waiting
    on its session's channel opened again. Taking that prediction would shift every later token by one."""
    assert await final_link.ensure()
    hub.open_session(7, 1)
    replay = hub.open_session(7, 2)  # the resume: same session, the next request id
    await final_link.send(PredictedToken(1, 7, 42))  # the first attempt's, late
    await final_link.send(ErrorReply(1, 7, ErrorCode.COMPUTE_FAILED, "the first attempt's lane closed"))
    await final_link.send(PredictedToken(2, 7, 43))
    with trio.fail_after(2):
        assert await replay.receive() == PredictedToken(2, 7, 43)
    assert hub.stats.stale == 2 and hub.stats.tokens == 1 and hub.stats.errors == 0


async def test_a_lane_cannot_dial_the_return_listener(hub):
    host, port = hub.address.rsplit(":", 1)
    with pytest.raises(DownstreamError, match="role mismatch"):
        await DownstreamLink.connect(host, int(port), hello(0, 0, 10))
    await wait_until(lambda: hub.stats.refused == 1)
    assert hub.stats.accepted == 0


async def test_lost_connection_fails_waiting_sessions_and_is_dialed_again(hub, final_link, nursery):
    assert await final_link.ensure()
    await wait_until(lambda: hub.connections == 1)
    returns = hub.open_session(5, 1)
    await hub.disconnect()  # the head side goes away: the waiting session hears it at once
    with trio.fail_after(2):
        item = await returns.receive()
    assert isinstance(item, ReturnLost)
    await wait_until(lambda: not final_link.connected)  # the final stage sees the EOF
    with pytest.raises(TokenReturnLost):
        await final_link.send(PredictedToken(1, 5, 3))
    assert await final_link.ensure()  # dialed again
    assert final_link.stats.dials == 2 and final_link.stats.lost == 1


async def test_an_overdue_prediction_wakes_its_wait_with_return_lost(nursery):
    """The hub keeps each wait's reply deadline in one task: a session whose prediction does not come within
    prediction_timeout gets a ReturnLost that says so; another session's prediction still arrives."""
    hub = TokenReturnHub(hello(0, 0, 10), prediction_timeout=0.3)
    await nursery.start(hub.serve, "127.0.0.1", 0)
    late, prompt = hub.open_session(1, 9), hub.open_session(2, 9)
    started = trio.current_time()
    hub.begin_wait(1)
    hub.begin_wait(2)
    hub._deliver(PredictedToken(9, 2, 5))  # session 2's prediction is there before the deadline
    with trio.fail_after(3):
        item = await late.receive()
    hub.end_wait(1)
    assert isinstance(item, ReturnLost) and "no prediction" in str(item) and "0.3 s" in str(item)
    assert 0.25 <= trio.current_time() - started < 2
    # a prediction waiting in the channel when the deadline passes is not timed out (its task had not run)
    assert await prompt.receive() == PredictedToken(9, 2, 5)
    hub.end_wait(2)
    assert prompt.statistics().current_buffer_used == 0
    # a wait that ends in time leaves nothing behind for the next one
    hub.begin_wait(1)
    hub._deliver(PredictedToken(9, 1, 6))
    assert await late.receive() == PredictedToken(9, 1, 6)
    hub.end_wait(1)
    await trio.sleep(0.5)
    assert late.statistics().current_buffer_used == 0


async def test_interrupt_wakes_a_waiting_session(hub):
    returns = hub.open_session(3, 1)
    hub.interrupt(3, "stage 1 did not answer a ping")
    hub.interrupt(4, "nobody waits: ignored")
    with trio.fail_after(1):
        item = await returns.receive()
    assert isinstance(item, ReturnLost) and str(item) == "stage 1 did not answer a ping"


async def test_unreachable_head_falls_back_quickly(nursery):
    (port,) = free_ports(1)  # nothing listens there
    link = TokenReturnLink(hello(2, 20, 30), "127.0.0.1", port, connect_timeout=1.0)
    await nursery.start(link.run)
    assert not await link.ensure()
    assert link.last_error and link.stats.dial_failures == 1
    assert not await link.ensure()  # within the retry interval: no second dial
    assert link.stats.dial_failures == 1
    with pytest.raises(TokenReturnLost):
        await link.send(PredictedToken(1, 1, 1))


# ---------------------------------------------------------------------------- real processes


@functools.cache
def reference(model_path, prompt: str, n: int) -> list[int]:
    with LocalPipeline([model_path], ContextParams(n_ctx_per_seq=1024, n_seq_max=1, n_threads=1)) as ref:
        out = ref.generate(ref.head.tokenize(prompt, parse_special=False), n, chunk=CHUNK)
        if out and ref.head.is_eog(out[-1]):
            out.pop()
        return out


def _start(model_path, work, *, final_extra: tuple[str, ...] = (), n: int = 3,
           stage_extra: dict[int, tuple[str, ...]] | None = None, final_config: dict | None = None) -> Pipeline:
    split_for_test(model_path, n, work)
    pipe = Pipeline(work / "topology.toml", work, extra=["--lanes", "2"], config={"runtime.prefill_chunk": CHUNK})
    extra = {**(stage_extra or {}), n - 1: final_extra}
    try:
        base, base_config = pipe.extra, pipe.config
        for k in reversed(range(n)):
            pipe.extra = [*base, *extra.get(k, ())]
            pipe.config = {**base_config, **((final_config or {}) if k == n - 1 else {})}
            pipe.start_stage(k, wait=False)
        pipe.extra, pipe.config = base, base_config
        for k in reversed(range(n)):
            pipe.stages[k].wait_ready()
    except BaseException:
        pipe.stop()
        raise
    return pipe


def _stop(pipe: Pipeline) -> None:
    codes = pipe.stop()
    assert all(c == 0 for c in codes.values()), codes


@pytest.fixture(scope="module")
def tiny3(tiny_model_path, tmp_path_factory):
    pipe = _start(tiny_model_path, tmp_path_factory.mktemp("direct3"))
    yield pipe
    _stop(pipe)


async def token_paths(pipe: Pipeline) -> tuple[dict, dict]:
    head = (await pipe.head.astatus())["head"]["token_return"]
    (final,) = (await pipe.stages[len(pipe.stages) - 1].astatus())["stages"]
    return head, final["token_return"]


async def returns_only(pipe: Pipeline) -> tuple[int, int]:
    """(decode steps the stage before the final stage sent it owing no ack, those the final stage answered
    on the token-return connection only)."""
    n = len(pipe.stages)
    (before_final,) = (await pipe.stages[n - 2].astatus())["stages"]
    (final,) = (await pipe.stages[n - 1].astatus())["stages"]
    return before_final["returns_only"]["forwarded"], final["returns_only"]["answered"]


async def unacked(pipe: Pipeline) -> int:
    """Decode steps stage 1 took from the head with DIRECT_RETURN: no ack on the lane."""
    (stage1,) = (await pipe.stages[1].astatus())["stages"]
    return stage1["returns_only"]["unacked"]


async def assert_parity(pipe: Pipeline, model_path, prompts, n: int) -> int:
    """Greedy parity; returns how many predictions the generations received."""
    received = 0
    for prompt in prompts:
        got = await pipe.generate(prompt=prompt, raw=True, max_tokens=n)
        want = reference(model_path, prompt, n)
        assert got["tokens"] == want, prompt
        received += n if len(want) == n else len(want) + 1  # an end-of-generation token is received too
    await pipe.wait_all_released(2.0)
    return received


async def test_tiny_three_stages_direct_return_matches_unsplit(tiny3, tiny_model_path):
    before, _ = await token_paths(tiny3)
    forwarded_before, answered_before = await returns_only(tiny3)
    unacked_before = await unacked(tiny3)
    prompts = [*PROMPTS, LONG_PROMPT]
    received = await assert_parity(tiny3, tiny_model_path, prompts, 40)
    head, final = await token_paths(tiny3)
    assert head["enabled"] and head["connections"] == 1
    assert head["direct"] - before["direct"] == received  # every prediction took the return connection
    assert head["relayed"] == before["relayed"] == 0 and head["fallbacks"] == 0
    assert final["connected"] and final["dials"] == 1 and final["sent"] == head["tokens"]
    # every decode step (each prediction but the prompt's) went to the final stage owing no reply on the lane
    forwarded, answered = await returns_only(tiny3)
    assert forwarded - forwarded_before == answered - answered_before == received - len(prompts)
    # and each generation's decode steps but its first few went to stage 1 owing no ack either
    assert await unacked(tiny3) - unacked_before == received - len(prompts) * (1 + ACKED_DECODE_STEPS)


async def test_concurrent_direct_generations_each_get_their_own_tokens(tiny3, tiny_model_path):
    results = {}

    async def run(prompt):
        results[prompt] = (await tiny3.generate(prompt=prompt, raw=True, max_tokens=24))["tokens"]

    async with trio.open_nursery() as nursery:
        for prompt in PROMPTS:
            nursery.start_soon(run, prompt)
    for prompt in PROMPTS:
        assert results[prompt] == reference(tiny_model_path, prompt, 24)
    await tiny3.wait_all_released(2.0)


async def test_four_stages_only_the_last_hop_goes_without_acks(tiny_model_path, tmp_path):
    """4 stages: stage 2's decode steps to the final stage go with DIRECT_RETURN, owing nothing on the lane;
    so do the head's to stage 1 (after the first few), but stage 1 sends them on to stage 2 (a middle stage)
    with its ack owed, and waits for it: a failure there must reach the head now."""
    pipe = await trio.to_thread.run_sync(functools.partial(_start, tiny_model_path, tmp_path, n=4))
    try:
        received = await assert_parity(pipe, tiny_model_path, PROMPTS, 24)
        head, _ = await token_paths(pipe)
        forwarded, answered = await returns_only(pipe)
        (stage1,) = (await pipe.stages[1].astatus())["stages"]
        (stage2,) = (await pipe.stages[2].astatus())["stages"]
    finally:
        await trio.to_thread.run_sync(_stop, pipe)
    assert head["direct"] == received and head["relayed"] == 0
    assert forwarded == answered == received - len(PROMPTS)
    steps = received - len(PROMPTS)
    assert stage1["returns_only"] == {"forwarded": 0, "answered": 0,
                                      "unacked": steps - ACKED_DECODE_STEPS * len(PROMPTS)}
    assert stage2["returns_only"]["unacked"] == 0


async def test_default_model_three_stages_direct_return_matches_unsplit(default_model_path, tmp_path):
    pipe = await trio.to_thread.run_sync(_start, default_model_path, tmp_path)
    try:
        received = await assert_parity(pipe, default_model_path, PROMPTS[:1], 24)
        head, final = await token_paths(pipe)
    finally:
        await trio.to_thread.run_sync(_stop, pipe)
    assert head["direct"] == received and head["relayed"] == 0
    assert final["sent"] == received


async def test_final_stage_without_direct_return_falls_back_to_relaying(tiny_model_path, tmp_path):
    pipe = await trio.to_thread.run_sync(functools.partial(_start, tiny_model_path, tmp_path,
                                                           final_config={"runtime.direct_return": False}))
    try:
        received = await assert_parity(pipe, tiny_model_path, PROMPTS, 16)
        head, final = await token_paths(pipe)
        log = pipe.head.log()
    finally:
        await trio.to_thread.run_sync(_stop, pipe)
    assert final is None  # the final stage has no return connection at all
    assert head["enabled"] and head["direct"] == 0 and head["relayed"] == received
    assert head["fallbacks"] == len(PROMPTS)
    assert log.count("using the relayed path") == 1  # said once, not once per generation


async def fail_mid_decode_then_reuse_the_lanes(pipe: Pipeline, model_path, check_counters) -> None:
    """A long generation fails with context_full mid-decode, at once (well before the 30 s reply deadline);
    every stage releases the session; `check_counters()` looks at where the failure went; then more
    generations than --lanes (the failed generation's lane is used again) are right: no reply was owed or
    left over on the lanes."""
    with trio.fail_after(20):
        with pytest.raises(ControlError, match="context_full"):
            await pipe.generate(prompt=LONG_PROMPT, raw=True, max_tokens=600)
        await pipe.wait_all_released(2.0)
        await check_counters()
        for _ in range(3):
            got = await pipe.generate(prompt=PROMPTS[0], raw=True, max_tokens=8)
            assert got["tokens"] == reference(model_path, PROMPTS[0], 8)
        await pipe.wait_all_released(2.0)


async def test_failed_prediction_on_the_final_stage_is_a_clean_error(tiny_model_path, tmp_path):
    """The final stage runs out of context mid-decode (it was given less than the head), on a decode step it
    answers on the token-return connection only: the error reaches the head there."""
    pipe = await trio.to_thread.run_sync(functools.partial(_start, tiny_model_path, tmp_path,
                                                           final_extra=("--ctx", "16")))

    async def check_counters() -> None:
        head, _ = await token_paths(pipe)
        assert head["errors"] == 1 and head["direct"] > 0
        forwarded, answered = await returns_only(pipe)
        assert forwarded > 0 and answered == forwarded - 1  # the last one failed: a decode step

    try:
        await fail_mid_decode_then_reuse_the_lanes(pipe, tiny_model_path, check_counters)
    finally:
        await trio.to_thread.run_sync(_stop, pipe)


async def test_failed_decode_step_on_stage_1_reaches_the_head_on_the_watched_lane(tiny_model_path, tmp_path):
    """Stage 1 runs out of context mid-decode, on a decode step the head sent it with DIRECT_RETURN (no ack
    owed): its Error on the lane wakes the head, which waits on the token-return connection for a
    prediction that will not come."""
    pipe = await trio.to_thread.run_sync(functools.partial(_start, tiny_model_path, tmp_path,
                                                           stage_extra={1: ("--ctx", "16")}))

    async def check_counters() -> None:
        assert await unacked(pipe) > 0  # it failed on one of those
        head, _ = await token_paths(pipe)
        assert head["errors"] == 0  # nothing came on the token-return connection

    try:
        await fail_mid_decode_then_reuse_the_lanes(pipe, tiny_model_path, check_counters)
    finally:
        await trio.to_thread.run_sync(_stop, pipe)
