"""A stage on a GPU: the Vulkan build of the pinned llama.cpp, on Mesa's lavapipe (a Vulkan device that is
the CPU), beside a stage of the ordinary CPU build.

scripts/test makes the Vulkan build (``native/build.py --gpu vulkan --into build/native-vulkan``, cached)
where the Vulkan headers and glslc are there or can be installed; a daemon runs it when SKIPPY_NATIVE_DIR
names it. lavapipe is a CPU device, which llama.cpp's Vulkan backend passes over unless
GGML_VK_VISIBLE_DEVICES names it: the GPU stage's daemon is given ``GGML_VK_VISIBLE_DEVICES=0``.

Tokens: the Vulkan kernels (activations multiplied as f16, other reduction orders) round differently from
the CPU's, so a mixed pipeline's greedy tokens equal the all-CPU pipeline's up to a near-tie: at the first
token that differs, the all-CPU run's two best candidates are within NEAR_TIE of each other. Where the two
runs agree, the chosen token's log-probability differs by up to 0.15 between them (the default model on
lavapipe; printed); two candidates moving apart by that much each swap at a margin of up to 0.3, and NEAR_TIE
leaves room above that for other CPUs' rounding.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.procs import REPO, Daemon, Pipeline, split_for_test

pytestmark = pytest.mark.slow  # real daemon processes on a Vulkan build

VULKAN_DIR = Path(os.environ.get("SKIPPY_VULKAN_NATIVE_DIR", REPO / "build" / "native-vulkan"))
LAVAPIPE = {"GGML_VK_VISIBLE_DEVICES": "0"}
NEAR_TIE = 0.5
PROMPTS = ["The capital of France is",
           "Here is a short story about a lighthouse keeper who",
           "def fibonacci(n):\n    \"\"\""]
N_TOKENS = 24
# lavapipe compiles each compute shader (SPIR-V to LLVM) on its first use, some for tens of seconds on two
# cores: the head waits that long for a stage's first replies
WARMING = {"runtime.reply_timeout": 600.0}


def _vulkan_build() -> Path:
    if not any(VULKAN_DIR.glob("_skippy_llama*.so")):
        pytest.skip(f"no Vulkan build in {VULKAN_DIR} (scripts/test makes one where the Vulkan headers, "
                    "spirv-headers and glslc are installed or installable: native/build.py --gpu vulkan)")
    return VULKAN_DIR


def _on_vulkan(extra: dict | None = None) -> dict:
    return {"SKIPPY_NATIVE_DIR": str(_vulkan_build()), **LAVAPIPE, **(extra or {})}


class MixedPipeline(Pipeline):
    """A pipeline whose stages each run with an environment of their own (the build they load)."""

    def __init__(self, topology_path: Path, workdir: Path, envs: dict[int, dict], gpu_layers: dict[int, str]):
        super().__init__(topology_path, workdir)
        self.envs, self.gpu_layers = envs, gpu_layers

    def start_stage(self, k: int, *, wait: bool = True) -> Daemon:
        extra = ["--gpu-layers", self.gpu_layers[k]] if k in self.gpu_layers else []
        d = Daemon(["--topology", str(self.topology_path), "--stage", str(k), *extra], self.workdir,
                   f"stage{k}", env=self.envs.get(k), config=WARMING)
        self.stages[k] = d
        if wait:
            d.wait_ready()
        return d


def _split(model: Path, tmp_path_factory, name: str) -> Path:
    """The model's 2-stage split, on ports of its own."""
    work = tmp_path_factory.mktemp(name)
    split_for_test(model, 2, work)
    return work / "topology.toml"


