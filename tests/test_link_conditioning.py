"""Link conditioning (`stage.link_delay_ms`, `stage.link_mbps`): a fixed one-way delay and a bandwidth cap.

In-process: the conditioned send stream on trio's memory streams and
autojump clock (exact times, no waiting): each chunk arrives `delay` after it
was sent, in order, the sender never waits for it, and a bandwidth cap adds
each chunk's serialization time.

Real processes (the tiny model, so compute is a few milliseconds): with
20 ms on every link, a 2-stage pipeline's time per output token is at least
two one-way delays (head → stage 1 → head), a 3-stage pipeline's is at least
four with relayed predictions and three with direct token return, which is
measurably faster. Bounds are loose: the machine is shared and noisy.
"""

from __future__ import annotations

import statistics
import sys
import time

import pytest
import trio
import trio.testing

from skippyd.stage.conditioning import LinkShape, ShapedSendStream, _TimerFd
from tests.procs import Pipeline, retarget, split_for_test

DELAY_MS = 20.0
PROMPT = "Once upon a time, in a small village by the sea,"


# ---------------------------------------------------------------------------- in-process


async def _arrivals(receive: trio.abc.ReceiveStream, n_bytes: int, out: list) -> None:
    got = 0
    while got < n_bytes:
        data = await receive.receive_some()
        out.append((trio.current_time(), bytes(data)))
        got += len(data)


async def test_delay_applied_in_order_without_blocking_the_sender(autojump_clock):
    sender, receiver = trio.testing.memory_stream_pair()
    link = ShapedSendStream(sender, LinkShape(delay_ms=DELAY_MS))
    arrivals: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        nursery.start_soon(_arrivals, receiver, 6, arrivals)
        t0 = trio.current_time()
        await link.send_all(b"ab")
        assert trio.current_time() == t0  # the sender goes on at once, like on a real link
        await trio.sleep(0.005)
        await link.send_all(b"cd")
        await link.send_all(b"ef")
        await link.flush()
        link.close()
    times = [round((t - t0) * 1e3, 6) for t, _ in arrivals]
    assert b"".join(data for _, data in arrivals) == b"abcdef"
    assert times[0] == DELAY_MS
    assert times[-1] == DELAY_MS + 5


async def test_bandwidth_cap_serializes_chunks(autojump_clock):
    sender, receiver = trio.testing.memory_stream_pair()
    link = ShapedSendStream(sender, LinkShape(delay_ms=10, mbps=1.0))  # 12 500 bytes take 100 ms
    arrivals: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        nursery.start_soon(_arrivals, receiver, 25_000, arrivals)
        t0 = trio.current_time()
        await link.send_all(b"x" * 12_500)
        await link.send_all(b"y" * 12_500)  # queued behind the first: leaves 100 ms later
        assert trio.current_time() == t0
        await link.flush()
        link.close()
    first_y = next(t for t, data in arrivals if data.startswith(b"y"))
    assert round((arrivals[0][0] - t0) * 1e3, 6) == 110
    assert round((first_y - t0) * 1e3, 6) == 210


async def test_broken_link_is_reported_to_the_sender(autojump_clock):
    sender, receiver = trio.testing.memory_stream_pair()
    link = ShapedSendStream(sender, LinkShape(delay_ms=1))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        await receiver.aclose()
        await link.send_all(b"lost")
        await trio.sleep(0.01)
        assert link.broken
        with pytest.raises(trio.BrokenResourceError):
            await link.send_all(b"more")
        link.close()


async def test_a_frame_written_to_a_conditioned_link_is_queued_at_once(autojump_clock):
    """write_frame hands a conditioned link the whole frame without a schedule point (as it does a socket
    that takes it at once): the sender's next step is not delayed by the emulation; the frame arrives after
    the delay, whole. A broken link fails the write as a closed peer does."""
    from skippyd.wire.errors import PeerClosed
    from skippyd.wire.messages import Ack, StageStats
    from skippyd.wire.stream import ReceiveBuffer, read_reply, write_frame

    sender, receiver = trio.testing.memory_stream_pair()
    link = ShapedSendStream(sender, LinkShape(delay_ms=DELAY_MS))
    reply = Ack(7, 3, StageStats.single(1, compute_us=5))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        t0 = trio.current_time()
        with trio.testing.assert_no_checkpoints():
            n = await write_frame(link, reply, timeout=1.0)
        assert n > 0 and trio.current_time() == t0
        assert await read_reply(ReceiveBuffer(receiver), timeout=1.0) == reply
        assert trio.current_time() - t0 == pytest.approx(DELAY_MS / 1e3)
        await receiver.aclose()
        await write_frame(link, reply)
        await trio.sleep(0.1)
        with pytest.raises(PeerClosed):
            await write_frame(link, reply)
        link.close()


