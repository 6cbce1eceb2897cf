"""A big deferred frame (a prompt chunk) is written by a task of its own, so that the sender computes the next
chunk while the last one is still leaving on a slow link: in order, counted, and a failure still surfaces.

The link is the daemon's own DownstreamLink over a real socket pair whose other end reads only when the test
says, so the write is seen to be under way while send_deferred has already returned.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from skippyd.stage.downstream import WRITE_BEHIND_BYTES, DownstreamError, DownstreamLink
from skippyd.wire.messages import Ack, Hello, PrefillChunk, Stop, WireFormat
from skippyd.wire.stream import ReceiveBuffer, read_frame, write_frame

N_EMBD = 1024
ROWS = 2 * WRITE_BEHIND_BYTES // (4 * N_EMBD)  # a frame twice the threshold


def socket_link(nursery, wire: WireFormat = WireFormat.F32) -> tuple[DownstreamLink, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    for sock in (a, b):  # small buffers: a frame of a few hundred KiB cannot vanish into them
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_SNDBUF, 16384)
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 16384)
    stream = trio.SocketStream(a)
    peer = Hello(fingerprint=bytes(32), stage_index=1, layer_start=0, layer_end=1, n_layer=2, n_embd=N_EMBD)
    link = DownstreamLink(stream, peer, "peer", ReceiveBuffer(stream), credit_limit=2, reply_timeout=5,
                          write_timeout=5, nursery=nursery, wire=wire)
    return link, trio.SocketStream(b)


def chunk(i: int, rows: int = ROWS * 4) -> PrefillChunk:
    act = np.random.default_rng(i).standard_normal((rows, N_EMBD)).astype(np.float32)
    return PrefillChunk(1, 7, i * rows, np.arange(rows), act)


async def test_a_big_deferred_frame_is_written_behind_and_the_next_one_after_it(nursery):
    link, other = socket_link(nursery)
    first, second = chunk(0), chunk(1)
    with trio.fail_after(5):
        assert await link.send_deferred(first) == (0, 0)  # counted once it is out
    assert link.writing and not link.settled and link.pending_acks == 1
    assert link.prepare_step(1, 7, 0, 1, False, N_EMBD) is None  # nothing may be prepared meanwhile
    receive = ReceiveBuffer(other)
    got = []

    async def reader():
        for _ in range(3):
            got.append(await read_frame(receive, timeout=5, n_embd=N_EMBD))

    nursery.start_soon(reader)
    with trio.fail_after(5):
        await link.send_deferred(second)  # waits for the first, then goes behind too
        n, _ = await link.send(Stop(2, 7))  # after both
        while len(got) < 3:
            await trio.sleep(0.01)
    assert got == [first, second, Stop(2, 7)] and n > 0
    assert not link.writing
    folded, _error = link.take_folded()
    assert folded.bytes_sent >= 2 * first.activation.nbytes  # both chunks counted, once out
    await link.aclose()


async def test_a_small_deferred_frame_goes_at_once(nursery):
    link, other = socket_link(nursery)
    small = chunk(0, rows=2)
    n, _ = await link.send_deferred(small)
    assert n > 0 and not link.writing
    assert await read_frame(ReceiveBuffer(other), timeout=5, n_embd=N_EMBD) == small
    await link.aclose()


async def test_settle_waits_for_the_frame_behind_then_collects_its_ack(nursery):
    link, other = socket_link(nursery, WireFormat.F16)
    msg = chunk(3)
    await link.send_deferred(msg)
    receive = ReceiveBuffer(other)

    async def peer():
        got = await read_frame(receive, timeout=5, n_embd=N_EMBD)
        assert np.array_equal(got.activation, msg.activation.astype(np.float16).astype(np.float32))
        await write_frame(other, Ack(1, 7))

    nursery.start_soon(peer)
    with trio.fail_after(5):
        await link.settle()
    assert link.settled
    await link.aclose()


async def test_a_failed_write_behind_fails_the_next_send(nursery):
    link, other = socket_link(nursery)
    await link.send_deferred(chunk(0))
    await other.aclose()  # the next stage is gone: the frame cannot be finished
    with trio.fail_after(10), pytest.raises(DownstreamError, match="send failed"):
        await link.send(Stop(2, 7))
    assert link.broken and not link.settled
    await link.aclose()
