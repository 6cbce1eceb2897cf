"""libmtmd through cffi: a text model's multimodal projector, images, and prompts cut into text and image chunks.

What the head needs to put images through a pipeline: a :class:`Projector` (the "mmproj" GGUF of a vision
model, loaded against the text model it feeds), :class:`Bitmap` (an image decoded from PNG/JPEG/... bytes),
:meth:`Projector.tokenize` (a prompt with one media marker per image, cut into :class:`TextChunk` and
:class:`ImageChunk` in prompt order) and :meth:`ImageChunk.encode` (the image's rows, float32 ``[n_tokens,
n_embd]``, the input embeddings the first stage decodes in place of token ids). :func:`image_positions` is
the position arithmetic llama.cpp's own helper (``mtmd_helper_eval_chunks``) uses, so that the head can give
every stage the positions of the rows it forwards.

Like llama.py (whose ``ffi``/``lib`` it shares: one extension), this module touches pointers; everything it
hands out is Python or numpy, copied out of C memory at once. Native objects have an idempotent ``close()``;
C failures become :class:`MtmdError` subclasses; arguments are checked before they reach C++.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

import attrs
import gguf
import numpy as np

from skippyd.runtime.gguf_info import ModelFileError, field_value, open_gguf
from skippyd.runtime.llama import InvalidArgumentError, LlamaError, Model, backend_init
from skippyd.runtime.llama.ffi import NativeObject, ffi, lib

# M-RoPE takes this many positions per embedding row (llama.cpp's GGML_MROPE_SECTIONS): time, row, column and
# a fourth section that images and text leave at 0
MROPE_SECTIONS = 4


class MtmdError(LlamaError):
    """A libmtmd operation failed. ``op`` names the operation."""


class ProjectorLoadError(MtmdError):
    """A projector file could not be loaded for a text model: not a projector, unreadable, or the wrong width."""


class ImageDecodeError(MtmdError, ValueError):
    """Bytes that are not an image this build can decode."""


class TokenizeError(MtmdError):
    """A multimodal prompt could not be cut into chunks."""


class EncodeError(MtmdError):
    """The projector failed to encode an image."""


_log_lock = threading.Lock()
_log_ready = False


def _init() -> None:
    """llama.cpp's backend and libmtmd's logging (into llama.cpp's, so errors reach our exceptions), once."""
    global _log_ready
    backend_init()
    with _log_lock:
        if not _log_ready:
            lib.skippy_mtmd_log_setup()
            _log_ready = True


def default_marker() -> str:
    """The text that stands for one image in a prompt unless a projector says otherwise ("<__media__>")."""
    return ffi.string(lib.mtmd_default_marker()).decode()


# --------------------------------------------------------------------------- positions


def text_positions(start: int, n_tokens: int) -> np.ndarray:
    """The positions of a text chunk's tokens from `start`: one each, consecutive (int32 ``[n_tokens]``). On an
    M-RoPE model a stage that receives these rows as hidden states spreads each over the sections as llama.cpp
    does for a token: (p, p, p, 0)."""
    return np.arange(start, start + n_tokens, dtype=np.int32)


def image_positions(start: int, n_tokens: int, grid: tuple[int, int] | None) -> np.ndarray:
    """The positions of an image chunk's rows from `start`, as llama.cpp's ``mtmd_helper_decode_image_chunk``
    gives them to ``llama_decode``.

    Without M-RoPE (`grid` None): one per row, consecutive (int32 ``[n_tokens]``); the chunk takes
    ``n_tokens`` positions. With M-RoPE (`grid` the image's ``(nx, ny)`` in embeddings): four per row,
    section-major (int32 ``[4, n_tokens]``), row i at time ``start``, image row ``start + i // nx``, image column
    ``start + i % nx`` and 0; the chunk takes ``max(nx, ny)`` positions, the next chunk starts there.
    """
    if n_tokens < 1:
        raise InvalidArgumentError("image positions", "an image chunk has at least one row")
    if grid is None:
        return np.arange(start, start + n_tokens, dtype=np.int32)
    nx, ny = grid
    if nx < 1 or ny < 1 or nx * ny != n_tokens:
        raise InvalidArgumentError("image positions", f"grid {nx}x{ny} does not hold {n_tokens} rows")
    i = np.arange(n_tokens, dtype=np.int32)
    pos = np.empty((MROPE_SECTIONS, n_tokens), dtype=np.int32)
    pos[0] = start
    pos[1] = start + i // nx
    pos[2] = start + i % nx
    pos[3] = 0
    return pos


# --------------------------------------------------------------------------- bitmaps


def _looks_like_audio(data: bytes) -> bool:
    # what libmtmd's helper takes for audio (WAV, MP3, FLAC) and would decode as such
    return len(data) >= 12 and (
        (data[:4] == b"RIFF" and data[8:12] == b"WAVE")
        or data[:3] == b"ID3"
        or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0)
        or data[:4] == b"fLaC"
    )


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# JPEG markers of a frame header (SOF0..SOF15 but DHT, JPG and DAC), which holds the image's size
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The size in a JPEG's frame header, found by walking its marker segments (none of the image decoded)."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a segment
            i += 2
            continue
        (length,) = struct.unpack_from(">H", data, i + 2)
        if marker in _JPEG_SOF:
            if i + 9 > n:
                return None
            height, width = struct.unpack_from(">HH", data, i + 5)
            return width, height
        i += 2 + length
    return None


