"""The head's end of direct token return: a listener for the final stage's token-return connection.

With three or more stages the final stage sends the predictions of sessions
configured with DIRECT_RETURN straight to the head, on a connection it dials
to stage 0's address in the topology (role TOKEN_RETURN; lanes are refused
there with "role mismatch"). The hub reads those replies and hands each to
the generation waiting for it, through that session's own memory channel: a
generation waits on its channel, never polls.

When a return connection closes (or stays silent past the deadline: the
final stage sends a keepalive Ack every few seconds), every session waiting
on the hub is told so and fails; the final stage dials again for the next
generation, and if it cannot, generations fall back to the relayed path.
"""

from __future__ import annotations

import itertools
import logging

import attrs
import trio

from skippyd.stage.access import UpstreamAllow
from skippyd.wire.errors import HandshakeRefused, PeerClosed, ProtocolError, ReadTimeout, WireError
from skippyd.wire.handshake import handshake_server, refuse_handshake
from skippyd.wire.messages import Ack, ErrorReply, Hello, PredictedToken, PredictedTokens, Reply, Role
from skippyd.wire.stream import DEFAULT_FRAME_TIMEOUT, ReceiveBuffer, WaitWatch, keep_alive, read_reply

log = logging.getLogger("skippyd.head")

KEEPALIVE_S = 5.0  # the final stage's keepalive interval on an idle return connection
READ_DEADLINE_S = 4 * KEEPALIVE_S  # a return connection silent for this long is closed
SESSION_BUFFER = 8  # replies a session's channel holds (one is in flight at a time)


class ReturnLost(Exception):
    """The token-return connection closed while the session depended on it."""


class LaneSpoke:
    """Put on a session's channel by the head itself: stage 1 said something on the session's lane, where
    its decode steps (DIRECT_RETURN) owe no reply: an Error, or the connection closed. Read the lane."""

    def __init__(self, lane_id: int):
        self.lane_id = lane_id

    def __repr__(self) -> str:
        return f"LaneSpoke(lane {self.lane_id})"


@attrs.define
class HubStats:
    accepted: int = 0  # return connections accepted (handshake passed)
    refused: int = 0  # connections refused at the handshake (a lane dialing here, say)
    tokens: int = 0  # PredictedToken/PredictedTokens delivered to a waiting session
    errors: int = 0  # ErrorReply delivered to a waiting session
    unknown: int = 0  # replies for a session nobody waits for (ended already)
    stale: int = 0  # replies owed to an earlier attempt of a resumed session (dropped)


@attrs.frozen
class _Waiting:
    """A session's channel, and the request id of the attempt it is for."""

    request_id: int
    send: trio.MemorySendChannel


