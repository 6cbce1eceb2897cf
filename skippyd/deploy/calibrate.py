"""How fast this host computes a model's layers: decode steps on a slice of a few of them, timed.

The planner divides the layers by these figures, so what matters is how hosts
compare on the same slice: every host times the same slice the same way, with
the threads a stage here would use, after a few steps that warm the caches.
A host whose build has a GPU backend times the slice twice: on the CPU, and
with all its layers on the GPU, so that the planner can weigh each device.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from skippyd.control.messages import RequestFailed
from skippyd.runtime.llama import Context, ContextParams, LlamaError, Model
from skippyd.runtime.llama.devices import GpuMemoryError, gpu_backend, gpu_devices

WARMUP_STEPS = 4
MIN_STEPS = 24
# long enough to span several periods of a cgroup CPU quota (100 ms by default): a throttled host computes
# at full speed in bursts, and only the time over a few periods shows how fast it really is
MIN_SECONDS = 0.5


class CalibrationError(RequestFailed):
    """A slice that cannot calibrate this host."""


def calibrate(path: Path, threads: int) -> dict:
    """Time one-token decode steps of the slice at `path` (a middle slice: hidden states in and out), on the
    CPU and, where the build has a GPU backend that finds a GPU here, with every layer on that GPU.

    Returns the CPU's ms per step and per layer (the mean over at least MIN_SECONDS) and what was timed, and
    `devices`: each device's timing (the CPU's first; a GPU's with its name, description and memory), or for
    a GPU that could not be timed, `error`."""
    with Model(path) as model:
        stage = model.stage
        if stage.is_first or stage.is_last:
            raise CalibrationError(f"{path.name} is not a middle slice (layers {stage.layer_start}-"
                                   f"{stage.layer_end}): calibration times hidden states through layers only")
        n_layers = stage.layer_end - stage.layer_start
        cpu = _timed(model, threads, n_layers)
    timings = [{"device": "cpu", "kind": "cpu", **cpu}]
    gpus = gpu_devices() if gpu_backend() != "none" else []
    if gpus:
        gpu = gpus[0]  # a stage offloads to the first GPU (skippyd/runtime/llama/devices.py placement)
        entry = {"device": gpu.name, "description": gpu.description, "kind": gpu.kind,
                 "backend": gpu.backend.lower(), "memory_total": gpu.memory_total, "memory_free": gpu.memory_free}
        try:
            with Model(path, n_gpu_layers=-1) as model:
                entry.update(_timed(model, threads, n_layers))
        except (LlamaError, GpuMemoryError) as exc:  # the CPU's timing still plans this host
            entry["error"] = str(exc)
        timings.append(entry)
    return {**cpu, "layers": n_layers, "threads": threads, "devices": timings}


def _timed(model: Model, threads: int, n_layers: int) -> dict:
    """ms per step and per layer of one-token decode steps through the loaded slice, after a warm-up."""
    n_ctx = 256
    params = ContextParams(n_ctx_per_seq=n_ctx, n_seq_max=1, n_batch=8, n_ubatch=8, n_threads=threads)
    model.check_gpu_room(params.n_ctx_per_seq, params.n_seq_max, params.n_ubatch)  # refused before llama.cpp allocates
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, model.n_embd_inp), dtype=np.float32)
    with Context(model, params) as context:
        for pos in range(WARMUP_STEPS):
            context.decode_row(pos, 0, embd=hidden)
        steps, started = 0, time.perf_counter()
        while steps < MIN_STEPS or time.perf_counter() - started < MIN_SECONDS:
            pos = WARMUP_STEPS + steps % (n_ctx - WARMUP_STEPS)
            if pos == WARMUP_STEPS and steps:
                context.kv_trim(0, WARMUP_STEPS)
            context.decode_row(pos, 0, embd=hidden)
            steps += 1
        elapsed = time.perf_counter() - started
    step = elapsed * 1e3 / steps
    return {"ms_per_layer": step / n_layers, "ms_per_step": step, "steps": steps}