def image_size(data: bytes | bytearray | memoryview) -> tuple[int, int] | None:
    """(width, height) of an encoded image as its header says, without decoding it (nothing the size of the
    image is allocated): PNG, JPEG, GIF and BMP read here (whatever size they claim), other formats by
    stb_image's header reader; None for data whose header says nothing."""
    data = data if isinstance(data, bytes) else bytes(data)
    if data[:8] == _PNG_SIGNATURE and data[12:16] == b"IHDR" and len(data) >= 24:
        return struct.unpack_from(">II", data, 16)
    if data[:3] == b"\xff\xd8\xff":
        return _jpeg_size(data)
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return struct.unpack_from("<HH", data, 6)
    if data[:2] == b"BM" and len(data) >= 26:
        width, height = struct.unpack_from("<ii", data, 18)
        return abs(width), abs(height)
    if not data:
        return None
    _init()
    x, y, comp = ffi.new("int *"), ffi.new("int *"), ffi.new("int *")
    if not lib.stbi_info_from_memory(ffi.from_buffer("unsigned char[]", data), min(len(data), 2**31 - 1), x, y,
                                     comp):
        return None
    return int(x[0]), int(y[0])


class Bitmap(NativeObject):
    """An image decoded to RGB by libmtmd (stb_image: PNG, JPEG, BMP, GIF, ...), with its id: the sha256 of its
    size and decoded pixels, which libmtmd carries into the image's chunks (the same picture sent as another
    file, or with other metadata, has the same id)."""

    _kind = "bitmap"

    def __init__(self, ptr, nbytes: int):
        self._ptr = ptr
        self.nx = int(lib.mtmd_bitmap_get_nx(ptr))
        self.ny = int(lib.mtmd_bitmap_get_ny(ptr))
        digest = hashlib.sha256(struct.pack("<II", self.nx, self.ny))
        digest.update(ffi.buffer(lib.mtmd_bitmap_get_data(ptr), int(lib.mtmd_bitmap_get_n_bytes(ptr))))
        self.id = digest.hexdigest()
        lib.mtmd_bitmap_set_id(ptr, self.id.encode())
        self.encoded_bytes = nbytes

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Bitmap:
        """Decode an encoded image; :class:`ImageDecodeError` for bytes that are not one."""
        op = "decode image"
        data = bytes(data)
        if not data:
            raise ImageDecodeError(op, "no image data (0 bytes)")
        if _looks_like_audio(data):
            raise ImageDecodeError(op, "the data is audio (WAV, MP3 or FLAC), not an image")
        _init()
        lib.skippy_clear_last_error()
        # the helper reads the context only for audio (refused above) and video (not in this build)
        wrapped = lib.mtmd_helper_bitmap_init_from_buf(ffi.NULL, data, len(data), False,
                                                       lib.mtmd_helper_init_opt_default())
        if wrapped.bitmap == ffi.NULL:
            raise ImageDecodeError(op, f"{len(data)} bytes that are not an image this build decodes "
                                       f"(PNG, JPEG, BMP, GIF, TGA, PSD, HDR, PIC, PNM), starting {data[:8]!r}")
        return cls(wrapped.bitmap, len(data))

    @classmethod
    def blank(cls, width: int, height: int) -> Bitmap:
        """A black image of that size (what the projector makes of an image of a size, whatever it shows)."""
        op = "make image"
        if not 0 < width <= 1 << 16 or not 0 < height <= 1 << 16:
            raise InvalidArgumentError(op, f"an image of {width} x {height} pixels")
        _init()
        ptr = lib.mtmd_bitmap_init(width, height, bytes(3 * width * height))
        if ptr == ffi.NULL:
            raise MtmdError(op, "mtmd_bitmap_init returned NULL")
        return cls(ptr, 0)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.nx, self.ny

    def close(self) -> None:
        if self._ptr != ffi.NULL:
            lib.mtmd_bitmap_free(self._ptr)
            self._ptr = ffi.NULL


