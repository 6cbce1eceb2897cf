"""Frames on trio streams: exact reads, deadlines, EOF, limits before allocation, fuzzing, handshake."""

from __future__ import annotations

import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from skippyd.wire.codec import MESSAGE_KINDS, REPLY_KINDS, frame_bytes
from skippyd.wire.errors import (
    HandshakeRefused,
    PeerClosed,
    ProtocolError,
    ReadTimeout,
    WireError,
    WriteTimeout,
)
from skippyd.wire.handshake import handshake_client, handshake_server
from skippyd.wire.messages import (
    PROTOCOL_VERSION,
    Ack,
    ConfigureGeneration,
    DecodeStep,
    ErrorCode,
    ErrorReply,
    Hello,
    HelloReply,
    Limits,
    MessageKind,
    Ping,
    PredictedToken,
    PredictedTokens,
    PrefillChunk,
    ReplyKind,
    Role,
    SamplingParams,
    StageStats,
    Stop,
    TrimSession,
    VerifyWindow,
)
from skippyd.wire.stream import (
    DEFAULT_PEER_TIMEOUT,
    KEEPALIVE_IDLE_S,
    KEEPALIVE_INTERVAL_S,
    PreparedFrame,
    ReceiveBuffer,
    WaitWatch,
    frame_deadline_s,
    keep_alive,
    keepalive_probes,
    read_frame,
    read_message,
    read_reply,
    send_buffer,
    write_frame,
    write_prepared,
)

N_EMBD = 8
FP = bytes(range(32))


class Trickle(trio.abc.ReceiveStream):
    """Hands out at most a few bytes per receive_some: every read is short."""

    def __init__(self, inner: trio.abc.ReceiveStream, seed: int = 0) -> None:
        self.inner = inner
        self.rng = random.Random(seed)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        n = self.rng.randint(1, 7)
        return await self.inner.receive_some(n if max_bytes is None else min(n, max_bytes))

    async def aclose(self) -> None:
        await self.inner.aclose()


class Broken(trio.abc.ReceiveStream):
    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        raise trio.BrokenResourceError("connection reset")

    async def aclose(self) -> None:
        pass


def sample_frames(n_embd: int = N_EMBD) -> list:
    rng = np.random.default_rng(0)
    return [
        ConfigureGeneration(1, 7, SamplingParams(temperature=0.5, logit_bias=[(3, -float("inf")), (9, 2.0)])),
        PrefillChunk(2, 7, 0, [1, 2, 3], rng.standard_normal((3, n_embd), dtype=np.float32)),
        PrefillChunk(3, 7, 3, np.arange(4000), rng.standard_normal((4000, n_embd), dtype=np.float32), final=True),
        PrefillChunk(4, 7, 0, [5, 6]),  # tokens only
        DecodeStep(5, 7, 4003, [42], rng.standard_normal((1, n_embd), dtype=np.float32)),
        VerifyWindow(6, 7, 4004, [1, 2, 3, 4], rng.standard_normal((4, n_embd), dtype=np.float32)),
        TrimSession(7, 7, 4004),
        Stop(8, 7),
        Ping(9),
        Ack(2, 7, StageStats.single(1, compute_us=10)),
        PredictedToken(5, 7, 17, StageStats.single(2, compute_us=900, bytes_sent=99)),
        PredictedTokens(6, 7, [1, 2, 3, 4]),
        ErrorReply(8, 7, ErrorCode.UNKNOWN_SESSION, "no session 7 — sorry"),
        Hello(FP, 1, 10, 20, 30, n_embd, node="stage-1"),
        HelloReply(False, "non-adjacent stage: …"),
    ]


async def feed(data: bytes, *, eof: bool = True) -> trio.abc.ReceiveStream:
    send, receive = trio.testing.memory_stream_one_way_pair()
    if data:
        await send.send_all(data)
    if eof:
        await send.aclose()
    return receive


