"""Turning generated tokens into text safely, a piece at a time."""

from __future__ import annotations

import codecs
from collections.abc import Callable


class Detokenizer:
    """Incremental detokenizer that never emits half a UTF-8 character.

    Tokens of byte-level vocabularies can end in the middle of a multi-byte
    character; the incremental decoder holds those bytes back until the
    character is complete (invalid bytes become U+FFFD, never an exception).
    """

    def __init__(self, token_piece: Callable[[int], bytes]):
        self._piece = token_piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """Text that became complete with this token (possibly '')."""
        return self._decoder.decode(self._piece(token))

    def flush(self) -> str:
        """Whatever is left at the end of a generation."""
        return self._decoder.decode(b"", final=True)
