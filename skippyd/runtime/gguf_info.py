"""Read GGUF files with clear errors, and summarise them.

`gguf.GGUFReader` reports a bad file with whatever numpy happens to raise
(a reshape error for a truncated file, a memmap error for an empty one).
`open_gguf` turns all of that into one `ModelFileError` whose message names
the file and says what is wrong with it, so the CLI and the daemon can print
one line instead of a traceback.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import gguf

GGUF_MAGIC = b"GGUF"

# Keys the slicer writes into every stage file (see slicing.py).
SKIPPY_LAYER_START = "skippy.layer_start"
SKIPPY_LAYER_END = "skippy.layer_end"
SKIPPY_N_LAYER_TOTAL = "skippy.n_layer_total"
SKIPPY_OUTPUT = "skippy.output"
SKIPPY_SOURCE_SHA256 = "skippy.source_sha256"


# What numpy says when the reader's views run past the end of the memory map.
_SHORT_FILE_SYMPTOMS = ("reshape", "larger dtype", "out of bounds")


class ModelFileError(ValueError):
    """A model file is missing, unreadable, truncated or not a GGUF file."""


def open_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """Open `path` with `GGUFReader`, raising `ModelFileError` for any bad file.

    The reader memory-maps the file and parses all metadata up front (about
    2 s for a 49k-token vocabulary); the tensor data is only read on access.
    """
    path = Path(path)
    _check_header(path)
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, MemoryError) as exc:
        size = path.stat().st_size
        reason = str(exc) or type(exc).__name__
        # A short file shows up as a numpy view, reshape or index error deep
        # inside the reader; say what it means instead.
        if isinstance(exc, IndexError) or any(s in reason for s in _SHORT_FILE_SYMPTOMS):
            reason = "the file ends before the data its header describes (incomplete download or copy?)"
        raise ModelFileError(f"{path}: truncated or corrupt GGUF file ({size} bytes): {reason}") from None
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _check_header(path: Path) -> None:
    """Fail early, with a precise message, for files that are obviously not GGUF."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ModelFileError(f"{path}: is a directory, not a GGUF file") from None
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not head:
        raise ModelFileError(f"{path}: file is empty, not a GGUF file")
    if len(head) < len(GGUF_MAGIC) and GGUF_MAGIC.startswith(head):
        raise ModelFileError(f"{path}: truncated GGUF file ({len(head)} bytes)")
    if head != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (starts with {head!r}, expected {GGUF_MAGIC!r})")


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The decoded value of metadata `key` (str, number, bool or list), or `default`."""
    field = reader.get_field(key)
    if field is None:
        return default
    return field.contents()


def field_length(reader: gguf.GGUFReader, key: str) -> int | None:
    """Number of elements of an array field without decoding it (None if absent)."""
    field = reader.get_field(key)
    if field is None:
        return None
    if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
        return len(field.data)
    return 1


def architecture(reader: gguf.GGUFReader) -> str:
    arch = field_value(reader, gguf.Keys.General.ARCHITECTURE)
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"{reader.data.filename}: GGUF file has no general.architecture")
    return arch


def _file_type_name(value: Any) -> str | None:
    if not isinstance(value, int):
        return None
    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"unknown ({value})"


def summarize(reader: gguf.GGUFReader, path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON-friendly summary of an opened GGUF file.

    Keys: path, file_size, architecture, name, n_layer, n_embd, n_head,
    n_head_kv, n_ff, n_vocab, context_length, tensor_count, file_type,
    tensor_types ({ggml type name: count}), has_output_weight, and stage
    (None for a whole model; for a slice written by the slicer a dict with
    layer_start, layer_end, n_layer_total, output, source_sha256).
    `models.inspect_gguf` adds whether the model can be split.
    """
    path = Path(path)
    arch = architecture(reader)

    def arch_key(name: str) -> Any:
        return field_value(reader, f"{arch}.{name}")

    tensor_types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    n_vocab = field_length(reader, gguf.Keys.Tokenizer.LIST) or arch_key("vocab_size")
    info: dict[str, Any] = {
        "path": str(path),
        "file_size": path.stat().st_size,
        "architecture": arch,
        "name": field_value(reader, gguf.Keys.General.NAME),
        "n_layer": arch_key("block_count"),
        "n_embd": arch_key("embedding_length"),
        "n_head": arch_key("attention.head_count"),
        "n_head_kv": arch_key("attention.head_count_kv"),
        "n_ff": arch_key("feed_forward_length"),
        "n_vocab": n_vocab,
        "context_length": arch_key("context_length"),
        "tensor_count": len(reader.tensors),
        "file_type": _file_type_name(field_value(reader, gguf.Keys.General.FILE_TYPE)),
        "tensor_types": dict(tensor_types.most_common()),
        "has_output_weight": any(t.name == "output.weight" for t in reader.tensors),
        "stage": None,
    }
    if reader.get_field(SKIPPY_OUTPUT) is not None:
        info["stage"] = {
            "layer_start": field_value(reader, SKIPPY_LAYER_START),
            "layer_end": field_value(reader, SKIPPY_LAYER_END),
            "n_layer_total": field_value(reader, SKIPPY_N_LAYER_TOTAL),
            "output": field_value(reader, SKIPPY_OUTPUT),
            "source_sha256": field_value(reader, SKIPPY_SOURCE_SHA256),
        }
    return info
