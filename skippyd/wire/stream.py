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
import os
import select
import socket
import time
from collections.abc import Callable, Container
from typing import NoReturn

import trio

from skippyd.wire.codec import (
    DECODE_KIND,
    MESSAGE_HEADER_SIZE,
    MESSAGE_KINDS,
    PREFIX_SIZE,
    REPLY_KINDS,
    Buffer,
    decode_body,
    decode_message,
    decode_parsed,
    decode_reply_at,
    decode_step_at,
    encode_frame,
    parse_message_header,
    parse_prefix,
)
from skippyd.wire.errors import PeerClosed, ReadTimeout, WriteTimeout
from skippyd.wire.messages import DEFAULT_LIMITS, Frame, Limits, Message, Reply, WireFormat

__all__ = [
    "DEFAULT_FRAME_TIMEOUT",
    "DEFAULT_MIN_RATE",
    "DEFAULT_PEER_TIMEOUT",
    "DEFAULT_READ_SIZE",
    "PreparedFrame",
    "ReceiveBuffer",
    "WaitWatch",
    "frame_deadline_s",
    "keep_alive",
    "keepalive_probes",
    "read_frame",
    "read_message",
    "read_reply",
    "timed_out",
    "write_frame",
    "write_prepared",
]

DEFAULT_READ_SIZE = 64 * 1024
# A started frame's deadline (read_frame's frame_timeout) grows by body_len / DEFAULT_MIN_RATE: 1 MiB/s
# (8 Mbit/s) gives the largest prefill frame a big model sends (512 tokens x 8192 x 4 = 16 MiB) 16 s more.
DEFAULT_FRAME_TIMEOUT = 5.0
DEFAULT_MIN_RATE = float(1 << 20)


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

    async def wait_first_byte(self) -> None:
        """Return once at least one byte of the next frame is here (already buffered, or received now).

        EOF first is a clean close (``PeerClosed(mid_frame=False)``). The byte
        stays buffered for the frame's read, so this loses nothing even with
        ``read_size=0``.
        """
        if self.buffered:
            return
        data = await self._receive_some(max(1, self._read_size))
        if not data:
            _raise_eof(0, 1, False)
        self._pending, self._pos = data, 0

    def take_frame(self, limits: Limits, n_embd: int | None, accept: Container[int] | None) -> Frame | None:
        """The next frame if all of it is buffered already, decoded without a wait; None if it is not.

        A small frame usually arrives in one piece, and a read ahead may hold
        the next ones: decoding it straight from the buffer spares the
        per-part awaits of the general path. The frame's bytes are copied out
        (a ``bytearray``, as :meth:`receive_exactly` gives), so its arrays are
        writable and outlive the buffer.
        """
        pos = self._pos
        avail = len(self._pending) - pos
        if avail < PREFIX_SIZE:
            return None
        # the per-token frames, in one unpack: a decode step where messages are read, an ack or a prediction
        # where replies are
        if n_embd is not None and (accept is None or DECODE_KIND in accept):
            fast = decode_step_at(self._pending, pos, n_embd, limits)
        else:
            fast = decode_reply_at(self._pending, pos, limits, accept)
        if fast is not None:
            self._consumed(fast[1])
            return fast[0]
        view = memoryview(self._pending)
        prefix = parse_prefix(view[pos:pos + PREFIX_SIZE], limits, n_embd=n_embd, accept=accept)
        end = pos + PREFIX_SIZE + prefix.body_len
        if end > len(self._pending):
            return None
        body = bytearray(view[pos + PREFIX_SIZE:end])
        self._consumed(end)
        return decode_parsed(prefix, body, n_embd=n_embd, limits=limits)

    def _consumed(self, end: int) -> None:
        """The buffered bytes up to ``end`` are handed out."""
        if end == len(self._pending):
            self._pending, self._pos = b"", 0
        else:
            self._pos = end

    def arrived(self) -> bool:
        """Whether the next frame's first byte (or EOF) is here now: buffered, or waiting in the socket."""
        if self.buffered:
            return True
        if self._socket is None:
            return False
        poller = select.poll()
        poller.register(self._socket.fileno(), select.POLLIN)
        return bool(poller.poll(0))

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
        except OSError as exc:
            _raise_socket_failure(exc, mid_frame=True)

    async def _receive_some(self, max_bytes: int) -> Buffer:
        if self._socket is not None:
            return await self._recv_socket(max_bytes)
        try:
            return await self.stream.receive_some(max_bytes)
        except trio.BrokenResourceError as exc:
            raise PeerClosed(f"connection broken: {exc}", mid_frame=True) from exc

    async def _recv_socket(self, max_bytes: int) -> bytes:
        """``receive_some`` on the socket itself: what has arrived, else wait until something does.

        As trio's, always a schedule point: the wait, or a pass of the
        scheduler when the bytes were there already (a peer that keeps the
        socket full must not keep this task from letting others run), but
        with none of trio's per-call wrapping, which a decode step pays twice.
        """
        sock = self._socket
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            try:
                data = os.read(sock.fileno(), max_bytes)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                waited = True
                continue
            except OSError as exc:
                _raise_socket_failure(exc, mid_frame=True)
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return data


