"""The llama-cpp-python reference: built from the same pinned llama.cpp source as skippy.

    .venv/bin/python bench/reference.py          # build (once) and install into this interpreter

The benchmark compares skippyd with plain llama.cpp through its usual Python
binding. For the comparison to be about the runtime and not the compiler
flags, the reference is built from the very sdist skippy builds from
(``llama-cpp-python==0.3.36``, checked by sha256; unpatched: our patch only
touches sliced stage models) with the same code-generation CMake options
(``GGML_OPENMP=OFF``, ``SKIPPY_LLAMA_CMAKE_ARGS``). The wheel is cached under
``~/.cache/skippy/reference/<key>/`` so a second install takes seconds.

``pip install '.[bench]'`` is the other route: it builds the same version
from the index with llama-cpp-python's own defaults (OpenMP on).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippyd.runtime.pypi import cache_root, fetch_pinned  # noqa: E402

# native/build.py holds the pin (version, file name, sha256); loaded by path, it is not a package
_spec = importlib.util.spec_from_file_location("skippy_native_build", ROOT / "native" / "build.py")
native_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native_build)

# the options that change the generated code; the rest of skippy's list is about what gets built
REFERENCE_CMAKE_ARGS = ["-DGGML_OPENMP=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF"]


def cmake_args() -> list[str]:
    user = shlex.split(os.environ.get("SKIPPY_LLAMA_CMAKE_ARGS", ""))
    return REFERENCE_CMAKE_ARGS + native_build.cpu_cmake_args() + user


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_reference(*, quiet: bool = False) -> str:
    """Install the reference into this interpreter if it is not there; returns its version."""
    version = native_build.LLAMA_CPP_PYTHON_VERSION
    if installed_version() == version:
        return version
    sdist = fetch_pinned("llama-cpp-python", version, native_build.SDIST_FILENAME, native_build.SDIST_SHA256)
    key = hashlib.sha256("\n".join([native_build.SDIST_SHA256, sys.version, *cmake_args()]).encode()).hexdigest()[:16]
    wheel_dir = cache_root() / "reference" / key
    wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl")) if wheel_dir.is_dir() else []
    if not wheels:
        print(f"building the llama-cpp-python {version} reference from {sdist.name} "
              f"(a few minutes, once; cached in {wheel_dir})", file=sys.stderr, flush=True)
        wheel_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, CMAKE_ARGS=shlex.join(cmake_args()))  # split with shlex by scikit-build-core
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheel_dir),
                        str(sdist)], env=env, check=True,
                       stdout=subprocess.DEVNULL if quiet else None)
        wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    # its runtime dependencies are small pure-Python packages from the index
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", str(wheels[-1])], check=True)
    return version


if __name__ == "__main__":
    print(f"llama-cpp-python {ensure_reference()} installed in {sys.prefix}")
