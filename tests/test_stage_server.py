"""The stage server in-process: deadlines, and session cleanup on every way a connection can end.

A real StageServer (tiny model, real libllama) on a loopback port 0, driven
with the daemon's own DownstreamLink. Deadline tests run on trio's
autojump clock, so "60 s idle" takes no time; they avoid computes (a compute
runs in a worker thread, during which the autojump clock would move on).
"""

from __future__ import annotations

import math
import os
import socket
import time

import numpy as np
import pytest
import trio

from skippyd.stage.core import StageCore
from skippyd.stage.downstream import DownstreamError, DownstreamLink
from skippyd.stage.roles import FinalStage
from skippyd.stage.server import StageConfig, StageServer
from skippyd.wire.codec import frame_bytes
from skippyd.wire.errors import PeerClosed
from skippyd.wire.handshake import handshake_server
from skippyd.wire.messages import (
    Ack,
    ConfigureGeneration,
    DecodeStep,
    ErrorCode,
    ErrorReply,
    Hello,
    Ping,
    PredictedToken,
    PrefillChunk,
    SamplingParams,
    Stop,
    Stopped,
)
from skippyd.wire.stream import KEEPALIVE_IDLE_S, ReceiveBuffer, read_frame, read_message, write_frame
from tests.procs import split_for_test


@pytest.fixture(scope="module")
def split3(tiny_model_small_vocab_path, tmp_path_factory):
    """The tiny model (512-token vocabulary) cut into 3 stages; nothing listens on their ports."""
    return split_for_test(tiny_model_small_vocab_path, 3, tmp_path_factory.mktemp("split3"))


def stage_hello(topology, k: int, **kw) -> Hello:
    spec = topology.stage(k)
    return Hello(**{"fingerprint": topology.source_sha256, "stage_index": k, "layer_start": spec.layer_start,
                    "layer_end": spec.layer_end, "n_layer": topology.n_layer, "n_embd": topology.n_embd,
                    "node": f"test-{k}", **kw})


def config(**kw) -> StageConfig:
    return StageConfig(**{"n_ctx_per_seq": 256, "lanes": 2, "n_batch": 64, "n_threads": 1,
                          "listen_host": "127.0.0.1", "listen_port": 0, **kw})


async def connect(server: StageServer, **kw) -> DownstreamLink:
    return await DownstreamLink.connect("127.0.0.1", server.port, stage_hello(server.topology, server.index - 1),
                                        **kw)


def activation(n: int, n_embd: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, n_embd), dtype=np.float32)


def released(server: StageServer) -> bool:
    snap = server.snapshot()
    return snap["live_sessions"] == 0 and snap["free_slots"] == snap["n_seq_max"]


async def wait_released(server: StageServer, timeout: float = 2.0) -> None:
    with trio.fail_after(timeout):
        while not released(server):
            await trio.sleep(0.01)


async def open_session(link: DownstreamLink, session_id: int, n_embd: int, *, prompt: int = 5) -> int:
    """Configure + prefill a session on a final stage; returns the first predicted token."""
    reply, *_ = await link.request(ConfigureGeneration(1, session_id, SamplingParams.greedy()))
    assert isinstance(reply, Ack), reply
    tokens = np.arange(1, prompt + 1, dtype=np.int32)
    reply, *_ = await link.request(PrefillChunk(2, session_id, 0, tokens, activation(prompt, n_embd), final=True))
    assert isinstance(reply, PredictedToken), reply
    return reply.token


@pytest.fixture
async def final_stage(split3, nursery):
    """Stage 2 (the final stage) of the split, in-process; yields the running StageServer."""
    return await nursery.start(StageServer(split3, 2, config(idle_timeout_s=60.0, handshake_timeout_s=5.0)).run)


# ---------------------------------------------------------------------------- deadlines


