"""llama-cpp-python as the reference a split model must agree with.

The pinned sdist skippy builds libllama from (``llama-cpp-python==0.3.36``,
cached by the native build) carries llama-cpp-python's own Python package.
Its ``llama_cpp`` package is extracted once per test run and given skippy's
libllama build as its ``lib/``: the same llama.cpp source and kernels, so a
whole-model greedy run is the same computation bit for bit (skippy's patches
act only on stage files), while llama-cpp-python's own batching, sampling and
generation loop stand for "plain llama.cpp". Building its own copy would cost
the suite minutes for the same bits.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

from skippyd.runtime.pypi import fetch_pinned

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "skippyd" / "_native"

_spec = importlib.util.spec_from_file_location("skippy_native_build", ROOT / "native" / "build.py")
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)  # type: ignore[union-attr]


def install_llama_cpp(into: Path):
    """Extract llama-cpp-python's package into `into` (once) and import it."""
    package = into / "llama_cpp"
    if not package.exists():
        sdist = fetch_pinned("llama-cpp-python", _build.LLAMA_CPP_PYTHON_VERSION, _build.SDIST_FILENAME,
                             _build.SDIST_SHA256)
        prefix = f"llama_cpp_python-{_build.LLAMA_CPP_PYTHON_VERSION}/llama_cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
            for m in members:
                m.name = m.name.removeprefix(f"llama_cpp_python-{_build.LLAMA_CPP_PYTHON_VERSION}/")
            tar.extractall(into, members=members, filter="data")
        os.symlink(NATIVE, package / "lib")
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    module = importlib.import_module("llama_cpp")
    # its import installs its own log callback in the shared libllama; skippy's keeps load errors explained
    from skippyd._native._skippy_llama import lib

    lib.skippy_log_setup(1 if os.environ.get("SKIPPY_LLAMA_LOG") == "1" else 0)
    return module


def greedy_tokens(llama_cpp, model: str | os.PathLike[str], prompt: Sequence[int], n: int, *,
                  n_ctx: int = 2048, n_batch: int = 512) -> list[int]:
    """`n` greedy tokens after `prompt` (token ids), as llama-cpp-python's `Llama.generate` gives them."""
    llm = llama_cpp.Llama(str(model), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=2,
                          verbose=False)
    try:
        out: list[int] = []
        for token in llm.generate(list(prompt), temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if len(out) >= n:
                break
        return out
    finally:
        llm.close()
