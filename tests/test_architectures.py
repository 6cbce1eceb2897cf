"""Every architecture of the pinned llama.cpp has a verdict, and refusals say why."""

from __future__ import annotations

import importlib.util
import re
import tarfile
from pathlib import Path

import gguf
import pytest

from skippyd.runtime.architectures import ARCHITECTURES, Verdict, support
from skippyd.runtime.pypi import cache_root
from tests.arch_models import ARCH_MODELS
from tests.mm_models import MM_ARCHITECTURES

REPO = Path(__file__).resolve().parent.parent


# The installed gguf package (0.19.0) is older than the pinned llama.cpp, whose
# LLM_ARCH_NAMES also has these; "(unknown)" is llama.cpp's placeholder, never
# a gguf architecture.
PINNED_ONLY = {
    "(unknown)",
    "bailingmoe3",
    "cohere2moe",
    "deepseek32",
    "deepseek4",
    "dflash",
    "dots3note",
    "eagle3",
    "gemma4-assistant",
    "glm5-next",
    "granite_swa",
    "graniteswitch",
    "hrm_text",
    "hy_v3",
    "hy_v4",
    "kimi-k3",
    "laguna",
    "maple",
    "mellum",
    "minimax-01",
    "minimax-m3",
    "muse-glimmer",
    "nanbeige",
    "pockettts",
    "qwen3tts",
    "qwen4exp",
    "spark2_5",
    "talkie",
}


def _native_build():
    spec = importlib.util.spec_from_file_location("_skippy_native_build", REPO / "native" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pinned_arch_names(sdist: Path, vendor_prefix: str) -> list[str]:
    """The names in LLM_ARCH_NAMES of the pinned source's src/llama-arch.cpp."""
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if member.name == vendor_prefix + "src/llama-arch.cpp":
                text = tar.extractfile(member).read().decode()
                break
        else:
            raise AssertionError(f"{sdist.name} has no src/llama-arch.cpp")
    table = text[text.index("LLM_ARCH_NAMES = {") :]
    table = table[: table.index("};")]
    return re.findall(r'\{\s*LLM_ARCH_\w+\s*,\s*"([^"]+)"\s*\}', table)


def test_the_table_holds_exactly_the_pinned_architectures():
    installed = set(gguf.MODEL_ARCH_NAMES.values())
    assert not PINNED_ONLY & installed
    assert set(ARCHITECTURES) == installed | PINNED_ONLY


def test_the_table_matches_the_pinned_source():
    build = _native_build()
    sdist = cache_root() / "downloads" / build.SDIST_FILENAME
    if not sdist.exists():
        pytest.skip(f"{build.SDIST_FILENAME} is not in the download cache (the native build fetches it)")
    names = _pinned_arch_names(sdist, build.VENDOR_PREFIX)
    assert len(names) == len(set(names))
    assert set(names) == set(ARCHITECTURES)


def test_the_verified_set_is_the_one_with_fixture_tests():
    # tests/test_split_architectures.py splits a random-weight model of each (and gemma3 real weights too); the
    # image tests split the multimodal ones (tests/mm_models.py)
    assert {arch for arch, s in ARCHITECTURES.items() if s.verdict is Verdict.VERIFIED} == \
        set(ARCH_MODELS) | set(MM_ARCHITECTURES)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_verdict_says_why_only_when_it_refuses(arch):
    s = support(arch)
    assert s is ARCHITECTURES[arch]
    if s.splits:
        assert s.reason == ""
        assert s.describe() == s.verdict.value
    else:
        assert s.reason
        assert s.reason == s.reason.strip()
        assert "\n" not in s.reason
        assert s.describe() == f"refused: {s.reason}"


def test_recurrent_models_and_encoders_are_refused():
    assert "rolled back" in support("mamba").reason
    assert "rolled back" in support("qwen3next").reason
    assert "encoder" in support("bert").reason
    assert support("llama4").verdict is Verdict.SAME_MECHANISM


def test_an_unknown_architecture_is_refused():
    s = support("no-such-architecture")
    assert not s.splits
    assert s.reason
    assert not support("").splits


def test_the_docs_table_is_the_one_the_code_holds():
    from skippyd.runtime.architectures import markdown

    assert (REPO / "ARCHITECTURES.md").read_text() == markdown(), \
        "regenerate it: python -m skippyd.runtime.architectures > ARCHITECTURES.md"