async def test_idle_upstream_is_closed_and_its_session_released(final_stage, autojump_clock):
    link = await connect(final_stage)
    reply, *_ = await link.request(ConfigureGeneration(1, 5, SamplingParams.greedy()))
    assert isinstance(reply, Ack) and final_stage.snapshot()["live_sessions"] == 1
    start = trio.current_time()
    await trio.sleep(59)
    assert final_stage.snapshot()["live_sessions"] == 1 and link.looks_alive()
    await wait_released(final_stage, timeout=5)
    assert 60 <= trio.current_time() - start < 62
    assert not link.looks_alive()  # the stage closed the lane
    await link.aclose()


async def test_silent_dialer_is_dropped_at_the_handshake_deadline(final_stage, autojump_clock):
    stream = await trio.open_tcp_stream("127.0.0.1", final_stage.port)
    start = trio.current_time()
    with trio.fail_after(30):
        assert await stream.receive_some(100) == b""  # no hello from us: closed, without a word
    assert 5 <= trio.current_time() - start < 6
    await stream.aclose()


async def silent_peer(hello: Hello, *, handshake: bool, task_status=trio.TASK_STATUS_IGNORED):
    """A listener that accepts, optionally completes the handshake, then never says another word."""

    async def handle(stream):
        if handshake:
            receive = ReceiveBuffer(stream)
            peer = await handshake_server(stream, hello, timeout=5, receive=receive)
            while True:  # read everything, answer nothing
                await read_message(receive, timeout=math.inf, n_embd=peer.n_embd)
        await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handle, listeners)
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.sleep_forever()


@pytest.mark.parametrize("watched", [False, True], ids=["scoped", "watched"])
async def test_downstream_reply_deadline_against_a_silent_peer(split3, nursery, autojump_clock, watched):
    """The reply deadline, by a cancel scope per read, or (given a nursery) kept by the link's WaitWatch."""
    port = await nursery.start(lambda task_status: silent_peer(stage_hello(split3, 2), handshake=True,
                                                               task_status=task_status))
    link = await DownstreamLink.connect("127.0.0.1", port, stage_hello(split3, 1), reply_timeout=30,
                                        nursery=nursery if watched else None)
    assert link.interruptible == watched
    start = trio.current_time()
    with pytest.raises(DownstreamError, match="no reply"):
        await link.request(Ping(1))
    assert 30 <= trio.current_time() - start < 31
    assert link.broken and not link.looks_alive()
    await link.aclose()


async def test_interrupted_link_fails_its_wait_at_once_and_every_later_use(split3, nursery, autojump_clock):
    """What the head's liveness watch does to a lane when stage 1 stops answering pings."""
    port = await nursery.start(lambda task_status: silent_peer(stage_hello(split3, 2), handshake=True,
                                                               task_status=task_status))
    link = await DownstreamLink.connect("127.0.0.1", port, stage_hello(split3, 1), reply_timeout=30,
                                        nursery=nursery)

    async def interrupt_later():
        await trio.sleep(2)
        link.interrupt("stage 1 is not responding")

    nursery.start_soon(interrupt_later)
    start = trio.current_time()
    with pytest.raises(DownstreamError, match="no reply: stage 1 is not responding"):
        await link.request(Ping(1))
    assert trio.current_time() - start == pytest.approx(2)
    assert link.broken
    with pytest.raises(DownstreamError, match="link given up: stage 1 is not responding"):
        await link.request(Ping(2))
    await link.aclose()


async def test_downstream_handshake_deadline_against_a_silent_peer(split3, nursery, autojump_clock):
    port = await nursery.start(lambda task_status: silent_peer(stage_hello(split3, 2), handshake=False,
                                                               task_status=task_status))
    start = trio.current_time()
    with pytest.raises(DownstreamError, match="handshake failed"):
        await DownstreamLink.connect("127.0.0.1", port, stage_hello(split3, 1), connect_timeout=5)
    assert 5 <= trio.current_time() - start < 6


