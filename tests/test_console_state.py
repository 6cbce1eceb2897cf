"""What the web console shows, without a browser: the pipeline's load report (StageQuery through real stages),
the stage marked as limiting the rate, and the event feed's bounded rate."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import trio

from skippyd.console.feed import MIN_INTERVAL_S, ConsoleFeed
from skippyd.console.pipeline import _mark_limiting
from skippyd.head.lanes import LanePool
from skippyd.head.load_report import load_report
from skippyd.wire.messages import Hello
from tests.fake_node import FakeNode
from tests.openai_api import httpx2, wait_for_health
from tests.procs import Pipeline, free_ports, split_for_test


def test_the_busiest_stage_limits_the_rate():
    stages = [{"index": 0, "health": "up", "busy_share": 0.2, "compute_ms_per_step": 5.0},
              {"index": 1, "health": "up", "busy_share": 0.6, "compute_ms_per_step": 4.0},
              {"index": 2, "health": "down", "busy_share": None, "compute_ms_per_step": None}]
    _mark_limiting(stages)
    assert [s["limiting"] for s in stages] == [False, True, False]
    idle = [{"index": 0, "health": "up", "busy_share": 0.0, "compute_ms_per_step": 3.0},
            {"index": 1, "health": "up", "busy_share": 0.0, "compute_ms_per_step": 7.0}]
    _mark_limiting(idle)  # no work in the window: the slowest per step
    assert [s["limiting"] for s in idle] == [False, True]
    unknown = [{"index": 0, "health": "up", "busy_share": None, "compute_ms_per_step": None},
               {"index": 1, "health": "up", "busy_share": None, "compute_ms_per_step": None}]
    _mark_limiting(unknown)
    assert not any(s["limiting"] for s in unknown)


async def test_the_feed_publishes_at_most_every_min_interval(autojump_clock):
    changing = {"n": 0}

    class Monitor:
        def watching(self):
            class Watch:
                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    return None
            return Watch()

        def view(self):
            changing["n"] += 1  # every build differs: a session generating without pause
            return {"n": changing["n"]}

    daemon = FakeNode()
    feed = ConsoleFeed(daemon, Monitor())
    got = []
    async with trio.open_nursery() as nursery:
        await nursery.start(feed.serve)
        with feed.subscribe() as sub:
            started = trio.current_time()
            while trio.current_time() - started < 10.0:
                snapshot = await sub.next(keepalive_s=1.0)
                if snapshot is not None:
                    got.append((trio.current_time(), snapshot["seq"]))
        nursery.cancel_scope.cancel()
    times = [t for t, _ in got]
    assert len(got) <= 10.0 / MIN_INTERVAL_S + 2
    assert all(b - a >= MIN_INTERVAL_S - 1e-9 for a, b in zip(times[1:], times[2:]))
    assert [seq for _, seq in got] == sorted({seq for _, seq in got})  # each once, in order


async def test_a_report_without_stage_1_says_why():
    port = free_ports(1)[0]  # nothing listens there
    hello = Hello(fingerprint=b"\0" * 32, stage_index=0, layer_start=0, layer_end=1, n_layer=2, n_embd=8, node="head")
    engine = SimpleNamespace(
        sessions=SimpleNamespace(snapshot=lambda: {"sessions": []}, n_seq_max=2), scheduler=None, context=None,
        prefix_cache=SimpleNamespace(stats=lambda: SimpleNamespace(bytes_held=0, budget_bytes=0)), live={})
    node = SimpleNamespace(engine=engine, pool=LanePool("127.0.0.1", port, hello, connect_timeout=1.0),
                           single_stage=False, topology=SimpleNamespace(stages=[None, None]),
                           model=SimpleNamespace(stage=SimpleNamespace(layer_start=0, layer_end=1)))
    report = await load_report(node)
    assert [s.stage_index for s in report.stages] == [0]
    assert report.failure.startswith(f"stage 1 at 127.0.0.1:{port}: cannot connect"), report.failure


@pytest.mark.slow
def test_three_stages_report_each_stage_and_both_links(default_model_path, tmp_path):
    work = tmp_path / "three"
    split_for_test(default_model_path, 3, work)
    port = free_ports(1)[0]
    pipe = Pipeline(work / "topology.toml", work, extra=["--openai", f"127.0.0.1:{port}", "--ctx", "256"]).start()
    try:
        with httpx2.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as h:
            wait_for_health(h)
            h.get("/console/api/state")  # the first report: the window starts here
            reply = h.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "The sea",
                                                    "max_tokens": 16, "temperature": 0})
            assert reply.status_code == 200
            time.sleep(1.1)  # (a state request asks the stages again once the last report is a poll old)
            state = h.get("/console/api/state").json()
            pipeline = state["pipeline"]
            stages = pipeline["stages"]
            topo = pipe.topology.stages
            assert [s["index"] for s in stages] == [0, 1, 2] and all(s["health"] == "up" for s in stages), stages
            assert [s["layers"] for s in stages] == [[t.layer_start, t.layer_end] for t in topo]
            assert all(link["rtt_ms"] is not None and link["rtt_ms"] >= 0 for link in pipeline["links"])
            assert [(x["from"], x["to"]) for x in pipeline["links"]] == [(0, 1), (1, 2)]
            assert pipeline["return_path"]["direct"] is True and pipeline["return_path"]["predictions_direct"] > 0
            # the stages computed the completion within the window: each has steps, one limits the rate
            assert all(s["steps"] > 0 and s["compute_ms_per_step"] > 0 for s in stages), stages
            assert sum(s["limiting"] for s in stages) == 1

            pipe.stages[2].kill()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                stages = h.get("/console/api/state").json()["pipeline"]["stages"]
                if stages[2]["health"] == "down":
                    break
                time.sleep(0.2)
            assert stages[2]["health"] == "down" and stages[2]["error"], stages
            assert stages[0]["health"] == "up"
    finally:
        pipe.stop()