# --------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("read_size", [0, 16, 64 * 1024, "trickle"])
async def test_frames_round_trip_over_a_stream(read_size):
    frames = sample_frames()
    send, receive = trio.testing.memory_stream_one_way_pair()
    source = Trickle(receive) if read_size == "trickle" else receive
    buf = ReceiveBuffer(source, read_size=16 if read_size == "trickle" else read_size)
    for frame in frames:
        written = await write_frame(send, frame, timeout=1)
        assert written == len(frame_bytes(frame))
    await send.aclose()
    # a generous timeout: trickled a few bytes per read, the 4000-row chunk takes ~30k reads (~1 s on a slow VM)
    for frame in frames:
        got = await read_frame(buf, timeout=20, n_embd=N_EMBD)
        assert got == frame
    with pytest.raises(PeerClosed) as info:
        await read_frame(buf, timeout=1, n_embd=N_EMBD)
    assert not info.value.mid_frame


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=64),
    read_size=st.sampled_from([0, 5, 4096]),
)
async def test_prefill_round_trip_hypothesis(tokens, read_size):
    act = np.random.default_rng(len(tokens)).standard_normal((len(tokens), N_EMBD), dtype=np.float32)
    msg = PrefillChunk(1, 2, 3, tokens, act)
    send, receive = trio.testing.memory_stream_one_way_pair()
    await write_frame(send, msg, timeout=1)
    got = await read_message(ReceiveBuffer(receive, read_size=read_size), timeout=1, n_embd=N_EMBD)
    assert got == msg


async def test_decoded_activation_is_a_writable_view_of_its_own_buffer():
    msg = sample_frames()[2]
    receive = await feed(frame_bytes(msg))
    got = await read_message(ReceiveBuffer(receive), timeout=1, n_embd=N_EMBD)
    assert got.activation.flags.writeable and got.activation.flags.c_contiguous
    owner = got.activation
    while isinstance(owner, np.ndarray | memoryview):
        owner = owner.obj if isinstance(owner, memoryview) else owner.base
    assert isinstance(owner, bytearray) and len(owner) == got.activation.nbytes


async def test_bare_stream_reads_exactly_and_loses_nothing():
    frames = sample_frames()[:5]
    receive = await feed(b"".join(frame_bytes(f) for f in frames))
    for frame in frames:
        assert await read_frame(receive, timeout=1, n_embd=N_EMBD) == frame


# --------------------------------------------------------------------------
# EOF, broken transports, deadlines


async def test_eof_mid_frame():
    wire = frame_bytes(sample_frames()[1])
    for cut in (1, 7, 8, 20, 40, len(wire) - 1):
        receive = await feed(wire[:cut])
        with pytest.raises(PeerClosed) as info:
            await read_frame(ReceiveBuffer(receive), timeout=1, n_embd=N_EMBD)
        assert info.value.mid_frame


async def test_broken_transport_is_peer_closed():
    with pytest.raises(PeerClosed):
        await read_frame(Broken(), timeout=1, n_embd=N_EMBD)
    send, receive = trio.testing.memory_stream_one_way_pair()
    await receive.aclose()
    with pytest.raises(PeerClosed):
        await write_frame(send, Ping(1), timeout=1)


async def test_read_deadline(autojump_clock):
    receive = await feed(b"", eof=False)
    start = trio.current_time()
    with pytest.raises(ReadTimeout) as info:
        await read_frame(receive, timeout=5, n_embd=N_EMBD)
    assert trio.current_time() - start == pytest.approx(5)
    assert info.value.timeout == 5
    # a frame that starts but never finishes
    receive = await feed(frame_bytes(Ping(1))[:20], eof=False)
    with pytest.raises(ReadTimeout):
        await read_frame(receive, timeout=5, n_embd=N_EMBD)


