"""The API key (``--api-key-file``) and the access rules of the OpenAI listener: /v1/* needs the key, /health
never does, /metrics follows ``[openai] public_metrics``; the console's views need the key when one is set, its
actions always, and with no key are refused unless the listener is loopback. On the app with a fake engine, then
against real daemons with the official ``openai`` client."""

from __future__ import annotations

import json
import logging
import stat

import openai
import pytest

from skippyd.config import ConfigError, load
from skippyd.openai.auth import Access, ApiKey, KeyFileError, Need, Refused
from skippyd.openai.console import ConsoleRoutes
from tests.openai_api import httpx2, wait_for_health
from tests.procs import Pipeline, SingleStage, free_ports, split_for_test, write_config
from tests.test_openai import Asgi, fake_app

KEY = "s3cret-key-for-tests"
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"


def bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


async def call(app, method: str, path: str, body=b"", headers=()) -> Asgi:
    req = Asgi(app, method, path, body)
    req.scope["headers"] = [(b"host", b"127.0.0.1:8080"), *headers]
    await req.run()
    return req


def keyed_app(access: Access):
    async def behave(sink):
        return "ok", [7], "stop"

    app, _ = fake_app(behave, access=access)
    app.node.head.model = None  # (no model to describe on the pipeline page)
    app.mount(ConsoleRoutes(app.node, access).routes())
    return app


