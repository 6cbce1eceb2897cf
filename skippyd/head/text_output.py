"""A generation's text: tokens to text, stop strings, and each piece handed on (its sink's ``piece``)."""

from __future__ import annotations

from collections.abc import Callable

from skippyd.head.stops import StopMatcher
from skippyd.runtime.text import Detokenizer


class TextOutput:
    """Text made token by token; a stop string is held back until it is known to be one, and never emitted."""

    __slots__ = ("detok", "stops", "parts", "emit")

    def __init__(self, token_piece: Callable[[int], bytes], stops: tuple[str, ...] | list[str],
                 emit: Callable[[str], None]):
        self.detok = Detokenizer(token_piece)
        self.stops = StopMatcher(stops)
        self.parts: list[str] = []
        self.emit = emit  # must not wait: a generation never waits for its client

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def push(self, token: int) -> bool:
        """Add a generated token and emit what is safe to; True if a stop string was hit (the generation ends,
        nothing from the stop string on is emitted)."""
        text, hit = self.stops.push(self.detok.push(token))
        if text:
            self.parts.append(text)
            self.emit(text)
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
            self.emit(text)