class WaitWatch:
    """The deadline of one connection's waits for a frame's first byte, kept by a task of its own rather
    than by a cancel scope around every read.

    Entering and leaving a trio cancel scope runs some 700 interpreted
    instructions (tens of µs), and a decode step reads one frame on
    every connection it crosses, while the deadlines of those waits (an idle
    lane: minutes; a reply: ``runtime.reply_timeout``) almost never run out. So a
    watched read (:func:`read_frame` with ``watch=``) only notes when its
    wait began, and :meth:`run` sleeps until the current wait would be due;
    a wait that lasted ``timeout`` is woken with
    ``trio.lowlevel.notify_closing`` on the socket and raises ReadTimeout.
    As after any ReadTimeout, close the connection. A frame that is in the
    socket when its wait is due is not timed out (this process was not
    running; see read_frame's retry).

    Run :meth:`run` in a nursery that outlives the reads; :meth:`close`
    (or closing the socket) ends it. :meth:`expire` gives the reads up at
    once, from any task.
    """

    __slots__ = ("timeout", "since", "waits", "expired", "_buf", "_scope")

    def __init__(self, buf: ReceiveBuffer, timeout: float):
        if buf._socket is None:
            raise TypeError("a WaitWatch needs a ReceiveBuffer over a trio.SocketStream")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        self.timeout = timeout
        self.since: float | None = None  # trio time the current wait began; None while no read waits
        self.waits = 0  # waits begun so far: tells a new wait from the one the task saw
        self.expired: str | None = None  # why the reads were given up (see expire)
        self._buf = buf
        self._scope = trio.CancelScope()

    async def run(self) -> None:
        sock = self._buf._socket
        with self._scope:
            while self.expired is None and sock.fileno() >= 0:
                if self.since is None:
                    await trio.sleep(self.timeout)  # a wait that begins now is due after this at the earliest
                    continue
                since, waits = self.since, self.waits
                await trio.sleep_until(since + self.timeout)
                if self.waits == waits and self.since is not None and not self._buf.arrived():
                    self.expire(f"no complete frame within {self.timeout:g} s")

    def expire(self, reason: str) -> None:
        """Give the connection's reads up now: the current wait and every later one raise ReadTimeout(reason)
        (a connection that some other watch found dead, say; close it)."""
        if self.expired is None:
            self.expired = reason
        if self.since is not None:
            trio.lowlevel.notify_closing(self._buf._socket)

    def close(self) -> None:
        self._scope.cancel()


# Frames up to this size are joined into one buffer before sending (copying a few KiB is cheaper than
# a send and a trio checkpoint per part); bigger ones (prefill activations) go part by part, uncopied.
JOIN_BELOW = 64 * 1024


