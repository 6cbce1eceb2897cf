"""Gemma 3 270M (real weights) split in 2 and 3 stages computes what the whole model computes.

Its layers alternate five sliding-window layers (a 512-token window) with one of full attention, a pattern
counted from the model's first layer; the prompt is longer than the window, so a stage that took its layers'
pattern from its own numbering would attend to the wrong tokens. In process, the split's logits after the
prompt are bit-identical to the whole model's (same batch, same kernels); as skippyd processes, 2- and
3-stage pipelines give the greedy tokens of a single-stage daemon, of the whole model in process and of
llama-cpp-python, 48 of them.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from skippyd.runtime.llama import ContextParams
from skippyd.runtime.slicing import split_model
from tests.gemma3 import LONG_PROMPT, RANGES, SLIDING_WINDOW
from tests.llama_cpp_reference import greedy_tokens, install_llama_cpp
from tests.local_pipeline import LocalPipeline
from tests.procs import Pipeline, SingleStage, retarget

pytestmark = pytest.mark.slow  # a 250 MB model, real daemon processes

N_TOKENS = 48
CHUNK = 512  # the whole prompt in one batch of 512 and one of the rest, everywhere: the same computation
PARAMS = ContextParams(n_ctx_per_seq=2048, n_seq_max=1)
DAEMON_CONFIG = {"runtime.prefill_chunk": CHUNK, "runtime.ctx": 2048, "runtime.lanes": 1}


@pytest.fixture(scope="module")
def gemma3_splits(gemma3_path, tmp_path_factory) -> dict[int, list]:
    """{stages: topology.toml}, each stage file written once for the module."""
    out = {}
    for n, ranges in RANGES.items():
        work = tmp_path_factory.mktemp(f"gemma3-split{n}")
        split_model(gemma3_path, ranges, work)
        out[n] = work / "topology.toml"
    return out


@functools.cache
def prompt_tokens(model_path) -> list[int]:
    with LocalPipeline([model_path], PARAMS) as one:
        return [int(t) for t in one.head.tokenize(LONG_PROMPT, add_special=True)]


def run_in_process(paths) -> tuple[np.ndarray, list[int]]:
    """The last prompt token's logits and the greedy tokens after it."""
    with LocalPipeline(paths, PARAMS) as pipe:
        prompt = [int(t) for t in pipe.head.tokenize(LONG_PROMPT, add_special=True)]
        pipe.prefill(prompt, chunk=CHUNK)
        logits = pipe.last.logits(0).copy()
        return logits, pipe.continue_decode(len(prompt), N_TOKENS, stop_at_eog=False)


@functools.cache
def whole_model(model_path) -> tuple[np.ndarray, list[int]]:
    return run_in_process([model_path])


def test_the_prompt_is_longer_than_the_sliding_window(gemma3_path):
    assert len(prompt_tokens(gemma3_path)) > SLIDING_WINDOW + 64


@pytest.mark.parametrize("n", sorted(RANGES))
def test_split_in_process_is_bit_identical_to_the_whole_model(gemma3_path, gemma3_splits, n):
    from skippyd.topology import Topology

    files = [s.file for s in Topology.load(gemma3_splits[n]).stages]
    want_logits, want_tokens = whole_model(gemma3_path)
    logits, tokens = run_in_process(files)
    assert np.array_equal(logits, want_logits)
    assert tokens == want_tokens and len(tokens) == N_TOKENS


def test_the_whole_model_equals_llama_cpp_python(gemma3_path, tmp_path_factory):
    llama_cpp = install_llama_cpp(tmp_path_factory.mktemp("llama-cpp-python"))
    got = greedy_tokens(llama_cpp, gemma3_path, prompt_tokens(gemma3_path), N_TOKENS, n_batch=CHUNK)
    assert got == whole_model(gemma3_path)[1]


# Gemma's turn markers; the model, a base model, ships no chat template
TURNS = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}"
         "\n{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope="module")
