"""The head's pool of lanes: persistent connections to stage 1.

A lane carries one generation at a time. Checkout hands out an idle lane
(replacing one whose peer went away), or opens a new one up to capacity, or
waits. A lane returned with anything left half done on its link (a request
the generation's cleanup could not finish) or marked ``dirty`` is closed on
return: its stream may hold half a frame. ``drain`` stops checkouts (running
generations finish, idle lanes close); ``undrain`` restores service.

Idle lanes are kept alive, or found dead, by the kernel: each lane is probed
after a second of quiet (``keep_alive`` in skippyd/wire/stream.py), so a lane
whose stage 1 vanished (its host down, the link cut) fails its socket within
``peer_timeout`` s, and :meth:`LanePool.prune` (run every second by the
head) and :meth:`LanePool.checkout` close it instead of handing it to a
generation, which would find it dead only at its reply deadline.

``wrap(stream, nursery)`` (link conditioning, for tests and benchmarks) is
put around each lane's stream as it is made; its tasks run in the pool's
``nursery`` (the head node's).
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import time
from collections.abc import Callable

import attrs
import trio

from skippyd.stage.downstream import DownstreamError, DownstreamLink
from skippyd.stage.link_choice import WirePolicy, describe_links, untimed
from skippyd.wire.messages import Hello
from skippyd.wire.stream import DEFAULT_PEER_TIMEOUT

log = logging.getLogger("skippyd.head")


class PoolDraining(Exception):
    """The lane pool is draining (``skippyctl lanes drain``, or the daemon's drain): no new generations."""


class NoLaneAvailable(Exception):
    """No lane became free by the checkout's deadline."""


class LaneState(enum.StrEnum):
    IDLE = "idle"
    BUSY = "busy"  # carrying a generation
    CLOSED = "closed"


@attrs.define(eq=False)
class Lane:
    lane_id: int
    link: DownstreamLink | None = None
    session_id: int | None = None
    state: LaneState = LaneState.IDLE
    opened: float = attrs.field(factory=time.monotonic)
    generations: int = 0
    dirty: bool = False  # the stream cannot be trusted (or the peer is wedged): close it on return

    def describe(self) -> dict:
        return {
            "lane_id": self.lane_id,
            "state": self.state,
            "session_id": self.session_id,
            "downstream": self.link.address if self.link else None,
            "wire": self.link.describe_choice().name if self.link else None,
            "generations": self.generations,
        }


class LanePool:
    DRAINING = "the head is draining: no new generations"

    def __init__(self, host: str, port: int, hello: Hello, *, capacity: int = 4, credit_limit: int = 2,
                 connect_timeout: float = 5.0, reply_timeout: float = 30.0,
                 wrap: Callable[[trio.SocketStream, trio.Nursery | None], trio.abc.SendStream] | None = None,
                 nursery: trio.Nursery | None = None, peer_timeout: float = DEFAULT_PEER_TIMEOUT,
                 policy: WirePolicy | None = None):
        self.host, self.port, self.hello = host, port, hello
        self.policy = policy  # how each lane chooses its activations' encoding when it opens (see link_choice)
        self.peer_timeout = peer_timeout
        self.wrap = wrap
        self.nursery = nursery  # where the wrappers' tasks run
        self.capacity = capacity
        self.credit_limit = credit_limit
        self.connect_timeout = connect_timeout
        self.reply_timeout = reply_timeout
        self.lanes: dict[int, Lane] = {}
        self._ids = itertools.count(1)
        self._idle: list[Lane] = []
        self._slots = trio.Semaphore(capacity)
        self._opening = 0  # lanes being opened now (by warm or a checkout): they count against the capacity
        self.refusal: str | None = None  # why new generations are refused (None: they are not)
        self.last_error: str | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def _open(self) -> DownstreamLink:
        """A new lane's link. Logs a failure once until it changes, and the first success after one, whoever
        opens it (the background task that keeps lanes warm, or a generation's checkout)."""
        previous = self.last_error
        try:
            link = await DownstreamLink.connect(self.host, self.port, self.hello,
                                                connect_timeout=self.connect_timeout,
                                                credit_limit=self.credit_limit, reply_timeout=self.reply_timeout,
                                                wrap=self.wrap, nursery=self.nursery,
                                                peer_timeout=self.peer_timeout, policy=self.policy)
        except DownstreamError as exc:
            self.last_error = str(exc)
            if self.last_error != previous:
                log.warning("head: could not open a lane: %s", exc)
            raise
        self.last_error = None
        if previous is not None:
            log.info("head: %s is reachable again", self.address)
        return link

    async def retarget(self, host: str, port: int) -> None:
        """Stage 1 is elsewhere now (a deployment re-planned): idle lanes to the old address close; busy ones
        close at their checkin, as their generations leave them."""
        self.host, self.port, self.last_error = host, port, None
        for lane in list(self._idle):
            lane.dirty = True
        while self._idle:
            await self._discard(self._idle.pop())
        for lane in self.lanes.values():
            lane.dirty = True

    async def prune(self) -> None:
        """Close idle lanes whose peer went away. One at a time, each taken from the idle list when it is
        closed: while one closes, a checkout may take (and close) another of them."""
        while (dead := next((lane for lane in self._idle if not lane.link.looks_alive()), None)) is not None:
            self._idle.remove(dead)
            log.info("head: idle lane %d to %s is dead (closed by stage 1, or its host silent for %g s): "
                     "closing it", dead.lane_id, self.address, self.peer_timeout)
            await self._discard(dead)

    async def _open_counted(self) -> DownstreamLink:
        self._opening += 1
        try:
            return await self._open()
        finally:
            self._opening -= 1

    async def warm(self, n: int | None = None) -> None:
        """Open lanes ahead of time (best effort: a failure is logged by _open). The lanes that checkouts are
        opening meanwhile count too: after a fault killed every lane, generations resuming open lanes of their
        own while this reopens the pool's, and the pool must not end up with more lanes than its capacity
        (each one a connection on both hosts)."""
        target = min(n or self.capacity, self.capacity)
        while len(self.lanes) + self._opening < target:
            try:
                link = await self._open_counted()
            except DownstreamError:
                return
            if len(self.lanes) + self._opening >= target:  # checkouts opened lanes of their own meanwhile
                await link.aclose()
                return
            lane = Lane(next(self._ids), link)
            self.lanes[lane.lane_id] = lane
            self._idle.append(lane)

    async def checkout(self, deadline: float = math.inf) -> Lane:
        """A lane for one generation, waiting for one to be free until `deadline` (trio time: what is left of
        the generation's admission, which waited the queue timeout already). Raises PoolDraining, NoLaneAvailable,
        or DownstreamError when a new lane cannot be opened."""
        if self.draining:
            raise PoolDraining(self.refusal)
        try:
            self._slots.acquire_nowait()  # a free lane is taken whatever is left of the deadline
        except trio.WouldBlock:
            with trio.move_on_at(deadline) as scope:
                await self._slots.acquire()
            if scope.cancelled_caught:
                raise NoLaneAvailable("no lane became free within the queue timeout") from None
        try:
            if self.draining:
                raise PoolDraining(self.refusal)
            while self._idle:
                lane = self._idle.pop()
                if lane.link.looks_alive():
                    lane.state = LaneState.BUSY
                    return lane
                await self._discard(lane)
            link = await self._open_counted()
            lane = Lane(next(self._ids), link, state=LaneState.BUSY)
            self.lanes[lane.lane_id] = lane
            return lane
        except BaseException:
            self._slots.release()
            raise

    async def checkin(self, lane: Lane) -> None:
        """Return a lane after its generation; a broken or dirty one is closed instead."""
        lane.session_id = None
        lane.generations += 1
        try:
            if lane.dirty or lane.link is None or not lane.link.settled or self.draining \
                    or len(self.lanes) > self.capacity:  # (never, but an extra idle lane would stay forever)
                await self._discard(lane)
            else:
                lane.state = LaneState.IDLE
                self._idle.append(lane)
        finally:
            self._slots.release()

    async def _discard(self, lane: Lane) -> None:
        lane.state = LaneState.CLOSED
        self.lanes.pop(lane.lane_id, None)
        if lane.link is not None:
            await lane.link.aclose()

    async def drain(self, reason: str = DRAINING) -> None:
        """Refuse new generations (with `reason`) and close the idle lanes; busy ones close when released."""
        self.refusal = reason
        while self._idle:
            await self._discard(self._idle.pop())

    def undrain(self) -> None:
        self.refusal = None

    @property
    def draining(self) -> bool:
        return self.refusal is not None

    @property
    def busy(self) -> int:
        return sum(1 for lane in self.lanes.values() if lane.state == LaneState.BUSY)

    async def aclose(self) -> None:
        self.refusal = self.refusal or self.DRAINING
        for lane in list(self.lanes.values()):
            await self._discard(lane)

    def describe(self) -> list[dict]:
        return [lane.describe() for lane in self.lanes.values()]

    def describe_link(self) -> dict | None:
        """What the lanes to stage 1 carry (see link_choice.describe_links); None: no lane is open."""
        return describe_links((lane.link.describe_choice() for lane in list(self.lanes.values())
                               if lane.link is not None), to=1)

    async def request_once(self, msg) -> tuple[object, int]:
        """Send ``msg`` to stage 1 on a connection opened for it (the lanes' address, Hello and timeouts; a lane
        is a generation's, and a query must not wait for one) and closed after it: (the reply, its wait in µs).
        Raises DownstreamError."""
        failure = None
        # the link's own tasks (reply deadline, conditioning) run here; what fails is raised outside the
        # nursery, not wrapped in an exception group
        async with trio.open_nursery() as nursery:
            try:
                # (a query carries no activations: not timed, nor are the later links it opens)
                link = await DownstreamLink.connect(self.host, self.port, untimed(self.hello),
                                                    connect_timeout=self.connect_timeout,
                                                    credit_limit=self.credit_limit, reply_timeout=self.reply_timeout,
                                                    wrap=self.wrap, nursery=nursery, policy=self.policy)
                try:
                    reply, _sent, _write_us, wait_us = await link.request(msg)
                finally:
                    with trio.CancelScope(shield=True):
                        await link.aclose()
            except DownstreamError as exc:
                failure = exc
            finally:
                nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return reply, wait_us
