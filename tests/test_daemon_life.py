"""skippyd as a service: config file, sd_notify, signals (drain, grace, reload), exit status.

The process tests share one 2-stage split of the default model and one plain
stage 1; each test that stops a daemon starts its own.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import trio
from trio_websocket import ConnectionClosed

from skippyctl.client import open_control
from skippyd import config as cfgmod
from skippyd.cli import build_parser, moved_flags, read_settings
from skippyd.config import Config, ConfigError, Settings, find_config, load, with_values
from skippyd.control import messages as m
from skippyd.daemon import JournalFormatter, notify
from skippyd.head.engine import GenerationResult
from skippyd.stage.prefix_cache import PrefixCache
from tests.procs import REPO, Daemon, Pipeline, free_ports, split_for_test
from tests.test_openai import FakeEngine

pytestmark = pytest.mark.slow  # real daemons signalled


def run_skippyd(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "skippyd.daemon", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


# ---------------------------------------------------------------- config (no model)
def settings(tmp_path: Path, toml: str | None, *flags: str, environ: dict | None = None) -> Settings:
    parser = build_parser()
    if toml is not None:
        (tmp_path / "skippyd.toml").write_text(toml)
        flags = ("--config", str(tmp_path / "skippyd.toml"), *flags)
    return read_settings(parser.parse_args(list(flags)), environ={} if environ is None else environ)


def test_config_file_then_flags(tmp_path):
    s = settings(tmp_path, """
[daemon]
drain_grace = 12.5
log_level = "warning"
[pipeline]
topology = "split/topology.toml"
stage = 1
[runtime]
lanes = 2
threads = 3
keep_warm_ms = 150
[control]
listen = "127.0.0.1:7400"
token_file = "/run/skippy/token"
""", "--lanes", "6", "--control", "127.0.0.1:9000")
    c = s.config
    assert c.runtime.lanes == 6 and c.runtime.threads == 3 and c.runtime.ctx == 4096  # flag > file > default
    assert c.runtime.keep_warm_ms == 150 and settings(tmp_path, None).config.runtime.keep_warm_ms == 0
    assert c.control.listen == "127.0.0.1:9000" and c.control.token_file == Path("/run/skippy/token")
    assert c.daemon.drain_grace == 12.5 and c.daemon.log_level == "warning" and c.pipeline.stage == 1
    assert c.pipeline.topology == tmp_path / "split/topology.toml"  # relative to the file's directory
    assert c.control.enabled
    assert s.source("runtime.lanes") == "flag" and s.source("runtime.threads") == "file"
    assert s.source("runtime.ctx") == "default"


def test_a_model_flag_replaces_the_files_topology(tmp_path):
    s = settings(tmp_path, '[pipeline]\ntopology = "t.toml"\nstage = 1\n', "--model", "/m.gguf")
    assert s.config.pipeline.model == Path("/m.gguf") and s.config.pipeline.topology is None


def test_defaults_without_a_file(tmp_path, monkeypatch):
    monkeypatch.setattr(cfgmod, "SYSTEM_CONFIG_DIR", tmp_path / "nothing-here")
    s = settings(tmp_path, None)
    assert s.path is None and s.file == Config()
    c = s.config
    assert c.control.listen == "127.0.0.1:7390" and c.daemon.drain_grace == 30.0 and c.runtime.lanes == 4


def test_config_search_order(tmp_path, monkeypatch):
    system, unit = tmp_path / "etc", tmp_path / "unit"
    for d in (system, unit):
        d.mkdir()
        (d / "skippyd.toml").write_text("")
    monkeypatch.setattr(cfgmod, "SYSTEM_CONFIG_DIR", system)
    explicit = tmp_path / "mine.toml"
    assert find_config(explicit, {"CONFIGURATION_DIRECTORY": str(unit)}) == explicit
    assert find_config(None, {"CONFIGURATION_DIRECTORY": str(unit)}) == unit / "skippyd.toml"
    assert find_config(None, {"CONFIGURATION_DIRECTORY": str(tmp_path / "empty")}) == system / "skippyd.toml"
    assert find_config(None, {}) == system / "skippyd.toml"
    monkeypatch.setattr(cfgmod, "SYSTEM_CONFIG_DIR", tmp_path / "none")
    assert find_config(None, {}) is None


def test_every_bad_key_is_reported_with_file_and_key(tmp_path):
    path = tmp_path / "skippyd.toml"
    path.write_text("""