async def test_frame_arriving_before_the_deadline(autojump_clock):
    send, receive = trio.testing.memory_stream_one_way_pair()

    async def late_sender():
        await trio.sleep(4)
        await write_frame(send, Ping(3), timeout=1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(late_sender)
        assert await read_message(receive, timeout=5, n_embd=N_EMBD) == Ping(3)


async def test_write_deadline(autojump_clock):
    send, _receive = trio.testing.lockstep_stream_pair()  # nobody reads
    with pytest.raises(WriteTimeout):
        await write_frame(send, Ping(1), timeout=2)


# --------------------------------------------------------------------------
# limits are enforced before the body is read or allocated


def prefix(kind: int, body_len: int, flags: int = 0) -> bytes:
    return b"SK" + bytes([kind, flags]) + struct.pack("<I", body_len)


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        (prefix(MessageKind.PREFILL, 2**32 - 1), ErrorCode.FRAME_TOO_LARGE),
        (prefix(ReplyKind.ERROR, 80 + 10**6), ErrorCode.FRAME_TOO_LARGE),
        # a header claiming a 300 MiB activation, body_len consistent with it
        (
            prefix(MessageKind.PREFILL, 32 + 4 + 300 * 2**20)
            + struct.pack("<QQiIIHH", 1, 2, 0, 1, 300 * 2**20, 0, 0),
            ErrorCode.FRAME_TOO_LARGE,
        ),
        (
            prefix(MessageKind.PREFILL, 32 + 4 * 9000) + struct.pack("<QQiIIHH", 1, 2, 0, 9000, 0, 0, 0),
            ErrorCode.LIMIT_EXCEEDED,
        ),
    ],
)
async def test_oversized_claims_fail_before_allocation(autojump_clock, wire, code):
    receive = await feed(wire, eof=False)  # the body never comes
    tracemalloc.start()
    try:
        start = trio.current_time()
        with pytest.raises(ProtocolError) as info:
            await read_frame(ReceiveBuffer(receive), Limits(), timeout=5, n_embd=576)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code == code
    assert trio.current_time() == start  # did not wait for the body
    assert peak < 1024 * 1024


async def test_mistyped_frames_rejected_on_the_prefix(autojump_clock):
    receive = await feed(frame_bytes(Ack(1, 2))[:8], eof=False)
    with pytest.raises(ProtocolError) as info:
        await read_message(receive, timeout=5, n_embd=N_EMBD)
    assert info.value.code == ErrorCode.UNEXPECTED_KIND
    receive = await feed(frame_bytes(Stop(1, 2))[:8], eof=False)
    with pytest.raises(ProtocolError) as info:
        await read_reply(receive, timeout=5)
    assert info.value.code == ErrorCode.UNEXPECTED_KIND


# --------------------------------------------------------------------------
# fuzz: every input ends in ProtocolError / PeerClosed / ReadTimeout


def fuzz_case(rng: random.Random, corpus: list[bytes]) -> bytes:
    style = rng.randrange(7)
    if style == 0:  # random bytes, sometimes with a valid magic
        head = b"SK" if rng.random() < 0.5 else b""
        return head + rng.randbytes(rng.randrange(0, 120))
    frames = b"".join(rng.choice(corpus) for _ in range(rng.randint(1, 3)))
    data = bytearray(frames)
    if style == 1:  # truncated
        return bytes(data[: rng.randrange(0, len(data))])
    if style == 2:  # random byte flips
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if style == 3:  # body_len of the first frame rewritten
        struct.pack_into("<I", data, 4, rng.choice([0, 1, 79, 80, 2**31, 2**32 - 1, rng.randrange(2**20)]))
        return bytes(data)
    if style == 4:  # kind and flags rewritten (mis-typed frames)
        data[2] = rng.choice([0, 1, 2, 0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x20, 0x21, 0x22, 0x23, 0xFF])
        data[3] = rng.choice([0, 1, 2, 3, 0x80])
        return bytes(data)
    if style == 5 and len(data) >= 40:  # header counts rewritten
        offset = rng.choice([8 + 16, 8 + 20, 8 + 24, 8 + 28])
        struct.pack_into("<I", data, offset, rng.choice([0, 1, 2, 7, 8192, 8193, 2**31, 2**32 - 1]))
        return bytes(data)
    return bytes(data)  # valid frames, then EOF or silence


async def test_fuzz_reader(autojump_clock):
    rng = random.Random(20240601)
    corpus = [frame_bytes(f) for f in sample_frames(N_EMBD)]
    corpus += [frame_bytes(f) for f in sample_frames(4)[:6]]  # other width: length mismatches
    corpus = [c for c in corpus if len(c) < 4096] + [corpus[2][:4096]]
    outcomes: dict[str, int] = {}
    limits = Limits(max_tokens=4096)
    for case in range(3000):
        data = fuzz_case(rng, corpus)
        receive = await feed(data, eof=rng.random() < 0.8)
        buf = ReceiveBuffer(receive, read_size=rng.choice([0, 3, 64 * 1024]))
        reader = rng.choice([read_frame, read_message, read_reply])
        kwargs = {} if reader is read_reply else {"n_embd": N_EMBD}
        with trio.fail_after(60):  # virtual time: only a reader without a deadline could hit it
            for _ in range(10):
                try:
                    await reader(buf, limits, timeout=1, **kwargs)
                except (ProtocolError, PeerClosed, ReadTimeout) as exc:
                    outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
                    break
            else:
                pytest.fail(f"case {case}: reader never stopped")
    assert set(outcomes) == {"ProtocolError", "PeerClosed", "ReadTimeout"}, outcomes
    assert min(outcomes.values()) > 100, outcomes


