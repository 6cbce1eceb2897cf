"""The websocket client of skippyctl: one request, its replies, errors mapped to one line."""

from __future__ import annotations

import collections
import itertools
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, HandshakeError, open_websocket_url

from skippyd.control import messages as m
from skippyd.control.token import default_token_file


class ControlError(Exception):
    """Anything that keeps a command from getting its answer; the message is for the user."""

    def __init__(self, message: str, *, code: str = "failed"):
        super().__init__(message)
        self.code = code


SYSTEM_TOKEN_FILE = Path("/var/lib/skippy/control.token")  # skippyd.service's StateDirectory=skippy


def token_candidates() -> list[Path]:
    """Where skippyctl looks for the token without --token-file: where a daemon run by this user writes
    it, then the system service's state directory."""
    return [default_token_file(), SYSTEM_TOKEN_FILE]


def read_token(token_file: Path | None) -> str:
    if token_file is None:
        candidates = token_candidates()
        token_file = next((p for p in candidates if p.exists()), candidates[0])
        if not token_file.exists():
            raise ControlError(f"no control token at {' or '.join(map(str, candidates))} "
                               "(is skippyd running here? use --token-file)")
    try:
        token = token_file.read_text().strip()
    except FileNotFoundError:
        raise ControlError(f"no control token at {token_file} (is skippyd running here? use --token-file)") from None
    except PermissionError:
        raise ControlError(f"cannot read the control token {token_file}: permission denied "
                           "(it is readable by the service user only; try sudo)") from None
    except OSError as exc:
        raise ControlError(f"cannot read the control token {token_file}: {exc.strerror or exc}") from None
    if not token:
        raise ControlError(f"the control token file {token_file} is empty")
    return token


class ControlClient:
    """One control connection. Several requests may be in flight on it: a reply to another request than the
    one being read is kept for whoever reads that request's replies, never dropped."""

    def __init__(self, ws, url: str):
        self.ws = ws
        self.url = url
        self._ids = itertools.count(1)
        self._kept: dict[str, collections.deque] = {}
        self._reading = trio.Lock()

    def new_id(self) -> str:
        return str(next(self._ids))

    async def replies(self, request) -> AsyncIterator[m.Reply]:
        """Send `request`; yield its replies until the final one (Result, Data or Error)."""
        kept = self._kept.setdefault(request.id, collections.deque())
        try:
            await self.ws.send_message(m.dump(request))
            while True:
                if not kept:
                    # one reader at a time (a fair lock): it files what it reads under the reply's id
                    async with self._reading:
                        if not kept:
                            reply = m.parse_reply(await self.ws.get_message())
                            self._kept.setdefault(reply.id, collections.deque()).append(reply)
                    continue
                reply = kept.popleft()
                yield reply
                if not isinstance(reply, m.Piece):
                    return
        except ConnectionClosed as exc:
            raise ControlError(f"skippyd at {self.url} closed the connection {_how(exc.reason)}") from None
        finally:
            if not kept:
                self._kept.pop(request.id, None)

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


def check_url(url: str) -> str:
    """The control URL, with ws:// added to a bare HOST:PORT; ControlError if it cannot be one."""
    if "://" not in url:
        url = f"ws://{url}"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ControlError(f"invalid --url {url!r}: {exc}", code="bad_request") from None
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ControlError(f"invalid --url {url!r}: expected ws://HOST:PORT", code="bad_request")
    return url


def _how(reason) -> str:
    """How a websocket close reads to an operator: without a close frame (1006), the daemon went away."""
    if reason is None or reason.code == 1006:
        return "abruptly (the daemon stopped or crashed: its log says which)"
    return f"({reason.code} {reason.name}{': ' + reason.reason if reason.reason else ''})"


@asynccontextmanager
async def open_control(url: str, token_file: Path | None, *, connect_timeout: float = 5.0):
    url = check_url(url)
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
        raise ControlError(f"cannot reach skippyd at {url}: {_why(exc)} (is it running? see --url)") from None


def _why(exc: BaseException) -> str:
    """The most telling message in an exception chain (trio-websocket wraps the OSError that says why)."""
    seen, todo, first = set(), [exc], ""
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
        if isinstance(e, trio.TooSlowError):
            return "timed out"
        first = first or str(e)
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return first or "connection failed"


def call_once(url: str, token_file: Path | None, make_request) -> object:
    """Run one request synchronously (for thin typer commands)."""

    async def go():
        async with open_control(url, token_file) as client:
            return await client.call(make_request(client.new_id()))

    return trio.run(go)
