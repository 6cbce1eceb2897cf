"""A connection to the next stage: handshake, sending, and deferred acks (credits).

Non-final prefill chunks are acknowledged by the next stage before it
computes them. We do not wait for those acks one by one: up to
``credit_limit`` may be outstanding, so this stage computes chunk i+1 while
chunk i is on the wire or being computed downstream. Any message that
expects a prediction first drains the outstanding acks, folding their
stats into the reply.

Sessions with direct token return (three or more stages) are sent their
decode steps with :meth:`DownstreamLink.send_expecting_ack` too: the next
stage acknowledges each step on the lane while the prediction travels on the
token-return connection, so no stage waits for the prediction.

With link conditioning (``shape``), what the link sends goes through a
:class:`~skippyd.stage.conditioning.ShapedSendStream` whose transmit task
runs in the nursery given to :meth:`DownstreamLink.connect`.
"""

from __future__ import annotations

import select
import time

import trio

from skippyd.stage.conditioning import LinkShape, ShapedSendStream, shaped
from skippyd.wire.errors import PeerClosed, ProtocolError, WireError
from skippyd.wire.handshake import handshake_client
from skippyd.wire.messages import NO_STATS, Ack, ErrorReply, Hello, Message, Reply, StageStats, merge, with_stats
from skippyd.wire.stream import (
    DEFAULT_FRAME_TIMEOUT,
    ReceiveBuffer,
    WaitWatch,
    keep_alive,
    read_reply,
    write_frame,
)


class DownstreamError(Exception):
    """The next stage is unreachable, refused us, or broke the protocol."""

    def __init__(self, address: str, message: str):
        super().__init__(f"stage at {address}: {message}")
        self.address = address
        self.detail = message


