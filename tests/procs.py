"""Real skippyd processes on loopback for the tests: start, wait for ready, query, kill.

Each daemon gets its own control port and token file; `status` of any daemon
reports its stages' live sessions and free slots, which is how the tests see
cleanup on stages that are not the head.
"""

from __future__ import annotations

import atexit
import itertools
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import trio

from skippyctl.client import ControlError, call_once, open_control
from skippyd.control import messages as m
from skippyd.runtime.slicing import split_model
from skippyd.topology import Topology

REPO = Path(__file__).resolve().parent.parent


def _die_with_parent() -> None:
    """Linux: a daemon started by a test run that gets killed must not outlive it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


_port_picker = random.Random()  # its own: tests may seed the module's (hypothesis does)
# every port handed out in this test run: a port picked for a topology is free until its daemon starts, and
# a second pick (a daemon's control port) must not hand it out again meanwhile
_handed_out: set[int] = set()
_handing_out = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now, for daemons to listen on later. Below the kernel's ephemeral
    range: a port bind(0) picks comes from that range, where the outgoing connections of daemons started
    meanwhile take their local ports, and a daemon started later would find its port taken. Never a port it
    handed out before in this run (two daemons of one test must not share one)."""
    low = min(_ephemeral_low(), 65536)
    ports: list[int] = []
    with _handing_out:
        while len(ports) < n:
            port = _port_picker.randrange(10000, low) if low > 11000 else _port_picker.randrange(1024, 65536)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            ports.append(port)
    return ports


_splits: dict[tuple, Path] = {}  # (model, its size and mtime, stages, balance) → the run's split of it


def split_for_test(model: Path, n_stages: int, out_dir: Path, *, balance: str = "layers") -> Topology:
    """`model` split in `n_stages`, its topology.toml in `out_dir` on free loopback ports. The stage files are
    written once per run (a split parses the vocabulary for every stage: seconds) and shared; the tests only
    read them."""
    st = Path(model).stat()
    key = (Path(model).resolve(), st.st_size, st.st_mtime_ns, n_stages, balance)
    cached = _splits.get(key)
    if cached is None or not cached.exists():
        folder = Path(tempfile.mkdtemp(prefix="skippy-test-split-"))
        atexit.register(shutil.rmtree, folder, True)
        split_model(model, None, folder, stages=n_stages, balance=balance)
        cached = _splits[key] = folder / "topology.toml"
    out_dir.mkdir(parents=True, exist_ok=True)
    return Topology.load(retarget(cached, out_dir))


def retarget(topology_path: Path, out_dir: Path) -> Path:
    """A copy of a topology in `out_dir` with fresh loopback ports, sharing the stage files (no second split)."""
    import attrs

    topo = Topology.load(topology_path)
    ports = free_ports(len(topo.stages))
    stages = [attrs.evolve(s, host="127.0.0.1", port=p) for s, p in zip(topo.stages, ports)]
    out = out_dir / "topology.toml"
    attrs.evolve(topo, stages=stages).dump(out)
    return out


def write_config(path: Path, values: dict[str, Any]) -> Path:
    """A skippyd.toml at `path` setting `values` ({"runtime.prefill_chunk": 16, ...}); every other key keeps its
    default."""
    from skippyd.config import toml_value

    sections: dict[str, list[str]] = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, []).append(f"{name} = {toml_value(value)}")
    path.write_text("".join(f"[{section}]\n" + "\n".join(lines) + "\n" for section, lines in sections.items()))
    return path


