"""Real skippyd processes on loopback: greedy parity with the unsplit model, and session cleanup.

Parity: 2- and 3-stage pipelines of the default model and of the tiny random
model give exactly the greedy tokens of the unsplit model run in-process.

Cleanup: whatever ends a generation (the driving connection closed or reset
mid-prefill or mid-decode, a cancelled generation, a client that goes away,
Stop sent twice, a malformed frame, a downstream stage killed with SIGKILL or
shut down) every surviving stage reports zero live sessions and every
sequence slot free within 2 s, and the next generation on the same pipeline
works. The "driving connection" tests play stage 0 themselves
(`tests.procs.Stage0Driver`), so they can stop anywhere.
"""

from __future__ import annotations

import functools
import signal

import numpy as np
import pytest
import trio

from skippyctl.client import ControlError, open_control
from skippyd.control import messages as m
from skippyd.runtime.llama import ContextParams
from skippyd.wire.codec import frame_bytes
from skippyd.wire.errors import WireError
from skippyd.wire.messages import Ack, ErrorCode, ErrorReply, PredictedToken, PrefillChunk, Stopped
from skippyd.wire.stream import read_reply
from tests.local_pipeline import LocalPipeline
from tests.procs import Pipeline, Stage0Driver, retarget, split_for_test

pytestmark = pytest.mark.slow  # real daemon processes

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
# long enough for several prefill chunks (with prefill_chunk 16): exercises acks deferred on credits
LONG_PROMPT = ("In the beginning the universe was created. This has made a lot of people very angry and been "
               "widely regarded as a bad move. Many were increasingly of the opinion that they'd all made a big "
               "mistake in coming down from the trees in the first place. And some said that even the trees "
               "had been a bad move, and that no one should ever have left the oceans.")
CHUNK = 16
RELEASE_S = 2.0  # every stage releases within 2 seconds


def _start(model_path, n_stages: int, tmp_path_factory, name: str, *, config: dict | None = None) -> Pipeline:
    work = tmp_path_factory.mktemp(name)
    split_for_test(model_path, n_stages, work)
    pipe = Pipeline(work / "topology.toml", work, config=config)
    return pipe.start()


@pytest.fixture(scope="module")
def smol2(default_model_path, tmp_path_factory):
    pipe = _start(default_model_path, 2, tmp_path_factory, "smol2")
    yield pipe
    pipe.stop_cleanly()


@pytest.fixture(scope="module")
def smol3(default_model_path, tmp_path_factory):
    pipe = _start(default_model_path, 3, tmp_path_factory, "smol3", config={"runtime.prefill_chunk": CHUNK})
    yield pipe
    pipe.stop_cleanly()


@pytest.fixture(scope="module")
def tiny2(tiny_model_path, tmp_path_factory):
    pipe = _start(tiny_model_path, 2, tmp_path_factory, "tiny2", config={"runtime.prefill_chunk": CHUNK})
    yield pipe
    pipe.stop_cleanly()


@pytest.fixture(scope="module")
def tiny3(tiny_model_path, tmp_path_factory):
    pipe = _start(tiny_model_path, 3, tmp_path_factory, "tiny3", config={"runtime.prefill_chunk": CHUNK})
    yield pipe
    pipe.stop_cleanly()


@pytest.fixture(scope="module")
def driver(tiny3):
    d = Stage0Driver(tiny3.topology)
    yield d
    d.close()


@functools.cache
def reference(model_path, prompt: str, n: int, chunk: int = 512) -> list[int]:
    """Greedy tokens of the unsplit model in-process, without a final end-of-generation token."""
    with LocalPipeline([model_path], ContextParams(n_ctx_per_seq=1024, n_seq_max=1, n_threads=1)) as ref:
        out = ref.generate(ref.head.tokenize(prompt, parse_special=False), n, chunk=chunk)
        if out and ref.head.is_eog(out[-1]):
            out.pop()
        return out


async def assert_parity(pipe: Pipeline, model_path, prompts, n: int, *, chunk: int = 512) -> int:
    """Greedy parity; returns the decode steps the generations took."""
    steps = 0
    for prompt in prompts:
        got = await pipe.generate(prompt=prompt, raw=True, max_tokens=n)
        want = reference(model_path, prompt, n, chunk)
        assert got["tokens"] == want, prompt
        assert got["finish_reason"] == ("length" if len(want) == n else "stop")
        steps += len(want) - 1 if len(want) == n else len(want)  # an end-of-generation token is decoded too
    await pipe.wait_all_released(RELEASE_S)
    return steps


