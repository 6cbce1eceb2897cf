"""Prometheus metrics of one daemon (prometheus_client, a registry of its own).

Two kinds of numbers:

* **events**, recorded as they happen: HTTP requests (``observe_request``)
  and finished generations (``record_generation``: tokens, TTFT, time per
  output token, and the pipeline's timings from ``result.stage_stats``);
* **state**, read from the daemon when scraped (:class:`_DaemonCollector`):
  live generations and queue depth, lanes by state, sessions and free slots
  per local stage, scheduler counters per local stage, telemetry span totals,
  and every stage's prefix cache: the local stages' read then, the other
  stages' from the head's cache report, which ``refresh_caches`` (awaited by
  the ``/metrics`` route before it renders) fetches at most every
  CACHE_REPORT_TTL_S and waits for at most CACHE_REPORT_TIMEOUT_S; without a
  fresh one, only the local stages are reported.

``record_generation(result, source=...)`` is the one call a generation path
needs: the OpenAI app calls it with ``source="http"``; the control channel
can call it with ``source="control"``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from skippyd import telemetry
from skippyd.head.lanes import LaneState
from skippyd.head.states import GenerationState
from skippyd.ports import NodeView
from skippyd.stage.loop_lag import LoopLagCollector

log = logging.getLogger("skippyd.metrics")

CONTENT_TYPE = CONTENT_TYPE_LATEST

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_SECONDS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
_MS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0)

CACHE_REPORT_TTL_S = 1.0  # scrapes closer together than this share one report of the remote stages' caches
CACHE_REPORT_TIMEOUT_S = 1.0  # a scrape waits this long for it, then reports the local stages only


class Metrics:
    def __init__(self, daemon: NodeView | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("skippy_http_requests", "HTTP requests by endpoint and status "
                                "(499: the client went away before the answer was complete)",
                                ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram("skippy_http_request_duration_seconds",
                                         "HTTP request duration, first byte in to last byte out",
                                         ["endpoint"], buckets=_SECONDS, registry=r)
        self.generations = Counter("skippy_generations", "Finished generations by source and finish reason",
                                   ["source", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("skippy_prompt_tokens", "Prompt tokens of finished generations",
                                     ["source"], registry=r)
        self.completion_tokens = Counter("skippy_completion_tokens", "Generated tokens of finished generations",
                                         ["source"], registry=r)
        self.ttft = Histogram("skippy_time_to_first_token_seconds",
                              "Time from request to the first generated token", ["source"],
                              buckets=_SECONDS, registry=r)
        self.tpot = Histogram("skippy_time_per_output_token_seconds",
                              "Mean time per generated token after the first, per generation", ["source"],
                              buckets=_TOKEN_SECONDS, registry=r)
        self.stage_compute_ms = Histogram(
            "skippy_stage_compute_milliseconds",
            "Per generation: mean llama_decode time of one stage for one message (compute_us / stage_count)",
            buckets=_MS, registry=r)
        self.hop_wait_ms = Histogram(
            "skippy_hop_wait_milliseconds",
            "Per generation: longest wait of a stage for its downstream's reply (downstream_wait_us)",
            buckets=_MS + (2500.0, 10000.0), registry=r)
        self.stage_seconds = Counter("skippy_stage_seconds", "Pipeline time summed over stages and messages, "
                                     "by kind (compute, queue, forward_write)", ["kind"], registry=r)
        self.stage_reports = Counter("skippy_stage_reports", "Per-stage timing reports folded into replies",
                                     registry=r)
        self.pipeline_bytes = Counter("skippy_pipeline_bytes_sent", "Frame bytes written downstream by all stages",
                                      registry=r)
        self.slowest_stage = Counter("skippy_slowest_stage", "Generations whose slowest single compute was on "
                                     "this stage", ["stage"], registry=r)
        self.daemon = daemon
        # the prefix caches of the stages this daemon does not run, by stage index (see refresh_caches)
        self.remote_caches: dict[int, Any] = {}
        self._caches_at = -math.inf
        self._refreshing = trio.Lock()
        if daemon is not None:
            r.register(_DaemonCollector(daemon, self))
            r.register(LoopLagCollector())  # skippy_event_loop_lag_seconds of this daemon's stages

    async def refresh_caches(self) -> None:
        """Fetch the head's report of every stage's prefix cache, unless one is fresh (CACHE_REPORT_TTL_S);
        waits at most CACHE_REPORT_TIMEOUT_S. On a failure or a timeout the remote stages are left out."""
        head = self.daemon.head if self.daemon is not None else None
        if head is None or head.engine is None or head.pool is None:
            self.remote_caches = {}  # no pipeline beyond this daemon's own stages
            return
        async with self._refreshing:
            if trio.current_time() - self._caches_at < CACHE_REPORT_TTL_S:
                return
            report = []
            with trio.move_on_after(CACHE_REPORT_TIMEOUT_S):
                try:
                    report = await head.cache_report()
                except Exception as exc:  # a scrape reports what it can: the local stages
                    log.debug("metrics: no prefix cache report from the pipeline: %s", exc)
            self.remote_caches = {s.stage_index: s for s in report}
            self._caches_at = trio.current_time()

    # ------------------------------------------------------------ events
    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.request_seconds.labels(endpoint).observe(seconds)

    def record_generation(self, result: Any, source: str = "control") -> None:
        """Count one finished generation (a `GenerationResult`, or anything with the same fields)."""
        tokens = len(result.tokens)
        self.generations.labels(source, result.finish_reason).inc()
        self.prompt_tokens.labels(source).inc(result.prompt_tokens)
        self.completion_tokens.labels(source).inc(tokens)
        if tokens:
            self.ttft.labels(source).observe(result.ttft_ms / 1e3)
        if tokens > 1 and result.decode_tokens_per_s > 0:
            self.tpot.labels(source).observe(1.0 / result.decode_tokens_per_s)
        stats = result.stage_stats or {}
        count = int(stats.get("stage_count", 0))
        if count:
            self.stage_compute_ms.observe(stats.get("compute_us", 0) / count / 1e3)
            self.stage_reports.inc(count)
            self.slowest_stage.labels(str(stats.get("slowest_stage", 0))).inc()
        if stats.get("downstream_wait_us"):
            self.hop_wait_ms.observe(stats["downstream_wait_us"] / 1e3)
        for kind in ("compute", "queue", "forward_write"):
            self.stage_seconds.labels(kind).inc(stats.get(f"{kind}_us", 0) / 1e6)
        self.pipeline_bytes.inc(stats.get("bytes_sent", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _DaemonCollector(Collector):
    """The daemon's state at scrape time. Never raises: a scrape must not fail because a part is starting."""

    def __init__(self, daemon: NodeView, metrics: Metrics):
        self.daemon = daemon
        self.metrics = metrics

    def describe(self) -> Iterable:
        return []  # unchecked collector: its families depend on what the daemon runs

    def collect(self) -> Iterable:
        try:
            yield from self._collect()
        except Exception:  # a scrape reports what it can
            log.debug("metrics: collecting daemon state failed", exc_info=True)

    def _collect(self) -> Iterable:
        daemon = self.daemon
        head, engine = daemon.head, daemon.engine
        yield GaugeMetricFamily("skippy_draining", "1 while the daemon drains (no new generations)",
                                value=float(daemon.draining))
        if engine is not None:
            states = dict.fromkeys((GenerationState.QUEUED, GenerationState.PREFILL, GenerationState.DECODE), 0)
            for live in list(engine.live.values()):
                states[live.state] = states.get(live.state, 0) + 1
            g = GaugeMetricFamily("skippy_live_generations", "Running generations on the head by state",
                                  labels=["state"])
            for state, n in states.items():
                g.add_metric([state], n)
            yield g
            yield GaugeMetricFamily("skippy_queue_depth", "Generations waiting for a lane or a slot",
                                    value=states[GenerationState.QUEUED])
            totals = engine.totals
            c = CounterMetricFamily("skippy_head_generations", "Generations the head engine ran, all sources "
                                    "(errors included)", labels=["outcome"])
            c.add_metric(["all"], totals.get("generations", 0))
            c.add_metric(["error"], totals.get("errors", 0))
            yield c
            yield self._head_tokens(totals)
            availability = engine.availability
            if availability is not None:
                yield CounterMetricFamily("skippy_requests_resumed", "Generations replayed after a stage was lost "
                                          "(the same stage back, or a re-planned pipeline)",
                                          value=availability.resumed)
        supervisor = daemon.deployment.supervisor if daemon.deployment is not None else None
        if supervisor is not None:
            c = CounterMetricFamily("skippy_deploy_replans", "Times the supervising head moved its deployment to a "
                                    "new plan, by cause", labels=["cause"])
            for cause, n in supervisor.replans.items():
                c.add_metric([cause], n)
            yield c
            yield GaugeMetricFamily("skippy_deploy_generation", "The deployment plan's generation (1: as deployed)",
                                    value=supervisor.generation)
        pool = daemon.pool
        if pool is not None:
            lanes = dict.fromkeys((LaneState.IDLE, LaneState.BUSY), 0)
            for lane in pool.describe():
                lanes[lane["state"]] = lanes.get(lane["state"], 0) + 1
            lanes["unopened"] = max(0, pool.capacity - sum(lanes.values()))
            g = GaugeMetricFamily("skippy_lanes", "Head lanes to stage 1 by state", labels=["state"])
            for state, n in lanes.items():
                g.add_metric([state], n)
            yield g
        yield from self._stages(head, engine)
        yield from self._prefix_caches(engine)
        yield from self._speculation(engine)
        spans = telemetry.summary()
        if spans:
            count = CounterMetricFamily("skippy_span", "Telemetry spans finished, by name", labels=["span"])
            secs = CounterMetricFamily("skippy_span_seconds", "Telemetry span time, by name", labels=["span"])
            for name, s in sorted(spans.items()):
                count.add_metric([name], s["count"])
                secs.add_metric([name], s["total_s"])
            yield count
            yield secs

    @staticmethod
    def _head_tokens(totals: dict) -> CounterMetricFamily:
        c = CounterMetricFamily("skippy_head_tokens", "Tokens through the head engine, all sources",
                                labels=["kind"])
        c.add_metric(["prompt"], totals.get("prompt_tokens", 0))
        c.add_metric(["completion"], totals.get("completion_tokens", 0))
        return c

    def _stages(self, head: Any, engine: Any) -> Iterable:
        tables = []  # (stage index, SessionTable, Scheduler)
        if engine is not None:
            tables.append((0, engine.sessions, engine.scheduler))
        for stage in list(self.daemon.stages):
            tables.append((stage.index, stage.sessions, stage.scheduler))
        if not tables:
            return
        live = GaugeMetricFamily("skippy_stage_sessions", "Live sessions (KV sequences) per local stage",
                                 labels=["stage"])
        free = GaugeMetricFamily("skippy_stage_free_slots", "Free sequence slots per local stage", labels=["stage"])
        compute = CounterMetricFamily("skippy_scheduler_compute_seconds", "Time in llama_decode per local stage",
                                      labels=["stage"])
        batches = CounterMetricFamily("skippy_scheduler_batches", "llama_decode calls per local stage",
                                      labels=["stage"])
        tokens = CounterMetricFamily("skippy_scheduler_tokens", "Tokens computed per local stage", labels=["stage"])
        threads = GaugeMetricFamily("skippy_compute_threads", "Threads the local stage computes with now "
                                    "(fewer than configured while other programs hold the cores)", labels=["stage"])
        for index, table, scheduler in tables:
            k = str(index)
            if table is not None:
                live.add_metric([k], len(table.live))
                free.add_metric([k], table.free_slots)
            stats = getattr(scheduler, "stats", None)
            if stats is not None:
                compute.add_metric([k], stats.compute_s)
                batches.add_metric([k], stats.batches)
                tokens.add_metric([k], stats.tokens)
            chooser = getattr(scheduler, "threads", None)
            if chooser is not None:
                threads.add_metric([k], chooser.current)
        yield from (live, free, compute, batches, tokens, threads)

    @staticmethod
    def _speculation(engine: Any) -> Iterable:
        totals = engine.speculation if engine is not None else None
        if totals is None:
            return
        for name, attr, doc in (
                ("skippy_speculative_windows", "windows", "Verify windows the head sent (speculative decoding)"),
                ("skippy_speculative_drafted_tokens", "drafted", "Drafted tokens sent for verification"),
                ("skippy_speculative_accepted_tokens", "accepted", "Drafted tokens the final stage accepted"),
                ("skippy_speculative_plain_steps", "plain_steps",
                 "Decode steps of speculative generations sent without drafts (drafting did not pay)"),
                ("skippy_speculative_chained_windows", "chained",
                 "Verify windows sent before the window ahead of them was answered (windows in flight)"),
                ("skippy_speculative_dropped_windows", "dropped",
                 "Windows in flight that a rejected draft ahead of them made void (dropped by the final stage)")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], getattr(totals, attr))
            yield c

    def _prefix_caches(self, engine: Any) -> Iterable:
        """Every stage's prefix cache: the local stages' now, the others' from the last report."""
        caches = dict(self.metrics.remote_caches)
        local = [(0, engine.prefix_cache if engine is not None else None)]
        local += [(stage.index, stage.core.prefix_cache) for stage in list(self.daemon.stages)]
        for index, cache in local:
            if cache is not None:
                caches[index] = cache.stats()
        if not caches:
            return
        counters = {
            "lookups": ("skippy_prefix_cache_lookups", "Prefix cache lookups (a prompt looked up) per stage"),
            "hits": ("skippy_prefix_cache_hits", "Prefix cache lookups that found a prefix worth restoring, "
                     "per stage"),
            "restored_tokens": ("skippy_prefix_cache_restored_tokens", "Prompt positions restored from the prefix "
                                "cache rather than computed, per stage"),
            "recorded_tokens": ("skippy_prefix_cache_recorded_tokens", "Tokens of the prefixes recorded in the "
                                "prefix cache, per stage"),
            "evictions": ("skippy_prefix_cache_evictions", "Prefix cache entries dropped to stay within the "
                          "budget, per stage"),
        }
        gauges = {
            "bytes_held": ("skippy_prefix_cache_bytes", "Bytes the prefix cache holds (KV state, token ids and, "
                           "before the final stage, the hidden states recorded), per stage"),
            "entries": ("skippy_prefix_cache_entries", "Prefixes the prefix cache holds, per stage"),
            "tokens_held": ("skippy_prefix_cache_tokens", "Tokens of the prefixes the prefix cache holds, per stage"),
            "budget_bytes": ("skippy_prefix_cache_budget_bytes", "The most bytes the prefix cache may hold "
                             "(0: off), per stage"),
        }
        families = [(field, CounterMetricFamily(name, doc, labels=["stage"])) for field, (name, doc) in
                    counters.items()]
        families += [(field, GaugeMetricFamily(name, doc, labels=["stage"])) for field, (name, doc) in
                     gauges.items()]
        for index, stats in sorted(caches.items()):
            for field, family in families:
                family.add_metric([str(index)], getattr(stats, field))
        yield from (family for _, family in families)
        yield from self._cache_tiers(caches)

    @staticmethod
    def _cache_tiers(caches: dict) -> Iterable:
        """The prefix caches per tier (memory, disk): what each holds and the hits each served."""
        labels = ["stage", "tier"]
        hits = CounterMetricFamily("skippy_prefix_cache_tier_hits", "Prefix cache lookups each tier served "
                                   "(memory, disk), per stage", labels=labels)
        held = {name: GaugeMetricFamily(f"skippy_prefix_cache_tier_{name}", doc, labels=labels) for name, doc in (
            ("entries", "Prefixes each tier of the prefix cache holds, per stage"),
            ("bytes", "Bytes each tier of the prefix cache holds, per stage"),
            ("tokens", "Tokens of the prefixes each tier of the prefix cache holds, per stage"),
            ("budget_bytes", "The most bytes each tier of the prefix cache may hold (0: off), per stage"))}
        writes = CounterMetricFamily("skippy_prefix_cache_disk_writes", "Prefix cache entries written to the disk "
                                     "tier, per stage", labels=["stage"])
        disk_on = GaugeMetricFamily("skippy_prefix_cache_disk_on", "Whether the prefix cache's disk tier is in use "
                                    "(1) or off (0: none, full, or its directory is another daemon's), per stage",
                                    labels=["stage"])
        for index, st in sorted(caches.items()):
            stage = str(index)
            hits.add_metric([stage, "memory"], st.hits - st.disk_hits)
            hits.add_metric([stage, "disk"], st.disk_hits)
            for tier, values in (("memory", (st.entries, st.bytes_held, st.tokens_held, st.budget_bytes)),
                                 ("disk", (st.disk_entries, st.disk_bytes, st.disk_tokens,
                                           st.disk_budget_bytes if st.disk_on else 0))):
                for family, value in zip(held.values(), values):
                    family.add_metric([stage, tier], value)
            writes.add_metric([stage], st.disk_writes)
            disk_on.add_metric([stage], int(st.disk_on))
        yield hits
        yield from held.values()
        yield writes
        yield disk_on
