"""Reading and writing frames on trio streams.

The only I/O of the wire package. Transport errors are mapped here, once, to
the package's exceptions: EOF and ``trio.BrokenResourceError`` become
:class:`PeerClosed`, a missed deadline :class:`ReadTimeout` /
:class:`WriteTimeout`; everything the peer gets wrong is a
:class:`ProtocolError` raised by the codec before any large allocation.

After *any* :class:`WireError` the connection is in an unknown state (part of
a frame may have been consumed or written): close it.

Use one :class:`ReceiveBuffer` per connection for its whole life, from the
handshake on. It may read ahead (``read_size``) to save receive calls, so the
bytes it holds belong to the next frames; reading the same stream around it
would lose them. Passing a bare ``ReceiveStream`` to :func:`read_frame` is
safe too: it then reads exactly what each frame needs and nothing more.
"""

from __future__ import annotations

import errno
import math
from collections.abc import Container

import trio

from skippyd.wire.codec import (
    MESSAGE_HEADER_SIZE,
    MESSAGE_KINDS,
    PREFIX_SIZE,
    REPLY_KINDS,
    Buffer,
    decode_body,
    decode_message,
    encode_frame,
    parse_message_header,
    parse_prefix,
)
from skippyd.wire.errors import PeerClosed, ReadTimeout, WriteTimeout
from skippyd.wire.messages import DEFAULT_LIMITS, Frame, Limits, Message, Reply

__all__ = [
    "DEFAULT_READ_SIZE",
    "ReceiveBuffer",
    "read_frame",
    "read_message",
    "read_reply",
    "write_frame",
]

DEFAULT_READ_SIZE = 64 * 1024


class ReceiveBuffer:
    """Exact-size reads from a ``trio.abc.ReceiveStream``.

    :meth:`receive_exactly` returns a new ``bytearray`` of exactly ``n``
    bytes, allocated once at its final size and filled by ``receive_some``
    (short reads handled), so callers can keep numpy views of it. Small reads
    ask the stream for ``read_size`` bytes and keep the surplus for the next
    call; reads of ``read_size`` or more ask for exactly what is missing, and
    on a ``trio.SocketStream`` they are received straight into the returned
    buffer (``recv_into``), so an activation goes from the socket into the
    array numpy will view without another copy. ``read_size=0`` never reads
    ahead.
    """

    __slots__ = ("stream", "_read_size", "_pending", "_pos", "_socket")

    def __init__(self, stream: trio.abc.ReceiveStream, *, read_size: int = DEFAULT_READ_SIZE) -> None:
        self.stream = stream
        self._read_size = read_size
        # reads of read_size or more on a socket go through recv_into: no intermediate bytes object
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._pending: Buffer = b""
        self._pos = 0

    @property
    def buffered(self) -> int:
        """Bytes already received and not yet handed out."""
        return len(self._pending) - self._pos

    async def receive_exactly(self, n: int, *, frame_started: bool = True) -> bytearray:
        out = bytearray(n)
        await self.receive_into(memoryview(out), frame_started=frame_started)
        return out

    async def receive_into(self, view: memoryview, *, frame_started: bool = True) -> None:
        """Fill ``view`` completely.

        EOF before the first byte with ``frame_started=False`` is a clean
        close (``PeerClosed(mid_frame=False)``); any other EOF is mid-frame.
        """
        n = len(view)
        filled = 0
        if self._pending:
            take = min(n, len(self._pending) - self._pos)
            view[:take] = memoryview(self._pending)[self._pos : self._pos + take]
            filled = take
            self._pos += take
            if self._pos == len(self._pending):
                self._pending, self._pos = b"", 0
        while filled < n:
            missing = n - filled
            if self._socket is not None and missing >= self._read_size:
                # a large payload (an activation): straight from the socket into its final buffer
                got = await self._recv_into(view[filled:])
                if not got:
                    _raise_eof(filled, n, frame_started)
                filled += got
                continue
            data = await self._receive_some(max(missing, self._read_size))
            if not data:
                _raise_eof(filled, n, frame_started)
            got = len(data)
            if got <= missing:
                view[filled : filled + got] = data
                filled += got
            else:
                view[filled:] = memoryview(data)[:missing]
                filled = n
                self._pending, self._pos = data, missing

    async def _recv_into(self, view: memoryview) -> int:
        try:
            return await self._socket.recv_into(view)
        except OSError as exc:  # the same mapping as trio.SocketStream.receive_some
            if exc.errno == errno.EBADF:
                raise trio.ClosedResourceError("this socket was already closed") from None
            raise PeerClosed(f"connection broken: {exc}", mid_frame=True) from exc

    async def _receive_some(self, max_bytes: int) -> Buffer:
        try:
            return await self.stream.receive_some(max_bytes)
        except trio.BrokenResourceError as exc:
            raise PeerClosed(f"connection broken: {exc}", mid_frame=True) from exc


