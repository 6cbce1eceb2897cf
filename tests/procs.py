"""Real skippyd processes on loopback for the tests: start, wait for ready, query, kill.

Each daemon gets its own control port and token file; `status` of any daemon
reports its stages' live sessions and free slots, which is how the tests see
cleanup on stages that are not the head.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import trio

from skippyctl.client import ControlError, call_once, open_control
from skippyd.control import messages as m
from skippyd.runtime.slicing import split_model
from skippyd.topology import Topology

REPO = Path(__file__).resolve().parent.parent


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def split_for_test(model: Path, n_stages: int, out_dir: Path) -> Topology:
    ports = free_ports(n_stages)
    return split_model(model, None, out_dir, stages=n_stages, hosts=[f"127.0.0.1:{p}" for p in ports])


class Daemon:
    """One skippyd process."""

    def __init__(self, args: list[str], workdir: Path, name: str, *, env: dict | None = None):
        self.name = name
        self.control_port = free_ports(1)[0]
        self.token_file = workdir / f"{name}.token"
        self.log_path = workdir / f"{name}.log"
        self.args = [sys.executable, "-m", "skippyd.daemon", *args, "--control", f"127.0.0.1:{self.control_port}",
                     "--control-token-file", str(self.token_file)]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, **(env or {})})

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.control_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if self.token_file.exists():
                try:
                    call_once(self.url, self.token_file, lambda i: m.Status(id=i))
                    return
                except ControlError:
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log()}")

    def status(self) -> dict:
        return call_once(self.url, self.token_file, lambda i: m.Status(id=i))

    async def astatus(self) -> dict:
        async with open_control(self.url, self.token_file) as client:
            return await client.call(m.Status(id=client.new_id()))

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 20.0) -> int:
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait()


class Pipeline:
    """Every stage of a topology as its own skippyd process (stage 0 is the head)."""

    def __init__(self, topology_path: Path, workdir: Path, *, extra: list[str] = (), env: dict | None = None):
        self.topology_path = topology_path
        self.topology = Topology.load(topology_path)
        self.workdir = workdir
        self.extra = list(extra)
        self.env = env
        self.stages: dict[int, Daemon] = {}

    def start_stage(self, k: int, *, wait: bool = True) -> Daemon:
        d = Daemon(["--topology", str(self.topology_path), "--stage", str(k), *self.extra], self.workdir,
                   f"stage{k}", env=self.env)
        self.stages[k] = d
        if wait:
            d.wait_ready()
        return d

    def start(self) -> Pipeline:
        for k in reversed(range(len(self.topology.stages))):
            self.start_stage(k, wait=False)
        for k in reversed(range(len(self.topology.stages))):
            self.stages[k].wait_ready()
        return self

    @property
    def head(self) -> Daemon:
        return self.stages[0]

    def stop(self) -> dict[int, int]:
        return {k: d.stop() for k, d in self.stages.items()}

    async def stage_sessions(self) -> dict[int, dict]:
        """Per stage: live sessions and free slots (head included)."""
        out = {}
        for k, d in self.stages.items():
            if d.proc.poll() is not None:
                continue
            st = await d.astatus()
            snap = st["head"] if k == 0 else st["stages"][0]
            out[k] = {"live": snap["live_sessions"], "free": snap["free_slots"], "n_seq_max": snap["n_seq_max"],
                      "scheduler": snap.get("scheduler", {})}
        return out

    async def wait_all_released(self, timeout: float = 2.0) -> dict[int, dict]:
        """Wait until every live stage reports zero sessions and every slot free."""
        deadline = trio.current_time() + timeout
        while True:
            snap = await self.stage_sessions()
            if all(s["live"] == 0 and s["free"] == s["n_seq_max"] for s in snap.values()):
                return snap
            if trio.current_time() > deadline:
                raise AssertionError(f"sessions not released within {timeout}s: {snap}")
            await trio.sleep(0.05)

    async def generate(self, **kw) -> dict:
        async with open_control(self.head.url, self.head.token_file) as client:
            return await client.call(m.Generate(id=client.new_id(), stream=False, **kw))
