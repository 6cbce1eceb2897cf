"""A generation's prompt as the head computes it: pieces in prompt order, each a text's tokens or an image's
rows, and the positions they take.

Once an image is in a prompt its position count is not its row count: an image's rows are no tokens, and on
an M-RoPE model (Qwen2-VL) an image of ``nx`` x ``ny`` rows takes ``max(nx, ny)`` positions. So the prompt
says, for every piece, where it starts and ends (:attr:`Piece.start`, :attr:`Piece.end`), and the
generation goes on from :attr:`Prompt.n_pos`. What the prefix caches key each position by is
:attr:`Prompt.keys`: a text position's token id, an image position's negative key made from the image's
pixels (its id), the tile's place among the image's tiles and the position's place in the tile, so that a
second question about the same image finds its KV and two different images never share any.

A prompt is computed in parts (:meth:`Prompt.parts`): a text piece in chunks of the generation's prefill
chunk, an image piece in chunks too, or whole when its rows attend to each other both ways. A restore from
the prefix caches may end only where computing can go on (:meth:`Prompt.resume_point`): anywhere in a text
piece, at an image's start or end, never inside an image.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import attrs
import numpy as np

from skippyd.wire.messages import NO_TOKEN, MediaRows


class ImageRows(Protocol):
    """What the prompt needs of an image chunk (skippyd.runtime.mtmd.ImageChunk)."""

    id: str
    n_tokens: int
    n_pos: int
    non_causal: bool

    def positions(self, start: int) -> np.ndarray: ...

    def encode(self) -> np.ndarray: ...

    def close(self) -> None: ...


@attrs.define(eq=False)
class TextPiece:
    tokens: np.ndarray  # int32 token ids
    start: int

    @property
    def n_rows(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def keys(self) -> np.ndarray:
        return self.tokens


@attrs.define(eq=False)
class ImagePiece:
    """An image (or one tile of it): its rows, once encoded (kept: a replay computes them again, never the
    projector), their positions and the keys of the positions they take."""

    chunk: ImageRows
    start: int
    keys: np.ndarray  # int32, one per position of [start, end), negative
    rows: np.ndarray | None = None  # float32 (n_rows, n_embd): the projector's output

    @property
    def n_rows(self) -> int:
        return self.chunk.n_tokens

    @property
    def end(self) -> int:
        return self.start + self.chunk.n_pos

    @property
    def causal(self) -> bool:
        return not self.chunk.non_causal

    @property
    def positions(self) -> np.ndarray:
        """int32 (sections, n_rows): one per row, or the four an M-RoPE model takes."""
        pos = self.chunk.positions(self.start)
        return pos.reshape(1, -1) if pos.ndim == 1 else pos


Piece = TextPiece | ImagePiece


@attrs.frozen(eq=False)
class PromptPart:
    """What one compute (and one prefill message) of the prompt holds: text tokens at counted positions, or
    media rows (``media``, with ``rows`` their input embeddings) at theirs."""

    pos_start: int
    tokens: np.ndarray  # token ids, or NO_TOKEN per media row
    media: MediaRows | None = None
    rows: np.ndarray | None = None

    @property
    def pos_end(self) -> int:
        return self.pos_start + len(self.tokens) if self.media is None else self.media.pos_end


def image_keys(image_id: str, tile: int, n: int) -> np.ndarray:
    """The keys of the `n` positions of tile `tile` of the image `image_id`: 31 bits each of an extendable
    hash of the three, negative (no token id is), so that a false match of a whole tile's positions (a
    restore never ends inside one) needs 31 bits per position to collide."""
    words = np.frombuffer(hashlib.shake_256(f"{image_id}:{tile}".encode()).digest(4 * n), dtype="<u4")
    return (-1 - (words & 0x7FFFFFFF).astype(np.int64)).astype(np.int32)


class Prompt:
    """A prompt's pieces in order (see the module docstring). A text-only prompt is one text piece."""

    def __init__(self, pieces: Sequence[Piece]):
        self.pieces = tuple(pieces)
        if not self.pieces:
            raise ValueError("a prompt has at least one piece")
        at = 0
        for piece in self.pieces:
            if piece.start != at:
                raise ValueError(f"a piece starts at {piece.start}, the one before ends at {at}")
            at = piece.end
        self.n_pos = at  # where decoding goes on
        self.n_rows = sum(p.n_rows for p in self.pieces)  # tokens and image rows: what usage counts
        self.keys = np.concatenate([p.keys for p in self.pieces]).astype(np.int32, copy=False)
        self.images = tuple(p for p in self.pieces if isinstance(p, ImagePiece))
        self.image_rows = sum(p.n_rows for p in self.images)
        self.encode_ms = 0.0  # the projector's time on this prompt's images (by whoever encodes them)

    @classmethod
    def of_tokens(cls, tokens: Sequence[int] | np.ndarray) -> Prompt:
        return cls([TextPiece(np.asarray(tokens, dtype=np.int32), 0)])

    @classmethod
    def of_chunks(cls, chunks: Sequence) -> Prompt:
        """From a projector's chunks in prompt order (skippyd.runtime.mtmd: TextChunk, ImageChunk). Tiles of one
        image share its id; a tile's place is its count among the chunks of that id so far."""
        pieces: list[Piece] = []
        tiles: dict[str, int] = {}
        at = 0
        for c in chunks:
            if hasattr(c, "encode"):
                tile = tiles[c.id] = tiles.get(c.id, -1) + 1
                piece = ImagePiece(c, at, image_keys(c.id, tile, c.n_pos))
            else:
                piece = TextPiece(np.asarray(c.tokens, dtype=np.int32), at)
            if piece.n_rows:
                pieces.append(piece)
                at = piece.end
        return cls(pieces)

    @property
    def text_tokens(self) -> np.ndarray:
        """The text pieces' tokens, in order (what drafting looks for repeats in)."""
        return np.concatenate([p.tokens for p in self.pieces if isinstance(p, TextPiece)] or
                              [np.empty(0, np.int32)])

    @property
    def tokens(self) -> np.ndarray:
        """A text-only prompt's tokens (ValueError for a prompt with images)."""
        if self.images:
            raise ValueError("a prompt with images is no list of tokens")
        return self.pieces[0].tokens if len(self.pieces) == 1 else self.text_tokens

    def resume_point(self, length: int) -> int:
        """The longest prefix of ``length`` positions or fewer that computing can go on after: anywhere in a
        text piece, an image's start or end, never inside an image."""
        for piece in self.pieces:
            if piece.start <= length < piece.end and isinstance(piece, ImagePiece):
                return piece.start
        return min(length, self.n_pos)

    def rows_before(self, position: int) -> int:
        """Tokens and image rows at positions before ``position`` (a resume point)."""
        rows = 0
        for piece in self.pieces:
            if piece.end <= position:
                rows += piece.n_rows
            elif piece.start < position:
                rows += position - piece.start  # a text piece: one row per position
        return rows

    def parts(self, start: int, chunk: int) -> Iterator[tuple[Piece, int, int]]:
        """The prompt from ``start`` (a resume point) as (piece, first row, end row) per compute: text in
        ``chunk`` tokens at most, an image's rows likewise, or all of them at once without causal attention."""
        for piece in self.pieces:
            if piece.end <= start:
                continue
            lo = start - piece.start if isinstance(piece, TextPiece) and piece.start < start else 0
            size = piece.n_rows if isinstance(piece, ImagePiece) and not piece.causal else chunk
            for first in range(lo, piece.n_rows, size):
                yield piece, first, min(first + size, piece.n_rows)

    def part(self, piece: Piece, lo: int, hi: int) -> PromptPart:
        """Rows ``[lo, hi)`` of ``piece`` as one compute's input (an image piece's rows encoded already)."""
        if isinstance(piece, TextPiece):
            return PromptPart(piece.start + lo, piece.tokens[lo:hi])
        if piece.rows is None:
            raise ValueError("an image's rows are computed once it is encoded")
        positions = piece.positions[:, lo:hi]
        if positions.shape[0] == 1:  # rows one position each: the positions they take, as text rows do
            pos_start, pos_end = piece.start + lo, piece.start + hi
        else:  # an M-RoPE image takes its positions as a whole, with its last rows
            pos_start, pos_end = piece.start, piece.end if hi == piece.n_rows else piece.start
        keys = piece.keys[pos_start - piece.start:pos_end - piece.start]
        media = MediaRows(positions, pos_end, keys, causal=piece.causal)
        return PromptPart(pos_start, np.full(hi - lo, NO_TOKEN, dtype=np.int32), media, piece.rows[lo:hi])

    def close(self) -> None:
        """Free the image chunks (native memory). Idempotent."""
        for piece in self.images:
            piece.chunk.close()
