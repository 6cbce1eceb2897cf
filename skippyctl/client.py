"""The websocket client of skippyctl: one request, its replies, errors mapped to one line."""

from __future__ import annotations

import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from skippyd.control.client import ControlClient, ControlError, connect
from skippyd.control.token import default_token_file

__all__ = ["ControlClient", "ControlError", "call_once", "check_url", "open_control", "read_token"]


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


@asynccontextmanager
async def open_control(url: str, token_file: Path | None, *, connect_timeout: float = 5.0
                       ) -> AsyncIterator[ControlClient]:
    url = check_url(url)
    async with connect(url, read_token(token_file), name=f"skippyd at {url}", connect_timeout=connect_timeout,
                       token_hint=" (check --token-file)", reach_hint=" (is it running? see --url)") as client:
        yield client


def call_once(url: str, token_file: Path | None, make_request) -> object:
    """Run one request synchronously (for thin typer commands)."""

    async def go():
        async with open_control(url, token_file) as client:
            return await client.call(make_request(client.new_id()))

    return trio.run(go)