def _raise_socket_failure(exc: OSError, *, mid_frame: bool = False) -> NoReturn:
    """A failed call on the socket itself, mapped as trio.SocketStream maps it: a closed socket is
    trio.ClosedResourceError, anything else a broken connection (PeerClosed)."""
    if exc.errno == errno.EBADF:
        raise trio.ClosedResourceError("this socket was already closed") from None
    raise PeerClosed(f"connection broken: {exc}", mid_frame=mid_frame) from exc


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


async def _read_frame(buf: ReceiveBuffer, limits: Limits, n_embd: int | None, accept: Container[int] | None,
                      on_length: Callable[[int], None] | None = None) -> Frame:
    prefix = parse_prefix(
        await buf.receive_exactly(PREFIX_SIZE, frame_started=False), limits, n_embd=n_embd, accept=accept
    )
    if on_length is not None:
        on_length(prefix.body_len)
    if prefix.kind not in MESSAGE_KINDS:
        return decode_body(prefix, await buf.receive_exactly(prefix.body_len), limits)
    assert n_embd is not None  # parse_prefix refuses messages without it
    header = parse_message_header(prefix, await buf.receive_exactly(MESSAGE_HEADER_SIZE), limits, n_embd)
    tail = await buf.receive_exactly(header.tail_len) if header.tail_len else b""
    activation = await buf.receive_exactly(header.activation_bytes) if header.activation_bytes else None
    return decode_message(header, tail, activation, n_embd)


def frame_deadline_s(body_len: int, frame_timeout: float, min_rate: float = DEFAULT_MIN_RATE) -> float:
    """Seconds a frame of ``body_len`` bytes may take from its first byte to its last."""
    return frame_timeout + body_len / min_rate


async def read_frame(
    source: ReceiveBuffer | trio.abc.ReceiveStream,
    limits: Limits = DEFAULT_LIMITS,
    *,
    timeout: float,
    frame_timeout: float | None = None,
    min_rate: float = DEFAULT_MIN_RATE,
    n_embd: int | None = None,
    accept: Container[int] | None = None,
    watch: WaitWatch | None = None,
) -> Frame:
    """Read and decode one frame.

    Without ``frame_timeout`` the whole frame must arrive within ``timeout``
    s. With it, ``timeout`` only bounds the wait for the frame's first byte
    (an idle connection); from that byte on the frame must be complete within
    ``frame_timeout + body_len / min_rate`` s (:func:`frame_deadline_s`), so
    a peer that starts a frame and then stalls or trickles it is dropped in
    seconds whatever the idle deadline, while a large activation still gets
    time to arrive at ``min_rate`` bytes/s.

    With ``watch`` (a :class:`WaitWatch` of this connection, whose task
    runs), the watch bounds the wait for the first byte instead of
    ``timeout``, which is then ignored, and ``frame_timeout`` is required.

    ``n_embd`` (from the handshake) is needed to accept message frames;
    ``accept`` restricts the frame kinds (checked on the prefix, before the
    body is read). Raises ProtocolError, PeerClosed or ReadTimeout
    (``mid_frame`` set when the frame had started).
    """
    buf = _as_buffer(source)
    if frame_timeout is not None and (math.isnan(frame_timeout) or frame_timeout < 0 or not min_rate > 0):
        raise ValueError(f"frame_timeout must be >= 0 and min_rate > 0, got {frame_timeout!r}, {min_rate!r}")
    frame = buf.take_frame(limits, n_embd, accept)  # read ahead already (no deadline to set for it)
    if frame is not None:
        await trio.lowlevel.cancel_shielded_checkpoint()  # a read is a schedule point, as trio's are
        return frame
    if watch is not None:
        if frame_timeout is None:
            raise ValueError("a watched read needs a frame_timeout (the watch bounds the first byte only)")
        await _wait_watched(buf, watch)
    else:
        retried = False
        while True:
            with trio.CancelScope(deadline=_deadline(timeout)):  # trio.fail_after, minus contextlib
                if frame_timeout is None:
                    return await _read_frame(buf, limits, n_embd, accept)
                await buf.wait_first_byte()
                break
            if not retried and buf.arrived():
                # the frame is here, its wait ran out all the same: this process was not running (SIGSTOP, a
                # suspended VM, a starved host), the peer was not late. Read it, with fresh deadlines.
                retried = True
                continue
            raise ReadTimeout(f"no complete frame within {timeout:g} s", timeout=timeout)
    frame = buf.take_frame(limits, n_embd, accept)  # usually all of a small frame came at once
    if frame is not None:
        return frame
    started = trio.current_time()
    with trio.CancelScope(deadline=started + frame_timeout) as scope:

        def on_length(body_len: int) -> None:
            scope.deadline = started + frame_deadline_s(body_len, frame_timeout, min_rate)

        return await _read_frame(buf, limits, n_embd, accept, on_length)
    took = trio.current_time() - started
    raise ReadTimeout(f"frame started but not complete {took:.1f} s later (a stalled or too slow peer)",
                      timeout=took, mid_frame=True)


