"""Aggregate tok/s, time to first token and queue length over the last 15 minutes, one sample a second.

Recorded on the head whether or not anyone watches, so that the history page
shows the quarter of an hour before it was opened. Tokens per second count
every generation's tokens, running or finished; the time to first token is
the mean over the generations that finished in that second (the engine's
receipts), None in a second when none did.
"""

from __future__ import annotations

import collections
import time

import trio

from skippyd.ports import NodeView

SAMPLE_S = 1.0
KEEP_S = 15 * 60


class History:
    def __init__(self, node: NodeView):
        self.node = node
        self.samples: collections.deque = collections.deque(maxlen=int(KEEP_S / SAMPLE_S))
        self._tokens: int | None = None  # the token count at the last sample
        self._at = time.time()

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(SAMPLE_S)
            self.sample()

    def sample(self) -> None:
        engine = self.node.engine
        now = time.time()
        if engine is None:
            self._at = now
            return
        live = list(engine.live.values())
        tokens = engine.totals["completion_tokens"] + sum(g.generated for g in live)
        elapsed = max(1e-3, now - self._at)
        rate = 0.0 if self._tokens is None else max(0, tokens - self._tokens) / elapsed
        finished = [r.ttft_ms for r in list(engine.receipts) if self._at < r.finished_at <= now and r.tokens]
        queued = sum(1 for g in live if str(g.state) == "queued")
        self.samples.append({"t": round(now, 3), "tokens_per_s": round(rate, 2), "queued": queued,
                             "running": len(live),
                             "ttft_ms": round(sum(finished) / len(finished), 1) if finished else None})
        self._tokens, self._at = tokens, now

    def view(self) -> dict:
        return {"sample_s": SAMPLE_S, "keep_s": KEEP_S, "samples": list(self.samples)}
