"""Tiny random-weight llama GGUF files for fast tests.

libllama loads these like any model: the metadata is complete and the
tokenizer is the real SmolLM2 one (copied from the default model), so prompts
tokenize and detokenize normally (49152 tokens). The weights are small random
numbers, so the output is gibberish but deterministic for a given seed.

Shapes follow the gguf package's convention: arrays are given in numpy
(row-major) order and GGUF stores the dimensions reversed, so
`token_embd` is numpy (n_vocab, n_embd), i.e. ggml {n_embd, n_vocab}.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import gguf
import numpy as np


@attrs.frozen
class MetadataField:
    """One GGUF key with its value and types, ready for `GGUFWriter.add_key_value`."""

    key: str
    value: Any
    vtype: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None


def load_tokenizer(path: str | os.PathLike[str]) -> list[MetadataField]:
    """Every `tokenizer.*` key of a GGUF file (vocabulary, merges, special ids, chat template).

    Parsing a 49k-token vocabulary takes ~2 s, so load it once per session and
    pass the result to `write_tiny_llama`.
    """
    reader = gguf.GGUFReader(path)
    fields = []
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = gguf.GGUFValueType(int(field.parts[3][0])) if vtype == gguf.GGUFValueType.ARRAY else None
        fields.append(MetadataField(field.name, field.contents(), vtype, sub_type))
    return fields


def small_vocabulary(tokenizer: Sequence[MetadataField], n_vocab: int = 512) -> list[MetadataField]:
    """The first `n_vocab` tokens of a BPE tokenizer, with the merges that stay inside them.

    Files with a small vocabulary parse in milliseconds with `GGUFReader`
    (the full 49k-token SmolLM2 vocabulary costs ~2 s per open), which keeps
    tests that only look at metadata and tensors fast. Special token ids
    must be below `n_vocab`.
    """
    fields = {f.key: f for f in tokenizer}
    tokens = fields[gguf.Keys.Tokenizer.LIST].value[:n_vocab]
    kept = set(tokens)
    out = []
    for f in tokenizer:
        value = f.value
        if f.key == gguf.Keys.Tokenizer.MERGES:
            value = [m for m in value if all(p in kept for p in m.split(" ")) and m.replace(" ", "") in kept]
        elif f.vtype == gguf.GGUFValueType.ARRAY and len(value) == len(fields[gguf.Keys.Tokenizer.LIST].value):
            value = value[:n_vocab]  # per-token arrays: token_type, scores
        elif f.key.endswith("_token_id") and isinstance(value, int) and value >= n_vocab:
            raise ValueError(f"{f.key} = {value} does not fit in {n_vocab} tokens")
        out.append(attrs.evolve(f, value=value))
    return out


def write_tiny_llama(
    path: str | os.PathLike[str],
    *,
    tokenizer_from: Sequence[MetadataField] | str | os.PathLike[str] | None = None,
    tokenizer: Sequence[MetadataField] | str | os.PathLike[str] | None = None,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    context_length: int = 2048,
    seed: int = 0,
    arch: str = "llama",
    output_weight: bool = True,
    weight_type: Literal["f16", "f32"] = "f16",
    alignment: int | None = None,
    extra_metadata: Sequence[MetadataField] = (),
) -> Path:
    """Write a tiny llama-shaped GGUF model with random weights and return its path.

    `tokenizer_from` is a GGUF path to copy the tokenizer from, or the result
    of `load_tokenizer` (faster when writing several files); by default the
    default model is fetched and used. `tokenizer` is an alias.
    `output_weight=False` makes a tied-embedding model (like SmolLM2).
    `arch` only changes the metadata prefix and `general.architecture`, so a
    test can produce, for example, a "gemma" file the slicer must refuse.
    `alignment` sets a non-default `general.alignment` for tensor data.
    `extra_metadata` is added last (for per-layer arrays or refused keys).
    """
    path = Path(path)
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must be a multiple of n_head, and n_head of n_head_kv")
    if tokenizer is not None and tokenizer_from is not None:
        raise TypeError("give tokenizer_from or its alias tokenizer, not both")
    source = tokenizer_from if tokenizer_from is not None else tokenizer
    if source is None:
        from skippyd.runtime.models import fetch_default_model

        source = fetch_default_model()
    fields = load_tokenizer(source) if isinstance(source, (str, os.PathLike)) else list(source)
    tokens = next((f.value for f in fields if f.key == gguf.Keys.Tokenizer.LIST), None)
    if not tokens:
        raise ValueError("the tokenizer has no tokenizer.ggml.tokens")
    n_vocab = len(tokens)
    head_dim = n_embd // n_head

    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_name(f"tiny-{arch}-test")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if weight_type == "f16" else gguf.LlamaFileType.ALL_F32)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for f in fields:
        writer.add_key_value(f.key, f.value, f.vtype, sub_type=f.sub_type)
    for f in extra_metadata:
        writer.add_key_value(f.key, f.value, f.vtype, sub_type=f.sub_type)

    rng = np.random.default_rng(seed)
    dtype = np.float16 if weight_type == "f16" else np.float32

    def matrix(rows: int, cols: int) -> np.ndarray:
        # Small weights keep activations in a sane range through every layer.
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(dtype)

    def norm() -> np.ndarray:
        return np.ones(n_embd, dtype=np.float32)  # ggml norms are f32

    n_embd_kv = head_dim * n_head_kv
    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.attn_q.weight", matrix(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", matrix(n_embd_kv, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", matrix(n_embd_kv, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", matrix(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", matrix(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", matrix(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", norm())
    if output_weight:
        writer.add_tensor("output.weight", matrix(n_vocab, n_embd))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
