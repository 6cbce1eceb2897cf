"""skippyctl against a real 2-stage pipeline of the default model (one pipeline for the module).

Commands run in-process through typer's CliRunner (in a worker thread when a
generation must run at the same time); Ctrl-C runs a real `skippyctl`
subprocess. The control protocol itself (bad requests, streaming order) is
checked with the websocket client.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import trio
from typer.testing import CliRunner

from skippyctl.app import app
from skippyctl.client import open_control
from skippyd.control import messages as m
from tests.procs import REPO, Daemon, Pipeline, free_ports, split_for_test

STORY = "Write a long story about a brave dragon who lives in the mountains."
GREEDY = ["--prompt", "The capital of France is", "--raw"]


@pytest.fixture(scope="module")
def smol2(default_model_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("cli2")
    split_for_test(default_model_path, 2, work)
    pipe = Pipeline(work / "topology.toml", work).start()
    yield pipe
    pipe.stop_cleanly()


def ctl(daemon: Daemon, *args: str, token_file=None):
    """`skippyctl --url … --token-file … ARGS` in-process; the click Result."""
    tf = daemon.token_file if token_file is None else token_file
    return CliRunner().invoke(app, ["--url", daemon.url, "--token-file", str(tf), *args])


def ctl_json(daemon: Daemon, *args: str):
    result = ctl(daemon, *args, "--json")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


async def actl(daemon: Daemon, *args: str):
    """`ctl` in a worker thread, for use while a generation runs in this trio task."""
    return await trio.to_thread.run_sync(lambda: ctl(daemon, *args))


async def actl_json(daemon: Daemon, *args: str):
    return await trio.to_thread.run_sync(lambda: ctl_json(daemon, *args))


def assert_clean_error(result, *needles: str, code: int = 1) -> None:
    """One "error: …" line on stderr, the expected exit status, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert result.stderr.startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for needle in needles:
        assert needle in result.stderr, result.stderr


class Running:
    """A streamed generation on its own control connection, driven by a task: pieces, then the result."""

    def __init__(self, daemon: Daemon, **kw):
        self.daemon = daemon
        self.kw = {"prompt": STORY, "max_tokens": 400, **kw}
        self.pieces: list[str] = []
        self.result: dict | None = None
        self.error: m.Error | None = None
        self.first_piece = trio.Event()
        self.done = trio.Event()

    async def run(self) -> None:
        async with open_control(self.daemon.url, self.daemon.token_file) as client:
            async for reply in client.replies(m.Generate(id=client.new_id(), **self.kw)):
                if isinstance(reply, m.Piece):
                    self.pieces.append(reply.text)
                    self.first_piece.set()
                elif isinstance(reply, m.Result):
                    self.result = reply.result
                elif isinstance(reply, m.Error):
                    self.error = reply
        self.first_piece.set()
        self.done.set()