async def test_a_frame_written_at_its_compute_end_travels_from_then(autojump_clock):
    """A prepared frame that native code finished at the end of a compute (the Python after the compute
    still to run) is handed to a conditioned link with that time: it arrives the delay after the compute's
    end, as it would on a real link where the native code wrote it to the socket, and without a schedule
    point in the hand-over."""
    from skippyd.wire.stream import PreparedFrame, write_prepared

    sender, receiver = trio.testing.memory_stream_pair()
    link = ShapedSendStream(sender, LinkShape(delay_ms=DELAY_MS))
    prepared = PreparedFrame.for_stream(link, b"head", 4)
    assert prepared is not None and prepared.fd == -1
    arrivals: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        nursery.start_soon(_arrivals, receiver, 8, arrivals)
        prepared.frame[4:] = b"tail"
        prepared.done_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC) - 5_000_000  # the compute ended 5 ms ago
        t0 = trio.current_time()
        with trio.testing.assert_no_checkpoints():
            assert await write_prepared(link, prepared) == 8
        await link.flush()
        link.close()
    ((arrived, data),) = arrivals
    assert data == b"headtail"
    assert (arrived - t0) * 1e3 == pytest.approx(DELAY_MS - 5, abs=0.5)


async def test_aclose_lets_queued_bytes_arrive(autojump_clock):
    sender, receiver = trio.testing.memory_stream_pair()
    link = ShapedSendStream(sender, LinkShape(delay_ms=50))
    arrivals: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        nursery.start_soon(_arrivals, receiver, 3, arrivals)
        await link.send_all(b"bye")
        await link.aclose()
    assert arrivals and arrivals[0][1] == b"bye"
    with pytest.raises(trio.ClosedResourceError):
        await link.send_all(b"x")


async def test_the_wrapper_closes_as_its_stream_does(autojump_clock, nursery):
    """What is put around a stream where it is made is closed by its owner as the stream itself: ``aclose``
    lets the queued bytes arrive, then closes the stream; closed forcefully, it drops them."""
    sender, receiver = trio.testing.memory_stream_pair()
    assert LinkShape().wrap(sender, None) is sender  # no conditioning: the stream itself
    link = LinkShape(delay_ms=50).wrap(sender, nursery)
    await link.send_all(b"lost")
    await trio.aclose_forcefully(link)
    assert await receiver.receive_some() == b""  # the stream is closed, and nothing came before the close
    with pytest.raises(trio.ClosedResourceError):
        await link.send_all(b"x")


