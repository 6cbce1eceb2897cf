"""Function tools on the OpenAI endpoint (skippyd/openai/tools.py): the request's checks, the generic format's
prompt and JSON schema, the parsing of both formats, and the official `openai` client against a real 2-stage
pipeline of the default model (a template without tools: the generic format, constrained on the final stage)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from skippyd.head.engine import GenerationRequest, GenerationResult
from skippyd.openai import tools
from skippyd.openai.schemas import BadParameter, ChatCompletionRequest, converter
from skippyd.runtime.llama import Model
from tests.openai_api import Api, run, serving, wait_healthy
from tests.procs import free_ports
from tests.test_chat_template import HERMES, _with_template

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Book a restaurant table",
    "parameters": {"type": "object", "properties": {"restaurant": {"type": "string"},
                                                     "people": {"type": "integer", "minimum": 1, "maximum": 12},
                                                     "vegetarian": {"type": "boolean"}},
                   "required": ["restaurant", "people", "vegetarian"]}}}
TOOLS = [WEATHER, TIME, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def request(**body) -> ChatCompletionRequest:
    body.setdefault("model", MODEL_ID)
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return converter.structure(body, ChatCompletionRequest)


def prepared(model, **body):
    req = request(**body)
    return tools.prepare(req, req.to_generation(model.n_vocab, 512), model)


@pytest.fixture(scope="module")
def smol(default_model_path):
    with Model(default_model_path) as m:
        yield m


# ---------------------------------------------------------------- checks (no stage involved)
@pytest.mark.parametrize("body, param, text", [
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name",
     "invalid function name"),
    (dict(tools=[{"type": "function", "function": {"name": "x" * 65}}]), "tools[0].function.name", "1 to 64"),
    (dict(tools=[WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]),
     "tools[1].function.parameters", "invalid parameters schema for 'f'"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]),
     "tools[0].function.parameters", "must be a JSON schema object"),
    (dict(tools=[{"type": "retrieval"}]), "tools[0].type", "not supported"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name", "two tools"),
    (dict(tools="get_weather"), "tools", "array"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
     "tool_choice.function.name", "'get_time', which is not one of the request's tools"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "not one of"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[WEATHER], response_format={"type": "json_object"}), "response_format", "cannot be combined"),
    (dict(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]),
     "messages[1].tool_call_id", "tool_call_id"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]),
     "messages[0].tool_calls[0]", "a tool call is"),
])
def test_bad_tools_are_named(smol, body, param, text):
    with pytest.raises(BadParameter, match=text) as info:
        prepared(smol, **body)
    assert info.value.param == param


def test_generic_format_prompt_and_schema(smol):
    greq, plan = prepared(smol, tools=TOOLS, tool_choice="required",
                          messages=[{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Weather in Oslo?"}])
    assert not plan.native and plan.mode == "required" and not plan.parallel
    assert greq.tools == ()  # the template knows none: they are in the system message
    system = greq.messages[0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\nYou can call")
    assert '"name": "book_table"' in system["content"] and "Respond with a tool call" in system["content"]
    schema = json.loads(greq.sampling.constraint.text)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = {"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}
    jsonschema.validate(good, schema)
    jsonschema.validate({"zone": "UTC", "invented": 1}, SCHEMAS["get_time"])
    for bad in ({"response": "hi"}, {"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
                {"tool_call": {"name": "nope", "arguments": {}}},
                # objects are closed to the properties they name (the schema itself leaves that open)
                {"tool_call": {"name": "get_time", "arguments": {"zone": "UTC", "invented": 1}}},
                {"tool_call": {"name": "book_table", "arguments": {"restaurant": "x", "people": 40,
                                                                    "vegetarian": True}}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_auto_named_parallel_and_none(smol):
    greq, plan = prepared(smol, tools=TOOLS)
    schema = json.loads(greq.sampling.constraint.text)
    jsonschema.validate({"response": "hello"}, schema)
    jsonschema.validate({"tool_call": {"name": "get_time", "arguments": {"zone": "UTC"}}}, schema)
    greq, plan = prepared(smol, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                          parallel_tool_calls=True)
    schema = json.loads(greq.sampling.constraint.text)
    jsonschema.validate({"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}] * 2}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [{"name": "get_weather", "arguments": {"city": "a", "unit": "celsius"}}]},
                            schema)
    greq, plan = prepared(smol, tools=TOOLS, tool_choice="none")
    assert plan is None and greq.sampling.constraint is None
    assert greq.messages == ({"role": "user", "content": "hi"},)


def test_history_in_the_generic_format(smol):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    greq, _plan = prepared(smol, tools=TOOLS, messages=[
        {"role": "user", "content": "Time?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}])
    assert greq.messages[2] == {"role": "assistant",
                                "content": '{"tool_call": {"name": "get_time", "arguments": {"zone": "UTC"}}}'}
    assert json.loads(greq.messages[3]["content"]) == {
        "tool_response": {"tool": "get_time", "tool_call_id": "call_1", "content": "12:00"}}
    assert greq.messages[3]["role"] == "user"


def test_native_template_gets_the_tools_and_a_grammar(tmp_path_factory, small_tokenizer_fields):
    path = _with_template(tmp_path_factory, small_tokenizer_fields, "hermes-tools", HERMES)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    with Model(path) as model:
        greq, plan = prepared(model, tools=TOOLS, tool_choice="required", messages=[
            {"role": "user", "content": "Time?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}])
        assert plan.native and plan.hermes
        assert [t["function"]["name"] for t in greq.tools] == ["get_weather", "get_time", "book_table"]
        assert greq.messages[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
        assert greq.messages[2]["name"] == "get_time"
        assert greq.sampling.constraint.kind == "grammar"
        _greq, auto = prepared(model, tools=TOOLS)
        assert _greq.sampling.constraint is None and auto.native


def _result(text: str, finish: str = "stop") -> GenerationResult:
    return GenerationResult(request_id=1, session_id=1, text=text, tokens=[1], finish_reason=finish,
                            prompt_tokens=1, ttft_ms=0, decode_tokens_per_s=0, elapsed_ms=0)


def test_parsing_replies():
    generic = tools.ToolPlan(tools.parse_tools(TOOLS), "auto", False, native=False)
    msg, finish = tools.message(generic, _result('{"tool_call": {"name": "get_time", "arguments": {"zone": "é"}}}'))
    assert finish == "tool_calls" and msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "é"}'}
    msg, finish = tools.message(generic, _result('{"response": "Hello!"}'))
    assert (msg, finish) == ({"role": "assistant", "content": "Hello!", "refusal": None}, "stop")
    msg, finish = tools.message(generic, _result('{"tool_call": {"name": "get_ti', "length"))
    assert msg["content"] == '{"tool_call": {"name": "get_ti' and finish == "length" and "tool_calls" not in msg
    hermes = tools.ToolPlan(tools.parse_tools(TOOLS), "auto", True, native=True, hermes=True)
    text = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>')
    msg, finish = tools.message(hermes, _result(text))
    assert finish == "tool_calls" and msg["content"] == "Let me check."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time", "get_weather"]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    msg, _ = tools.message(hermes, _result("<tool_call>\n{\"name\": \"unknown\", \"arguments\": {}}\n</tool_call>"))
    assert "tool_calls" not in msg  # not one of the tools offered: left as text


def test_stream_deltas_assemble_like_the_official_client():
    from openai.lib.streaming.chat import ChatCompletionStreamState

    msg = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "Europe/Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Rome", "unit": "celsius"}'}}]}
    state = ChatCompletionStreamState()
    chunks = [{"role": "assistant", "content": ""}, *tools.deltas(msg)]
    for i, delta in enumerate(chunks + [{}]):
        state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL_ID,
            "choices": [{"index": 0, "delta": delta, "finish_reason": "tool_calls" if i == len(chunks) else None}]}))
    got = state.get_final_completion().choices[0]
    assert got.finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in got.message.tool_calls] == \
        [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
    assert sum(1 for d in chunks if "tool_calls" in d) > 4  # the arguments came in pieces


def _assembled(deltas: list[dict], finish: str):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    chunks = [{"role": "assistant", "content": ""}, *deltas, {}]
    for i, delta in enumerate(chunks):
        state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL_ID,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish if i == len(chunks) - 1 else None}]}))
    return state.get_final_completion().choices[0]


@pytest.mark.parametrize("text", [
    '{"response": "Hello there!"}',
    '{"response": "a \\"quoted\\" word,\\nnew line, \\u00e9t\\u00e9 \\ud83d\\ude00 and \\\\ back"}',
    '{"tool_call": {"name": "get_time", "arguments": {"zone": "Europe/Paris"}}}',
    '{"tool_call": {"name": "book_table", "arguments": {"restaurant": "Chez \\"M\\" {x}", "people": 4, '
    '"vegetarian": true}}}',
    '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": '
    '{"city": "Rome", "unit": "celsius"}}]}',
])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_generic_reply_streams_as_it_is_written(text, step):
    plan = tools.ToolPlan(tools.parse_tools(TOOLS), "auto", True, native=False)
    stream = tools.ReplyStream(plan)
    sent = []
    for at in range(0, len(text), step):
        sent += stream.feed(text[at:at + step])
    before_end = len(sent)
    rest, finish = stream.finish(_result(text))
    whole, whole_finish = tools.message(plan, _result(text))
    got = _assembled(sent + rest, finish)
    assert finish == whole_finish
    assert (got.message.content or None) == whole["content"]
    calls = whole.get("tool_calls", [])
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls or ()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    for c in calls:
        json.loads(c["function"]["arguments"])
    assert before_end >= (3 if calls else 2)  # most of it went out while the model was writing
    assert not rest or len(rest) <= 1


def test_a_native_reply_is_sent_once_complete():
    plan = tools.ToolPlan(tools.parse_tools(TOOLS), "auto", False, native=True, hermes=True)
    stream = tools.ReplyStream(plan)
    text = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert stream.feed(text) == []
    rest, finish = stream.finish(_result(text))
    got = _assembled(rest, finish)
    assert finish == "tool_calls" and got.message.content == "Sure."
    assert got.message.tool_calls[0].function.arguments == '{"zone": "UTC"}'


# ---------------------------------------------------------------- the real pipeline
@pytest.fixture(scope="module")
def api(default_model_path, tmp_path_factory):
    with serving(default_model_path, tmp_path_factory.mktemp("tools"), ctx=2048) as a:
        yield a


PROMPTS = [
    ("What's the weather like in Paris right now?", "required"),
    ("Is it cold in Reykjavik today? Answer in fahrenheit.", "required"),
    ("What time is it in Tokyo?", {"type": "function", "function": {"name": "get_time"}}),
    ("Book a table for four at Chez Marcel, we're vegetarian.",
     {"type": "function", "function": {"name": "book_table"}}),
]


def _check_calls(choice, allowed: set[str]) -> None:
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
@pytest.mark.parametrize("prompt, choice", PROMPTS)
async def test_required_and_named_calls_validate(api, prompt, choice):
    got = await run(api.client.chat.completions.create, model=MODEL_ID, tools=TOOLS, tool_choice=choice,
                    messages=[{"role": "user", "content": prompt}], max_tokens=120, temperature=0.7, seed=7)
    allowed = {choice["function"]["name"]} if isinstance(choice, dict) else set(SCHEMAS)
    _check_calls(got.choices[0], allowed)


@pytest.mark.slow
async def test_round_trip_call_result_answer(api):
    messages = [{"role": "user", "content": "What's the weather in Paris? Use celsius."}]
    first = await run(api.client.chat.completions.create, model=MODEL_ID, tools=[WEATHER], tool_choice="required",
                      messages=messages, max_tokens=120, temperature=0)
    _check_calls(first.choices[0], {"get_weather"})
    (call,) = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    final = await run(api.client.chat.completions.create, model=MODEL_ID, tools=[WEATHER], tool_choice="none",
                      messages=messages, max_tokens=60, temperature=0)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert answer.message.content.strip()

    # auto: a call or a reply, whichever the model writes, always well formed
    auto = await run(api.client.chat.completions.create, model=MODEL_ID, tools=[WEATHER], messages=messages,
                     max_tokens=120, temperature=0)
    choice = auto.choices[0]
    if choice.message.tool_calls:
        _check_calls(choice, {"get_weather"})
    else:
        assert choice.finish_reason == "stop" and choice.message.content


@pytest.mark.slow
async def test_streamed_round_trip(api):
    messages = [{"role": "user", "content": "What time is it in Lisbon?"}]

    def stream_call():
        with api.client.chat.completions.stream(model=MODEL_ID, tools=[TIME, WEATHER], messages=messages,
                                                tool_choice={"type": "function", "function": {"name": "get_time"}},
                                                max_tokens=80, temperature=0) as s:
            return s.get_final_completion()

    def raw_chunks(**kw):
        return list(api.client.chat.completions.create(model=MODEL_ID, messages=messages, stream=True, **kw))

    done = await run(stream_call)
    _check_calls(done.choices[0], {"get_time"})
    whole = await run(api.client.chat.completions.create, model=MODEL_ID, tools=[TIME, WEATHER], messages=messages,
                      tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=80,
                      temperature=0)
    assert done.choices[0].message.tool_calls[0].function.arguments == \
        whole.choices[0].message.tool_calls[0].function.arguments
    chunks = await run(raw_chunks, tools=[TIME], tool_choice="required", max_tokens=80, temperature=0)
    first = next(c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_time" and first.function.arguments == ""
    pieces = [c.choices[0].delta.tool_calls[0].function.arguments for c in chunks
              if c.choices and c.choices[0].delta.tool_calls and c.choices[0].delta.tool_calls[0].id is None]
    assert len(pieces) >= 2 and json.loads("".join(pieces))  # the arguments as the model wrote them, in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]

    call = done.choices[0].message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "09:41"}]
    answer = await run(raw_chunks, tools=[TIME], tool_choice="none", max_tokens=40, temperature=0)
    text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    assert text.strip()
    assert [c.choices[0].finish_reason for c in answer if c.choices[0].finish_reason][0] in ("stop", "length")


@pytest.mark.slow
async def test_bad_tools_are_400s_before_any_generation(api):
    await run(api.client.chat.completions.create, model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
              max_tokens=2)  # so that the generation counters exist
    before = api.metrics()
    assert any(k[0] == "skippy_generations_total" for k in before)
    bad = [dict(tools=[{"type": "function", "function": {"name": "no spaces"}}]),
           dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]),
           dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}})]
    for body in bad:
        with pytest.raises(openai.BadRequestError) as info:
            await run(api.client.chat.completions.create, model=MODEL_ID,
                      messages=[{"role": "user", "content": "hi"}], max_tokens=4, **body)
        assert info.value.body["param"].startswith(("tools[0].function.", "tool_choice.function.name"))
    after = api.metrics()
    generations = [k for k in after if k[0] == "skippy_generations_total"]
    assert all(after[k] == before.get(k, 0) for k in generations)


def test_request_type_unchanged_for_plain_chats(smol):
    greq, plan = prepared(smol)
    assert plan is None and isinstance(greq, GenerationRequest) and greq.tools == ()
    assert greq.messages == ({"role": "user", "content": "hi"},)


@pytest.mark.slow
def test_native_template_forced_call_through_a_daemon(tmp_path_factory, small_tokenizer_fields):
    """A (tiny, random) model whose template knows tools: the tools go to its template, the forced call is
    constrained to <tool_call>{json}</tool_call> on the stage that samples and parsed back into tool_calls."""
    from tests.procs import SingleStage

    path = _with_template(tmp_path_factory, small_tokenizer_fields, "hermes-daemon", HERMES)
    port = free_ports(1)[0]
    unit = {"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}}}
    pipe = SingleStage(path, tmp_path_factory.mktemp("hermes-daemon-run"),
                       extra=["--openai", f"127.0.0.1:{port}", "--ctx", "1024"])
    try:
        a = Api(pipe, port)
        wait_healthy(a)
        for choice in ("required", {"type": "function", "function": {"name": "set_unit"}}):
            got = a.client.chat.completions.create(model=path.stem, tools=[unit], tool_choice=choice, max_tokens=64,
                                                   messages=[{"role": "user", "content": "Use celsius."}],
                                                   temperature=0)
            (call,) = got.choices[0].message.tool_calls
            assert got.choices[0].finish_reason == "tool_calls" and call.function.name == "set_unit"
            jsonschema.validate(json.loads(call.function.arguments), unit["function"]["parameters"])
    finally:
        codes = pipe.stop()
    assert all(c == 0 for c in codes.values()), codes
