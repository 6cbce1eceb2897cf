"""A slower host for the tests: a daemon started in a cgroup with a CPU quota, else confined to one core.

A quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``) makes every step slower,
as a slower machine would; where cgroups cannot be written (not root, a
read-only hierarchy), the daemon is confined to one core with ``taskset``
instead: it then computes with one thread where the others have two.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

V2_ROOT = Path("/sys/fs/cgroup")
V1_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


class SlowHost:
    """``prefix``: put before a command to run it slowed down; :meth:`close` removes the cgroup."""

    def __init__(self, fraction: float):
        self.fraction = fraction
        self.group: Path | None = None
        self.how = ""
        self.prefix = self._cgroup() or self._taskset()

    def _cgroup(self) -> list[str] | None:
        name = f"skippy-slow-{uuid.uuid4().hex[:6]}"
        quota = int(PERIOD_US * self.fraction)
        try:
            if (V2_ROOT / "cgroup.controllers").exists():
                if "cpu" not in (V2_ROOT / "cgroup.subtree_control").read_text().split():
                    (V2_ROOT / "cgroup.subtree_control").write_text("+cpu")
                group = V2_ROOT / name
                group.mkdir()
                self.group = group
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
                procs = group / "cgroup.procs"
            elif (V1_CPU / "cpu.cfs_quota_us").exists():
                group = V1_CPU / name
                group.mkdir()
                self.group = group
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
                procs = group / "tasks"
            else:
                return None
        except OSError:
            self.close()
            return None
        self.how = f"a CPU quota of {self.fraction:g} core ({self.group})"
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh"]

    def _taskset(self) -> list[str]:
        if shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2:
            self.how = "nothing (no cgroup to write, no taskset or one core only)"
            return []
        core = min(os.sched_getaffinity(0))
        self.how = f"one core (taskset -c {core})"
        return ["taskset", "-c", str(core)]

    def close(self) -> None:
        if self.group is not None:
            try:
                self.group.rmdir()
            except OSError:
                pass
            self.group = None
