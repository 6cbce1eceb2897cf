"""No work holds a stage's event loop: every stage answers a ping within 250 ms while the long operations run.

The live tests ping every stage every 50 ms (stage 1 with the wire protocol's Ping, as the head's liveness
watch does; the head, which serves no stage links of its own here, over a kept-alive HTTP connection to its
/health) while one operation runs: the first constrained request on Gemma 3 (llguidance's view of a 262k
vocabulary), a 4,000-token chat through the chat template, a 5 MB request body (an image in base64), an
image prompt, and prefix-cache entries written to the disk tier and its files cleared. The monitor itself
(:class:`~skippyd.stage.loop_lag.LoopLag`) and the ping deadline are checked first, in this process.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import math
import re
import time

import numpy as np
import pytest
import trio

from skippyd.stage.downstream import DownstreamLink
from skippyd.stage.loop_lag import LAG_BUCKETS, LoopLag, LoopLagCollector, PingDeadline
from skippyd.topology import Topology
from skippyd.wire.messages import Hello, Ping, wire_formats
from tests.mm_models import write_idefics3_projector, write_smolvlm_text_model
from tests.openai_api import Api, wait_healthy
from tests.procs import Pipeline, SingleStage, free_ports, split_for_test

PING_EVERY_S = 0.05
BOUND_S = 0.25  # no ping may take longer than this


# ---------------------------------------------------------------------------- the monitor, in this process
async def test_the_monitor_measures_how_long_the_loop_was_held_and_warns_once(caplog):
    caplog.set_level(logging.WARNING, logger="skippyd.stage")
    lag = LoopLag("7", period=0.02, warn_s=0.1, warn_every_s=60)
    async with trio.open_nursery() as nursery:
        await nursery.start(lag.serve)
        await trio.sleep(0.1)
        assert lag.recent(trio.current_time()) < 0.1
        for _ in range(2):
            time.sleep(0.3)  # what a long call on the loop's thread does to every task on it
            await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert lag.samples >= 6 and lag.stalls == 2 and 0.28 <= lag.max_s < 1.0
    assert lag.recent(trio.current_time()) == lag.max_s
    assert sum(lag.counts) == lag.samples
    assert sum(lag.counts[:LAG_BUCKETS.index(0.25) + 1]) == lag.samples - 2  # the two stalls are over 0.25 s
    warnings = [r.getMessage() for r in caplog.records if "event loop" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert re.fullmatch(r"stage 7: the event loop was held for 0\.(2[89]|3)\d* s", warnings[0]), warnings
    assert lag.describe()["stalls"] == 2 and lag.describe()["max_ms"] >= 280


async def test_the_collector_exports_each_stages_histogram():
    lag = LoopLag("3", period=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(lag.serve)
        await trio.sleep(0.1)
        time.sleep(0.06)
        await trio.sleep(0.02)
        (family,) = LoopLagCollector().collect()
        nursery.cancel_scope.cancel()
    assert family.name == "skippy_event_loop_lag_seconds"
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples if s.labels["stage"] == "3"}
    count = samples["skippy_event_loop_lag_seconds_count", None]
    assert count >= 5 and samples["skippy_event_loop_lag_seconds_bucket", "+Inf"] == count
    assert samples["skippy_event_loop_lag_seconds_bucket", "0.025"] <= count - 1  # the 60 ms stall
    assert samples["skippy_event_loop_lag_seconds_sum", None] >= 0.05
    assert not [s for s in next(iter(LoopLagCollector().collect())).samples if s.labels["stage"] == "3"], \
        "a monitor that stopped is no longer exported"


async def test_the_ping_deadline_follows_round_trips_within_its_bounds():
    deadline = PingDeadline(1.0, 4.0)
    assert deadline.timeout() == 1.0  # nothing measured: the floor
    for _ in range(50):
        deadline.observe(0.002)
    assert deadline.timeout() == 1.0  # a stage that answers at once: the floor, so a dead one is found as fast
    for _ in range(10):
        deadline.observe(0.8)  # a stage alive but slow to answer (a loaded host)
    assert deadline.rtt_high() == 0.8 and deadline.timeout() == pytest.approx(1.6)
    deadline.observe(30.0)
    assert deadline.timeout() == pytest.approx(1.6)  # one late answer among many moves no percentile
    for _ in range(10):
        deadline.observe(30.0)
    assert deadline.timeout() == 4.0  # never past the ceiling: a dead stage is found within seconds
    relay = PingDeadline(scale=0.8)
    assert relay.timeout() == pytest.approx(0.8) and relay.ceiling == 4.0
    with pytest.raises(ValueError):
        PingDeadline(2.0, 1.0)


async def test_a_pings_wait_does_not_count_the_time_its_own_loop_was_held():
    deadline = PingDeadline(0.5, 4.0)
    answered = trio.Event()

    async def answer_late():
        await answered.wait()
        return "ack"

    async def hold_the_loop_then_answer():
        await trio.sleep(0.1)
        time.sleep(0.6)  # the waiting loop itself held past the deadline: the answer sat unread meanwhile
        answered.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold_the_loop_then_answer)
        started = time.monotonic()
        assert await deadline.within(answer_late) == "ack"
        assert time.monotonic() - started >= 0.6

    never = trio.Event()
    started = time.monotonic()
    with pytest.raises(trio.TooSlowError):
        await deadline.within(never.wait)  # a free loop and no answer: the deadline as it is
    assert 0.45 <= time.monotonic() - started < 0.8

    async def held_for_good():
        while True:
            time.sleep(0.2)  # a loop that never runs free still gives up by the ceiling
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(held_for_good)
        started = time.monotonic()
        with pytest.raises(trio.TooSlowError):
            await PingDeadline(0.5, 1.0).within(never.wait)
        assert time.monotonic() - started < 3.0  # the ceiling and the stall in progress, however loaded the host
        nursery.cancel_scope.cancel()

    async def refused():
        raise ConnectionRefusedError("refused")

    with pytest.raises(ConnectionRefusedError):
        await deadline.within(refused)  # the operation's own error, as it is


# ---------------------------------------------------------------------------- pinging live daemons
class Pings:
    """Pings each target every PING_EVERY_S and keeps every round trip (a ping still waiting at the end counts
    as long as it has waited)."""

    def __init__(self):
        self.rtts: dict[str, list[float]] = {}
        self._waiting: dict[str, float] = {}

    async def _every(self, name: str, ping, task_status) -> None:
        rtts = self.rtts.setdefault(name, [])
        await ping()  # connected and answering before the operation starts
        task_status.started()
        while True:
            self._waiting[name] = sent = time.perf_counter()
            await ping()
            rtts.append(time.perf_counter() - sent)
            del self._waiting[name]
            await trio.sleep(max(0.0, PING_EVERY_S - rtts[-1]))

    async def stage(self, name: str, topology: Topology, k: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Stage k (k >= 1) over the wire protocol, as the head's liveness watch does."""
        up, s = topology.stage(k - 1), topology.stage(k)
        hello = Hello(fingerprint=topology.source_sha256, stage_index=k - 1, layer_start=up.layer_start,
                      layer_end=up.layer_end, n_layer=topology.n_layer, n_embd=topology.n_embd, node="pinger",
                      wire_formats=wire_formats("f32"))
        link = await DownstreamLink.connect(s.host, s.port, hello, connect_timeout=10, credit_limit=0,
                                            reply_timeout=30, write_timeout=30)
        ids = iter(range(1, 1 << 62))
        try:
            await self._every(name, lambda: link.request(Ping(next(ids))), task_status)
        finally:
            with trio.CancelScope(shield=True):
                await link.aclose()

    async def http(self, name: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """A head's event loop: GET /health on a kept-alive connection (opened again when the server ends one:
        it serves a connection so many requests)."""
        conn: list[trio.SocketStream] = []
        pending = bytearray()

        async def get() -> None:
            if not conn:
                conn.append(await trio.open_tcp_stream("127.0.0.1", port))
                pending.clear()
            stream = conn[0]
            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: pinger\r\n\r\n")
            while True:
                head, sep, rest = bytes(pending).partition(b"\r\n\r\n")
                if sep:
                    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    if len(rest) >= length:
                        assert head.startswith(b"HTTP/1.1 200"), head
                        del pending[:len(head) + 4 + length]
                        if b"connection: close" in head.lower():
                            await conn.pop().aclose()
                        return
                chunk = await stream.receive_some(65536)
                if not chunk:  # closed after its last answer: the same request on a new connection
                    await conn.pop().aclose()
                    return await get()
                pending.extend(chunk)

        try:
            await self._every(name, get, task_status)
        finally:
            for stream in conn:
                await trio.aclose_forcefully(stream)

    def worst(self) -> dict[str, float]:
        now = time.perf_counter()
        return {name: max([*rtts, now - self._waiting[name]] if name in self._waiting else rtts, default=math.inf)
                for name, rtts in self.rtts.items()}


@contextlib.asynccontextmanager
async def pinging(*targets):
    """Ping every target (``(method name, args...)`` of :class:`Pings`) while the body runs; then assert that
    each answered every time, within BOUND_S."""
    pings = Pings()
    own = LoopLag("pinger", period=0.01)  # this process's own loop, which the pings go through
    async with trio.open_nursery() as nursery:
        await nursery.start(own.serve)
        for method, *args in targets:
            await nursery.start(getattr(pings, method), *args)
        yield pings
        worst = pings.worst()
        nursery.cancel_scope.cancel()
    counts = {name: len(rtts) for name, rtts in pings.rtts.items()}
    assert all(n >= 2 for n in counts.values()), f"too few pings to tell anything: {counts}"
    slow = {name: round(s, 3) for name, s in worst.items() if s > BOUND_S}
    assert not slow, (f"a ping took over {BOUND_S} s (worst by target, s): {slow}; pings: {counts}; "
                      f"this process's own loop lagged {own.max_s:.3f} s at most")


def _post(api: Api, path: str, body: bytes, status: int) -> dict:
    with api.http() as h:
        reply = h.post(path, content=body, headers={"content-type": "application/json"}, timeout=300)
    assert reply.status_code == status, reply.text[:2000]
    return reply.json()


async def post(api: Api, path: str, body: bytes, *, status: int = 200) -> dict:
    return await trio.to_thread.run_sync(_post, api, path, body, status)


@pytest.mark.slow
async def test_the_first_constrained_request_on_gemma3_holds_no_loop(gemma3_path, tmp_path):
    """Gemma 3's 262k-token vocabulary as llguidance reads it is made while the stage loads, not by the first
    constrained request, whose matcher alone is made then (off the event loop)."""
    port = free_ports(1)[0]
    single = await trio.to_thread.run_sync(lambda: SingleStage(gemma3_path, tmp_path, ["--openai",
                                                                                        f"127.0.0.1:{port}",
                                                                                        "--ctx", "1024"]))
    try:
        api = Api(single, port)
        await trio.to_thread.run_sync(wait_healthy, api)
        schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"]}
        async with pinging(("http", "head", port)):
            got = await single.generate(prompt="A person, as JSON:", raw=True, max_tokens=24,
                                        json_schema=json.dumps(schema))
        assert got["tokens"] and got["text"].lstrip().startswith("{"), got["text"]
        lag = (await single.head.astatus())["head"]["loop_lag"]
        assert lag["samples"] > 0 and lag["last_ms"] < BOUND_S * 1e3, lag
        metrics = await trio.to_thread.run_sync(api.metrics)
        assert metrics["skippy_event_loop_lag_seconds_count", (("stage", "0"),)] > 0
    finally:
        codes = await trio.to_thread.run_sync(single.stop)
    assert codes == {0: 0}, codes


def _noise_png(side: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    pixels = np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(out, format="PNG", compress_level=1)
    return out.getvalue()


def _chat(content, max_tokens: int = 2) -> bytes:
    return json.dumps({"model": "smolvlm-text", "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}).encode()


def _image_chat(png: bytes, text: str) -> bytes:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return _chat([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}])


@pytest.fixture(scope="module")
def vision_pipeline(default_model_path, tmp_path_factory):
    """SmolVLM's text model (the default model with its image tokens) on 2 stages, the head with an idefics3
    projector, serving the OpenAI API, every stage's prefix cache on with a disk tier (a small memory budget:
    a few prompts push entries to disk)."""
    work = tmp_path_factory.mktemp("loop-stall")
    model = write_smolvlm_text_model(default_model_path, work / "smolvlm-text.gguf")
    projector = write_idefics3_projector(work / "mmproj.gguf")
    split_for_test(model, 2, work)
    port = free_ports(1)[0]
    pipe = Pipeline(work / "topology.toml", work,
                    extra=["--openai", f"127.0.0.1:{port}", "--mmproj", str(projector), "--ctx", "2048",
                           "--lanes", "2", "--prefix-cache-mb", "8", "--prefix-cache-dir", str(work / "pc")]).start()
    try:
        api = Api(pipe, port, timeout=300)
        wait_healthy(api)
        yield pipe, api, port
    finally:
        codes = pipe.stop()
    assert all(c == 0 for c in codes.values()), codes


def _targets(pipe: Pipeline, port: int):
    return ("http", "head", port), ("stage", "stage 1", pipe.topology, 1)


LINE = "The keeper climbed the one hundred and twelve steps, trimmed the wick and wrote the weather in his log. "


@pytest.mark.slow
async def test_a_4000_token_chat_holds_no_loop(vision_pipeline):
    """A 40-message chat of over 4,000 tokens through the chat template and the tokenizer, into a context of
    2,048 (its prompt is refused once counted: the prefill is not the point)."""
    pipe, api, port = vision_pipeline
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": LINE * 5} for i in range(40)]
    body = json.dumps({"model": "smolvlm-text", "max_tokens": 2, "temperature": 0, "messages": history}).encode()
    async with pinging(*_targets(pipe, port)):
        got = await post(api, "/v1/chat/completions", body, status=400)
    assert got["error"]["code"] == "context_length_exceeded", got
    tokens = int(re.search(r"the prompt has (\d+)", got["error"]["message"]).group(1))
    assert tokens >= 4000, got


@pytest.mark.slow
async def test_a_5_mb_request_body_and_an_image_hold_no_loop(vision_pipeline):
    pipe, api, port = vision_pipeline
    big = _image_chat(_noise_png(1120), "What is in the picture?")
    small = _image_chat(_noise_png(64), "And in this one?")
    assert len(big) > 5_000_000
    async with pinging(*_targets(pipe, port)):
        got = await post(api, "/v1/chat/completions", big)
    assert got["usage"]["prompt_tokens"] > 8, got["usage"]  # the image's rows among them
    async with pinging(*_targets(pipe, port)):
        got = await post(api, "/v1/chat/completions", small)
    assert got["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
async def test_writing_the_prefix_cache_to_disk_holds_no_loop(vision_pipeline):
    """Distinct prompts of some 300 tokens: each one's entries push earlier ones out of memory (8 MiB) to the
    disk tier, written while the next prompt computes; then every file is cleared."""
    from skippyctl.client import open_control
    from skippyd.control import messages as m

    pipe, api, port = vision_pipeline
    bodies = [_chat(f"Log book {i}. " + LINE * 14, max_tokens=1) for i in range(4)]
    async with pinging(*_targets(pipe, port)):
        for body in bodies:
            await post(api, "/v1/chat/completions", body)
        with trio.fail_after(60):
            while True:  # every stage's tier holds files: the writes were under way while the pings went on
                snaps = [(await pipe.head.astatus())["head"], *(await pipe.stages[1].astatus())["stages"]]
                if all(s["prefix_cache"].get("disk_writes", 0) > 0 for s in snaps):
                    break
                await trio.sleep(0.2)
        async with open_control(pipe.head.url, pipe.head.token_file) as client:
            await client.call(m.CacheClear(id=client.new_id(), disk=True))
    files = list((pipe.workdir / "pc").glob("stage-*/*.kv"))
    with trio.fail_after(10):
        while files:  # the files are deleted by the tier's writer thread
            await trio.sleep(0.1)
            files = list((pipe.workdir / "pc").glob("stage-*/*.kv"))
