"""Build skippy's native layer: a patched libllama (+ ggml) and the cffi extension.

Steps, each cached under ``~/.cache/skippy/`` so that a second build costs seconds:

1. fetch the pinned source distribution ``llama-cpp-python==0.3.36`` from the
   package index and check its sha256 (its ``vendor/llama.cpp`` is llama.cpp
   commit 0c1e570);
2. extract ``vendor/llama.cpp`` and apply ``native/patches/*.patch`` (a patch
   that does not apply stops the build with patch's own output);
3. build shared libllama + ggml, and libmtmd (the multimodal projectors of
   ``tools/mtmd``, built standalone, without video), with CMake: CPU by default,
   with a GPU backend beside the CPU one by ``--gpu vulkan|cuda`` (or
   ``SKIPPY_GPU``); extra arguments from ``SKIPPY_LLAMA_CMAKE_ARGS``; the cache
   key covers the sdist hash, the patches and the CMake arguments;
4. compile the cffi extension (API mode, out of line) against the patched
   ``llama.h`` and ``mtmd.h``, linked with an ``$ORIGIN`` rpath so that it finds
   libllama and libmtmd beside itself.

Run directly (``python native/build.py [--into DIR]``) or through setup.py.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import filecmp
import functools
import hashlib
import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_FILENAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDOR_PREFIX = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"

# Bump when this script changes what it produces for the same inputs.
BUILD_SCHEMA = 2

EXTENSION_NAME = "_skippy_llama"
# the extension's declarations and C source: libllama's, then libmtmd's (whose helpers use the former's statics)
CDEF_FILES = ("llama_cdef.h", "mtmd_cdef.h")
SOURCE_FILES = ("llama_helpers.c", "mtmd_helpers.c")
BUILD_TARGETS = ("llama", "mtmd")

BASE_CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DCMAKE_UNITY_BUILD=ON",
    # plain `libllama.so` files whose SONAME is the file name: a wheel cannot carry symlinks
    "-DCMAKE_PLATFORM_NO_VERSIONED_SONAME=ON",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DGGML_OPENMP=OFF",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    # libmtmd alone (no tools): what the head encodes images with; no video, which would run ffmpeg on input
    "-DLLAMA_BUILD_MTMD=ON",
    "-DMTMD_VIDEO=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
]


class NativeBuildError(RuntimeError):
    pass


def _log(msg: str) -> None:
    print(f"skippy-native: {msg}", file=sys.stderr, flush=True)


def _load_pypi_module():
    # Import skippyd/runtime/pypi.py by path: the package cannot be imported as a
    # whole before its extension exists, and build isolation hides the source tree.
    spec = importlib.util.spec_from_file_location("_skippy_pypi", REPO / "skippyd" / "runtime" / "pypi.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cpu_cmake_args() -> list[str]:
    """Compiler flags for this CPU family, before the user's (whose -DCMAKE_C_FLAGS=... replaces them).

    x86: no AMX. On a CPU that reports AMX, -march=native compiles ggml's AMX
    kernels, which do not build in a unity build, and which died with SIGILL
    at their first tile instruction on the VMs this project is tested on
    (their CPUs report AMX; the kernel granted ggml the permission).
    """
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        return [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]
    return []


GPU_BACKENDS = ("none", "vulkan", "cuda")


def default_gpu() -> str:
    return os.environ.get("SKIPPY_GPU", "").strip().lower() or "none"


def gpu_cmake_args(gpu: str) -> list[str]:
    """The GPU backend's switch; the CPU backend is always built too (a stage offloads none, some or all layers)."""
    if gpu == "none":
        return []
    if gpu == "vulkan":
        if not os.environ.get("VULKAN_SDK") and (
                shutil.which("glslc") is None or not Path("/usr/include/vulkan/vulkan.hpp").exists()
                or not Path("/usr/include/spirv").exists()):
            raise NativeBuildError(
                "a Vulkan build needs the Vulkan headers, the SPIR-V headers and glslc (Debian/Ubuntu: "
                "apt-get install libvulkan-dev spirv-headers glslc; a device to run on: mesa-vulkan-drivers "
                "or the GPU vendor's driver), or VULKAN_SDK set to an SDK")
        return ["-DGGML_VULKAN=ON"]
    if gpu == "cuda":
        if shutil.which("nvcc") is None and not os.environ.get("CUDACXX"):
            raise NativeBuildError(
                "a CUDA build needs nvcc on PATH or CUDACXX=/path/to/nvcc "
                "(the CUDA toolkit, or pip install nvidia-cuda-nvcc and its nvidia/cu13/bin/nvcc)")
        # the card present, unless the caller names architectures in SKIPPY_LLAMA_CMAKE_ARGS
        return ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=native"]
    raise NativeBuildError(f"unknown GPU backend {gpu!r}: choose one of {', '.join(GPU_BACKENDS)}")


