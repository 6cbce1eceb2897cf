"""Exceptions of the stage wire protocol.

Every failure the wire layer reports is one of these, so a connection handler
needs exactly one ``except WireError`` around its read loop:

``ProtocolError``
    The peer sent something that breaks the protocol (bad magic, unknown kind,
    a count over a limit, a length that does not add up, …). Carries an
    :class:`~skippyd.wire.messages.ErrorCode`. The server answers with an
    ``ErrorReply`` built by :func:`skippyd.wire.codec.error_reply_for`, closes
    the connection and logs one line.
``PeerClosed``
    The peer closed the connection (EOF or a broken transport), either cleanly
    between frames or in the middle of one (``mid_frame``).
``ReadTimeout`` / ``WriteTimeout``
    A read or write did not finish before its deadline.
``HandshakeRefused``
    The handshake was refused, by us (``by_peer=False``) or by the peer
    (``by_peer=True``); ``reason`` says which check failed.
"""

from __future__ import annotations

from skippyd.wire.messages import ErrorCode

__all__ = [
    "HandshakeRefused",
    "PeerClosed",
    "ProtocolError",
    "ReadTimeout",
    "WireError",
    "WireTimeout",
    "WriteTimeout",
]


class WireError(Exception):
    """Base class of everything the wire layer raises on purpose."""


class ProtocolError(WireError):
    """The peer violated the protocol; the connection cannot be trusted any more.

    ``request_id`` / ``session_id`` are filled in when the offending frame's
    header was parsed far enough to know them (0 otherwise), so the error reply
    can name the request.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        request_id: int = 0,
        session_id: int = 0,
    ) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.request_id = request_id
        self.session_id = session_id

    def __str__(self) -> str:
        return f"{self.code.name.lower()}: {self.message}"


class PeerClosed(WireError):
    """The peer closed the connection (EOF or broken transport)."""

    def __init__(self, message: str = "peer closed the connection", *, mid_frame: bool = False) -> None:
        super().__init__(message)
        self.mid_frame = mid_frame


class WireTimeout(WireError):
    """A read or write missed its deadline."""

    def __init__(self, message: str, *, timeout: float) -> None:
        super().__init__(message)
        self.timeout = timeout


class ReadTimeout(WireTimeout):
    """No complete frame arrived before the read deadline.

    ``mid_frame`` is True when the frame had started (its first byte had
    arrived) and the rest did not follow in time: a stalled or slow-drip
    peer rather than an idle one.
    """

    def __init__(self, message: str, *, timeout: float, mid_frame: bool = False) -> None:
        super().__init__(message, timeout=timeout)
        self.mid_frame = mid_frame


class WriteTimeout(WireTimeout):
    """A frame could not be written before the write deadline.

    The frame may be partly written: the connection is unusable afterwards.
    """


class HandshakeRefused(WireError):
    """The handshake failed a check.

    ``reason`` is the human-readable check that failed (for example
    ``"protocol version mismatch: peer 2, ours 1"``); ``by_peer`` is True when
    the other end refused us, False when we refused the other end.
    """

    def __init__(self, reason: str, *, by_peer: bool) -> None:
        super().__init__(f"{'refused by peer' if by_peer else 'refused peer'}: {reason}")
        self.reason = reason
        self.by_peer = by_peer
