"""Speculative decoding over verify windows, end to end on real skippyd processes (1, 2 and 3 stages).

The head drafts tokens from the session's own context and sends [token, drafts...] as one verify window;
every stage computes it as one batch and the final stage accepts drafts while they equal its own choice.
The output must be the token-by-token loop's: the same daemon answers the same request with speculation
off (per request) for the reference. On this CPU build a window's rows compute a decode step's bits
(native/patches/0006), so the replies are equal; a build whose kernels round a batch otherwise may part at a
near-tie, and the comparisons allow that much: there the reference's two best candidates must be within
NEAR_TIE of each other (the reference asks for its logprobs); any other difference fails.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import openai
import pytest
import trio

from skippyctl.client import open_control
from skippyd.control import messages as m
from tests.openai_api import run, serving
from tests.procs import Pipeline, SingleStage, retarget
from tests.test_resume import kill_and_restart, stream, wait_for

pytestmark = pytest.mark.slow  # real daemon processes

CODE = ("def area(width, height):\n    return width * height\n\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n\n\n"
        "def describe(width, height):\n    return f\"{width} by {height}: area {area(width, height)}\"\n")
# copy-heavy: the reply repeats the prompt, so drafts from the prompt are mostly right
COPY = dict(prompt=f"Here is a Python module:\n\n{CODE}\nThe same module, copied exactly:\n\n", raw=True,
            max_tokens=64)
SEEDED = dict(COPY, temperature=0.8, seed=7)
FLAGS = ["--lanes", "2", "--ctx", "1024", "--speculate", "on"]
CONFIG = {"runtime.compute_lock": "off", "runtime.prefix_cache_mb": 0}
# Where a window's rows and single steps round differently (one batch against several: llama.cpp's CPU
# kernels before native/patches/0006 landed the same positions up to 0.23 apart in log-probability on the
# best candidates), a greedy choice whose two best candidates are closer than that may go either way. A
# wrong acceptance would part the outputs where the choice is clear: most positions lead by more.
NEAR_TIE = 0.25
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"  # the served model (the GGUF file name)


SETUPS = {"1-stage": (1, 0), "2-stage": (2, 0), "3-stage": (3, 0), "2-stage-prefix-cache": (2, 64)}
# the rules for ending and cancelling in the middle of a window, where the answer comes on the lane (one
# stage: the head's own) and on the token-return connection (three stages)
ENDINGS = pytest.mark.parametrize("pipe", ["1-stage", "3-stage"], indirect=True)


@pytest.fixture(scope="module", params=list(SETUPS))
def pipe(request, splits, default_model_path, tmp_path_factory):
    stages, cache_mb = SETUPS[request.param]
    work = tmp_path_factory.mktemp(f"spec{stages}")
    config = {**CONFIG, "runtime.prefix_cache_mb": cache_mb}
    if stages == 1:
        p = SingleStage(default_model_path, work, FLAGS, config=config)
    else:
        p = Pipeline(retarget(splits[stages], work), work, extra=FLAGS, config=config).start()
    yield p
    p.stop_cleanly()


async def reference(pipe, kw: dict) -> dict:
    """The token-by-token loop's answer, with each token's two best candidates."""
    return await pipe.generate(**dict(kw, speculate=False, logprobs=2))


def first_difference(got: list[int], want: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def assert_same_or_near_tie(got: dict, want: dict) -> None:
    i = first_difference(got["tokens"], want["tokens"])
    if i is None:
        return
    assert i < len(want["tokens"]) and i < len(got["tokens"]), (
        f"one reply ends early at {i}: {got['finish_reason']} against {want['finish_reason']}")
    top = want["logprobs"][i]["top"]
    margin = top[0][1] - top[1][1] if len(top) > 1 else math.inf
    assert margin <= NEAR_TIE, (f"speculative output differs at token {i} ({got['tokens'][i]} against "
                                f"{want['tokens'][i]}) where the two best candidates are {margin:.4f} apart")


async def test_windows_carry_the_copy_and_the_output_is_the_token_by_token_loops(pipe):
    want = await reference(pipe, COPY)
    got = await pipe.generate(**COPY)
    spec = got["usage"]["speculation"]
    assert spec["windows"] >= 1 and spec["accepted"] >= 1, spec
    assert spec["accepted"] <= spec["drafted"]
    assert "speculation" not in want["usage"]  # speculation off for this request
    assert_same_or_near_tie(got, want)
    status = (await pipe.stages[0].astatus())["head"]["speculation"]
    assert status["enabled"] and status["windows"] >= spec["windows"] and status["accepted"] >= spec["accepted"]


@ENDINGS
async def test_seeded_sampling_draws_at_each_position_what_the_token_by_token_loop_draws(pipe):
    """Each position of a window is sampled from the target distribution in order, by the session's one chain,
    and accepted while it equals the draft: the seeded draws are those of the plain loop. A window's rows
    compute the bits a decode step computes (the default model's kernels, see native/patches), so the reply
    is the plain loop's exactly, greedy or seeded."""
    seeded_accepted = 0
    for kw in (SEEDED, dict(SEEDED, temperature=0.5, seed=8), COPY):
        want = await pipe.generate(**dict(kw, speculate=False))
        got = await pipe.generate(**kw)
        assert got["tokens"] == want["tokens"], (kw, first_difference(got["tokens"], want["tokens"]))
        if kw is not COPY:
            seeded_accepted += got["usage"]["speculation"]["accepted"]
        else:
            assert got["usage"]["speculation"]["accepted"] >= 8
    assert seeded_accepted >= 1  # seeded windows took drafts, and drew as the plain loop did
    other = await pipe.generate(**dict(SEEDED, seed=8, max_tokens=24))
    first = await pipe.generate(**dict(SEEDED, max_tokens=24))
    assert other["tokens"] != first["tokens"]  # the sampling is live


# part copy, part new text: windows while the reply copies, plain steps while it does not
EDIT = dict(prompt=f"Here is a Python module:\n\n{CODE}\nThe same module with a docstring for each function:\n\n",
            raw=True, max_tokens=96)


@pytest.mark.parametrize("pipe", ["1-stage", "2-stage-prefix-cache"], indirect=True)
async def test_the_same_greedy_request_gives_the_same_tokens_every_time(pipe):
    """Windows and plain steps are chosen from the tokens, never from the clock, and the prompt is computed in
    rows that round alike whatever its chunks or what the prefix cache restored: the request repeated (the
    second and third restoring the prompt where the cache is on) gives the same tokens each time."""
    before = (await pipe.stages[0].astatus())["head"]["speculation"]["plain_steps"]
    replies = [await pipe.generate(**EDIT) for _ in range(3)]
    assert replies[0]["usage"]["speculation"]["windows"] >= 1
    assert (await pipe.stages[0].astatus())["head"]["speculation"]["plain_steps"] > before  # both kinds of step
    assert replies[1]["tokens"] == replies[0]["tokens"] and replies[2]["tokens"] == replies[0]["tokens"]
    assert [r["usage"]["speculation"] for r in replies[1:]] == [replies[0]["usage"]["speculation"]] * 2


STORY = dict(prompt="Once upon a time, in a village by the sea, there lived", raw=True, max_tokens=64)


@pytest.mark.parametrize("pipe", ["2-stage"], indirect=True)
async def test_sessions_that_share_batches_each_give_the_same_tokens_every_time(pipe):
    """A session's rows round the same whatever other sessions' rows share its batches, and each chooses its
    windows from its own tokens: four sessions at once (two copying, two not) twice give the same replies."""
    async def together() -> list[list[int]]:
        replies: list[list[int]] = [[]] * 4

        async def one(i: int, kw: dict) -> None:
            replies[i] = (await pipe.generate(**kw))["tokens"]

        async with trio.open_nursery() as nursery:
            for i, kw in enumerate((EDIT, STORY, COPY, dict(STORY, prompt=STORY["prompt"] + " an old"))):
                nursery.start_soon(one, i, kw)
        return replies

    first = await together()
    assert await together() == first


@ENDINGS
@pytest.mark.parametrize("max_tokens", [1, 5, 17])
async def test_max_tokens_ends_in_the_middle_of_a_window(pipe, max_tokens):
    kw = dict(COPY, max_tokens=max_tokens)
    got, want = await pipe.generate(**kw), await reference(pipe, kw)
    assert len(got["tokens"]) == max_tokens and got["finish_reason"] == "length"
    assert_same_or_near_tie(got, want)


@ENDINGS
async def test_a_stop_string_ends_in_the_middle_of_a_window(pipe):
    kw = dict(COPY, stop=["perimeter"])
    got, want = await pipe.generate(**kw), await reference(pipe, kw)
    assert got["finish_reason"] == "stop" and "perimeter" not in got["text"]
    assert got["text"] == want["text"]


@ENDINGS
async def test_logprobs_requests_are_decoded_token_by_token(pipe):
    got = await pipe.generate(**dict(COPY, max_tokens=8, logprobs=1))
    assert "speculation" not in got["usage"] and len(got["logprobs"]) == 8


@ENDINGS
async def test_cancelled_in_the_middle_of_windows_every_stage_lets_go(pipe):
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            s = await stream(pipe, nursery, **dict(COPY, max_tokens=400, stream=True))
            await wait_for(lambda: len(s.pieces) >= 6 or s.done.is_set())
            async with open_control(pipe.head.url, pipe.head.token_file) as client:
                live = await client.call(m.SessionsList(id=client.new_id()))
                assert live, "the generation ended before it could be cancelled"
                for entry in live:
                    await client.call(m.SessionKill(id=client.new_id(), session_id=entry["session_id"], wait=True))
            await s.done.wait()
    assert s.result is None or s.result["finish_reason"] == "cancelled", s.result
    await pipe.wait_all_released(timeout=5.0)
    again = await pipe.generate(**dict(COPY, max_tokens=8))
    assert len(again["tokens"]) == 8


# each way on every link: a round trip over a quarter of a window's compute even on a busy machine, so windows
# go behind the one in flight
DELAY = {"stage.link_delay_ms": 15}


# the requests of each delayed pipeline: 3 stages (a middle stage acknowledging windows it forwarded, the
# predictions on the token-return connection) take a trip more per token, so fewer
IN_FLIGHT_REQUESTS = {2: (COPY, SEEDED, dict(EDIT, max_tokens=160)), 3: (COPY, EDIT)}


@pytest.fixture(scope="module", params=[2, 3], ids=["2-stage", "3-stage"])
def delayed(request, splits, tmp_path_factory):
    """2 or 3 stages whose links take 15 ms each way (skippy's own link conditioning)."""
    work = tmp_path_factory.mktemp(f"spec-delayed{request.param}")
    p = Pipeline(retarget(splits[request.param], work), work, extra=FLAGS, config={**CONFIG, **DELAY}).start()
    yield p
    p.stop_cleanly()


async def test_windows_in_flight_over_a_slow_link_give_the_token_by_token_loops_output(delayed):
    """Over a link whose round trip is long against a window's compute the head keeps windows in flight,
    each drafted as if the one ahead were accepted in full; those behind a rejected draft are dropped. The
    reply is the plain loop's, greedy and seeded."""
    chained = dropped = 0
    for kw in IN_FLIGHT_REQUESTS[len(delayed.stages)]:
        want = await delayed.generate(**dict(kw, speculate=False))
        got = await delayed.generate(**kw)
        assert got["tokens"] == want["tokens"], (kw, first_difference(got["tokens"], want["tokens"]))
        spec = got["usage"]["speculation"]
        chained += spec["chained"]
        dropped += spec["dropped"]
    assert chained >= 4 and dropped >= 1, (chained, dropped)
    status = (await delayed.stages[0].astatus())["head"]["speculation"]
    assert status["chained"] >= chained and status["dropped"] >= dropped
    (final,) = (await delayed.stages[len(delayed.stages) - 1].astatus())["stages"]
    assert final["windows_dropped"] >= dropped


@pytest.fixture(params=["loopback", "slow link"])
def resuming(request, splits, tmp_path):
    config = {**CONFIG, **(DELAY if request.param == "slow link" else {})}
    p = Pipeline(retarget(splits[2], tmp_path), tmp_path, extra=[*FLAGS, "--resume"], config=config).start()
    p.slow_link = request.param == "slow link"
    yield p
    p.stop_cleanly()


async def test_a_stage_killed_in_the_middle_of_windows_resumes_without_a_repeated_or_lost_token(resuming):
    """--resume replays the reply so far token by token on the restarted pipeline and goes on drafting: the
    stream repeats and loses nothing, and the reply is the uninterrupted one's (up to a near-tie). Over a
    slow link windows are in flight behind one another when the stage dies."""
    pipe = resuming
    kw = dict(COPY, max_tokens=160)
    want = await reference(pipe, kw)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            s = await stream(pipe, nursery, **kw)
            await wait_for(lambda: len(s.pieces) >= 12 or s.done.is_set())
            assert not s.done.is_set(), s.result or s.error
            await kill_and_restart(pipe, 1)
            await s.done.wait()
    assert s.error is None, f"the generation failed instead of resuming: {s.error}"
    got = s.result
    assert "".join(s.pieces) == got["text"], "the stream repeated or lost text across the replay"
    assert got["usage"]["speculation"]["windows"] >= 2
    if pipe.slow_link:  # windows were in flight behind one another
        assert got["usage"]["speculation"]["chained"] >= 1
    assert_same_or_near_tie(got, want)
    await pipe.wait_all_released(timeout=5.0)


@pytest.fixture
def api(default_model_path, tmp_path):
    with serving(default_model_path, tmp_path, ctx=1024) as served:
        yield served


async def test_the_openai_endpoint_takes_speculate_per_request_and_reports_it(api):
    """A daemon with --speculate off: a request with ``speculate: true`` drafts, one without does not; the
    usage says so and the Prometheus counters count the windows. ``"ngram"`` and ``"off"`` say the same, and
    anything else is a 400 naming the field."""
    messages = [{"role": "user", "content": f"{CODE}\nRepeat the code above exactly."}]
    plain = await run(api.client.chat.completions.create, model=MODEL_ID, messages=messages, max_tokens=48,
                      temperature=0)
    spec = await run(api.client.chat.completions.create, model=MODEL_ID, messages=messages, max_tokens=48,
                     temperature=0, extra_body={"speculate": True})
    assert "speculation" not in (plain.usage.model_extra or {})
    counts = spec.usage.model_extra["speculation"]
    assert counts["windows"] >= 1 and counts["accepted"] >= 1, counts
    metrics = await run(api.metrics)
    assert metrics[("skippy_speculative_windows_total", ())] == counts["windows"]
    assert metrics[("skippy_speculative_accepted_tokens_total", ())] == counts["accepted"]
    named = await run(api.client.chat.completions.create, model=MODEL_ID, messages=messages, max_tokens=48,
                      temperature=0, extra_body={"speculate": "ngram"})
    assert named.usage.model_extra["speculation"]["windows"] >= 1
    off = await run(api.client.chat.completions.create, model=MODEL_ID, messages=messages, max_tokens=8,
                    temperature=0, extra_body={"speculate": "off"})
    assert "speculation" not in (off.usage.model_extra or {})
    with pytest.raises(openai.BadRequestError) as bad:
        await run(api.client.chat.completions.create, model=MODEL_ID, messages=messages, max_tokens=8,
                  extra_body={"speculate": "fast"})
    assert bad.value.body["param"] == "speculate"


async def test_skippyctl_generate_speculate_reports_timings_and_status_the_acceptance_per_session(api):
    """`skippyctl generate --speculate ngram --json`: timings carry the drafted and accepted tokens and the
    windows; `--speculate off`: none. While a drafting generation runs, status shows its acceptance."""
    head = api.pipe.head
    base = [sys.executable, "-m", "skippyctl.app", "--url", head.url, "--token-file", str(head.token_file),
            "generate", "--raw", "-p", f"{CODE}\n{CODE}", "-n", "40", "--json"]
    on = json.loads((await trio.to_thread.run_sync(lambda: subprocess.run(
        [*base, "--speculate", "ngram"], capture_output=True, text=True, check=True, timeout=120))).stdout)
    assert on["timings"]["windows"] >= 1 and 1 <= on["timings"]["accepted"] <= on["timings"]["drafted"], on
    off = json.loads((await trio.to_thread.run_sync(lambda: subprocess.run(
        [*base, "--speculate", "off"], capture_output=True, text=True, check=True, timeout=120))).stdout)
    assert (off["timings"]["windows"], off["timings"]["drafted"], off["timings"]["accepted"]) == (0, 0, 0)
    seen = {}
    async with trio.open_nursery() as nursery:
        async def generate():
            async with open_control(head.url, head.token_file) as client:
                await client.call(m.Generate(id=client.new_id(), prompt=f"{CODE}\n{CODE}", raw=True,
                                             max_tokens=200, speculate=True))

        nursery.start_soon(generate)
        with trio.fail_after(60):
            while not seen:
                await trio.sleep(0.05)
                seen = (await head.astatus())["head"]["speculation"]["sessions"]
    assert all(a is None or 0 <= a <= 1 for a in seen.values()), seen
    assert (await head.astatus())["head"]["speculation"]["sessions"] == {}