# ---------------------------------------------------------------- status and errors
@pytest.mark.slow
def test_status(smol2):
    data = ctl_json(smol2.head, "status")
    assert data["role"] == "head" and data["ready"] and not data["draining"]
    assert data["model"]["architecture"] == "llama" and data["model"]["n_layer_total"] == 30
    # the name the topology (and the OpenAI endpoint) gives the model, not the GGUF's general.name
    assert data["model"]["name"] == data["topology"]["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert data["model"]["gguf_name"] and data["model"]["gguf_name"] != data["model"]["name"]
    assert data["local_stages"] == [{"index": 0, "layers": [0, 15], "listen": None}]
    assert data["uptime_s"] >= 0 and data["version"] and data["protocol_version"] >= 1
    assert set(data["load"]) >= {"live_generations", "busy_lanes", "queued", "totals"}
    topo = data["topology"]
    assert [(s["index"], s["layers"], s["local"]) for s in topo["stages"]] == [(0, [0, 15], True),
                                                                               (1, [15, 30], False)]
    assert all(s["reachable"] is True and s["version"] == topo["protocol_version"] for s in topo["stages"])
    threads = data["head"]["threads"]
    # (fewer than configured while other programs hold this host's cores: skippyd/stage/threads.py)
    assert threads["configured"] >= 1 and 1 <= threads["now"] <= threads["configured"] and threads["adaptive"]
    table = ctl(smol2.head, "status")
    assert table.exit_code == 0 and "head" in table.stdout and "[15,30)" in table.stdout and "threads" in table.stdout


def test_status_table_shows_a_stage_on_fewer_threads_and_a_failing_lanes_task():
    from rich.console import Console

    from skippyctl.status import _table

    data = {"role": "head", "uptime_s": 5, "version": "0", "model": {"name": "m"},
            "topology": {"stages": [{"index": 0, "address": "a:1", "layers": [0, 15], "local": True,
                                     "reachable": True, "version": 3},
                                    {"index": 1, "address": "b:1", "layers": [15, 30], "local": True,
                                     "reachable": True, "version": 3}]},
            "head": {"stage_index": 0, "threads": {"configured": 4, "now": 4}},
            "stages": [{"stage_index": 1, "threads": {"configured": 4, "now": 1}}]}
    console = Console(width=120, record=True)
    console.print(_table(data))
    text = console.export_text()
    rows = [line for line in text.splitlines() if "a:1" in line or "b:1" in line]
    assert rows[0].split()[4] == "4" and "1 of 4" in rows[1], rows
    assert "lanes" not in text
    # the head's lanes task failed (a bug it survives): the table says so, not only the log
    data["head"]["lanes_task"] = {"failures": 2, "last_error": "ValueError: [x] not in [bold]list"}
    console = Console(width=120, record=True)
    console.print(_table(data))
    caption = " ".join(console.export_text().split())  # (a long caption wraps)
    # word for word: an error's brackets are not rich's markup
    assert "keeping lanes open FAILED 2 time(s), last: ValueError: [x] not in [bold]list" in caption
    # at a pipe's 80 characters, a LAN address keeps its port
    data["topology"]["stages"][1]["address"] = "192.168.100.201:7401"
    console = Console(width=80, record=True)
    console.print(_table(data))
    assert "192.168.100.201:7401" in console.export_text(), console.export_text()
    # speculative decoding: the head's totals, and the acceptance of each running generation that drafts
    data["head"]["speculation"] = {"enabled": True, "windows": 40, "acceptance": 0.625,
                                   "sessions": {"77": 0.5, "78": None}}
    console = Console(width=160, record=True)
    console.print(_table(data))
    assert "speculation: 40 windows, acceptance 62%; running: session 77 50%, session 78 -" in \
        console.export_text().splitlines(), console.export_text()
    data["head"]["speculation"] = {"enabled": False, "windows": 0, "acceptance": None, "sessions": {}}
    console = Console(width=160, record=True)
    console.print(_table(data))
    assert "speculation: off" in console.export_text().splitlines()
    # a caption line wider than the (rule-less, narrow) table goes out at the console's width, not broken at
    # the table's into several
    data["listeners"] = [{"what": what, "address": address, "loopback": False} for what, address in
                         (("control", "192.168.100.200:7390"), ("openai", "0.0.0.0:8080"),
                          ("token-return", "192.168.100.200:7403"))]
    console = Console(width=160, record=True)
    console.print(_table(data))
    text = console.export_text()
    assert ("listening: control 192.168.100.200:7390 (not loopback), openai 0.0.0.0:8080 (not loopback), "
            "token-return 192.168.100.200:7403 (not loopback)") in text.splitlines(), text


def test_sessions_table_fits_80_columns_without_cutting_a_number():
    from rich.console import Console

    from skippyctl.sessions import _table

    rows = [{"session_id": 3063365090573110252, "state": "prefill", "prompt_tokens": 1234, "generated": 1090,
             "decode_tokens_per_s": 62.2, "position": 2324, "age_s": 121.5, "lane": 17,
             "stages": {"0": {"seq": 0}, "1": {"seq": 3}, "2": {"seq": 7}}},
            {"session_id": 13063365090573110252, "state": "decode", "prompt_tokens": None, "generated": 10,
             "decode_tokens_per_s": None, "position": 24, "age_s": 1.5, "lane": None, "stages": {"1": {"seq": 3}}}]
    console = Console(width=80, record=True)
    console.print(_table(rows))
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80, text
    first = next(line for line in text.splitlines() if line.startswith("3063365090573110252"))
    assert first.split()[:9] == ["3063365090573110252", "prefill", "1234", "1090", "62.2", "2324", "121.5", "17",
                                 "0:0,"], text
    assert "tok/s" in text and "2:7" in text


@pytest.mark.slow
def test_status_of_a_stage_daemon(smol2):
    data = ctl_json(smol2.stages[1], "status")
    assert data["role"] == "stage 1" and data["head"] is None
    assert data["local_stages"][0]["index"] == 1 and data["local_stages"][0]["layers"] == [15, 30]
    stages = {s["index"]: s for s in data["topology"]["stages"]}
    assert stages[1]["local"] and stages[1]["reachable"]
    assert stages[0]["reachable"] is None  # the head has no listener to probe
    # its load is its stage's sessions: it never sees a generation, so it does not count any
    table = ctl(smol2.stages[1], "status").stdout
    assert f"{data['load']['stage_sessions']['1']} sessions live" in table and "generations" not in table, table
    assert data["model"]["name"] == data["topology"]["model"]
    # generation needs the head: a clear refusal (a bad request for this daemon), not a crash
    assert_clean_error(ctl(smol2.stages[1], "generate", "--prompt", "hi"), "no head", code=2)


@pytest.mark.slow
def test_token_file_is_private(smol2):
    assert stat.S_IMODE(os.stat(smol2.head.token_file).st_mode) == 0o600


@pytest.mark.slow
def test_bad_token_is_refused(smol2, tmp_path):
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-the-token\n")
    assert_clean_error(ctl(smol2.head, "status", token_file=wrong), "refused the control token")
    assert_clean_error(ctl(smol2.head, "sessions", "list", token_file=tmp_path / "missing"), "no control token")


def test_generate_option_out_of_range_is_a_usage_error(tmp_path):
    """Caught by the message's own checks, before any connection (sampling travels as float32 / int32)."""
    token = tmp_path / "t.token"
    token.write_text("x\n")
    base = ["--url", f"ws://127.0.0.1:{free_ports(1)[0]}", "--token-file", str(token), "generate", "-p", "hi"]
    for option, value, needle in (("--temperature", "1e300", "(a float32)"), ("--top-k", "4294967296", "2147483647")):
        assert_clean_error(CliRunner().invoke(app, [*base, option, value]), f"{option}: ", needle, code=2)
    # the daemon would take a negative temperature for greedy, as llama.cpp does; the CLI says 0 is greedy
    negative = CliRunner().invoke(app, [*base, "--temperature", "-1"])
    assert negative.exit_code == 2 and "--temperature" in negative.output, negative.output


@pytest.mark.slow
def test_daemon_not_running(smol2, tmp_path):
    token = tmp_path / "t.token"
    token.write_text("x\n")
    port = free_ports(1)[0]
    result = CliRunner().invoke(app, ["--url", f"ws://127.0.0.1:{port}", "--token-file", str(token), "status"])
    assert_clean_error(result, "cannot reach skippyd", "Connection refused")


@pytest.mark.slow
def test_unknown_session(smol2):
    for command in ("show", "kill"):
        assert_clean_error(ctl(smol2.head, "sessions", command, "12345"), "unknown session 12345")


@pytest.mark.slow
async def test_bad_requests_get_error_replies_on_a_usable_connection(smol2):
    async with open_control(smol2.head.url, smol2.head.token_file) as client:
        async def send_raw(text: str) -> m.Reply:
            await client.ws.send_message(text)
            return m.parse_reply(await client.ws.get_message())

        reply = await send_raw('{"type": "generate", "id": "g1", "prompt": "hi", "max_tokens": "lots"}')
        assert isinstance(reply, m.Error) and reply.id == "g1" and reply.code == "bad_request"
        assert "$.max_tokens" in reply.message and "expected an integer" in reply.message
        reply = await send_raw('{"type": "session_kill", "id": "k1", "session": 3}')
        assert isinstance(reply, m.Error) and "$.session" in reply.message and "$.session_id" in reply.message
        reply = await send_raw('{"type": "explode", "id": "x"}')
        assert isinstance(reply, m.Error) and "$.type" in reply.message
        reply = await send_raw("this is not json")
        assert isinstance(reply, m.Error) and "malformed JSON" in reply.message
        reply = await send_raw("[" * 100_000 + "]" * 100_000)  # deeper than Python's recursion limit
        assert isinstance(reply, m.Error) and "nested too deeply" in reply.message
        # the same connection still works
        data = await client.call(m.Status(id=client.new_id()))
        assert data["role"] == "head"


# ---------------------------------------------------------------- generate
@pytest.mark.slow
def test_generate_json_matches_the_heads_result(smol2):
    out = ctl_json(smol2.head, "generate", *GREEDY, "--max-tokens", "24")
    assert set(out) >= {"text", "tokens", "finish_reason", "usage", "timings"}
    assert out["usage"]["completion_tokens"] == len(out["tokens"]) and out["usage"]["prompt_tokens"] > 0
    assert out["timings"]["ttft_ms"] > 0 and out["timings"]["decode_tokens_per_s"] >= 0
    head = trio.run(lambda: smol2.generate(prompt="The capital of France is", raw=True, max_tokens=24))
    for key in ("text", "tokens", "finish_reason"):
        assert out[key] == head[key], key
    assert out["usage"]["prompt_tokens"] == head["usage"]["prompt_tokens"]
    assert " Paris" in out["text"]

    # the text mode prints the same text, then a summary on stderr
    plain = ctl(smol2.head, "generate", *GREEDY, "--max-tokens", "24")
    assert plain.exit_code == 0, plain.stderr
    assert plain.stdout == out["text"] + "\n"
    assert f"{len(out['tokens'])} generated tokens" in plain.stderr


@pytest.mark.slow
def test_generate_options(smol2):
    stopped = ctl_json(smol2.head, "generate", *GREEDY, "--max-tokens", "24", "--stop", "zzz", "--stop", ".")
    assert stopped["finish_reason"] == "stop" and stopped["text"] == " Paris"
    sampled = ["--temperature", "0.9", "--top-k", "40", "--top-p", "0.9", "--seed", "7", "--max-tokens", "12"]
    a = ctl_json(smol2.head, "generate", "--prompt", "Name a colour.", "--system", "Answer in one word.", *sampled)
    b = ctl_json(smol2.head, "generate", "--prompt", "Name a colour.", "--system", "Answer in one word.", *sampled)
    assert a["tokens"] == b["tokens"]  # a seed makes sampling reproducible
    chat = ctl_json(smol2.head, "generate", "--prompt", "Name a colour.", "--max-tokens", "4")
    assert chat["usage"]["prompt_tokens"] > 5  # the chat template wrapped the prompt
    bad = ctl(smol2.head, "generate", "--prompt", "hi", "--max-tokens", "0")
    assert_clean_error(bad, "max_tokens", code=2)


ENDS_SOON = "Answer yes or no: is the sky blue?\n"  # greedy, raw: the default model ends it after 11 tokens


@pytest.mark.slow
def test_generate_ignore_eos_runs_past_the_end_to_max_tokens(smol2):
    plain = ctl_json(smol2.head, "generate", "--prompt", ENDS_SOON, "--raw", "--max-tokens", "40")
    assert plain["finish_reason"] == "stop" and len(plain["tokens"]) < 20, plain
    got = ctl_json(smol2.head, "generate", "--prompt", ENDS_SOON, "--raw", "--max-tokens", "40", "--ignore-eos")
    assert got["finish_reason"] == "length" and len(got["tokens"]) == got["usage"]["completion_tokens"] == 40, got
    assert got["tokens"][:len(plain["tokens"])] == plain["tokens"]  # the same reply, then on past its end
    text = ctl(smol2.head, "generate", "--prompt", ENDS_SOON, "--raw", "--max-tokens", "40", "--ignore-eos")
    assert text.exit_code == 0 and "[length: " in text.stderr and "40 generated tokens" in text.stderr, text.stderr


@pytest.mark.slow
async def test_generation_streams_pieces_before_the_result(smol2):
    seen = []
    async with open_control(smol2.head.url, smol2.head.token_file) as client:
        first = trio.Event()

        async def generate() -> None:
            request = m.Generate(id=client.new_id(), prompt="Once upon a time", raw=True, max_tokens=32)
            async for reply in client.replies(request):
                seen.append((type(reply).__name__, time.monotonic()))
                first.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate)
            await first.wait()
            # the same connection serves another request while the generation streams
            status = await client.call(m.Status(id=client.new_id()))
            assert status["load"]["live_generations"] == 1
    kinds = [k for k, _ in seen]
    assert kinds[-1] == "Result" and set(kinds[:-1]) == {"Piece"} and len(kinds) >= 4, kinds
    assert seen[-1][1] - seen[0][1] > 0  # the first piece came while the generation still ran


