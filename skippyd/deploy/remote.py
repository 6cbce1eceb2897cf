"""The supervising head's way to the other hosts of its deployment: their control channels, as skippyctl reaches
them (the same token, the same messages), and the slices it sends them."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, HandshakeError, open_websocket_url

from skippyd.control import messages as m
from skippyd.deploy import transfer


class RemoteError(Exception):
    """A host that did not answer, or answered with an error; ``code`` is the control channel's error code
    ("unreachable" when it could not be asked at all)."""

    def __init__(self, message: str, code: str = "failed"):
        super().__init__(message)
        self.code = code


class HostLink:
    """One control connection to a host."""

    def __init__(self, ws, name: str, timeout: float):
        self.ws, self.name, self.timeout = ws, name, timeout
        self._ids = itertools.count(1)

    def new_id(self) -> str:
        return str(next(self._ids))

    async def call(self, make: Callable[[str], object], timeout: float | None = None):
        """One request (``make(id)``), its one answer's data; RemoteError for an Error reply or no answer."""
        request = make(self.new_id())
        try:
            with trio.fail_after(timeout or self.timeout):
                await self.ws.send_message(m.dump(request))
                while True:
                    reply = m.parse_reply(await self.ws.get_message())
                    if reply.id != request.id or isinstance(reply, m.Piece):
                        continue
                    if isinstance(reply, m.Error):
                        raise RemoteError(f"{self.name}: {reply.message}", reply.code)
                    return reply.data if isinstance(reply, m.Data) else reply.result
        except trio.TooSlowError:
            raise RemoteError(f"{self.name}: no answer within {timeout or self.timeout:g} s", "unreachable") from None
        except ConnectionClosed:
            raise RemoteError(f"{self.name}: closed the control connection", "unreachable") from None


@asynccontextmanager
async def open_host(url: str, name: str, token: str, *, timeout: float = 5.0):
    try:
        async with open_websocket_url(url, extra_headers=[(b"authorization", f"Bearer {token}".encode())],
                                      connect_timeout=timeout, disconnect_timeout=1) as ws:
            yield HostLink(ws, name, timeout)
    except ConnectionRejected as exc:
        if exc.status_code == 401:
            raise RemoteError(f"{name} refused the deployment's control token", "unauthorized") from None
        raise RemoteError(f"{name} rejected the control connection ({exc.status_code})", "unreachable") from None
    except trio.TooSlowError:
        raise RemoteError(f"{name} is unreachable (no connection within {timeout:g} s)", "unreachable") from None
    except (HandshakeError, OSError) as exc:
        why = str(exc.__cause__ or exc) or type(exc).__name__
        raise RemoteError(f"{name} is unreachable ({why})", "unreachable") from None


async def call(url: str, name: str, token: str, make, *, timeout: float = 5.0):
    async with open_host(url, name, token, timeout=timeout) as host:
        return await host.call(make)


async def send_slice(url: str, name: str, token: str, path: Path, sha256: str, *,
                     on_start: Callable[[], None] | None = None) -> int:
    """Send the file unless the host holds it (resuming where an interrupted transfer stopped); bytes sent.
    `on_start` is called once, before the first chunk goes (not when the host holds the file)."""
    async with open_host(url, name, token, timeout=30.0) as host:
        try:
            return (await transfer.send_slice(host, path, sha256, errors=(RemoteError,), on_start=on_start)).sent
        except transfer.DamagedThrice as exc:
            raise RemoteError(f"{name}: {exc}") from None