async def test_real_clock_chunks_never_arrive_early_and_keep_their_order():
    # the real clock: the transmit task waits on a timerfd (Linux) and then yields until the chunk is due
    sender, receiver = trio.testing.memory_stream_pair()
    link = ShapedSendStream(sender, LinkShape(delay_ms=3))
    arrivals: list = []
    sent_at = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        nursery.start_soon(_arrivals, receiver, 20, arrivals)
        for i in range(10):
            sent_at.append(trio.current_time())
            await link.send_all(b"%02d" % i)
            await trio.sleep(0.0007 * (i % 3))  # some chunks share a wait, some not
        await link.flush()
        link.close()
    assert b"".join(data for _, data in arrivals) == b"".join(b"%02d" % i for i in range(10))
    got = 0
    for t, data in arrivals:  # a read may hold several chunks: the last one's time bounds it
        got += len(data)
        assert t >= sent_at[got // 2 - 1] + 0.003


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")
async def test_timerfd_rearmed_after_a_cancelled_wait_does_not_fire_early():
    timer = _TimerFd.open()
    assert timer is not None
    try:
        with trio.move_on_after(0.001):
            await timer.sleep(0.002)
        await trio.sleep(0.003)  # the cancelled wait's expiry has passed: the fd is readable now
        started = trio.current_time()
        await timer.sleep(0.005)
        assert trio.current_time() - started >= 0.005
    finally:
        timer.close()


def test_shape_validation():
    assert not LinkShape().active
    assert LinkShape(delay_ms=1).active and LinkShape(mbps=10).active
    with pytest.raises(ValueError):
        LinkShape(delay_ms=-1)
    with pytest.raises(ValueError):
        LinkShape(mbps=float("inf"))


# ---------------------------------------------------------------------------- real processes


def _pipeline(topology, work, config: dict | None = None) -> Pipeline:
    # one thread per stage: these tests time the links; a tiny model gains nothing from more threads, and
    # llama.cpp's spinning workers would make its compute time depend on whatever else the host runs
    pipe = Pipeline(topology, work, extra=["--threads", "1"],
                    config={"runtime.prefill_chunk": 16, "stage.link_delay_ms": DELAY_MS, **(config or {})})
    return pipe.start()


async def _tpot_ms(pipe: Pipeline, rounds: int = 3, tokens: int = 16) -> float:
    """Median time per output token (ms) over a few greedy generations."""
    values = []
    for _ in range(rounds):
        got = await pipe.generate(prompt=PROMPT, raw=True, max_tokens=tokens)
        assert len(got["tokens"]) == tokens
        values.append(1e3 / got["timings"]["decode_tokens_per_s"])
    return statistics.median(values)


@pytest.fixture(scope="module")
def tiny_split3(tiny_model_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("cond3")
    split_for_test(tiny_model_path, 3, work)
    return work / "topology.toml"


@pytest.mark.slow  # real daemon processes
async def test_two_stages_with_delay_pay_two_one_way_delays_per_token(tiny_model_path, tmp_path):
    split_for_test(tiny_model_path, 2, tmp_path)
    pipe = await trio.to_thread.run_sync(_pipeline, tmp_path / "topology.toml", tmp_path)
    try:
        tpot = await _tpot_ms(pipe)
        two = (await pipe.generate(prompt=PROMPT, raw=True, max_tokens=2))["timings"]
        head = (await pipe.head.astatus())["head"]
    finally:
        await trio.to_thread.run_sync(pipe.stop)
    assert 2 * DELAY_MS <= tpot < 2 * DELAY_MS + 40, tpot
    # the rate ends with the last token in hand: the session's Stop after it (a round trip, two more delays)
    # counts in elapsed_ms, not as the second token's time
    gap_ms = 1e3 / two["decode_tokens_per_s"]
    assert 2 * DELAY_MS <= gap_ms < 3 * DELAY_MS, two
    assert two["elapsed_ms"] >= two["ttft_ms"] + gap_ms + 2 * DELAY_MS, two
    assert head["token_return"]["listen"] is None  # two stages: nothing to gain from direct return
    assert head["token_return"]["relayed"] > 0


@pytest.mark.slow  # real daemon processes
async def test_three_stages_direct_return_saves_one_delay_per_token(tiny_split3, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "r").mkdir()
    direct = await trio.to_thread.run_sync(_pipeline, retarget(tiny_split3, tmp_path / "d"), tmp_path / "d")
    try:
        relayed = await trio.to_thread.run_sync(_pipeline, retarget(tiny_split3, tmp_path / "r"), tmp_path / "r",
                                                {"runtime.direct_return": False})
        try:
            direct_ms, relayed_ms = [], []
            for _ in range(2):  # interleaved: the machine's speed drifts
                direct_ms.append(await _tpot_ms(direct, rounds=2))
                relayed_ms.append(await _tpot_ms(relayed, rounds=2))
            paths = [(await p.head.astatus())["head"]["token_return"] for p in (direct, relayed)]
        finally:
            await trio.to_thread.run_sync(relayed.stop)
    finally:
        await trio.to_thread.run_sync(direct.stop)
    d, r = statistics.median(direct_ms), statistics.median(relayed_ms)
    print(f"3 stages, {DELAY_MS:g} ms per link: direct {d:.1f} ms/token, relayed {r:.1f} ms/token")
    assert 3 * DELAY_MS <= d < 3 * DELAY_MS + 40, direct_ms
    assert 4 * DELAY_MS <= r < 4 * DELAY_MS + 40, relayed_ms
    assert d < r - DELAY_MS / 2, (direct_ms, relayed_ms)
    assert paths[0]["direct"] > 0 and paths[0]["relayed"] == 0
    assert paths[1]["direct"] == 0 and paths[1]["relayed"] > 0
