"""What a host offers a deployment: cores, memory, disk for slices, the native build's features, its GPU
backend and devices."""

from __future__ import annotations

import os
from pathlib import Path

from skippyd.runtime.llama import system_info
from skippyd.runtime.llama.devices import devices, gpu_backend
from skippyd.stage.threads import usable_cores


def _kib_line(path: str, key: str) -> int:
    """Bytes of a "Key:  N kB" line of a /proc file; 0 if it is not there."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def memory_available(meminfo: str = "/proc/meminfo") -> int:
    """Bytes the kernel says a new program could use (MemAvailable), 0 if unknown."""
    return _kib_line(meminfo, "MemAvailable:")


def cgroup_memory_room(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's cgroup (v2) still lets it use: memory.max less memory.current, the smallest along
    the way to the root; None without a limit."""
    try:
        with open(proc_cgroup) as f:
            path = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), None)
    except OSError:
        return None
    if path is None:
        return None
    room = None
    here = Path(cgroup_root + path)
    root = Path(cgroup_root)
    while True:
        try:
            limit = (here / "memory.max").read_text().strip()
            if limit != "max":
                left = int(limit) - int((here / "memory.current").read_text().strip())
                room = left if room is None else min(room, left)
        except (OSError, ValueError):
            pass
        if here == root or root not in here.parents:
            break
        here = here.parent
    return None if room is None else max(0, room)


def anon_rss(status: str = "/proc/self/status") -> int:
    """This process's anonymous resident bytes (RssAnon): the KV cache and buffers a stage allocated; its
    weights are file pages, which the kernel counts as available already."""
    return _kib_line(status, "RssAnon:")


def memory_for_skippy(limit_mb: int, held: int = 0) -> int:
    """What skippy may use here: the host's available memory, within its cgroup's limit and within
    runtime.memory_limit_mb if set. `held`: what the stage running here holds, counted as available (a new
    deployment replaces it)."""
    room = [memory_available() + held]
    cgroup = cgroup_memory_room()
    if cgroup is not None:
        room.append(cgroup + held)
    if limit_mb:
        room.append(limit_mb << 20)
    return min(r for r in room if r >= 0)


def host_report(limit_mb: int, slices, held: int = 0, gpu_layers: int | str = 0) -> dict:
    """The `host` request's answer (a SliceStore `slices` adds what it holds and the disk it has; `held`: the
    memory of the stage running here; `gpu_layers`: runtime.gpu_layers here). `devices` lists what the build
    finds, the CPU included (name, description, kind, backend, memory_total, memory_free in bytes)."""
    return {
        "cores": usable_cores(),
        "cpu_count": os.cpu_count() or 1,
        "memory_bytes": memory_for_skippy(limit_mb, held),
        "memory_held_bytes": held,
        "memory_available_bytes": memory_available(),
        "memory_limit_mb": limit_mb,
        "disk_free_bytes": slices.disk_free(),
        "slices_dir": str(slices.dir),
        "slices": slices.held(),
        "features": system_info(),
        "gpu_backend": gpu_backend(),
        "devices": [d.to_dict() for d in devices()],
        "gpu_layers": gpu_layers,
    }
