"""The web console's HTTP routes, beside the OpenAI API on the head's ``--openai`` listener.

    GET  /                                   the page (static/index.html); its scripts and styles under /console/
    GET  /console/api/access                 whether the views need the key, whether actions are allowed
    GET  /console/api/state                  the whole state: pipeline, sessions, lanes, warnings
    GET  /console/api/events                 the same as server-sent events, when it changes (at most 4 a second)
    GET  /console/api/history                tok/s, TTFT and queue length, the last 15 minutes
    POST /console/api/sessions/{id}/kill     cancel a generation (freed on every stage)
    POST /console/api/lanes/drain|undrain    refuse new generations / take them again

The page and its files are open; the views need the key when one is set; the
actions always need it, and with no key are refused unless the listener is
loopback (see :mod:`skippyd.openai.auth`). An action must come as JSON, which
a page of another origin cannot send without a preflight this server never
answers, and on a loopback listener without a key it must name a loopback
host (a name rebound to 127.0.0.1 by some page's DNS is turned away).
"""

from __future__ import annotations

import json
import logging
import time
from importlib import resources
from typing import Any

import attrs
import trio

from skippyd.console.feed import ConsoleFeed
from skippyd.console.history import History
from skippyd.console.pipeline import POLL_S, PipelineMonitor
from skippyd.openai.app import ApiError
from skippyd.openai.auth import Access, Need
from skippyd.ports import NodeView

log = logging.getLogger("skippyd.openai")

KILL_WAIT_S = 5.0  # a kill answers once the session is released everywhere, or after this long
STATIC_TYPES = {".html": b"text/html; charset=utf-8", ".js": b"text/javascript; charset=utf-8",
                ".css": b"text/css; charset=utf-8", ".svg": b"image/svg+xml"}
PAGE_HEADERS = [
    (b"cache-control", b"no-cache"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),  # the actions' buttons inside someone else's frame: no
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data: blob:; frame-ancestors 'none'"),
]
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


@attrs.frozen
class Route:
    method: str
    path: str  # exact, or a prefix when it ends with "/"
    handler: Any  # async (Exchange) -> None
    need: Need
    label: str  # the metrics' endpoint label (bounded: templates, not paths)


def _static(name: str) -> bytes:
    return resources.files("skippyd.console").joinpath("static", name).read_bytes()


