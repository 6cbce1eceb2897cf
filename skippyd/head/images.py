"""The images of a request, from bytes to the chunks of its prompt, and the limits they are held to.

An image arrives as encoded bytes (PNG, JPEG, ...: an OpenAI data URL's, a
control message's base64), with a name for errors (``messages[0].content[1]``,
``images[0]``). Before anything is decoded: its size against
``runtime.image_max_mb`` and the pixels its header claims against
``runtime.image_max_pixels`` (both 413), so that a decompression bomb never
allocates its pixels. Then (in a worker thread, by :func:`image_prompt`)
libmtmd decodes it (bytes that are no image: 400 naming it) and cuts the
prompt, one media marker per image, into text and image chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from skippyd.head.errors import ImageRefused
from skippyd.head.prompt import Prompt
from skippyd.runtime import mtmd

DEFAULT_MAX_BYTES = 20 << 20
DEFAULT_MAX_PIXELS = 1 << 25  # 32 Mi pixels (8192 x 4096): 96 MiB decoded as RGB


@attrs.frozen
class ImageInput:
    """An image as a request sent it: its encoded bytes, and where it was in the request."""

    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")
    source: str


@attrs.frozen
class ImageLimits:
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS

    def check(self, image: ImageInput) -> None:
        """ImageRefused (413) for an image over a limit; 400 for bytes whose header is no image's."""
        size = len(image.data)
        if size > self.max_bytes:
            raise ImageRefused(f"{image.source}: the image is {size} bytes, more than the {self.max_bytes} bytes "
                               f"this server takes (runtime.image_max_mb)", source=image.source, status=413,
                               code="image_too_large")
        dims = mtmd.image_size(image.data)
        if dims is None:
            raise not_an_image(image)
        width, height = dims
        if width * height > self.max_pixels:
            raise ImageRefused(f"{image.source}: the image is {width} x {height} pixels, more than the "
                               f"{self.max_pixels} this server takes (runtime.image_max_pixels)",
                               source=image.source, status=413, code="image_too_large")
        if not width or not height:
            raise not_an_image(image)


def not_an_image(image: ImageInput) -> ImageRefused:
    return ImageRefused(f"{image.source}: {len(image.data)} bytes that are no image this server decodes (PNG, "
                        f"JPEG, GIF, BMP, TGA, PSD, HDR, PIC, PNM)", source=image.source)


def image_prompt(projector: mtmd.Projector, text: str, images: Sequence[ImageInput], *, raw: bool) -> Prompt:
    """`text` (one media marker per image) and the images, as the prompt's pieces: decoded and cut into
    chunks by libmtmd, the text tokenized as a text prompt's is (``raw``: the model's BOS added, special tokens
    kept as text; else a chat template's text, special tokens parsed). Blocking (decoding, resizing): run it
    in a worker thread. ImageRefused for bytes that are no image, or markers that do not match the images."""
    bitmaps = []
    try:
        for image in images:
            try:
                bitmaps.append(mtmd.Bitmap.from_bytes(image.data))
            except mtmd.ImageDecodeError:
                raise not_an_image(image) from None
        try:
            chunks = projector.tokenize(text, bitmaps, add_special=raw, parse_special=not raw)
        except mtmd.TokenizeError as exc:
            raise ImageRefused(f"the prompt and its images: {exc}") from None
        try:
            return Prompt.of_chunks(chunks)
        except BaseException:
            for c in chunks:
                if hasattr(c, "close"):
                    c.close()
            raise
    finally:
        for b in bitmaps:
            b.close()
