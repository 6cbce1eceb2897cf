"""Each verified architecture, split into stages, computes exactly what the whole model computes.

A tiny random model of each architecture (tests/arch_models.py) is split in 2
and in 3 stages at boundaries that cut its layer patterns (sliding-window
period, leading dense layers), so that a stage whose layers were numbered from
0 would compute something else. The prompt is longer than the 16-token
sliding window and prefilled as one batch everywhere, so the same kernels see
the same shapes: the split's logits are bit-identical to the whole model's.

The controls rebuild each stage as libllama read stage files before they
carried their absolute layers (each numbered as a whole model of its own) and
show that the fixtures are sensitive: that split's output differs (or, where
the loader expects other tensors there, does not load).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import gguf
import numpy as np
import pytest

from skippyd.runtime.architectures import Verdict, support
from skippyd.runtime.gguf_info import SKIPPY_LAYER_END, SKIPPY_LAYER_START, SKIPPY_N_LAYER_TOTAL, field_value
from skippyd.runtime.llama import ContextParams, ModelLoadError
from skippyd.runtime.slicing import split_model
from tests.arch_models import ARCH_MODELS, SLIDING_WINDOW, write_arch_model
from tests.llama_cpp_reference import greedy_tokens, install_llama_cpp
from tests.local_pipeline import LocalPipeline
from tests.tiny_model import MetadataField

PROMPT_LEN = 200  # longer than the sliding window; one batch (<= n_batch) on every stage and in llama-cpp-python
N_TOKENS = 32
PARAMS = ContextParams(n_ctx_per_seq=512, n_seq_max=1)


@attrs.frozen
class Case:
    splits: tuple[str, str]  # layer ranges for 2 and for 3 stages
    # what the old numbering does to the split: "differs" (the output changes), "refused" (the loader wants
    # other tensors for the renumbered layers), None (no per-layer pattern or input scaling to get wrong)
    control: str | None = None


CASES: dict[str, Case] = {
    "llama": Case(("0:2,2:4", "0:1,1:3,3:4")),
    "qwen2": Case(("0:2,2:4", "0:1,1:3,3:4")),
    "qwen3": Case(("0:2,2:4", "0:1,1:3,3:4")),
    "qwen3moe": Case(("0:2,2:4", "0:1,1:3,3:4")),
    "phi3": Case(("0:2,2:4", "0:1,1:3,3:4")),
    "mistral3": Case(("0:2,2:4", "0:1,1:3,3:4")),
    # SWA on even layers: every boundary odd, so a renumbered stage swaps SWA and full layers;
    # gemma2 also scales its input, which a stage after the first must not do
    "gemma2": Case(("0:3,3:6", "0:1,1:3,3:6"), "differs"),
    "gpt-oss": Case(("0:3,3:6", "0:1,1:3,3:6"), "differs"),
    # global layers 5 and 11 of 12; every stage after the first holds a global layer at another offset mod 6
    "gemma3": Case(("0:4,4:12", "0:3,3:8,8:12"), "differs"),
    # two dense layers, then MoE: a first stage shorter than the dense lead, stages that start inside it and
    # after it, stages with both dense and MoE layers
    "deepseek2": Case(("0:3,3:6", "0:1,1:4,4:6"), "refused"),
}
assert set(CASES) == set(ARCH_MODELS)


@attrs.frozen
class Run:
    logits: np.ndarray  # the prompt's last row
    tokens: list[int]  # greedy, after the prompt


def run(paths: list[Path], prompt: list[int]) -> Run:
    with LocalPipeline(paths, PARAMS) as pipe:
        pipe.prefill(prompt, chunk=PROMPT_LEN)
        logits = pipe.last.logits(0)
        return Run(logits, pipe.continue_decode(len(prompt), N_TOKENS, stop_at_eog=False))


@attrs.frozen
class Whole:
    arch: str
    path: Path
    result: Run


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return np.random.default_rng(7).integers(0, 512, PROMPT_LEN).tolist()


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def whole(request, tmp_path_factory: pytest.TempPathFactory, small_tokenizer_fields: list[MetadataField],
          prompt: list[int]) -> Whole:
    arch = request.param
    path = write_arch_model(arch, tmp_path_factory.mktemp(arch) / f"{arch}.gguf", small_tokenizer_fields)
    return Whole(arch, path, run([path], prompt))


@pytest.fixture(scope="module", params=[2, 3], ids=["2stages", "3stages"])
def split(request, whole: Whole, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    ranges = CASES[whole.arch].splits[request.param - 2]
    topology = split_model(whole.path, ranges, tmp_path_factory.mktemp(f"{whole.arch}-split"))
    return [s.file for s in topology.stages]


@pytest.fixture(scope="module")
def llama_cpp(tmp_path_factory: pytest.TempPathFactory):
    return install_llama_cpp(tmp_path_factory.mktemp("llama_cpp"))


def write_renumbered_stage(stage: Path, out: Path) -> Path:
    """`stage` as libllama read a stage file before it knew its absolute layers: numbered as a whole model of its
    own, per-layer arrays cut to its layers (as the slicer cut them then). Without skippy.n_layer_total the
    patched loader reads the file that way; skippy.layer_start and layer_end stay, for the runtime to chain the
    stages (the first takes tokens, the others hidden states). Tensors are copied byte for byte."""
    reader = gguf.GGUFReader(stage)
    arch = field_value(reader, gguf.Keys.General.ARCHITECTURE)
    start, end, total = (field_value(reader, k) for k in (SKIPPY_LAYER_START, SKIPPY_LAYER_END, SKIPPY_N_LAYER_TOTAL))
    writer = gguf.GGUFWriter(out, arch=arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (gguf.Keys.General.ARCHITECTURE, SKIPPY_N_LAYER_TOTAL):
            continue  # GGUF.*: the reader's header fields; the writer adds the architecture itself
        vtype, value = field.types[0], field.contents()
        sub_type = gguf.GGUFValueType(int(field.parts[3][0])) if vtype == gguf.GGUFValueType.ARRAY else None
        if sub_type is not None and field.name.startswith(f"{arch}.") and len(value) == total:
            value = value[start:end]
        writer.add_key_value(field.name, value, vtype, sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("arch", list(CASES))
def test_architecture_is_verified(arch: str):
    # the slicer's table says what these tests show
    assert support(arch).verdict is Verdict.VERIFIED


def test_whole_model_generates_as_llama_cpp(whole: Whole, prompt: list[int], llama_cpp):
    assert PROMPT_LEN > SLIDING_WINDOW
    assert np.isfinite(whole.result.logits).all()
    # not degenerate: greedy decoding does not settle on one token
    assert len(set(whole.result.tokens)) >= 4, whole.result.tokens
    assert greedy_tokens(llama_cpp, whole.path, prompt, N_TOKENS) == whole.result.tokens


def test_split_computes_the_whole_model(whole: Whole, split: list[Path], prompt: list[int]):
    result = run(split, prompt)
    np.testing.assert_array_equal(result.logits, whole.result.logits)
    assert result.tokens == whole.result.tokens


@pytest.mark.parametrize("whole", [arch for arch, case in CASES.items() if case.control], indirect=True)
def test_stages_numbered_from_zero_compute_something_else(whole: Whole, split: list[Path], prompt: list[int],
                                                          tmp_path: Path):
    control = CASES[whole.arch].control
    renumbered = [write_renumbered_stage(p, tmp_path / p.name) for p in split]
    if control == "refused":
        # numbered from 0, a stage after the first wants dense FFN tensors for its own layers 0 and 1, which
        # hold MoE ones (the real split, which differs only in skippy.n_layer_total, loads: the test above)
        with pytest.raises(ModelLoadError):
            run(renumbered, prompt)
        return
    result = run(renumbered, prompt)
    diff = float(np.max(np.abs(result.logits - whole.result.logits)))
    print(f"{whole.arch} {len(split)} stages numbered from 0: max logit difference {diff:.3g}")
    assert diff > 1e-2