class ConsoleRoutes:
    """The console's handlers over one node; :meth:`routes` for the app, :meth:`serve` for the tasks that
    keep its figures (the pipeline's polling, the history, the feed)."""

    def __init__(self, node: NodeView, access: Access, *, warnings=lambda: []):
        self.node = node
        self.access = access
        self.monitor = PipelineMonitor(node)
        self.history = History(node)
        self.feed = ConsoleFeed(node, self.monitor, warnings=warnings)
        self.files = {name: _static(name) for name in ("index.html", "console.js", "console.css")}

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.monitor.serve)
            await nursery.start(self.history.serve)
            await nursery.start(self.feed.serve)
            task_status.started()

    def routes(self) -> list[Route]:
        api = "/console/api/"
        return [
            Route("GET", "/", self.page, Need.OPEN, "/"),
            Route("GET", "/console/", self.file, Need.OPEN, "/console/{file}"),
            Route("GET", api + "access", self.describe_access, Need.OPEN, api + "access"),
            Route("GET", api + "state", self.state, Need.READ, api + "state"),
            Route("GET", api + "events", self.events, Need.READ, api + "events"),
            Route("GET", api + "history", self.history_view, Need.READ, api + "history"),
            Route("POST", api + "sessions/", self.kill, Need.ACTION, api + "sessions/{id}/kill"),
            Route("POST", api + "lanes/drain", self.drain, Need.ACTION, api + "lanes/drain"),
            Route("POST", api + "lanes/undrain", self.undrain, Need.ACTION, api + "lanes/undrain"),
        ]

    # ------------------------------------------------------------ the page
    async def page(self, ex) -> None:
        await ex.respond(200, self.files["index.html"], STATIC_TYPES[".html"], PAGE_HEADERS)

    async def file(self, ex) -> None:
        name = ex.path[len("/console/"):]
        data = self.files.get(name)
        if data is None:
            raise ApiError(404, f"no such file: {ex.path}", code="not_found")
        await ex.respond(200, data, STATIC_TYPES[name[name.rindex("."):]], PAGE_HEADERS)

    # ------------------------------------------------------------ views
    async def describe_access(self, ex) -> None:
        a = self.access
        await ex.json(200, {"key_required": a.key is not None, "loopback": a.loopback,
                            "actions": "key" if a.key is not None else ("open" if a.loopback else "refused")})

    async def state(self, ex) -> None:
        monitor = self.monitor
        if monitor.reported_at is None or time.time() - monitor.reported_at > POLL_S:
            await monitor.poll()
        self.feed.refresh()
        await ex.json(200, self.feed.snapshot)

    async def history_view(self, ex) -> None:
        await ex.json(200, self.history.view())

    async def events(self, ex) -> None:
        """Server-sent events: each ``data:`` the whole state (``seq`` counts them); a comment every
        KEEPALIVE_S of quiet. Ends when the client goes."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_when_gone, ex, nursery.cancel_scope)
            await ex.start(200, b"text/event-stream", [(b"cache-control", b"no-cache"),
                                                       (b"x-accel-buffering", b"no")])
            with self.feed.subscribe() as sub:
                while True:
                    snapshot = await sub.next()
                    if snapshot is None:
                        await ex.write(b": keepalive\n\n")
                    else:
                        await ex.write(b"id: %d\ndata: " % snapshot["seq"]
                                       + json.dumps(snapshot, separators=(",", ":")).encode() + b"\n\n")

    # ------------------------------------------------------------ actions
    def _check_action(self, ex) -> None:
        if not (ex.header(b"content-type") or "").startswith("application/json"):
            raise ApiError(415, "console actions are sent as application/json", code="unsupported_media_type")
        if self.access.key is None:
            host = (ex.header(b"host") or "").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in LOOPBACK_NAMES:
                raise ApiError(403, f"a console action without an API key must be sent to a loopback address, "
                                    f"not {host!r}", code="forbidden")

    def _engine(self):
        engine = self.node.engine
        if engine is None:
            raise ApiError(503, "the model is loading", code="loading")
        return engine

    async def kill(self, ex) -> None:
        self._check_action(ex)
        rest = ex.path[len("/console/api/sessions/"):]
        sid, _, verb = rest.partition("/")
        if verb != "kill" or not sid.isdigit():
            raise ApiError(404, f"no such endpoint: {ex.method} {ex.path}", code="not_found")
        session_id = int(sid)
        engine = self._engine()
        if not engine.kill(session_id, "killed by an operator (the web console)"):
            raise ApiError(404, f"unknown session {session_id} (finished, or never started here)",
                           code="not_found")
        with trio.move_on_after(KILL_WAIT_S):
            while session_id in engine.live:
                await trio.sleep(0.01)
        released = session_id not in engine.live
        log.info("console: killed session %d%s", session_id, "" if released else " (still cleaning up)")
        self.feed.refresh()
        await ex.json(200, {"killed": str(session_id), "released": released})

    async def drain(self, ex) -> None:
        self._check_action(ex)
        pool = self.node.pool
        if pool is not None:
            await pool.drain("the head's lanes are drained (from the web console): no new generations until "
                             "they are undrained")
        log.info("console: lanes drained")
        self.feed.refresh()
        await ex.json(200, self.feed.snapshot["lanes"])

    async def undrain(self, ex) -> None:
        self._check_action(ex)
        pool = self.node.pool
        if pool is not None:
            pool.undrain()
        log.info("console: lanes undrained")
        self.feed.refresh()
        await ex.json(200, self.feed.snapshot["lanes"])


async def _cancel_when_gone(ex, scope: trio.CancelScope) -> None:
    await ex.wait_disconnect()
    scope.cancel()