async def test_deferred_acks_wait_for_credit_then_time_out(split3, nursery, autojump_clock):
    """Acks are deferred up to the credit limit; the one over the limit must come within the deadline."""
    port = await nursery.start(lambda task_status: silent_peer(stage_hello(split3, 2), handshake=True,
                                                               task_status=task_status))
    link = await DownstreamLink.connect("127.0.0.1", port, stage_hello(split3, 1), credit_limit=2, reply_timeout=10)
    n_embd = split3.n_embd
    for i in range(2):  # within credit: sent without waiting
        await link.send_deferred(PrefillChunk(i, 1, 4 * i, np.arange(4), activation(4, n_embd)))
    assert link.pending_acks == 2 and trio.current_time() == 0
    with pytest.raises(DownstreamError, match="no reply"):
        await link.send_deferred(PrefillChunk(3, 1, 8, np.arange(4), activation(4, n_embd)))
    assert trio.current_time() == pytest.approx(10, abs=0.5)
    await link.aclose()


# ---------------------------------------------------------------------------- cleanup


def keepalive_of(sock) -> tuple[int, int]:
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE))


async def test_both_ends_of_a_stage_link_probe_it_when_idle(final_stage):
    """TCP keepalive on the lane, at the dialer and at the stage that accepted it: a peer that vanished
    without a FIN (host down, a NAT that forgot the lane) is found by the probes, not by the next request."""
    link = await connect(final_stage)
    try:
        assert keepalive_of(link.stream.socket) == (1, KEEPALIVE_IDLE_S)
        with trio.fail_after(2):
            while not final_stage.connections:
                await trio.sleep(0.01)
        (accepted,) = final_stage.connections.values()
        assert keepalive_of(accepted.stream.socket) == (1, KEEPALIVE_IDLE_S)
    finally:
        await link.aclose()


async def test_stop_releases_and_stop_again_is_harmless(final_stage):
    link = await connect(final_stage)
    n_embd = final_stage.topology.n_embd
    token = await open_session(link, 9, n_embd)
    reply, *_ = await link.request(DecodeStep(3, 9, 5, [token], activation(1, n_embd, 1)))
    assert isinstance(reply, PredictedToken)
    assert final_stage.snapshot()["sessions"][0]["position"] == 6
    for _ in range(2):
        reply, *_ = await link.request(Stop(4, 9))
        assert isinstance(reply, Stopped) and released(final_stage)
    reply, *_ = await link.request(DecodeStep(5, 9, 6, [token], activation(1, n_embd, 1)))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.UNKNOWN_SESSION
    await link.aclose()


async def test_upstream_close_releases_every_session_it_owned(final_stage):
    n_embd = final_stage.topology.n_embd
    a, b = await connect(final_stage), await connect(final_stage)
    await open_session(a, 1, n_embd)
    await open_session(b, 1, n_embd)  # same session id, other connection: another session
    assert final_stage.snapshot()["live_sessions"] == 2 and final_stage.snapshot()["free_slots"] == 0
    conn_a, conn_b = [s["connection"] for s in final_stage.snapshot()["sessions"]]
    reply, *_ = await a.request(ConfigureGeneration(3, 2, SamplingParams.greedy()))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.NO_CAPACITY  # and the lane stays usable
    await a.aclose()
    with trio.fail_after(2):
        while final_stage.snapshot()["live_sessions"] != 1:
            await trio.sleep(0.01)
    assert [s["connection"] for s in final_stage.snapshot()["sessions"]] == [conn_b] != [conn_a]
    reply, *_ = await b.request(Stop(4, 1))
    assert isinstance(reply, Stopped) and released(final_stage)
    await b.aclose()


