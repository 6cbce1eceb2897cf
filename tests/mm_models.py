"""Random-weight multimodal fixtures: vision projectors that libmtmd loads, the text models they pair with, and
small test images.

A projector file (llama.cpp's "mmproj") is a GGUF of architecture ``clip``: ``clip.*`` keys and ``v.*`` /
``mm.*`` tensors, as ``tools/mtmd/clip.cpp``'s loader reads them for its projector type. Two are written here:

* ``idefics3`` (SmolVLM's projector: a SigLIP vision tower, a 2x2 pixel shuffle and one linear map to the text
  model's width), for SmolLM2-135M's width of 576. An image becomes a global 32x32 view and up to 2x2 tiles of
  32x32, each 16 patches of 8x8 shuffled into 4 embeddings. libmtmd frames each view with SmolVLM's own tokens
  (``<fake_token_around_image>``, ``<global-img>``, ``<row_1_col_1>``, ...), which SmolVLM's text model has and
  SmolLM2-135M-Instruct has not: :func:`write_smolvlm_text_model` adds them to a copy of the default model.
* ``qwen2vl_merger`` (Qwen2-VL's projector: a vision tower with M-RoPE over the patches' rows and columns, and
  an MLP over 2x2 patch groups), with :func:`write_qwen2vl_text_model`, a small random ``qwen2vl`` text model
  whose rotary positions come in sections (``rope.dimension_sections``), so that an image's rows take several
  positions each and the prompt's position count differs from its token count.

Weights are random and f32 (the towers are tiny, so encoding takes milliseconds); shapes are given in numpy
order, the reverse of ggml's.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np

from skippyd.runtime.slicing import _copyable_kv
from tests.arch_models import _Model, _qwen2
from tests.tiny_model import MetadataField

CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: matched as one token when special tokens are parsed

# SmolVLM's added tokens (its tokenizer's order), which libmtmd's idefics3 prompt format looks up by text
SMOLVLM_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                  *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))
QWEN2VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")

SMOLLM2_WIDTH = 576

# architectures whose splits the image tests verify against the whole model (and llama.cpp's own multimodal
# path): tests/test_mtmd.py in one process, tests/test_images.py through skippyd on 1, 2 and 3 stages
MM_ARCHITECTURES = frozenset({"qwen2vl"})


# --------------------------------------------------------------------------- text models


def _extended_tokenizer(fields: Sequence[MetadataField], extra: Sequence[str]) -> list[MetadataField]:
    """`fields` (a tokenizer's metadata) with `extra` appended to the vocabulary as control tokens."""
    tokens = next(f.value for f in fields if f.key == gguf.Keys.Tokenizer.LIST)
    out = []
    for f in fields:
        value = f.value
        if f.key == gguf.Keys.Tokenizer.LIST:
            value = [*value, *extra]
        elif f.key == gguf.Keys.Tokenizer.TOKEN_TYPE:
            value = [*value, *([CONTROL] * len(extra))]
        elif f.key == gguf.Keys.Tokenizer.SCORES:
            value = [*value, *([0.0] * len(extra))]
        elif f.vtype == gguf.GGUFValueType.ARRAY and isinstance(value, list) and len(value) == len(tokens):
            raise ValueError(f"{f.key}: a per-token array this function does not extend")
        out.append(MetadataField(f.key, value, f.vtype, f.sub_type))
    return out


def write_smolvlm_text_model(src: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """A copy of `src` (the default model, SmolLM2-135M-Instruct) whose vocabulary also has SmolVLM's image
    tokens, as SmolVLM's own text model does. The new tokens' embedding rows are zero (as LM-head rows their
    logit is 0, below any continuation the model would pick); every other byte of the model is the source's."""
    path = Path(path)
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    fields = _extended_tokenizer(_copyable_kv(reader), SMOLVLM_TOKENS)
    n_vocab = len(next(f.value for f in fields if f.key == gguf.Keys.Tokenizer.LIST))
    writer = gguf.GGUFWriter(path, arch=arch, endianess=reader.endianess)
    writer.data_alignment = int(reader.alignment)
    for f in fields:
        writer.add_key_value(f.key, f.value, f.vtype, sub_type=f.sub_type)
    tensors = []
    for t in reader.tensors:
        data = t.data
        if t.name == "token_embd.weight":
            # rows of raw (quantized) bytes: a zero row decodes to zeros in every ggml type
            data = np.concatenate([data, np.zeros((n_vocab - data.shape[0], *data.shape[1:]), dtype=data.dtype)])
        tensors.append((t.name, data, t.tensor_type))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return path


def write_qwen2vl_text_model(path: str | os.PathLike[str], tokenizer: Sequence[MetadataField], *,
                             sections: Sequence[int] = (2, 3, 3, 0), seed: int = 0) -> Path:
    """A 4-layer, 64-wide random ``qwen2vl`` model (Qwen2's layers, M-RoPE): head width 16, whose 8 rotary
    pairs `sections` split between the time, row and column positions. `tokenizer` (e.g. the 512-token small
    vocabulary) gets Qwen2-VL's vision tokens."""
    path = Path(path)
    if 2 * sum(sections) != 16 or len(sections) != 4:
        raise ValueError("four sections of 8 rotary pairs in all")
    model = _Model(path, "qwen2vl", _extended_tokenizer(tokenizer, QWEN2VL_TOKENS), n_layer=4, seed=seed)
    model.writer.add_key_value("qwen2vl.rope.dimension_sections", list(sections), gguf.GGUFValueType.ARRAY,
                               sub_type=gguf.GGUFValueType.INT32)
    _qwen2(model)
    model.close()
    return path


# --------------------------------------------------------------------------- projectors


class _Projector:
    """A projector file being written: the ``clip.*`` keys every vision tower has, then its tensors (f32)."""

    def __init__(self, path: Path, projector_type: str, *, n_embd: int, n_head: int, n_ff: int, n_layer: int,
                 image_size: int, patch_size: int, projection_dim: int, seed: int):
        self.n_embd, self.n_ff, self.n_layer, self.patch_size = n_embd, n_ff, n_layer, patch_size
        self.rng = np.random.default_rng(seed)
        self.writer = w = gguf.GGUFWriter(path, arch="clip")
        w.add_name(f"tiny random {projector_type} projector")
        w.add_type(gguf.GGUFType.MMPROJ)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_bool("clip.has_vision_encoder", True)
        w.add_bool("clip.has_audio_encoder", False)
        w.add_bool("clip.use_gelu", True)
        w.add_string("clip.projector_type", projector_type)
        w.add_uint32("clip.vision.embedding_length", n_embd)
        w.add_uint32("clip.vision.feed_forward_length", n_ff)
        w.add_uint32("clip.vision.block_count", n_layer)
        w.add_uint32("clip.vision.attention.head_count", n_head)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
        w.add_uint32("clip.vision.projection_dim", projection_dim)
        w.add_uint32("clip.vision.image_size", image_size)
        w.add_uint32("clip.vision.patch_size", patch_size)
        w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    def tensor(self, name: str, *shape: int, std: float | None = None, around: float = 0.0) -> None:
        """A random tensor; a matrix's std defaults to 1/sqrt(its input width), so activations keep their size."""
        if std is None:
            std = shape[-1] ** -0.5 if len(shape) >= 2 else 0.02
        data = around + self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        self.writer.add_tensor(name, data.astype(np.float32))

    def norm(self, name: str, n: int) -> None:
        self.tensor(f"{name}.weight", n, std=0.1, around=1.0)
        self.tensor(f"{name}.bias", n, std=0.02)

    def linear(self, name: str, n_out: int, n_in: int) -> None:
        self.tensor(f"{name}.weight", n_out, n_in)
        self.tensor(f"{name}.bias", n_out)

    def layers(self) -> None:
        """The vision tower's transformer layers (pre-norm, biases everywhere, a GELU MLP)."""
        e = self.n_embd
        for i in range(self.n_layer):
            blk = f"v.blk.{i}"
            self.norm(f"{blk}.ln1", e)
            for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
                self.linear(f"{blk}.{name}", e, e)
            self.norm(f"{blk}.ln2", e)
            self.linear(f"{blk}.ffn_up", self.n_ff, e)
            self.linear(f"{blk}.ffn_down", e, self.n_ff)

    def close(self) -> None:
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_tensors_to_file()
        self.writer.close()


def write_idefics3_projector(path: str | os.PathLike[str], *, n_embd_text: int = SMOLLM2_WIDTH, image_size: int = 32,
                             patch_size: int = 8, longest_edge: int = 64, scale_factor: int = 2, n_embd: int = 32,
                             n_layer: int = 2, n_head: int = 2, n_ff: int | None = None, seed: int = 0) -> Path:
    """SmolVLM's projector, small by default: a SigLIP tower over `image_size` tiles of `patch_size` patches
    (learned position embeddings, a post-norm), the pixel shuffle by `scale_factor` and ``mm.model.fc`` to
    `n_embd_text`. An image is resized so its longer side is `longest_edge`, then cut into tiles, plus a global
    view. (SmolVLM-256M's tower: image_size 512, patch_size 16, scale_factor 4, n_embd 768, 12 layers of 12
    heads, n_ff 3072.)"""
    path = Path(path)
    p = _Projector(path, "idefics3", n_embd=n_embd, n_head=n_head, n_ff=n_ff or 2 * n_embd + 16, n_layer=n_layer,
                   image_size=image_size, patch_size=patch_size, projection_dim=n_embd_text, seed=seed)
    p.writer.add_uint32("clip.vision.projector.scale_factor", scale_factor)
    p.writer.add_uint32("clip.vision.preproc_image_size", longest_edge)
    n_patches = (image_size // patch_size) ** 2
    p.tensor("v.patch_embd.weight", n_embd, 3, patch_size, patch_size, std=(3 * patch_size**2) ** -0.5)
    p.tensor("v.patch_embd.bias", n_embd)
    p.tensor("v.position_embd.weight", n_patches, n_embd, std=0.5)
    p.layers()
    p.norm("v.post_ln", n_embd)
    p.tensor("mm.model.fc.weight", n_embd_text, n_embd * scale_factor**2)
    p.close()
    return path


def write_qwen2vl_projector(path: str | os.PathLike[str], *, n_embd_text: int = 64, patch_size: int = 4,
                            n_embd: int = 32, n_layer: int = 2, seed: int = 0) -> Path:
    """Qwen2-VL's projector, small: two patch kernels (an image is its own second frame), a tower with M-RoPE
    over 4-dimensional patch positions, ``v.post_ln`` and the MLP (``mm.0``, ``mm.2``) over 2x2 patch groups to
    `n_embd_text`. Images keep their size, rounded to 2 * `patch_size` (at least 8 embeddings)."""
    path = Path(path)
    p = _Projector(path, "qwen2vl_merger", n_embd=n_embd, n_head=2, n_ff=2 * n_embd + 16, n_layer=n_layer,
                   image_size=64, patch_size=patch_size, projection_dim=n_embd_text, seed=seed)
    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
        p.tensor(name, n_embd, 3, patch_size, patch_size, std=(6 * patch_size**2) ** -0.5)
    p.layers()
    p.norm("v.post_ln", n_embd)
    p.linear("mm.0", 4 * n_embd, 4 * n_embd)
    p.linear("mm.2", n_embd_text, 4 * n_embd)
    p.close()
    return path


# --------------------------------------------------------------------------- images


def image_bytes(width: int, height: int, *, seed: int, fmt: str = "PNG") -> bytes:
    """An encoded image (PNG or JPEG) of smooth random colour blobs, the same for the same arguments."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rgb = np.zeros((height, width, 3), dtype=np.float32)
    for _ in range(4):
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(4, max(width, height) / 2)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))[..., None]
        rgb += blob * rng.uniform(0, 255, 3).astype(np.float32)
    out = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB").save(out, format=fmt)
    return out.getvalue()


def claimed_size(png: bytes, width: int, height: int) -> bytes:
    """`png` whose header claims `width` x `height` (its IHDR rewritten, with a valid CRC) over the same few
    pixels: what a decompression bomb looks like before it is decoded."""
    import struct
    import zlib

    if png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        raise ValueError("not a PNG starting with its IHDR")
    ihdr = b"IHDR" + struct.pack(">II", width, height) + png[24:29]
    return png[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + png[33:]