# --------------------------------------------------------------------------- chunks


@attrs.frozen(eq=False)
class TextChunk:
    """Text of a multimodal prompt, tokenized (int32 token ids), as the first stage decodes it."""

    tokens: np.ndarray

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_pos(self) -> int:
        return self.n_tokens

    def positions(self, start: int) -> np.ndarray:
        return text_positions(start, self.n_tokens)


class ImageChunk(NativeObject):
    """One image (or one tile of it) of a multimodal prompt: ``n_tokens`` embedding rows taking ``n_pos``
    positions. :meth:`encode` runs the projector; :meth:`positions` gives the rows' positions.

    ``id`` is the image's id (a :class:`Bitmap`'s: the sha256 of its pixels): every tile of one image has the
    same id (a cache keyed by it must also key on the tile's place). ``grid`` is the rows'
    layout ``(nx, ny)`` for an M-RoPE model (None otherwise); ``non_causal`` says that its rows attend to each
    other both ways (the context must decode them with causal attention off, in one batch)."""

    _kind = "image chunk"

    def __init__(self, projector: Projector, chunk_ptr, *, n_tokens: int, n_pos: int, id: str,
                 grid: tuple[int, int] | None, non_causal: bool):
        self._projector = projector
        self._ptr = chunk_ptr  # our own copy of the chunk (mtmd_input_chunk_copy), freed by close()
        self._use = threading.Lock()  # held by an encode of it: close() waits for that, and no other
        self.n_tokens = n_tokens
        self.n_pos = n_pos
        self.id = id
        self.grid = grid
        self.non_causal = non_causal

    def positions(self, start: int) -> np.ndarray:
        return image_positions(start, self.n_tokens, self.grid)

    def encode(self) -> np.ndarray:
        """The image's embedding rows, float32 ``[n_tokens, n_embd]`` (a copy; the projector's CPU threads)."""
        op = "encode image"
        with self._use:
            return self._projector._encode(self._live(op), self.n_tokens, op)

    def close(self) -> None:
        with self._use:  # never under an encode of it in another thread
            if self._ptr != ffi.NULL:
                lib.mtmd_input_chunk_free(self._ptr)
                self._ptr = ffi.NULL

    def __repr__(self) -> str:
        return f"ImageChunk(n_tokens={self.n_tokens}, n_pos={self.n_pos}, id={self.id[:12]!r}, grid={self.grid})"


Chunk = TextChunk | ImageChunk


def prompt_positions(chunks: Sequence[Chunk], start: int = 0) -> int:
    """Where decoding goes on after `chunks` from `start`: the sum of their position counts."""
    return start + sum(c.n_pos for c in chunks)


# --------------------------------------------------------------------------- projector

_WIDTH_MISMATCH = re.compile(r"text model \(n_embd = (\d+)\) and mmproj \(n_embd = (\d+)\)")


def _projector_info(path: Path) -> dict[str, object]:
    """The projector file's type and modalities from its metadata (ProjectorLoadError: not a projector)."""
    op = "load projector"
    try:
        reader = open_gguf(path)
    except ModelFileError as exc:
        raise ProjectorLoadError(op, str(exc)) from None
    arch = field_value(reader, gguf.Keys.General.ARCHITECTURE)
    if arch != "clip":
        raise ProjectorLoadError(op, f"{path} is not a multimodal projector (its architecture is {arch!r}, not "
                                     "'clip')")
    vision = bool(field_value(reader, "clip.has_vision_encoder", False))
    kind = field_value(reader, "clip.projector_type") or field_value(reader, "clip.vision.projector_type")
    if not vision:
        raise ProjectorLoadError(op, f"{path} has no vision encoder (a projector for audio only?)")
    size = field_value(reader, "clip.vision.image_size", 0)
    return {"projector_type": str(kind) if kind else "unknown", "image_size": int(size) if size else 0}