async def sent_at_compute_end(pipe: Pipeline) -> list[int]:
    """Each stage's decode steps whose answer (a forward, a prediction) native code wrote as the compute
    ended, stage 0 first."""
    counts = [(await pipe.head.astatus())["head"]["scheduler"]["sent_at_compute_end"]]
    for k in range(1, len(pipe.stages)):
        (stage,) = (await pipe.stages[k].astatus())["stages"]
        counts.append(stage["scheduler"]["sent_at_compute_end"])
    return counts


async def assert_answers_sent_at_compute_end(pipe: Pipeline, before: list[int], steps: int) -> None:
    # a lone session's decode steps compute inline, each stage's answer written from native code as its
    # compute ends (the first steps of a generation may compute elsewhere, written as any other frame)
    grown = [a - b for a, b in zip(await sent_at_compute_end(pipe), before)]
    assert all(steps // 2 <= g <= steps for g in grown), (grown, steps)


# ---------------------------------------------------------------------------- parity


async def test_two_process_greedy_matches_unsplit(smol2, default_model_path):
    before = await sent_at_compute_end(smol2)
    steps = await assert_parity(smol2, default_model_path, PROMPTS, 32)
    await assert_answers_sent_at_compute_end(smol2, before, steps)


async def test_three_process_greedy_matches_unsplit(smol3, default_model_path):
    before = await sent_at_compute_end(smol3)
    steps = await assert_parity(smol3, default_model_path, PROMPTS[:1], 32, chunk=CHUNK)
    steps += await assert_parity(smol3, default_model_path, [LONG_PROMPT], 16, chunk=CHUNK)
    await assert_answers_sent_at_compute_end(smol3, before, steps)


async def test_tiny_two_process_matches_unsplit(tiny2, tiny_model_path):
    await assert_parity(tiny2, tiny_model_path, [*PROMPTS, LONG_PROMPT], 40, chunk=CHUNK)


async def test_tiny_three_process_matches_unsplit(tiny3, tiny_model_path):
    await assert_parity(tiny3, tiny_model_path, [*PROMPTS, LONG_PROMPT], 40, chunk=CHUNK)


@pytest.fixture
def tiny3_all_in_one(tiny3, tmp_path_factory):
    work = tmp_path_factory.mktemp("tiny3all")
    pipe = Pipeline(retarget(tiny3.topology_path, work), work, config={"runtime.prefill_chunk": CHUNK})
    pipe.start_all_in_one()
    yield pipe
    pipe.stop_cleanly()


async def test_stage_all_in_one_daemon_matches_unsplit(tiny3_all_in_one, tiny_model_path):
    snap = await tiny3_all_in_one.stage_sessions()
    assert sorted(snap) == [0, 1, 2]  # one daemon, three stages, each with its own listener
    await assert_parity(tiny3_all_in_one, tiny_model_path, [LONG_PROMPT], 24, chunk=CHUNK)


async def test_driver_speaks_the_protocol(tiny3, driver, tiny_model_path):
    """The in-test stage 0 gets the unsplit model's tokens: it is a faithful stand-in for the head."""
    prompt = driver.tokenize(LONG_PROMPT)
    link = await driver.connect()
    try:
        got = await driver.generate(link, 1, prompt, 24, chunk=CHUNK)
    finally:
        await link.aclose()
    assert got == reference(tiny_model_path, LONG_PROMPT, 24, CHUNK)[:24]
    await tiny3.wait_all_released(RELEASE_S)


# ---------------------------------------------------------------------------- cleanup


async def assert_next_generation_works(pipe: Pipeline, model_path) -> None:
    await assert_parity(pipe, model_path, PROMPTS[:1], 8, chunk=CHUNK)


async def assert_live(pipe: Pipeline, stages: list[int], n: int = 1) -> None:
    snap = await pipe.stage_sessions()
    assert [snap[k]["live"] for k in stages] == [n] * len(stages), snap


async def test_driver_reset_mid_prefill_releases_everywhere(tiny3, driver, tiny_model_path):
    prompt = driver.tokenize(LONG_PROMPT)
    assert len(prompt) > 4 * CHUNK
    link = await driver.connect()
    assert isinstance(await driver.configure(link, 7), Ack)
    await driver.send_prefill(link, 7, prompt[:4 * CHUNK], chunk=CHUNK, final=False)
    await link.drain()  # stages 1 and 2 acked every chunk: the session is mid-prefill on both
    await assert_live(tiny3, [1, 2])
    await Stage0Driver.reset(link)
    await tiny3.wait_all_released(RELEASE_S)
    await assert_next_generation_works(tiny3, tiny_model_path)


async def test_driver_closes_mid_prefill_with_acks_outstanding(tiny3, driver, tiny_model_path):
    prompt = driver.tokenize(LONG_PROMPT)
    link = await driver.connect(credit_limit=100)
    assert isinstance(await driver.configure(link, 8), Ack)
    await driver.send_prefill(link, 8, prompt[:5 * CHUNK], chunk=CHUNK, final=False)
    assert link.pending_acks == 5
    await link.aclose()
    await tiny3.wait_all_released(RELEASE_S)
    await assert_next_generation_works(tiny3, tiny_model_path)


async def test_driver_closes_mid_decode_releases_everywhere(tiny3, driver, tiny_model_path):
    prompt = driver.tokenize(PROMPTS[0])
    link = await driver.connect()
    assert isinstance(await driver.configure(link, 9), Ack)
    reply = await driver.send_prefill(link, 9, prompt, chunk=CHUNK)
    token, pos = reply.token, len(prompt)
    for _ in range(3):
        reply = await driver.request(link, driver.decode_msg(9, token, pos))
        token, pos = reply.token, pos + 1
    await assert_live(tiny3, [1, 2])
    await link.aclose()
    await tiny3.wait_all_released(RELEASE_S)
    await assert_next_generation_works(tiny3, tiny_model_path)


async def test_driver_reset_with_a_decode_step_in_flight(tiny3, driver, tiny_model_path):
    prompt = driver.tokenize(PROMPTS[1])
    link = await driver.connect()
    assert isinstance(await driver.configure(link, 10), Ack)
    reply = await driver.send_prefill(link, 10, prompt, chunk=CHUNK)
    await link.send(driver.decode_msg(10, reply.token, len(prompt)))  # its reply will find no reader
    await Stage0Driver.reset(link)
    await tiny3.wait_all_released(RELEASE_S)
    await assert_next_generation_works(tiny3, tiny_model_path)


async def test_stop_twice(tiny3, driver, tiny_model_path):
    prompt = driver.tokenize(PROMPTS[0])
    link = await driver.connect()
    try:
        assert isinstance(await driver.configure(link, 11), Ack)
        reply = await driver.send_prefill(link, 11, prompt, chunk=CHUNK)
        reply = await driver.request(link, driver.decode_msg(11, reply.token, len(prompt)))
        assert isinstance(reply, PredictedToken)
        assert isinstance(await driver.stop(link, 11), Stopped)
        assert isinstance(await driver.stop(link, 11), Stopped)  # stopping twice is not an error
        assert isinstance(await driver.stop(link, 12345), Stopped)  # nor is stopping a session never seen
        await tiny3.wait_all_released(RELEASE_S)
        # the lane stays usable: a new generation on the same connection is exact
        got = await driver.generate(link, 11, prompt, 12, chunk=CHUNK)
        assert got == reference(tiny_model_path, PROMPTS[0], 12, CHUNK)[:12]
        # a decode for the stopped session is refused, not resurrected
        reply = await driver.request(link, driver.decode_msg(11, got[-1], len(prompt) + 11))
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.UNKNOWN_SESSION
    finally:
        await link.aclose()
    await tiny3.wait_all_released(RELEASE_S)


async def test_malformed_frame_closes_only_that_connection(tiny3, driver, tiny_model_path):
    prompt = driver.tokenize(PROMPTS[1])
    good = await driver.connect()
    bad = await driver.connect()
    try:
        assert isinstance(await driver.configure(good, 21), Ack)
        reply = await driver.send_prefill(good, 21, prompt, chunk=CHUNK)
        tokens = [reply.token]
        assert isinstance(await driver.configure(bad, 22), Ack)
        await assert_live(tiny3, [1, 2], 2)

        # a prefill whose activation length does not match token_count x n_embd x 4
        hidden = np.zeros((2, tiny3.topology.n_embd), dtype=np.float32)
        frame = bytearray(frame_bytes(PrefillChunk(99, 22, 0, prompt[:2], hidden)))
        frame[8 + 24:8 + 28] = (2 * tiny3.topology.n_embd * 4 - 4).to_bytes(4, "little")
        await bad.stream.send_all(bytes(frame))
        err = await read_reply(bad._receive, timeout=5)
        assert isinstance(err, ErrorReply) and err.code == ErrorCode.LENGTH_MISMATCH, err
        assert err.code.closes_connection and err.request_id == 99
        with pytest.raises(WireError):  # then the stage closes the connection
            await read_reply(bad._receive, timeout=5)

        # the other session did not notice
        pos = len(prompt)
        for _ in range(4):
            reply = await driver.request(good, driver.decode_msg(21, tokens[-1], pos))
            tokens.append(reply.token)
            pos += 1
        assert tokens == reference(tiny_model_path, PROMPTS[1], 5, CHUNK)[:5]
        assert isinstance(await driver.stop(good, 21), Stopped)
    finally:
        await good.aclose()
        await bad.aclose()
    await tiny3.wait_all_released(RELEASE_S)


async def _wait_generating(pipe: Pipeline, at_least: int = 3) -> int:
    """The session id of the head's running generation once it has produced `at_least` tokens."""
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        with trio.fail_after(20):
            while True:
                live = await client.call(m.SessionsList(id=client.new_id()))
                if live and live[0]["generated"] >= at_least:
                    return live[0]["session_id"]
                await trio.sleep(0.01)


async def test_cancelled_generation_releases_everywhere(tiny3, tiny_model_path):
    result = {}

    async def run():
        result.update(await tiny3.generate(prompt=LONG_PROMPT, raw=True, max_tokens=1500))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        session_id = await _wait_generating(tiny3)
        await assert_live(tiny3, [0, 1, 2])
        async with open_control(tiny3.head.url, tiny3.head.token_file) as client:
            await client.call(m.SessionKill(id=client.new_id(), session_id=session_id))
    assert result["finish_reason"] == "cancelled"
    assert 3 <= len(result["tokens"]) < 1500
    await tiny3.wait_all_released(RELEASE_S)
    await assert_next_generation_works(tiny3, tiny_model_path)


async def test_client_gone_mid_generation_releases_everywhere(tiny3, tiny_model_path):
    async with open_control(tiny3.head.url, tiny3.head.token_file) as client:
        await client.ws.send_message(m.dump(m.Generate(id="g", prompt=LONG_PROMPT, raw=True, max_tokens=1500)))
        await _wait_generating(tiny3)
    # the websocket is closed: the head cancels the generation
    await tiny3.wait_all_released(RELEASE_S)
    await assert_next_generation_works(tiny3, tiny_model_path)


@pytest.mark.parametrize(("victim", "how"), [(2, "sigkill"), (1, "sigkill"), (2, "sigterm-twice")],
                         ids=["sigkill-final-stage", "sigkill-middle-stage", "shutdown-final-stage"])
async def test_downstream_stage_dies_mid_decode(tiny3, tiny_model_path, victim, how):
    """SIGKILL, or a daemon shutdown that does not wait for the generation (a second SIGTERM skips the drain)."""
    errors = []

    async def run():
        try:
            await tiny3.generate(prompt=LONG_PROMPT, raw=True, max_tokens=1500)
        except ControlError as exc:
            errors.append(exc)

    # two generations at once leave the head with two idle lanes (two chains head -> 1 -> 2) ...
    async with trio.open_nursery() as nursery:
        for prompt in PROMPTS:
            nursery.start_soon(functools.partial(tiny3.generate, prompt=prompt, raw=True, max_tokens=4))
    # ... one carries this generation; the victim dies under it and under the idle one
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await _wait_generating(tiny3)
        daemon = tiny3.stages[victim]
        if how == "sigkill":
            daemon.kill()
        else:  # shutdown: cancels its connections, releases every session, exits 0
            daemon.signal(signal.SIGTERM)
            await trio.sleep(0.2)
            daemon.signal(signal.SIGTERM)
            await trio.to_thread.run_sync(daemon.wait_exit)
    assert errors and "fail" in str(errors[0]), errors  # a clean error, not a hang
    assert daemon.proc.returncode == (-signal.SIGKILL if how == "sigkill" else 0)
    await tiny3.wait_all_released(RELEASE_S)  # every surviving stage
    await tiny3.astart_stage(victim)
    await assert_next_generation_works(tiny3, tiny_model_path)
    await tiny3.wait_all_released(RELEASE_S)
