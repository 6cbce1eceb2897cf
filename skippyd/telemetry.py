"""Spans: how long a named piece of work took, with the ids that say whose work it was.

    with span("head.prefill", request=rid, session=sid) as s:
        ...
        s.set(tokens=n)          # add ids or numbers learnt along the way

Three levels, chosen with ``daemon.telemetry`` in skippyd.toml(5):

``off``      (default) ``span()`` returns one shared object whose enter and
             exit do nothing: no clock read, no allocation beyond the call's
             keyword arguments. Safe on the hot path.
``summary``  per span name: count, total and maximum duration, kept in memory
             (``summary()``; exported on ``/metrics`` and logged at exit).
``debug``    the summary, and one JSON line per finished span on the sink
             (stderr by default): name, span id, parent span id, start time,
             duration and the ids given (request, session, ...).

Spans nest through a context variable, so a span opened inside another one,
in the same task or in a task started from it, names it as its parent.
"""

from __future__ import annotations

import atexit
import contextvars
import itertools
import json
import logging
import sys
import threading
import time
from typing import IO, Any

log = logging.getLogger("skippyd.telemetry")

LEVELS = ("off", "summary", "debug")

_level = 0  # index into LEVELS
_sink: IO[str] = sys.stderr
_lock = threading.Lock()  # spans may end on worker threads (trio.to_thread)
_totals: dict[str, list] = {}  # name -> [count, total_s, max_s, errors]
_ids = itertools.count(1)
_current: contextvars.ContextVar[_Span | None] = contextvars.ContextVar("skippy_span", default=None)
_atexit_registered = False


def configure(level: str = "off", *, sink: IO[str] | None = None) -> None:
    """Set the level (off | summary | debug) and, for debug, where the JSON lines go."""
    global _level, _sink, _atexit_registered
    if level not in LEVELS:
        raise ValueError(f"telemetry level must be one of {', '.join(LEVELS)}, not {level!r}")
    _level = LEVELS.index(level)
    _sink = sink or sys.stderr
    if _level and not _atexit_registered:
        atexit.register(log_summary)
        _atexit_registered = True


def level() -> str:
    return LEVELS[_level]


def enabled() -> bool:
    return _level > 0


class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def set(self, **ids: Any) -> None:
        pass


_NO_SPAN = _NoSpan()


class _Span:
    __slots__ = ("name", "ids", "span_id", "parent", "wall", "t0", "_token")

    def __init__(self, name: str, ids: dict[str, Any]):
        self.name = name
        self.ids = ids

    def set(self, **ids: Any) -> None:
        self.ids.update(ids)

    def __enter__(self) -> _Span:
        parent = _current.get()
        self.parent = parent.span_id if parent is not None else None
        self.span_id = next(_ids)
        self._token = _current.set(self)
        self.wall = time.time()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        duration = time.perf_counter() - self.t0
        try:
            _current.reset(self._token)
        except ValueError:  # exited in another context than it was entered (a bug in the caller, not fatal)
            pass
        failed = exc_type is not None
        with _lock:
            entry = _totals.get(self.name)
            if entry is None:
                entry = _totals[self.name] = [0, 0.0, 0.0, 0]
            entry[0] += 1
            entry[1] += duration
            entry[2] = max(entry[2], duration)
            entry[3] += failed
        if _level >= 2:
            record = {"span": self.name, "span_id": self.span_id, "parent_id": self.parent,
                      "start": round(self.wall, 6), "duration_ms": round(duration * 1e3, 3), **self.ids}
            if failed:
                record["error"] = exc_type.__name__
            _write(record)
        return False


def span(name: str, **ids: Any) -> _Span | _NoSpan:
    """A context manager timing `name`; `ids` (request=, session=, stage=, ...) go into its record."""
    if not _level:
        return _NO_SPAN
    return _Span(name, ids)


def _write(record: dict) -> None:
    line = json.dumps(record, default=str, separators=(",", ":")) + "\n"
    try:
        with _lock:
            _sink.write(line)
            _sink.flush()
    except (OSError, ValueError):  # a closed or full sink must never break the work it measures
        pass


def summary() -> dict[str, dict[str, float]]:
    """Per span name: count, total_s, max_s, errors (empty when telemetry is off)."""
    with _lock:
        return {name: {"count": c, "total_s": t, "max_s": m, "errors": e} for name, (c, t, m, e) in _totals.items()}


def reset() -> None:
    with _lock:
        _totals.clear()


def log_summary() -> None:
    for name, s in sorted(summary().items()):
        mean_ms = s["total_s"] / s["count"] * 1e3 if s["count"] else 0.0
        log.info("span %s: %d, mean %.3f ms, max %.3f ms, %d failed", name, s["count"], mean_ms,
                 s["max_s"] * 1e3, s["errors"])
