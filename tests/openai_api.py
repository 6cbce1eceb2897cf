"""A real 2-stage pipeline serving the OpenAI API, for the tests that talk to it with client libraries.

The stages are skippyd processes started with `--openai` (stage 1 has no head and ignores it); the
clients are sync, so trio tests run their calls in a worker thread (:func:`run`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import Pipeline, free_ports, split_for_test

try:  # the HTTP client the installed openai release is built on
    import httpx2
except ImportError:  # openai 1.x
    import httpx as httpx2


class Api:
    def __init__(self, pipe: Pipeline, port: int, *, timeout: float = 120):
        self.pipe = pipe
        self.base = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=timeout)

    def http(self) -> httpx2.Client:
        return httpx2.Client(base_url=self.base, timeout=60)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        with self.http() as h:
            text = h.get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


def wait_healthy(api: Api, timeout: float = 20.0) -> None:
    """READY comes once the control channel is up; the HTTP listener follows it by milliseconds."""
    with api.http() as h:
        wait_for_health(h, timeout, api.pipe.head.log)


def wait_for_health(h: httpx2.Client, timeout: float = 20.0, log: Callable[[], str] = str) -> None:
    """Poll `h`'s /health until it answers 200; TimeoutError with `log()` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if h.get("/health").status_code == 200:
                return
        except httpx2.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"/health not 200 after {timeout}s:\n{log()}")
        time.sleep(0.1)


@contextlib.contextmanager
def serving(model_path: Path, work: Path, *, ctx: int, lanes: int = 2, timeout: float = 120,
            extra: tuple[str, ...] = ()) -> Iterator[Api]:
    """The model split in 2 under `work`, served with `--openai` (and the flags `extra`); every stage must exit
    cleanly at the end."""
    split_for_test(model_path, 2, work)
    port = free_ports(1)[0]
    pipe = Pipeline(work / "topology.toml", work,
                    extra=["--openai", f"127.0.0.1:{port}", "--ctx", str(ctx), "--lanes", str(lanes), *extra]).start()
    try:
        api = Api(pipe, port, timeout=timeout)
        wait_healthy(api)
        yield api
    finally:
        codes = pipe.stop()
    assert all(c == 0 for c in codes.values()), codes


def run(fn, *args, **kw):
    """A sync (client library) call from a trio test, in a worker thread."""
    return trio.to_thread.run_sync(lambda: fn(*args, **kw))
