"""A connection to the next stage: handshake, sending, and deferred acks (credits).

Non-final prefill chunks are acknowledged by the next stage before it
computes them. We do not wait for those acks one by one: up to
``credit_limit`` may be outstanding, so this stage computes chunk i+1 while
chunk i is on the wire or being computed downstream. Any message that
expects a prediction first drains the outstanding acks, folding their
stats into the reply.

A big deferred frame (a prompt chunk's activation) is written by a task of
its own (:meth:`DownstreamLink.send_deferred`): over a link slower than the
compute, this stage computes the next chunk while the last one is still
leaving, rather than waiting for the link and then computing. Frames still
leave one at a time, in order: every other send waits for that write first.

Sessions with direct token return (three or more stages) are sent their
decode steps with :meth:`DownstreamLink.send_expecting_ack` too: the next
stage acknowledges each step on the lane while the prediction travels on the
token-return connection, so no stage waits for the prediction. Or the steps
go with DIRECT_RETURN and owe nothing (:meth:`DownstreamLink.send`): the
next stage says something only if it fails, and :meth:`watch_silence` wakes
the sender when it does, without a read per step.

The kernel probes the link after a second of quiet (``keep_alive``): a
next stage whose host vanished fails the socket within ``peer_timeout``
when nothing of ours is in flight, and :meth:`DownstreamLink.looks_alive`
says so before the link is used again.

Activations go in the encoding chosen when the link opened (``wire``, and
``choice`` says why; skippyd/stage/link_choice.py): with ``activation_wire =
"auto"`` float32 unless the link, timed right after the handshake, is slow
enough that half floats save a real share of the time; "f16" half floats
wherever the next stage takes them. The next stage widens half floats back to
float32 before its layers.

What the link sends goes through ``out``: the stream itself, or a wrapper
that whoever made the stream put around it (``wrap`` of :meth:`DownstreamLink.connect`);
closing ``out`` closes the stream.
"""

from __future__ import annotations

import select
import time
from collections import deque
from collections.abc import Callable

import trio

from skippyd.stage.link_choice import LinkChoice, WirePolicy
from skippyd.wire.codec import decode_step_head
from skippyd.wire.errors import PeerClosed, ProtocolError, WireError
from skippyd.wire.handshake import handshake_client, report_link, time_link
from skippyd.wire.messages import (
    NO_STATS,
    TRUSTED,
    Ack,
    ErrorReply,
    Hello,
    Message,
    Reply,
    StageStats,
    WireFormat,
    link_timed,
    merge,
    negotiate_wire,
    with_stats,
)
from skippyd.wire.stream import (
    DEFAULT_FRAME_TIMEOUT,
    DEFAULT_PEER_TIMEOUT,
    PreparedFrame,
    ReceiveBuffer,
    WaitWatch,
    keep_alive,
    read_reply,
    write_frame,
)

# a deferred frame at least this big is written behind the caller's back (see send_deferred); a smaller one
# goes into the socket's buffer at once anyway
WRITE_BEHIND_BYTES = 64 * 1024


def _activation_bytes(msg: Message) -> int:
    act = getattr(msg, "activation", None)
    return 0 if act is None else act.nbytes


def _mode(offered: WireFormat) -> str:
    """The runtime.activation_wire a Hello's offer stands for."""
    return "auto" if offered & WireFormat.TIMED else "f16" if offered & WireFormat.F16 else "f32"


class DownstreamError(Exception):
    """The next stage is unreachable, refused us, or broke the protocol."""

    def __init__(self, address: str, message: str):
        super().__init__(f"stage at {address}: {message}")
        self.address = address
        self.detail = message


