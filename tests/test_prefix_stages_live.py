"""Stages hit their prefix caches independently: when a later stage lost a prefix (evicted, or cleared here)
that the stages before it hold, only it computes the prompt, fed the hidden states the stage before it
recorded with its entry; the stages that hold it compute only what is new. The reply is the cold one's, up to
a near-tie (a prefix computed in other batches rounds a little differently).

A 3-stage pipeline of the default model, every stage its own process, with the cache on.
"""

from __future__ import annotations

import math

import pytest

from skippyctl.client import open_control
from skippyd.control import messages as m
from tests.procs import Pipeline, split_for_test

pytestmark = pytest.mark.slow  # real daemon processes

SYSTEM = ("You are the assistant of a harbour office. You answer questions about ships, tides, lighthouses and "
          "the weather on the coast. You are precise, you give numbers where you have them, and you say when "
          "you do not know something. ") * 3
NEAR_TIE = 0.25  # as tests/test_speculative.py


@pytest.fixture(scope="module")
def pipe(default_model_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("stages3")
    split_for_test(default_model_path, 3, work)
    p = Pipeline(work / "topology.toml", work, extra=["--lanes", "2", "--ctx", "2048", "--prefix-cache-mb",
                                                      "512"]).start()
    yield p
    p.stop_cleanly()


async def clear(daemon) -> None:
    """Empty the caches of the daemon's own stages (the head's daemon: every stage of the pipeline)."""
    async with open_control(daemon.url, daemon.token_file) as client:
        await client.call(m.CacheClear(id=client.new_id()))


async def computed(pipe: Pipeline) -> dict[int, int]:
    """Tokens each stage has computed since it started."""
    out = {}
    for k, d in pipe.stages.items():
        st = await d.astatus()
        snap = st["head"] if k == 0 else next(s for s in st["stages"] if s["stage_index"] == k)
        out[k] = snap["scheduler"]["tokens"]
    return out


def assert_same_or_near_tie(got: dict, want: dict) -> None:
    i = next((i for i, (a, b) in enumerate(zip(got["tokens"], want["tokens"])) if a != b), None)
    if i is None:
        assert len(got["tokens"]) == len(want["tokens"])
        return
    top = want["logprobs"][i]["top"]
    margin = top[0][1] - top[1][1] if len(top) > 1 else math.inf
    assert margin <= NEAR_TIE, f"the replies part at token {i}, where the best two are {margin:.4f} apart"


@pytest.mark.parametrize("lost", [1, 2])
async def test_only_the_stage_that_lost_the_prefix_computes_it(pipe, lost):
    question = f"Which ships are due this week at berth {lost}?"
    turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    first = await pipe.generate(messages=turn, max_tokens=24)
    follow = [*turn, {"role": "assistant", "content": first["text"]},
              {"role": "user", "content": "And which of them carry passengers?"}]
    await clear(pipe.head)
    cold = await pipe.generate(messages=follow, max_tokens=24, logprobs=2)
    assert cold["usage"]["cached_tokens"] == 0
    await clear(pipe.head)
    held = await pipe.generate(messages=turn, max_tokens=24)  # every stage holds the first turn again
    assert held["tokens"] == first["tokens"]
    await clear(pipe.stages[lost])  # that stage alone loses it
    before = await computed(pipe)
    after = await pipe.generate(messages=follow, max_tokens=24)
    spent = {k: n - before[k] for k, n in (await computed(pipe)).items()}
    usage = after["usage"]
    assert usage["cached_tokens"] == 0, usage  # not every stage held it: the prefill starts at 0
    new = usage["prompt_tokens"] - first["usage"]["prompt_tokens"] - len(first["tokens"])  # this turn's own
    for k, n in spent.items():
        if k == lost:
            assert n >= usage["prompt_tokens"], spent  # the whole prompt (and the reply's steps)
        else:
            assert n <= new + len(after["tokens"]) + 8, (k, spent, new)  # only what is new
    assert_same_or_near_tie(after, cold)
    await pipe.wait_all_released()