class TokenReturnHub:
    def __init__(self, hello: Hello, *, handshake_timeout: float = 5.0, read_deadline: float = READ_DEADLINE_S,
                 allow: UpstreamAllow | None = None, prediction_timeout: float = 30.0):
        if not prediction_timeout > 0:
            raise ValueError(f"prediction_timeout must be > 0, got {prediction_timeout!r}")
        self.hello = attrs.evolve(hello, role=Role.TOKEN_RETURN)
        self.prediction_timeout = prediction_timeout  # a session's wait for its prediction (runtime.reply_timeout)
        self.allow = allow  # who may connect (the final stage's host by default; see stage/access.py)
        self.handshake_timeout = handshake_timeout
        self.read_deadline = read_deadline
        self.address: str | None = None
        self.connections = 0  # live return connections
        self.stats = HubStats()
        self._sessions: dict[int, _Waiting] = {}
        self._waits: dict[int, float] = {}  # session -> trio time its wait for a prediction began
        self._streams: set[trio.SocketStream] = set()
        self._ids = itertools.count(1)

    # ---------------------------------------------------------------- generations
    def open_session(self, session_id: int, request_id: int) -> trio.MemoryReceiveChannel:
        """Register a session; its predictions carrying `request_id` (or a ReturnLost) arrive on the returned
        channel. A replay opens it again with a new request id: what an earlier attempt was owed is dropped."""
        send, receive = trio.open_memory_channel(SESSION_BUFFER)
        self.close_session(session_id)
        self._sessions[session_id] = _Waiting(request_id, send)
        return receive

    def close_session(self, session_id: int) -> None:
        waiting = self._sessions.pop(session_id, None)
        if waiting is not None:
            waiting.send.close()

    @property
    def waiting(self) -> int:
        return len(self._sessions)

    def begin_wait(self, session_id: int) -> None:
        """The session waits for its prediction from now: within ``prediction_timeout``, or its channel gets
        a ReturnLost. Call :meth:`end_wait` when the wait is over, however it ended."""
        self._waits[session_id] = trio.current_time()

    def end_wait(self, session_id: int) -> None:
        self._waits.pop(session_id, None)

    def interrupt(self, session_id: int, why: str) -> None:
        """Wake the session's wait now with a ReturnLost(why) on its channel (the liveness watch found the
        pipeline down, or the prediction is overdue). The session fails: it opens a new channel to resume."""
        self.wake(session_id, ReturnLost(why))

    def wake(self, session_id: int, item: ReturnLost | LaneSpoke) -> None:
        """Put `item` on the session's channel, if it has one (best effort: a full channel is not waited)."""
        waiting = self._sessions.get(session_id)
        if waiting is not None:
            try:
                waiting.send.send_nowait(item)
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                pass

    async def keep_deadlines(self) -> None:
        """The deadlines of the sessions' waits for a prediction, kept by this one task rather than by a
        cancel scope around every wait (entering and leaving one, with trio's deadline bookkeeping, cost a
        decode step some 1300 interpreted instructions). As WaitWatch does for a connection: while nothing
        waits it sleeps ``prediction_timeout`` (a wait that begins meanwhile is due after that at the
        earliest), otherwise until the oldest wait would be due."""
        timeout = self.prediction_timeout
        while True:
            if not self._waits:
                await trio.sleep(timeout)
                continue
            await trio.sleep_until(min(self._waits.values()) + timeout)
            now = trio.current_time()
            for session_id, since in list(self._waits.items()):
                if since + timeout > now:
                    continue
                waiting = self._sessions.get(session_id)
                if waiting is not None and waiting.send.statistics().current_buffer_used:
                    # its prediction is there, the waiting task has not run yet (this process was not
                    # running): the wait ends at once, but is not timed out meanwhile
                    self._waits[session_id] = now
                    continue
                del self._waits[session_id]
                self.interrupt(session_id, f"the final stage sent no prediction on the token-return connection "
                                           f"within {timeout:g} s")

    def _deliver(self, reply: Reply) -> None:
        waiting = self._sessions.get(reply.session_id)
        if waiting is None:
            self.stats.unknown += 1
            log.debug("head: token-return: reply for session %d, which is not waiting", reply.session_id)
            return
        if reply.request_id != waiting.request_id:
            self.stats.stale += 1
            log.info("head: token-return: dropped a reply of session %d owed to an attempt given up (request %d)",
                     reply.session_id, reply.request_id)
            return
        try:
            waiting.send.send_nowait(reply)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            log.warning("head: token-return: session %d did not take its replies; dropping one", reply.session_id)
            return
        if isinstance(reply, ErrorReply):
            self.stats.errors += 1
        else:
            self.stats.tokens += 1

    def _fail_all(self, why: str) -> None:
        for session_id in list(self._sessions):
            self.interrupt(session_id, why)

    # ---------------------------------------------------------------- the listener
    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen for token-return connections until cancelled. Raises OSError if it cannot listen."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.address = f"{host}:{listeners[0].socket.getsockname()[1]}"
        log.info("head: listening for the final stage's token-return connection on %s", self.address)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, self._handle, listeners)
                nursery.start_soon(self.keep_deadlines)
                task_status.started(self.address)
        finally:
            self.address = None

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = next(self._ids)
        keep_alive(stream)
        receive = ReceiveBuffer(stream)
        self._streams.add(stream)
        try:
            try:
                address = _peer_ip(stream)
                if self.allow is not None and not await self.allow.allows(address):
                    # anyone who passed the handshake could inject tokens into running generations
                    await refuse_handshake(stream, f"upstream address not allowed: {address} may not open the "
                                           f"token-return connection", timeout=self.handshake_timeout,
                                           receive=receive)
                peer = await handshake_server(stream, self.hello, timeout=self.handshake_timeout, receive=receive)
            except HandshakeRefused as exc:
                self.stats.refused += 1
                log.warning("head: refused a connection on the token-return listener: %s", exc.reason)
                return
            except (WireError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                log.info("head: token-return handshake failed: %s", exc)
                return
            self.stats.accepted += 1
            self.connections += 1
            log.info("head: token-return connection %d from stage %d (%s)", conn, peer.stage_index, peer.node)
            why = "closed by the final stage"
            async with trio.open_nursery() as nursery:
                # the read deadline, kept by a task (no cancel scope per token); see WaitWatch
                watch = WaitWatch(receive, self.read_deadline)
                nursery.start_soon(watch.run)
                try:
                    while True:
                        reply = await read_reply(receive, timeout=self.read_deadline, watch=watch,
                                                 frame_timeout=DEFAULT_FRAME_TIMEOUT)
                        if isinstance(reply, Ack):
                            continue  # keepalive
                        if isinstance(reply, (PredictedToken, PredictedTokens, ErrorReply)):
                            self._deliver(reply)
                except ReadTimeout:
                    why = f"silent for {self.read_deadline:g} s"
                except ProtocolError as exc:
                    why = f"protocol error: {exc}"
                except PeerClosed:
                    pass
                except trio.ClosedResourceError:
                    why = "closed by the head"
                except (WireError, trio.BrokenResourceError) as exc:
                    why = str(exc)
                finally:
                    watch.close()
                    self.connections -= 1
            log.warning("head: token-return connection %d lost (%s); waiting generations fail", conn, why)
            self._fail_all(f"the token-return connection was lost ({why})")
        finally:
            self._streams.discard(stream)
            await trio.aclose_forcefully(stream)

    async def disconnect(self) -> None:
        """Close every return connection (the final stage dials again at its next direct-return session)."""
        for stream in list(self._streams):
            await trio.aclose_forcefully(stream)

    def describe(self) -> dict:
        return {"listen": self.address, "connections": self.connections, "waiting": self.waiting,
                **attrs.asdict(self.stats)}


def _peer_ip(stream: trio.SocketStream) -> str:
    try:
        return stream.socket.getpeername()[0]
    except (OSError, AttributeError, IndexError):
        return "?"
