"""Logprobs: computed on the final stage from the distribution it sampled from, carried back with each token
(relayed or by direct return), streamed or whole, on the OpenAI endpoint and the control channel."""

from __future__ import annotations

import json
import math

import jsonschema
import numpy as np
import pytest
import trio

from skippyctl.client import open_control
from skippyd.control import messages as m
from skippyd.runtime import llama
from skippyd.sampling import Constraint, SamplingParams
from tests.openai_api import run, serving
from tests.procs import Pipeline, split_for_test

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
CTX = 1024
PROMPTS = ["Name three colours.", "What is the capital of France?"]
RAW_PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max()
    return x - (top + math.log(np.exp(x - top).sum()))


@pytest.fixture(scope="module")
def full(default_model_path):
    model = llama.Model(default_model_path)
    ctx = llama.Context(model, llama.ContextParams(n_ctx_per_seq=CTX, n_seq_max=1, n_threads=2))
    yield model, ctx
    ctx.close()
    model.close()


def _chat_tokens(model: llama.Model, prompt: str) -> np.ndarray:
    """The prompt as the head tokenizes a chat (skippyd.head.engine.HeadEngine.prompt_tokens)."""
    text = model.apply_chat_template([{"role": "user", "content": prompt}], add_assistant=True)
    return model.tokenize(text, add_special=False, parse_special=True)


def _raw_tokens(model: llama.Model, prompt: str) -> np.ndarray:
    """A raw prompt as the head tokenizes it (skippyd.head.engine.HeadEngine.prompt_tokens)."""
    return model.tokenize(prompt, add_special=True, parse_special=False)


def _reference(model, ctx, prompt: np.ndarray, reply: list[int]) -> list[np.ndarray]:
    """The single-process log-softmax at each generated position, along the reply's tokens."""
    ctx.kv_clear_seq(0)
    ctx.decode(np.arange(len(prompt), dtype=np.int32), np.zeros(len(prompt), dtype=np.int32), tokens=prompt)
    out = [_log_softmax(ctx.logits(0))]
    for i, token in enumerate(reply[:-1]):
        ctx.decode_row(len(prompt) + i, 0, token=token)
        out.append(_log_softmax(ctx.logits(0)))
    return out


# ---------------------------------------------------------------- in process
def test_guided_sampler_logprobs(full):
    model, ctx = full
    prompt = _chat_tokens(model, PROMPTS[0])
    ctx.kv_clear_seq(0)
    ctx.decode(np.arange(len(prompt), dtype=np.int32), np.zeros(len(prompt), dtype=np.int32), tokens=prompt)
    want = _log_softmax(ctx.logits(0))
    greedy = llama.sampler_for(model, SamplingParams(logprobs=5))
    token = ctx.sample_row(0, greedy)
    got = greedy.last
    assert token == int(np.argmax(want)) == got.token == got.top[0][0]
    assert abs(got.logprob - want[token]) < 1e-6
    assert [t for t, _ in got.top] == list(np.argsort(-want, kind="stable")[:5])
    # sampled: the distribution after the filters and temperature (top_k 3 leaves three tokens, summing to 1)
    sampled = llama.sampler_for(model, SamplingParams(temperature=0.7, top_k=3, seed=1, logprobs=10))
    token = ctx.sample_row(0, sampled)
    got = sampled.last
    assert len(got.top) == 3 and token in [t for t, _ in got.top]
    assert abs(sum(math.exp(lp) for _, lp in got.top) - 1) < 1e-5
    kept = np.argsort(-want)[:3]
    scaled = want[kept] / 0.7
    expected = scaled - (scaled.max() + math.log(np.exp(scaled - scaled.max()).sum()))
    assert np.allclose(sorted((lp for _, lp in got.top), reverse=True), sorted(expected, reverse=True), atol=1e-4)
    # constrained: the mask's distribution (only the tokens the schema allows)
    constrained = llama.sampler_for(model, SamplingParams(constraint=Constraint.json_object(), logprobs=3))
    token = ctx.sample_row(0, constrained)
    assert model.token_piece(token).startswith(b"{") and constrained.last.logprob <= 0


# ---------------------------------------------------------------- a real 2-stage pipeline
@pytest.fixture(scope="module")
def pipe(default_model_path, tmp_path_factory):
    with serving(default_model_path, tmp_path_factory.mktemp("logprobs"), ctx=CTX) as api:
        api.pipe.client = api.client
        yield api.pipe