async def test_exception_in_a_handler_costs_one_connection(final_stage, monkeypatch):
    async def broken(self, msg):
        raise RuntimeError("a bug in the decode handler")

    monkeypatch.setattr(FinalStage, "on_decode", broken)
    n_embd = final_stage.topology.n_embd
    other = await connect(final_stage)
    await open_session(other, 2, n_embd)
    link = await connect(final_stage)
    token = await open_session(link, 1, n_embd)
    with pytest.raises(DownstreamError):  # the connection is closed, without a reply
        await link.request(DecodeStep(3, 1, 5, [token], activation(1, n_embd)))
    with trio.fail_after(2):
        while final_stage.snapshot()["live_sessions"] != 1:
            await trio.sleep(0.01)
    reply, *_ = await other.request(Stop(3, 2))  # the other connection did not notice
    assert isinstance(reply, Stopped) and released(final_stage)
    await link.aclose()
    await other.aclose()


async def test_a_release_that_raises_leaves_the_connections_other_sessions_released(final_stage, monkeypatch):
    """A bug releasing one session of a closed connection (logged) does not keep its other sessions held."""
    n_embd = final_stage.topology.n_embd
    link = await connect(final_stage)
    await open_session(link, 1, n_embd)
    await open_session(link, 2, n_embd)
    release = StageCore.release
    failed = []

    async def first_one_fails(self, session):
        if not failed:
            failed.append(session.session_id)
            raise RuntimeError("a bug in the release")
        await release(self, session)

    monkeypatch.setattr(StageCore, "release", first_one_fails)
    await link.aclose()
    with trio.fail_after(2):
        while final_stage.snapshot()["live_sessions"] != 1:
            await trio.sleep(0.01)
    assert [s["session_id"] for s in final_stage.snapshot()["sessions"]] == failed  # only the failed one


async def test_shutdown_releases_every_session(split3):
    server = StageServer(split3, 2, config())
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        links = [await connect(server) for _ in range(2)]
        for i, link in enumerate(links):
            await open_session(link, i, split3.n_embd)
        assert server.snapshot()["free_slots"] == 0
        nursery.cancel_scope.cancel()
    assert released(server) and server.connections == {}
    for link in links:
        assert not link.looks_alive()
        await link.aclose()


async def test_shutdown_in_the_middle_of_a_compute(split3):
    """Cancelled while a prefill runs in the worker thread: the compute ends, then its KV is cleared and freed."""
    server = StageServer(split3, 2, config())
    computing = trio.Event()
    cleared = []
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        compute, clear = server.scheduler.execution.compute_sync, server.context.kv_clear_seq

        def slow_compute(batch):
            trio.from_thread.run_sync(computing.set)
            time.sleep(0.3)
            return compute(batch)

        def spy_clear(seq):
            cleared.append((seq, computing.is_set()))
            clear(seq)

        server.scheduler.execution.compute_sync = slow_compute
        server.context.kv_clear_seq = spy_clear
        link = await connect(server)
        reply, *_ = await link.request(ConfigureGeneration(1, 1, SamplingParams.greedy()))
        await link.send(PrefillChunk(2, 1, 0, np.arange(32), activation(32, split3.n_embd), final=True))
        await computing.wait()
        nursery.cancel_scope.cancel()
    assert released(server) and len(cleared) == 1
    await link.aclose()


async def test_middle_stage_refuses_upstream_when_its_downstream_is_away(split3):
    """A lane is accepted only if it leads somewhere: with stage 2 down, stage 1 refuses and says why."""
    server = StageServer(split3, 1, config())
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        with pytest.raises(DownstreamError, match="downstream unavailable: stage 2 at 127.0.0.1:"):
            await connect(server)
        assert released(server) and server.connections == {}
        nursery.cancel_scope.cancel()