# --------------------------------------------------------------------------
# handshake


def stage(index: int, start: int, end: int, **kw) -> Hello:
    return Hello(kw.pop("fingerprint", FP), index, start, end, 30, 576, **kw)


async def run_handshake(client_hello: Hello, server_hello: Hello, *, timeout: float = 5):
    client_stream, server_stream = trio.testing.memory_stream_pair()
    results = {}

    async def run(name, fn):
        try:
            results[name] = await fn()
        except WireError as exc:
            results[name] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "client", lambda: handshake_client(client_stream, client_hello, timeout=timeout))
        nursery.start_soon(run, "server", lambda: handshake_server(server_stream, server_hello, timeout=timeout))
    return results["client"], results["server"]


async def test_handshake_accepts_adjacent_stages():
    up, down = stage(0, 0, 10, node="head"), stage(1, 10, 30)
    client, server = await run_handshake(up, down)
    assert client == down and server == up


async def test_handshake_token_return():
    final, head = stage(2, 20, 30, role=Role.TOKEN_RETURN), stage(0, 0, 10, role=Role.TOKEN_RETURN)
    client, server = await run_handshake(final, head)
    assert client == head and server == final


@pytest.mark.parametrize(
    ("client_hello", "reason"),
    [
        (stage(0, 0, 10, version=6), f"protocol version mismatch: peer 6, ours {PROTOCOL_VERSION}"),
        (stage(0, 0, 10, fingerprint=bytes(32)), "model fingerprint mismatch: peer 0000000000000000"),
        (stage(0, 0, 12), "non-adjacent stage: peer is stage 0 with layers [0, 12) of 30, expected stage 0 ending"),
        (stage(1, 0, 10), "non-adjacent stage"),
        (stage(0, 0, 10, role=Role.TOKEN_RETURN), "role mismatch"),
    ],
)
async def test_server_refusals_name_the_failed_check(client_hello, reason):
    client, server = await run_handshake(client_hello, stage(1, 10, 30))
    assert isinstance(server, HandshakeRefused) and not server.by_peer
    assert isinstance(client, HandshakeRefused) and client.by_peer
    assert server.reason.startswith(reason)
    assert client.reason == server.reason


async def test_client_refuses_the_server():
    client, server = await run_handshake(stage(0, 0, 10, auth=b"k"), stage(1, 10, 30))
    assert isinstance(client, HandshakeRefused) and not client.by_peer
    assert client.reason == "authentication failed"
    assert isinstance(server, HandshakeRefused) and server.by_peer and server.reason == "authentication failed"


async def test_handshake_then_pipelined_messages():
    client_stream, server_stream = trio.testing.memory_stream_pair()
    up, down = stage(0, 0, 10), stage(1, 10, 30)
    server_buf = ReceiveBuffer(server_stream)
    got = []

    async def server():
        peer = await handshake_server(server_stream, down, timeout=5, receive=server_buf)
        got.append(peer)
        for _ in range(2):
            got.append(await read_message(server_buf, timeout=5, n_embd=peer.n_embd))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server)
        await handshake_client(client_stream, up, timeout=5)
        await write_frame(client_stream, DecodeStep(1, 2, 0, [3], np.ones((1, 576), "<f4")), timeout=5)
        await write_frame(client_stream, Stop(2, 2), timeout=5)
    assert got[0] == up and got[2] == Stop(2, 2) and got[1].token == 3


async def test_garbage_instead_of_hello_is_refused():
    client_stream, server_stream = trio.testing.memory_stream_pair()
    await client_stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(HandshakeRefused) as info:
        await handshake_server(server_stream, stage(1, 10, 30), timeout=5)
    assert "magic" in info.value.reason
    reply = await read_frame(client_stream, timeout=1)
    assert reply == HelloReply(False, info.value.reason)


