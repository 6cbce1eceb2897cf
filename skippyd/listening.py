"""Clear errors for a listener that cannot bind: which listener, which address, and the flag that moves it.

A bare ``[Errno 98] Address already in use`` does not say which of a daemon's listeners (a stage's,
the control channel's, the OpenAI API's) failed, and the usual cause is a second daemon on the same
host with the same defaults (two stages started with the default control port).
"""

from __future__ import annotations

import errno
import ipaddress
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ListenError", "explain_bind_errors", "is_loopback"]


class ListenError(OSError):
    """A listener could not bind its address; the message says which and what to do."""


def _hint(code: int | None, option: str) -> str:
    if code == errno.EADDRINUSE:
        return f"another program (another skippyd?) listens there: give this daemon another address with {option}"
    if code == errno.EADDRNOTAVAIL:
        return f"no interface of this host has that address: give this daemon one of its own with {option}"
    if code == errno.EACCES:
        return f"ports below 1024 need privileges: choose a higher port with {option}"
    return f"choose another address with {option}"


@contextmanager
def explain_bind_errors(what: str, host: str, port: int, option: str) -> Iterator[None]:
    """Re-raise an OSError from binding ``host:port`` as a ListenError naming ``what`` and ``option``."""
    try:
        yield
    except ListenError:
        raise
    except OSError as exc:
        raise _explained(exc, what, host, port, option) from exc
    except BaseExceptionGroup as group:  # a server that binds inside nurseries of its own (hypercorn)
        errors, rest = group.split(OSError)
        if errors is None or rest is not None:
            raise
        raise _explained(_first_leaf(errors), what, host, port, option) from group


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _explained(exc: OSError, what: str, host: str, port: int, option: str) -> ListenError:
    reason = exc.strerror or str(exc)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    error = ListenError(f"{what}: cannot listen on {address}: {reason.lower()}; {_hint(exc.errno, option)}")
    error.errno = exc.errno
    return error


def is_loopback(host: str) -> bool:
    """Only this host can reach a listener on ``host``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
