"""Stage 1's liveness as the head sees it, against real skippyd processes (default runtime.reply_timeout, 30 s).

A hung stage 1 (SIGSTOP) fails the running generation within 2 s, is shown
down in `status`, and new generations are refused with a retryable error
until it answers again (SIGCONT). A stage that is merely busy (a long
prefill chunk) answers the head's pings from its event loop while it
computes, and is not mistaken for a hung one.
"""

from __future__ import annotations

import contextlib
import functools
import math
import signal
import time

import pytest
import trio

from skippyctl.client import ControlError
from tests.procs import Daemon, Pipeline, retarget
from tests.test_faults import COUNT, PROBE, start_stream

pytestmark = pytest.mark.slow  # real daemon processes stopped


@pytest.fixture
async def pipe(splits, tmp_path):
    # batch/prefill_chunk 4096: one prefill chunk of thousands of tokens keeps stage 1 busy for seconds
    # (compute_lock off: without holding the host-wide lock other skippy processes here would wait on)
    pipe = Pipeline(retarget(splits[2], tmp_path), tmp_path, extra=["--lanes", "2", "--ctx", "4096"],
                    config={"runtime.batch": 4096, "runtime.prefill_chunk": 4096, "runtime.compute_lock": "off"})
    await trio.to_thread.run_sync(pipe.start)
    try:
        yield pipe
    finally:
        await trio.to_thread.run_sync(pipe.stop)


async def downstream(pipe: Pipeline) -> dict:
    return (await pipe.head.astatus())["head"]["downstream"]


async def hang_mid_decode(pipe: Pipeline, stage: Daemon):
    """SIGSTOP `stage` while a generation streams; the generation must end within 2 s. The caller sends
    SIGCONT (in a finally). Returns the ended stream."""
    async with trio.open_nursery() as nursery:
        s = await start_stream(pipe, nursery, prompt=COUNT, raw=True, max_tokens=256)
        await s.wait_pieces(3)
        injected = time.monotonic()
        stage.signal(signal.SIGSTOP)
        assert await s.wait_done(3), "the hung stage was not detected within 3 s"
    detection = s.ended_at - injected
    assert detection < 2.0, detection
    return s


async def test_hung_stage_is_down_in_status_and_new_work_is_refused_until_it_answers(pipe):
    reference = (await pipe.generate(**PROBE))["tokens"]
    assert (await downstream(pipe))["state"] == "up"
    stage1 = pipe.stages[1]
    with trio.fail_after(60):
        try:
            s = await hang_mid_decode(pipe, stage1)
            assert s.error is not None and s.error.code == "unavailable" and s.retryable
            assert "stage 1 at 127.0.0.1:" in str(s.error) and "not responding" in str(s.error), str(s.error)

            status = await pipe.head.astatus()
            watch = status["head"]["downstream"]
            assert watch["state"] == "down" and watch["stage"] == 1, watch
            assert "no answer to a liveness ping" in watch["error"]
            stage_1 = next(st for st in status["topology"]["stages"] if st["index"] == 1)
            assert stage_1["reachable"] is False and stage_1.get("state") == "down", stage_1

            started = time.monotonic()
            with pytest.raises(ControlError) as err:
                await pipe.generate(**PROBE)
            assert time.monotonic() - started < 2.0
            assert err.value.code == "unavailable", err.value
            assert "stage 1 at 127.0.0.1:" in str(err.value) and "is down" in str(err.value), str(err.value)
        finally:
            stage1.signal(signal.SIGCONT)
        # back: the next generation checks at once (no waiting for the watch's backoff)
        got = await pipe.generate(**PROBE)
        assert got["tokens"] == reference
        assert (await downstream(pipe))["state"] == "up"
        await pipe.wait_all_released()


async def test_a_busy_stage_answers_pings_and_is_not_taken_for_a_hung_one(pipe):
    """A 1000-token prefill chunk: stage 1 computes for seconds while the head waits (and pings). (The
    test is about pings, not speed: the chunk is small enough for a slow host to finish within the reply
    deadline.)"""
    before = await downstream(pipe)  # (the head may have checked before stage 1 listened: a failed check)
    with trio.fail_after(120):
        got = await pipe.generate(prompt="word" + " word" * 999, raw=True, max_tokens=4)
    assert got["usage"]["prompt_tokens"] == 1000 and got["finish_reason"] == "length"
    watch = await downstream(pipe)
    assert watch["state"] == "up" and watch["failed_checks"] == before["failed_checks"], watch
    assert watch["pings"] > before["pings"], "the head never waited long enough to ping: the test proves nothing"
    assert watch["last_rtt_ms"] < 500, watch
    await pipe.wait_all_released()


