"""Every stage's health and load over the last minute, and the round trip of every link, for the pipeline page.

The monitor asks the pipeline for its load (:func:`skippyd.head.load_report.load_report`: one StageQuery down a
connection of its own) every POLL_S while someone watches, and keeps each stage's reports of the last WINDOW_S:
a stage's busy share is its compute time over that window's length, its compute per step that time over the
llama_decode calls in it. A stage is down when it is missing from the last report (the reason says why).
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import TYPE_CHECKING

import trio

from skippyd.head.load_report import LoadReport, load_report
from skippyd.ports import NodeView

if TYPE_CHECKING:
    from skippyd.head.node import HeadNode

log = logging.getLogger("skippyd.console")

POLL_S = 1.0  # between two reports while the page is open (a stage killed shows as down within 2 POLL_S)
WINDOW_S = 60.0  # the busy share and compute per step are over this long (or since the page opened)
QUERY_TIMEOUT_S = 1.0


class PipelineMonitor:
    """Polls the pipeline's load while :meth:`watching` is held, and describes it (:meth:`view`)."""

    def __init__(self, node: NodeView):
        self.node = node
        self.report: LoadReport | None = None
        self.reported_at: float | None = None  # time.time() of the last report
        self._samples: dict[int, collections.deque] = {}  # stage → (clock_us, compute_us, batches) in the window
        self._watchers = 0
        self._watched = trio.Event()
        self._polled = trio.Event()  # set after each report

    # ------------------------------------------------------------ polling
    def watching(self):
        """A context manager: the monitor polls while at least one is open."""
        monitor = self

        class _Watch:
            def __enter__(self):
                monitor._watchers += 1
                monitor._watched.set()

            def __exit__(self, *exc):
                monitor._watchers -= 1
                if monitor._watchers == 0:
                    monitor._watched = trio.Event()

        return _Watch()

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self._watched.wait()
            await self.poll()
            await trio.sleep(POLL_S)

    async def poll(self) -> None:
        head = self.node.head
        if head is None:
            return
        try:
            report = await load_report(head, timeout=QUERY_TIMEOUT_S)
        except Exception as exc:  # the page shows what it can; a bug here must not end the polling
            log.exception("console: the pipeline's load report failed")
            report = LoadReport((), f"internal error: {exc}")
        self._keep(report)
        self.report, self.reported_at = report, time.time()
        self._polled.set()
        self._polled = trio.Event()

    async def wait_report(self) -> None:
        """Until the next report is in."""
        await self._polled.wait()

    def _keep(self, report: LoadReport) -> None:
        for load in report.stages:
            samples = self._samples.setdefault(load.stage_index, collections.deque())
            if samples and (load.compute_us < samples[-1][1] or load.clock_us <= samples[-1][0]):
                samples.clear()  # the stage restarted: its counters began again
            samples.append((load.clock_us, load.compute_us, load.batches))
            while len(samples) > 2 and (load.clock_us - samples[1][0]) / 1e6 >= WINDOW_S:
                samples.popleft()

    # ------------------------------------------------------------ the view
    def _window(self, index: int) -> dict:
        samples = self._samples.get(index)
        if not samples or len(samples) < 2:
            return {"window_s": 0.0, "busy_share": None, "compute_ms_per_step": None, "steps": 0}
        (c0, u0, b0), (c1, u1, b1) = samples[0], samples[-1]
        span_us = max(1, c1 - c0)
        steps = b1 - b0
        return {"window_s": round(span_us / 1e6, 1), "busy_share": round(min(1.0, (u1 - u0) / span_us), 4),
                "compute_ms_per_step": round((u1 - u0) / steps / 1e3, 3) if steps else None, "steps": steps}

    def view(self) -> dict:
        """The stages in order, each link between them, and the way predictions come back to the head."""
        head = self.node.head
        topology = self.node.topology
        report = self.report
        loads = {s.stage_index: s for s in report.stages} if report else {}
        specs = list(topology.stages) if topology is not None else []
        if not specs and head is not None and head.model is not None:  # a whole model as one stage
            st = head.model.stage
            specs = [_Spec(0, "this daemon", st.layer_start, st.layer_end)]
        stages = []
        for spec in specs:
            load = loads.get(spec.index)
            if spec.index == 0:
                health, why = "up", None
            elif report is None:
                health, why = "unknown", "not checked yet"
            elif load is None:
                health, why = "down", report.failure or "no report"
            else:
                health, why = "up", None
            entry = {"index": spec.index, "address": spec.address,
                     "layers": [spec.layer_start, spec.layer_end], "health": health, "error": why,
                     **self._window(spec.index)}
            if load is not None:
                entry.update(sessions=load.sessions, n_seq_max=load.n_seq_max, kv_tokens=load.kv_tokens,
                             kv_capacity=load.kv_capacity, cache_bytes=load.cache_bytes,
                             cache_budget=load.cache_budget)
            stages.append(entry)
        _mark_limiting(stages)
        links = []
        for a, b in zip(stages, stages[1:]):
            load = loads.get(a["index"])
            rtt = load.downstream_rtt_us / 1e3 if load is not None and b["health"] == "up" else None
            links.append({"from": a["index"], "to": b["index"], "rtt_ms": None if rtt is None else round(rtt, 3),
                          "ms": None if rtt is None else round(rtt / 2, 3), **_wire(self.node, a["index"])})
        return {"stages": stages, "links": links, "return_path": self._return_path(head, stages, links),
                "failure": report.failure if report else None, "reported_at": self.reported_at,
                "poll_s": POLL_S}

    @staticmethod
    def _return_path(head: HeadNode | None, stages: list[dict], links: list[dict]) -> dict | None:
        """How predictions reach the head: relayed back up every link, or (3+ stages) straight from the final
        stage. Its time is what the decode steps' network time (the head's measure of a step's round trip
        without the stages' compute) leaves once the forward halves of the links are taken out."""
        engine = head.engine if head is not None else None
        if engine is None or head.pool is None:
            return None
        token_return = engine.describe_token_return() or {}
        loop_us = engine.chunker.round_trip_us
        direct = bool(token_return.get("enabled")) and len(stages) >= 3
        ms = None
        if loop_us > 0:
            forward = sum(link["ms"] for link in links if link["ms"] is not None)
            ms = round(max(0.0, loop_us / 1e3 - forward), 3)
        return {"direct": direct, "from": stages[-1]["index"] if stages else None, "ms": ms,
                "loop_network_ms": round(loop_us / 1e3, 3) if loop_us > 0 else None,
                "predictions_direct": token_return.get("direct", 0),
                "predictions_relayed": token_return.get("relayed", 0)}