[daemon]
log_level = "loud"
drain_grace = -1
colour = "blue"
[runtime]
lanes = "4"
ctx = 8
keep_warm_ms = 20000
[control]
listen = "nowhere"
[stage]
listen = "0.0.0.0:7400"
[extra]
""")
    with pytest.raises(ConfigError) as info:
        load(path)
    problems = dict(info.value.problems)
    assert problems.keys() == {"daemon.log_level", "daemon.drain_grace", "daemon.colour", "runtime.lanes",
                               "runtime.ctx", "runtime.keep_warm_ms", "control.listen", "extra"}
    assert problems["daemon.colour"] == problems["extra"] == "unknown key"
    assert "expected an integer" in problems["runtime.lanes"] and "at least 16" in problems["runtime.ctx"]
    assert "a number from 0 to 10000" in problems["runtime.keep_warm_ms"]
    # at start: every problem on stderr, one line each, with the file and the key; exit status 2
    proc = run_skippyd("--config", str(path))
    assert proc.returncode == 2
    assert f"{path}: runtime.lanes: expected an integer, got \"4\"" in proc.stderr
    assert f"{path}: daemon.colour: unknown key" in proc.stderr and "Traceback" not in proc.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("[daemon\n")
    proc = run_skippyd("--config", str(broken))
    assert proc.returncode == 2 and f"{broken}: not valid TOML" in proc.stderr
    proc = run_skippyd("--config", str(tmp_path / "missing.toml"))
    assert proc.returncode == 2 and "missing.toml: no such file" in proc.stderr
    proc = run_skippyd("--lanes", "0")  # a flag's value: the same check, named by the flag
    assert proc.returncode == 2 and "--lanes: must be at least 1, got 0" in proc.stderr


def test_tuning_is_set_in_the_file_and_its_old_flags_name_the_key():
    parser = build_parser()
    shown = [a for a in parser._actions if a.help != "==SUPPRESS=="]
    assert len(shown) <= 30, [a.option_strings for a in shown]  # -h, --version and what an operator gives by hand
    for flag, key in moved_flags().items():
        assert key in dict(cfgmod.DEFAULTS.items()), key
        assert not any(flag in a.option_strings for a in shown), flag
    proc = run_skippyd("--keep-warm-ms", "5", "--model", "m.gguf")
    assert proc.returncode == 2 and "--keep-warm-ms is set in the configuration file only: runtime.keep_warm_ms" \
        in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = run_skippyd("--no-direct-return")
    assert proc.returncode == 2 and "runtime.direct_return" in proc.stderr, proc.stderr
    help_text = run_skippyd("--help").stdout
    assert "--keep-warm-ms" not in help_text and "--drain-grace" not in help_text and "--lanes" in help_text


def test_a_chat_template_that_cannot_be_used_stops_the_daemon_with_one_line(tmp_path, default_model_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    for flags, expected in (
        (["--chat-template", str(tmp_path / "none.jinja")], f"chat template {tmp_path / 'none.jinja'}: cannot read"),
        (["--chat-template", str(bad)], f"chat template {bad}: does not compile"),
    ):
        proc = run_skippyd("--model", str(default_model_path), "--no-control", *flags)
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    path = tmp_path / "skippyd.toml"
    path.write_text(f'[pipeline]\nchat_template_file = "{bad}"\n')
    proc = run_skippyd("--config", str(path), "--check-config")
    assert proc.returncode == 0 and f'chat_template_file = "{bad}"  # file' in proc.stdout, proc.stderr


def test_check_config_prints_the_settings_in_force(tmp_path):
    path = tmp_path / "skippyd.toml"
    path.write_text('[runtime]\nlanes = 2\n[openai]\nlisten = "127.0.0.1:8080"\n')
    proc = run_skippyd("--config", str(path), "--check-config", "--ctx", "1024")
    assert proc.returncode == 0, proc.stderr
    assert "lanes = 2  # file" in proc.stdout and "ctx = 1024  # flag" in proc.stdout
    assert 'listen = "127.0.0.1:7390"' in proc.stdout


def test_sd_notify_is_a_noop_without_a_socket(monkeypatch, tmp_path):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notify("READY=1")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    notify("READY=1")  # never raises


def test_journald_priority_prefixes(monkeypatch):
    monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
    fmt = JournalFormatter()
    record = logging.LogRecord("skippyd", logging.WARNING, __file__, 1, "disk %s", ("full",), None)
    assert fmt.format(record) == "<4>skippyd: disk full"
    monkeypatch.delenv("JOURNAL_STREAM")
    assert JournalFormatter().format(record).endswith("warning skippyd: disk full")


# ---------------------------------------------------------------- drain (in-process, a stand-in engine)
class SlowToAnswerEngine(FakeEngine):
    """The OpenAI tests' stand-in engine, killable, for both channels. Its generation leaves `live` a while
    before its caller has the result (the moments between the engine's cleanup and the reply's last
    message, long on a crawling host): a shutdown that watched `live` alone would cancel the daemon there and
    cut the reply off."""

    def __init__(self, cleanup_s: float = 0.0):
        super().__init__(behave=None)
        self.release = trio.Event()
        self.killed: str | None = None
        self.cleanup_s = cleanup_s  # once cancelled, it stays live this long (the real one's shielded cleanup)
        self.prefix_cache = PrefixCache(0, stage_index=0)  # (a drain writes it to its disk tier: it has none)

    def kill(self, session_id: int, why: str) -> None:
        self.killed = why
        self.live[session_id].cancel()

    async def generate(self, req, sink=None):
        with trio.CancelScope() as scope:
            # a running generation as the engine keeps it: the console's history reads its progress
            self.live[1] = SimpleNamespace(cancel=scope.cancel, generated=0, state="decode")
            await self.release.wait()
        if self.killed is not None:
            await trio.sleep(self.cleanup_s)
        del self.live[1]
        await trio.sleep(0.3)
        return GenerationResult(request_id=1, session_id=1, text=" done", tokens=[7],
                                finish_reason="stop" if self.killed is None else "cancelled", error=self.killed,
                                prompt_tokens=5, ttft_ms=1.0, decode_tokens_per_s=1.0, elapsed_ms=1.0)


@pytest.mark.parametrize("channel", ["control", "openai"])
@pytest.mark.parametrize("ends", ["within-grace", "past-grace", "past-grace-slow-cleanup"])
async def test_a_shutdown_waits_until_every_reply_is_sent_not_until_the_engine_lets_go(tmp_path, channel, ends):
    """past-grace-slow-cleanup: a cancelled generation's cleanup may wait STOP_TIMEOUT_S twice (its stop
    down the lane, its KV clear behind a long compute); a shorter limit on that wait would close the
    client's connection before the result."""
    from skippyd.control.server import ControlServer
    from skippyd.daemon import Daemon as SkippyDaemon
    from skippyd.head.sequence import STOP_TIMEOUT_S
    from skippyd.openai.server import OpenAIServer

    grace = "5" if ends == "within-grace" else "0.2"
    daemon = SkippyDaemon(with_values(Config(), {"pipeline.model": Path("m.gguf"), "daemon.drain_grace": float(grace)}))
    engine = SlowToAnswerEngine(cleanup_s=2 * STOP_TIMEOUT_S - 0.3 if ends.endswith("slow-cleanup") else 0.0)
    node = daemon.node
    node.head = SimpleNamespace(engine=engine, pool=None, vision=None, model_name="m")  # a stand-in head
    token = tmp_path / "token"
    token.write_text("the-token\n")
    got: list = []  # the generation's replies
    idle: list = []  # the close reasons an idle control client got

    async def ask_control(port: int) -> None:
        async with open_control(f"ws://127.0.0.1:{port}", token) as client:
            got.extend([r async for r in client.replies(m.Generate(id="g", prompt="hi", max_tokens=4))])

    async def stay_idle(port: int) -> None:  # a client connected, asking nothing: told why it is closed
        async with open_control(f"ws://127.0.0.1:{port}", token) as client:
            with pytest.raises(ConnectionClosed) as closed:
                await client.ws.get_message()
            idle.append(closed.value.reason)

    def ask_openai(port: int) -> None:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=10)
        try:
            got.append(api.completions.create(model="m", prompt="hi", max_tokens=4))
        except openai.APIError as exc:
            got.append(exc)

    async with trio.open_nursery() as clients:
        async with trio.open_nursery() as daemon_tasks:  # the daemon's own nursery
            if channel == "control":
                node.control = await daemon_tasks.start(ControlServer(node, "127.0.0.1", 0, token_file=token).run)
                clients.start_soon(ask_control, node.control.port)
                clients.start_soon(stay_idle, node.control.port)
            else:
                node.openai = await daemon_tasks.start(OpenAIServer(node, "127.0.0.1", 0, model_id="m",
                                                                    metrics=node.metrics).run)
                clients.start_soon(trio.to_thread.run_sync, ask_openai, node.openai.port)
            while not engine.live or (node.control is not None and len(node.control._open) < 2):
                await trio.sleep(0.01)
            if ends == "within-grace":
                engine.release.set()  # the generation ends while the drain runs
            await daemon._shutdown(daemon_tasks.cancel_scope)  # SIGTERM's: drain, cancel what is left, stop
    reply = got[-1]
    if channel == "control":
        assert [(r.code, r.reason) for r in idle] == [(1001, "skippyd is shutting down")]
    if ends == "within-grace":
        assert (reply.result["text"] if channel == "control" else reply.choices[0].text) == " done", reply
    elif channel == "control":
        assert isinstance(reply, m.Result) and reply.result["finish_reason"] == "cancelled", reply
        assert reply.result["error"] == "the daemon is shutting down (its drain grace of 0.2 s is over)"
    else:
        assert isinstance(reply, openai.APIStatusError) and reply.status_code == 503
        assert "ended early (cancelled): the daemon is shutting down (its drain grace of 0.2 s is over)" in str(reply)


