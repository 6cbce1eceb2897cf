"""Link conditioning: a fixed one-way delay and a bandwidth cap on what a daemon sends.

For tests and benchmarks: WAN behaviour measured on one machine
(``stage.link_delay_ms``, ``stage.link_mbps``). A conditioned connection
sends through a :class:`ShapedSendStream`: ``send_all`` returns at once (the
bytes are "on the wire"), and the connection's transmit task hands each
chunk to the socket when it would arrive at the peer:

    leaves  = max(now, when the previous chunk finished leaving) + len(chunk) × 8 / (mbps × 10⁶)
    arrives = leaves + delay

Chunks keep their order and the sender never waits for the delay, like a
real link (the sender's next frame can go out while the previous one is
still travelling). A daemon conditions every frame it sends to another stage
after the handshake: messages down its lanes, replies up its upstream
connections, and predictions on the token-return connection; so a link
between two conditioned daemons is delayed in both directions.

The wrapper is put around a connection where it is made (:meth:`LinkShape.wrap`,
given as ``wrap`` to whatever dials or accepts); the code that then sends and
closes through it treats it as the stream itself.

The transmit task runs on the event loop: a chunk that falls due while the
loop computes a decode step inline leaves when that compute ends, at most one
compute late (a few milliseconds on small models).
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import time
from collections import deque

import attrs
import trio

from skippyd.wire.errors import PeerClosed
from skippyd.wire.stream import send_buffer

__all__ = ["LinkShape", "ShapedSendStream"]

LINGER_S = 1.0  # closing a link lets what it queued arrive for this long (plus the delay), then drops it


def _non_negative(_inst, attribute: attrs.Attribute, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{attribute.name} must be a finite number >= 0, got {value!r}")


@attrs.frozen
class LinkShape:
    """What to add to each frame sent: ``delay_ms`` one way, and serialization at ``mbps`` (0: no cap)."""

    delay_ms: float = attrs.field(default=0.0, converter=float, validator=_non_negative)
    mbps: float = attrs.field(default=0.0, converter=float, validator=_non_negative)

    @property
    def active(self) -> bool:
        return self.delay_ms > 0 or self.mbps > 0

    def wrap(self, stream: trio.abc.SendStream, nursery: trio.Nursery | None) -> trio.abc.SendStream:
        """What a connection just made sends through: ``stream`` itself, or (an active shape) a
        ShapedSendStream over it whose transmit task runs in ``nursery``. Closing what this returns (its
        ``aclose``) closes ``stream`` too."""
        if not self.active:
            return stream
        if nursery is None:
            raise ValueError("a conditioned link needs a nursery for its transmit task")
        out = ShapedSendStream(stream, self)
        nursery.start_soon(out.run)
        return out

    def describe(self) -> str:
        parts = []
        if self.delay_ms > 0:
            parts.append(f"{self.delay_ms:g} ms one-way delay")
        if self.mbps > 0:
            parts.append(f"{self.mbps:g} Mbit/s")
        return ", ".join(parts) or "none"


NO_SHAPE = LinkShape()


class ShapedSendStream(trio.abc.SendStream):
    """The send side of a conditioned link over ``stream``.

    :meth:`run` is the transmit task (start it in the nursery that owns the
    connection); :meth:`close` stops it and drops what has not left yet;
    :meth:`aclose` first lets the queued bytes leave (for up to ``LINGER_S``
    plus the delay; cancelled: at once), then closes ``stream``, so its owner
    closes it as it would close ``stream`` itself.
    A transport error in the transmit task is reported by the next
    ``send_all`` (``trio.BrokenResourceError``); the receiving side of the
    connection sees the close itself.
    """

    def __init__(self, stream: trio.abc.SendStream, shape: LinkShape):
        self.stream = stream
        self.shape = shape
        self._send, self._receive = trio.open_memory_channel(math.inf)
        self._scope = trio.CancelScope()
        self._free_at = -math.inf  # when the link finishes serializing what was queued
        self._releases: deque[float] = deque()  # the release times of chunks not yet handed to the socket
        self._empty = trio.Event()
        self._empty.set()
        self._done = trio.Event()
        self._error: BaseException | None = None
        self._closed = False
        self.bytes_sent = 0

    # ---------------------------------------------------------------- sender side
    def _release_time(self, n: int, sent_at: float | None) -> float:
        now = trio.current_time() if sent_at is None else sent_at
        start = max(now, self._free_at)
        end = start + (n * 8 / (self.shape.mbps * 1e6) if self.shape.mbps > 0 else 0.0)
        self._free_at = end
        return end + self.shape.delay_ms / 1e3

    async def send_all(self, data) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self.send_now(data)

    # write_prepared hands a frame that native code finished at the end of a compute over with that time
    takes_sent_at = True

    def send_now(self, data, *, sent_at: float | None = None) -> int:
        """``send_all`` without its checkpoint: the link takes every byte at once (the bytes written, all of
        them). write_frame sends through it without a cancel scope for its timeout, which no send here
        can need; entering one would cost every conditioned frame what a real link does not. ``sent_at``
        (trio time, not later than now): when the frame left, if earlier than now; a frame that native code
        would have written to a socket at the end of a compute travels from then, as it would on a real link."""
        if self._closed:
            raise trio.ClosedResourceError("the link is closed")
        if self._error is not None:
            raise trio.BrokenResourceError(f"the link is broken: {self._error}")
        chunk = bytes(data)
        release_at = self._release_time(len(chunk), sent_at)
        self._send.send_nowait((release_at, chunk))
        self._releases.append(release_at)
        self._empty = trio.Event() if self._empty.is_set() else self._empty
        # no schedule point after queueing (as write_frame's direct send): every sender's loop waits on the
        # network next, and a pass of the scheduler here would delay each conditioned hop for nothing
        return len(chunk)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    @property
    def broken(self) -> bool:
        return self._error is not None or self._done.is_set()

    async def flush(self) -> None:
        """Wait until every chunk sent so far has been handed to the socket (or the link broke)."""
        if self._releases and not self._done.is_set():
            await self._empty.wait()
        else:
            await trio.lowlevel.checkpoint()

    def close(self) -> None:
        """Stop the transmit task; chunks still travelling are dropped. Does not close ``stream``."""
        self._closed = True
        self._send.close()
        self._scope.cancel()
        self._forget_releases()

    async def aclose(self) -> None:
        """Let the queued chunks leave (up to LINGER_S plus the delay), then close ``stream``; cancelled (as by
        ``trio.aclose_forcefully``): drop them and close ``stream`` at once."""
        self._closed = True
        self._send.close()
        try:
            with trio.move_on_after(LINGER_S + self.shape.delay_ms / 1e3):
                await self._done.wait()
        finally:
            self._scope.cancel()
            self._forget_releases()
            await trio.aclose_forcefully(self.stream)

    def _forget_releases(self) -> None:
        self._releases.clear()

    # ---------------------------------------------------------------- the transmit task
    async def run(self) -> None:
        """Hand each chunk to the socket at its arrival time, in order. Never raises (but Cancelled)."""
        timer = _precise_timer()
        try:
            with self._scope:
                async with self._receive:
                    async for release_at, chunk in self._receive:
                        await _wait_until(release_at, timer)
                        try:
                            await send_buffer(self.stream, chunk)
                        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError,
                                OSError, PeerClosed) as exc:
                            self._error = exc
                            return
                        self.bytes_sent += len(chunk)
                        if self._releases:  # (close() drops them: it can come between the last wait and the write)
                            self._releases.popleft()
                        if not self._releases:
                            self._empty.set()
        finally:
            if timer is not None:
                timer.close()
            self._forget_releases()
            self._done.set()
            self._empty.set()


# trio's timers are as coarse as epoll's timeout, whole milliseconds rounded up: a sleep ends up to 1 ms
# late, which would add ~0.5 ms to every conditioned hop (a real network delivers to the microsecond). So the
# transmit task sleeps until shortly before a chunk's time and yields to the loop from there on (a spin that
# lets the other tasks run). On Linux that sleep is on a timerfd (nanosecond expiry, woken through trio's
# epoll like a socket), and TIMER_EARLY before the time only covers the wake-up's own latency (~0.1-0.3 ms
# on a VM); elsewhere it is a trio sleep, to TIMER_GRAIN before, and the spin lasts up to that long.
TIMER_GRAIN = 0.0011
TIMER_EARLY = 0.0004
# ... and the last TIMER_HOLD before the time it holds the loop: a pass of trio's loop costs tens of microseconds
# (a chunk released at the first pass past its time left half a pass late on average, ~0.03 ms a hop)
TIMER_HOLD = 0.00006


class _TimerFd:
    """A one-shot CLOCK_MONOTONIC timerfd (Linux; Python < 3.13 has no os.timerfd_*, hence ctypes)."""

    _CLOCK_MONOTONIC, _TFD_NONBLOCK, _TFD_CLOEXEC = 1, os.O_NONBLOCK, os.O_CLOEXEC

    class _Itimerspec(ctypes.Structure):  # two struct timespec {tv_sec, tv_nsec}, as longs on Linux
        _fields_ = [("it_interval", ctypes.c_long * 2), ("it_value", ctypes.c_long * 2)]

    def __init__(self, libc: ctypes.CDLL):
        self._libc = libc
        self.fd = libc.timerfd_create(self._CLOCK_MONOTONIC, self._TFD_NONBLOCK | self._TFD_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")

    @classmethod
    def open(cls) -> _TimerFd | None:
        """A timer, or None where there is no timerfd (not Linux, or a libc without it)."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.timerfd_create, libc.timerfd_settime  # noqa: B018 - both or neither
            return cls(libc)
        except (OSError, AttributeError):
            return None

    async def sleep(self, seconds: float) -> None:
        ns = max(1, int(seconds * 1e9))  # 0 would disarm the timer
        spec = self._Itimerspec()
        spec.it_value[0], spec.it_value[1] = divmod(ns, 1_000_000_000)
        # arming resets the expiry count, so an expiry left over from a cancelled wait cannot end this one
        if self._libc.timerfd_settime(self.fd, 0, ctypes.byref(spec), None) < 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        await trio.lowlevel.wait_readable(self.fd)
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            trio.lowlevel.notify_closing(self.fd)
            os.close(self.fd)
            self.fd = -1


async def _wait_until(when: float, timer: _TimerFd | None) -> None:
    early = TIMER_GRAIN if timer is None else TIMER_EARLY
    if (left := when - trio.current_time()) > early:
        await (trio.sleep(left - early) if timer is None else timer.sleep(left - early))
    spin_until = time.perf_counter() + 2 * early
    while trio.current_time() < when - TIMER_HOLD and time.perf_counter() < spin_until:
        await trio.lowlevel.checkpoint()  # other tasks run meanwhile
    while trio.current_time() < when and time.perf_counter() < spin_until:
        pass
    if trio.current_time() < when:  # the clock does not follow real time (tests' MockClock), or a late wake
        await trio.sleep_until(when)


def _precise_timer() -> _TimerFd | None:
    """A timerfd when trio's clock is the real one (a test's MockClock keeps trio's own timers)."""
    # a MockClock can exist only where trio.testing was imported: no need to import it here
    testing = sys.modules.get("trio.testing")
    if testing is not None and isinstance(trio.lowlevel.current_clock(), testing.MockClock):
        return None
    return _TimerFd.open()
