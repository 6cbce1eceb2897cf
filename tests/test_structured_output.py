"""Structured output: a constraint (JSON schema, any JSON object, a grammar) travels with the generation's
configuration to the final stage, which masks the logits with it every step.

The fast tests check the constraint type, its wire form and the final stage's sampler in process (real
libllama, the default model); the slow ones run a 2-stage pipeline of real daemons and ask it through the
official ``openai`` client and the control channel."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pydantic
import pytest
from typer.testing import CliRunner

from skippyctl.app import app
from skippyctl.client import ControlError, open_control
from skippyd.control import messages as m
from skippyd.openai import schemas
from skippyd.runtime import llama
from skippyd.sampling import Constraint, InvalidConstraint, InvalidSampling, SamplingParams
from skippyd.wire.codec import decode_frame, frame_bytes
from skippyd.wire.messages import ConfigureGeneration, PredictedToken, PredictedTokenLogprobs
from tests.openai_api import run, serving
from tests.procs import SingleStage

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
CTX = 2048
N_EMBD = 576

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}

# (prompt, schema): nested objects, arrays, enums, required fields
CASES = [
    ("Describe a person.", PERSON),
    ("Give me a city and its country.", {
        "type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"]}),
    ("Rate the weather today.", {
        "type": "object", "properties": {"sky": {"enum": ["sunny", "cloudy", "rainy"]},
                                         "temperature_c": {"type": "number"}},
        "required": ["sky", "temperature_c"], "additionalProperties": False}),
    ("List three colours.", {
        "type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                     "minItems": 3, "maxItems": 3}},
        "required": ["colours"], "additionalProperties": False}),
    ("Describe a book with its author.", {
        "type": "object", "properties": {
            "title": {"type": "string", "maxLength": 40},
            "author": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 20},
                                                        "last": {"type": "string", "maxLength": 20}},
                       "required": ["first", "last"], "additionalProperties": False},
            "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
        "required": ["title", "author", "year"], "additionalProperties": False}),
    ("Is the sea salty? Answer yes or no.", {
        "type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
        "additionalProperties": False}),
    ("Pick a fruit.", {"enum": ["apple", "banana", "cherry"]}),
    ("Give two numbers.", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                           "minItems": 2, "maxItems": 2}),
]


# ---------------------------------------------------------------- the constraint type
def test_constraints_check_what_they_are_given():
    c = Constraint.json_schema(PERSON)
    assert c.kind == "json_schema" and json.loads(c.text) == PERSON
    assert Constraint.json_schema(json.dumps(PERSON)) == c
    assert Constraint.json_object().compiled()
    assert Constraint.grammar('root ::= "yes" | "no"').compiled()  # GBNF
    assert Constraint.grammar('start: "yes" | "no"').compiled()  # Lark
    bad = [
        (lambda: Constraint.json_schema({"type": "frobnicate"}), "not a valid JSON schema"),
        (lambda: Constraint.json_schema({"type": "object", "if": {"type": "object"}}), "not supported"),
        (lambda: Constraint.json_schema("{not json"), "is not JSON"),
        (lambda: Constraint.json_schema([1, 2]), "must be a JSON object"),
        (lambda: Constraint.json_schema({"type": "string", "format": "no-such-format"}), "no-such-format"),
        (lambda: Constraint.grammar('root ::= "yes | '), "grammar"),
        (lambda: Constraint.grammar("start: undefined_rule"), "undefined_rule"),
        (lambda: Constraint.grammar("  "), "empty"),
    ]
    for make, words in bad:
        with pytest.raises(InvalidConstraint, match=words) as info:
            make()
        assert info.value.field in ("json_schema", "grammar")
    with pytest.raises(InvalidSampling, match="logprobs"):
        SamplingParams(logprobs=21)
    assert SamplingParams(constraint=Constraint.json_object()).guided
    assert SamplingParams(logprobs=0).guided and not SamplingParams(logprobs=0).is_plain_greedy
    assert SamplingParams().is_plain_greedy and not SamplingParams().guided


def test_configure_generation_carries_the_constraint_and_logprobs_on_the_wire():
    plain = ConfigureGeneration(1, 2, SamplingParams(temperature=0.5, seed=7))
    assert len(frame_bytes(plain)) == 8 + 32 + 36  # no extension: the frame of a plain generation is unchanged
    for sampling in (SamplingParams(constraint=Constraint.json_schema(PERSON), logprobs=3),
                     SamplingParams(constraint=Constraint.grammar('root ::= "é" | "ü"'), logit_bias=[(5, -1.0)]),
                     SamplingParams(constraint=Constraint.json_object()),
                     SamplingParams(logprobs=0, temperature=0.7, seed=1)):
        msg = ConfigureGeneration(3, 4, sampling, direct_return=True)
        data = frame_bytes(msg)
        assert decode_frame(data, n_embd=N_EMBD) == msg
    reply = PredictedTokenLogprobs(1, 2, 42, logprob=-0.25, top=((42, -0.25), (7, -1.5)))
    data = frame_bytes(reply)
    got = decode_frame(data)
    assert got == reply and isinstance(got, PredictedToken)


# ---------------------------------------------------------------- the final stage's sampler, in process
@pytest.fixture(scope="module")
def full(default_model_path):
    model = llama.Model(default_model_path)
    ctx = llama.Context(model, llama.ContextParams(n_ctx_per_seq=1024, n_seq_max=2, n_threads=2))
    yield model, ctx
    ctx.close()
    model.close()


def _generate(model, ctx, prompt: str, sampling: SamplingParams, max_tokens: int) -> tuple[list[int], object]:
    sampler = llama.sampler_for(model, sampling)
    tokens = model.tokenize(model.apply_chat_template([{"role": "user", "content": prompt}]), add_special=False)
    ctx.kv_clear_seq(0)
    ctx.decode(np.arange(len(tokens), dtype=np.int32), np.zeros(len(tokens), dtype=np.int32), tokens=tokens)
    out, pos = [], len(tokens)
    for _ in range(max_tokens):
        token = ctx.sample_row(0, sampler)
        if model.is_eog(token):
            break
        out.append(token)
        if sampler is not None:
            sampler.advance(token)
        ctx.decode_row(pos, 0, token=token)
        pos += 1
    return out, sampler


def test_guided_sampler_output_matches_the_schema(full):
    model, ctx = full
    for prompt, schema in CASES[:4]:
        for temperature in (0.0, 0.7):
            sampling = SamplingParams(temperature=temperature, seed=5, constraint=Constraint.json_schema(schema))
            tokens, _ = _generate(model, ctx, prompt, sampling, 120)
            if len(tokens) == 120:
                continue  # cut by max_tokens: no claim
            jsonschema.validate(json.loads(model.detokenize(tokens)), schema)


def test_a_grammar_constrains_and_ends_the_output(full):
    model, ctx = full
    sampling = SamplingParams(constraint=Constraint.grammar('root ::= ("yes" | "no") "!"'))
    tokens, _ = _generate(model, ctx, "Is water wet?", sampling, 20)
    assert model.detokenize(tokens) in ("yes!", "no!")


def test_unconstrained_greedy_is_unchanged_by_the_python_path(full):
    """The guided path (logprobs only) picks what the native argmax picks."""
    model, ctx = full
    native, _ = _generate(model, ctx, "Name three colours.", SamplingParams(), 24)
    guided, _ = _generate(model, ctx, "Name three colours.", SamplingParams(logprobs=2), 24)
    assert guided == native


# ---------------------------------------------------------------- request checks (no stage touched)
def test_response_format_errors_name_the_parameter():
    def chat(**kw):
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], **kw}
        return schemas.parse(json.dumps(body).encode(), schemas.ChatCompletionRequest).to_generation(49152, CTX)

    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
         "response_format.json_schema.schema"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}),
         "response_format.json_schema.schema"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
         "response_format.json_schema.schema"),
        (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
        (dict(response_format={"type": "yaml"}), "response_format.type"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
         "response_format.json_schema.name"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),
    ]
    for kw, param in cases:
        with pytest.raises(schemas.BadParameter) as info:
            chat(**kw)
        assert info.value.param == param, (kw, info.value.param, str(info.value))
    got = chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                                         "strict": True}},
               logprobs=True, top_logprobs=3)
    assert got.sampling.constraint == Constraint.json_schema(PERSON) and got.sampling.logprobs == 3
    assert chat(response_format={"type": "json_object"}).sampling.constraint == Constraint.json_object()
    assert chat(response_format={"type": "text"}).sampling.constraint is None


def test_control_generate_carries_the_constraint():
    g = m.Generate(id="1", json_schema=json.dumps(PERSON), logprobs=2)
    assert g.sampling().constraint == Constraint.json_schema(PERSON)
    with pytest.raises(InvalidSampling, match="grammar"):
        m.Generate(id="1", grammar="start: nothing_here").sampling()
    with pytest.raises(InvalidSampling, match="one constraint"):
        m.Generate(id="1", json_object=True, grammar='start: "a"').sampling()
    assert m.parse_request(m.dump(g)) == g


# ---------------------------------------------------------------- a real 2-stage pipeline
@pytest.fixture(scope="module")
def api(default_model_path, tmp_path_factory):
    with serving(default_model_path, tmp_path_factory.mktemp("structured"), ctx=CTX, timeout=300) as a:
        yield a



def _schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.slow
async def test_replies_parse_and_validate_against_their_schemas(api):
    """Every reply that finishes parses and validates; nearly all finish well within 300 tokens at 0.7 (the
    full 20 prompts: bench/bench_constrained.py --validity)."""
    finished = 0
    for i, (prompt, schema) in enumerate(CASES):
        got = await run(api.client.chat.completions.create, model=MODEL_ID,
                        messages=[{"role": "user", "content": prompt}], response_format=_schema_format(schema),
                        temperature=0.7, seed=100 + i, max_tokens=300)
        choice = got.choices[0]
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
        finished += 1
    assert finished >= len(CASES) - 1, finished


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.mark.slow
async def test_parse_with_a_pydantic_model_json_object_and_streaming(api):
    got = await run(api.client.chat.completions.parse, model=MODEL_ID, temperature=0, max_tokens=200,
                    messages=[{"role": "user", "content": "Describe a person."}], response_format=Person)
    person = got.choices[0].message.parsed
    assert isinstance(person, Person) and got.choices[0].finish_reason == "stop"

    got = await run(api.client.chat.completions.create, model=MODEL_ID, temperature=0.7, seed=3, max_tokens=200,
                    messages=[{"role": "user", "content": "Describe your favourite animal in JSON."}],
                    response_format={"type": "json_object"})
    if got.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(got.choices[0].message.content), dict)

    def stream():
        parts = []
        for chunk in api.client.chat.completions.create(
                model=MODEL_ID, temperature=0, max_tokens=200, stream=True,
                messages=[{"role": "user", "content": "Describe a person."}],
                response_format=_schema_format(PERSON)):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return "".join(parts), finish

    text, finish = await run(stream)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)

    # completions take response_format too (as llama.cpp's server does)
    got = await run(api.client.completions.create, model=MODEL_ID, prompt="A person as JSON:", temperature=0,
                    max_tokens=200, extra_body={"response_format": _schema_format(PERSON)})
    assert got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got.choices[0].text), PERSON)


@pytest.mark.slow
async def test_bad_schemas_are_400s_naming_the_field_and_harm_nothing(api):
    chat = api.client.chat.completions.create
    cases = [
        (dict(response_format=_schema_format({"type": "frobnicate"})), "response_format.json_schema.schema"),
        (dict(response_format=_schema_format({"type": "object", "if": {}})), "response_format.json_schema.schema"),
        (dict(response_format={"type": "xml"}), "response_format.type"),
        (dict(logprobs=True, top_logprobs=25), "top_logprobs"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await run(chat, model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=3, **kw)
        err = info.value.response.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err
    got = await run(chat, model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                    temperature=0)
    assert got.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
async def test_control_channel_grammar_and_schema(api):
    pipe = api.pipe
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        result = await client.call(m.Generate(id=client.new_id(), prompt="Is fire hot?", max_tokens=10,
                                              grammar='root ::= ("yes" | "no") "."', stream=False))
        assert result["text"] in ("yes.", "no.") and result["finish_reason"] == "stop", result
        result = await client.call(m.Generate(id=client.new_id(), prompt="Describe a person.", max_tokens=200,
                                              json_schema=json.dumps(PERSON), stream=False))
        jsonschema.validate(json.loads(result["text"]), PERSON)
        with pytest.raises(ControlError) as info:
            await client.call(m.Generate(id=client.new_id(), prompt="x", grammar="start: missing", stream=False))
        assert "missing" in str(info.value) and info.value.code == "bad_request", info.value


@pytest.mark.slow
def test_skippyctl_flags_on_a_single_stage(default_model_path, tmp_path):
    """skippyctl generate --json-schema / --grammar / --logprobs, against `skippyd --model` (the head samples,
    through the same guided sampler as a final stage)."""
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON))
    grammar_file = tmp_path / "yesno.gbnf"
    grammar_file.write_text('root ::= ("yes" | "no") "!"\n')
    bad_grammar = tmp_path / "bad.lark"
    bad_grammar.write_text("start: nowhere\n")
    single = SingleStage(default_model_path, tmp_path, ["--ctx", str(CTX)])
    try:
        daemon = single.head

        def ctl(*args: str):
            return CliRunner().invoke(app, ["--url", daemon.url, "--token-file", str(daemon.token_file), "generate",
                                            *args])

        got = ctl("--prompt", "Describe a person.", "--json-schema", str(schema_file), "--logprobs", "2", "--json",
                  "-n", "200")
        assert got.exit_code == 0, (got.stdout, got.stderr)
        result = json.loads(got.stdout)
        jsonschema.validate(json.loads(result["text"]), PERSON)
        assert result["finish_reason"] == "stop"
        assert [e["token"] for e in result["logprobs"]] == result["tokens"]
        assert all(e["top"][0][0] == e["token"] and len(e["top"]) <= 2 for e in result["logprobs"])
        got = ctl("--prompt", "Is water wet?", "--grammar", str(grammar_file), "--json")
        assert got.exit_code == 0 and json.loads(got.stdout)["text"] in ("yes!", "no!"), (got.stdout, got.stderr)
        for args, needle in ((("--grammar", str(bad_grammar)), "nowhere"),
                             (("--json-schema", str(tmp_path / "missing.json")), "cannot read"),
                             (("--json-object", "--grammar", str(grammar_file)), "one constraint")):
            got = ctl("--prompt", "x", *args)
            assert got.exit_code == 2 and got.stderr.startswith("error: ") and needle in got.stderr, got.stderr
            assert "Traceback" not in got.stderr + got.stdout
    finally:
        single.stop()
