"""A generation's text: tokens to text, stop strings, and each piece handed to the client's ``on_piece``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from skippyd.head.stops import StopMatcher
from skippyd.runtime.text import Detokenizer

PieceCallback = Callable[[str], None]  # must not wait: see skippyd/head/piece_relay.py


class TextOutput:
    """Text made token by token; a stop string is held back until it is known to be one, and never emitted."""

    __slots__ = ("detok", "stops", "parts", "on_piece", "let_out")

    def __init__(self, token_piece: Callable[[int], bytes], stops: tuple[str, ...] | list[str],
                 on_piece: PieceCallback | None):
        self.detok = Detokenizer(token_piece)
        self.stops = StopMatcher(stops)
        self.parts: list[str] = []
        self.on_piece = on_piece
        # a PieceRelay's: a generation about to block the event loop with a compute lets its text out first
        self.let_out: Callable[[], Awaitable[None]] | None = getattr(on_piece, "let_out", None)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def push(self, token: int) -> bool:
        """Add a generated token and emit what is safe to; True if a stop string was hit (the generation ends,
        nothing from the stop string on is emitted)."""
        text, hit = self.stops.push(self.detok.push(token))
        if text:
            self.parts.append(text)
            if self.on_piece is not None:
                self.on_piece(text)  # queued for the client's own task: a generation never waits for its client
        return hit

    def finish(self) -> None:
        """The generation ended without a stop string: emit what the detokenizer and the stop matcher held."""
        text = self.detok.flush() + self.stops.flush()
        if self.stops.stops:  # a stop string may only be completed by what was held back
            cut = min((i for i in (text.find(s) for s in self.stops.stops) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
        if text:
            self.parts.append(text)
            if self.on_piece is not None:
                self.on_piece(text)