class Daemon:
    """One skippyd process; `config` ({"section.key": value}) is written to a skippyd.toml of its own.
    `prefix`: a command it runs under (``ip netns exec NAME``: a host of its own, see tests/netns.py);
    `control_host`: where its control channel listens (an address the test can reach); `as_service`: none of
    the tests' defaults below (no config file, the daemon's own defaults), as skippyd.service starts it."""

    def __init__(self, args: list[str], workdir: Path, name: str, *, env: dict | None = None,
                 config: dict[str, Any] | None = None, prefix: list[str] | None = None,
                 control_host: str = "127.0.0.1", as_service: bool = False):
        self.name = name
        self.control_host = control_host
        self.control_port = free_ports(1)[0]
        self.token_file = workdir / f"{name}.token"
        self.log_path = workdir / f"{name}.log"
        # the prefix cache off unless the test turns it on (a later --prefix-cache-mb wins): a restored prefix
        # followed by a suffix prefill rounds differently from a whole prefill, and most tests compare the
        # tokens of one run with another's
        # speculative decoding off likewise (a later --speculate wins): a verify window computes its rows in one
        # batch, which rounds a little differently from steps one by one
        if not as_service:
            args = ["--prefix-cache-mb", "0", "--speculate", "off", *args]
        # and activations float32 on the stage links unless the test asks for f16 (tests/test_activation_wire.py):
        # half floats round each hidden state a little, so a split's greedy tokens equal the unsplit model's only
        # up to a near-tie
        if not as_service:
            config = {"runtime.activation_wire": "f32", **(config or {})}
        if config:
            args = ["--config", str(write_config(workdir / f"{name}.toml", config)), *args]
        self.args = [*(prefix or ()), sys.executable, "-m", "skippyd.daemon", *args,
                     "--control", f"{control_host}:{self.control_port}", "--control-token-file", str(self.token_file)]
        self.env = {**os.environ, **(env or {})}
        self._start()

    def _start(self) -> None:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=self.env,
                                     # PDEATHSIG follows the forking *thread*: only safe from the main thread
                                     preexec_fn=_die_with_parent if threading.current_thread() is
                                     threading.main_thread() else None)

    def restart(self) -> None:
        """Start the same daemon again after it exited: the same flags, control port and token."""
        assert self.proc.poll() is not None, f"{self.name} still runs"
        self._log.close()
        self._start()

    @property
    def url(self) -> str:
        return f"ws://{self.control_host}:{self.control_port}"

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
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float = 20.0) -> int:
        """Wait for the process to exit (SIGKILL after `timeout`); its exit code."""
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
    """Every stage of a topology as its own skippyd process (stage 0 is the head): `extra` flags and
    `config` keys ({"runtime.prefill_chunk": 16}) for every daemon; `prefixes`: stage k's command prefix
    (``taskset -c K``: a core of its own), if any."""

    def __init__(self, topology_path: Path, workdir: Path, *, extra: list[str] = (), env: dict | None = None,
                 config: dict[str, Any] | None = None, prefixes: dict[int, list[str]] | None = None):
        self.prefixes = dict(prefixes or {})
        self.topology_path = topology_path
        self.topology = Topology.load(topology_path)
        self.workdir = workdir
        self.extra = list(extra)
        self.config = dict(config or {})
        self.env = env
        self.stages: dict[int, Daemon] = {}

    def start_stage(self, k: int, *, wait: bool = True) -> Daemon:
        d = Daemon(["--topology", str(self.topology_path), "--stage", str(k), *self.extra], self.workdir,
                   f"stage{k}", env=self.env, config=self.config, prefix=self.prefixes.get(k))
        self.stages[k] = d
        if wait:
            d.wait_ready()
        return d

    async def astart_stage(self, k: int) -> Daemon:
        """`start_stage` from inside trio (waits for readiness in a worker thread)."""
        d = self.start_stage(k, wait=False)
        await trio.to_thread.run_sync(d.wait_ready)
        return d

    def start(self) -> Pipeline:
        """Start every stage; if one fails, stop those already started before raising."""
        try:
            for k in reversed(range(len(self.topology.stages))):
                self.start_stage(k, wait=False)
            for k in reversed(range(len(self.topology.stages))):
                self.stages[k].wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def start_all_in_one(self) -> Pipeline:
        """Every stage in one daemon (`--stage all`); `stages` maps each index to that daemon."""
        d = Daemon(["--topology", str(self.topology_path), "--stage", "all", *self.extra], self.workdir, "all",
                   env=self.env, config=self.config)
        self.stages = {k: d for k in range(len(self.topology.stages))}
        try:
            d.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def head(self) -> Daemon:
        return self.stages[0]

    def stop(self) -> dict[int, int]:
        """SIGTERM every daemon (each once) and return the exit codes by stage index."""
        daemons = {id(d): d for d in self.stages.values()}
        for d in daemons.values():
            d.signal(signal.SIGTERM)
        codes = {key: d.wait_exit() for key, d in daemons.items()}
        return {k: codes[id(d)] for k, d in self.stages.items()}

    def stop_cleanly(self) -> None:
        """`stop`, asserting that every daemon exited 0; the message has each failed daemon's log tail."""
        codes = self.stop()
        failed = {k: code for k, code in codes.items() if code != 0}
        assert not failed, "\n".join(f"stage {k} exited with {code}; its log ends:\n{self.stages[k].log()[-4000:]}"
                                      for k, code in failed.items())

    async def stage_sessions(self) -> dict[int, dict]:
        """Per stage: live sessions and free slots (head included; every stage of a `--stage all` daemon)."""
        out = {}
        for d in {id(d): d for d in self.stages.values()}.values():
            if d.proc.poll() is not None:
                continue
            st = await d.astatus()
            snaps = ([st["head"]] if st.get("head") else []) + list(st["stages"])
            for snap in snaps:
                out[snap["stage_index"]] = {"live": snap["live_sessions"], "free": snap["free_slots"],
                                            "n_seq_max": snap["n_seq_max"], "scheduler": snap.get("scheduler", {})}
        return dict(sorted(out.items()))

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