class Projector(NativeObject):
    """A multimodal projector file loaded for `model` (the text model its embeddings feed; a whole model or
    the first stage of one, whose input width they must have).

    ``n_threads`` CPU threads encode images; ``warmup`` runs one encode at load time (llama.cpp's default: it
    sizes the compute buffers up front, at the cost of an encode of the largest image the projector takes)."""

    _kind = "projector"

    def __init__(self, model: Model, path: str | os.PathLike[str], *, n_threads: int = 2, warmup: bool = True,
                 use_gpu: bool = False):
        self._ptr = ffi.NULL
        self._lock = threading.Lock()  # mtmd_encode_chunk and its output buffer: one encode at a time
        op = "load projector"
        if n_threads < 1:
            raise InvalidArgumentError(op, "n_threads must be >= 1")
        self.path = Path(path)
        self.model = model
        info = _projector_info(self.path)
        _init()
        params = lib.mtmd_context_params_default()
        params.use_gpu = bool(use_gpu)
        params.print_timings = False
        params.n_threads = int(n_threads)
        params.warmup = bool(warmup)
        lib.skippy_clear_last_error()
        ptr = lib.mtmd_init_from_file(os.fsencode(self.path), model._live(op), params)
        if ptr == ffi.NULL:
            native = ffi.string(lib.skippy_last_error()).decode("utf-8", "replace")
            lib.skippy_clear_last_error()
            m = _WIDTH_MISMATCH.search(native)
            if m:
                raise ProjectorLoadError(op, f"{self.path} outputs embeddings {m.group(2)} wide, but the text model "
                                             f"{model.path.name} takes {m.group(1)}: not its projector")
            reason = native.splitlines()[0] if native else "libmtmd could not load it"
            raise ProjectorLoadError(op, f"{self.path}: {reason}")
        self._ptr = ptr
        self.projector_type: str = info["projector_type"]  # type: ignore[assignment]
        # the vision encoder's input (a side, in pixels): what an image is resized or cut to
        self.image_size: int = info["image_size"] or 224  # type: ignore[assignment]
        self.n_embd = model.n_embd_inp
        self.marker = ffi.string(lib.mtmd_get_marker(ptr)).decode()
        self.supports_vision = bool(lib.mtmd_support_vision(ptr))
        self.uses_mrope = bool(lib.mtmd_decode_use_mrope(ptr))
        # the default for an image chunk; each ImageChunk carries its own
        self.non_causal = bool(lib.mtmd_decode_use_non_causal(ptr, ffi.NULL))
        self.n_pos_per_embd = MROPE_SECTIONS if self.uses_mrope else 1

    def _live(self, op: str):
        self.model._live(op)  # the projector reads the text model's vocabulary
        return super()._live(op)

    def close(self) -> None:
        if self._ptr != ffi.NULL:
            lib.mtmd_free(self._ptr)
            self._ptr = ffi.NULL

    # -- prompts
    def tokenize(self, text: str, bitmaps: Sequence[Bitmap], *, add_special: bool = True,
                 parse_special: bool = True) -> list[Chunk]:
        """`text` with one :attr:`marker` per bitmap, cut into text and image chunks in prompt order (the
        projector's own framing tokens around each image included). ``add_special`` adds the text model's BOS
        where it wants one."""
        op = "tokenize prompt"
        ptr = self._live(op)
        n_markers = text.count(self.marker)
        if n_markers != len(bitmaps):
            raise TokenizeError(op, f"the prompt has {n_markers} image markers ({self.marker}) for "
                                    f"{len(bitmaps)} images")
        bitmap_ptrs = ffi.new("mtmd_bitmap *[]", max(1, len(bitmaps)))
        for i, b in enumerate(bitmaps):
            bitmap_ptrs[i] = b._live(op)
        data = text.encode("utf-8")
        text_c = ffi.new("char[]", data)
        inp = ffi.new("mtmd_input_text *")
        inp.text, inp.text_len, inp.add_special, inp.parse_special = text_c, len(data), add_special, parse_special
        chunks = lib.mtmd_input_chunks_init()
        if chunks == ffi.NULL:
            raise TokenizeError(op, "mtmd_input_chunks_init returned NULL")
        try:
            lib.skippy_clear_last_error()
            rc = lib.mtmd_tokenize(ptr, chunks, inp, ffi.cast("const mtmd_bitmap * const *", bitmap_ptrs),
                                   len(bitmaps))
            if rc == 1:
                raise TokenizeError(op, "the number of images does not match the prompt's markers")
            if rc != 0:
                raise TokenizeError(op, f"libmtmd could not preprocess the images ({rc})")
            return [self._chunk(lib.mtmd_input_chunks_get(chunks, i), op)
                    for i in range(lib.mtmd_input_chunks_size(chunks))]
        finally:
            lib.mtmd_input_chunks_free(chunks)

    def image_rows(self, width: int, height: int) -> int:
        """The embedding rows (tokens) an image of that size becomes, every tile's together. TokenizeError for a
        text model that lacks the tokens this projector frames images with."""
        with Bitmap.blank(width, height) as bitmap:
            chunks = self.tokenize(self.marker, [bitmap], add_special=False)
        try:
            return sum(c.n_tokens for c in chunks if isinstance(c, ImageChunk))
        finally:
            for c in chunks:
                if isinstance(c, ImageChunk):
                    c.close()

    def _chunk(self, c, op: str) -> Chunk:
        kind = lib.mtmd_input_chunk_get_type(c)
        if kind == lib.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ffi.new("size_t *")
            p = lib.mtmd_input_chunk_get_tokens_text(c, n)
            tokens = np.frombuffer(ffi.buffer(p, n[0] * 4), dtype=np.int32).copy() if n[0] else np.empty(0, np.int32)
            if n[0] and (tokens.min() < 0 or tokens.max() >= self.model.n_vocab):
                raise TokenizeError(op, f"projector {self.path.name} frames images with tokens that the text "
                                        f"model {self.model.path.name} does not have (not its text model?)")
            return TextChunk(tokens)
        if kind != lib.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            raise TokenizeError(op, f"a chunk of type {int(kind)}: only text and images are supported")
        n_tokens = int(lib.mtmd_input_chunk_get_n_tokens(c))
        n_pos = int(lib.mtmd_input_chunk_get_n_pos(c))
        idp = lib.mtmd_input_chunk_get_id(c)
        grid = None
        if self.uses_mrope:
            # the last row's place relative to the chunk's start: (nx - 1, ny - 1) of a single-frame image
            last = lib.mtmd_image_tokens_get_decoder_pos(lib.mtmd_input_chunk_get_tokens_image(c), 0, n_tokens - 1)
            grid = (int(last.x) + 1, int(last.y) + 1)
            if grid[0] * grid[1] != n_tokens or max(grid) != n_pos:
                raise TokenizeError(op, f"an image chunk of {n_tokens} rows and {n_pos} positions is not a "
                                        f"{grid[0]}x{grid[1]} image (several frames?)")
        copy = lib.mtmd_input_chunk_copy(c)
        if copy == ffi.NULL:
            raise TokenizeError(op, "mtmd_input_chunk_copy returned NULL")
        return ImageChunk(self, copy, n_tokens=n_tokens, n_pos=n_pos,
                          id="" if idp == ffi.NULL else ffi.string(idp).decode(), grid=grid,
                          non_causal=bool(lib.mtmd_decode_use_non_causal(self._ptr, c)))

    def _encode(self, chunk_ptr, n_tokens: int, op: str) -> np.ndarray:
        with self._lock:
            ptr = self._live(op)
            lib.skippy_clear_last_error()
            rc = lib.mtmd_encode_chunk(ptr, chunk_ptr)
            if rc != 0:
                raise EncodeError(op, f"mtmd_encode_chunk returned {rc}")
            out = lib.mtmd_get_output_embd(ptr)
            if out == ffi.NULL:
                raise EncodeError(op, "mtmd_get_output_embd returned NULL")
            count = n_tokens * self.n_embd
            return np.frombuffer(ffi.buffer(out, count * 4), dtype=np.float32).reshape(n_tokens, self.n_embd).copy()