class DownstreamLink:
    def __init__(self, stream: trio.SocketStream, peer: Hello, address: str, receive: ReceiveBuffer, *,
                 credit_limit: int, reply_timeout: float, write_timeout: float,
                 out: trio.abc.SendStream | None = None, nursery: trio.Nursery | None = None,
                 wire: WireFormat = WireFormat.F32):
        self.stream = stream
        self.wire = wire  # how activations travel on this link (chosen when it opened)
        self.choice: LinkChoice | None = None  # ... and why (connect sets it)
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
        # what an interrupted caller left behind (see settle): a frame half written, replies not yet read
        self.writing = False
        self._owed: deque[float] = deque()  # when each request whose reply is owed was sent, oldest first
        self._nursery = nursery
        self._silence: trio.CancelScope | None = None  # see watch_silence
        self._behind: trio.Event | None = None  # set once the frame a task writes (send_deferred) is out
        self._behind_error: str | None = None  # why that write failed
        # the reply deadline, kept by a task in `nursery` (no cancel scope per read); without one, per read
        self._watch: WaitWatch | None = None
        if nursery is not None and isinstance(stream, trio.SocketStream):
            self._watch = WaitWatch(receive, reply_timeout)
            nursery.start_soon(self._watch.run)

    @classmethod
    async def connect(cls, host: str, port: int, hello: Hello, *, connect_timeout: float = 5.0,
                      credit_limit: int = 2, reply_timeout: float = 30.0, write_timeout: float = 10.0,
                      wrap: Callable[[trio.SocketStream, trio.Nursery | None], trio.abc.SendStream] | None = None,
                      nursery: trio.Nursery | None = None,
                      peer_timeout: float = DEFAULT_PEER_TIMEOUT,
                      policy: WirePolicy | None = None) -> DownstreamLink:
        """Dial and handshake. ``wrap(stream, nursery)``: what frames after the handshake are sent through
        (default: the stream). With a ``nursery``, the reply deadline is kept by a task there (see
        WaitWatch), not by a cancel scope per read. ``peer_timeout``: the kernel fails the connection once
        the next stage's host has been silent this long (see keep_alive). ``policy``: how the activations'
        encoding is chosen (default: the mode ``hello`` offers, this stage's compute not timed); a link whose
        ``hello`` says TIMED is timed through ``wrap`` after the handshake (skippyd/wire/handshake.py)."""
        address = f"{host}:{port}"
        try:
            with trio.fail_after(connect_timeout):
                stream = await trio.open_tcp_stream(host, port)
        except (OSError, trio.TooSlowError) as exc:
            raise DownstreamError(address, f"cannot connect: {exc or 'timed out'}") from exc
        keep_alive(stream, peer_timeout=peer_timeout)
        receive = ReceiveBuffer(stream)
        try:
            peer = await handshake_client(stream, hello, timeout=connect_timeout, receive=receive)
        except WireError as exc:
            await trio.aclose_forcefully(stream)
            raise DownstreamError(address, f"handshake failed: {exc}") from exc
        out = wrap(stream, nursery) if wrap is not None else stream
        policy = policy if policy is not None else WirePolicy(_mode(hello.wire_formats), hello.n_embd)
        if link_timed(hello, peer):
            try:
                timing = await time_link(out, receive, timeout=connect_timeout)
                choice = policy.choose(timing)
                await report_link(out, choice.wire, timing, timeout=connect_timeout)
            except (WireError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                if out is not stream:
                    await trio.aclose_forcefully(out)
                await trio.aclose_forcefully(stream)
                raise DownstreamError(address, f"timing the link failed: {exc}") from exc
        else:
            choice = policy.untimed(negotiate_wire(hello, peer))
        link = cls(stream, peer, address, receive, credit_limit=credit_limit, reply_timeout=reply_timeout,
                   write_timeout=write_timeout, out=out, nursery=nursery, wire=choice.wire)
        link.choice = choice
        return link

    def describe_choice(self) -> LinkChoice:
        """How this link's activations travel, and why."""
        return self.choice if self.choice is not None else LinkChoice(self.wire, _mode(self.wire))

    def looks_alive(self) -> bool:
        """Non-blocking check between requests: False once the next stage closed or reset the connection.

        With nothing outstanding the next stage has nothing to say, so a
        readable socket means EOF, a reset, or a frame nobody asked for.
        While acks are outstanding the answer is True (unknown).
        """
        if self.broken or getattr(self._out, "broken", False):  # a wrapper whose own sending failed
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
        self._end_silence()
        if self._watch is not None:
            self._watch.close()
        if self._out is not self.stream:
            await trio.aclose_forcefully(self._out)  # what it still holds is dropped
        await trio.aclose_forcefully(self.stream)

    def prepare_step(self, request_id: int, session_id: int, pos: int, token: int, direct_return: bool,
                     n_embd: int) -> PreparedFrame | None:
        """A decode step's frame, in this link's encoding, for the compute that makes its activation to write
        (see PreparedFrame), then :meth:`send` with it; None if this link cannot take one now (broken, given
        up, a frame half written). Nothing else may be sent on the link in between (the single writer's
        rule). A compute that cannot fill a half-float frame (a value beyond half's range) leaves it unwritten,
        and :meth:`send` encodes the step itself."""
        if self.broken or self.writing or (self._watch is not None and self._watch.expired is not None):
            return None
        f16 = bool(self.wire & WireFormat.F16)
        n = n_embd * (2 if f16 else 4)
        return PreparedFrame.for_stream(self._out, decode_step_head(request_id, session_id, pos, token,
                                                                    direct_return, n, f16=f16), n)

    async def send(self, msg: Message, prepared: PreparedFrame | None = None) -> tuple[int, int]:
        """Write one message; returns (bytes, microseconds). ``prepared``: its frame, which a native compute
        may have written already (then only what is left of it goes, and nothing is checked first: the frame
        is on its way, and a cancellation must find it counted)."""
        started = time.perf_counter()
        if prepared is None or not prepared.written:
            await self._ready_to_write()
        self.writing = True
        try:
            n = await write_frame(self._out, msg, timeout=self.write_timeout, prepared=prepared, wire=self.wire)
        except WireError as exc:
            self.broken = True
            raise DownstreamError(self.address, f"send failed: {exc}") from exc
        self.writing = False
        return n, int((time.perf_counter() - started) * 1e6)

    async def _ready_to_write(self) -> None:
        """Before a frame's first byte: the frame a task is writing is out, the link still usable. A
        cancellation already pending (a kill while this task computed) lands here, before the first byte,
        rather than at write_frame's first checkpoint, where the frame would count as half written."""
        if self._behind is not None:
            await self._behind.wait()
            self._behind = None  # (not waited for again: a decode step's send has no schedule point to spare)
        if self._behind_error is not None:
            raise DownstreamError(self.address, f"send failed: {self._behind_error}")
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._watch is not None and self._watch.expired is not None:
            raise DownstreamError(self.address, f"link given up: {self._watch.expired}")

    async def send_deferred(self, msg: Message, prepared: PreparedFrame | None = None) -> tuple[int, int]:
        """Send a message whose ack may arrive later (up to the credit limit outstanding). Its bytes and write
        time travel with the next reply, as its ack's report does (this stage's report went up with its own
        ack, before this forward). A big frame is written by a task in the link's nursery: this returns once
        the previous one is out and this one has begun (its bytes and time are counted when it is out); the
        link counts as writing until then (nothing may be prepared on it, :meth:`settle` waits for it)."""
        if prepared is not None or self._nursery is None or _activation_bytes(msg) < WRITE_BEHIND_BYTES:
            sent = await self.send(msg, prepared)
            self._fold_sent(*sent)
        else:
            await self._ready_to_write()
            self.writing = True
            self._behind = trio.Event()
            self._nursery.start_soon(self._write_behind, msg, self._behind)
            sent = (0, 0)
        self.pending_acks += 1
        while self.pending_acks > self.credit_limit:
            await self._collect_one_ack()
        return sent

    def _fold_sent(self, n: int, write_us: int) -> None:
        self._folded = merge(self._folded, TRUSTED[StageStats](0, 0, 0, write_us, 0, n, 0, 0))

    async def _write_behind(self, msg: Message, done: trio.Event) -> None:
        """send_deferred's task: write ``msg``; a failure breaks the link, and a read waiting on it is woken."""
        started = time.perf_counter()
        try:
            n = await write_frame(self._out, msg, timeout=self.write_timeout, wire=self.wire)
        except (WireError, trio.ClosedResourceError, trio.BrokenResourceError, OSError) as exc:
            self.broken = True
            self._behind_error = str(exc) or type(exc).__name__
            if self._watch is not None:
                self._watch.expire(f"send failed: {self._behind_error}")
        else:
            self._fold_sent(n, int((time.perf_counter() - started) * 1e6))
            self.writing = False
        finally:  # (cancelled with the nursery: the frame is half written, the link stays `writing`)
            done.set()

    async def send_expecting_ack(self, msg: Message, prepared: PreparedFrame | None = None) -> tuple[int, int]:
        """Send a message whose ack is collected later (by :meth:`drain` or a later request),
        without waiting for older acks: a direct-return decode step. Returns (bytes, microseconds)."""
        sent = await self.send(msg, prepared)
        self.pending_acks += 1
        return sent

    def watch_silence(self, on_spoke: Callable[[], None]) -> bool:
        """Until the next read on this link: call ``on_spoke`` (once) as soon as the next stage sends
        anything or closes, though nothing was asked of it. For messages that owe no reply (DIRECT_RETURN
        decode steps), whose sender waits elsewhere (on the token-return connection) and must still learn
        of a failure reported on the lane. A task in the link's nursery waits for the socket to become
        readable, and reads nothing: the read that follows (any read ends the watch) takes the message.
        False if this link cannot be watched (no nursery, not a socket)."""
        if self._nursery is None or not isinstance(self.stream, trio.SocketStream) or self.broken:
            return False
        self._end_silence()
        self._silence = trio.CancelScope()
        if self._receive.buffered:  # already here: the socket may never become readable again
            on_spoke()
        else:
            self._nursery.start_soon(self._await_spoke, self._silence, on_spoke)
        return True

    async def _await_spoke(self, scope: trio.CancelScope, on_spoke: Callable[[], None]) -> None:
        if scope.cancel_called:  # a read came first (before this task ran): it may be waiting on the socket
            return
        with scope:
            try:
                await trio.lowlevel.wait_readable(self.stream.socket)
            except (trio.ClosedResourceError, OSError):  # closed by this end: whoever closed it knows
                return
            on_spoke()

    @property
    def watching_silence(self) -> bool:
        """A :meth:`watch_silence` is on: nothing was read since."""
        return self._silence is not None

    def _end_silence(self) -> None:
        # cancelling takes the waiting task off the socket at once (trio aborts its wait synchronously),
        # so a read may follow without a checkpoint in between
        if self._silence is not None:
            self._silence.cancel()
            self._silence = None

    def take_folded(self) -> tuple[StageStats, ErrorReply | None]:
        """The stats of the acks collected since the last reply, and the first error one of them
        reported (both cleared): to fold into this stage's next reply upstream."""
        folded, self._folded = self._folded, NO_STATS
        error, self._deferred_error = self._deferred_error, None
        return folded, error

    async def _read(self) -> Reply:
        self._end_silence()
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

    async def read_unasked(self) -> Reply:
        """Read what the next stage sent unasked (after ``watch_silence`` called back): an Error, usually.
        Raises DownstreamError if the link closed."""
        return await self._read()

    async def drain(self, keep: int = 0) -> None:
        """Collect the owed acks, all but the ``keep`` newest (those of messages sent after the one waited for)."""
        while self.pending_acks > keep:
            await self._collect_one_ack()

    @property
    def awaiting_reply(self) -> bool:
        """A request's reply is owed (:meth:`begin` sent it, :meth:`finish` has not read it)."""
        return bool(self._owed)

    @property
    def settled(self) -> bool:
        """Nothing left half done: no frame half written, no ack or reply owed by the next stage."""
        return not (self.broken or self.writing or self.pending_acks or self._owed)

    async def settle(self) -> None:
        """Finish what an interrupted caller left: collect the owed acks and the owed reply (dropped), so
        the link can carry the next request (a Stop, say). A frame half written cannot be finished: raises
        DownstreamError (close the link). Waits for the next stage: bound it with a cancel scope."""
        if self._behind is not None:
            await self._behind.wait()  # a frame a task is writing: out before anything else goes
            self._behind = None
        if self.writing:
            self.broken = True
            raise DownstreamError(self.address, "a frame was left half written")
        await self.drain()
        while self._owed:
            await self._read()
            self._owed.popleft()
        self._folded, self._deferred_error = NO_STATS, None

    async def request(self, msg: Message) -> tuple[Reply, int, int, int]:
        """Send `msg`, drain outstanding acks, and return (reply, bytes, write_us, wait_us).

        The reply carries the stats of the drained acks too. An error that a
        drained ack reported replaces the reply (it happened first).
        """
        n, write_us = await self.begin(msg)
        reply, wait_us = await self.finish()
        return reply, n, write_us, wait_us

    async def begin(self, msg: Message, prepared: PreparedFrame | None = None) -> tuple[int, int]:
        """The first half of :meth:`request`: send `msg` (its reply is then owed, after those of the requests
        begun before it, which the next stage answers in order); (bytes, write_us)."""
        sent = await self.send(msg, prepared)
        self._owed.append(time.perf_counter())
        return sent

    async def finish(self) -> tuple[Reply, int]:
        """The second half of :meth:`request`: drain the acks, read the oldest owed reply; (reply, wait_us since
        its request was sent)."""
        await self.drain()
        reply = await self._read()
        wait_us = int((time.perf_counter() - self._owed.popleft()) * 1e6)
        if self._deferred_error is not None:
            reply, self._deferred_error = self._deferred_error, None
        if self._folded is not NO_STATS:  # acks were drained: their stats travel with the reply
            reply = with_stats(reply, merge(reply.stats, self._folded))
            self._folded = NO_STATS
        return reply, wait_us