@pytest.mark.parametrize("direct", [True, False], ids=["direct-return", "relayed"])
async def test_hung_final_stage_of_three_is_named_within_2s(splits, tmp_path, direct):
    """SIGSTOP stage 2 of 3: stage 1 is alive, so the head's ping goes through it; stage 1 relays it with a
    shorter deadline and names stage 2. With direct return the head waits on the token-return connection,
    which stage 1 never waits on: only the relayed ping can tell."""
    pipe = Pipeline(retarget(splits[3], tmp_path), tmp_path,
                    extra=["--lanes", "2", "--ctx", "1024"],
                    config={"runtime.compute_lock": "off", "runtime.direct_return": direct})
    await trio.to_thread.run_sync(pipe.start)
    try:
        reference = (await pipe.generate(**PROBE))["tokens"]
        stage2 = pipe.stages[2]
        with trio.fail_after(60):
            try:
                s = await hang_mid_decode(pipe, stage2)
                assert s.error.code == "unavailable" and s.retryable, s.error
                assert str(s.error).startswith("pipeline failed: stage 2 failed: ") and "liveness ping" in \
                    str(s.error), str(s.error)
                watch = await downstream(pipe)
                assert watch["state"] == "down" and watch["stage"] == 2, watch
                with pytest.raises(ControlError) as err:
                    await pipe.generate(**PROBE)
                assert err.value.code == "unavailable" and "stage 2" in str(err.value), str(err.value)
            finally:
                stage2.signal(signal.SIGCONT)
            got = await pipe.generate(**PROBE)
            assert got["tokens"] == reference
            assert (await downstream(pipe))["state"] == "up"
            await pipe.wait_all_released()
    finally:
        await trio.to_thread.run_sync(pipe.stop)


# ---------------------------------------------------------------------------- silent peers (no daemon)
async def test_keep_alive_probes_a_quiet_link_every_second():
    """The kernel probes a stage link after a second of quiet and gives it up about peer_timeout after its
    peer's host last answered; only a side that sends small frames also bounds unacknowledged data."""
    import socket

    from skippyd.wire.stream import keep_alive

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        sock = stream.socket
        keep_alive(stream)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 2  # probes at 1 s and 2 s; gone at 3 s
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0
        keep_alive(stream, peer_timeout=5.0, user_timeout=True)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 4
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 5000
    finally:
        await stream.aclose()
        for listener in listeners:
            await listener.aclose()


def test_timed_out_tells_a_silent_host_from_a_close():
    import errno

    from skippyd.wire.errors import PeerClosed
    from skippyd.wire.stream import timed_out

    def broken(err: int) -> PeerClosed:
        try:
            try:
                raise OSError(err, "x")
            except OSError as exc:
                raise PeerClosed("connection broken", mid_frame=True) from exc
        except PeerClosed as exc:
            return exc

    assert timed_out(broken(errno.ETIMEDOUT))
    assert not timed_out(broken(errno.ECONNRESET))
    assert not timed_out(PeerClosed("peer closed the connection"))


class _StuckClient:
    """A control client's websocket whose messages never go out (it stopped reading)."""

    remote = None  # the log line copes with an address it cannot tell

    def __init__(self, send_s: float = math.inf):
        self.send_s = send_s
        self.closed = False
        self._stream = self  # what the deadline closes

    async def send_message(self, text) -> None:
        await trio.sleep(self.send_s)

    async def aclose(self) -> None:
        self.closed = True


async def test_control_client_that_stops_reading_is_dropped(autojump_clock):
    from skippyd.control import messages as cm
    from skippyd.control.server import _Connection

    ws = _StuckClient()
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        conn = _Connection(ws, nursery, 10.0)
        nursery.start_soon(conn.keep_deadline)
        nursery.start_soon(conn, cm.Error("1", "a message the client never takes"))
        await trio.sleep_forever()  # the connection's requests: cancelled with it
    assert conn.dropped and ws.closed
    assert 10.0 <= trio.current_time() - started <= 12.6


async def test_control_client_that_reads_slowly_is_kept(autojump_clock):
    from skippyd.control import messages as cm
    from skippyd.control.server import _Connection

    ws = _StuckClient(send_s=6.0)  # each message slow, none past the deadline
    async with trio.open_nursery() as nursery:
        conn = _Connection(ws, nursery, 10.0)
        nursery.start_soon(conn.keep_deadline)
        for i in range(5):
            await conn(cm.Error(str(i), "slow"))
        nursery.cancel_scope.cancel()
    assert not conn.dropped and not ws.closed