def _pipelines(model: Path, tmp_path_factory, name: str, gpu_layers: str = "all"):
    """The model split in two, run all on the CPU, and with stage 1 on the Vulkan device (stage 0 on the
    ordinary build)."""
    cpu = Pipeline(_split(model, tmp_path_factory, f"{name}-cpu"), tmp_path_factory.mktemp(f"{name}-cpu")).start()
    try:
        mixed = MixedPipeline(_split(model, tmp_path_factory, f"{name}-vk"), tmp_path_factory.mktemp(f"{name}-vk"),
                              envs={1: _on_vulkan()}, gpu_layers={1: gpu_layers}).start()
    except BaseException:
        cpu.stop_cleanly()
        raise
    return cpu, mixed


async def assert_same_but_near_ties(cpu: Pipeline, mixed: Pipeline, prompt: str) -> float | None:
    """The mixed pipeline's greedy tokens are the all-CPU pipeline's up to the first near-tie; returns the
    margin at the first difference (None: no difference)."""
    kw = dict(prompt=prompt, raw=True, max_tokens=N_TOKENS, logprobs=2)
    want = await cpu.generate(**kw)
    got = await mixed.generate(**kw)
    wobble = 0.0  # the largest difference of the chosen token's log-probability where the two agree
    for i, (a, b) in enumerate(zip(got["tokens"], want["tokens"])):
        if a == b:
            wobble = max(wobble, abs(got["logprobs"][i]["logprob"] - want["logprobs"][i]["logprob"]))
        else:
            top = want["logprobs"][i]["top"]
            margin = top[0][1] - top[1][1] if len(top) > 1 else math.inf
            print(f"{prompt!r}: first difference at token {i}, the CPU run's two best {margin:.4f} apart "
                  f"(log-probabilities differed by {wobble:.4f} at most before)")
            assert margin <= NEAR_TIE, (prompt, i, a, b, margin)
            return margin
    assert got["tokens"] == want["tokens"], prompt
    print(f"{prompt!r}: {len(want['tokens'])} tokens equal")
    return None


@pytest.fixture(scope="module")
def smol(default_model_path, tmp_path_factory):
    _vulkan_build()
    cpu, mixed = _pipelines(default_model_path, tmp_path_factory, "smol")
    yield cpu, mixed
    mixed.stop_cleanly()
    cpu.stop_cleanly()


async def test_a_stage_on_the_vulkan_device_gives_the_cpu_pipelines_tokens(smol):
    cpu, mixed = smol
    for prompt in PROMPTS:
        await assert_same_but_near_ties(cpu, mixed, prompt)
    await mixed.wait_all_released()


async def test_status_shows_each_stages_backend_device_and_memory(smol):
    cpu, mixed = smol
    (gpu_stage,) = (await mixed.stages[1].astatus())["stages"]
    device = gpu_stage["device"]
    assert device["backend"] == "vulkan" and device["device"] == "Vulkan0", device
    assert "llvmpipe" in device["device_name"]
    assert device["gpu_layers"] == device["layers"] == gpu_stage["layers"][1] - gpu_stage["layers"][0]
    assert device["output_on_gpu"] and device["memory_total"] > 0
    head = (await mixed.head.astatus())["head"]["device"]
    assert head["backend"] == "cpu" and head["gpu_layers"] == 0 and head["device"] == "CPU", head
    shown = await trio.to_thread.run_sync(functools.partial(
        subprocess.run, [sys.executable, "-m", "skippyctl.app", "--url", mixed.stages[1].url, "--token-file",
                         str(mixed.stages[1].token_file), "status"], capture_output=True, text=True, cwd=REPO,
        env={**os.environ, "COLUMNS": "200"}))
    assert shown.returncode == 0, shown.stderr
    assert "Vulkan0 llvmpipe" in shown.stdout and f"{device['layers']}/{device['layers']} layers" in shown.stdout, \
        shown.stdout


