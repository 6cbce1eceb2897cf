"""Serve the OpenAI app, and the web console beside it, with hypercorn's trio worker, in the daemon's nursery."""

from __future__ import annotations

import logging
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from skippyd.listening import explain_bind_errors, is_loopback
from skippyd.openai.app import OpenAIApp
from skippyd.openai.auth import Access, ApiKey
from skippyd.openai.console import ConsoleRoutes
from skippyd.openai.metrics import Metrics

log = logging.getLogger("skippyd.openai")


def _not_hypercorns_banner(record: logging.LogRecord) -> bool:
    """Drops hypercorn's "Running on http://... (CTRL + C to quit)": a daemon's journal has no Ctrl-C, and the
    line after it ("OpenAI API on ...") says where the API is."""
    return not str(record.msg).startswith("Running on ")


class OpenAIServer:
    """``await nursery.start(OpenAIServer(daemon, host, port).run)``: returns once it accepts connections.

    The daemon's ``metrics`` (a :class:`Metrics`) is used when it has one, else
    one is made and set on the daemon, so that other parts can record into it.
    """

    def __init__(self, daemon: Any, host: str, port: int, *, model_id: str | None = None,
                 graceful_timeout_s: float = 5.0, api_key: ApiKey | None = None, public_metrics: bool = False):
        self.daemon = daemon
        self.host, self.port = host, port
        metrics = getattr(daemon, "metrics", None)
        if not isinstance(metrics, Metrics):
            metrics = Metrics(daemon)
            try:
                daemon.metrics = metrics
            except AttributeError:
                pass
        self.metrics = metrics
        self.access = Access(api_key, loopback=is_loopback(host), public_metrics=public_metrics)
        self.app = OpenAIApp(daemon, model_id=model_id, metrics=metrics, access=self.access)
        self.console = ConsoleRoutes(daemon, self.access, warnings=self.warnings)
        self.app.mount(self.console.routes())
        self.graceful_timeout_s = graceful_timeout_s
        self._shutdown = trio.Event()

    def _config(self) -> Config:
        config = Config()
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        config.bind = [f"{host}:{self.port}"]
        errorlog = logging.getLogger("skippyd.openai.http")
        if _not_hypercorns_banner not in errorlog.filters:
            errorlog.addFilter(_not_hypercorns_banner)
        config.errorlog = errorlog
        config.accesslog = None
        config.graceful_timeout = self.graceful_timeout_s
        config.include_server_header = False
        return config

    def warnings(self) -> list[str]:
        """What the operator should know about this listener (the console and ``status`` show it)."""
        if self.access.exposed:
            return [f"the OpenAI API on {self.host}:{self.port} is reachable from other hosts and has no API key: "
                    "anyone who can reach it can use the model (give skippyd --api-key-file FILE)"]
        return []

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.console.serve)
            with explain_bind_errors("OpenAI API", self.host, self.port, "--openai HOST:PORT"):
                binds = await nursery.start(lambda task_status: serve(self.app, self._config(),
                                                                      shutdown_trigger=self._shutdown.wait,
                                                                      task_status=task_status))
            if binds:
                self.port = int(binds[0].rsplit(":", 1)[1])
            log.info("OpenAI API on http://%s:%d/v1 (model %s), web console on http://%s:%d/", self.host, self.port,
                     self.app.model_id, self.host, self.port)
            for line in self.warnings():
                log.warning("%s", line)
            task_status.started(self)

    def shutdown(self) -> None:
        """Stop accepting, finish running requests (up to the graceful timeout), then return from run."""
        self._shutdown.set()