def single_daemon(gemma3_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("gemma3-single")
    (work / "turns.jinja").write_text(TURNS)
    d = SingleStage(gemma3_path, work, config=DAEMON_CONFIG, extra=["--chat-template", str(work / "turns.jinja")])
    yield d
    d.stop_cleanly()


async def test_a_base_model_chats_with_the_operators_template(gemma3_path, single_daemon):
    chat = [{"role": "user", "content": "Name a colour."}]
    got = await single_daemon.generate(messages=chat, max_tokens=8, temperature=0.0)
    with LocalPipeline([gemma3_path], PARAMS) as one:
        bos = one.head.token_piece(one.head.bos, special=True).decode()
        text = f"{bos}<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n"
        want = len(one.head.tokenize(text, add_special=False, parse_special=True))
    assert got["error"] is None and got["tokens"] and got["usage"]["prompt_tokens"] == want


async def daemon_tokens(pipe) -> list[int]:
    got = await pipe.generate(prompt=LONG_PROMPT, raw=True, max_tokens=N_TOKENS, temperature=0.0)
    assert got["finish_reason"] == "length", got
    return got["tokens"]


@pytest.fixture(scope="module", params=sorted(RANGES), ids=lambda n: f"{n}-stages")
def gemma3_pipeline(request, gemma3_splits, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"gemma3-pipe{request.param}")
    pipe = Pipeline(retarget(gemma3_splits[request.param], work), work, config=DAEMON_CONFIG).start()
    yield pipe
    pipe.stop_cleanly()


async def test_the_single_stage_daemon_gives_the_whole_models_tokens(gemma3_path, single_daemon):
    assert await daemon_tokens(single_daemon) == whole_model(gemma3_path)[1]


async def test_pipeline_daemons_give_the_whole_models_tokens(gemma3_path, gemma3_pipeline):
    assert await daemon_tokens(gemma3_pipeline) == whole_model(gemma3_path)[1]
    await gemma3_pipeline.wait_all_released()


def greedy_steps(pipe: LocalPipeline, first: int, position: int, n: int, seq: int) -> list[int]:
    """Decode `first` at `position` in `seq`, then greedily on: the next `n` tokens."""
    out, token = [], first
    for pos in range(position, position + n):
        pipe.decode(np.array([token], np.int32), np.array([pos], np.int32), np.array([seq], np.int32))
        token = pipe.last.sample({seq: None})[seq]
        out.append(token)
    return out


def test_sliding_window_kv_moves_and_trims_across_stage_boundaries(gemma3_splits):
    """What the prefix cache and speculative decoding do to a session's KV on every stage: a sequence's state
    exported after the prompt and imported into another sequence, and a sequence trimmed back to an earlier
    position, decode exactly as the sequence that computed it."""
    from skippyd.topology import Topology

    files = [s.file for s in Topology.load(gemma3_splits[2]).stages]
    with LocalPipeline(files, ContextParams(n_ctx_per_seq=2048, n_seq_max=2)) as pipe:
        prompt = [int(t) for t in pipe.head.tokenize(LONG_PROMPT, add_special=True)]
        pipe.prefill(prompt, seq=0, chunk=CHUNK)
        first = pipe.last.sample({0: None})[0]
        states = [ctx.state_export(0) for ctx in pipe.contexts]
        want = greedy_steps(pipe, first, len(prompt), 16, seq=0)
        for ctx, state in zip(pipe.contexts, states):
            ctx.state_import(1, state)
        assert greedy_steps(pipe, first, len(prompt), 16, seq=1) == want
        keep = len(prompt) + 6  # the prompt, `first` and five of the tokens after it
        for ctx in pipe.contexts:
            ctx.kv_trim(0, keep)
        assert greedy_steps(pipe, want[5], keep, 10, seq=0) == want[6:]


# ------------------------------------------------------------------ what runs on a split, unchanged

@pytest.fixture(scope="module")
def gemma3_featured(gemma3_splits, tmp_path_factory):
    """2 stages with speculative decoding and the prefix cache on (the product's defaults)."""
    work = tmp_path_factory.mktemp("gemma3-featured")
    pipe = Pipeline(retarget(gemma3_splits[2], work), work, config=DAEMON_CONFIG,
                    extra=["--speculate", "ngram", "--prefix-cache-mb", "256"]).start()
    yield pipe
    pipe.stop_cleanly()


async def test_speculative_windows_cross_the_stages(gemma3_featured):
    from tests.test_speculative import COPY, assert_same_or_near_tie, reference

    want = await reference(gemma3_featured, COPY)
    got = await gemma3_featured.generate(**COPY)
    spec = got["usage"]["speculation"]
    assert spec["windows"] >= 1 and 1 <= spec["accepted"] <= spec["drafted"], spec
    assert_same_or_near_tie(got, want)
    await gemma3_featured.wait_all_released()


async def test_a_prefix_held_by_both_stages_is_restored_past_the_window(gemma3_featured):
    first = await gemma3_featured.generate(prompt=LONG_PROMPT, raw=True, max_tokens=4, speculate=False)
    longer = dict(prompt=LONG_PROMPT + " harbour and the hills beyond it.", raw=True, max_tokens=16,
                  speculate=False)
    second, third = [await gemma3_featured.generate(**longer) for _ in range(2)]
    held = first["usage"]["prompt_tokens"]
    assert second["usage"]["cached_tokens"] >= SLIDING_WINDOW and second["usage"]["cached_tokens"] >= held - 1
    # the same restore and the same suffix: the same computation, the same tokens
    assert third["usage"]["cached_tokens"] >= second["usage"]["cached_tokens"]
    assert third["tokens"] == second["tokens"] and len(second["tokens"]) == 16
    await gemma3_featured.wait_all_released()


async def test_structured_output_on_the_final_stage(gemma3_featured):
    import json

    import jsonschema

    steps = {"type": "integer", "minimum": 1, "maximum": 500}  # a base model left free writes digits on and on
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "steps": steps},
              "required": ["city", "steps"], "additionalProperties": False}
    got = await gemma3_featured.generate(prompt="A lighthouse record as JSON: ", raw=True, max_tokens=48,
                                         json_schema=json.dumps(schema), temperature=0.0)
    assert got["finish_reason"] == "stop", got
    jsonschema.validate(json.loads(got["text"]), schema)


async def test_a_killed_final_stage_resumes_with_the_same_tokens(gemma3_splits, tmp_path):
    import trio

    from tests.test_faults import COUNT
    from tests.test_resume import check_resumed

    pipe = Pipeline(retarget(gemma3_splits[3], tmp_path), tmp_path, extra=["--resume"],
                    config={**DAEMON_CONFIG, "runtime.resume_window": 30})
    await trio.to_thread.run_sync(pipe.start)
    try:
        await check_resumed(pipe, 2, dict(prompt=COUNT, raw=True, max_tokens=64), when="decode")
    finally:
        await trio.to_thread.run_sync(pipe.stop)