async def test_handshake_deadline_and_eof(autojump_clock):
    client_stream, server_stream = trio.testing.memory_stream_pair()
    with pytest.raises(ReadTimeout):
        await handshake_server(server_stream, stage(1, 10, 30), timeout=3)
    await client_stream.aclose()
    with pytest.raises(PeerClosed):
        await handshake_server(server_stream, stage(1, 10, 30), timeout=3)


def test_kind_sets_are_disjoint():
    assert not MESSAGE_KINDS & REPLY_KINDS


# --------------------------------------------------------------------------
# idle deadline vs a started frame's deadline (slow-drip peers)


async def test_idle_deadline_covers_only_the_wait_for_the_first_byte(autojump_clock):
    """A frame that starts late (within the idle deadline) is read; the idle wait is not the frame's."""
    send, receive = trio.testing.memory_stream_one_way_pair()

    async def late_sender():
        await trio.sleep(50)
        await write_frame(send, Ping(3), timeout=1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(late_sender)
        got = await read_message(ReceiveBuffer(receive), timeout=60, frame_timeout=2, n_embd=N_EMBD)
    assert got == Ping(3)
    receive = await feed(b"", eof=False)
    with pytest.raises(ReadTimeout) as info:
        await read_frame(ReceiveBuffer(receive), timeout=60, frame_timeout=2, n_embd=N_EMBD)
    assert not info.value.mid_frame and trio.current_time() == pytest.approx(50 + 60)


@pytest.mark.parametrize("read_size", [0, 64 * 1024])
async def test_started_frame_that_stalls_times_out_on_its_own_deadline(autojump_clock, read_size):
    wire = frame_bytes(sample_frames()[2])
    for cut in (1, 8, 20, len(wire) - 1):
        receive = await feed(wire[:cut], eof=False)
        start = trio.current_time()
        with pytest.raises(ReadTimeout) as info:
            await read_frame(ReceiveBuffer(receive, read_size=read_size), timeout=600, frame_timeout=3,
                             n_embd=N_EMBD)
        assert info.value.mid_frame
        took = trio.current_time() - start
        # before the prefix is complete the body length is unknown: frame_timeout alone
        want = frame_deadline_s(struct.unpack_from("<I", wire, 4)[0] if cut >= 8 else 0, 3)
        assert took == pytest.approx(want), (cut, took)


async def test_slow_drip_frame_is_dropped(autojump_clock):
    """A byte every 100 ms: the frame is dropped after frame_timeout, not after the idle deadline."""
    send, receive = trio.testing.memory_stream_one_way_pair()
    wire = frame_bytes(sample_frames()[2])

    async def drip():
        for i in range(len(wire)):
            await send.send_all(wire[i:i + 1])
            await trio.sleep(0.1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(drip)
        with pytest.raises(ReadTimeout) as info:
            await read_message(ReceiveBuffer(receive), timeout=600, frame_timeout=5, n_embd=N_EMBD)
        nursery.cancel_scope.cancel()
    assert info.value.mid_frame
    assert trio.current_time() == pytest.approx(frame_deadline_s(len(wire) - 8, 5))


async def test_big_frame_gets_time_at_the_minimum_rate(autojump_clock):
    """The started frame's deadline grows with its body length (min_rate bytes/s)."""
    act = np.zeros((64, N_EMBD), dtype=np.float32)
    wire = frame_bytes(PrefillChunk(1, 2, 0, list(range(64)), act))  # 32 + 256 + 2048 bytes of body
    body = len(wire) - 8
    send, receive = trio.testing.memory_stream_one_way_pair()

    async def sender():  # the prefix now, the body 1.5 s later: late for frame_timeout alone
        await send.send_all(wire[:8])
        await trio.sleep(1.5)
        await send.send_all(wire[8:])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        got = await read_message(ReceiveBuffer(receive), timeout=600, frame_timeout=1, min_rate=body / 1.0,
                                 n_embd=N_EMBD)  # deadline 1 + body / (body / 1 s) = 2 s
    assert got.tokens.tolist() == list(range(64))
    receive = await feed(wire[:-1], eof=False)
    with pytest.raises(ReadTimeout):
        await read_message(ReceiveBuffer(receive), timeout=600, frame_timeout=1, min_rate=body / 1.0,
                           n_embd=N_EMBD)
    assert frame_deadline_s(body, 1, body / 1.0) == pytest.approx(2)


async def test_clean_close_between_frames_with_a_frame_deadline():
    receive = await feed(frame_bytes(Ping(1)))
    buf = ReceiveBuffer(receive, read_size=0)
    assert await read_frame(buf, timeout=5, frame_timeout=1, n_embd=N_EMBD) == Ping(1)
    with pytest.raises(PeerClosed) as info:
        await read_frame(buf, timeout=5, frame_timeout=1, n_embd=N_EMBD)
    assert not info.value.mid_frame


@pytest.mark.parametrize("read_size", [0, 5, 64 * 1024, "trickle"])
async def test_frame_deadline_reads_lose_nothing(read_size):
    frames = sample_frames()
    send, receive = trio.testing.memory_stream_one_way_pair()
    source = Trickle(receive) if read_size == "trickle" else receive
    buf = ReceiveBuffer(source, read_size=16 if read_size == "trickle" else read_size)
    for frame in frames:
        await write_frame(send, frame, timeout=1)
    await send.aclose()
    # the deadlines are generous: this checks what a read under a frame deadline returns, not its speed (a
    # trickled frame is read a few bytes at a time, thousands of reads on a slow VM)
    deadline = 20 if read_size == "trickle" else 1
    for frame in frames:
        assert await read_frame(buf, timeout=deadline, frame_timeout=deadline, n_embd=N_EMBD) == frame


# --------------------------------------------------------------------------
# real sockets: a small frame is sent with no wait (what the socket takes at once) and decoded from what one
# receive brought; the general path finishes whatever that did not cover


def socket_streams() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


@pytest.mark.parametrize("read_size", [0, 16, 64 * 1024])
async def test_frames_round_trip_over_a_socket(read_size):
    frames = sample_frames()
    left, right = socket_streams()
    buf = ReceiveBuffer(right, read_size=read_size)

    async def write_all():
        for frame in frames:
            assert await write_frame(left, frame, timeout=5) == len(frame_bytes(frame))
        await left.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_all)
        for frame in frames:
            assert await read_frame(buf, timeout=5, frame_timeout=5, n_embd=N_EMBD) == frame
        with pytest.raises(PeerClosed) as info:
            await read_frame(buf, timeout=5, frame_timeout=5, n_embd=N_EMBD)
        assert not info.value.mid_frame


def _natively_written(prepared: PreparedFrame, tail: bytes, sent: int) -> None:
    """What Context.decode_row_send leaves in a prepared frame: its tail filled, `sent` bytes written."""
    prepared.frame[prepared.head_len:] = tail
    assert os.write(prepared.fd, prepared.frame[:sent]) == sent
    prepared.sent, prepared.done_ns = sent, time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@pytest.mark.parametrize("written", [0, 5, -1])
async def test_a_prepared_frame_is_finished_after_its_native_write(written):
    """write_prepared sends what the native write left of a prepared frame (nothing if it took it all) and
    reports a failed native write as a closed peer, as write_frame would."""
    step = DecodeStep(3, 4, 10, np.array([7], dtype=np.int32), np.arange(N_EMBD, dtype=np.float32)[None, :])
    wire = frame_bytes(step)
    tail = step.activation.nbytes
    left, right = socket_streams()
    prepared = PreparedFrame.for_stream(left, wire[:-tail], tail)
    assert prepared.fd == left.socket.fileno() and prepared.done_ns == 0
    if written < 0:
        prepared.sent, prepared.done_ns = -32, 1  # EPIPE
        with pytest.raises(PeerClosed):
            await write_prepared(left, prepared, timeout=5)
        return
    _natively_written(prepared, wire[-tail:], written)
    assert await write_prepared(left, prepared, timeout=5) == len(wire)
    assert await read_frame(ReceiveBuffer(right), timeout=5, frame_timeout=5, n_embd=N_EMBD) == step
    assert PreparedFrame.for_stream(trio.testing.memory_stream_pair()[0], b"", 4) is None  # no socket, no link
    await left.aclose()
    assert PreparedFrame.for_stream(left, b"", 4) is None  # a closed socket: the frame goes the usual way


async def test_frames_that_arrived_together_are_read_one_by_one():
    frames = sample_frames()[3:12]
    left, right = socket_streams()
    await left.send_all(b"".join(frame_bytes(f) for f in frames))  # one write: one receive holds them all
    buf = ReceiveBuffer(right)
    got = [await read_frame(buf, timeout=5, frame_timeout=5, n_embd=N_EMBD) for _ in frames]
    assert got == frames
    assert buf.buffered == 0
    decode = next(g for g in got if isinstance(g, DecodeStep))
    assert decode.activation.flags.writeable  # as from receive_exactly: its own buffer, not the receive's


@pytest.mark.parametrize("read_size", [0, 64 * 1024])
async def test_reading_frames_that_are_all_there_still_lets_other_tasks_run(read_size):
    """A peer that keeps the socket full must not starve the reader's neighbours (liveness pings, other
    connections): every read is a schedule point, also when its frame was already there."""
    n = 50
    left, right = socket_streams()
    await left.send_all(frame_bytes(Ping(1)) * n)
    buf = ReceiveBuffer(right, read_size=read_size)
    done, turns = False, 0

    async def neighbour():
        nonlocal turns
        while not done:
            turns += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(neighbour)
        await trio.lowlevel.checkpoint()
        for _ in range(n):
            assert await read_frame(buf, timeout=5, frame_timeout=5, n_embd=N_EMBD) == Ping(1)
        done = True
    assert turns >= n // 2


async def test_a_frame_the_socket_cannot_take_at_once_is_sent_whole():
    """Bigger than the socket's buffer: what the first send left is written by the general path (waiting
    for the reader), and the frame arrives intact."""
    left, right = socket_streams()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    right.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    msg = PrefillChunk(1, 7, 0, np.arange(8000) % 1000)  # 32 KB of tokens: one part, sent in pieces
    buf = ReceiveBuffer(right, read_size=512)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: write_frame(left, msg, timeout=5))
        await trio.sleep(0.05)  # the writer is blocked on a full socket by now
        assert await read_message(buf, timeout=5, frame_timeout=5, n_embd=N_EMBD) == msg


