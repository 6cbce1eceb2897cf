"""Real skippyd processes on loopback: greedy parity with the unsplit model, and cleanup."""

from __future__ import annotations

import pytest

from skippyd.runtime.llama import ContextParams
from skippyd.runtime.local_pipeline import LocalPipeline
from tests.procs import Pipeline, split_for_test

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]


@pytest.fixture(scope="module")
def smol2(default_model_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("smol2")
    split_for_test(default_model_path, 2, work)
    pipe = Pipeline(work / "topology.toml", work).start()
    yield pipe
    codes = pipe.stop()
    assert all(c == 0 for c in codes.values()), codes


def reference(model_path, prompt: str, n: int) -> list[int]:
    with LocalPipeline([model_path], ContextParams(n_ctx_per_seq=1024, n_seq_max=1)) as ref:
        tokens = ref.head.tokenize(prompt)
        return ref.generate(tokens, n)


async def test_two_process_greedy_matches_unsplit(smol2, default_model_path):
    for prompt in PROMPTS:
        got = await smol2.generate(prompt=prompt, raw=True, max_tokens=32)
        assert got["tokens"] == reference(default_model_path, prompt, 32)[: len(got["tokens"])]
        assert got["finish_reason"] in ("length", "stop")
    await smol2.wait_all_released()