@pytest.mark.slow
async def test_two_streams_on_one_connection_stay_whole_and_apart(smol2):
    """Two generations streamed at once over one control connection: every message arrives whole (the
    daemon relies on trio-websocket to keep concurrent messages apart), each stream's pieces are its own
    and in order (they make up its result's text), and each result is what it is alone."""
    prompts = ["Once upon a time", "The capital of France is"]
    streams: dict[str, tuple[list[str], dict]] = {}
    async with open_control(smol2.head.url, smol2.head.token_file) as client:
        async def generate(prompt: str) -> None:
            pieces = []
            async for reply in client.replies(m.Generate(id=client.new_id(), prompt=prompt, raw=True,
                                                         max_tokens=24, temperature=0.0)):
                if isinstance(reply, m.Piece):
                    pieces.append(reply.text)
                else:
                    assert isinstance(reply, m.Result), reply
                    streams[prompt] = (pieces, reply.result)

        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(generate, prompt)
        alone = {p: await client.call(m.Generate(id=client.new_id(), prompt=p, raw=True, max_tokens=24,
                                                 temperature=0.0, stream=False)) for p in prompts}
    for prompt in prompts:
        pieces, result = streams[prompt]
        assert len(pieces) >= 4 and "".join(pieces) == result["text"]
        assert result["tokens"] == alone[prompt]["tokens"]