def cmake_args(gpu: str = "none") -> list[str]:
    return (BASE_CMAKE_ARGS + cpu_cmake_args() + gpu_cmake_args(gpu)
            + shlex.split(os.environ.get("SKIPPY_LLAMA_CMAKE_ARGS", "")))


def patch_files() -> list[Path]:
    return sorted((HERE / "patches").glob("*.patch"))


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:16]


def libllama_key(gpu: str = "none") -> str:
    parts = [SDIST_SHA256.encode(), str(BUILD_SCHEMA).encode(), platform.machine().encode()]
    parts += [p.name.encode() + b"\0" + p.read_bytes() for p in patch_files()]
    parts += [a.encode() for a in cmake_args(gpu)]
    return _digest(parts)


def extension_key(lib_key: str) -> str:
    import cffi

    parts = [
        lib_key.encode(),
        *((HERE / name).read_bytes() for name in CDEF_FILES + SOURCE_FILES),
        (sysconfig.get_config_var("EXT_SUFFIX") or "").encode(),
        cffi.__version__.encode(),
        str(BUILD_SCHEMA).encode(),
    ]
    return _digest(parts)


@contextlib.contextmanager
def _locked(path: Path):
    """Serialise builds that share a cache (a test run and a pip install at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _extract_vendor(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(VENDOR_PREFIX):
                m.name = m.name[len(VENDOR_PREFIX):]
                if m.name:
                    members.append(m)
        if not members:
            raise NativeBuildError(f"{sdist.name} has no {VENDOR_PREFIX}")
        tar.extractall(dest, members=members, filter="data")


def _apply_patches(src: Path) -> None:
    for patch in patch_files():
        cmd = ["patch", "-p1", "--forward", "--batch", "--silent", "-d", str(src), "-i", str(patch)]
        dry = subprocess.run(cmd + ["--dry-run"], capture_output=True, text=True)
        if dry.returncode != 0:
            raise NativeBuildError(
                f"patch {patch.name} does not apply to llama.cpp from {SDIST_FILENAME}:\n"
                f"{dry.stdout}{dry.stderr}"
            )
        subprocess.run(cmd, check=True)
        _log(f"applied {patch.name}")


def _run(cmd: list[str], log_path: Path) -> None:
    with open(log_path, "a") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        raise NativeBuildError(f"command failed ({proc.returncode}): {shlex.join(cmd)}\n" + "\n".join(tail))


def build_libllama(gpu: str = "none") -> Path:
    """Return the cache directory holding ``lib/`` and ``include/`` of the patched build."""
    pypi = _load_pypi_module()
    root = pypi.cache_root() / "native"
    key = libllama_key(gpu)
    out = root / f"libllama-{key}"
    if (out / "DONE").exists():
        return out
    with _locked(root / ".lock"):
        if (out / "DONE").exists():
            return out
        started = time.monotonic()
        sdist = pypi.fetch_pinned("llama-cpp-python", LLAMA_CPP_PYTHON_VERSION, SDIST_FILENAME, SDIST_SHA256)
        what = "" if gpu == "none" else f" with the {gpu} backend"
        _log(f"building patched llama.cpp{what} from {sdist.name} (first time only, a few minutes)")
        with tempfile.TemporaryDirectory(prefix="skippy-llama-", dir=root) as tmp:
            src, build = Path(tmp) / "src", Path(tmp) / "build"
            _extract_vendor(sdist, src)
            _apply_patches(src)
            log_path = root / f"build-{key}.log"
            log_path.unlink(missing_ok=True)
            cmake = shutil.which("cmake")
            if cmake is None:
                raise NativeBuildError("cmake not found on PATH (pip install cmake, or apt-get install cmake)")
            _run([cmake, "-S", str(src), "-B", str(build), *cmake_args(gpu)], log_path)
            _run([cmake, "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *BUILD_TARGETS], log_path)
            staging = Path(tmp) / "out"
            (staging / "lib").mkdir(parents=True)
            libs = [p for p in (build / "bin").glob("lib*.so") if p.is_file()]
            for target in BUILD_TARGETS:
                if not any(p.name == f"lib{target}.so" for p in libs):
                    raise NativeBuildError(f"lib{target}.so not produced; see {log_path}")
            for lib in libs:
                shutil.copy2(lib, staging / "lib" / lib.name)
            shutil.copytree(src / "include", staging / "include")
            shutil.copytree(src / "ggml" / "include", staging / "include", dirs_exist_ok=True)
            for header in ("mtmd.h", "mtmd-helper.h"):
                shutil.copy2(src / "tools" / "mtmd" / header, staging / "include" / header)
            (staging / "cmake-args.txt").write_text("\n".join(cmake_args(gpu)) + "\n")
            shutil.rmtree(out, ignore_errors=True)
            staging.rename(out)
        (out / "DONE").write_text(f"{time.monotonic() - started:.1f}s\n")
        _log(f"llama.cpp built in {time.monotonic() - started:.0f}s -> {out}")
    return out


def build_extension(lib_dir: Path) -> Path:
    """Compile the cffi extension against the patched headers; return the .so path."""
    import cffi

    key = extension_key(lib_dir.name)
    out = lib_dir.parent / f"ext-{key}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = out / f"{EXTENSION_NAME}{suffix}"
    if target.exists():
        return target
    with _locked(lib_dir.parent / ".lock"):
        if target.exists():
            return target
        ffi = cffi.FFI()
        ffi.cdef("\n".join((HERE / name).read_text() for name in CDEF_FILES))
        ffi.set_source(
            EXTENSION_NAME,
            "\n".join((HERE / name).read_text() for name in SOURCE_FILES),
            include_dirs=[str(lib_dir / "include")],
            library_dirs=[str(lib_dir / "lib")],
            libraries=["mtmd", "llama", "ggml", "ggml-cpu", "ggml-base"],
            extra_compile_args=["-O2"],
            extra_link_args=["-Wl,-rpath,$ORIGIN"],
        )
        with tempfile.TemporaryDirectory(dir=lib_dir.parent) as tmp:
            built = Path(ffi.compile(tmpdir=tmp, verbose=False))
            out.mkdir(parents=True, exist_ok=True)
            _replace(target, functools.partial(shutil.copy2, built))  # others check for it unlocked
        _log(f"cffi extension compiled -> {target}")
    return target


def install_into(dest: Path, gpu: str | None = None) -> list[Path]:
    """Build (or reuse) everything and copy the shared objects into ``dest``."""
    lib_dir = build_libllama(default_gpu() if gpu is None else gpu)
    ext = build_extension(lib_dir)
    dest.mkdir(parents=True, exist_ok=True)
    sources = [*sorted((lib_dir / "lib").glob("*.so")), ext]
    copied = []
    for src in sources:
        target = dest / src.name
        if not (target.exists() and filecmp.cmp(src, target, shallow=False)):
            _replace(target, functools.partial(shutil.copy2, src))
        copied.append(target)
    for old in dest.glob("*.so*"):
        if old.name not in {src.name for src in sources}:
            old.unlink()
    init, text = dest / "__init__.py", "# generated by native/build.py; not in version control\n"
    if not (init.exists() and init.read_text() == text):
        _replace(init, lambda tmp: tmp.write_text(text))
    return copied


def _replace(target: Path, write) -> None:
    """Make ``target`` anew (``write(path)``), renamed into place: a running process that has the old file
    loaded keeps its mapping (copying over it in place would change the code under that process), and a
    process starting meanwhile finds the old file or the new one, never none or half of one."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--into", type=Path, default=REPO / "skippyd" / "_native",
                        help="where to put libllama and the extension (default: skippyd/_native)")
    parser.add_argument("--gpu", choices=GPU_BACKENDS, default=default_gpu(),
                        help="a GPU backend beside the CPU one (default: $SKIPPY_GPU, else none)")
    args = parser.parse_args(argv)
    try:
        for path in install_into(args.into, args.gpu):
            _log(f"installed {path}")
    except NativeBuildError as exc:
        _log(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
