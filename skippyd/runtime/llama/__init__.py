"""libllama through cffi: models, stage contexts, samplers.

This package and mtmd.py (libmtmd, in the same extension) are the only places in skippy that touch C
pointers. Everything
it hands out is plain Python or numpy (copied right away: llama.cpp reuses its
output buffers on the next decode). Every object has an idempotent ``close()``;
every C failure becomes a :class:`LlamaError` subclass naming the operation.
Arguments are validated here before they reach C++, because several bad
arguments (a partial-range KV copy, an out-of-range sequence id) abort the
whole process inside llama.cpp instead of returning an error.

Its modules: ``ffi`` (the extension, errors, backend), ``model`` (a loaded
GGUF), ``sampling`` (sampler chains, the guided sampler) and ``context`` (a
stage's llama context); the names below are the package's interface.
"""

from skippyd.runtime.llama.context import Context, ContextParams
from skippyd.runtime.llama.ffi import (
    ClosedError,
    ContextError,
    DecodeError,
    InvalidArgumentError,
    KvCacheFullError,
    LlamaError,
    ModelLoadError,
    backend_init,
    system_info,
)
from skippyd.runtime.llama.model import Model, StageInfo
from skippyd.runtime.llama.sampling import GuidedSampler, Sampler, TokenLogprobs, sampler_for

__all__ = [
    "ClosedError", "Context", "ContextError", "ContextParams", "DecodeError", "GuidedSampler", "InvalidArgumentError",
    "KvCacheFullError", "LlamaError", "Model", "ModelLoadError", "Sampler", "StageInfo", "TokenLogprobs",
    "backend_init", "sampler_for", "system_info",
]
