"""Metrics (prometheus_client, one registry per daemon) and telemetry spans, without processes."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from skippyd import telemetry
from skippyd.head.engine import GenerationResult
from skippyd.openai.metrics import Metrics
from tests.fake_node import FakeNode


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def result(**kw) -> GenerationResult:
    base = dict(request_id=1, session_id=2, text="hi", tokens=[5, 6, 7, 8], finish_reason="length",
                prompt_tokens=10, ttft_ms=40.0, decode_tokens_per_s=50.0, elapsed_ms=100.0,
                stage_stats={"compute_us": 8000, "compute_us_max": 3000, "queue_us": 100, "forward_write_us": 50,
                             "downstream_wait_us": 6000, "bytes_sent": 4096, "stage_count": 4, "slowest_stage": 1})
    base.update(kw)
    return GenerationResult(**base)


def test_record_generation_moves_counters_and_histograms():
    m = Metrics()
    m.record_generation(result(), source="http")
    m.record_generation(result(finish_reason="stop", tokens=[1]), source="control")
    s = samples(m)
    assert s[("skippy_generations_total", (("finish_reason", "length"), ("source", "http")))] == 1
    assert s[("skippy_generations_total", (("finish_reason", "stop"), ("source", "control")))] == 1
    assert s[("skippy_prompt_tokens_total", (("source", "http"),))] == 10
    assert s[("skippy_completion_tokens_total", (("source", "http"),))] == 4
    assert s[("skippy_completion_tokens_total", (("source", "control"),))] == 1
    assert s[("skippy_time_to_first_token_seconds_sum", (("source", "http"),))] == pytest.approx(0.04)
    assert s[("skippy_time_per_output_token_seconds_sum", (("source", "http"),))] == pytest.approx(0.02)
    # one token: no time per output token
    assert s.get(("skippy_time_per_output_token_seconds_count", (("source", "control"),)), 0) == 0
    assert s[("skippy_stage_compute_milliseconds_sum", ())] == pytest.approx(2 * 8000 / 4 / 1e3)
    assert s[("skippy_hop_wait_milliseconds_sum", ())] == pytest.approx(12.0)
    assert s[("skippy_stage_seconds_total", (("kind", "compute"),))] == pytest.approx(0.016)
    assert s[("skippy_pipeline_bytes_sent_total", ())] == 8192
    assert s[("skippy_slowest_stage_total", (("stage", "1"),))] == 2


def test_requests_by_endpoint_and_status():
    m = Metrics()
    m.observe_request("/v1/chat/completions", 200, 0.5)
    m.observe_request("/v1/chat/completions", 200, 0.7)
    m.observe_request("/v1/completions", 400, 0.001)
    s = samples(m)
    assert s[("skippy_http_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] == 2
    assert s[("skippy_http_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] == 1
    assert s[("skippy_http_request_duration_seconds_count", (("endpoint", "/v1/chat/completions"),))] == 2


def test_registries_are_per_daemon():
    a, b = Metrics(), Metrics()
    a.observe_request("/health", 200, 0.0)
    assert ("skippy_http_requests_total", (("endpoint", "/health"), ("status", "200"))) not in samples(b)


def fake_daemon():
    live = {1: SimpleNamespace(state="queued"), 2: SimpleNamespace(state="decode"), 3: SimpleNamespace(state="decode")}
    engine = SimpleNamespace(
        live=live, totals={"generations": 7, "prompt_tokens": 70, "completion_tokens": 30, "errors": 1},
        sessions=SimpleNamespace(live=[object(), object()], free_slots=2),
        scheduler=SimpleNamespace(stats=SimpleNamespace(compute_s=1.5, batches=9, tokens=40)),
        availability=None, speculation=None, prefix_cache=None)
    pool = SimpleNamespace(capacity=4, describe=lambda: [{"state": "busy"}, {"state": "busy"}, {"state": "idle"}])
    stage = SimpleNamespace(index=1, sessions=SimpleNamespace(live=[object()], free_slots=3),
                            scheduler=SimpleNamespace(stats=SimpleNamespace(compute_s=2.5, batches=11, tokens=44),
                                                      threads=SimpleNamespace(current=1)),
                            core=SimpleNamespace(prefix_cache=None))
    return FakeNode(head=SimpleNamespace(engine=engine, pool=pool), stages=[stage], draining=True)


def test_daemon_state_is_read_at_scrape_time():
    daemon = fake_daemon()
    m = Metrics(daemon)
    s = samples(m)
    assert s[("skippy_live_generations", (("state", "decode"),))] == 2
    assert s[("skippy_queue_depth", ())] == 1  # every request, HTTP or control, waits at the engine's gate
    assert s[("skippy_lanes", (("state", "busy"),))] == 2
    assert s[("skippy_lanes", (("state", "idle"),))] == 1
    assert s[("skippy_lanes", (("state", "unopened"),))] == 1
    assert s[("skippy_stage_sessions", (("stage", "0"),))] == 2
    assert s[("skippy_stage_sessions", (("stage", "1"),))] == 1
    assert s[("skippy_stage_free_slots", (("stage", "1"),))] == 3
    assert s[("skippy_scheduler_compute_seconds_total", (("stage", "1"),))] == 2.5
    assert s[("skippy_compute_threads", (("stage", "1"),))] == 1  # on one thread now (ThreadChooser)
    assert s[("skippy_head_generations_total", (("outcome", "error"),))] == 1
    assert s[("skippy_head_tokens_total", (("kind", "prompt"),))] == 70
    assert s[("skippy_draining", ())] == 1
    daemon.head.engine.live.clear()
    assert samples(m)[("skippy_live_generations", (("state", "decode"),))] == 0


def test_a_starting_or_stage_only_daemon_still_scrapes():
    assert samples(Metrics(FakeNode()))[("skippy_draining", ())] == 0
    loading = FakeNode(head=SimpleNamespace(engine=None, pool=None))
    assert ("skippy_draining", ()) in samples(Metrics(loading))
    broken = FakeNode(head=SimpleNamespace(engine=SimpleNamespace(live=None)))
    samples(Metrics(broken))  # a part in a strange state: the scrape still answers


# ---------------------------------------------------------------- telemetry
@pytest.fixture
def spans():
    sink = io.StringIO()
    yield sink
    telemetry.configure("off")
    telemetry.reset()


def test_span_off_is_a_shared_no_op(spans):
    telemetry.configure("off", sink=spans)
    s = telemetry.span("x", request=1)
    assert s is telemetry.span("y")
    with s as inner:
        inner.set(session=3)
    assert spans.getvalue() == "" and telemetry.summary() == {}


def test_span_debug_writes_one_json_line_per_span_with_ids_and_parent(spans):
    telemetry.configure("debug", sink=spans)
    with telemetry.span("http.request", request="abc") as outer:
        with telemetry.span("head.decode", request="abc", session=42) as inner:
            inner.set(tokens=3)
        outer.set(status=200)
    with pytest.raises(KeyError), telemetry.span("failing", request="def"):
        raise KeyError("boom")
    lines = [json.loads(line) for line in spans.getvalue().splitlines()]
    assert [r["span"] for r in lines] == ["head.decode", "http.request", "failing"]
    decode, request, failing = lines
    assert decode["session"] == 42 and decode["tokens"] == 3 and decode["request"] == "abc"
    assert decode["parent_id"] == request["span_id"] and request["parent_id"] is None
    assert request["status"] == 200 and request["duration_ms"] >= decode["duration_ms"] >= 0
    assert failing["error"] == "KeyError" and failing["parent_id"] is None
    assert telemetry.summary()["failing"]["errors"] == 1


def test_span_summary_counts_without_lines(spans):
    telemetry.configure("summary", sink=spans)
    for _ in range(3):
        with telemetry.span("stage.compute", stage=1):
            pass
    assert spans.getvalue() == ""
    assert telemetry.summary()["stage.compute"]["count"] == 3
    s = samples(Metrics(FakeNode()))
    assert s[("skippy_span_total", (("span", "stage.compute"),))] == 3


async def test_spans_in_child_tasks_name_their_parent(spans):
    telemetry.configure("debug", sink=spans)

    async def child():
        with telemetry.span("child"):
            await trio.sleep(0)

    with telemetry.span("parent"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
            nursery.start_soon(child)
    lines = [json.loads(line) for line in spans.getvalue().splitlines()]
    parent = next(r for r in lines if r["span"] == "parent")
    assert [r["parent_id"] for r in lines if r["span"] == "child"] == [parent["span_id"]] * 2


def test_unknown_level_is_refused():
    with pytest.raises(ValueError):
        telemetry.configure("verbose")


# ---------------------------------------------------------------- prefix caches
def cache_daemon(report=None):
    """A head of a 3-stage pipeline running stage 0 with stage 2 in the same daemon; `report` plays the head's
    cache_report (of every stage)."""
    import numpy as np

    from skippyd.stage.prefix_cache import PrefixCache

    head_cache, stage2_cache = PrefixCache(1 << 20, stage_index=0), PrefixCache(2 << 20, stage_index=2)
    tokens = np.arange(40, dtype=np.int32)
    assert head_cache.record(tokens, b"x" * 1000)
    assert head_cache.lookup(tokens) is not None and head_cache.lookup(tokens[::-1].copy()) is None
    head_cache.note_restored(39)
    engine = SimpleNamespace(live={}, totals={}, sessions=SimpleNamespace(live=[], free_slots=1),
                             scheduler=SimpleNamespace(stats=SimpleNamespace(compute_s=0, batches=0, tokens=0)),
                             prefix_cache=head_cache, availability=None, speculation=None)
    pool = SimpleNamespace(capacity=1, describe=lambda: [])
    stage = SimpleNamespace(index=2, sessions=None, scheduler=None, core=SimpleNamespace(prefix_cache=stage2_cache))
    head = SimpleNamespace(engine=engine, pool=pool, cache_report=report)
    return FakeNode(head=head, stages=[stage])


async def test_prefix_caches_per_stage_local_and_from_the_heads_report():
    from skippyd.wire.messages import CacheStats

    asked = []

    async def report(clear=False):
        asked.append(clear)
        return [CacheStats(0), CacheStats(1, budget_bytes=3 << 20, bytes_held=500, entries=2, tokens_held=70,
                                          lookups=4, hits=3, restored_tokens=60, recorded_tokens=90, evictions=1,
                                          disk_on=True, disk_budget_bytes=4 << 30, disk_bytes=9000, disk_entries=5,
                                          disk_tokens=400, disk_hits=2, disk_writes=7),
                CacheStats(2)]

    m = Metrics(cache_daemon(report))
    before = samples(m)  # no report asked for yet: the local stages only
    assert ("skippy_prefix_cache_lookups_total", (("stage", "0"),)) in before
    assert ("skippy_prefix_cache_lookups_total", (("stage", "1"),)) not in before
    await m.refresh_caches()
    await m.refresh_caches()  # within CACHE_REPORT_TTL_S: the same report
    assert asked == [False]
    s = samples(m)

    def at(name: str, stage: int) -> float:
        return s[(f"skippy_prefix_cache_{name}", (("stage", str(stage)),))]

    # the head's own cache (stage 0): read now
    assert (at("lookups_total", 0), at("hits_total", 0), at("restored_tokens_total", 0)) == (2, 1, 39)
    assert at("recorded_tokens_total", 0) == 40 and at("entries", 0) == 1 and at("tokens", 0) == 40
    assert at("bytes", 0) == 1000 + 40 * 4 and at("budget_bytes", 0) == 1 << 20 and at("evictions_total", 0) == 0
    # stage 1 from the report; stage 2 (local) read now, not from the report
    assert (at("lookups_total", 1), at("hits_total", 1), at("restored_tokens_total", 1)) == (4, 3, 60)
    assert (at("recorded_tokens_total", 1), at("evictions_total", 1), at("bytes", 1)) == (90, 1, 500)
    assert (at("entries", 1), at("budget_bytes", 1)) == (2, 3 << 20)
    assert at("budget_bytes", 2) == 2 << 20
    # per tier: stage 1's disk tier from the report
    tier = {(name, labels): v for (name, labels), v in s.items() if "_tier_" in name}
    assert tier[("skippy_prefix_cache_tier_hits_total", (("stage", "1"), ("tier", "disk")))] == 2
    assert tier[("skippy_prefix_cache_tier_hits_total", (("stage", "1"), ("tier", "memory")))] == 1
    assert tier[("skippy_prefix_cache_tier_entries", (("stage", "1"), ("tier", "disk")))] == 5
    assert tier[("skippy_prefix_cache_tier_bytes", (("stage", "1"), ("tier", "disk")))] == 9000
    assert tier[("skippy_prefix_cache_tier_budget_bytes", (("stage", "1"), ("tier", "disk")))] == 4 << 30
    assert tier[("skippy_prefix_cache_tier_budget_bytes", (("stage", "0"), ("tier", "disk")))] == 0
    assert tier[("skippy_prefix_cache_tier_entries", (("stage", "0"), ("tier", "memory")))] == 1
    assert s[("skippy_prefix_cache_disk_writes_total", (("stage", "1"),))] == 7
    assert s[("skippy_prefix_cache_disk_on", (("stage", "1"),))] == 1
    assert s[("skippy_prefix_cache_disk_on", (("stage", "0"),))] == 0


async def test_prefix_caches_without_an_answer_are_the_local_stages(autojump_clock):
    async def failing(clear=False):
        raise RuntimeError("stage 1 at 127.0.0.1:1: cannot connect")

    async def hanging(clear=False):
        await trio.sleep_forever()

    for report in (failing, hanging):
        m = Metrics(cache_daemon(report))
        started = trio.current_time()
        await m.refresh_caches()
        assert trio.current_time() - started <= 1.0  # a scrape waits a second at most
        s = samples(m)
        assert {labels for (name, labels) in s if name == "skippy_prefix_cache_entries"} == {
            (("stage", "0"),), (("stage", "2"),)}
