"""The prefix caches made visible and manageable: skippyctl cache show|clear, cached_tokens in generate --json
and in the OpenAI API's usage, /metrics and status; against real daemons of the default model, plus the
tables and the head's report on fakes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from skippyctl.app import app
from skippyd.control import messages as m
from skippyd.head.cache_admin import CacheReportError, cache_report
from skippyd.head.lanes import LanePool
from skippyd.stage.prefix_cache import PrefixCache
from skippyd.wire.messages import Hello
from tests.openai_api import httpx2, wait_for_health
from tests.procs import Daemon, Pipeline, SingleStage, free_ports, split_for_test

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
BUDGET = 512 << 20  # the default, runtime.prefix_cache_mb = 512
CACHE_ON = ["--prefix-cache-mb", "512"]  # (the tests' daemons may run without it unless told)
FIELDS = {"stage", "entries", "tokens", "bytes", "budget_bytes", "lookups", "hits", "hit_rate", "restored_tokens",
          "recorded_tokens", "evictions", "memory_hits", "disk"}
# long enough for a hit (the cache restores a common prefix of 16 tokens or more); each prompt begins with its
# test's own words, so that what one test cached is no hit for another
SYSTEM = "You are a careful assistant who answers in one short sentence and never uses lists or tables. "


def prompt_about(topic: str) -> str:
    return f"{topic}. {SYSTEM}The {topic.lower()}"


def ctl(daemon: Daemon, *args: str):
    return CliRunner().invoke(app, ["--url", daemon.url, "--token-file", str(daemon.token_file), *args])


def ctl_json(daemon: Daemon, *args: str):
    result = ctl(daemon, *args, "--json")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def generate(daemon: Daemon, prompt: str) -> dict:
    return ctl_json(daemon, "generate", "--raw", "--prompt", prompt, "--max-tokens", "6")


def by_stage(rows: list[dict]) -> dict[int, dict]:
    return {r["stage"]: r for r in rows}


# ---------------------------------------------------------------- a 2-stage pipeline with the OpenAI API
class Api:
    def __init__(self, pipe: Pipeline, port: int):
        self.pipe = pipe
        self.head = pipe.head
        self.base = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=120)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        with httpx2.Client(base_url=self.base, timeout=30) as h:
            text = h.get("/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def wait_healthy(self, timeout: float = 20.0) -> None:
        with httpx2.Client(base_url=self.base, timeout=5) as h:
            wait_for_health(h, timeout, self.head.log)


@pytest.fixture(scope="module")
def api(default_model_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("cache2")
    split_for_test(default_model_path, 2, work)
    port = free_ports(1)[0]
    pipe = Pipeline(work / "topology.toml", work, extra=["--openai", f"127.0.0.1:{port}", "--ctx", "1024",
                                                               *CACHE_ON]).start()
    try:
        a = Api(pipe, port)
        a.wait_healthy()
        yield a
    finally:
        codes = pipe.stop()
    assert all(c == 0 for c in codes.values()), codes


@pytest.mark.slow
def test_cache_show_lists_every_stage(api):
    rows = ctl_json(api.head, "cache", "show")
    assert [r["stage"] for r in rows] == [0, 1]
    for r in rows:
        assert set(r) == FIELDS and r["budget_bytes"] == BUDGET
        assert r["bytes"] >= 0 and r["entries"] >= 0 and 0.0 <= r["hit_rate"] <= 1.0
    table = ctl(api.head, "cache", "show")
    assert table.exit_code == 0 and "512 MiB" in table.stdout and "disk" in table.stdout, table.stdout
    # a daemon without the head: its own stage
    assert [r["stage"] for r in ctl_json(api.pipe.stages[1], "cache", "show")] == [1]


@pytest.mark.slow
def test_a_repeated_prompt_is_restored_and_says_so(api):
    prompt = prompt_about("Mountains")
    first, second = generate(api.head, prompt), generate(api.head, prompt)
    assert first["usage"]["cached_tokens"] == 0, first["usage"]
    cached = second["usage"]["cached_tokens"]
    # all of the prompt but its last token, whose logits give the first generated token
    assert 16 <= cached < second["usage"]["prompt_tokens"], second["usage"]
    rows = by_stage(ctl_json(api.head, "cache", "show"))
    for stage in (0, 1):
        r = rows[stage]
        assert r["entries"] >= 1 and r["tokens"] >= first["usage"]["prompt_tokens"] and 0 < r["bytes"] <= BUDGET
        assert r["hits"] >= 1 and r["restored_tokens"] >= cached and r["recorded_tokens"] >= r["tokens"]
    # the human summary says it too
    plain = ctl(api.head, "generate", "--raw", "--prompt", prompt, "--max-tokens", "6")
    assert plain.exit_code == 0 and f"cached {cached}," in plain.stderr, plain.stderr


@pytest.mark.slow
async def test_the_openai_usage_reports_cached_prompt_tokens(api):
    messages = [{"role": "system", "content": "Rivers. " + SYSTEM},
                {"role": "user", "content": "Name a river."}]

    def chat(**kw):
        return api.client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4, temperature=0,
                                                  **kw)

    def cached(usage) -> int:
        return usage.prompt_tokens_details.cached_tokens

    first = await trio.to_thread.run_sync(chat)
    second = await trio.to_thread.run_sync(chat)
    assert cached(first.usage) == 0
    assert 16 <= cached(second.usage) < second.usage.prompt_tokens
    chunks = await trio.to_thread.run_sync(lambda: list(chat(stream=True, stream_options={"include_usage": True})))
    assert chunks[-1].choices == [] and cached(chunks[-1].usage) == cached(second.usage)

    def complete(**kw):
        return api.client.completions.create(model=MODEL_ID, prompt=prompt_about("Nile"), max_tokens=4,
                                             temperature=0, **kw)

    assert cached((await trio.to_thread.run_sync(complete)).usage) == 0
    again = await trio.to_thread.run_sync(complete)
    assert 16 <= cached(again.usage) < again.usage.prompt_tokens
    chunks = await trio.to_thread.run_sync(lambda: list(complete(stream=True,
                                                                  stream_options={"include_usage": True})))
    assert cached(chunks[-1].usage) == cached(again.usage)


@pytest.mark.slow
def test_metrics_and_status_show_each_stages_cache(api):
    prompt = prompt_about("Lakes")
    generate(api.head, prompt)
    generate(api.head, prompt)
    s = api.metrics()
    shown = by_stage(ctl_json(api.head, "cache", "show"))
    for stage in ("0", "1"):
        def at(name: str, stage: str = stage) -> float:
            return s[(f"skippy_prefix_cache_{name}", (("stage", stage),))]

        assert at("lookups_total") >= 1 and at("hits_total") >= 1 and at("restored_tokens_total") >= 16
        assert at("recorded_tokens_total") >= 16 and at("evictions_total") >= 0
        assert at("entries") >= 1 and at("bytes") > 0 and at("budget_bytes") == BUDGET
        # what the control channel reports (no generation in between)
        assert at("entries") == shown[int(stage)]["entries"] and at("bytes") == shown[int(stage)]["bytes"]
    status = ctl_json(api.head, "status")
    assert status["head"]["prefix_cache"]["budget_bytes"] == BUDGET and status["head"]["prefix_cache"]["entries"] >= 1
    table = ctl(api.head, "status").stdout
    assert "prefix cache of stage 0: " in table and "of 512 MiB, hit rate" in table, table
    stage1 = ctl_json(api.pipe.stages[1], "status")
    assert stage1["stages"][0]["prefix_cache"]["stage_index"] == 1
    assert "prefix cache of stage 1: " in ctl(api.pipe.stages[1], "status").stdout


@pytest.mark.slow
def test_cache_clear_empties_every_stage(api):
    prompt = prompt_about("Europe")
    generate(api.head, prompt)
    held = by_stage(ctl_json(api.head, "cache", "show"))
    cleared = ctl_json(api.head, "cache", "clear")
    assert [r["stage"] for r in cleared] == [0, 1]
    for r in cleared:
        assert r["entries"] == 0 and r["bytes"] == 0 and r["tokens"] == 0 and r["budget_bytes"] == BUDGET
        assert r["cleared"] == held[r["stage"]]["entries"] >= 1 and r["cleared_bytes"] > 0
        # the counters count on: a clear is not a restart
        assert r["recorded_tokens"] >= held[r["stage"]]["recorded_tokens"]
    assert all(r["entries"] == 0 for r in ctl_json(api.head, "cache", "show"))
    assert generate(api.head, prompt)["usage"]["cached_tokens"] == 0  # computed in full again
    generate(api.head, prompt)
    plain = ctl(api.head, "cache", "clear")
    assert plain.exit_code == 0 and "stage 0: cleared " in plain.stdout and "stage 1: cleared " in plain.stdout
    # a daemon without the head clears its own stage
    generate(api.head, prompt)
    assert by_stage(ctl_json(api.pipe.stages[1], "cache", "clear"))[1]["entries"] == 0
    assert by_stage(ctl_json(api.head, "cache", "show"))[0]["entries"] >= 1  # (the head's is its own)


# ---------------------------------------------------------------- the cache off; a stage away
@pytest.mark.slow
def test_prefix_cache_mb_0_turns_it_off_and_a_stage_away_is_named(default_model_path, tmp_path):
    split_for_test(default_model_path, 2, tmp_path)
    pipe = Pipeline(tmp_path / "topology.toml", tmp_path, extra=["--prefix-cache-mb", "0"]).start()
    try:
        prompt = prompt_about("Deserts")
        assert [generate(pipe.head, prompt)["usage"]["cached_tokens"] for _ in range(2)] == [0, 0]
        rows = ctl_json(pipe.head, "cache", "show")
        assert [(r["stage"], r["budget_bytes"], r["entries"], r["bytes"]) for r in rows] == [(0, 0, 0, 0),
                                                                                          (1, 0, 0, 0)]
        assert "off" in ctl(pipe.head, "cache", "show").stdout
        assert "prefix cache of stage 0: off" in ctl(pipe.head, "status").stdout
        pipe.stages[1].kill()
        for command in ("show", "clear"):
            failed = ctl(pipe.head, "cache", command)
            assert failed.exit_code == 1 and failed.stderr.startswith("error: stage 1 at 127.0.0.1:"), failed.stderr
            assert "Traceback" not in failed.stderr + failed.stdout
    finally:
        pipe.stop()


@pytest.mark.slow
def test_a_single_stage_daemon_reports_its_one_cache(default_model_path, tmp_path):
    single = SingleStage(default_model_path, tmp_path, extra=CACHE_ON)
    try:
        prompt = prompt_about("Planets")
        first, second = generate(single.head, prompt), generate(single.head, prompt)
        assert first["usage"]["cached_tokens"] == 0 and second["usage"]["cached_tokens"] >= 16
        rows = ctl_json(single.head, "cache", "show")
        assert [r["stage"] for r in rows] == [0] and rows[0]["entries"] >= 1 and rows[0]["hits"] >= 1
        assert ctl_json(single.head, "cache", "clear")[0]["entries"] == 0
    finally:
        single.stop()


# ---------------------------------------------------------------- without processes
def _node(port: int) -> SimpleNamespace:
    cache = PrefixCache(1 << 20, stage_index=0)
    assert cache.record(np.arange(20, dtype=np.int32), b"s" * 100)
    hello = Hello(fingerprint=b"\0" * 32, stage_index=0, layer_start=0, layer_end=1, n_layer=2, n_embd=8,
                  node="head")
    pool = LanePool("127.0.0.1", port, hello, connect_timeout=1.0)
    return SimpleNamespace(engine=SimpleNamespace(prefix_cache=cache), pool=pool, single_stage=False,
                           topology=SimpleNamespace(stages=[None, None]))


async def test_an_unreachable_stage_fails_the_report_naming_it():
    port = free_ports(1)[0]  # nothing listens there
    node = _node(port)
    with pytest.raises(CacheReportError) as caught:
        await cache_report(node, clear=True)
    exc = caught.value
    assert exc.stage == 1 and str(exc).startswith(f"stage 1 at 127.0.0.1:{port}: cannot connect"), str(exc)
    # the head's own cache was cleared first, and that much is known
    assert [s.stage_index for s in exc.partial] == [0] and exc.partial[0].entries == 0


async def test_a_head_still_loading_has_no_report():
    with pytest.raises(CacheReportError, match="loading"):
        await cache_report(SimpleNamespace(engine=None))


def test_cache_requests_parse():
    assert m.parse_request('{"type": "cache_show", "id": "a"}') == m.CacheShow(id="a")
    assert m.parse_request('{"type": "cache_clear", "id": "b"}') == m.CacheClear(id="b")
    with pytest.raises(m.BadRequest, match=r"\$.stage"):
        m.parse_request('{"type": "cache_show", "id": "c", "stage": 1}')


def test_cache_tables_fit_80_columns():
    from rich.console import Console

    from skippyctl.cache import _cleared, _table
    from skippyctl.render import human_bytes

    assert [human_bytes(n) for n in (0, 812, 3500, 512 << 20, 3 << 30, 1536)] == [
        "0 B", "812 B", "3.4 KiB", "512 MiB", "3 GiB", "1.5 KiB"]
    rows = [{"stage": k, "entries": 1234, "tokens": 1_234_567, "bytes": 536_000_000, "budget_bytes": BUDGET,
             "lookups": 123456, "hits": 61728, "hit_rate": 0.5, "restored_tokens": 12_345_678,
             "recorded_tokens": 1, "evictions": 99999, "memory_hits": 61000,
             "disk": {"on": True, "entries": 12345, "tokens": 12_345_678, "bytes": 3 << 30, "budget_bytes": 4 << 30,
                      "hits": 728}} for k in range(3)]
    rows.append({**rows[0], "stage": 3, "budget_bytes": 0, "lookups": 0, "hit_rate": 0.0, "disk": {"on": False}})
    console = Console(width=80, record=True)
    console.print(_table(rows))
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80, text
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("0 "))
    assert lines[at].split() == ["0", "memory", "1234", "1234567", "511.2", "MiB", "512", "MiB", "61000", "12345678",
                                 "99999"], text
    assert lines[at + 1].split() == ["disk", "12345", "12345678", "3", "GiB", "4", "GiB", "728"], text
    at = next(i for i, x in enumerate(lines) if x.startswith("3 "))
    assert lines[at].split()[6] == "off" and lines[at + 1].split() == ["disk", "-", "-", "-", "off", "-"], text
    assert _cleared([{"stage": 0, "cleared": 1, "cleared_bytes": 2048},
                     {"stage": 1, "cleared": 3, "cleared_bytes": 0}]) == (
        "stage 0: cleared 1 entry (2 KiB)\nstage 1: cleared 3 entries (0 B)")


@pytest.mark.slow
def test_three_stages_report_through_the_middle_one(default_model_path, tmp_path):
    split_for_test(default_model_path, 3, tmp_path)
    pipe = Pipeline(tmp_path / "topology.toml", tmp_path, extra=CACHE_ON).start()
    try:
        prompt = prompt_about("Oceans")
        assert generate(pipe.head, prompt)["usage"]["cached_tokens"] == 0
        assert generate(pipe.head, prompt)["usage"]["cached_tokens"] >= 16
        rows = ctl_json(pipe.head, "cache", "show")
        assert [r["stage"] for r in rows] == [0, 1, 2] and all(r["entries"] >= 1 and r["hits"] >= 1 for r in rows)
        assert all(r["entries"] == 0 for r in ctl_json(pipe.head, "cache", "clear"))
        pipe.stages[2].kill()
        failed = ctl(pipe.head, "cache", "show")
        # stage 1 refuses a connection that leads nowhere, and says where
        assert failed.exit_code == 1 and "stage 1 at" in failed.stderr and "stage 2 at" in failed.stderr, \
            failed.stderr
    finally:
        pipe.stop()
