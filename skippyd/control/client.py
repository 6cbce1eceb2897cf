"""A control channel client: one websocket connection to a skippyd, its requests and their replies, every
failure a :class:`ControlError` with the channel's error code. skippyctl and a supervising head (its other
hosts) both speak through it."""

from __future__ import annotations

import collections
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, HandshakeError, open_websocket_url

from skippyd.control import messages as m


class ControlError(Exception):
    """Anything that keeps a request from getting its answer; the message is for the user, ``code`` the
    control channel's error code ("unreachable" when the daemon could not be asked at all)."""

    def __init__(self, message: str, *, code: str = "failed"):
        super().__init__(message)
        self.code = code


class ControlClient:
    """One control connection to the daemon ``name``. Several requests may be in flight on it: a reply to
    another request than the one being read is kept for whoever reads that request's replies, never dropped.
    ``timeout``: how long :meth:`call` waits for an answer unless told (None: as long as it takes); ``label``
    goes before the daemon's own error messages (which host said so, where several are asked)."""

    def __init__(self, ws, name: str, *, timeout: float | None = None, label: str = ""):
        self.ws, self.name, self.timeout, self.label = ws, name, timeout, label
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
            raise ControlError(f"{self.name} closed the connection {_how(exc.reason)}", code="unreachable") from None
        finally:
            if not kept:
                self._kept.pop(request.id, None)

    async def call(self, request, timeout: float | None = None) -> object:
        """A request with one answer: its data, or ControlError (an Error reply, no answer in time, the
        connection gone)."""
        wait = timeout if timeout is not None else self.timeout
        try:
            with trio.fail_after(wait if wait is not None else float("inf")):
                async for reply in self.replies(request):
                    if isinstance(reply, m.Error):
                        raise ControlError(f"{self.label}{reply.message}", code=reply.code)
                    if isinstance(reply, m.Data):
                        return reply.data
                    if isinstance(reply, m.Result):
                        return reply.result
        except trio.TooSlowError:
            raise ControlError(f"{self.label}no answer within {wait:g} s", code="unreachable") from None
        raise ControlError(f"{self.label}no answer")


@asynccontextmanager
async def connect(url: str, token: str, *, name: str, connect_timeout: float = 5.0, disconnect_timeout: float = 2.0,
                  timeout: float | None = None, label: str = "", token_hint: str = "",
                  reach_hint: str = "") -> AsyncIterator[ControlClient]:
    """A control connection to ``url`` with ``token`` (see :class:`ControlClient` for ``name``, ``timeout``
    and ``label``). A refused token or an unreachable daemon is a ControlError naming ``name``, with
    ``token_hint`` or ``reach_hint`` after it (what the user can do about it)."""
    opened = False
    try:
        async with open_websocket_url(url, extra_headers=[(b"authorization", f"Bearer {token}".encode())],
                                      connect_timeout=connect_timeout, disconnect_timeout=disconnect_timeout) as ws:
            opened = True
            yield ControlClient(ws, name, timeout=timeout, label=label)
    except ConnectionRejected as exc:
        if exc.status_code == 401:
            raise ControlError(f"{name} refused the control token{token_hint}", code="unauthorized") from None
        raise ControlError(f"{name} rejected the connection ({exc.status_code})", code="unreachable") from None
    except (HandshakeError, OSError, trio.TooSlowError) as exc:
        if opened:  # the caller's own failure, not the connection's
            raise
        raise ControlError(f"cannot reach {name}: {_why(exc)}{reach_hint}", code="unreachable") from None


def _how(reason) -> str:
    """How a websocket close reads to an operator: without a close frame (1006), the daemon went away."""
    if reason is None or reason.code == 1006:
        return "abruptly (the daemon stopped or crashed: its log says which)"
    return f"({reason.code} {reason.name}{': ' + reason.reason if reason.reason else ''})"


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
