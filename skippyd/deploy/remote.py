"""The supervising head's way to the other hosts of its deployment: their control channels, as skippyctl reaches
them (the same token, the same messages and client), and the slices it sends them. Every failure is a
:class:`~skippyd.control.client.ControlError` naming the host."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from skippyd.control.client import ControlClient, ControlError, connect
from skippyd.deploy import transfer


@asynccontextmanager
async def open_host(url: str, name: str, token: str, *, timeout: float = 5.0) -> AsyncIterator[ControlClient]:
    """A control connection to the host ``name``; each call waits ``timeout`` for its answer unless told."""
    async with connect(url, token, name=name, connect_timeout=timeout, disconnect_timeout=1, timeout=timeout,
                       label=f"{name}: ") as host:
        yield host


async def call(url: str, name: str, token: str, make: Callable[[str], object], *, timeout: float = 5.0):
    """One request (``make(id)``) to the host, its one answer's data."""
    async with open_host(url, name, token, timeout=timeout) as host:
        return await host.call(make(host.new_id()))


async def send_slice(url: str, name: str, token: str, path: Path, sha256: str, *,
                     on_start: Callable[[], None] | None = None) -> int:
    """Send the file unless the host holds it (resuming where an interrupted transfer stopped); bytes sent.
    `on_start` is called once, before the first chunk goes (not when the host holds the file)."""
    async with open_host(url, name, token, timeout=30.0) as host:
        try:
            return (await transfer.send_slice(host, path, sha256, on_start=on_start)).sent
        except transfer.DamagedThrice as exc:
            raise ControlError(f"{name}: {exc}") from None