CTL_MAIN = "from skippyctl.app import main; sys.argv[0] = 'skippyctl'; main()"


# rich takes these over whether stderr is a terminal
TERMINAL_OVERRIDES = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")


@pytest.mark.slow
def test_generate_on_a_terminal_shows_what_it_waits_for_until_the_first_token(smol2, monkeypatch):
    """Before the first token (a long prompt's prefill: tens of seconds with a big model) stderr, when it is
    a terminal, shows a spinner saying what it waits for, cleared at the first token; stdout has the text."""
    import pty

    for name in TERMINAL_OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    primary, secondary = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", f"import sys; {CTL_MAIN}", "--url", smol2.head.url, "--token-file",
             str(smol2.head.token_file), "generate", *GREEDY, "--max-tokens", "8"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=secondary, env=dict(os.environ, TERM="xterm"), timeout=60)
        os.close(secondary)
        secondary = -1
        screen = b""
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not chunk:
                break
            screen += chunk
    finally:
        os.close(primary)
        if secondary >= 0:
            os.close(secondary)
    assert proc.returncode == 0, screen
    assert b"reading the prompt, then the first token" in screen
    assert b"[length: " in screen  # the summary, after the line was cleared
    want = ctl_json(smol2.head, "generate", *GREEDY, "--max-tokens", "8")["text"]
    assert proc.stdout.decode() == want + "\n"
    # not a terminal (CliRunner, pipes): no such line, for scripts and logs
    assert "reading the prompt" not in ctl(smol2.head, "generate", *GREEDY, "--max-tokens", "8").stderr


