"""Whether the head's pipeline serves now, as a supervising deployment (skippyd/deploy/supervisor.py) says.

Without a supervisor the pipeline always "serves" and nothing here waits.
While a supervisor recovers (a host lost, its grace running, a new plan being
started) or switches plans, new generations wait for it instead of failing,
and generations being resumed keep waiting; once it finds the model no longer
fits the hosts left, both fail with its message (503) until a host returns.
"""

from __future__ import annotations

import trio

from skippyd.head.errors import GenerationError

SERVING, RECOVERING, SHORT = "serving", "recovering", "short"


class Unavailable(GenerationError):
    """The deployment cannot run the model on the hosts it has (the message names the shortfall)."""

    def __init__(self, message: str):
        super().__init__(message, retryable=True, status=503)


class Availability:
    def __init__(self) -> None:
        self.state = SERVING
        self.why: str | None = None  # SHORT: the shortfall; RECOVERING: what is being done
        self.supervised = False  # a supervisor decides (else a stage that is down fails requests at once)
        self.max_wait = 0.0  # how long a new generation waits through a recovery at most
        self.resumed = 0  # generations replayed after a stage failure (for the metrics)
        self._changed = trio.Event()

    def set(self, state: str, why: str | None = None) -> None:
        if (state, why) == (self.state, self.why):
            return
        self.state, self.why = state, why
        self._changed.set()
        self._changed = trio.Event()

    def refusal(self) -> str | None:
        """The shortfall while the model does not fit (None otherwise)."""
        return self.why if self.state == SHORT else None

    async def wait_changed(self) -> None:
        await self._changed.wait()

    async def wait_serving(self, watch=None) -> None:
        """Until the pipeline serves: at once when unsupervised; raises Unavailable when the model does not
        fit, or when a recovery outlasts `max_wait`. With `watch` (stage 1's), also until stage 1 answers."""
        if not self.supervised:
            return
        with trio.move_on_after(self.max_wait) as scope:
            while True:
                if self.state == SHORT:
                    raise Unavailable(self.why)
                if self.state == SERVING and (watch is None or not watch.down or await watch.check()):
                    return
                with trio.move_on_after(0.25):  # a state change, or stage 1 back, whichever first
                    await self.wait_changed()
        if scope.cancelled_caught:
            raise Unavailable(f"the deployment is still recovering after {self.max_wait:g} s"
                              f"{': ' + self.why if self.why else ''}")