def test_model_inspect_names_the_devices_of_the_build_it_runs_on(default_model_path):
    def inspect(env: dict | None = None) -> dict:
        out = subprocess.run([sys.executable, "-m", "skippyctl.app", "model", "inspect", "--json",
                              str(default_model_path)], capture_output=True, text=True, cwd=REPO,
                             env={**os.environ, **(env or {})}, check=True)
        return json.loads(out.stdout)["build"]

    assert inspect()["gpu_backend"] == "none"
    vulkan = inspect(_on_vulkan())
    assert vulkan["gpu_backend"] == "vulkan"
    assert [d["name"] for d in vulkan["devices"]] == ["Vulkan0", "CPU"], vulkan


@pytest.fixture(scope="module")
def gemma(gemma3_path, tmp_path_factory):
    _vulkan_build()
    cpu, mixed = _pipelines(gemma3_path, tmp_path_factory, "gemma", gpu_layers="4")
    yield cpu, mixed
    mixed.stop_cleanly()
    cpu.stop_cleanly()


async def test_gemma3_with_part_of_a_stage_on_the_vulkan_device(gemma):
    """Gemma 3 (sliding-window attention) with the last 4 of stage 1's 9 layers on the device, the rest of
    the stage and the output head on the CPU."""
    cpu, mixed = gemma
    for prompt in PROMPTS[:2]:
        await assert_same_but_near_ties(cpu, mixed, prompt)
    (stage,) = (await mixed.stages[1].astatus())["stages"]
    assert stage["device"]["gpu_layers"] == 4 and not stage["device"]["output_on_gpu"], stage["device"]


def _run_daemon(args: list[str], env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "skippyd.daemon", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, **(env or {})}, timeout=timeout)


def test_version_names_the_backend_and_its_devices():
    ordinary = _run_daemon(["--version"])
    assert ordinary.returncode == 0 and "backend: cpu; devices: CPU" in ordinary.stdout, ordinary
    vulkan = _run_daemon(["--version"], _on_vulkan())
    assert vulkan.returncode == 0 and "backend: vulkan + cpu" in vulkan.stdout, vulkan
    assert "Vulkan0 (llvmpipe" in vulkan.stdout
    hidden = _run_daemon(["--version"], {"SKIPPY_NATIVE_DIR": str(_vulkan_build())})
    assert "no Vulkan device found" in hidden.stdout and "GGML_VK_VISIBLE_DEVICES" in hidden.stdout, hidden


def test_gpu_layers_without_a_gpu_is_refused_with_what_to_change(default_model_path, tmp_path):
    args = ["--model", str(default_model_path), "--gpu-layers", "all", "--no-control", "--listen", "127.0.0.1:0"]
    cpu_only = _run_daemon(args)
    assert cpu_only.returncode == 1, cpu_only
    assert "no GPU backend" in cpu_only.stderr and "SKIPPY_GPU=vulkan" in cpu_only.stderr, cpu_only.stderr
    assert "Traceback" not in cpu_only.stderr
    no_device = _run_daemon(args, {"SKIPPY_NATIVE_DIR": str(_vulkan_build())})
    assert no_device.returncode == 1, no_device
    assert "finds no GPU" in no_device.stderr and "GGML_VK_VISIBLE_DEVICES" in no_device.stderr, no_device.stderr


def test_layers_that_would_not_fit_the_devices_memory_are_refused_before_llama_cpp_allocates(default_model_path):
    """16 lanes of 32768 tokens: about 11 GiB of KV cache against lavapipe's 2 GiB, refused with the need and
    what to lower, where llama.cpp would abort the process."""
    args = ["--model", str(default_model_path), "--gpu-layers", "all", "--ctx", "32768", "--lanes", "16",
            "--no-control", "--listen", "127.0.0.1:0"]
    refused = _run_daemon(args, _on_vulkan())
    assert refused.returncode == 1, refused
    assert "Vulkan0 (llvmpipe" in refused.stderr and "GiB of KV cache for 16 lanes of 32768 tokens" in refused.stderr
    assert "lower runtime.gpu_layers, runtime.ctx or runtime.lanes" in refused.stderr
    assert "Traceback" not in refused.stderr