async def _wait_watched(buf: ReceiveBuffer, watch: WaitWatch) -> None:
    """Wait for the next frame's first byte, bounded by ``watch`` (no cancel scope of its own)."""
    if watch.expired is not None:
        raise ReadTimeout(watch.expired, timeout=watch.timeout)
    watch.waits += 1
    watch.since = trio.current_time()
    try:
        await buf.wait_first_byte()
    except trio.ClosedResourceError:
        if watch.expired is None:
            raise
        raise ReadTimeout(watch.expired, timeout=watch.timeout) from None
    finally:
        watch.since = None


async def read_message(
    source: ReceiveBuffer | trio.abc.ReceiveStream,
    limits: Limits = DEFAULT_LIMITS,
    *,
    timeout: float,
    n_embd: int,
    frame_timeout: float | None = None,
    min_rate: float = DEFAULT_MIN_RATE,
    watch: WaitWatch | None = None,
) -> Message:
    """Read one upstream → downstream message (anything else is UNEXPECTED_KIND); deadlines as read_frame."""
    frame = await read_frame(source, limits, timeout=timeout, frame_timeout=frame_timeout, min_rate=min_rate,
                             n_embd=n_embd, accept=MESSAGE_KINDS, watch=watch)
    return frame  # type: ignore[return-value]


async def read_reply(
    source: ReceiveBuffer | trio.abc.ReceiveStream,
    limits: Limits = DEFAULT_LIMITS,
    *,
    timeout: float,
    frame_timeout: float | None = None,
    watch: WaitWatch | None = None,
) -> Reply:
    """Read one downstream → upstream reply (anything else is UNEXPECTED_KIND); deadlines as read_frame."""
    return await read_frame(source, limits, timeout=timeout, frame_timeout=frame_timeout,  # type: ignore[return-value]
                            accept=REPLY_KINDS, watch=watch)


async def write_frame(stream: trio.abc.SendStream, obj: Frame, *, timeout: float = math.inf,
                      prepared: PreparedFrame | None = None, wire: WireFormat = WireFormat.F32) -> int:
    """Encode ``obj`` and send it; returns the bytes written. ``prepared``: ``obj``'s frame, which a native
    compute may have written already (see :func:`write_prepared`; then only what is left of it goes).
    ``wire``: how its activation travels (the lane's negotiated encoding, see codec.wire_activation).

    Not safe to call concurrently on one stream (trio raises
    BusyResourceError): give each connection a single writer or a lock.
    Cancelled or timed out halfway, the frame is partly written and the
    connection must be closed.
    """
    if prepared is not None and prepared.written:
        return await write_prepared(stream, prepared, timeout=timeout)
    parts = encode_frame(obj, wire)
    total = sum(len(part) for part in parts)
    if len(parts) > 1 and total <= JOIN_BELOW:
        parts = [b"".join(parts)]  # one send: a decode step's frame costs one syscall, not three
    try:
        if len(parts) == 1:
            rest = _unsent(stream, parts[0])
            if rest is None:
                return total
            parts = [rest]
        await _send_parts(stream, parts, timeout)
        return total
    except trio.BrokenResourceError as exc:
        raise PeerClosed(f"connection broken: {exc}") from exc