@pytest.mark.slow
async def test_greedy_logprobs_match_a_single_process(pipe, full):
    """The chosen token is the top alternative, and its logprob is the full model's, to 1e-3."""
    model, ctx = full
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        for prompt in RAW_PROMPTS:
            result = await client.call(m.Generate(id=client.new_id(), prompt=prompt, raw=True, max_tokens=12,
                                                  logprobs=3, stream=False))
            tokens, entries = result["tokens"], result["logprobs"]
            assert len(entries) == len(tokens) > 0
            assert result["usage"]["prompt_tokens"] == len(_raw_tokens(model, prompt))
            reference = _reference(model, ctx, _raw_tokens(model, prompt), tokens)
            for token, entry, want in zip(tokens, entries, reference):
                assert entry["token"] == token
                assert entry["top"][0][0] == token and len(entry["top"]) == 3
                assert abs(entry["logprob"] - want[token]) < 1e-3, (entry, want[token])
                for alt, lp in entry["top"]:
                    assert abs(lp - want[alt]) < 1e-3


@pytest.mark.slow
async def test_openai_logprobs_whole_and_streamed(pipe):
    chat = dict(model=MODEL_ID, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=8, temperature=0,
                logprobs=True, top_logprobs=2)
    got = await run(pipe.client.chat.completions.create, **chat)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    assert "".join(c.token for c in content) == got.choices[0].message.content
    for c in content:
        assert bytes(c.bytes).decode("utf-8", "replace") == c.token
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == c.logprob <= 0

    def stream():
        streamed = []
        for chunk in pipe.client.chat.completions.create(stream=True, **chat):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                streamed += chunk.choices[0].logprobs.content
        return streamed

    streamed = await run(stream)
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == [(c.token, round(c.logprob, 5)) for c in content]

    # completions: tokens, token_logprobs, top_logprobs, text_offset
    got = await run(pipe.client.completions.create, model=MODEL_ID, prompt="The capital of France is",
                    max_tokens=6, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert "".join(lp.tokens) == got.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and max(top.values()) == logprob

    # sampled at a temperature: from the distribution sampled from (top_k 4: at most 4 alternatives, and the
    # chosen token among them)
    got = await run(pipe.client.chat.completions.create, **{**chat, "temperature": 0.8, "top_logprobs": 10,
                                                           "seed": 5, "extra_body": {"top_k": 4}})
    for c in got.choices[0].logprobs.content:
        assert len(c.top_logprobs) <= 4 and c.token in [t.token for t in c.top_logprobs]


@pytest.mark.slow
@pytest.mark.parametrize("direct_return", [True, False], ids=["direct-return", "relayed"])
async def test_three_stages_carry_logprobs_and_constraints(default_model_path, tmp_path, full, direct_return):
    """With a middle stage: predictions with logprobs come by direct return or relayed through it, the same;
    a constrained session beside an unconstrained one (decoded together) keeps to its schema."""
    model, ctx = full
    split_for_test(default_model_path, 3, tmp_path)
    pipe = await trio.to_thread.run_sync(Pipeline(tmp_path / "topology.toml", tmp_path,
                                                   extra=["--ctx", str(CTX), "--lanes", "2"],
                                                   config={"runtime.direct_return": direct_return}).start)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    try:
        async with open_control(pipe.head.url, pipe.head.token_file) as client:
            prompt = RAW_PROMPTS[0]
            result = await client.call(m.Generate(id=client.new_id(), prompt=prompt, raw=True, max_tokens=8,
                                                  logprobs=2, stream=False))
            reference = _reference(model, ctx, _raw_tokens(model, prompt), result["tokens"])
            for token, entry, want in zip(result["tokens"], result["logprobs"], reference):
                assert entry["token"] == token == entry["top"][0][0]
                assert abs(entry["logprob"] - want[token]) < 1e-3
        results = {}

        async def one(name: str, **kw) -> None:
            async with open_control(pipe.head.url, pipe.head.token_file) as client:
                results[name] = await client.call(m.Generate(id=client.new_id(), stream=False, **kw))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: one("constrained", prompt="Describe a person.", max_tokens=120,
                                           json_schema=json.dumps(schema), temperature=0.7, seed=4))
            nursery.start_soon(lambda: one("plain", prompt="Name three colours.", max_tokens=40))
        if results["constrained"]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(results["constrained"]["text"]), schema)
        assert results["plain"]["finish_reason"] in ("stop", "length") and "logprobs" not in results["plain"]
    finally:
        codes = await trio.to_thread.run_sync(pipe.stop)
    assert all(c == 0 for c in codes.values()), codes
