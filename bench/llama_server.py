"""llama.cpp's own ``llama-server``, built from the same pinned llama.cpp source as skippy.

    .venv/bin/python bench/llama_server.py       # build (once) and print the binary's path

The prefix-cache benchmark compares skippyd's OpenAI endpoint with llama-server's
prompt cache on the same conversation. As with bench/reference.py, the server is
built from the very sdist skippy builds from (``llama-cpp-python==0.3.36``'s
``vendor/llama.cpp``, checked by sha256; unpatched) with the same code-generation
CMake options (``GGML_OPENMP=OFF``, the CPU flags, ``SKIPPY_LLAMA_CMAKE_ARGS``).
Only the ``llama-server`` target is built, statically linked, without the web UI
(nothing is downloaded at build time). The binary is cached under
``~/.cache/skippy/reference/llama-server-<key>/``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reference import native_build  # noqa: E402  (native/build.py: the pin, the source, the CPU flags)
from skippyd.runtime.pypi import cache_root, fetch_pinned  # noqa: E402

# the reference's code-generation options plus what the server needs; the web UI would be fetched
# from the network or built with npm, so it is left out (the API does not need it)
SERVER_CMAKE_ARGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_OPENMP=OFF",
                     "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
                     "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
                     "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
                     "-DLLAMA_CURL=OFF"]


def cmake_args() -> list[str]:
    user = shlex.split(os.environ.get("SKIPPY_LLAMA_CMAKE_ARGS", ""))
    return SERVER_CMAKE_ARGS + native_build.cpu_cmake_args() + user


def cache_dir() -> Path:
    key = hashlib.sha256("\n".join([native_build.SDIST_SHA256, "llama-server", platform.machine(),
                                    *cmake_args()]).encode()).hexdigest()[:16]
    return cache_root() / "reference" / f"llama-server-{key}"


def ensure_llama_server(*, jobs: int = 2, quiet: bool = False) -> Path:
    """Build llama-server if it is not cached; return the binary's path."""
    out = cache_dir()
    binary = out / "llama-server"
    if binary.is_file() and (out / "DONE").exists():
        return binary
    with native_build._locked(out.parent / ".llama-server.lock"):
        if binary.is_file() and (out / "DONE").exists():
            return binary
        started = time.monotonic()
        sdist = fetch_pinned("llama-cpp-python", native_build.LLAMA_CPP_PYTHON_VERSION,
                             native_build.SDIST_FILENAME, native_build.SDIST_SHA256)
        out.mkdir(parents=True, exist_ok=True)
        log_path = out / "build.log"
        log_path.unlink(missing_ok=True)
        print(f"building llama-server from {sdist.name} (once, long on few cores; log: {log_path})",
              file=sys.stderr, flush=True)
        cmake = shutil.which("cmake")
        if cmake is None:
            raise native_build.NativeBuildError("cmake not found on PATH")
        with tempfile.TemporaryDirectory(prefix="skippy-llama-server-", dir=out.parent) as tmp:
            src, build = Path(tmp) / "src", Path(tmp) / "build"
            native_build._extract_vendor(sdist, src)
            if not (src / "tools" / "server" / "CMakeLists.txt").is_file():
                raise native_build.NativeBuildError(f"{sdist.name} has no tools/server in its llama.cpp")
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            native_build._run([cmake, "-S", str(src), "-B", str(build), *generator, *cmake_args()], log_path)
            native_build._run([cmake, "--build", str(build), "-j", str(jobs), "--target", "llama-server"],
                              log_path)
            built = build / "bin" / "llama-server"
            if not built.is_file():
                raise native_build.NativeBuildError(f"llama-server not produced; see {log_path}")
            shutil.copy2(built, binary)
        (out / "cmake-args.txt").write_text("\n".join(cmake_args()) + "\n")
        (out / "DONE").write_text(f"{time.monotonic() - started:.1f}s\n")
        if not quiet:
            print(f"llama-server built in {time.monotonic() - started:.0f}s -> {binary}", file=sys.stderr, flush=True)
    return binary


if __name__ == "__main__":
    print(ensure_llama_server())