async def test_send_buffer_sends_everything_at_once_or_in_pieces():
    """send_buffer (the conditioned link's transmit task): what the socket takes at once goes straight in,
    the rest waits for the reader; the bytes arrive whole and in order."""
    left, right = socket_streams()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    right.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    small, big = b"hello", bytes(range(256)) * 256  # 64 KB: more than both buffers hold
    got = bytearray()

    async def read_all():
        while len(got) < len(small) + len(big):
            got.extend(await right.receive_some(8192))

    async with trio.open_nursery() as nursery:
        await send_buffer(left, small)
        nursery.start_soon(read_all)
        await send_buffer(left, big)
    assert bytes(got) == small + big
    await right.aclose()
    with pytest.raises(PeerClosed):
        await send_buffer(left, small * 100_000)


async def test_socket_writes_to_a_closed_peer_or_socket_fail_clearly():
    left, right = socket_streams()
    await right.aclose()
    with pytest.raises(PeerClosed):
        await write_frame(left, Ping(1), timeout=1)
    left.socket.close()
    with pytest.raises(trio.ClosedResourceError):
        await write_frame(left, Ping(1), timeout=1)


async def test_socket_peer_gone_mid_frame_is_peer_closed():
    left, right = socket_streams()
    await left.send_all(frame_bytes(Ping(1))[:5])
    await left.aclose()
    with pytest.raises(PeerClosed) as info:
        await read_frame(ReceiveBuffer(right), timeout=1, n_embd=N_EMBD)
    assert info.value.mid_frame