def _wire(node: NodeView, index: int) -> dict:
    """How the link from stage ``index`` carries activations (f32 or f16, runtime.activation_wire) and the rate
    it measured when it opened (Mbit/s), where this daemon runs that stage; None where it does not."""
    link = None
    if index == 0 and node.pool is not None:
        link = node.pool.describe_link()
    for stage in node.stages:
        if stage.index == index:
            link = stage.describe_link()
    link = link or {}
    return {"wire": link.get("wire"), "wire_mode": link.get("mode"), "rate_mbps": link.get("rate_mbps"),
            "f16_below_mbps": link.get("threshold_mbps")}


class _Spec:
    def __init__(self, index: int, address: str, layer_start: int, layer_end: int):
        self.index, self.address, self.layer_start, self.layer_end = index, address, layer_start, layer_end


def _mark_limiting(stages: list[dict]) -> None:
    """The stage that limits the rate: the busiest over the window (every token crosses every stage, so the one
    computing the largest share of the time is the first to run out of it); with no work in the window, the
    slowest per step; none when nothing is known."""
    def key(s: dict) -> tuple[float, float]:
        return (s.get("busy_share") or 0.0, s.get("compute_ms_per_step") or 0.0)

    up = [s for s in stages if s["health"] == "up"]
    best = max(up, key=key, default=None)
    for s in stages:
        s["limiting"] = False
    if best is not None and any(math.isfinite(v) and v > 0 for v in key(best)) and len(stages) > 1:
        best["limiting"] = True