async def test_idle_lanes_of_a_dead_final_stage_are_replaced(splits, tmp_path):
    """Stage 2 of 3 dies while no generation runs: stage 1 closes the idle lanes whose link to it died, the head
    drops them from its pool (instead of handing one to the next generation), and once stage 2 is back the
    next generation is served."""
    pipe = Pipeline(retarget(splits[3], tmp_path), tmp_path, extra=["--lanes", "2", "--ctx", "1024"],
                    config={"runtime.compute_lock": "off"})
    await trio.to_thread.run_sync(pipe.start)
    try:
        reference = (await pipe.generate(**PROBE))["tokens"]
        pipe.stages[2].kill()
        with trio.fail_after(5):  # checked every second on stage 1, pruned every second on the head
            while "is dead" not in pipe.head.log():
                await trio.sleep(0.1)
        assert "closing idle upstream" in pipe.stages[1].log() and "to stage 2 at" in pipe.stages[1].log()
        await pipe.astart_stage(2)
        with trio.fail_after(30):
            while True:
                try:
                    got = await pipe.generate(**PROBE)
                    break
                except ControlError as exc:
                    assert exc.code == "unavailable", exc  # stage 2 not yet back everywhere: retryable
                    await trio.sleep(0.2)
        assert got["tokens"] == reference
        await pipe.wait_all_released()
    finally:
        await trio.to_thread.run_sync(pipe.stop)


# ---------------------------------------------------------------------------- the ping's deadline (no daemon)
_N_EMBD = 8


async def _answering_stage(delays: list, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A stage 1 in this process that answers each Ping after the next of ``delays`` seconds (at once when
    there is none; None: never)."""
    from skippyd.wire.handshake import handshake_server
    from skippyd.wire.messages import Ack, Hello
    from skippyd.wire.stream import ReceiveBuffer, read_message, write_frame

    theirs = Hello(fingerprint=bytes(32), stage_index=1, layer_start=2, layer_end=4, n_layer=4, n_embd=_N_EMBD)

    async def answer(stream: trio.SocketStream) -> None:
        receive = ReceiveBuffer(stream)
        await handshake_server(stream, theirs, timeout=10, receive=receive)
        while True:
            ping = await read_message(receive, timeout=math.inf, n_embd=_N_EMBD)
            delay = delays.pop(0) if delays else 0.0
            if delay is None:
                await trio.sleep_forever()
            await trio.sleep(delay)
            await write_frame(stream, Ack(ping.request_id, 0))

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(functools.partial(_closing, answer), listeners)


async def _closing(handler, stream: trio.SocketStream) -> None:
    async with stream:
        with contextlib.suppress(Exception):
            await handler(stream)


async def test_a_stage_that_answers_late_is_given_longer_and_one_that_stops_is_found_within_seconds():
    """The watch's deadline is no constant: a floor of PING_TIMEOUT_S while stage 1 answers at once (so a stage
    that then stops is found as fast as ever), longer once it has been answering late (alive, busy: a loaded
    host), so that an answer later than any fixed 1 s deadline still counts; at most PING_TIMEOUT_MAX_S."""
    from skippyd.head.liveness import PING_TIMEOUT_MAX_S, PING_TIMEOUT_S, StageWatch
    from skippyd.wire.messages import Hello

    ours = Hello(fingerprint=bytes(32), stage_index=0, layer_start=0, layer_end=2, n_layer=4, n_embd=_N_EMBD)
    delays: list = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_answering_stage, delays)
        watch = StageWatch("127.0.0.1", port, ours)
        for _ in range(3):
            assert await watch.check(), watch.last_error
        assert watch.ping_timeout == PING_TIMEOUT_S and watch.describe()["ping_timeout_s"] == PING_TIMEOUT_S
        delays.extend([0.8] * 4)
        for _ in range(4):
            assert await watch.check(), watch.last_error
        assert 1.6 <= watch.ping_timeout < 1.8, watch.ping_timeout
        delays.append(1.3)  # later than a fixed 1 s deadline: alive all the same
        assert await watch.check(), watch.last_error
        assert watch.failures == 0 and watch.up
        delays.append(None)  # and now it stops answering
        started = trio.current_time()
        assert not await watch.check()
        took = trio.current_time() - started
        assert 2.5 <= took <= PING_TIMEOUT_MAX_S + 0.2, took
        assert watch.down and "no answer to a liveness ping within 2." in watch.last_error, watch.last_error
        await watch._drop()
        nursery.cancel_scope.cancel()