async def test_middle_stage_releases_when_its_downstream_dies(split3, nursery):
    """Stage 1 in-process, a fake stage 2 that dies after the handshake: the session is freed, upstream told."""
    nxt = split3.stage(2)
    died = trio.Event()

    async def dying_stage2(stream):
        receive = ReceiveBuffer(stream)
        peer = await handshake_server(stream, stage_hello(split3, 2), timeout=5, receive=receive)
        await read_message(receive, timeout=5, n_embd=peer.n_embd)  # the ConfigureGeneration
        await trio.aclose_forcefully(stream)
        died.set()

    listeners = await trio.open_tcp_listeners(nxt.port, host=nxt.host)
    nursery.start_soon(trio.serve_listeners, dying_stage2, listeners)
    server = await nursery.start(StageServer(split3, 1, config()).run)
    link = await connect(server)
    reply, *_ = await link.request(ConfigureGeneration(1, 1, SamplingParams.greedy()))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.DOWNSTREAM_FAILED, reply
    assert "stage 2 failed" in reply.message
    await wait_released(server)
    assert not link.looks_alive() or await _eof(link)
    await link.aclose()


async def _eof(link: DownstreamLink) -> bool:
    with trio.fail_after(2):
        return await link.stream.receive_some(10) == b""


# ---------------------------------------------------------------------------- zero-copy receive


async def test_activation_goes_from_the_socket_into_its_array(monkeypatch):
    """A large activation is received with recv_into into the buffer numpy views: no intermediate bytes."""
    a, b = trio.socket.socketpair()
    sender, receiver = trio.SocketStream(a), trio.SocketStream(b)
    asked: list[int] = []
    receive_some = trio.SocketStream.receive_some

    async def spy(self, max_bytes=None):
        data = await receive_some(self, max_bytes)
        asked.append(len(data))
        return data

    monkeypatch.setattr(trio.SocketStream, "receive_some", spy)
    n, n_embd = 256, 576  # a prefill chunk of the default model: 590 KB of activation
    sent = PrefillChunk(1, 2, 0, np.arange(n), activation(n, n_embd))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_frame, sender, sent)
        got = await read_message(ReceiveBuffer(receiver), timeout=10, n_embd=n_embd)
    assert got == sent
    assert got.activation.flags.writeable and not got.activation.flags.owndata  # a view of the receive buffer
    assert sum(asked) <= 64 * 1024  # at most one read-ahead (header, tokens, a little activation) was copied
    await sender.aclose()
    await receiver.aclose()


async def test_failed_chunk_acked_before_compute_is_reported_on_the_next_reply(final_stage):
    """A non-final chunk is acked before compute; its failure comes back on the final chunk, and the lane lives."""
    link = await connect(final_stage)
    n_embd = final_stage.topology.n_embd
    reply, *_ = await link.request(ConfigureGeneration(1, 3, SamplingParams.greedy()))
    await link.send_deferred(PrefillChunk(2, 3, 4, np.arange(4), activation(4, n_embd)))  # a gap: [0, 4) missing
    await link.drain()  # acked all the same
    reply, *_ = await link.request(PrefillChunk(3, 3, 8, np.arange(4), activation(4, n_embd), final=True))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.POSITION_GAP, reply
    assert "holds 0 positions, message starts at 4" in reply.message
    reply, *_ = await link.request(Stop(4, 3))
    assert isinstance(reply, Stopped) and released(final_stage)
    assert await open_session(link, 4, n_embd) >= 0  # the lane still works
    await link.aclose()
    await wait_released(final_stage)


async def test_draining_stage_refuses_new_sessions_only(final_stage):
    link = await connect(final_stage)
    n_embd = final_stage.topology.n_embd
    token = await open_session(link, 1, n_embd)
    final_stage.begin_drain()
    assert final_stage.snapshot()["draining"]
    reply, *_ = await link.request(ConfigureGeneration(3, 2, SamplingParams.greedy()))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.SHUTTING_DOWN, reply
    reply, *_ = await link.request(DecodeStep(4, 1, 5, [token], activation(1, n_embd)))
    assert isinstance(reply, PredictedToken)  # the running one goes on
    reply, *_ = await link.request(Stop(5, 1))
    assert isinstance(reply, Stopped) and released(final_stage)
    await link.aclose()


