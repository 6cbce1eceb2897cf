"""Is stage 1 alive? Pings while a generation waits on it, and the up/down state ``status`` shows.

The reply deadline (``runtime.reply_timeout``, 30 s by default) must leave room
for a slow compute, so it cannot tell a busy stage from a hung one within
seconds. A stage computes in a worker thread while its event loop keeps
serving the network, so an alive stage answers a Ping at once, however long
its compute; a hung (stopped, wedged) one does not answer, a dead one
refuses the connection.

:class:`StageWatch` holds its own connection to stage 1 (a lane that never
carries a session, outside the pool's capacity) and pings on it only while
some request has been waiting on the pipeline for longer than ``interval``:
a generation's requests register with :meth:`StageWatch.watching`, and one
task, woken by the first registration and sleeping until the oldest
request is due, pings for all of them. Decode steps that answer within the
interval cost no ping at all, and nothing polls. No answer within
``ping_timeout`` marks the stage down and fails every registered request
(:class:`StageDown`, naming the stage); while it is down the same task
pings with backoff until it answers again, and a new generation checks it
at once (:meth:`check`) instead of waiting for the next try; whichever check
finds it up again, the task watches the requests from then on (not once its
backoff is over), so a fault soon after a recovery is found as fast as any.

``ping_timeout`` is not a constant: it is PING_TIMEOUT_S while stage 1
answers at once, and grows with a high percentile of its recent round trips,
up to PING_TIMEOUT_MAX_S; and it is counted in time the head's own loop was
free to run (:class:`~skippyd.stage.loop_lag.PingDeadline`): a stage that is
alive but slow to answer (a loaded host) or a head that was itself held up
while waiting is not taken for a dead stage, while a stage that stops
answering after answering at once is found as fast as ever.

The watch connection is a lane like any other, so it leads through the
whole pipeline, and a middle stage relays a Ping with a shorter deadline
than its upstream's (``MiddleStage.on_ping`` in skippyd/stage/roles.py): a hung
stage further down is named by the stage before it, in a DOWNSTREAM_FAILED
reply ("stage 2 failed: ..."), and ``down_stage`` says which stage it was
(a relaying stage's deadline is its own estimate of the same kind, scaled
below its upstream's).

The same holds across a network: a link cut (or losing packets one way)
leaves the ping unanswered, so the generation fails within
``interval + ping_timeout`` whatever the link does afterwards, while stage
1, whose connection's host no longer answers, releases the generation's
session on its side (skippyd/stage/connection.py). When the link heals the
next check (with backoff, or at once for a new generation) finds the stage
up again.
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
import time
from collections.abc import Callable

import trio

from skippyd.stage.downstream import DownstreamError, DownstreamLink
from skippyd.stage.loop_lag import PING_CEILING_S, PING_FLOOR_S, PingDeadline
from skippyd.wire.errors import HandshakeRefused
from skippyd.wire.messages import Ack, ErrorReply, Hello, Ping
from skippyd.wire.stream import DEFAULT_PEER_TIMEOUT

log = logging.getLogger("skippyd.head")

INTERVAL_S = 0.3  # a request waiting longer than this gets stage 1 pinged (one small frame: cheap)
# no answer within the ping's deadline: stage 1 is down. The deadline is PING_TIMEOUT_S while stage 1 answers at
# once (detection within INTERVAL_S + PING_TIMEOUT_S), longer while it has been answering late, never longer
# than PING_TIMEOUT_MAX_S; time the head's own loop was held does not count (see PingDeadline.within)
PING_TIMEOUT_S = PING_FLOOR_S
PING_TIMEOUT_MAX_S = PING_CEILING_S
BACKOFF_MIN_S = 0.25  # while down: first re-check after this, doubling ...
BACKOFF_MAX_S = 2.0  # ... up to this


_NAMED = re.compile(r"^stage (\d+) failed: ")  # how a stage's DOWNSTREAM_FAILED reply names the next stage
_AWAY = re.compile(r"^downstream unavailable: stage (\d+) at ")  # a middle stage's refusal when it is


class StageDown(Exception):
    """Stage 1 did not answer a liveness ping (or refused the connection) while a request waited on it."""


class _Waiter:
    """One wait on the pipeline, as the context manager :meth:`StageWatch.watching` returns (a class, not a
    generator: it is entered around every decode step's wait).

    A failed check wakes the wait with ``interrupt`` when the waiter has one (a lane link's
    ``interrupt``: the wait is a read on the lane, and no cancel scope is entered per wait, which costs
    a decode step some 700 interpreted instructions); otherwise by cancelling the waiter's own scope."""

    __slots__ = ("watch", "since", "scope", "interrupt", "failure")

    def __init__(self, watch: StageWatch, interrupt: Callable[[str], None] | None = None):
        self.watch = watch
        self.since = 0.0  # trio time the request started (or the last ping that covered it)
        self.interrupt = interrupt
        self.scope = trio.CancelScope() if interrupt is None else None
        self.failure: str | None = None

    def __enter__(self) -> None:
        watch = self.watch
        self.since = trio.current_time()
        if watch._idle:  # a newer request never makes a ping due sooner: only an idle task needs waking
            watch._idle = False
            watch._wake.set()
        watch._waiters.add(self)
        if self.scope is not None:
            self.scope.__enter__()

    def __exit__(self, etype, exc, tb) -> bool:
        if self.scope is None:
            self.watch._waiters.discard(self)
            if self.failure is not None:  # whatever the interrupted wait raised, this is why
                raise StageDown(self.failure) from exc
            return False
        try:
            swallowed = self.scope.__exit__(etype, exc, tb)
        finally:
            self.watch._waiters.discard(self)
        if (etype is None or swallowed) and self.failure is not None:
            raise StageDown(self.failure)
        return swallowed

    def fail(self, why: str) -> None:
        self.failure = why
        if self.scope is not None:
            self.scope.cancel()
        else:
            self.interrupt(why)


class StageWatch:
    def __init__(self, host: str, port: int, hello: Hello, *, stage_index: int = 1, interval: float = INTERVAL_S,
                 ping_timeout: float = PING_TIMEOUT_S, ping_timeout_max: float = PING_TIMEOUT_MAX_S,
                 peer_timeout: float = DEFAULT_PEER_TIMEOUT):
        self.host, self.port, self.hello = host, port, hello
        self.peer_timeout = peer_timeout
        self.stage_index = stage_index
        self.interval = interval
        self.deadline = PingDeadline(ping_timeout, max(ping_timeout, ping_timeout_max))
        self.up: bool | None = None  # None: not checked yet
        self.down_stage = stage_index  # while down: the stage that did not answer (a later one may be named)
        self.changed_at = time.time()
        self.last_error: str | None = None
        self.pings = 0
        self.failures = 0
        self.last_rtt_ms: float | None = None
        self._link: DownstreamLink | None = None
        self._waiters: set[_Waiter] = set()
        self._wake = trio.Event()
        self._idle = False  # the task waits for a first request (no deadline to keep)
        self._checked = trio.Event()  # set (and replaced) after every check
        self._answered = trio.Event()  # set (and replaced) when a check finds stage 1 up after it was down
        self._lock = trio.Lock()  # one ping at a time on the watch connection
        self._suspected = False
        self._ids = itertools.count(1)

    @property
    def ping_timeout(self) -> float:
        """How long the next ping waits for its answer (seconds)."""
        return self.deadline.timeout()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def name(self) -> str:
        return f"stage {self.stage_index} at {self.address}"

    @property
    def down(self) -> bool:
        return self.up is False

    @property
    def down_name(self) -> str:
        """The stage that is down, as error messages name it."""
        return self.name if self.down_stage == self.stage_index else f"stage {self.down_stage}"

    # ---------------------------------------------------------------- requests
    def watching(self, interrupt: Callable[[str], None] | None = None) -> _Waiter:
        """Around a wait on the pipeline: raises StageDown if stage 1 stops answering meanwhile. With
        ``interrupt``, that wakes the wait (which must then fail at once, and every later wait too: a lane
        link's ``interrupt``); without, a cancel scope around the wait is cancelled."""
        return _Waiter(self, interrupt)

    def suspect(self) -> None:
        """A request failed in a way that may mean stage 1 is gone: check now rather than at the next due."""
        self._suspected = True
        self._wake.set()

    async def check(self) -> bool:
        """Up or down now (waits for the check in progress, or runs one); True if stage 1 answers."""
        if self._lock.locked():
            await self._checked.wait()
        else:
            await self._check()
        return self.up is True

    async def retarget(self, host: str, port: int) -> None:
        """Stage 1 is elsewhere now (a deployment re-planned): the next check pings the new address."""
        async with self._lock:
            self.host, self.port = host, port
            await self._drop()

    async def wait_answering(self) -> None:
        """While stage 1 is down: until a check (this watch's own, or anyone's) finds it up again."""
        if self.down:
            await self._answered.wait()

    # ---------------------------------------------------------------- the task
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Ping when due, until cancelled."""
        task_status.started()
        backoff = BACKOFF_MIN_S
        try:
            await self._check()  # so that status knows before the first long wait
            while True:
                if self.down:
                    # down: re-check with backoff (a new generation may check sooner, see check())
                    with trio.move_on_after(backoff):
                        await self._wait_woken()
                    if not self.down:
                        # another check found it up meanwhile (and woke this task): watch the requests again
                        # now, not once the backoff is over, or a fault in between would go unnoticed till then
                        continue
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
                    await self._check()
                    continue
                backoff = BACKOFF_MIN_S
                if not self._waiters:
                    self._idle = True  # between two decode steps too: then woken at the next due, not per step
                    await self._wait_woken()
                    continue
                due = min(w.since for w in self._waiters) + self.interval
                if trio.current_time() < due and not self._suspected:
                    with trio.move_on_at(due):
                        await self._wait_woken()  # a suspect() brings the check forward
                    continue  # the oldest request may have ended meanwhile: recompute
                self._suspected = False
                await self._check()
        finally:
            if self._link is not None:
                with trio.CancelScope(shield=True):
                    await self._link.aclose()

    async def _wait_woken(self) -> None:
        self._wake = trio.Event()
        await self._wake.wait()

    async def _check(self) -> None:
        async with self._lock:
            started = trio.current_time()
            try:
                error = await self._ping()
            finally:
                self._checked.set()
                self._checked = trio.Event()
        if error is None:
            for w in self._waiters:  # the answer covers them all until one interval from now
                w.since = max(w.since, started)
            self._set(True, None)
            return
        named = _NAMED.match(error)  # a stage further down did not answer: the stage before it says so
        if named:
            self.down_stage = int(named.group(1))
        elif self.down and self.down_stage != self.stage_index:
            # a re-check that times out while a later stage is down (stage 1 waits on that one in the watch
            # connection's handshake) keeps the stage first named, and why
            error = self.last_error
        else:
            self.down_stage = self.stage_index
        self._set(False, error)
        why = error if named else f"{self.name} is not responding: {error}"
        for w in list(self._waiters):
            w.fail(why)

    async def _ping(self) -> str | None:
        """One liveness check; None if stage 1 answered, else why not. A connection that turns out to be
        stale (the stage restarted, or closed an idle connection) is replaced once."""
        for attempt in (1, 2):
            fresh = self._link is None
            timeout = self.ping_timeout
            try:
                if self._link is not None and not self._link.looks_alive():
                    await self._drop()
                    fresh = True
                if self._link is None:
                    self._link = await self.deadline.within(functools.partial(
                        DownstreamLink.connect, self.host, self.port, self.hello, connect_timeout=self.deadline.ceiling,
                        credit_limit=0, reply_timeout=self.deadline.ceiling + 1,
                        write_timeout=self.deadline.ceiling + 1, peer_timeout=self.peer_timeout), timeout)
                sent = time.perf_counter()
                reply, *_ = await self.deadline.within(
                    functools.partial(self._link.request, Ping(next(self._ids))), timeout)
                rtt = time.perf_counter() - sent
                self.pings += 1
                self.last_rtt_ms = round(rtt * 1e3, 3)
                if not isinstance(reply, Ack):
                    await self._drop()
                    if isinstance(reply, ErrorReply):
                        return reply.message  # "stage K failed: ...": the stage before it names it
                    return f"it answered a ping with {type(reply).__name__}"
                self.deadline.observe(rtt)
                return None
            except trio.TooSlowError:
                await self._drop()
                return f"no answer to a liveness ping within {timeout:.3g} s"
            except DownstreamError as exc:
                await self._drop()
                if isinstance(exc.__cause__, HandshakeRefused):
                    # it refused the watch connection: alive; but if because its next stage is away, that one is down
                    away = _AWAY.match(exc.__cause__.reason)
                    return f"stage {away.group(1)} failed: {exc.__cause__.reason}" if away else None
                if fresh or attempt == 2:
                    return exc.detail
        return "unreachable"

    async def _drop(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            await link.aclose()

    def _set(self, up: bool, error: str | None) -> None:
        if up != self.up:
            if up and self.up is False:
                log.info("head: %s answers again", self.name)
                self._wake.set()  # the task, waiting out its backoff while down
                self._answered.set()  # generations waiting to resume
                self._answered = trio.Event()
            elif not up:
                log.warning("head: %s is down: %s", self.name, error)
            self.changed_at = time.time()
        if not up:
            self.failures += 1
        self.up, self.last_error = up, error

    def describe(self) -> dict:
        return {"stage": self.down_stage if self.down else self.stage_index, "address": self.address,
                "state": {None: "unknown", True: "up", False: "down"}[self.up],
                "since": round(self.changed_at, 3), "error": self.last_error, "pings": self.pings,
                "failed_checks": self.failures, "last_rtt_ms": self.last_rtt_ms,
                "ping_timeout_s": round(self.ping_timeout, 3)}
