"""Every stage's load, as the head sees it (the console's pipeline view).

The head describes its own stage 0 and asks the rest with a ``StageQuery`` on
a connection of its own to stage 1, opened for the query and closed after it
(as :mod:`skippyd.head.cache_admin` does for the prefix caches: a lane is a
generation's). Each stage answers for itself and every later stage it can
reach, and notes the round trip to its next stage; the head notes its own
to stage 1.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import trio

from skippyd.stage.downstream import DownstreamError
from skippyd.stage.load import stage_load
from skippyd.wire.messages import ErrorReply, StageLoad, StageQuery, StageReport

_query_ids = itertools.count(1)


@attrs.frozen
class LoadReport:
    """The stages that answered, in order from stage 0, and why the next one is missing (None: none is)."""

    stages: tuple[StageLoad, ...]
    failure: str | None = None


async def load_report(node: Any, timeout: float = 1.0) -> LoadReport:
    """Every stage's StageLoad (``node``: the HeadNode); a stage that cannot be reached within ``timeout`` ends
    the report, with the reason."""
    engine = node.engine
    if engine is None:
        return LoadReport((), "the head is still loading its model")
    stage = node.model.stage
    layers = (stage.layer_start, stage.layer_end)

    def own(rtt_us: int = 0) -> StageLoad:
        return stage_load(0, layers, engine.sessions, engine.scheduler, engine.context, engine.prefix_cache,
                          downstream_rtt_us=rtt_us, kv_tokens=sum(g.position for g in list(engine.live.values())))

    if node.single_stage:
        return LoadReport((own(),))
    later, failure, rtt_us = (), None, 0
    with trio.move_on_after(timeout) as scope:
        later, failure, rtt_us = await _query(node.pool)
    if scope.cancelled_caught:
        failure = f"stage 1 at {node.pool.address} did not answer within {timeout:g} s"
    if failure is None and len(later) < len(node.topology.stages) - 1:
        missing = 1 + len(later)
        failure = f"stage {missing} did not answer (stage {missing - 1} could not reach it)"
    return LoadReport((own(rtt_us), *later), failure)


async def _query(pool) -> tuple[tuple[StageLoad, ...], str | None, int]:
    """(stages 1..N's loads, why they are missing, the round trip to stage 1 less its own time)."""
    try:
        reply, wait_us = await pool.request_once(StageQuery(next(_query_ids)))
    except DownstreamError as exc:
        return (), f"stage 1 at {pool.address}: {exc.detail}", 0
    if isinstance(reply, ErrorReply):
        return (), f"stage 1 at {pool.address}: {reply.code.name}: {reply.message}", 0
    if not isinstance(reply, StageReport) or not reply.stages:
        return (), f"stage 1 at {pool.address} answered the stage query with {type(reply).__name__}", 0
    return reply.stages, None, wait_us - reply.stages[0].answer_us
