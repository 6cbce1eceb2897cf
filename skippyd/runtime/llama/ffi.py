"""The native layer's base: the cffi extension, the errors every wrapper raises, the backend, lifetime plumbing.

The wrappers (model.py, sampling.py, context.py) reach libllama only through
``ffi`` and ``lib`` from here: cffi in API mode, nothing else.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path

NATIVE_DIR_ENV = "SKIPPY_NATIVE_DIR"


def _load_extension():
    """The package's native build (skippyd/_native), or the one $SKIPPY_NATIVE_DIR names: a build with another
    backend beside it (``native/build.py --gpu vulkan --into DIR``), whose libllama the extension finds beside
    itself."""
    where = os.environ.get(NATIVE_DIR_ENV)
    if not where:
        try:
            from skippyd._native import _skippy_llama
        except ImportError as exc:  # pragma: no cover - depends on the build
            raise ImportError(
                "skippy's native layer is not built (skippyd/_native is missing or stale): "
                "run `python native/build.py` or reinstall the package"
            ) from exc
        return _skippy_llama.ffi, _skippy_llama.lib
    found = sorted(Path(where).glob("_skippy_llama*.so"))
    if not found:
        raise ImportError(f"{NATIVE_DIR_ENV}={where} holds no native build of skippy "
                          f"(make one with `python native/build.py --into {where}`)")
    spec = importlib.util.spec_from_file_location("_skippy_llama", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ffi, module.lib


ffi, lib = _load_extension()

# --------------------------------------------------------------------------- errors


class LlamaError(RuntimeError):
    """A libllama operation failed. ``op`` names the operation."""

    def __init__(self, op: str, message: str):
        self.op = op
        native = ffi.string(lib.skippy_last_error()).decode("utf-8", "replace")
        lib.skippy_clear_last_error()
        detail = f" (llama.cpp: {native})" if native and native not in message else ""
        super().__init__(f"{op}: {message}{detail}")


class ModelLoadError(LlamaError):
    pass


class ContextError(LlamaError):
    pass


class DecodeError(LlamaError):
    def __init__(self, op: str, message: str, code: int):
        self.code = code
        super().__init__(op, message)


class KvCacheFullError(DecodeError):
    """llama_decode returned 1: no free KV slot for the batch."""


class InvalidArgumentError(LlamaError, ValueError):
    pass


class ClosedError(LlamaError):
    pass


# --------------------------------------------------------------------------- backend

_backend_lock = threading.Lock()
_backend_ready = False


def backend_init() -> None:
    """Initialise llama.cpp once per process; logs go to stderr only if SKIPPY_LLAMA_LOG=1."""
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            lib.llama_backend_init()
            lib.skippy_log_setup(1 if os.environ.get("SKIPPY_LLAMA_LOG") == "1" else 0)
            _backend_ready = True


def system_info() -> dict[str, str]:
    """The native build's features, as llama.cpp reports them ("AVX2": "1", "OPENMP": "1", ...)."""
    backend_init()
    features = {}
    for part in ffi.string(lib.llama_print_system_info()).decode("utf-8", "replace").split("|"):
        key, sep, value = part.rpartition("=")
        if sep:
            features[key.split(":")[-1].strip()] = value.strip()
    return features


def read_string(fn, *args, initial: int = 256) -> str | None:
    """Call a llama.cpp `(…, char *buf, size)` getter, growing the buffer as told."""
    size = initial
    while True:
        buf = ffi.new("char[]", size)
        n = fn(*args, buf, size)
        if n < 0:
            return None
        if n < size:
            return ffi.string(buf, n).decode("utf-8", "replace")
        size = n + 1



class NativeObject:
    """Lifetime plumbing shared by the wrappers: context manager, close on GC, closed-use guard."""

    _ptr = ffi.NULL
    _kind = "object"

    def close(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _live(self, op: str):
        if self._ptr == ffi.NULL:
            raise ClosedError(op, f"{self._kind} is closed")
        return self._ptr


def check_decode(op: str, rc: int) -> None:
    if rc == 1:
        raise KvCacheFullError(op, "no free KV slot for the batch (context full)", rc)
    if rc != 0:
        raise DecodeError(op, f"llama_decode returned {rc}", rc)

