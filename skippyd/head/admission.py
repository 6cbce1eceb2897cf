"""The one wait a generation meets before it runs, whichever way it came in (control channel, OpenAI API).

The head has as many places as its context has sequences. A generation
waits for one up to the queue timeout (``--queue-timeout``) and is then
refused with :class:`QueueTimeout` (a retryable 503). The deadline it got
covers the rest of its admission too: the lane it then takes waits at most
until the same deadline, never a timeout of its own.
"""

from __future__ import annotations

import trio

from skippyd.head.errors import QueueTimeout


class AdmissionGate:
    def __init__(self, places: int, timeout: float):
        self.places = places
        self.timeout = timeout
        self._free = trio.Semaphore(places)

    async def enter(self) -> float:
        """Wait for a place; returns the admission's deadline (trio time). Raises QueueTimeout. Call
        :meth:`leave` once the generation has ended, whatever ended it."""
        deadline = trio.current_time() + self.timeout
        try:
            self._free.acquire_nowait()  # a free place is taken whatever the timeout, even 0
        except trio.WouldBlock:
            with trio.move_on_at(deadline):
                await self._free.acquire()
                return deadline
            raise QueueTimeout(f"no free session slot within {self.timeout:g} s (all {self.places} busy)") from None
        return deadline

    def leave(self) -> None:
        self._free.release()