async def _send_parts(stream: trio.abc.SendStream, parts: list[Buffer], timeout: float) -> None:
    with trio.CancelScope(deadline=_deadline(timeout)):
        for part in parts:
            await stream.send_all(part)
        return
    raise WriteTimeout(f"frame not written within {timeout:g} s", timeout=timeout)


class PreparedFrame:
    """A frame made before the compute whose output are its last bytes (a decode step's activation), so that
    native code writes it the moment the compute ends (``Context.decode_row_send``) instead of after the
    Python that follows a compute. :func:`write_prepared` then finishes what that write left: the rest of a
    frame the socket took part of, or the hand-over to a conditioned link (which gets the time the frame
    left). ``fd`` is the socket's, or -1 for a conditioned link; ``done_ns`` stays 0 until a native compute
    filled the frame (a compute elsewhere, in a batch or on the worker thread, leaves it to ``write_frame``),
    ``sent`` is what the socket took then (``-errno`` if the write failed). A final stage's prediction is a
    whole one-token reply whose token and compute times the compute fills in (``us_at``: where its
    compute_us lies; -1 for a frame that ends with an activation)."""

    __slots__ = ("frame", "head_len", "us_at", "fd", "sent", "done_ns")

    def __init__(self, head: bytes, tail_len: int, fd: int, us_at: int = -1):
        self.frame = bytearray(len(head) + tail_len)
        self.frame[:len(head)] = head
        self.head_len = len(head)
        self.us_at = us_at
        self.fd = fd
        self.sent = 0
        self.done_ns = 0

    @property
    def written(self) -> bool:
        """Whether a native compute filled the frame and wrote it (or what the socket took of it)."""
        return self.done_ns != 0

    @classmethod
    def for_stream(cls, stream: trio.abc.SendStream, head: bytes, tail_len: int,
                   us_at: int = -1) -> PreparedFrame | None:
        """A frame to be written natively on ``stream``: a socket stream, or a conditioned link (whose
        ``send_now`` takes the time the frame left); None for any other stream. The caller's single-writer
        rule must hold from now until :func:`write_prepared`: no frame half written, none begun meanwhile."""
        if isinstance(stream, trio.SocketStream):
            fd = stream.socket.fileno()
            return cls(head, tail_len, fd, us_at) if fd >= 0 else None  # (-1: closed)
        if getattr(stream, "takes_sent_at", False):
            return cls(head, tail_len, -1, us_at)
        return None


async def write_prepared(stream: trio.abc.SendStream, prepared: PreparedFrame, *, timeout: float = math.inf) -> int:
    """Finish writing a frame that a native compute filled (``prepared.done_ns`` set) on the stream it was
    prepared for; returns the bytes of the frame. No schedule point when the native write took it all.
    Raises as :func:`write_frame`."""
    frame = prepared.frame
    if prepared.sent < 0:
        _raise_socket_failure(OSError(-prepared.sent, os.strerror(-prepared.sent)))
    try:
        if prepared.fd < 0:  # a conditioned link: the frame left when the compute ended
            age = (time.clock_gettime_ns(time.CLOCK_MONOTONIC) - prepared.done_ns) / 1e9
            stream.send_now(frame, sent_at=trio.current_time() - age)
        elif prepared.sent < len(frame):
            await _send_parts(stream, [memoryview(frame)[prepared.sent:]], timeout)
        return len(frame)
    except trio.BrokenResourceError as exc:
        raise PeerClosed(f"connection broken: {exc}") from exc


async def send_buffer(stream: trio.abc.SendStream, data: Buffer) -> None:
    """Send all of ``data``: straight to the socket when it takes it at once (no schedule point, as in
    :func:`write_frame`), the rest through ``send_all``. Raises as ``send_all`` does, or PeerClosed."""
    rest = _unsent(stream, data)
    if rest is not None:
        await stream.send_all(rest)


