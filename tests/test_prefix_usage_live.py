"""What a reply says of the prefix caches, on a real 2-stage pipeline of the default model (each stage its own
process, the OpenAI API on the head): ``cached_tokens`` counts the prompt tokens no stage computed (every stage
held them), and ``prefix_cache`` says, per stage, the prompt tokens that stage held rather than computed, as
the control result (``skippyctl generate --json``) and the OpenAI usage report them. The stages are made to
hold different prefixes: one stage's cache emptied, the head restarted (its cache empty, stage 1's not).

A prompt the head does not hold carries its prefix cache lookup on its first prefill chunk: no trip of its
own through the stages (a RestorePrefix) before the prefill; stage 1 counts both kinds.
"""

from __future__ import annotations

import json
import signal

import pytest
import trio
from typer.testing import CliRunner

from skippyctl.app import app
from skippyctl.client import open_control
from skippyd.control import messages as m
from tests.openai_api import Api, run, wait_healthy
from tests.procs import Pipeline, free_ports, split_for_test

pytestmark = pytest.mark.slow  # real daemon processes

SYSTEM = ("You are the assistant of a harbour office. You answer questions about ships, tides, lighthouses and "
          "the weather on the coast. You are precise, you give numbers where you have them, and you say when "
          "you do not know something. ") * 2
TURN = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When is the next high tide?"}]


@pytest.fixture(scope="module")
def served(default_model_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("prefix_usage")
    split_for_test(default_model_path, 2, work)
    port = free_ports(1)[0]
    pipe = Pipeline(work / "topology.toml", work, extra=["--openai", f"127.0.0.1:{port}", "--ctx", "2048",
                                                          "--lanes", "2", "--prefix-cache-mb", "256"]).start()
    api = Api(pipe, port)
    wait_healthy(api)
    yield api
    pipe.stop_cleanly()


async def clear(daemon) -> None:
    """Empty the caches of the daemon's own stages (the head's daemon: every stage of the pipeline)."""
    async with open_control(daemon.url, daemon.token_file) as client:
        await client.call(m.CacheClear(id=client.new_id()))


def per_stage(usage: dict) -> dict[int, int]:
    return {s["stage"]: s["cached_tokens"] for s in usage["prefix_cache"]}


async def restores(pipe: Pipeline) -> dict:
    """Stage 1's restore lookups so far: those that took a trip of their own, those on a first prefill chunk."""
    st = await pipe.stages[1].astatus()
    return next(s for s in st["stages"] if s["stage_index"] == 1)["restores"]


async def restart_head(api: Api) -> None:
    """The head's daemon stopped and started again: its prefix cache is empty, stage 1's is not."""
    pipe = api.pipe
    pipe.head.signal(signal.SIGTERM)
    await trio.to_thread.run_sync(pipe.head.wait_exit)
    await pipe.astart_stage(0)
    await trio.to_thread.run_sync(wait_healthy, api)


async def test_cached_tokens_is_what_no_stage_computed_and_each_stage_says_what_it_held(served):
    pipe = served.pipe
    await clear(pipe.head)
    cold = await pipe.generate(messages=TURN, max_tokens=16)
    n_prompt = cold["usage"]["prompt_tokens"]
    assert cold["usage"]["cached_tokens"] == 0 and per_stage(cold["usage"]) == {0: 0, 1: 0}, cold["usage"]

    # every stage holds the prompt (and the reply): all but its last token (whose logits give the first token)
    # is computed nowhere
    warm = await pipe.generate(messages=TURN, max_tokens=16)
    assert warm["usage"]["cached_tokens"] == n_prompt - 1, warm["usage"]
    assert per_stage(warm["usage"]) == {0: n_prompt - 1, 1: n_prompt - 1}
    assert warm["tokens"] == cold["tokens"]

    # stage 1 alone loses it: it computes the whole prompt, the head only the last token; the OpenAI usage
    await clear(pipe.stages[1])
    model = (await run(served.client.models.list)).data[0].id
    reply = await run(served.client.chat.completions.create, model=model, messages=TURN, max_tokens=16,
                      temperature=0)
    usage = reply.usage.model_dump()
    assert usage["prompt_tokens"] == n_prompt
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
    assert per_stage(usage) == {0: n_prompt - 1, 1: 0}, usage
    assert reply.choices[0].message.content == cold["text"]

    # the head restarted holds nothing, stage 1 holds the prompt again (it recorded it above):
    # skippyctl generate --json reports it
    await restart_head(served)
    before = await restores(pipe)
    result = await trio.to_thread.run_sync(lambda: CliRunner().invoke(app, [
        "--url", pipe.head.url, "--token-file", str(pipe.head.token_file), "generate", "--json", "-n", "16",
        "--system", SYSTEM, "--prompt", TURN[1]["content"], "--temperature", "0"]))
    assert result.exit_code == 0, (result.stdout, result.stderr)
    got = json.loads(result.stdout)
    assert got["usage"]["cached_tokens"] == 0 and per_stage(got["usage"]) == {0: 0, 1: n_prompt - 1}, got["usage"]
    assert got["tokens"] == cold["tokens"]
    after = await restores(pipe)
    # the head held nothing: the lookup rode on the first prefill chunk, no trip of its own
    assert after["queries"] == before["queries"] and after["with_prefill"] == before["with_prefill"] + 1
    await pipe.wait_all_released()


async def test_a_warm_head_still_asks_the_stages_before_its_prefill(served):
    """Where the head holds a prefix the prefill starts at what every stage holds: it asks them first."""
    pipe = served.pipe
    await clear(pipe.head)
    await pipe.generate(messages=TURN, max_tokens=8)
    before = await restores(pipe)
    got = await pipe.generate(messages=TURN, max_tokens=8)
    after = await restores(pipe)
    assert got["usage"]["cached_tokens"] > 0
    assert after["queries"] == before["queries"] + 1 and after["with_prefill"] == before["with_prefill"]
    await pipe.wait_all_released()
