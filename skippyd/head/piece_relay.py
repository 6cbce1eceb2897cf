"""Streaming a generation's text to its client from a task of its own.

A relay is a generation's sink (:class:`~skippyd.head.sink.GenerationSink`):
the engine hands each piece of text to :meth:`PieceRelay.piece`, which never
waits; the relay's task (:meth:`PieceRelay.run`, started by whoever serves
the client: the control channel's connection, the OpenAI endpoint's
request) sends it. So the generation never waits for its client, and needs
no cancel scope per token: a send in the generation's own task had to be
shielded (a kill must not cut a client's message in half) and bounded (a
stalled client must not hold the pipeline), which cost every streamed token
a cancel scope with a deadline. Pieces that pile up while a send is under
way (a slow client) go out together as one message.

:meth:`PieceRelay.finish` lets the queued pieces out before the caller sends
its last message (the result or an error), so the client sees every piece
first; a client that takes none of it within the timeout is given up.

A generation that computes on the event loop's thread (a single stage's
lone session: see Scheduler._direct) blocks the loop for a whole step, and
a send takes the relay's task a few passes of trio's scheduler; with one
pass per step the text came out in bursts, tokens late. Such a generation
calls :meth:`PieceRelay.let_out` before it computes.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import trio

from skippyd.runtime.llama import TokenLogprobs

FINISH_TIMEOUT_S = 10.0  # the queued pieces must be out this long after the generation ended
LET_OUT_PASSES = 8  # a send takes ~3-4 passes; a client slow to read gets no more of its generation's time


class ClientStalled(Exception):
    """The client took no text for FINISH_TIMEOUT_S after its generation ended."""


class PieceRelay:
    """A streaming client's GenerationSink: pieces go out in order from the relay's own task; each token's
    logprobs go to ``on_logprobs`` (the client's, at once: it sends them with the next piece it sends)."""

    def __init__(self, send: Callable[[str, int], Awaitable[None]], *,
                 on_logprobs: Callable[[TokenLogprobs], None] | None = None):
        self._send = send  # called with the text and how many pushed pieces it joins
        self._on_logprobs = on_logprobs
        self._tx, self._rx = trio.open_memory_channel(math.inf)
        self._done = trio.Event()
        self.messages = 0  # sent to the client (fewer than the pieces pushed when a slow client made them wait)
        self._pushed = self._sent = 0  # pieces

    def piece(self, text: str) -> None:
        """Queue `text` for the client, at once."""
        try:
            self._tx.send_nowait(text)
            self._pushed += 1
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the relay was given up (its client is gone): the generation learns from its own scope

    def logprobs(self, entry: TokenLogprobs) -> None:
        if self._on_logprobs is not None:
            self._on_logprobs(entry)

    async def let_out(self, max_passes: int = LET_OUT_PASSES) -> None:
        """A checkpoint, then more until the queued pieces are sent (at most `max_passes` in all): for a
        generation about to block the event loop with a compute."""
        await trio.lowlevel.checkpoint()
        for _ in range(max_passes - 1):
            if self._sent == self._pushed:
                return
            await trio.lowlevel.checkpoint()

    async def run(self) -> None:
        """Send the queued pieces in order until :meth:`finish`; a send's error propagates (the client is
        gone: whoever started this task cancels the generation)."""
        try:
            async for text in self._rx:
                parts = [text]
                while True:  # whatever queued up during the last send goes in this message
                    try:
                        parts.append(self._rx.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                await self._send(parts[0] if len(parts) == 1 else "".join(parts), len(parts))
                self.messages += 1
                self._sent += len(parts)
        finally:
            self._done.set()

    async def finish(self, timeout: float = FINISH_TIMEOUT_S) -> None:
        """No more pieces: wait until the queued ones are sent. Raises ClientStalled after `timeout`."""
        self._tx.close()
        with trio.move_on_after(timeout):
            await self._done.wait()
        if not self._done.is_set():
            raise ClientStalled(f"the client took no text for {timeout:g} s")
