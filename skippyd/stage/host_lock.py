"""The host compute lock: stages that share a host take turns at its cores (see scheduler.py's docstring)."""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time

log = logging.getLogger(__name__)

LOCK_MAX_WAIT_S = 1.0  # longer than any other stage's one compute should hold the host lock ...
LOCK_BYPASS_S = 5.0  # ... past that the holder is taken to be stuck: go without the lock this long


class HostComputeLock:
    """An exclusive lock (flock) that every skippy stage on this host holds while it computes.

    flock locks belong to an open file description, so stages in one process
    (``--stage all``) exclude each other as stages in different processes do.

    Taking turns is an optimisation, never a dependency: a holder that stops
    (SIGSTOP, a wedged compute) keeps its flock, so a waiter gives up after
    ``max_wait_s``, computes without the lock and leaves it alone for
    ``bypass_s`` before trying again. Slower while that lasts, never stuck.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, max_wait_s: float = LOCK_MAX_WAIT_S,
                 bypass_s: float = LOCK_BYPASS_S):
        self.path = str(path or default_lock_path())
        self.max_wait_s, self.bypass_s = max_wait_s, bypass_s
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._bypass_until = 0.0
        self.timeouts = 0  # waits that gave up (a stuck or very long holder)

    def acquire(self) -> bool:
        """Wait (blocking this thread, up to max_wait_s) for the lock; False: compute without it."""
        now = time.monotonic()
        if now < self._bypass_until:
            return False
        deadline, pause = now + self.max_wait_s, 50e-6
        while not self.try_acquire():
            now = time.monotonic()
            if now >= deadline:
                self.timeouts += 1
                self._bypass_until = now + self.bypass_s
                log.warning("the host compute lock %s was held for more than %g s (a stopped or stuck stage?); "
                            "computing without it for %g s", self.path, self.max_wait_s, self.bypass_s)
                return False
            time.sleep(pause)  # flock has no timeout: poll, from 50 us up to 1 ms apart
            pause = min(pause * 2, 1e-3)
        return True

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def try_acquire(self) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def default_lock_path() -> str:
    """One lock per user and host: in /dev/shm (memory) when there is one; $SKIPPY_COMPUTE_LOCK overrides it
    (e.g. to keep a test run's stages apart from another's)."""
    if os.environ.get("SKIPPY_COMPUTE_LOCK"):
        return os.environ["SKIPPY_COMPUTE_LOCK"]
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"skippy-compute-{os.getuid()}.lock")
