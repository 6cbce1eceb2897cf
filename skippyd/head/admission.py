"""The one wait a generation meets before it runs, whichever way it came in (control channel, OpenAI API).

The head has as many places as its context has sequences. A generation
waits for one up to the queue timeout (``--queue-timeout``) and is then
refused with :class:`QueueTimeout` (a retryable 503). The deadline it got
covers the rest of its admission too: the lane it then takes waits at most
until the same deadline, never a timeout of its own. Once the daemon drains
(:meth:`AdmissionGate.close`), no generation gets in, waiting ones included.
"""

from __future__ import annotations

import trio

from skippyd.head.errors import Draining, QueueTimeout


class AdmissionGate:
    def __init__(self, places: int, timeout: float):
        self.places = places
        self.timeout = timeout
        self._free = trio.Semaphore(places)
        self.refusal: str | None = None  # why no generation gets in (None: they do)
        self._waiting: set[trio.CancelScope] = set()

    async def enter(self) -> float:
        """Wait for a place; returns the admission's deadline (trio time). Raises QueueTimeout, or Draining
        once the gate is closed. Call :meth:`leave` once the generation has ended, whatever ended it."""
        if self.refusal is not None:
            raise Draining(self.refusal)
        deadline = trio.current_time() + self.timeout
        try:
            self._free.acquire_nowait()  # a free place is taken whatever the timeout, even 0
        except trio.WouldBlock:
            with trio.CancelScope(deadline=deadline) as waiting:
                self._waiting.add(waiting)
                try:
                    await self._free.acquire()
                    return deadline
                finally:
                    self._waiting.discard(waiting)
            if self.refusal is not None:
                raise Draining(self.refusal) from None
            raise QueueTimeout(f"no free session slot within {self.timeout:g} s (all {self.places} busy)") from None
        return deadline

    def close(self, why: str) -> None:
        """Let no generation in from now on; those waiting for a place are refused at once."""
        self.refusal = why
        for waiting in self._waiting:
            waiting.cancel()

    def leave(self) -> None:
        self._free.release()