class DownstreamLink:
    def __init__(self, stream: trio.SocketStream, peer: Hello, address: str, receive: ReceiveBuffer, *,
                 credit_limit: int, reply_timeout: float, write_timeout: float,
                 out: trio.abc.SendStream | None = None, nursery: trio.Nursery | None = None):
        self.stream = stream
        self._out = out if out is not None else stream  # the send side: the stream, or a conditioned link over it
        self.peer = peer
        self.address = address
        self._receive = receive
        self.credit_limit = max(0, credit_limit)
        self.reply_timeout = reply_timeout
        self.write_timeout = write_timeout
        self.frame_timeout = DEFAULT_FRAME_TIMEOUT
        self.pending_acks = 0
        self._folded = NO_STATS
        self._deferred_error: ErrorReply | None = None
        self.broken = False
        # what an interrupted caller left behind (see settle): a frame half written, a reply not yet read
        self.writing = False
        self.awaiting_reply = False
        self._reply_owed_since = 0.0
        # the reply deadline, kept by a task in `nursery` (no cancel scope per read); without one, per read
        self._watch: WaitWatch | None = None
        if nursery is not None and isinstance(stream, trio.SocketStream):
            self._watch = WaitWatch(receive, reply_timeout)
            nursery.start_soon(self._watch.run)

    @classmethod
    async def connect(cls, host: str, port: int, hello: Hello, *, connect_timeout: float = 5.0,
                      credit_limit: int = 2, reply_timeout: float = 30.0, write_timeout: float = 10.0,
                      shape: LinkShape | None = None, nursery: trio.Nursery | None = None) -> DownstreamLink:
        """Dial and handshake. With an active ``shape``, frames after the handshake are conditioned
        (their transmit task runs in ``nursery``). With a ``nursery``, the reply deadline is kept by a task
        there (see WaitWatch), not by a cancel scope per read."""
        address = f"{host}:{port}"
        try:
            with trio.fail_after(connect_timeout):
                stream = await trio.open_tcp_stream(host, port)
        except (OSError, trio.TooSlowError) as exc:
            raise DownstreamError(address, f"cannot connect: {exc or 'timed out'}") from exc
        keep_alive(stream)
        receive = ReceiveBuffer(stream)
        try:
            peer = await handshake_client(stream, hello, timeout=connect_timeout, receive=receive)
        except WireError as exc:
            await trio.aclose_forcefully(stream)
            raise DownstreamError(address, f"handshake failed: {exc}") from exc
        return cls(stream, peer, address, receive, credit_limit=credit_limit, reply_timeout=reply_timeout,
                   write_timeout=write_timeout, out=shaped(stream, shape, nursery), nursery=nursery)

    def looks_alive(self) -> bool:
        """Non-blocking check between requests: False once the next stage closed or reset the connection.

        With nothing outstanding the next stage has nothing to say, so a
        readable socket means EOF, a reset, or a frame nobody asked for.
        While acks are outstanding the answer is True (unknown).
        """
        if self.broken or (isinstance(self._out, ShapedSendStream) and self._out.broken):
            return False
        if self.pending_acks:
            return True
        if self._receive.buffered:
            return False
        try:
            fd = self.stream.socket.fileno()
        except AttributeError:  # not a socket (memory streams in tests)
            return True
        if fd < 0:
            return False
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        return not poller.poll(0)

    @property
    def interruptible(self) -> bool:
        """Whether :meth:`interrupt` can wake a wait on this link (its reply deadline is kept by a watch)."""
        return self._watch is not None

    def interrupt(self, reason: str) -> None:
        """Give the link up from another task: a read waiting on it now, and any later read or send, fails
        with DownstreamError(reason); a send blocked now is woken too. For the head's liveness watch, which
        has found the next stage dead: no cancel scope around every wait needed. Close the link after."""
        self.broken = True
        self._watch.expire(reason)
        trio.lowlevel.notify_closing(self.stream.socket)  # a send blocked on a full socket

    async def aclose(self) -> None:
        self.broken = True
        if self._watch is not None:
            self._watch.close()
        if isinstance(self._out, ShapedSendStream):
            self._out.close()
        await trio.aclose_forcefully(self.stream)

    async def send(self, msg: Message) -> tuple[int, int]:
        """Write one message; returns (bytes, microseconds)."""
        started = time.perf_counter()
        # a cancellation already pending (a kill while this task computed) lands here, before the first
        # byte, rather than at write_frame's first checkpoint, where the frame would count as half written
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._watch is not None and self._watch.expired is not None:
            raise DownstreamError(self.address, f"link given up: {self._watch.expired}")
        self.writing = True
        try:
            n = await write_frame(self._out, msg, timeout=self.write_timeout)
        except WireError as exc:
            self.broken = True
            raise DownstreamError(self.address, f"send failed: {exc}") from exc
        self.writing = False
        return n, int((time.perf_counter() - started) * 1e6)

    async def send_deferred(self, msg: Message) -> tuple[int, int]:
        """Send a message whose ack may arrive later (up to the credit limit outstanding)."""
        sent = await self.send(msg)
        self.pending_acks += 1
        while self.pending_acks > self.credit_limit:
            await self._collect_one_ack()
        return sent

    async def send_expecting_ack(self, msg: Message) -> tuple[int, int]:
        """Send a message whose ack is collected later (by :meth:`drain` or a later request),
        without waiting for older acks: a direct-return decode step. Returns (bytes, microseconds)."""
        sent = await self.send(msg)
        self.pending_acks += 1
        return sent

    def take_folded(self) -> tuple[StageStats, ErrorReply | None]:
        """The stats of the acks collected since the last reply, and the first error one of them
        reported (both cleared): to fold into this stage's next reply upstream."""
        folded, self._folded = self._folded, NO_STATS
        error, self._deferred_error = self._deferred_error, None
        return folded, error

    async def _read(self) -> Reply:
        try:
            # reply_timeout covers the next stage's compute; a reply once started must be whole within
            # frame_timeout (a stalled or trickling next stage is detected in seconds, not reply_timeout)
            return await read_reply(self._receive, timeout=self.reply_timeout, frame_timeout=self.frame_timeout,
                                    watch=self._watch)
        except (ProtocolError, PeerClosed) as exc:
            self.broken = True
            raise DownstreamError(self.address, str(exc)) from exc
        except WireError as exc:
            self.broken = True
            raise DownstreamError(self.address, f"no reply: {exc}") from exc

    async def _collect_one_ack(self) -> None:
        reply = await self._read()
        self.pending_acks -= 1
        self._folded = merge(self._folded, reply.stats)
        if isinstance(reply, ErrorReply):
            self._deferred_error = self._deferred_error or reply
        elif not isinstance(reply, Ack):
            self.broken = True
            raise DownstreamError(self.address, f"expected an ack, got {type(reply).__name__}")

    async def drain(self) -> None:
        while self.pending_acks:
            await self._collect_one_ack()

    @property
    def settled(self) -> bool:
        """Nothing left half done: no frame half written, no ack or reply owed by the next stage."""
        return not (self.broken or self.writing or self.pending_acks or self.awaiting_reply)

    async def settle(self) -> None:
        """Finish what an interrupted caller left: collect the owed acks and the owed reply (dropped), so
        the link can carry the next request (a Stop, say). A frame half written cannot be finished: raises
        DownstreamError (close the link). Waits for the next stage: bound it with a cancel scope."""
        if self.writing:
            self.broken = True
            raise DownstreamError(self.address, "a frame was left half written")
        await self.drain()
        if self.awaiting_reply:
            await self._read()
            self.awaiting_reply = False
        self._folded, self._deferred_error = NO_STATS, None

    async def request(self, msg: Message) -> tuple[Reply, int, int, int]:
        """Send `msg`, drain outstanding acks, and return (reply, bytes, write_us, wait_us).

        The reply carries the stats of the drained acks too. An error that a
        drained ack reported replaces the reply (it happened first).
        """
        n, write_us = await self.begin(msg)
        reply, wait_us = await self.finish()
        return reply, n, write_us, wait_us

    async def begin(self, msg: Message) -> tuple[int, int]:
        """The first half of :meth:`request`: send `msg` (its reply is then owed); (bytes, write_us)."""
        sent = await self.send(msg)
        self.awaiting_reply = True
        self._reply_owed_since = time.perf_counter()
        return sent

    async def finish(self) -> tuple[Reply, int]:
        """The second half of :meth:`request`: drain the acks, read the reply; (reply, wait_us since sent)."""
        await self.drain()
        reply = await self._read()
        self.awaiting_reply = False
        wait_us = int((time.perf_counter() - self._reply_owed_since) * 1e6)
        if self._deferred_error is not None:
            reply, self._deferred_error = self._deferred_error, None
        if self._folded is not NO_STATS:  # acks were drained: their stats travel with the reply
            reply = with_stats(reply, merge(reply.stats, self._folded))
            self._folded = NO_STATS
        return reply, wait_us