def _raise_eof(filled: int, n: int, frame_started: bool):
    if filled == 0 and not frame_started:
        raise PeerClosed("peer closed the connection")
    raise PeerClosed(f"peer closed mid-frame ({filled} of {n} bytes read)", mid_frame=True)


def _deadline(timeout: float) -> float:
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be >= 0, got {timeout!r}")
    return trio.current_time() + timeout


def _as_buffer(source: ReceiveBuffer | trio.abc.ReceiveStream) -> ReceiveBuffer:
    if isinstance(source, ReceiveBuffer):
        return source
    return ReceiveBuffer(source, read_size=0)


async def _read_frame(buf: ReceiveBuffer, limits: Limits, n_embd: int | None, accept: Container[int] | None) -> Frame:
    prefix = parse_prefix(
        await buf.receive_exactly(PREFIX_SIZE, frame_started=False), limits, n_embd=n_embd, accept=accept
    )
    if prefix.kind not in MESSAGE_KINDS:
        return decode_body(prefix, await buf.receive_exactly(prefix.body_len), limits)
    assert n_embd is not None  # parse_prefix refuses messages without it
    header = parse_message_header(prefix, await buf.receive_exactly(MESSAGE_HEADER_SIZE), limits, n_embd)
    tail = await buf.receive_exactly(header.tail_len) if header.tail_len else b""
    activation = await buf.receive_exactly(header.activation_bytes) if header.activation_bytes else None
    return decode_message(header, tail, activation, n_embd)


async def read_frame(
    source: ReceiveBuffer | trio.abc.ReceiveStream,
    limits: Limits = DEFAULT_LIMITS,
    *,
    timeout: float,
    n_embd: int | None = None,
    accept: Container[int] | None = None,
) -> Frame:
    """Read and decode one frame; the whole frame must arrive within ``timeout`` s.

    ``n_embd`` (from the handshake) is needed to accept message frames;
    ``accept`` restricts the frame kinds (checked on the prefix, before the
    body is read). Raises ProtocolError, PeerClosed or ReadTimeout.
    """
    buf = _as_buffer(source)
    with trio.CancelScope(deadline=_deadline(timeout)):  # trio.fail_after, minus contextlib
        return await _read_frame(buf, limits, n_embd, accept)
    raise ReadTimeout(f"no complete frame within {timeout:g} s", timeout=timeout)


async def read_message(
    source: ReceiveBuffer | trio.abc.ReceiveStream,
    limits: Limits = DEFAULT_LIMITS,
    *,
    timeout: float,
    n_embd: int,
) -> Message:
    """Read one upstream → downstream message (anything else is UNEXPECTED_KIND)."""
    frame = await read_frame(source, limits, timeout=timeout, n_embd=n_embd, accept=MESSAGE_KINDS)
    return frame  # type: ignore[return-value]


async def read_reply(
    source: ReceiveBuffer | trio.abc.ReceiveStream,
    limits: Limits = DEFAULT_LIMITS,
    *,
    timeout: float,
) -> Reply:
    """Read one downstream → upstream reply (anything else is UNEXPECTED_KIND)."""
    return await read_frame(source, limits, timeout=timeout, accept=REPLY_KINDS)  # type: ignore[return-value]


async def write_frame(stream: trio.abc.SendStream, obj: Frame, *, timeout: float = math.inf) -> int:
    """Encode ``obj`` and send it; returns the bytes written.

    Not safe to call concurrently on one stream (trio raises
    BusyResourceError): give each connection a single writer or a lock.
    Cancelled or timed out halfway, the frame is partly written and the
    connection must be closed.
    """
    parts = encode_frame(obj)
    try:
        with trio.CancelScope(deadline=_deadline(timeout)):
            for part in parts:
                await stream.send_all(part)
            return sum(len(part) for part in parts)
    except trio.BrokenResourceError as exc:
        raise PeerClosed(f"connection broken: {exc}") from exc
    raise WriteTimeout(f"frame not written within {timeout:g} s", timeout=timeout)
