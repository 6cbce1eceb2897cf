"""The host compute lock: stages that share a host take turns at its cores (see execution.py's docstring)."""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time

log = logging.getLogger(__name__)

LOCK_CHECK_S = 0.1  # a wait this long looks at the holder (then again this often): stopped, it is bypassed at once
LOCK_MAX_WAIT_S = 1.0  # a holder that cannot be looked at: taken to be stuck after this long ...
LOCK_RUNNING_MAX_S = 60.0  # ... one that is running: after this long (a compute wedged in native code?)
LOCK_BYPASS_S = 5.0  # a stuck holder: compute without the lock this long before waiting for it again


class HostComputeLock:
    """An exclusive lock (flock) that every skippy stage on this host holds while it computes.

    flock locks belong to an open file description, so stages in one process
    (``--stage all``) exclude each other as stages in different processes do.

    Taking turns is an optimisation, never a dependency: a holder that stops
    (SIGSTOP) keeps its flock, so a waiter that finds the holder stopped
    (``/proc/locks`` names it, ``/proc/PID/stat`` says it is stopped) computes
    without the lock and leaves it alone for ``bypass_s`` before trying again.
    Slower while that lasts, never stuck. A running holder is waited for: one
    compute of a big model (a prefill chunk) takes seconds, and computing
    beside it would slow both (a fixed one-second limit did so with a 1.3 GB
    model). Only after ``running_max_s`` is it taken to be wedged; a holder
    that cannot be looked at (no /proc, another pid namespace), after
    ``max_wait_s``.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, max_wait_s: float = LOCK_MAX_WAIT_S,
                 running_max_s: float = LOCK_RUNNING_MAX_S, bypass_s: float = LOCK_BYPASS_S):
        self.path = str(path or default_lock_path())
        self.max_wait_s, self.running_max_s, self.bypass_s = max_wait_s, running_max_s, bypass_s
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._bypass_until = 0.0
        self.timeouts = 0  # waits that gave up (a stopped or stuck holder)

    def acquire(self) -> bool:
        """Wait (blocking this thread) for the lock, as long as its holder computes; False: compute without it."""
        started = time.monotonic()
        if started < self._bypass_until:
            return False
        check_at, pause = started + LOCK_CHECK_S, 50e-6
        while not self.try_acquire():
            now = time.monotonic()
            if now >= check_at:
                check_at = now + LOCK_CHECK_S
                why = self._why_not_wait(now - started)
                if why:
                    self.timeouts += 1
                    self._bypass_until = now + self.bypass_s
                    log.warning("the host compute lock %s %s; computing without it for %g s", self.path, why,
                                self.bypass_s)
                    return False
            time.sleep(pause)  # flock has no timeout: poll, from 50 us up to 1 ms apart
            pause = min(pause * 2, 1e-3)
        return True

    def _why_not_wait(self, waited: float) -> str | None:
        """Why to stop waiting for the lock after `waited` seconds (None: wait on)."""
        pid = lock_holder(self._fd)
        if pid == 0:
            return None  # let go since the failed try: try again
        stopped = process_stopped(pid) if pid is not None else None
        if stopped is None and pid is not None and lock_holder(self._fd) != pid:
            return None  # it let go (and exited) between the two looks
        if stopped:
            return f"is held by process {pid}, which is stopped (SIGSTOP?)"
        if stopped is None and waited >= self.max_wait_s:
            return f"was held for more than {self.max_wait_s:g} s by a process that cannot be looked at (stuck?)"
        if waited >= self.running_max_s:
            return f"was held for more than {self.running_max_s:g} s by process {pid}, running (a wedged compute?)"
        return None

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    @property
    def fd(self) -> int:
        """The locked file's descriptor, for native code that is handed the lock and releases it as its compute
        ends (Context.decode_row_send)."""
        return self._fd

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


def lock_holder(fd: int) -> int | None:
    """The process holding the flock on `fd`'s file, from /proc/locks: 0 if none does, None if it cannot be told."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as locks:
            for line in locks:
                # "1: FLOCK  ADVISORY  WRITE 1234 00:1b:3 0 EOF"; a blocked waiter's line has "->" after the number
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key:
                    pid = int(fields[4])
                    return pid if pid > 0 else None  # a holder in another pid namespace may show as -1 or 0
    except (OSError, ValueError):
        return None
    return 0


def process_stopped(pid: int) -> bool | None:
    """Whether process `pid` is stopped (SIGSTOP, or a debugger); None if it cannot be told."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:][:1] in ("T", "t")  # the state follows the command name, which may hold ")"