@pytest.mark.slow
async def test_ctrl_c_cancels_the_generation_on_every_stage(smol2):
    # `python -c`, so that SIGINT has its default handler even when the test runner ignores it
    code = f"import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); {CTL_MAIN}"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--url", smol2.head.url, "--token-file", str(smol2.head.token_file),
         "generate", "--prompt", STORY, "--max-tokens", "400"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # the text streams: some arrives while the generation still runs
        first = await trio.to_thread.run_sync(lambda: os.read(proc.stdout.fileno(), 64))
        assert first and proc.poll() is None
        assert (await smol2.stage_sessions())[1]["live"] == 1
        proc.send_signal(signal.SIGINT)
        await smol2.wait_all_released(timeout=2.0)
        rc = await trio.to_thread.run_sync(lambda: proc.wait(10))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read().decode()
    assert rc == 130, err
    assert "cancelled" in err and "Traceback" not in err


# ---------------------------------------------------------------- sessions and lanes
@pytest.mark.slow
async def test_sessions_list_show_kill(smol2):
    gen = Running(smol2.head)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gen.run)
        await gen.first_piece.wait()
        listed = await actl_json(smol2.head, "sessions", "list")
        assert len(listed) == 1
        s = listed[0]
        assert s["state"] in ("prefill", "decode") and s["prompt_tokens"] > 0 and s["generated"] >= 1
        assert s["position"] >= s["prompt_tokens"] and s["age_s"] >= 0 and s["lane"] is not None
        assert s["stages"]["0"]["seq"] >= 0
        shown = await actl_json(smol2.head, "sessions", "show", str(s["session_id"]))
        assert shown["session_id"] == s["session_id"] and shown["generated"] >= s["generated"]
        with trio.fail_after(10):
            while shown["generated"] < 3:  # the decode rate so far, from the second token on
                await trio.sleep(0.02)
                shown = await actl_json(smol2.head, "sessions", "show", str(s["session_id"]))
        rate = shown["decode_tokens_per_s"]
        assert rate > 0 and (shown["generated"] - 1) / rate <= shown["age_s"], shown
        table = await actl(smol2.head, "sessions", "list")
        assert str(s["session_id"]) in table.stdout and "tok/s" in table.stdout
        # stage 1's own daemon lists the same session with its sequence there
        on_stage1 = await actl_json(smol2.stages[1], "sessions", "list")
        assert [r["session_id"] for r in on_stage1] == [s["session_id"]] and on_stage1[0]["stages"]["1"]["seq"] >= 0
        assert on_stage1[0]["decode_tokens_per_s"] is None  # a stage does not time the head's generation
        killed = await actl_json(smol2.head, "sessions", "kill", str(s["session_id"]))
        assert killed == {"killed": s["session_id"], "released": True}
        await gen.done.wait()
    assert gen.result["finish_reason"] == "cancelled"
    assert gen.result["error"] == "killed by an operator (skippyctl sessions kill)"
    assert 0 < gen.result["usage"]["completion_tokens"] < 400
    await smol2.wait_all_released()
    assert await actl_json(smol2.head, "sessions", "list") == []