@pytest.mark.parametrize("read_size", [0, 64 * 1024])
async def test_socket_eof_between_frames_is_a_clean_close(read_size):
    a, b = trio.socket.socketpair()
    sender, receiver = trio.SocketStream(a), trio.SocketStream(b)
    buf = ReceiveBuffer(receiver, read_size=read_size)
    await write_frame(sender, Stop(1, 2))
    await sender.send_all(frame_bytes(Stop(3, 4))[:20])  # then half a frame, then EOF
    await sender.aclose()
    assert await read_message(buf, timeout=5, n_embd=8) == Stop(1, 2)
    with pytest.raises(PeerClosed) as info:
        await read_message(buf, timeout=5, n_embd=8)
    assert info.value.mid_frame
    b2, a2 = trio.socket.socketpair()
    await trio.SocketStream(a2).aclose()
    with pytest.raises(PeerClosed) as info:
        await read_message(ReceiveBuffer(trio.SocketStream(b2), read_size=read_size), timeout=5, n_embd=8)
    assert not info.value.mid_frame
    await receiver.aclose()


async def test_both_ends_of_a_lane_send_without_delay(final_stage):
    """Replies and activations must not wait for Nagle: TCP_NODELAY on the dialer's and the acceptor's socket."""
    link = await connect(final_stage)
    reply, *_ = await link.request(Ping(1))  # the stage has registered the connection by now
    (conn,) = final_stage.connections.values()
    for sock in (link.stream.socket, conn.stream.socket):
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    await link.aclose()


async def test_direct_return_is_refused_not_ignored(final_stage):
    """Nothing listens at stage 0's address: a session asking for direct return gets a clear error (the head
    then configures again without it), not silence."""
    link = await connect(final_stage)
    reply, *_ = await link.request(ConfigureGeneration(1, 1, SamplingParams.greedy(), direct_return=True))
    assert isinstance(reply, ErrorReply) and "direct token return" in reply.message
    assert reply.code == ErrorCode.DIRECT_RETURN_UNAVAILABLE
    assert released(final_stage)
    await link.aclose()


async def test_final_stage_sends_no_lane_reply_for_a_direct_return_decode_step(final_stage):
    """A decode step with DIRECT_RETURN is answered on the token-return connection only, even when it fails
    (here: the session was not configured with direct return, and no return connection exists): nothing
    comes back on the lane for it, so the next request's reply is that request's own."""
    link = await connect(final_stage)
    n_embd = final_stage.topology.n_embd
    token = await open_session(link, 1, n_embd)
    await link.send(DecodeStep(3, 1, 5, [token], activation(1, n_embd), direct_return=True))
    reply, *_ = await link.request(Stop(4, 1))
    assert isinstance(reply, Stopped) and reply.request_id == 4, reply
    assert final_stage.snapshot()["returns_only"]["answered"] == 0  # it failed: not answered with a token
    await wait_released(final_stage)
    await link.aclose()


async def test_middle_stage_answers_a_failed_direct_return_decode_step_on_the_lane(split3, nursery):
    """A middle stage owes no reply for a decode step with DIRECT_RETURN, but it reports its failure on the
    lane, where the head watches for one (here: a session it does not know), and the lane goes on."""
    nxt = split3.stage(2)

    async def quiet_stage2(stream):
        await handshake_server(stream, stage_hello(split3, 2), timeout=5, receive=ReceiveBuffer(stream))
        await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(nxt.port, host=nxt.host)
    nursery.start_soon(trio.serve_listeners, quiet_stage2, listeners)
    server = await nursery.start(StageServer(split3, 1, config()).run)
    link = await connect(server)
    reply, *_ = await link.request(DecodeStep(1, 1, 0, [1], activation(1, split3.n_embd), direct_return=True))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.UNKNOWN_SESSION, reply
    with trio.move_on_after(0.5) as quiet:  # the connection stays open: nothing more comes, no EOF
        await link.stream.receive_some(10)
    assert quiet.cancelled_caught
    assert server.snapshot()["returns_only"]["unacked"] == 0
    await link.aclose()


