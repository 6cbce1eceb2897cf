"""PieceRelay: a streamed generation's text goes to its client from a task of its own.

The generation hands pieces on without waiting; the relay's task sends the pieces in
order, whatever queued up during a slow send as one message; finish() lets
the queue out first, and gives a client that takes nothing up.
"""

from __future__ import annotations

import pytest
import trio

from skippyd.head.piece_relay import ClientStalled, PieceRelay


async def test_pieces_arrive_in_order_and_finish_waits_for_them(autojump_clock):
    got: list[str] = []

    async def send(text: str, pieces: int) -> None:
        await trio.sleep(0.001)
        got.append(text)
        assert pieces == 1

    relay = PieceRelay(send)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.run)
        for piece in ("The", " cat", " sat"):
            relay.piece(piece)  # never waits
            await trio.sleep(0.01)  # the next token: the last piece is out by then
        relay.piece(".")
        await relay.finish()
        assert got == ["The", " cat", " sat", "."]  # out before finish returned
    assert relay.messages == 4


async def test_pieces_queued_during_a_slow_send_go_out_as_one_message(autojump_clock):
    got: list[str] = []
    counts: list[int] = []

    async def slow_send(text: str, pieces: int) -> None:
        await trio.sleep(1.0)  # a slow client
        got.append(text)
        counts.append(pieces)

    relay = PieceRelay(slow_send)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.run)
        relay.piece("a")
        await trio.sleep(0.1)  # "a" is being sent
        t0 = trio.current_time()
        for piece in "bcd":
            relay.piece(piece)
        assert trio.current_time() == t0  # the generation did not wait
        await relay.finish(timeout=10)
    assert got == ["a", "bcd"]
    assert counts == [1, 3]


async def test_a_client_that_takes_nothing_is_given_up(autojump_clock):
    async def stalled(text: str, pieces: int) -> None:
        await trio.sleep_forever()

    relay = PieceRelay(stalled)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.run)
        relay.piece("hello")
        relay.piece("world")
        with trio.fail_after(1):
            await relay.let_out()  # a few passes of the scheduler, although nothing can go out
        with pytest.raises(ClientStalled):
            await relay.finish(timeout=2)
        nursery.cancel_scope.cancel()
    relay.piece("late")  # after the relay is done: dropped, no error


async def test_a_failed_send_ends_the_relay_with_its_error():
    async def broken(text: str, pieces: int) -> None:
        raise ConnectionError("gone")

    relay = PieceRelay(broken)
    relay.piece("x")
    with pytest.raises(ConnectionError):
        await relay.run()
    await relay.finish(timeout=1)  # returns at once: the relay's task has ended


async def _stream_with_blocking_computes(relay: PieceRelay, let_out: bool) -> None:
    """A generation computing on the loop's thread: push a piece, block the loop for a step, again."""
    import time
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.run)
        for i in range(12):
            relay.piece(f" {i}")
            if let_out:
                await relay.let_out()
            else:
                await trio.lowlevel.checkpoint()
            time.sleep(0.002)  # the compute: the loop runs nothing meanwhile
        await relay.finish()


@pytest.mark.parametrize("let_out", [True, False])
async def test_let_out_sends_each_piece_before_the_loop_blocks(let_out):
    counts: list[int] = []

    async def send(text: str, pieces: int) -> None:
        for _ in range(3):  # a websocket send: a lock, the stream, the socket
            await trio.lowlevel.checkpoint()
        counts.append(pieces)

    relay = PieceRelay(send)
    await _stream_with_blocking_computes(relay, let_out)
    assert sum(counts) == 12
    if let_out:
        assert counts == [1] * 12
    else:  # one pass per step: the sends lag behind and join pieces
        assert len(counts) < 12




async def test_let_out_waits_for_a_piece_queued_during_a_send():
    sent: list[str] = []
    sending = trio.Event()

    async def send(text: str, pieces: int) -> None:
        sending.set()
        for _ in range(3):
            await trio.lowlevel.checkpoint()
        sent.append(text)

    relay = PieceRelay(send)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.run)
        relay.piece("a")
        await sending.wait()  # "a" is on its way
        relay.piece("b")
        await relay.let_out()
        assert sent == ["a", "b"]  # not only the send under way when let_out began
        await relay.finish()
