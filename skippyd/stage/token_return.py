"""The final stage's token-return connection to the head (direct token return).

With three or more stages, a session configured with DIRECT_RETURN gets its
predictions from the final stage straight to stage 0 instead of through
every middle stage. The final stage dials stage 0's address (from the
topology) lazily, when the first such session is configured, and keeps the
connection for every later session; only this end writes on it. If the
connection breaks it is dialed again at the next configure; if dialing
fails, configures are answered DIRECT_RETURN_UNAVAILABLE without dialing
for a while (2 s, doubling after each failed dial up to a minute; the head
then uses the relayed path) instead of paying a connect timeout each time.

The connection's tasks (an EOF watch: the head never writes, so anything
readable means it closed; a keepalive Ack when idle; those of a wrapper put
around the stream by ``wrap``) run in the nursery of :meth:`TokenReturnLink.run`,
which is part of the stage's lifetime.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs
import trio

from skippyd.wire.errors import WireError
from skippyd.wire.handshake import handshake_client
from skippyd.wire.messages import Ack, Hello, Reply, Role
from skippyd.wire.stream import PreparedFrame, ReceiveBuffer, keep_alive, write_frame

log = logging.getLogger("skippyd.stage")

KEEPALIVE_S = 5.0  # an Ack(0, 0) when nothing was sent for this long (the head's deadline is 4×)
RETRY_S = 2.0  # after a failed dial, configures fall back without dialing for this long ...
RETRY_MAX_S = 60.0  # ... doubling after each further failure, up to this


class TokenReturnLost(Exception):
    """The prediction could not be sent on the token-return connection."""


@attrs.define
class ReturnStats:
    dials: int = 0  # successful dials (handshakes)
    dial_failures: int = 0
    sent: int = 0  # predictions (and errors) sent for direct-return sessions
    lost: int = 0  # connections that broke while in use


class _Connection:
    def __init__(self, stream: trio.SocketStream, out: trio.abc.SendStream, receive: ReceiveBuffer, peer: Hello):
        self.stream = stream
        self.out = out
        self.receive = receive
        self.peer = peer
        self.lock = trio.Lock()  # one frame at a time: several lanes send predictions
        self.closed = trio.Event()
        self.last_send = trio.current_time()

    async def close(self) -> None:
        self.closed.set()
        if self.out is not self.stream:
            await trio.aclose_forcefully(self.out)  # what it still holds is dropped
        await trio.aclose_forcefully(self.stream)


class TokenReturnLink:
    def __init__(self, hello: Hello, host: str, port: int, *, connect_timeout: float = 5.0,
                 write_timeout: float = 10.0,
                 wrap: Callable[[trio.SocketStream, trio.Nursery], trio.abc.SendStream] | None = None):
        """``wrap(stream, nursery)``: what a connection just dialed sends through (default: the stream)."""
        self.hello = attrs.evolve(hello, role=Role.TOKEN_RETURN)
        self.host, self.port = host, port
        self.connect_timeout = connect_timeout
        self.write_timeout = write_timeout
        self.wrap = wrap
        self.stats = ReturnStats()
        self.last_error: str | None = None
        self._conn: _Connection | None = None
        self._dial_lock = trio.Lock()
        self._retry_at = -float("inf")
        self._retry_s = RETRY_S
        self._nursery: trio.Nursery | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed.is_set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The lifetime of the return connection's tasks (until cancelled)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            conn, self._conn = self._conn, None
            if conn is not None:
                with trio.CancelScope(shield=True):
                    await conn.close()

    # ---------------------------------------------------------------- dialing
    async def ensure(self) -> bool:
        """True when a live connection to the head exists, dialing one if needed (at most one dial at a time)."""
        if self.connected:
            return True
        async with self._dial_lock:
            if self.connected:
                return True
            if self._nursery is None or trio.current_time() < self._retry_at:
                return False
            try:
                self._conn = await self._dial()
            except (OSError, trio.TooSlowError, WireError, trio.BrokenResourceError) as exc:
                self.stats.dial_failures += 1
                self._retry_at = trio.current_time() + self._retry_s
                self._retry_s = min(2 * self._retry_s, RETRY_MAX_S)
                reason = str(exc) or type(exc).__name__
                if reason != self.last_error:
                    log.warning("final stage: cannot open the token-return connection to the head at %s: %s; "
                                "predictions take the relayed path", self.address, reason)
                self.last_error = reason
                return False
            self.stats.dials += 1
            self.last_error = None
            self._retry_s = RETRY_S
            log.info("final stage: token-return connection to the head at %s open", self.address)
            return True

    async def _dial(self) -> _Connection:
        with trio.fail_after(self.connect_timeout):
            stream = await trio.open_tcp_stream(self.host, self.port)  # TCP_NODELAY
        keep_alive(stream, user_timeout=True)  # small frames the head reads at once: unacknowledged means lost
        try:
            receive = ReceiveBuffer(stream, read_size=0)
            peer = await handshake_client(stream, self.hello, timeout=self.connect_timeout, receive=receive)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        out = self.wrap(stream, self._nursery) if self.wrap is not None else stream
        conn = _Connection(stream, out, receive, peer)
        self._nursery.start_soon(self._watch, conn)
        return conn

    async def _watch(self, conn: _Connection) -> None:
        """Until the connection ends: wait for the head's EOF (it never writes) and send keepalives."""
        async def eof() -> None:
            try:
                await conn.stream.receive_some(1)  # EOF, a reset, or bytes nobody should send: all end it
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            nursery.cancel_scope.cancel()

        async def keepalive() -> None:
            while True:
                await trio.sleep_until(conn.last_send + KEEPALIVE_S)
                if trio.current_time() - conn.last_send >= KEEPALIVE_S:
                    try:
                        await self._write(conn, Ack(0, 0))
                    except TokenReturnLost:
                        nursery.cancel_scope.cancel()
                        return

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(eof)
                nursery.start_soon(keepalive)
        finally:
            stopping = trio.current_effective_deadline() == -float("inf")  # cancelled from outside
            await self._drop(conn, "closed by the head", quiet=stopping)

    async def _drop(self, conn: _Connection, why: str, *, quiet: bool = False) -> None:
        if self._conn is conn:
            self._conn = None
            if not quiet:
                self.stats.lost += 1
                log.info("final stage: token-return connection to %s lost (%s); dialing again at the next "
                         "direct-return session", self.address, why)
        await conn.close()

    # ---------------------------------------------------------------- sending
    def prepare(self, frame: bytes, us_at: int) -> PreparedFrame | None:
        """A prediction's frame for the compute that makes it to write (see PreparedFrame), then :meth:`send`
        with it; None while no connection is up or another lane's send holds it. Nothing else may be sent on
        the connection in between: the caller must not wait for anything until then."""
        conn = self._conn
        if conn is None or conn.closed.is_set() or conn.lock.locked():
            return None
        return PreparedFrame.for_stream(conn.out, frame, 0, us_at)

    async def send(self, reply: Reply, prepared: PreparedFrame | None = None) -> None:
        """Send one prediction (or error) of a direct-return session (``prepared``: its frame, which the
        compute may have written already). Raises TokenReturnLost."""
        conn = self._conn
        if conn is None or conn.closed.is_set():
            raise TokenReturnLost(f"no token-return connection to the head at {self.address}")
        await self._write(conn, reply, prepared)
        self.stats.sent += 1

    async def _write(self, conn: _Connection, reply: Reply, prepared: PreparedFrame | None = None) -> None:
        if prepared is None or not prepared.written:  # (a frame written already must be finished, cancelled or not)
            await trio.lowlevel.checkpoint_if_cancelled()
        try:
            # a free lock (the usual case) is taken without trio's schedule point, which an uncontended
            # Lock.acquire still makes: a pass of the scheduler before every prediction, on every token
            conn.lock.acquire_nowait()
        except trio.WouldBlock:
            await conn.lock.acquire()
        try:
            await write_frame(conn.out, reply, timeout=self.write_timeout, prepared=prepared)
        except (WireError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            with trio.CancelScope(shield=True):
                await self._drop(conn, str(exc) or type(exc).__name__)
            raise TokenReturnLost(f"token-return connection to {self.address} lost: {exc}") from exc
        except BaseException:  # cancelled halfway: the stream may hold half a frame
            with trio.CancelScope(shield=True):
                await self._drop(conn, "a send was interrupted")
            raise
        finally:
            conn.lock.release()
        conn.last_send = trio.current_time()

    def describe(self) -> dict:
        return {"head": self.address, "connected": self.connected, "last_error": self.last_error,
                **attrs.asdict(self.stats)}
