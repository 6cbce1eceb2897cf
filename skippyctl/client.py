"""The websocket client of skippyctl: one request, its replies, errors mapped to one line."""

from __future__ import annotations

import itertools
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, HandshakeError, open_websocket_url

from skippyd.control import messages as m
from skippyd.control.server import default_token_file


class ControlError(Exception):
    """Anything that keeps a command from getting its answer; the message is for the user."""

    def __init__(self, message: str, *, code: str = "failed"):
        super().__init__(message)
        self.code = code


def read_token(token_file: Path | None) -> str:
    path = token_file or default_token_file()
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise ControlError(f"no control token at {path} (is skippyd running here? use --token-file)") from None
    except PermissionError:
        raise ControlError(f"cannot read the control token {path}: permission denied") from None


class ControlClient:
    def __init__(self, ws, url: str):
        self.ws = ws
        self.url = url
        self._ids = itertools.count(1)

    def new_id(self) -> str:
        return str(next(self._ids))

    async def replies(self, request) -> AsyncIterator[m.Reply]:
        """Send `request`; yield its replies until the final one (Result, Data or Error)."""
        try:
            await self.ws.send_message(m.dump(request))
            while True:
                reply = m.parse_reply(await self.ws.get_message())
                if reply.id != request.id:
                    continue
                yield reply
                if not isinstance(reply, m.Piece):
                    return
        except ConnectionClosed as exc:
            raise ControlError(f"skippyd at {self.url} closed the connection ({exc.reason})") from None

    async def call(self, request) -> object:
        """A request with one answer: return its data or raise ControlError."""
        async for reply in self.replies(request):
            if isinstance(reply, m.Error):
                raise ControlError(reply.message, code=reply.code)
            if isinstance(reply, m.Data):
                return reply.data
            if isinstance(reply, m.Result):
                return reply.result
        raise ControlError("no answer")


@asynccontextmanager
async def open_control(url: str, token_file: Path | None, *, connect_timeout: float = 5.0):
    token = read_token(token_file)
    try:
        async with open_websocket_url(url, extra_headers=[(b"authorization", f"Bearer {token}".encode())],
                                      connect_timeout=connect_timeout, disconnect_timeout=2) as ws:
            yield ControlClient(ws, url)
    except ConnectionRejected as exc:
        if exc.status_code == 401:
            raise ControlError(f"skippyd at {url} refused the control token (check --token-file)",
                               code="unauthorized") from None
        raise ControlError(f"skippyd at {url} rejected the connection ({exc.status_code})") from None
    except (HandshakeError, OSError, trio.TooSlowError) as exc:
        raise ControlError(f"cannot reach skippyd at {url}: {exc or type(exc).__name__}") from None


def call_once(url: str, token_file: Path | None, make_request) -> object:
    """Run one request synchronously (for thin typer commands)."""

    async def go():
        async with open_control(url, token_file) as client:
            return await client.call(make_request(client.new_id()))

    return trio.run(go)
