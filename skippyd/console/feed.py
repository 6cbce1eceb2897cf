"""One snapshot of what the console shows, republished when it changes, at most once every MIN_INTERVAL_S.

Every open event stream reads the same snapshot (built once, however many
pages are open): a page with 64 live sessions gets at most 1 / MIN_INTERVAL_S
updates a second, each the whole state, so that a page that missed one
needs no other.
"""

from __future__ import annotations

import json
import time

import trio

from skippyd.console import views
from skippyd.console.pipeline import PipelineMonitor
from skippyd.ports import NodeView

MIN_INTERVAL_S = 0.25  # at most 4 updates a second
KEEPALIVE_S = 15.0  # a stream with nothing new sends a comment this often (proxies drop silent connections)


class ConsoleFeed:
    def __init__(self, node: NodeView, monitor: PipelineMonitor, *, warnings=lambda: []):
        self.node = node
        self.monitor = monitor
        self.warnings = warnings  # what the operator should know (an exposed listener, say)
        self.seq = 0  # the snapshot's number: it grows by one per publication
        self.snapshot: dict | None = None
        self._compared: str | None = None  # the last snapshot without its number and time
        self._changed = trio.Event()
        self._watchers = 0
        self._watched = trio.Event()

    def build(self) -> dict:
        d = self.node
        head = d.head
        return {"model": head.model_name if head is not None and head.model is not None else None,
                "role": d.describe_role(),
                "draining": d.draining,
                "sessions": views.sessions(d), "lanes": views.lanes(d), "pipeline": self.monitor.view(),
                "warnings": list(self.warnings())}

    def refresh(self) -> bool:
        """Build the snapshot; publish it if it differs from the last. True if it did."""
        state = self.build()
        compared = json.dumps(state, sort_keys=True, default=str)
        if compared == self._compared and self.snapshot is not None:
            return False
        self._compared = compared
        self.seq += 1
        self.snapshot = {"seq": self.seq, "time": time.time(), **state}
        self._changed.set()
        self._changed = trio.Event()
        return True

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Rebuild while someone listens, at most every MIN_INTERVAL_S."""
        task_status.started()
        while True:
            await self._watched.wait()
            self.refresh()
            await trio.sleep(MIN_INTERVAL_S)

    def subscribe(self) -> Subscription:
        """``with feed.subscribe() as sub: await sub.next()``: the snapshots as they are published (the current
        one first). The pipeline is polled, and the snapshot rebuilt, while any subscription is open."""
        return Subscription(self)


class Subscription:
    def __init__(self, feed: ConsoleFeed):
        self.feed = feed
        self.seen = 0
        self._watch = feed.monitor.watching()

    def __enter__(self) -> Subscription:
        feed = self.feed
        feed._watchers += 1
        feed._watched.set()
        self._watch.__enter__()
        if feed.snapshot is None:
            feed.refresh()
        return self

    def __exit__(self, *exc) -> None:
        self._watch.__exit__(*exc)
        feed = self.feed
        feed._watchers -= 1
        if feed._watchers == 0:
            feed._watched = trio.Event()

    async def next(self, keepalive_s: float = KEEPALIVE_S) -> dict | None:
        """The next snapshot not seen yet; None after keepalive_s without one."""
        feed = self.feed
        if feed.seq <= self.seen:
            with trio.move_on_after(keepalive_s):
                await feed._changed.wait()
        if feed.seq <= self.seen:
            return None
        self.seen = feed.seq
        return feed.snapshot
