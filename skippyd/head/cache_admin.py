"""The prefix caches of the whole pipeline, as the head sees them (``skippyctl cache``, ``/metrics``).

The head reports its own cache (stage 0) and asks the rest with a
``CacheQuery`` on a connection of its own to stage 1, opened for the query
and closed after it: a lane is a generation's, and a query must not wait for
one to be free. Stage 1 answers for itself and every later stage (a middle
stage asks the next one), so the report lists every stage in order.

A stage that cannot be reached or answers with an error fails the whole
report with :class:`CacheReportError`, which names the stage (the first one
whose answer is missing) and keeps what was gathered before it in
``partial``: a report never passes off part of the pipeline as all of it.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from skippyd.stage.downstream import DownstreamError
from skippyd.wire.messages import CacheQuery, CacheReport, CacheStats, ErrorReply

log = logging.getLogger("skippyd.head")

_query_ids = itertools.count(1)  # the one-off connection carries nothing else: any id is its own


class CacheReportError(Exception):
    """A stage's prefix cache could not be reported (or cleared): ``stage`` is its index; ``partial`` holds the
    stages reported before it."""

    def __init__(self, stage: int, message: str, partial: list[CacheStats] | None = None):
        super().__init__(message)
        self.stage = stage
        self.partial = list(partial or [])


def clear_local(cache, stage: int, disk: bool = False) -> int:
    """Empty one local cache (with ``disk``, its disk tier too); how many entries it held."""
    dropped = cache.clear(disk=disk)
    log.info("stage %d: prefix cache cleared (%d entries%s)", stage, dropped,
             ", the disk tier's included" if disk else "")
    return dropped


async def cache_report(node: Any, *, clear: bool = False, disk: bool = False) -> list[CacheStats]:
    """Every stage's :class:`CacheStats`, stage 0 first (``node``: the HeadNode, which imports this module); with
    ``clear``, each cache is emptied before it reports (with ``disk``, its disk tier too). Raises
    CacheReportError (see the module docstring)."""
    engine = node.engine
    if engine is None:
        raise CacheReportError(0, "the head is still loading its model")
    if clear:
        clear_local(engine.prefix_cache, 0, disk)
    report = [engine.prefix_cache.stats()]
    if node.single_stage:
        return report
    return report + await query_pipeline(node, clear=clear, disk=disk, partial=report)


async def query_pipeline(node: Any, *, clear: bool, partial: list[CacheStats], disk: bool = False
                         ) -> list[CacheStats]:
    """Stages 1..N's stats, by a CacheQuery to stage 1 on a connection opened for it (the lanes' address,
    Hello and timeouts)."""
    pool = node.pool
    n_stages = len(node.topology.stages)
    address = pool.address
    try:
        reply, _wait_us = await pool.request_once(CacheQuery(next(_query_ids), clear=clear, clear_disk=clear and disk))
    except DownstreamError as failure:
        raise CacheReportError(1, f"stage 1 at {address}: {failure.detail}", partial) from failure
    if isinstance(reply, ErrorReply):
        raise CacheReportError(1, f"stage 1 at {address} answered the cache query with an error: "
                                  f"{reply.code.name}: {reply.message}", partial)
    if not isinstance(reply, CacheReport):
        raise CacheReportError(1, f"stage 1 at {address} answered the cache query with "
                                  f"{type(reply).__name__}", partial)
    stages = list(reply.stages)
    expected = list(range(1, n_stages))
    got = [s.stage_index for s in stages]
    if got != expected[:len(got)] or not got:
        raise CacheReportError(1, f"stage 1 at {address} reported stages {got}, expected {expected}",
                               partial)
    if len(got) < len(expected):  # a middle stage without its next one answers for itself only
        missing = expected[len(got)]
        raise CacheReportError(missing, f"stage {missing} did not report its prefix cache (stage {missing - 1} "
                                        f"could not reach it)", partial + stages)
    return stages