class SingleStage(Pipeline):
    """`skippyd --model FILE`: the whole model in one stage, driven like a pipeline."""

    def __init__(self, model: Path, workdir: Path, extra: list[str] = (), config: dict[str, Any] | None = None, *,
                 wait: bool = True, name: str = "single", prefix: list[str] | None = None):
        self.workdir = workdir
        self.stages = {0: Daemon(["--model", str(model), *extra], workdir, name, config=config, prefix=prefix)}
        if wait:
            self.stages[0].wait_ready()


class Stage0Driver:
    """Plays stage 0 in the test process: runs the stage-0 slice and speaks the wire protocol to stage 1.

    It uses the daemon's own `DownstreamLink`, so what it sends is exactly what
    a head sends; unlike a head it can stop anywhere (mid-prefill, mid-decode)
    and drop the connection abruptly (`reset`).
    """

    def __init__(self, topology: Topology, *, n_ctx: int = 2048):
        from skippyd.runtime.llama import Context, ContextParams, Model
        from skippyd.wire.messages import Hello

        spec = topology.stage(0)
        self.topology = topology
        self.model = Model(spec.file)
        self.ctx = Context(self.model, ContextParams(n_ctx_per_seq=n_ctx, n_seq_max=1, n_threads=1))
        self.hello = Hello(fingerprint=topology.source_sha256, stage_index=0, layer_start=spec.layer_start,
                           layer_end=spec.layer_end, n_layer=topology.n_layer, n_embd=topology.n_embd,
                           node="test-driver")
        self._ids = itertools.count(1)

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    def next_id(self) -> int:
        return next(self._ids)

    async def connect(self, hello=None, **kw):
        """A DownstreamLink to stage 1 (raises DownstreamError if refused)."""
        from skippyd.stage.downstream import DownstreamLink

        s1 = self.topology.stage(1)
        return await DownstreamLink.connect(s1.host, s1.port, hello or self.hello, **kw)

    @staticmethod
    async def reset(link) -> None:
        """Close the connection with a TCP reset (SO_LINGER 0) instead of a FIN."""
        link.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await link.aclose()

    def tokenize(self, text: str):
        return self.model.tokenize(text, add_special=True, parse_special=False)

    def hidden(self, tokens, pos: int):
        """Stage 0's hidden states for `tokens` at positions [pos, pos+n) (a fresh session starts at 0)."""
        import numpy as np

        tokens = np.asarray(tokens, dtype=np.int32)
        if pos == 0:
            self.ctx.kv_clear_seq(0)
        self.ctx.decode(np.arange(pos, pos + len(tokens), dtype=np.int32), np.zeros(len(tokens), dtype=np.int32),
                        tokens=tokens)
        return self.ctx.hidden()

    async def request(self, link, msg):
        reply, *_ = await link.request(msg)
        return reply

    async def configure(self, link, session_id: int):
        from skippyd.wire.messages import ConfigureGeneration, SamplingParams

        return await self.request(link, ConfigureGeneration(self.next_id(), session_id, SamplingParams.greedy()))

    async def send_prefill(self, link, session_id: int, tokens, *, chunk: int, final: bool = True):
        """Prefill `tokens` from position 0 in chunks; returns the final chunk's reply (None if not `final`)."""
        from skippyd.wire.messages import PrefillChunk

        n = len(tokens)
        for lo in range(0, n, chunk):
            part = tokens[lo:lo + chunk]
            last = lo + chunk >= n
            msg = PrefillChunk(self.next_id(), session_id, lo, part, self.hidden(part, lo), final=last and final)
            if last and final:
                return await self.request(link, msg)
            await link.send_deferred(msg)
        return None

    def decode_msg(self, session_id: int, token: int, pos: int):
        import numpy as np

        from skippyd.wire.messages import DecodeStep

        tokens = np.array([token], dtype=np.int32)
        return DecodeStep(self.next_id(), session_id, pos, tokens, self.hidden(tokens, pos))

    async def stop(self, link, session_id: int):
        from skippyd.wire.messages import Stop

        return await self.request(link, Stop(self.next_id(), session_id))

    async def generate(self, link, session_id: int, prompt, n: int, *, chunk: int = 16) -> list[int]:
        """A whole greedy generation of `n` tokens over `link` (no EOG check), then Stop."""
        from skippyd.wire.messages import Ack, PredictedToken, Stopped

        assert isinstance(await self.configure(link, session_id), Ack)
        reply = await self.send_prefill(link, session_id, prompt, chunk=chunk)
        assert isinstance(reply, PredictedToken), reply
        out = [reply.token]
        pos = len(prompt)
        while len(out) < n:
            reply = await self.request(link, self.decode_msg(session_id, out[-1], pos))
            assert isinstance(reply, PredictedToken), reply
            out.append(reply.token)
            pos += 1
        assert isinstance(await self.stop(link, session_id), Stopped)
        return out