async def test_keep_alive_sets_the_probe_schedule():
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    stream = await trio.open_tcp_stream(*listener.getsockname())
    try:
        keep_alive(stream)
        sock = stream.socket
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert (sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)) == (
            KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, keepalive_probes(DEFAULT_PEER_TIMEOUT))
        assert KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * keepalive_probes(DEFAULT_PEER_TIMEOUT) <= DEFAULT_PEER_TIMEOUT
        await stream.aclose()
        keep_alive(stream)  # a closed socket: nothing to set, and no error
    finally:
        listener.close()


# --------------------------------------------------------------------------
# WaitWatch: the wait for a frame's first byte bounded by a task, not by a cancel scope per read


async def test_watched_reads_time_out_after_one_wait_of_the_timeout_and_not_before(autojump_clock):
    left, right = socket_streams()
    buf = ReceiveBuffer(right)
    watch = WaitWatch(buf, 60)

    async def sender():
        for n in range(3):
            await trio.sleep(50)
            await write_frame(left, Ping(n), timeout=1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        nursery.start_soon(sender)
        for n in range(3):  # three waits of 50 s: 150 s in all, none as long as the timeout
            assert await read_message(buf, timeout=60, watch=watch, frame_timeout=2, n_embd=N_EMBD) == Ping(n)
        start = trio.current_time()
        with pytest.raises(ReadTimeout) as info:
            await read_message(buf, timeout=60, watch=watch, frame_timeout=2, n_embd=N_EMBD)
    assert not info.value.mid_frame and watch.expired == "no complete frame within 60 s"
    assert trio.current_time() - start == pytest.approx(60)


async def test_watched_read_keeps_the_started_frame_deadline(autojump_clock):
    """The watch bounds the wait for the first byte; a frame that then stalls fails on frame_timeout."""
    left, right = socket_streams()
    buf = ReceiveBuffer(right)
    watch = WaitWatch(buf, 600)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        await left.send_all(frame_bytes(Ping(1))[:5])
        start = trio.current_time()
        with pytest.raises(ReadTimeout) as info:
            await read_message(buf, timeout=600, watch=watch, frame_timeout=3, n_embd=N_EMBD)
        watch.close()
    assert info.value.mid_frame and watch.expired is None
    assert trio.current_time() - start == pytest.approx(3)


async def test_closed_watch_and_closed_socket_end_the_watch_task(autojump_clock):
    left, right = socket_streams()
    buf = ReceiveBuffer(right)
    with trio.fail_after(1):  # run returns: the nursery would otherwise wait 60 s for it
        async with trio.open_nursery() as nursery:
            watch = WaitWatch(buf, 3600)
            nursery.start_soon(watch.run)
            await trio.sleep(0)
            watch.close()
    closed = WaitWatch(buf, 0.5)
    await right.aclose()
    with trio.fail_after(1):
        await closed.run()
    with pytest.raises(TypeError):
        WaitWatch(ReceiveBuffer(trio.testing.memory_stream_one_way_pair()[1]), 1)
    with pytest.raises(ValueError):
        WaitWatch(ReceiveBuffer(left), 0)
    with pytest.raises(ValueError):
        await read_message(ReceiveBuffer(left), timeout=1, watch=WaitWatch(ReceiveBuffer(left), 1), n_embd=N_EMBD)


READ_AFTER_STOP = """
import sys, socket, trio
from skippyd.wire.errors import ReadTimeout
from skippyd.wire.stream import ReceiveBuffer, WaitWatch, read_reply

async def main():
    sock = trio.socket.from_stdlib_socket(socket.socket(fileno=int(sys.argv[1])))
    reader = ReceiveBuffer(trio.SocketStream(sock))
    async with trio.open_nursery() as nursery:
        async def read(timeout):
            watch = WaitWatch(reader, timeout) if sys.argv[2] == "watched" else None
            if watch is not None:
                nursery.start_soon(watch.run)
            try:
                return await read_reply(reader, timeout=timeout, frame_timeout=1.0, watch=watch)
            finally:
                if watch is not None:
                    watch.close()

        print("waiting", flush=True)
        print(type(await read(0.3)).__name__, flush=True)
        try:
            await read(0.05)
        except ReadTimeout:
            print("silent peer: ReadTimeout", flush=True)

trio.run(main)
"""


@pytest.mark.parametrize("mode", ["scoped", "watched"])
def test_frame_that_arrived_while_the_reader_was_stopped_is_read(mode):
    """SIGSTOP while waiting for a reply, the reply arriving meanwhile, SIGCONT after the read's deadline: the
    interrupted epoll returns no event once its timeout is over, yet the peer was not late; the reply is read.
    The same with the deadline kept by a WaitWatch, whose task wakes before the reader hears of the reply."""
    a, b = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", READ_AFTER_STOP, str(a.fileno()), mode], pass_fds=[a.fileno()],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        a.close()
        assert child.stdout.readline() == "waiting\n"
        time.sleep(0.05)
        child.send_signal(signal.SIGSTOP)
        time.sleep(0.05)
        b.sendall(frame_bytes(Ack(1, 2)))
        time.sleep(0.4)  # past the reader's 0.3 s deadline
        child.send_signal(signal.SIGCONT)
        out, _ = child.communicate(timeout=10)
    finally:
        child.kill()
        b.close()
    assert out.splitlines() == ["Ack", "silent peer: ReadTimeout"]
