"""llama-cpp-python as the reference a split model must agree with.

The pinned sdist skippy builds libllama from (``llama-cpp-python==0.3.36``,
cached by the native build) carries llama-cpp-python's own Python package.
Its ``llama_cpp`` package is extracted once per test run and given skippy's
libllama build as its ``lib/``: the same llama.cpp source and kernels, so a
whole-model greedy run is the same computation bit for bit (skippy's patches
act only on stage files), while llama-cpp-python's own batching, sampling and
generation loop stand for "plain llama.cpp". Building its own copy would cost
the suite minutes for the same bits. Its ``mtmd_cpp`` bindings load skippy's
libmtmd the same way: :func:`mtmd_greedy_tokens` is llama.cpp's own multimodal
prompt evaluation (``mtmd_helper_eval_chunks``).
"""

from __future__ import annotations

import ctypes
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


def mtmd_greedy_tokens(llama_cpp, model: str | os.PathLike[str], projector: str | os.PathLike[str], prompt: str,
                       images: Sequence[bytes], n: int, *, n_ctx: int = 2048, n_batch: int = 512,
                       add_special: bool = True, parse_special: bool = True) -> list[int]:
    """Up to `n` greedy tokens (ending at an end-of-generation token) after a multimodal `prompt` (one media
    marker per image of `images`, encoded PNG/JPEG bytes) as llama.cpp's own path computes them: libmtmd's
    helper decodes the image bytes, ``mtmd_tokenize`` cuts the prompt into chunks and
    ``mtmd_helper_eval_chunks`` evaluates them (text as tokens, images encoded and decoded as embeddings with
    their positions, ``n_batch`` rows at a time); then llama.cpp's greedy sampler and one-token batches at the
    positions after the prompt's."""
    from llama_cpp import mtmd_cpp

    from skippyd._native._skippy_llama import lib

    lib.skippy_mtmd_log_setup()  # libmtmd's log into skippy's callback: quiet unless SKIPPY_LLAMA_LOG=1
    llm = llama_cpp.Llama(str(model), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=2, verbose=False)
    params = mtmd_cpp.mtmd_context_params_default()
    params.use_gpu, params.print_timings, params.n_threads, params.warmup = False, False, 2, False
    mctx = mtmd_cpp.mtmd_init_from_file(os.fsencode(projector), llm.model, params)
    if not mctx:
        llm.close()
        raise RuntimeError(f"llama-cpp-python's mtmd could not load {projector}")
    bitmaps, chunks, sampler, batch = [], None, None, None
    try:
        for data in images:
            buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
            bitmap = mtmd_cpp.mtmd_helper_bitmap_init_from_buf(mctx, buf, len(data), False)
            if not bitmap:
                raise RuntimeError("llama-cpp-python's mtmd could not decode an image")
            bitmaps.append(bitmap)
        chunks = mtmd_cpp.mtmd_input_chunks_init()
        text = prompt.encode()
        inp = mtmd_cpp.mtmd_input_text(text, len(text), add_special, parse_special)
        array = (mtmd_cpp.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
        if mtmd_cpp.mtmd_tokenize(mctx, chunks, ctypes.byref(inp), array, len(bitmaps)) != 0:
            raise RuntimeError("mtmd_tokenize failed")
        n_past = llama_cpp.llama_pos(0)
        if mtmd_cpp.mtmd_helper_eval_chunks(mctx, llm.ctx, chunks, 0, 0, n_batch, True, ctypes.byref(n_past)) != 0:
            raise RuntimeError("mtmd_helper_eval_chunks failed")
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        sampler = llama_cpp.llama_sampler_init_greedy()
        batch = llama_cpp.llama_batch_init(1, 0, 1)
        pos, out = n_past.value, []
        while True:
            token = int(llama_cpp.llama_sampler_sample(sampler, llm.ctx, -1))
            out.append(token)
            if len(out) >= n or llama_cpp.llama_vocab_is_eog(vocab, token):
                return out
            batch.n_tokens = 1
            batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = token, pos, 1, 1
            batch.seq_id[0][0] = 0
            if llama_cpp.llama_decode(llm.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            pos += 1
    finally:
        if batch is not None:
            llama_cpp.llama_batch_free(batch)
        if sampler is not None:
            llama_cpp.llama_sampler_free(sampler)
        if chunks is not None:
            mtmd_cpp.mtmd_input_chunks_free(chunks)
        for b in bitmaps:
            mtmd_cpp.mtmd_bitmap_free(b)
        mtmd_cpp.mtmd_free(mctx)
        llm.close()
