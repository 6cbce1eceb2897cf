"""The running sessions and the head's lanes as the console shows them (plain JSON-ready dicts).

Session ids are 63-bit integers: they travel as strings, which a browser's
numbers cannot spoil.
"""

from __future__ import annotations

import time

from skippyd.ports import NodeView

ORIGINS = {"control": "CLI", "openai": "OpenAI"}


def sessions(node: NodeView) -> list[dict]:
    """Every generation running on the head, oldest first."""
    engine = node.engine
    if engine is None:
        return []
    out = []
    for live in sorted(list(engine.live.values()), key=lambda g: g.started):
        rate = live.decode_rate()
        spec = live.speculation.describe() if live.speculation is not None else None
        out.append({"id": str(live.session_id), "request_id": live.request_id,
                    "origin": ORIGINS.get(live.origin, live.origin), "state": str(live.state),
                    "prompt_tokens": live.prompt_tokens, "generated": live.generated,
                    "tokens_per_s": None if rate is None else round(rate, 2),
                    "ttft_ms": None if live.ttft_ms is None else round(live.ttft_ms, 1),
                    "cached_tokens": live.cached_tokens,
                    "acceptance": None if spec is None else spec.get("acceptance"),
                    "age_s": round(time.monotonic() - live.started, 1), "lane": live.lane_id,
                    "killed": live.killed is not None})
    return out


def lanes(node: NodeView) -> dict:
    """The head's lanes to stage 1 (none for a single stage) and whether they take new generations."""
    pool = node.pool
    if pool is None:
        return {"downstream": None, "draining": node.draining, "capacity": 0, "lanes": [], "last_error": None}
    return {"downstream": pool.address, "draining": pool.draining or node.draining,
            "refusal": pool.refusal, "capacity": pool.capacity, "last_error": pool.last_error,
            "lanes": [{**lane, "session_id": None if lane["session_id"] is None else str(lane["session_id"]),
                       "state": str(lane["state"])} for lane in pool.describe()]}
