"""A stage's load as a StageReport carries it (:class:`~skippyd.wire.messages.StageLoad`): what its scheduler
has computed, the KV its sessions hold, its prefix cache. The head describes its own stage 0 the same way."""

from __future__ import annotations

import time

from skippyd.wire.messages import StageLoad


def stage_load(index: int, layers: tuple[int, int], sessions, scheduler, context, prefix_cache, *,
               downstream_rtt_us: int = 0, answer_us: int = 0, kv_tokens: int | None = None) -> StageLoad:
    """``sessions`` a SessionTable, ``scheduler`` its Scheduler, ``context`` its llama Context (either may be None
    while the stage loads), ``prefix_cache`` its PrefixCache; ``kv_tokens`` the positions held, where the table
    does not follow them (the head's generations do)."""
    stats = getattr(scheduler, "stats", None)
    held = sessions.snapshot()["sessions"]
    cache = prefix_cache.stats()
    return StageLoad(
        index, layers[0], layers[1], sessions.n_seq_max, clock_us=time.monotonic_ns() // 1000,
        compute_us=int(stats.compute_s * 1e6) if stats else 0, batches=stats.batches if stats else 0,
        tokens=stats.tokens if stats else 0, sessions=len(held),
        kv_tokens=sum(s["position"] for s in held) if kv_tokens is None else kv_tokens,
        kv_capacity=context.n_ctx_seq * context.n_seq_max if context is not None else 0,
        cache_bytes=cache.bytes_held, cache_budget=cache.budget_bytes, downstream_rtt_us=max(0, downstream_rtt_us),
        answer_us=max(0, answer_us))
