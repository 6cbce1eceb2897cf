"""The prefix cache on real pipelines: chat turns reuse the last turn, a stage that lost its cache makes a
cold (and correct) turn, concurrent sessions share one cached prefix, and a small budget evicts without a
failure.

Each test runs a 2-stage pipeline of the default model, every stage its own process, with the cache on.
Token streams are compared only between runs with the same batch boundaries: a cold run against a cold run,
a restore against the same restore (a restored prefix then a suffix prefill rounds differently from one whole
prefill, so a near-tie may flip between those two).
"""

from __future__ import annotations

import signal

import pytest
import trio

from skippyctl.client import open_control
from skippyd.control import messages as m
from tests.procs import Pipeline, split_for_test

pytestmark = pytest.mark.slow  # real daemon processes

BUDGET_MB = 512
SYSTEM = ("You are the assistant of a harbour office. You answer questions about ships, tides, lighthouses and "
          "the weather on the coast. You are precise, you give numbers where you have them, and you say when "
          "you do not know something. ") * 3
QUESTIONS = ["When is the next high tide?", "Which ships are due this week?", "Is the lighthouse lit tonight?",
             "How strong is the wind at the pier?", "Can a small boat leave the harbour now?"]


def pipeline(default_model_path, tmp_path, *flags: str) -> Pipeline:
    split_for_test(default_model_path, 2, tmp_path)
    return Pipeline(tmp_path / "topology.toml", tmp_path,
                    extra=["--lanes", "4", "--ctx", "2048", "--prefix-cache-mb", str(BUDGET_MB), *flags]).start()


@pytest.fixture
def pipe(default_model_path, tmp_path):
    p = pipeline(default_model_path, tmp_path)
    try:
        yield p
    finally:
        p.stop()


async def call(pipe: Pipeline, make) -> object:
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        return await client.call(make(client.new_id()))


async def ask(pipe: Pipeline, messages: list[dict], max_tokens: int = 24) -> dict:
    return await pipe.generate(messages=messages, max_tokens=max_tokens)


def turn(messages: list[dict], question: str) -> list[dict]:
    return [*messages, {"role": "user", "content": question}]


async def test_each_chat_turn_restores_the_last_turns_prompt_and_reply(pipe):
    messages = [{"role": "system", "content": SYSTEM}]
    previous = None
    for question in QUESTIONS[:4]:
        messages = turn(messages, question)
        result = await ask(pipe, messages)
        usage = result["usage"]
        if previous is None:
            assert usage["cached_tokens"] == 0, usage
        else:
            # the last turn's prompt and reply, as the stages computed them: the reply's text, tokenized again
            # inside this prompt, must come out as the same tokens for the reuse to hold
            held = previous["prompt_tokens"] + previous["completion_tokens"]
            assert usage["cached_tokens"] >= 0.9 * held, (usage, previous)
            assert usage["cached_tokens"] < usage["prompt_tokens"]
        previous = usage
        messages.append({"role": "assistant", "content": result["text"]})
    # the same request again restores the same prefix and computes the same suffix: the same tokens
    again = [await ask(pipe, turn(messages, QUESTIONS[4])) for _ in range(3)]
    assert again[1]["usage"]["cached_tokens"] == again[2]["usage"]["cached_tokens"] > 0
    assert again[1]["tokens"] == again[2]["tokens"]
    await pipe.wait_all_released()


async def test_a_restarted_stage_makes_a_cold_correct_turn_then_caches_again(pipe):
    conversation = turn([{"role": "system", "content": SYSTEM}], QUESTIONS[0])
    first = await ask(pipe, conversation)
    follow_up = turn([*conversation, {"role": "assistant", "content": first["text"]}], QUESTIONS[1])
    # the follow-up computed cold, for reference (no stage holds it: the caches are emptied before and after)
    await call(pipe, lambda i: m.CacheClear(id=i))
    cold = await ask(pipe, follow_up)
    assert cold["usage"]["cached_tokens"] == 0
    await call(pipe, lambda i: m.CacheClear(id=i))
    await ask(pipe, conversation)  # the conversation so far is in every stage's cache again

    pipe.stages[1].signal(signal.SIGKILL)
    pipe.stages[1].wait_exit()
    await pipe.astart_stage(1)
    after = await ask(pipe, follow_up)  # stage 1 holds nothing: it computes the prompt, fed what stage 0 recorded
    assert after["usage"]["cached_tokens"] == 0, after["usage"]
    assert after["tokens"] == cold["tokens"]
    warm = await ask(pipe, follow_up)
    assert warm["usage"]["cached_tokens"] > 0.9 * after["usage"]["prompt_tokens"]
    await pipe.wait_all_released()


async def test_concurrent_sessions_share_one_cached_system_prompt(pipe):
    system = [{"role": "system", "content": SYSTEM}]
    first = await ask(pipe, turn(system, QUESTIONS[0]))
    shared = first["usage"]["prompt_tokens"] - 20  # the system prompt's tokens, give or take the question's
    results: dict[int, dict] = {}

    async def one(k: int) -> None:
        results[k] = await ask(pipe, turn(system, QUESTIONS[k]))

    async with trio.open_nursery() as nursery:
        for k in range(1, 5):
            nursery.start_soon(one, k)
    for k, result in results.items():
        assert result["finish_reason"] in ("stop", "length") and result["tokens"], result
        assert result["usage"]["cached_tokens"] >= shared, (k, result["usage"])
    await pipe.wait_all_released()
    for row in await call(pipe, lambda i: m.CacheShow(id=i)):
        assert 0 < row["bytes"] <= BUDGET_MB << 20, row
        assert row["hits"] >= 4, row


SMALL_BUDGET_MB = 2  # ~1 entry of these prompts per stage (about 11 KiB a token on each half of the model)


@pytest.fixture
def small(default_model_path, tmp_path):
    p = pipeline(default_model_path, tmp_path, "--prefix-cache-mb", str(SMALL_BUDGET_MB))
    try:
        yield p
    finally:
        p.stop()


async def test_a_small_budget_evicts_old_entries_and_never_fails_a_request(small):
    for question in QUESTIONS:
        result = await ask(small, turn([{"role": "system", "content": SYSTEM}], question), max_tokens=8)
        assert result["finish_reason"] in ("stop", "length"), result
    rows = await call(small, lambda i: m.CacheShow(id=i))
    assert [r["stage"] for r in rows] == [0, 1]
    for row in rows:
        assert row["budget_bytes"] == SMALL_BUDGET_MB << 20
        assert row["bytes"] <= row["budget_bytes"], row
    assert sum(r["evictions"] for r in rows) > 0, rows
    await small.wait_all_released()
