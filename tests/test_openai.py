"""The OpenAI-compatible API: the official `openai` client against a real 2-stage pipeline, plus the app's
edge cases (disconnects, lazy stream start, queue timeout) on an in-process fake engine.

The pipeline's stages are real skippyd processes started with `--openai` (stage 1 has no head and ignores
it); the client is sync, so the trio tests run its calls in a thread.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from skippyctl.client import open_control
from skippyd.control import messages as m
from skippyd.head.admission import AdmissionGate
from skippyd.head.engine import GenerationError, GenerationResult
from skippyd.head.sink import DISCARD
from skippyd.openai.app import OpenAIApp
from skippyd.runtime.llama import Model
from tests.fake_node import FakeNode
from tests.openai_api import httpx2, run, serving
from tests.procs import Pipeline

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"  # the topology's model_name: the source file without .gguf
CTX = 512
HELLO = [{"role": "system", "content": "You are a terse assistant."},
         {"role": "user", "content": "Name three colours."}]
STORY = "Once upon a time, in a small village by the sea,"


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def api(default_model_path, tmp_path_factory):
    with serving(default_model_path, tmp_path_factory.mktemp("openai2"), ctx=CTX) as a:
        yield a


@pytest.fixture(scope="module")
def vocab(default_model_path):
    model = Model(default_model_path)
    yield model
    model.close()


async def control(pipe: Pipeline, msg_type, **kw):
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        return await client.call(msg_type(id=client.new_id(), **kw))


# ---------------------------------------------------------------- the real pipeline
@pytest.mark.slow
async def test_models(api):
    models = await run(api.client.models.list)
    assert [m_.id for m_ in models.data] == [MODEL_ID]
    assert (await run(api.client.models.retrieve, MODEL_ID)).id == MODEL_ID
    with pytest.raises(openai.NotFoundError):
        await run(api.client.models.retrieve, "gpt-4o")
    log = api.pipe.head.log()  # where the API is, once, without hypercorn's "(CTRL + C to quit)" banner
    assert f"OpenAI API on {api.base}/v1" in log and "CTRL + C" not in log, log


@pytest.mark.slow
async def test_chat_matches_control_channel_and_counts_tokens(api, vocab):
    got = await run(api.client.chat.completions.create, model=MODEL_ID, messages=HELLO, max_tokens=12,
                    temperature=0)
    ref = await api.pipe.generate(messages=HELLO, max_tokens=12)  # skippyctl generate: greedy by default
    choice = got.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref["text"]
    assert choice.finish_reason == ref["finish_reason"]
    prompt = vocab.tokenize(vocab.apply_chat_template(HELLO), add_special=False, parse_special=True)
    assert got.usage.prompt_tokens == len(prompt) == ref["usage"]["prompt_tokens"]
    assert got.usage.completion_tokens == len(ref["tokens"])
    assert got.usage.total_tokens == len(prompt) + len(ref["tokens"])
    assert got.model == MODEL_ID and got.object == "chat.completion" and got.id.startswith("chatcmpl-")


@pytest.mark.slow
async def test_streamed_chat_equals_whole_answer(api):
    whole = await run(api.client.chat.completions.create, model=MODEL_ID, messages=HELLO, max_tokens=10,
                      temperature=0)

    def stream():
        chunks = list(api.client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=10,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
        return chunks

    chunks = await run(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


@pytest.mark.slow
async def test_completion_raw_prompt_and_length(api, vocab):
    got = await run(api.client.completions.create, model=MODEL_ID, prompt="The capital of France is",
                    max_tokens=5, temperature=0)
    ref = await api.pipe.generate(prompt="The capital of France is", raw=True, max_tokens=5)
    assert got.choices[0].text == ref["text"]
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 5
    assert got.usage.prompt_tokens == len(vocab.tokenize("The capital of France is", add_special=True,
                                                         parse_special=False))

    def stream():
        return list(api.client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=5,
                                                  temperature=0, stream=True))

    chunks = await run(stream)
    assert "".join(c.choices[0].text for c in chunks) == ref["text"]
    assert chunks[-1].choices[0].finish_reason == "length"


ENDS_SOON = "Answer yes or no: is the sky blue?\n"  # greedy, raw: the default model ends it after 11 tokens


@pytest.mark.slow
async def test_ignore_eos_runs_a_reply_past_its_end_to_max_tokens(api):
    """llama-server's ignore_eos, through the official client's extra_body: the end of generation ends nothing,
    the reply goes on to max_tokens; without it the same prompt ends early. Both endpoints."""
    plain = await run(api.client.completions.create, model=MODEL_ID, prompt=ENDS_SOON, max_tokens=40, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 20, plain
    got = await run(api.client.completions.create, model=MODEL_ID, prompt=ENDS_SOON, max_tokens=40, temperature=0,
                    extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 40, got
    assert got.choices[0].text.startswith(plain.choices[0].text)
    off = await run(api.client.completions.create, model=MODEL_ID, prompt=ENDS_SOON, max_tokens=40, temperature=0,
                    extra_body={"ignore_eos": False})
    assert off.choices[0].text == plain.choices[0].text and off.choices[0].finish_reason == "stop"
    chat = await run(api.client.chat.completions.create, model=MODEL_ID, messages=HELLO, max_tokens=64,
                     temperature=0)
    assert chat.choices[0].finish_reason == "stop", chat  # a short answer, then the end of generation
    chat_on = await run(api.client.chat.completions.create, model=MODEL_ID, messages=HELLO, max_tokens=64,
                        temperature=0, extra_body={"ignore_eos": True})
    assert chat_on.choices[0].finish_reason == "length" and chat_on.usage.completion_tokens == 64, chat_on
    with pytest.raises(openai.BadRequestError) as info:
        await run(api.client.completions.create, model=MODEL_ID, prompt=ENDS_SOON, max_tokens=4,
                  extra_body={"ignore_eos": "yes"})
    assert "ignore_eos" in str(info.value)


@pytest.mark.slow
async def test_stop_sequences(api):
    base = await run(api.client.completions.create, model=MODEL_ID, prompt=STORY, max_tokens=24, temperature=0)
    text = base.choices[0].text
    words = text.split()
    assert len(words) > 4, text
    stop = " " + words[3]  # a stop string in the middle of the greedy answer
    cut = text.index(stop)
    for kind in ("string", "list"):
        got = await run(api.client.completions.create, model=MODEL_ID, prompt=STORY, max_tokens=24, temperature=0,
                        stop=stop if kind == "string" else ["\u2603 never", stop])
        assert got.choices[0].text == text[:cut]
        assert got.choices[0].finish_reason == "stop"

    def stream():
        return list(api.client.completions.create(model=MODEL_ID, prompt=STORY, max_tokens=24, temperature=0,
                                                  stop=[stop], stream=True))

    chunks = await run(stream)
    assert "".join(c.choices[0].text for c in chunks) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow
async def test_sampling_parameters_are_accepted(api):
    got = await run(api.client.chat.completions.create, model=MODEL_ID, messages=HELLO, max_completion_tokens=4,
                    temperature=0.7, top_p=0.9, seed=42, presence_penalty=0.5, frequency_penalty=0.5,
                    logit_bias={"28": -100}, n=1, user="test", logprobs=False)
    again = await run(api.client.chat.completions.create, model=MODEL_ID, messages=HELLO, max_completion_tokens=4,
                      temperature=0.7, top_p=0.9, seed=42, presence_penalty=0.5, frequency_penalty=0.5,
                      logit_bias={"28": -100})
    assert got.usage.completion_tokens <= 4
    assert got.choices[0].message.content == again.choices[0].message.content  # same seed, same answer


async def _error(fn, **kw) -> tuple[int, dict]:
    try:
        await run(fn, **kw)
    except openai.APIStatusError as exc:
        return exc.status_code, exc.response.json()
    raise AssertionError("the request succeeded")


def _assert_error_shape(body: dict) -> dict:
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.mark.slow
async def test_bad_requests_get_openai_errors_and_harm_nothing(api):
    chat = api.client.chat.completions.create
    ok = dict(model=MODEL_ID, messages=HELLO, max_tokens=3, temperature=0)
    cases = [
        (dict(ok, model="gpt-4o"), 404, "model", "model_not_found"),
        (dict(ok, max_tokens=-1), 400, "max_tokens", None),
        (dict(ok, max_tokens=0), 400, "max_tokens", None),
        (dict(ok, temperature="hot"), 400, "temperature", "invalid_type"),
        (dict(ok, messages="hello"), 400, "messages", "invalid_type"),
        (dict(ok, messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role", None),
        (dict(ok, messages=[]), 400, "messages", None),
        (dict(ok, n=2), 400, "n", None),
        (dict(ok, logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
        (dict(ok, logit_bias={"not-a-token": 1}), 400, "logit_bias", None),
        (dict(ok, logit_bias={"99999999": 1}), 400, "logit_bias", None),
        (dict(ok, temperature=3.5), 400, "temperature", None),
        (dict(ok, extra_body={"frobnicate": True}), 400, "frobnicate", "unrecognized_argument"),
        (dict(ok, messages=[{"role": "user", "content": "hello " * CTX}]), 400, "messages",
         "context_length_exceeded"),
    ]
    for kw, status, param, code in cases:
        got_status, body = await _error(chat, **kw)
        err = _assert_error_shape(body)
        assert got_status == status, (kw, body)
        assert err["param"] == param, (kw, body)
        assert err["type"] == "invalid_request_error"
        if code is not None:
            assert err["code"] == code, (kw, body)
    status, body = await _error(api.client.completions.create, model=MODEL_ID, prompt=["a", "b"], max_tokens=2)
    assert status == 400 and _assert_error_shape(body)["param"] == "prompt"

    def raw_posts():
        with api.http() as h:
            out = [h.post("/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={
                "content-type": "application/json"})]
            out.append(h.post("/v1/completions", content=b"[1, 2]"))
            out.append(h.post("/v1/chat/completions", content=b'{"model": NaN}'))
            out.append(h.get("/v1/chat/completions"))
            out.append(h.get("/v2/nothing"))
            return [(r.status_code, r.json()) for r in out]

    answers = await run(raw_posts)
    assert [s for s, _ in answers] == [400, 400, 400, 405, 404]
    for _, body in answers:
        _assert_error_shape(body)
    assert answers[0][1]["error"]["code"] == "invalid_json"
    # the pipeline is unharmed: every session was released and a good request still works
    await api.pipe.wait_all_released(timeout=2)
    good = await run(chat, **ok)
    assert good.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
async def test_bad_requests_during_a_stream_do_not_disturb_it(api):
    kw = dict(model=MODEL_ID, prompt=STORY, max_tokens=12, temperature=0)
    whole = await run(api.client.completions.create, **kw)

    def stream_with_noise():
        texts = []
        with api.client.completions.create(stream=True, **kw) as stream:
            for i, chunk in enumerate(stream):
                texts.append(chunk.choices[0].text)
                if i == 1:
                    with api.http() as h:
                        assert h.post("/v1/completions", content=b"{oops").status_code == 400
                        assert h.post("/v1/completions", json={"model": "zzz", "prompt": "x"}).status_code == 404
        return "".join(texts)

    assert await run(stream_with_noise) == whole.choices[0].text


@pytest.mark.slow
async def test_closing_a_stream_frees_the_session_everywhere(api):
    before = api.metrics()

    def read_a_few_chunks():
        stream = api.client.completions.create(model=MODEL_ID, prompt=STORY, max_tokens=400, temperature=0,
                                               stream=True)
        got = []
        for chunk in stream:
            got.append(chunk.choices[0].text)
            if len(got) == 3:
                break
        stream.close()  # the client hangs up mid-answer
        return got

    got = await run(read_a_few_chunks)
    assert len(got) == 3
    await api.pipe.wait_all_released(timeout=2)
    receipts = await control(api.pipe, m.Receipts, limit=1)
    assert receipts[-1]["termination"] == "cancelled"
    assert 3 <= len(receipts[-1]["tokens"]) < 400
    after = api.metrics()
    key = ("skippy_http_requests_total", (("endpoint", "/v1/completions"), ("status", "499")))
    assert after.get(key, 0) == before.get(key, 0) + 1


@pytest.mark.slow
async def test_aborting_a_plain_request_frees_the_session(api):
    def abort_after(seconds: float):
        with httpx2.Client(base_url=api.base, timeout=seconds) as h:
            with pytest.raises(httpx2.ReadTimeout):
                h.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": HELLO, "max_tokens": 400,
                                                     "temperature": 0, "logit_bias": {"0": -100, "2": -100}})

    await run(abort_after, 1.0)  # the answer takes longer than that: the client gives up and closes
    await api.pipe.wait_all_released(timeout=2)
    receipts = await control(api.pipe, m.Receipts, limit=1)
    assert receipts[-1]["termination"] == "cancelled"


@pytest.mark.slow
async def test_draining_answers_503_and_health_follows(api):
    await control(api.pipe, m.LanesDrain)
    try:
        def during():
            with api.http() as h:
                health = h.get("/health")
                chat = h.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": HELLO, "max_tokens": 2})
                return health.status_code, health.json(), chat.status_code, chat.headers, chat.json()

        hs, hbody, cs, headers, body = await run(during)
        assert (hs, hbody["status"]) == (503, "draining")
        assert cs == 503 and headers.get("retry-after")
        assert _assert_error_shape(body)["type"] == "server_error"
        status, _ = await _error(api.client.chat.completions.create, model=MODEL_ID, messages=HELLO, max_tokens=2)
        assert status == 503
    finally:
        await control(api.pipe, m.LanesUndrain)
    with api.http() as h:
        assert h.get("/health").status_code == 200
    got = await run(api.client.chat.completions.create, model=MODEL_ID, messages=HELLO, max_tokens=2,
                    temperature=0)
    assert got.usage.completion_tokens <= 2


@pytest.mark.slow
async def test_metrics_parse_and_move_with_traffic(api):
    before = api.metrics()
    await run(api.client.chat.completions.create, model=MODEL_ID, messages=HELLO, max_tokens=4, temperature=0)
    await _error(api.client.chat.completions.create, model="nope", messages=HELLO)
    after = api.metrics()

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("skippy_http_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert delta("skippy_http_requests_total", endpoint="/v1/chat/completions", status="404") == 1
    assert delta("skippy_generations_total", source="http", finish_reason="length") + \
        delta("skippy_generations_total", source="http", finish_reason="stop") == 1
    assert 1 <= delta("skippy_completion_tokens_total", source="http") <= 4
    assert delta("skippy_prompt_tokens_total", source="http") > 10
    assert delta("skippy_time_to_first_token_seconds_count", source="http") == 1
    assert delta("skippy_stage_compute_milliseconds_count") == 1
    assert delta("skippy_head_tokens_total", kind="completion") >= 1
    assert after[("skippy_lanes", (("state", "busy"),))] == 0
    assert after[("skippy_stage_sessions", (("stage", "0"),))] == 0
    assert after[("skippy_queue_depth", ())] == 0
    assert after[("skippy_draining", ())] == 0


# ---------------------------------------------------------------- the app on a fake engine
class FakeEngine:
    """Enough of HeadEngine for the app: `behave(sink)` plays the generation."""

    def __init__(self, behave, *, slots: int = 2, queue_timeout: float = 30.0):
        self.model = SimpleNamespace(n_vocab=1000)
        self.context = SimpleNamespace(n_ctx_seq=64)
        self.sessions = SimpleNamespace(n_seq_max=slots)
        self.gate = AdmissionGate(slots, queue_timeout)  # the engine's own admission
        self.live = {}
        self.behave = behave
        self.cancelled = 0
        self.requests = []
        self.cached_tokens = 0  # the prompt tokens no stage computed
        self.prefix_cache = []  # per stage, the prompt tokens it held rather than computed
        # what the console's history reads of an engine, as HeadEngine keeps it
        self.totals = {"generations": 0, "prompt_tokens": 0, "completion_tokens": 0, "errors": 0}
        self.receipts = []

    def prompt_tokens(self, req):
        return np.arange(1, 6, dtype=np.int32)

    async def tokenize_prompt(self, req):
        return self.prompt_tokens(req)

    def begin_drain(self) -> None:
        self.gate.close("the daemon is draining: no new generations")

    async def generate(self, req, sink=DISCARD):
        self.requests.append(req)
        await self.gate.enter()
        try:
            text, tokens, finish = await self.behave(sink)
        except trio.Cancelled:
            self.cancelled += 1
            raise
        finally:
            self.gate.leave()
        return GenerationResult(request_id=1, session_id=2, text=text, tokens=tokens, finish_reason=finish,
                                prompt_tokens=5, ttft_ms=1.0, decode_tokens_per_s=100.0, elapsed_ms=2.0,
                                cached_tokens=self.cached_tokens, prefix_cache=self.prefix_cache)


def fake_app(behave, **kw) -> tuple[OpenAIApp, FakeEngine]:
    engine = FakeEngine(behave, slots=kw.pop("slots", 2), queue_timeout=kw.pop("queue_timeout_s", 30.0))
    head = SimpleNamespace(engine=engine, pool=None, model_name="fake-model", vision=None)
    return OpenAIApp(FakeNode(head=head), **kw), engine


class Asgi:
    """One request driven straight through the ASGI interface."""

    def __init__(self, app, method: str, path: str, body: dict | bytes = b""):
        self.app = app
        self.scope = {"type": "http", "method": method, "path": path, "headers": []}
        self.body = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.sent: list[dict] = []
        self._in, self._out = trio.open_memory_channel(4)
        self.progress = trio.Event()

    async def _send(self, msg):
        self.sent.append(msg)
        self.progress.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        await self._in.send({"type": "http.request", "body": self.body, "more_body": False})
        task_status.started()
        await self.app(self.scope, self._out.receive, self._send)

    async def disconnect(self):
        await self._in.send({"type": "http.disconnect"})

    @property
    def status(self) -> int | None:
        return next((s["status"] for s in self.sent if s["type"] == "http.response.start"), None)

    @property
    def headers(self) -> dict:
        start = next(s for s in self.sent if s["type"] == "http.response.start")
        return {k.decode(): v.decode() for k, v in start["headers"]}

    @property
    def data(self) -> bytes:
        return b"".join(s.get("body", b"") for s in self.sent if s["type"] == "http.response.body")

    def events(self) -> list:
        return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                for line in self.data.decode().split("\n\n") if line]


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def test_fake_disconnect_cancels_a_streaming_generation():
    async def behave(sink):
        sink.piece("one")
        await trio.sleep_forever()

    app, engine = fake_app(behave)
    call = Asgi(app, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
    async with trio.open_nursery() as nursery:
        await nursery.start(call.run)
        while "one" not in call.data.decode():
            await call.progress.wait()
            call.progress = trio.Event()
        await call.disconnect()
    assert engine.cancelled == 1
    assert not any(s.get("more_body") is False for s in call.sent if s["type"] == "http.response.body")
    samples = {(s.name, s.labels.get("status")): s.value
               for f in text_string_to_metric_families(app.metrics.render().decode()) for s in f.samples}
    assert samples[("skippy_http_requests_total", "499")] == 1


async def test_fake_disconnect_cancels_a_plain_generation(autojump_clock, caplog):
    async def behave(sink):
        await trio.sleep_forever()

    app, engine = fake_app(behave)
    call = Asgi(app, "POST", "/v1/completions", {"model": "fake-model", "prompt": "x"})
    async with trio.open_nursery() as nursery:
        await nursery.start(call.run)
        await trio.sleep(5)
        await call.disconnect()
    assert engine.cancelled == 1 and call.status is None
    # a client gone is an answer of its own (499), not an internal error
    samples = {(s.name, s.labels.get("status")): s.value
               for f in text_string_to_metric_families(app.metrics.render().decode()) for s in f.samples}
    assert samples[("skippy_http_requests_total", "499")] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_fake_failure_before_the_first_piece_is_a_real_status():
    async def behave(sink):
        raise GenerationError("stage 1 is unreachable", retryable=True, status=503)

    app, _ = fake_app(behave)
    call = Asgi(app, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
    await call.run()
    assert call.status == 503 and call.headers["retry-after"] == "1"
    assert json.loads(call.data)["error"]["type"] == "server_error"


async def test_fake_failure_mid_stream_is_an_error_event():
    async def behave(sink):
        sink.piece("partial")
        raise GenerationError("pipeline failed: stage 1 went away", retryable=True, status=502)

    app, _ = fake_app(behave)
    call = Asgi(app, "POST", "/v1/completions", {"model": "fake-model", "prompt": "x", "stream": True})
    await call.run()
    events = call.events()
    assert call.status == 200 and events[0]["choices"][0]["text"] == "partial"
    assert events[-1]["error"]["message"].startswith("pipeline failed")


async def test_fake_queue_timeout_is_503(autojump_clock):
    async def behave(sink):
        await trio.sleep(100)
        return "done", [1], "length"

    app, _ = fake_app(behave, slots=1, queue_timeout_s=3.0)
    first = Asgi(app, "POST", "/v1/completions", {"model": "fake-model", "prompt": "x"})
    second = Asgi(app, "POST", "/v1/completions", {"model": "fake-model", "prompt": "y"})
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        await trio.sleep(1)
        await second.run()
        assert second.status == 503 and json.loads(second.data)["error"]["code"] == "no_lane"
    assert first.status == 200 and json.loads(first.data)["choices"][0]["text"] == "done"


async def test_fake_defaults_follow_openai():
    async def behave(sink):
        return "ok", [7], "stop"

    app, engine = fake_app(behave)
    chat = Asgi(app, "POST", "/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user",
                                                                                           "content": "hi"}]})
    await chat.run()
    comp = Asgi(app, "POST", "/v1/completions/", {"model": "fake-model", "prompt": "x"})
    await comp.run()
    chat_req, comp_req = engine.requests
    assert chat_req.max_tokens == 64 and chat_req.sampling.temperature == 1.0 and chat_req.sampling.seed is not None
    assert comp_req.max_tokens == 16 and comp_req.raw
    assert chat_req.prompt_tokens == (1, 2, 3, 4, 5)  # tokenized once, by the app
    assert json.loads(chat.data)["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                                              "prompt_tokens_details": {"cached_tokens": 0}, "prefix_cache": []}


async def test_fake_usage_reports_the_cached_prompt_tokens():
    """usage.prompt_tokens_details.cached_tokens and the per-stage usage.prefix_cache, whole and in the streamed
    usage chunk, of both endpoints."""
    async def behave(sink):
        sink.piece("ok")
        return "ok", [7], "stop"

    app, engine = fake_app(behave)
    engine.cached_tokens = 4
    engine.prefix_cache = [{"stage": 0, "cached_tokens": 4}, {"stage": 1, "cached_tokens": 4}]
    want = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
            "prompt_tokens_details": {"cached_tokens": 4},
            "prefix_cache": [{"stage": 0, "cached_tokens": 4}, {"stage": 1, "cached_tokens": 4}]}
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": "fake-model", "prompt": "x"})):
        whole = Asgi(app, "POST", path, body)
        await whole.run()
        assert json.loads(whole.data)["usage"] == want, whole.data
        streamed = Asgi(app, "POST", path, {**body, "stream": True, "stream_options": {"include_usage": True}})
        await streamed.run()
        events = streamed.events()
        assert events[-1] == "[DONE]" and events[-2]["usage"] == want and events[-2]["choices"] == []
        assert all(e["usage"] is None for e in events[:-2]), events


def test_ignore_eos_in_the_body_reaches_the_generation():
    """llama-server's ignore_eos on both endpoints: strictly a boolean, off unless given."""
    from skippyd.openai import schemas

    for kind, body in ((schemas.ChatCompletionRequest, CHAT), (schemas.CompletionRequest,
                                                               {"model": "fake-model", "prompt": "x"})):
        assert not schemas.parse(json.dumps(body).encode(), kind).to_generation(1000, 64).ignore_eos
        for value in (True, False):
            got = schemas.parse(json.dumps({**body, "ignore_eos": value}).encode(), kind).to_generation(1000, 64)
            assert got.ignore_eos is value
        for bad in ("yes", 1):
            with pytest.raises(schemas.BadParameter) as info:
                schemas.parse(json.dumps({**body, "ignore_eos": bad}).encode(), kind)
            assert info.value.param == "ignore_eos"


async def test_fake_bodies_nothing_could_serve():
    async def behave(sink):
        raise AssertionError("no generation for a bad body")

    app, _ = fake_app(behave)
    # sampling parameters travel between stages as int32 / float32
    for param, value in (("top_k", 2**32), ("repeat_penalty", 1e-300), ("repeat_penalty", 1e300)):
        call = Asgi(app, "POST", "/v1/completions", {"model": "fake-model", "prompt": "x", param: value})
        await call.run()
        assert call.status == 400 and json.loads(call.data)["error"]["param"] == param, call.data
    deep = Asgi(app, "POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000)
    await deep.run()
    assert deep.status == 400 and json.loads(deep.data)["error"]["code"] == "invalid_json"
    big = Asgi(app, "POST", "/v1/completions", b" " * (app.body_limit + 1))
    await big.run()
    # the rest of the body is never read: the client must not reuse the connection
    assert big.status == 413 and big.headers["connection"] == "close"