# ---------------------------------------------------------------- real daemons
class NotifySocket:
    """A fake systemd notify socket (unix datagram); remembers every line it got, in order."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.lines: list[str] = []

    def wait_for(self, line: str, daemon: Daemon, timeout: float = 60.0) -> list[str]:
        """Read datagrams until one holds `line`; returns every line read so far."""
        deadline = time.monotonic() + timeout
        while line not in self.lines:
            if daemon.proc.poll() is not None and line != "STOPPING=1":
                raise AssertionError(f"{daemon.name} exited with {daemon.proc.returncode}:\n{daemon.log()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {line} within {timeout}s; got {self.lines}\n{daemon.log()}")
            self.sock.settimeout(min(left, 0.5))
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.lines += data.decode().splitlines()
        return self.lines

    def close(self) -> None:
        self.sock.close()


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def split(default_model_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("life")
    split_for_test(default_model_path, 2, work)
    return work / "topology.toml"


@pytest.fixture(scope="module")
def stage1(split):
    pipe = Pipeline(split, split.parent)
    daemon = pipe.start_stage(1)
    yield daemon
    assert daemon.stop() == 0


def test_notify_ready_reload_and_stopping(split, tmp_path):
    """READY=1 only once the stage listener and the control channel accept; SIGHUP reloads; SIGTERM: STOPPING=1."""
    notify = NotifySocket(tmp_path / "notify")
    cfg = tmp_path / "skippyd.toml"
    cfg.write_text('[daemon]\nlog_level = "info"\ndrain_grace = 5\n[runtime]\nlanes = 2\n')
    port = free_ports(1)[0]
    d = Daemon(["--config", str(cfg), "--topology", str(split), "--stage", "1", "--listen", f"127.0.0.1:{port}"],
               tmp_path, "notify", env={"NOTIFY_SOCKET": str(notify.path)})
    try:
        lines = notify.wait_for("READY=1", d)
        assert accepts(port) and accepts(d.control_port)  # checked right after READY=1 arrived
        assert any(line.startswith("STATUS=loading stage 1") for line in lines[: lines.index("READY=1")])
        assert "STOPPING=1" not in lines
        assert lines[lines.index("READY=1") + 1].startswith("STATUS=stage 1")
        status = d.status()
        assert status["config"] == str(cfg) and status["ready"]

        # SIGHUP: log level and drain grace apply at once; lanes needs a restart; flags still win
        cfg.write_text('[daemon]\nlog_level = "debug"\ndrain_grace = 7\n[runtime]\nlanes = 3\n')
        del notify.lines[:]
        d.signal(signal.SIGHUP)
        notify.wait_for("READY=1", d, timeout=10)
        assert notify.lines[0] == "RELOADING=1"
        log = d.log()
        assert "SIGHUP: daemon.log_level: info → debug" in log and "SIGHUP: daemon.drain_grace: 5.0 → 7.0" in log
        assert "SIGHUP: runtime.lanes changed in" in log and "next restart" in log
        # an invalid file is refused; the daemon keeps running on what it had
        cfg.write_text('[daemon]\nlog_level = "chatty"\n')
        del notify.lines[:]
        d.signal(signal.SIGHUP)
        notify.wait_for("READY=1", d, timeout=10)
        assert "daemon.log_level: must be one of" in d.log() and "keeping the running configuration" in d.log()
        assert d.status()["ready"]

        d.signal(signal.SIGTERM)
        notify.wait_for("STOPPING=1", d, timeout=10)
        assert d.wait_exit(20) == 0
        assert "received SIGTERM: draining (running generations get 7s to finish)" in d.log()
    finally:
        if d.proc.poll() is None:
            d.kill()
        notify.close()


async def wait_released(stage1: Daemon, timeout: float = 2.0) -> None:
    deadline = trio.current_time() + timeout
    while (snap := (await stage1.astatus())["stages"][0])["live_sessions"] or snap["free_slots"] != snap["n_seq_max"]:
        assert trio.current_time() < deadline, f"stage 1 still holds sessions: {snap}"
        await trio.sleep(0.05)


async def start_generation(head: Daemon, nursery: trio.Nursery, **kw) -> dict:
    """Start a streamed generation; returns a dict that gets "pieces", then "result" (or "error")."""
    state: dict = {"pieces": [], "first": trio.Event(), "done": trio.Event()}

    async def run() -> None:
        try:
            async with open_control(head.url, head.token_file) as client:
                async for reply in client.replies(m.Generate(id=client.new_id(), **kw)):
                    if isinstance(reply, m.Piece):
                        state["pieces"].append(reply.text)
                        state["first"].set()
                    elif isinstance(reply, m.Result):
                        state["result"] = reply.result
                    else:
                        state["error"] = reply
        finally:
            state["first"].set()
            state["done"].set()

    nursery.start_soon(run)
    await state["first"].wait()
    return state


async def test_sigterm_lets_running_generations_finish(split, stage1, tmp_path):
    head = Daemon(["--topology", str(split), "--stage", "0"], tmp_path, "head", config={"daemon.drain_grace": 30})
    try:
        await trio.to_thread.run_sync(head.wait_ready)
        async with trio.open_nursery() as nursery:
            gen = await start_generation(head, nursery, prompt="Once upon a time", raw=True, max_tokens=120)
            signalled = time.monotonic()
            head.signal(signal.SIGTERM)
            # draining: the control channel still answers, but new generations are refused
            while not (await head.astatus())["draining"]:
                await trio.sleep(0.02)
            async with open_control(head.url, head.token_file) as client:
                reply = [r async for r in client.replies(m.Generate(id="late", prompt="hi", max_tokens=4))][-1]
            assert isinstance(reply, m.Error) and "draining" in reply.message and reply.retryable
            await gen["done"].wait()
        assert "error" not in gen, gen.get("error")
        result = gen["result"]
        assert result["finish_reason"] in ("length", "stop")
        assert result["finish_reason"] == "stop" or result["usage"]["completion_tokens"] == 120
        assert "".join(gen["pieces"]) == result["text"]
        rc = await trio.to_thread.run_sync(lambda: head.wait_exit(20))
        assert rc == 0, head.log()
        assert time.monotonic() - signalled < 30
        assert "received SIGTERM: draining" in head.log()
    finally:
        if head.proc.poll() is None:
            head.kill()
    await wait_released(stage1)


async def test_sigint_past_the_grace_period_cancels_and_exits_0(split, stage1, tmp_path):
    head = Daemon(["--topology", str(split), "--stage", "0"], tmp_path, "head", config={"daemon.drain_grace": 0.5})
    try:
        await trio.to_thread.run_sync(head.wait_ready)
        async with trio.open_nursery() as nursery:
            gen = await start_generation(head, nursery, prompt="Write a long story about a dragon.", max_tokens=1000)
            signalled = time.monotonic()
            head.signal(signal.SIGINT)
            await gen["done"].wait()
        assert gen["result"]["finish_reason"] == "cancelled", gen
        assert gen["result"]["error"] == "the daemon is shutting down (its drain grace of 0.5 s is over)"
        assert time.monotonic() - signalled < 5
        rc = await trio.to_thread.run_sync(lambda: head.wait_exit(20))
        assert rc == 0, head.log()
        assert "grace period over" in head.log()
    finally:
        if head.proc.poll() is None:
            head.kill()
    await wait_released(stage1)  # the head stopped the session on stage 1 on its way out


async def test_status_probe_reads_a_stages_version_and_sees_a_dead_one(split, stage1):
    import attrs

    from skippyd.status import probe_stage
    from skippyd.topology import Topology
    from skippyd.wire.messages import PROTOCOL_VERSION

    topology = Topology.load(split)
    live = await probe_stage(topology, topology.stage(1))
    assert live == {"reachable": True, "version": PROTOCOL_VERSION, "node": "stage-1"}
    dead = await probe_stage(topology, attrs.evolve(topology.stage(1), port=free_ports(1)[0]))
    assert dead["reachable"] is False and dead["version"] is None and dead["error"]
    # the probe opened no session on the stage
    assert (await stage1.astatus())["stages"][0]["live_sessions"] == 0


@pytest.mark.parametrize("listener", ["stage", "control", "openai"])
def test_an_address_in_use_is_named_with_the_flag_that_moves_it(split, default_model_path, tmp_path, listener):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = f"127.0.0.1:{taken.getsockname()[1]}"
    free = f"127.0.0.1:{free_ports(1)[0]}"
    token = ["--control-token-file", str(tmp_path / "control.token")]
    args, expected = {
        "stage": (["--topology", str(split), "--stage", "1", "--listen", busy, "--no-control"],
                  f"stage 1: cannot listen on {busy}: address already in use; another program (another skippyd?) "
                  "listens there: give this daemon another address with --listen HOST:PORT"),
        "control": (["--topology", str(split), "--stage", "1", "--listen", free, "--control", busy, *token],
                    f"control channel: cannot listen on {busy}: address already in use; another program (another "
                    "skippyd?) listens there: give this daemon another address with --control HOST:PORT"),
        "openai": (["--model", str(default_model_path), "--no-control", "--openai", busy],
                   f"OpenAI API: cannot listen on {busy}: address already in use; another program (another "
                   "skippyd?) listens there: give this daemon another address with --openai HOST:PORT"),
    }[listener]
    try:
        proc = run_skippyd(*args)
    finally:
        taken.close()
    assert proc.returncode == 1, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr and "Errno" not in proc.stderr
