"""What a stage can compute on: the native build's backends (CPU, and Vulkan or CUDA where built) and their
devices, and how many of a stage's layers ``gpu_layers`` puts on the GPU."""

from __future__ import annotations

import attrs

from skippyd.runtime.llama.ffi import backend_init, ffi, lib

_KINDS = {
    lib.GGML_BACKEND_DEVICE_TYPE_CPU: "cpu",
    lib.GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
    lib.GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu",
    lib.GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel",
}
# a device llama.cpp may put layers on (an accelerator such as BLAS only speeds the CPU's work)
OFFLOAD_KINDS = ("gpu", "igpu")
# a Vulkan device that is the CPU (Mesa's lavapipe): llama.cpp's Vulkan backend passes it over unless
# GGML_VK_VISIBLE_DEVICES names it
VULKAN_CPU_HINT = "a Vulkan device that is the CPU (Mesa's lavapipe) is used only when GGML_VK_VISIBLE_DEVICES names it"


@attrs.frozen
class Device:
    name: str  # ggml's: "CPU", "Vulkan0", "CUDA0"
    description: str  # the hardware: "NVIDIA GeForce RTX 4070", "llvmpipe (LLVM 15.0.6, 256 bits)"
    kind: str  # cpu, gpu, igpu or accel
    backend: str  # "CPU", "Vulkan", "CUDA"
    memory_total: int  # bytes
    memory_free: int

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def _text(ptr) -> str:
    return ffi.string(ptr).decode("utf-8", "replace") if ptr != ffi.NULL else ""


def backends() -> list[str]:
    """The backends this build has ("CPU", "Vulkan", ...), whether or not a device of theirs is present."""
    backend_init()
    return [_text(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))) for i in range(lib.ggml_backend_reg_count())]


def gpu_backend() -> str:
    """The build's GPU backend, lower case (vulkan, cuda, ...), or "none" for a CPU-only build."""
    others = [name.lower() for name in backends() if name.upper() not in ("CPU", "BLAS", "RPC")]
    return others[0] if others else "none"


def devices() -> list[Device]:
    backend_init()
    found = []
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        lib.ggml_backend_dev_memory(dev, free, total)
        found.append(Device(
            name=_text(lib.ggml_backend_dev_name(dev)), description=_text(lib.ggml_backend_dev_description(dev)),
            kind=_KINDS.get(lib.ggml_backend_dev_type(dev), "other"),
            backend=_text(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev))),
            memory_total=int(total[0]), memory_free=int(free[0])))
    return found


def gpu_devices() -> list[Device]:
    return [d for d in devices() if d.kind in OFFLOAD_KINDS]


class GpuLayersError(ValueError):
    """gpu_layers asks for a GPU this build or this host does not have."""


class GpuMemoryError(ValueError):
    """A stage's layers on the GPU would not fit its memory (llama.cpp aborts the process on such a load)."""


def offload_layers(gpu_layers: int | str) -> int:
    """llama.cpp's n_gpu_layers for ``gpu_layers``: the last N of the stage's own layers on the GPU, or "all"
    (every one, and the output head where the stage has it; so is an N above its count, as with llama.cpp's
    ``-ngl``). Raises GpuLayersError, naming what to change, when layers are asked of a GPU that is not there."""
    if gpu_layers == 0:
        return 0
    backend = gpu_backend()
    if backend == "none":
        raise GpuLayersError(
            "gpu_layers asks for the GPU, but this build of skippy has no GPU backend (skippyd --version shows it): "
            "rebuild with SKIPPY_GPU=vulkan or SKIPPY_GPU=cuda (native/build.py --gpu), or set gpu_layers = 0")
    if not gpu_devices():
        hint = f"; {VULKAN_CPU_HINT}" if backend == "vulkan" else ""
        raise GpuLayersError(
            f"gpu_layers asks for the GPU, but the {backend} backend finds no GPU on this host (its driver, "
            f"or the device's permissions){hint}; or set gpu_layers = 0")
    return -1 if gpu_layers == "all" else int(gpu_layers)


def placement(n_gpu_layers: int, n_layer: int) -> dict:
    """Where a loaded stage computes, for status: its device (the first GPU when it offloads, else the CPU),
    that device's memory, and how many of its layers are on the GPU."""
    on_gpu = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    found = devices()
    gpus = [d for d in found if d.kind in OFFLOAD_KINDS]
    device = gpus[0] if on_gpu and gpus else next((d for d in found if d.kind == "cpu"), None)
    info = {"backend": "cpu" if device is None or device.kind == "cpu" else device.backend.lower(),
            "gpu_layers": min(on_gpu, n_layer), "layers": n_layer, "output_on_gpu": on_gpu > n_layer}
    if device is not None:
        info.update(device=device.name, device_name=device.description, memory_total=device.memory_total,
                    memory_free=device.memory_free)
    return info


def check_room(n_gpu_layers: int, n_layer: int, weights_bytes: int, kv_bytes_per_token_layer: int,
               n_ctx_per_seq: int, n_seq: int, n_swa: int = 0, n_ubatch: int = 512) -> None:
    """Refuse a stage whose layers on the GPU need more than its devices have free: their share of the
    weights and their KV cache (every lane's full context; a sliding-window model's window only, which errs
    towards trying). Raises GpuMemoryError naming the device, the need and what to lower."""
    if n_gpu_layers == 0:
        return
    gpus = gpu_devices()
    free = sum(d.memory_free for d in gpus)
    if not free:  # no GPU, or one that reports no memory: llama.cpp's own load decides
        return
    on_gpu = n_layer if n_gpu_layers < 0 else min(n_gpu_layers, n_layer)
    tokens = n_seq * (n_ctx_per_seq if n_swa <= 0 else min(n_ctx_per_seq, n_swa + n_ubatch))
    weights = weights_bytes * on_gpu // max(1, n_layer)
    kv = tokens * on_gpu * kv_bytes_per_token_layer
    if weights + kv <= free:
        return
    names = ", ".join(f"{d.name} ({d.description})" for d in gpus)
    raise GpuMemoryError(
        f"{names} has {free / 2**30:.2f} GiB free, and this stage's {on_gpu} layers on it need about "
        f"{(weights + kv) / 2**30:.2f} GiB ({weights / 2**30:.2f} GiB of weights, {kv / 2**30:.2f} GiB of KV "
        f"cache for {n_seq} lanes of {n_ctx_per_seq} tokens): lower runtime.gpu_layers, runtime.ctx or "
        f"runtime.lanes")


def describe_build() -> str:
    """One line for ``skippyd --version``: the backends and the devices they found."""
    found = devices()
    parts = []
    for d in found:
        memory = f", {d.memory_total / 2**30:.1f} GiB" if d.kind in OFFLOAD_KINDS and d.memory_total else ""
        parts.append(f"{d.name} ({d.description}{memory})" if d.description and d.kind != "cpu" else d.name)
    gpu = gpu_backend()
    line = f"backend: {'cpu' if gpu == 'none' else gpu + ' + cpu'}; devices: {', '.join(parts) or 'none'}"
    if gpu == "vulkan" and not any(d.backend == "Vulkan" for d in found):
        line += f" (no Vulkan device found; {VULKAN_CPU_HINT})"
    return line
