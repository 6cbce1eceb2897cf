"""One upstream connection of a stage, from the end of its handshake to its close.

The listener (``StageServer``) admits a connection (handshake cap, allow-list,
handshake) and hands it over with the stage's core, its stream and its peer:
:meth:`UpstreamConnection.serve` reads each message and has the handlers of
the stage's role (skippyd/stage/roles.py) handle it. Whatever ends the
connection (the peer closing, a protocol violation, a dead downstream,
daemon shutdown) runs :meth:`UpstreamConnection.release_all` in a shielded,
time-bounded scope, so every KV sequence and slot the connection held is
freed on this stage, and closing our downstream connection makes the next
stage do the same.

A peer that vanishes without a word (its host down, the link cut, packets
lost one way) is found by the kernel (``keep_alive`` in skippyd/wire/stream.py):
the connection is probed after a second of quiet and our replies must be
acknowledged, so about ``runtime.peer_timeout`` s after the upstream's host
last answered the socket fails with ETIMEDOUT and the connection ends as
any other, releasing its sessions, whether or not the link comes back.
The same probes go down the middle stage's own link to the next stage. An
upstream *process* that is stopped or busy keeps its connection: its
kernel answers the probes.
"""

from __future__ import annotations

import itertools
import logging

import trio

from skippyd.stage.downstream import DownstreamError, DownstreamLink
from skippyd.stage.roles import handlers_for
from skippyd.wire.errors import PeerClosed, ProtocolError, ReadTimeout, WireError
from skippyd.wire.messages import ErrorCode, ErrorReply, Limits
from skippyd.wire.stream import ReceiveBuffer, WaitWatch, keep_alive, read_message, timed_out, write_frame

log = logging.getLogger("skippyd.stage")

_conn_ids = itertools.count(1)
CLEANUP_TIMEOUT_S = 5.0
DOWNSTREAM_CHECK_S = 1.0  # how often an idle middle-stage lane checks its link to the next stage


