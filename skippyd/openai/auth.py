"""Who may use the HTTP side: the API key (``--api-key-file``) and what each kind of route asks of a request.

    OPEN      /health, the console's page and scripts: nothing
    API       /v1/*: the key, when one is set
    METRICS   /metrics: as API, or nothing with ``[openai] public_metrics``
    READ      the console's views and event stream: as API
    ACTION    the console's actions (kill, drain): the key; with no key set, only on a loopback listener

A refusal has OpenAI's error shape: 401 ``invalid_api_key`` for a missing or
wrong key, 403 ``forbidden`` for an action on a listener that has no key and
is reachable from other hosts.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
from pathlib import Path

log = logging.getLogger("skippyd.openai")


class KeyFileError(Exception):
    """The API key file cannot be used."""


class Need(enum.Enum):
    OPEN = "open"
    API = "api"
    METRICS = "metrics"
    READ = "read"
    ACTION = "action"


class ApiKey:
    """The key a request must present as ``Authorization: Bearer KEY``. Kept as its digest only: the comparison
    is of two digests of equal length, whose time reveals neither the key nor its length."""

    def __init__(self, key: str):
        if not key:
            raise KeyFileError("the API key is empty")
        self._digest = hashlib.sha256(key.encode()).digest()

    @classmethod
    def load(cls, path: Path) -> ApiKey:
        """The key in ``path`` (its first line, surrounding whitespace ignored). Raises KeyFileError."""
        try:
            text = Path(path).read_text(encoding="utf-8")
            mode = Path(path).stat().st_mode
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"API key file {path}: {getattr(exc, 'strerror', None) or exc}") from None
        key = text.strip().splitlines()[0].strip() if text.strip() else ""
        if len(key) < 8:
            raise KeyFileError(f"API key file {path}: the key must be at least 8 characters "
                               f"(e.g. `openssl rand -hex 24 > {path}`)")
        if mode & 0o077:
            log.warning("the API key file %s is readable by others (mode %o); chmod 600 it", path, mode & 0o777)
        return cls(key)

    def matches(self, authorization: str | None) -> bool:
        presented = ""
        if authorization and authorization[:7].lower() == "bearer ":
            presented = authorization[7:].strip()
        return hmac.compare_digest(hashlib.sha256(presented.encode()).digest(), self._digest)

    def __repr__(self) -> str:
        return "ApiKey(<hidden>)"


class Refused(Exception):
    """A request the access rules turn away: ``status`` 401 or 403, ``code`` OpenAI's error code."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class Access:
    """The rules of one listener: its key (None: no key), whether only this host can reach it, and whether
    /metrics is open to all."""

    def __init__(self, key: ApiKey | None = None, *, loopback: bool = True, public_metrics: bool = False):
        self.key = key
        self.loopback = loopback
        self.public_metrics = public_metrics

    @property
    def exposed(self) -> bool:
        """Reachable from other hosts with no key: anyone there can use the model."""
        return self.key is None and not self.loopback

    def check(self, need: Need, authorization: str | None) -> None:
        """Raises Refused unless a request with this Authorization header may do what ``need`` says."""
        if need is Need.OPEN or (need is Need.METRICS and self.public_metrics):
            return
        if self.key is None:
            if need is Need.ACTION and not self.loopback:
                raise Refused(403, "console actions need an API key on a listener other hosts can reach: start "
                                   "skippyd with --api-key-file FILE", "forbidden")
            return
        if not self.key.matches(authorization):
            what = "a" if not authorization else "a valid"
            raise Refused(401, f"this endpoint needs {what} API key: send Authorization: Bearer KEY "
                               "(the key in skippyd's --api-key-file)", "invalid_api_key")