# ---------------------------------------------------------------------------- a lane watched for silence


def _socket_link(nursery) -> tuple[DownstreamLink, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    stream = trio.SocketStream(a)
    peer = Hello(fingerprint=bytes(32), stage_index=1, layer_start=0, layer_end=1, n_layer=2, n_embd=8, node="t")
    link = DownstreamLink(stream, peer, "peer", ReceiveBuffer(stream), credit_limit=2, reply_timeout=5,
                          write_timeout=5, nursery=nursery)
    return link, trio.SocketStream(b)


async def test_a_step_written_at_its_compute_end_is_counted_though_cancelled(nursery):
    """A decode step whose frame native code wrote as its compute ended is on its way: a cancellation that
    arrives before the link's send (a kill while the task computed) must not leave the link unaware of it
    (its ack would then be read as the answer to something else). A frame not yet written is refused."""
    link, other = _socket_link(nursery)
    step = DecodeStep(5, 6, 3, [9], activation(1, 8))
    wire = frame_bytes(step)
    tail = step.activation.nbytes
    prepared = link.prepare_step(5, 6, 3, 9, False, 8)  # a float32 link (made without a handshake)
    assert prepared.frame[:-tail] == wire[:-tail]
    prepared.frame[-tail:] = wire[-tail:]
    os.write(prepared.fd, prepared.frame)  # as Context.decode_row_send does
    prepared.sent, prepared.done_ns = len(wire), time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    with trio.CancelScope() as scope:
        scope.cancel()
        assert await link.send_expecting_ack(step, prepared) == (len(wire), pytest.approx(0, abs=5e5))
    assert not scope.cancelled_caught and link.pending_acks == 1 and link.settled is False and not link.writing
    assert await read_frame(ReceiveBuffer(other), timeout=5, frame_timeout=5, n_embd=8) == step

    unwritten = link.prepare_step(5, 6, 3, 9, False, 8)
    with trio.CancelScope() as scope:
        scope.cancel()
        await link.send_expecting_ack(step, unwritten)  # done_ns 0: the compute went elsewhere
    assert scope.cancelled_caught and link.pending_acks == 1
    link.writing = True  # a frame half written: no frame may be prepared on the link
    assert link.prepare_step(5, 6, 3, 9, False, 8) is None
    link.writing = False
    await link.aclose()


async def test_watched_lane_calls_back_once_when_the_next_stage_speaks(nursery):
    link, other = _socket_link(nursery)
    spoke = []
    assert link.watch_silence(lambda: spoke.append(1)) and link.watching_silence
    await trio.sleep(0.05)
    assert spoke == []  # nothing said: no call, no read
    await write_frame(other, ErrorReply(1, 2, ErrorCode.CONTEXT_FULL, "full"))
    with trio.fail_after(5):
        while not spoke:
            await trio.sleep(0.01)
    reply = await link.read_unasked()  # the read takes the message, and ends the watch
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.CONTEXT_FULL
    assert spoke == [1] and not link.watching_silence
    await link.aclose()


async def test_a_read_before_the_watch_task_ran_keeps_the_socket(nursery):
    """A read right after watch_silence, before its task first ran, ends the watch; the task must then not
    wait on the socket the read waits on (trio would refuse the second waiter: BusyResourceError)."""
    link, other = _socket_link(nursery)
    link.watch_silence(lambda: None)

    async def answer_later():
        await trio.sleep(0.05)
        await write_frame(other, Ack(3, 4))

    nursery.start_soon(answer_later)
    with trio.fail_after(5):
        reply = await link.read_unasked()  # no schedule point before it: the watch task has not run
    assert isinstance(reply, Ack) and reply.request_id == 3
    await link.aclose()