# ---------------------------------------------------------------- the rules
def test_the_key_is_compared_whole_and_never_shown(tmp_path):
    key = ApiKey(KEY)
    assert key.matches(f"Bearer {KEY}") and key.matches(f"bearer {KEY} ")
    for wrong in (None, "", KEY, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Basic abc", "Bearer "):
        assert not key.matches(wrong), wrong
    assert KEY not in repr(key) and KEY not in str(vars(key))


def test_the_key_file_is_checked(tmp_path, caplog):
    path = tmp_path / "key"
    with pytest.raises(KeyFileError, match="No such file"):
        ApiKey.load(path)
    path.write_text("short\n")
    with pytest.raises(KeyFileError, match="at least 8"):
        ApiKey.load(path)
    path.write_text(f"  {KEY}\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert ApiKey.load(path).matches(f"Bearer {KEY}")
    assert "readable by others" in caplog.text and KEY not in caplog.text
    path.chmod(stat.S_IRUSR | stat.S_IWUSR)


def test_each_need_on_each_kind_of_listener():
    key = ApiKey(KEY)
    good, bad = f"Bearer {KEY}", "Bearer nope"
    keyed = Access(key, loopback=False)
    for need in (Need.API, Need.METRICS, Need.READ, Need.ACTION):
        keyed.check(need, good)
        with pytest.raises(Refused) as caught:
            keyed.check(need, bad)
        assert caught.value.status == 401 and caught.value.code == "invalid_api_key"
    keyed.check(Need.OPEN, None)
    Access(key, public_metrics=True).check(Need.METRICS, None)
    # no key: everything open, but actions only on loopback
    for loopback in (True, False):
        open_ = Access(None, loopback=loopback)
        for need in (Need.OPEN, Need.API, Need.METRICS, Need.READ):
            open_.check(need, None)
    Access(None, loopback=True).check(Need.ACTION, None)
    with pytest.raises(Refused) as caught:
        Access(None, loopback=False).check(Need.ACTION, None)
    assert caught.value.status == 403
    assert Access(None, loopback=False).exposed and not Access(key, loopback=False).exposed


async def test_the_app_answers_401_in_openais_shape():
    app = keyed_app(Access(ApiKey(KEY)))
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    refused = await call(app, "POST", "/v1/chat/completions", chat)
    assert refused.status == 401 and refused.headers["www-authenticate"] == "Bearer"
    error = json.loads(refused.data)["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert KEY not in error["message"]
    assert (await call(app, "POST", "/v1/chat/completions", chat, bearer(KEY))).status == 200
    assert (await call(app, "GET", "/v1/models", headers=bearer("wrong"))).status == 401
    assert (await call(app, "GET", "/v1/nothing-here")).status == 401  # a /v1 path says nothing without the key
    assert (await call(app, "GET", "/health")).status == 200
    assert (await call(app, "GET", "/metrics")).status == 401
    assert (await call(app, "GET", "/metrics", headers=bearer(KEY))).status == 200
    assert (await call(keyed_app(Access(ApiKey(KEY), public_metrics=True)), "GET", "/metrics")).status == 200
    # the console: its page is open, its views and actions need the key
    assert (await call(app, "GET", "/")).status == 200
    assert (await call(app, "GET", "/console/console.js")).status == 200
    assert (await call(app, "GET", "/console/api/state")).status == 401
    assert (await call(app, "GET", "/console/api/history", headers=bearer(KEY))).status == 200
    json_body = [(b"content-type", b"application/json")]
    assert (await call(app, "POST", "/console/api/lanes/drain", b"{}", json_body)).status == 401
    assert (await call(app, "POST", "/console/api/lanes/drain", b"{}", [*json_body, *bearer(KEY)])).status == 200
    access = json.loads((await call(app, "GET", "/console/api/access")).data)
    assert access == {"key_required": True, "loopback": True, "actions": "key"}


async def test_console_actions_without_a_key():
    exposed = keyed_app(Access(None, loopback=False))
    json_body = [(b"content-type", b"application/json")]
    refused = await call(exposed, "POST", "/console/api/lanes/drain", b"{}", json_body)
    assert refused.status == 403 and json.loads(refused.data)["error"]["code"] == "forbidden"
    assert (await call(exposed, "GET", "/console/api/history")).status == 200  # the views are open, as /v1 is
    local = keyed_app(Access(None, loopback=True))
    assert (await call(local, "POST", "/console/api/lanes/drain", b"{}", json_body)).status == 200
    # not as JSON: a page of another origin could send it without asking first
    assert (await call(local, "POST", "/console/api/lanes/drain", b"{}")).status == 415
    # a host name that is not loopback (a DNS name rebound to 127.0.0.1): refused
    rebound = Asgi(local, "POST", "/console/api/lanes/drain", b"{}")
    rebound.scope["headers"] = [(b"host", b"evil.example:8080"), *json_body]
    await rebound.run()
    assert rebound.status == 403


def test_config_keys(tmp_path):
    path = write_config(tmp_path / "skippyd.toml", {"openai.api_key_file": "key", "openai.public_metrics": True})
    config = load(path)
    assert config.openai.api_key_file == tmp_path / "key" and config.openai.public_metrics is True
    (tmp_path / "bad.toml").write_text("[openai]\npublic_metrics = 'yes'\n")
    with pytest.raises(ConfigError, match="public_metrics"):
        load(tmp_path / "bad.toml")


# ---------------------------------------------------------------- real daemons
@pytest.mark.slow
def test_a_keyed_pipeline_with_the_official_client(default_model_path, tmp_path):
    work = tmp_path / "keyed"
    split_for_test(default_model_path, 2, work)
    key_file = tmp_path / "api.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    port = free_ports(1)[0]
    pipe = Pipeline(work / "topology.toml", work,
                    extra=["--openai", f"127.0.0.1:{port}", "--api-key-file", str(key_file), "--ctx", "256"]).start()
    try:
        base = f"http://127.0.0.1:{port}"
        with httpx2.Client(base_url=base, timeout=30) as h:
            assert h.get("/health").status_code == 200
            assert h.get("/metrics").status_code == 401
            assert h.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        good = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
        reply = good.chat.completions.create(model=MODEL_ID, max_tokens=4, temperature=0,
                                             messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].message.content
        assert [m.id for m in good.models.list().data] == [MODEL_ID]
        for wrong in ("", "not-the-key"):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=wrong or "x", max_retries=0, timeout=60)
            with pytest.raises(openai.AuthenticationError) as caught:
                client.chat.completions.create(model=MODEL_ID, max_tokens=4,
                                               messages=[{"role": "user", "content": "Hi"}])
            assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
        status = pipe.head.status()
        listener = next(x for x in status["listeners"] if x["what"] == "openai")
        assert listener["api_key"] is True and status["warnings"] == []
        assert KEY not in json.dumps(status) and KEY not in pipe.head.log()
    finally:
        codes = pipe.stop()
    assert all(c == 0 for c in codes.values()), codes


@pytest.mark.slow
def test_an_exposed_listener_warns_and_refuses_console_actions(default_model_path, tmp_path):
    port = free_ports(1)[0]
    daemon = SingleStage(default_model_path, tmp_path, ["--openai", f"0.0.0.0:{port}", "--ctx", "256"])
    try:
        head = daemon.stages[0]
        base = f"http://127.0.0.1:{port}"
        with httpx2.Client(base_url=base, timeout=30) as h:
            wait_for_health(h)
            refused = h.post("/console/api/lanes/drain", json={})
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
            assert h.get("/console/api/access").json()["actions"] == "refused"
            state = h.get("/console/api/state").json()
            assert any("--api-key-file" in w for w in state["warnings"])
        status = head.status()
        assert any("no API key" in w for w in status["warnings"]), status["warnings"]
        assert "reachable from other hosts and has no API key" in head.log()
    finally:
        assert daemon.stop() == {0: 0}
