"""Serve the OpenAI app, and the web console beside it, with hypercorn's trio worker, in the daemon's nursery."""

from __future__ import annotations

import logging

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from skippyd.listening import explain_bind_errors, is_loopback
from skippyd.openai.app import OpenAIApp
from skippyd.openai.auth import Access, ApiKey
from skippyd.openai.console import ConsoleRoutes
from skippyd.openai.metrics import Metrics
from skippyd.ports import NodeView

log = logging.getLogger("skippyd.openai")


def _not_hypercorns_banner(record: logging.LogRecord) -> bool:
    """Drops hypercorn's "Running on http://... (CTRL + C to quit)": a daemon's journal has no Ctrl-C, and the
    line after it ("OpenAI API on ...") says where the API is."""
    return not str(record.msg).startswith("Running on ")


class OpenAIServer:
    """``await nursery.start(OpenAIServer(node, host, port).run)``: returns once it accepts connections.

    It counts into `metrics`, the node's registry (one of its own if none is given).
    """

    def __init__(self, node: NodeView, host: str, port: int, *, model_id: str | None = None,
                 graceful_timeout_s: float = 5.0, api_key: ApiKey | None = None, public_metrics: bool = False,
                 metrics: Metrics | None = None):
        self.node = node
        self.host, self.port = host, port
        self.metrics = metrics if metrics is not None else Metrics(node)
        self.access = Access(api_key, loopback=is_loopback(host), public_metrics=public_metrics)
        self.app = OpenAIApp(node, model_id=model_id, metrics=self.metrics, access=self.access)
        self.console = ConsoleRoutes(node, self.access, warnings=self.warnings)
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
