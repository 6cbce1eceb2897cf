"""Where a running generation's output goes as it is made: its text, each token's logprobs, and a chance to
let them out before a compute blocks the event loop.

The engine takes a :class:`GenerationSink` (a streaming client's
:class:`~skippyd.head.piece_relay.PieceRelay`), or none: :data:`DISCARD`.
"""

from __future__ import annotations

from typing import Protocol

import trio

from skippyd.runtime.llama import TokenLogprobs


class GenerationSink(Protocol):
    """What a generation hands its client while it runs. Neither ``piece`` nor ``logprobs`` may wait: a
    generation never waits for its client (a relay queues them for a task of the client's own)."""

    def piece(self, text: str) -> None:
        """The next piece of the reply's text (a stop string is never in one)."""

    def logprobs(self, entry: TokenLogprobs) -> None:
        """A generated token's logprobs (a generation asked for them), in order, each before the piece that
        holds the token's text (a piece may hold several tokens', or none yet: text held back)."""

    async def let_out(self) -> None:
        """The generation is about to block the event loop with a compute (a single stage's head computes on
        its thread): a few checkpoints, so that the text so far goes out first."""


class _Discard:
    """A generation's output when its caller wants only the result."""

    def piece(self, text: str) -> None:
        pass

    def logprobs(self, entry: TokenLogprobs) -> None:
        pass

    # a generation computing on the loop's thread still lets others run (trio's own, not a coroutine around it:
    # this runs for every token)
    let_out = staticmethod(trio.lowlevel.checkpoint)


DISCARD: GenerationSink = _Discard()