def _unsent(stream: trio.abc.SendStream, data: Buffer) -> Buffer | None:
    """Write what a socket stream takes of ``data`` right now (see _send_now), or a stream with a ``send_now``
    of its own (a conditioned link's: it takes everything); what is left, or None."""
    if isinstance(stream, trio.SocketStream):
        sent = _send_now(stream, data)
    elif (send_now := getattr(stream, "send_now", None)) is not None:
        sent = send_now(data)
    else:
        return data
    return None if sent == len(data) else memoryview(data)[sent:]


def _send_now(stream: trio.SocketStream, data: Buffer) -> int:
    """Write what the socket takes right now, without a wait or a schedule point; the bytes written.

    A small frame fits the socket's buffer at once; trio's ``send_all`` would
    spend a pass of the scheduler on it (its checkpoint after a send that did
    not block), which on a decode step costs more than the send itself. The
    caller's single-writer rule stands in for trio's conflict detection.
    """
    try:
        return os.write(stream.socket.fileno(), data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        _raise_socket_failure(exc)


# A stage link's peer is given up once its host has been silent for DEFAULT_PEER_TIMEOUT s (runtime.peer_timeout):
# the kernel probes a connection after KEEPALIVE_IDLE_S of quiet, every KEEPALIVE_INTERVAL_S, and a peer host
# alive (even a stopped process's) answers those probes itself; on a link that is cut, nothing answers.
DEFAULT_PEER_TIMEOUT = 3.0
KEEPALIVE_IDLE_S = 1
KEEPALIVE_INTERVAL_S = 1


def keepalive_probes(peer_timeout: float) -> int:
    """Unanswered probes after which the kernel gives a quiet connection up: about ``peer_timeout`` s after
    the last packet from its peer (the first probe goes out after KEEPALIVE_IDLE_S)."""
    return max(1, math.ceil((peer_timeout - KEEPALIVE_IDLE_S) / KEEPALIVE_INTERVAL_S))


def keep_alive(stream: trio.SocketStream, *, peer_timeout: float = DEFAULT_PEER_TIMEOUT,
               user_timeout: bool = False) -> None:
    """TCP keepalive on a stage link (both ends set it when the connection is made).

    A peer whose host went down, or a link that was cut, sends no FIN or
    RST: without probes such a connection looks alive until something is
    sent on it and a reply deadline runs out (or, with nothing to send,
    for ever). With probes after a second of quiet the kernel fails the
    socket about ``peer_timeout`` s after the peer's host last said
    anything: a read waiting on it wakes with ETIMEDOUT, an idle lane is
    seen dead before a generation takes it, and the probes keep the
    mappings of NATs and firewalls alive in the first place. The peer's
    kernel answers the probes, so a peer process that is merely stopped or
    busy keeps its connections. This costs nothing on a connection that
    carries traffic: the probes go only after a quiet second.

    ``user_timeout``: also TCP_USER_TIMEOUT, so that data of ours that stays
    unacknowledged for ``peer_timeout`` s fails the socket (replies that
    stopped getting through: loss in one direction). Only for a side that
    sends small frames its peer reads at once (a stage's replies upstream,
    the predictions of direct return): a sender of big frames to a peer
    that computes before it reads again (prefill chunks to a busy stage)
    would see a closed receive window, which the kernel counts as
    unacknowledged too, and give up a healthy peer.
    """
    sock = stream.socket
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                            ("TCP_KEEPCNT", keepalive_probes(peer_timeout))):
            if hasattr(socket, name):  # Linux; elsewhere the system's defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        if user_timeout and hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, round(peer_timeout * 1000)))
    except OSError:  # a connection already reset: it fails on its first use anyway
        pass


def timed_out(exc: BaseException) -> bool:
    """Whether a connection failed because its peer's host went silent (keepalive or TCP_USER_TIMEOUT)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT:
            return True
        exc = exc.__cause__
    return False