class UpstreamConnection:
    """An admitted upstream connection: its read loop, and the release of its sessions however it ends.

    ``stream``: the connection (its handshake done); ``receive``: its reads (with what the handshake read
    ahead); ``out``: what replies are written to (the stream, or a wrapper put around it where it was
    accepted; closing it closes the stream); ``peer``: its address, for the log; ``down``: a middle stage's
    link to the next stage, opened during the handshake."""

    def __init__(self, core, stream: trio.abc.Stream, peer: str, *, receive: ReceiveBuffer | None = None,
                 out: trio.abc.SendStream | None = None, down: DownstreamLink | None = None):
        self.core = core
        self.stream = stream
        self.peer = peer
        self.receive = receive if receive is not None else ReceiveBuffer(stream)
        self.out = out if out is not None else stream
        self.conn_id = next(_conn_ids)
        self._down = down
        self.handlers = None  # made by serve, for the stage's role
        self.gone_silent = False  # the upstream's host stopped answering (see keep_alive): the log says so
        self.down_dead: str | None = None  # why an idle connection was closed for its dead downstream link
        self._idle: WaitWatch | None = None  # the read loop's first-byte deadline (a socket stream's)
        # a timed link (see skippyd/wire/handshake.py): what its dialer chose and measured (encoding, kbit/s),
        # and the least rate a frame must keep arriving at, from that measure (None: the core's)
        self.upstream_link: tuple | None = None
        self.frame_min_rate: float | None = None

    async def serve(self) -> None:
        """Until the connection ends; then release every session it owned, and close it."""
        peer_timeout = self.core.config.peer_timeout_s
        if isinstance(self.stream, trio.SocketStream):
            # our replies are small and read at once: unacknowledged ones mean the upstream no longer hears us
            keep_alive(self.stream, peer_timeout=peer_timeout, user_timeout=True)
        if self._down is not None and isinstance(self._down.stream, trio.SocketStream):
            keep_alive(self._down.stream, peer_timeout=peer_timeout)
        async with trio.open_nursery() as nursery:  # the tasks of what the connection opens
            down, self._down = self._down, None
            self.handlers = handlers_for(self.core, self.conn_id, self.out, nursery, down=down)
            if down is not None and isinstance(self.stream, trio.SocketStream):
                nursery.start_soon(self._watch_downstream, down)
            try:
                await self._read_loop(nursery)
            finally:
                with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
                    await self.release_all()
                await self.handlers.aclose()
                if self.out is not self.stream:  # a wrapper lets its last frames (an error, say) arrive
                    with trio.CancelScope(shield=True):
                        await self.out.aclose()
                await trio.aclose_forcefully(self.stream)
                nursery.cancel_scope.cancel()

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        core, cfg = self.core, self.core.config
        idle: WaitWatch | None = None
        try:
            limits = Limits(max_tokens=min(core.context.n_batch, 8192))
            if isinstance(self.stream, trio.SocketStream):
                # idle_timeout_s bounds the wait for a frame's first byte only (kept by a task: no cancel scope
                # per read); a frame once started must be complete within frame_timeout_s (plus its size at
                # frame_min_rate): a peer that starts a frame and trickles it is dropped in seconds, with its
                # sessions, not after the idle deadline
                idle = self._idle = WaitWatch(self.receive, cfg.idle_timeout_s)
                nursery.start_soon(idle.run)
            n_embd = core.model.n_embd_inp
            dispatch = self.handlers.dispatch
            while True:
                msg = await read_message(self.receive, limits, timeout=cfg.idle_timeout_s, watch=idle,
                                         frame_timeout=cfg.frame_timeout_s,
                                         min_rate=self.frame_min_rate or core.frame_min_rate,
                                         n_embd=n_embd)
                await dispatch(msg)
        except ProtocolError as exc:
            log.warning("stage %d: protocol error from %s: %s", core.index, self.peer, exc)
            await self._fail_connection(exc.code, exc.message, exc.request_id, exc.session_id)
        except DownstreamError as exc:
            log.warning("stage %d: downstream failed: %s", core.index, exc)
        except ReadTimeout as exc:
            if self.down_dead is not None:
                log.info("stage %d: closing idle upstream %s: %s", core.index, self.peer, self.down_dead)
            elif exc.mid_frame:
                log.warning("stage %d: upstream %s: %s; closing", core.index, self.peer, exc)
            else:
                log.info("stage %d: upstream %s idle past the deadline; closing", core.index, self.peer)
        except (PeerClosed, WireError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if timed_out(exc):
                self.gone_silent = True
                held = len(core.sessions.owned_by(self.conn_id))
                log.log(logging.WARNING if held else logging.INFO,
                        "stage %d: upstream %s silent for %g s (its host does not answer, or does not acknowledge "
                        "our replies): closing; releasing its %d session(s)", core.index, self.peer,
                        cfg.peer_timeout_s, held)
            else:
                log.info("stage %d: upstream %s closed", core.index, self.peer)
        except Exception:  # a bug must cost one connection, never the daemon
            log.exception("stage %d: connection from %s failed", core.index, self.peer)
        finally:
            if idle is not None:
                idle.close()

    async def _watch_downstream(self, link: DownstreamLink) -> None:
        """A middle stage's idle lane: once its link to the next stage is dead (that stage closed it, or its
        host fell silent: see keep_alive), close the upstream connection too, so that the head drops the
        lane (its pool prunes closed lanes) before a generation takes it and fails. Checked every second, and
        only while the connection holds no session and the link owes nothing (a reply on its way reads as
        readable, as a close does): a running generation learns of a dead link from the link itself."""
        while True:
            await trio.sleep(DOWNSTREAM_CHECK_S)
            if self._idle is None or not link.settled or self.core.sessions.owned_by(self.conn_id):
                continue
            if not link.looks_alive():
                self.down_dead = f"its link to stage {self.core.index + 1} at {link.address} is dead"
                self._idle.expire(self.down_dead)
                return

    async def release_all(self) -> None:
        """Release every session this connection owned; one whose release raises does not keep the others."""
        core = self.core
        for session in core.sessions.owned_by(self.conn_id):
            try:
                await core.release(session)
            except Exception:  # a bug releasing one session must not keep the others (and the links) held
                log.exception("stage %d: releasing session %d failed", core.index, session.session_id)
                continue
            log.info("stage %d: released session %d (%s)", core.index, session.session_id,
                     "upstream silent" if self.gone_silent else "connection closed")

    async def _fail_connection(self, code: ErrorCode, message: str, request_id: int = 0, session_id: int = 0):
        """Tell the peer why the connection ends (best effort; the close lets it arrive)."""
        with trio.move_on_after(1.0, shield=True):
            try:
                await write_frame(self.out, ErrorReply(request_id, session_id, code, message[:4000]))
            except (WireError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