@pytest.mark.slow
async def test_lanes_drain_and_undrain(smol2):
    lanes = await actl_json(smol2.head, "lanes", "list")
    s1 = smol2.topology.stage(1)
    assert not lanes["draining"] and lanes["downstream"] == f"{s1.host}:{s1.port}"
    assert all(set(lane) >= {"lane_id", "state", "session_id", "downstream"} for lane in lanes["lanes"])
    gen = Running(smol2.head, max_tokens=48)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gen.run)
            await gen.first_piece.wait()
            drained = await actl_json(smol2.head, "lanes", "drain")
            assert drained["draining"]
            busy = [lane for lane in drained["lanes"] if lane["state"] == "busy"]
            assert len(busy) == 1 and busy[0]["session_id"] is not None
            refused = await actl(smol2.head, "generate", "--prompt", "hi", "--max-tokens", "4")
            assert_clean_error(refused, "no new generations until `skippyctl lanes undrain`")
            await gen.done.wait()
        # the running generation was not disturbed
        assert gen.error is None and gen.result["finish_reason"] in ("length", "stop")
        assert gen.result["finish_reason"] == "stop" or gen.result["usage"]["completion_tokens"] == 48
    finally:
        undrained = await actl_json(smol2.head, "lanes", "undrain")
    assert not undrained["draining"]
    again = await actl_json(smol2.head, "generate", *GREEDY, "--max-tokens", "4")
    assert again["finish_reason"] == "length"
    table = await actl(smol2.head, "lanes", "list")
    assert table.exit_code == 0 and "lane" in table.stdout
    await smol2.wait_all_released()
