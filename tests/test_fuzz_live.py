"""Bad input against a live pipeline: nothing crashes, nothing hangs past its deadline, good work goes on.

A 2-stage pipeline of the default model (real processes, the head with
`--openai`) takes, while a well-formed generation runs again and again beside
it on the control channel (the "canary", whose tokens must not change):

* on stage 1's listener: random bytes, valid frame prefixes with lying
  lengths, mutated frames after a real handshake, and slow-drip senders (a
  byte every 100 ms) before and after the handshake;
* on the control channel: garbled JSON, requests with fields of the wrong
  type or out of range, huge and binary messages;
* on the HTTP endpoint: hypothesis-generated bodies for /v1/chat/completions
  and /v1/completions.

After each test both daemons are alive, every stage holds no session, and the
canary's generations all matched. The counts (cases tried, crashes, hangs) are
printed at the end of the module.
"""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import struct
import threading
import time
from collections import Counter

import attrs
import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippyctl.client import ControlError, open_control
from skippyd.control import messages as m
from skippyd.sampling import Constraint
from skippyd.wire.codec import (
    MESSAGE_KINDS,
    PREFIX_SIZE,
    REPLY_KINDS,
    decode_body,
    decode_frame,
    frame_bytes,
    parse_prefix,
)
from skippyd.wire.messages import (
    DEFAULT_LIMITS,
    CacheQuery,
    ConfigureGeneration,
    DecodeStep,
    Hello,
    HelloReply,
    Ping,
    PrefillChunk,
    RestorePrefix,
    SamplingParams,
    Stop,
    TrimSession,
    VerifyWindow,
)
from tests.procs import Pipeline, free_ports, split_for_test

pytestmark = pytest.mark.slow  # fuzzes a live pipeline of daemon processes

try:  # the HTTP client the installed openai release is built on
    import httpx2
except ImportError:  # openai 1.x
    import httpx as httpx2

CTX = 512
PROBE = dict(prompt="The capital of France is", raw=True, max_tokens=8)
CLOSE_S = 2.0  # after our FIN (or a fatal frame) the stage closes the connection within this
HANDSHAKE_S = 5.0  # the stage's handshake deadline (StageConfig.handshake_timeout_s)
FRAME_S = 5.0  # a started frame's deadline after the handshake (StageConfig.frame_timeout_s; small frames)
REPLY_S = 20.0  # a control or HTTP request gets its answer within this (a generation of <= 4 tokens)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.function_scoped_fixture],
                derandomize=True)
TALLY: Counter = Counter()  # cases tried per target, crashes, hangs


# ---------------------------------------------------------------------------- the pipeline and the canary
@attrs.define
class Live:
    pipe: Pipeline
    http: str
    reference: list[int]
    hello: Hello  # what stage 0 says to stage 1


@pytest.fixture(scope="module")
def live(default_model_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz")
    topo = split_for_test(default_model_path, 2, work)
    port = free_ports(1)[0]
    pipe = Pipeline(work / "topology.toml", work,
                    # the cache on, so that fuzzed RestorePrefix frames reach it (the canary's prompt is too
                    # short to be restored: its tokens stay those of a whole prefill)
                    extra=["--openai", f"127.0.0.1:{port}", "--ctx", str(CTX), "--lanes", "4",
                           "--prefix-cache-mb", "64"],
                    config={"runtime.prefill_chunk": 64})
    try:
        pipe.start()
        reference = trio.run(functools.partial(pipe.generate, **PROBE))["tokens"]
        s0 = topo.stage(0)
        hello = Hello(fingerprint=topo.source_sha256, stage_index=0, layer_start=s0.layer_start,
                      layer_end=s0.layer_end, n_layer=topo.n_layer, n_embd=topo.n_embd, node="fuzz")
        yield Live(pipe, f"http://127.0.0.1:{port}", reference, hello)
    finally:
        codes = pipe.stop()
    assert all(c == 0 for c in codes.values()), codes


@pytest.fixture(scope="module", autouse=True)
def tally(request):
    TALLY.clear()
    TALLY.update(crashes=0, hangs=0)
    yield TALLY
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print("\n\nfuzz: " + ", ".join(f"{k} {v}" for k, v in sorted(TALLY.items())), flush=True)


class Canary:
    """Well-formed generations in a loop, in a thread of their own, while a test throws garbage."""

    def __init__(self, live: Live):
        self.live = live
        self.stop = threading.Event()
        self.results: list = []
        self.thread = threading.Thread(target=lambda: trio.run(self._run), daemon=True)

    async def _run(self) -> None:
        while not self.stop.is_set():
            try:
                got = await self.live.pipe.generate(**PROBE)
                self.results.append(got["tokens"])
            except ControlError as exc:
                self.results.append(f"error: {exc}")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)


@pytest.fixture
def canary(live):
    """Runs during the test; afterwards: both daemons alive, no session anywhere, every canary result right."""
    with Canary(live) as c:
        yield c
    assert not c.thread.is_alive(), "the canary hung"
    for k, d in live.pipe.stages.items():
        if d.proc.poll() is not None:
            TALLY["crashes"] += 1
            pytest.fail(f"stage {k} died ({d.proc.returncode}):\n{d.log()[-3000:]}")
    assert c.results, "no canary generation completed during the test"
    TALLY["canary generations"] += len(c.results)
    assert all(r == live.reference for r in c.results), [r for r in c.results if r != live.reference][:3]
    trio.run(functools.partial(live.pipe.wait_all_released, 5.0))


def _hang(what: str) -> None:
    TALLY["hangs"] += 1
    pytest.fail(f"hang: {what}")


# ---------------------------------------------------------------------------- stage 1's listener
class Peer:
    """A plain blocking socket to stage 1."""

    def __init__(self, live: Live):
        s1 = live.pipe.topology.stage(1)
        self.sock = socket.create_connection((s1.host, s1.port), timeout=5)
        self.live = live
        self.received = b""

    def close(self) -> None:
        self.sock.close()

    def fin(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def send(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # the stage may have closed already (a reset)
            self.sock.sendall(data)

    def wait_closed(self, timeout: float) -> float | None:
        """Read everything until the stage closes; seconds it took, or None if still open after `timeout`."""
        started = time.monotonic()
        deadline = started + timeout
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return None
            except OSError:  # reset
                return time.monotonic() - started
            if not data:
                return time.monotonic() - started
            self.received += data
        return None

    def read_frame(self, timeout: float = 5.0):
        self.sock.settimeout(timeout)
        prefix = self._exactly(PREFIX_SIZE)
        n = struct.unpack_from("<I", prefix, 4)[0]
        body = self._exactly(n)
        return prefix + body

    def _exactly(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            data = self.sock.recv(n - len(out))
            if not data:
                raise EOFError(f"closed after {len(out)} of {n} bytes")
            out += data
        return out

    def handshake(self) -> Hello:
        self.send(frame_bytes(self.live.hello))
        frame = self.read_frame()
        peer = decode_body(parse_prefix(frame[:PREFIX_SIZE], DEFAULT_LIMITS), frame[PREFIX_SIZE:])
        assert isinstance(peer, Hello), peer
        self.send(frame_bytes(HelloReply(accepted=True)))
        return peer


def replies_are_frames(data: bytes, n_embd: int, *, handshake: bool) -> None:
    """Whatever the stage said before closing is a sequence of well-formed frames."""
    view = memoryview(data)
    while len(view) >= PREFIX_SIZE:
        n = struct.unpack_from("<I", view, 4)[0]
        if len(view) < PREFIX_SIZE + n:
            break  # cut off by the close: allowed
        frame = bytes(view[:PREFIX_SIZE + n])
        kind = frame[2]
        assert kind in REPLY_KINDS or handshake, f"unexpected frame kind {kind:#x}"
        decode_frame(frame, n_embd=n_embd)
        view = view[PREFIX_SIZE + n:]


@settings(max_examples=120, **SETTINGS)
@given(data=st.binary(min_size=0, max_size=300))
def test_stage_random_bytes(live, canary, data):
    TALLY["stage cases"] += 1
    peer = Peer(live)
    try:
        peer.send(data)
        peer.fin()
        if peer.wait_closed(CLOSE_S) is None:
            _hang(f"stage 1 kept the connection {CLOSE_S} s after {data[:40]!r}... and a FIN")
        replies_are_frames(peer.received, live.hello.n_embd, handshake=True)
    finally:
        peer.close()


KINDS = st.sampled_from(sorted({0x01, 0x02} | set(MESSAGE_KINDS) | set(REPLY_KINDS)) + [0x00, 0x7F, 0xFF])


@settings(max_examples=120, **SETTINGS)
@given(kind=KINDS, flags=st.integers(0, 255), body_len=st.one_of(st.integers(0, 200), st.integers(0, 2**32 - 1)),
       body=st.binary(max_size=200), magic=st.sampled_from([b"SK", b"SK", b"SKPY"[:2], b"XX"]))
def test_stage_prefix_with_lying_length(live, canary, kind, flags, body_len, body, magic):
    """A frame prefix whose body length is not what follows (shorter, longer, absurd), before the handshake."""
    TALLY["stage cases"] += 1
    peer = Peer(live)
    try:
        peer.send(struct.pack("<2sBBI", magic, kind, flags, body_len) + body)
        peer.fin()
        if peer.wait_closed(CLOSE_S) is None:
            _hang(f"stage 1 kept the connection after a prefix claiming {body_len} bytes and a FIN")
    finally:
        peer.close()


def _messages(n_embd: int) -> list[bytes]:
    hidden = np.zeros((2, n_embd), dtype=np.float32)
    tokens = np.array([1, 2], dtype=np.int32)
    return [frame_bytes(msg) for msg in (
        ConfigureGeneration(1, 77, SamplingParams.greedy()),
        PrefillChunk(2, 77, 0, tokens, hidden, final=False),
        PrefillChunk(3, 77, 0, tokens, hidden, final=True),
        DecodeStep(4, 77, 2, tokens[:1], hidden[:1]),
        TrimSession(5, 77, 1),
        Stop(6, 77),
        Ping(7),
        RestorePrefix(8, 78, np.arange(40, dtype=np.int32)),
        CacheQuery(9, clear=False),
        # the generation extension: a constraint the final stage compiles (mutated: bad UTF-8, a schema or grammar
        # that does not compile, a length that lies) and logprobs
        ConfigureGeneration(10, 79, SamplingParams(constraint=Constraint.json_schema(
            {"type": "object", "properties": {"a": {"type": "integer"}}}), logprobs=2)),
        ConfigureGeneration(11, 80, SamplingParams(constraint=Constraint.grammar('root ::= "yes" | "no"'))),
        # verify windows (speculative decoding): one the final stage computes after the configure prelude (its
        # answer a PredictedTokens), one past the session's positions
        VerifyWindow(12, 77, 0, tokens, hidden),
        VerifyWindow(13, 77, 2, tokens, hidden),
        # a prompt's first chunk with its prefix cache lookup (a restore block)
        PrefillChunk(14, 81, 0, tokens, hidden, restore=np.arange(40, dtype=np.int32)),
    )]


@settings(max_examples=150, **SETTINGS)
@given(data=st.data())
def test_stage_mutated_frames_after_handshake(live, canary, data):
    """A real handshake, then a valid message with a field overwritten, cut short, or bytes flipped."""
    TALLY["stage cases"] += 1
    frames = _messages(live.hello.n_embd)
    frame = bytearray(data.draw(st.sampled_from(frames)))
    how = data.draw(st.sampled_from(["field", "truncate", "flip", "append", "configure-then-field"]))
    prelude = b""
    if how == "configure-then-field":  # a session exists when the bad frame comes
        prelude, how = frames[0], "field"
    if how == "field":
        # offsets: prefix kind 2, flags 3, body_len 4; header request_id 8, session_id 16, pos 24, token_count 28,
        # activation_bytes 32, bias_count 36, ext_len 38
        offset, size = data.draw(st.sampled_from([(2, 1), (3, 1), (4, 4), (24, 4), (28, 4), (32, 4), (36, 2),
                                                  (38, 2)]))
        value = data.draw(st.integers(0, 2 ** (8 * size) - 1))
        frame[offset:offset + size] = value.to_bytes(size, "little")
    elif how == "truncate":
        frame = frame[:data.draw(st.integers(0, len(frame) - 1))]
    elif how == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(frame) - 1))
            frame[i] ^= data.draw(st.integers(1, 255))
    else:
        frame += data.draw(st.binary(min_size=1, max_size=64))
    peer = Peer(live)
    try:
        peer.handshake()
        peer.send(prelude + bytes(frame))
        peer.fin()
        if peer.wait_closed(CLOSE_S + 3) is None:  # a valid prefill may compute first
            _hang(f"stage 1 kept the connection after a {how} frame and a FIN")
        replies_are_frames(peer.received, live.hello.n_embd, handshake=False)
    finally:
        peer.close()


def _drip(peer: Peer, data: bytes, until: float) -> None:
    for i in range(len(data)):
        if time.monotonic() > until:
            return
        try:
            peer.sock.sendall(data[i:i + 1])
        except OSError:
            return
        time.sleep(0.1)


def test_stage_slow_drip_and_stalled_frames_before_the_handshake(live, canary):
    """A Hello a byte per 100 ms, or a prefix promising more than comes: closed at the handshake deadline."""
    TALLY["stage cases"] += 6
    hello = frame_bytes(live.hello)
    assert len(hello) * 0.1 > HANDSHAKE_S + 1  # the drip cannot finish in time
    peers = [Peer(live) for _ in range(6)]
    closed: list = [None] * len(peers)
    start = time.monotonic()

    def run(i: int) -> None:
        peer = peers[i]
        if i < 3:
            threading.Thread(target=_drip, args=(peer, hello, start + HANDSHAKE_S + 3), daemon=True).start()
        else:  # a prefix claiming a whole Hello, then only part of it, then silence
            peer.send(hello[:PREFIX_SIZE + 10 * i])
        closed[i] = peer.wait_closed(HANDSHAKE_S + 3)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(peers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in peers:
        p.close()
    if any(c is None for c in closed):
        _hang(f"stage 1 kept stalled handshakes open past {HANDSHAKE_S + 3} s: {closed}")
    assert all(HANDSHAKE_S - 0.5 <= c <= HANDSHAKE_S + 1.5 for c in closed), closed


def test_stage_stalled_frame_after_the_handshake_is_dropped(live, canary):
    """A frame begun after the handshake and never finished (stalled, or a byte per 100 ms) is dropped at
    the stage's frame deadline (StageConfig.frame_timeout_s, 5 s, plus the frame's size at 1 MiB/s), well
    inside its idle deadline (600 s); the session the connection opened is released (the canary fixture
    checks)."""
    TALLY["stage cases"] += 2
    frames = _messages(live.hello.n_embd)
    peers = [Peer(live), Peer(live)]
    for p in peers:
        p.handshake()
        p.send(frames[0])  # ConfigureGeneration: stage 1 now holds a session for this connection
        p.read_frame()
    start = time.monotonic()
    threading.Thread(target=_drip, args=(peers[0], frames[2], start + 12), daemon=True).start()
    peers[1].send(frames[2][:PREFIX_SIZE + 40])  # a prefill chunk that stops after 40 bytes of its body
    closed = [None, None]

    def run(i: int) -> None:
        closed[i] = peers[i].wait_closed(10.0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in peers:
        p.close()  # so that the fixture sees the sessions released
    if any(c is None for c in closed):
        _hang(f"stage 1 kept stalled frames open past 10 s: {closed}")
    assert all(FRAME_S - 0.5 <= c <= FRAME_S + 2 for c in closed), closed


# ---------------------------------------------------------------------------- the control channel
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                      st.text(max_size=30))
JSON = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                    max_leaves=12)
REQUEST_TYPES = sorted({m._snake(c) for c in m.Request.__args__} - {"lanes_drain"})  # a drain would stop the canary
GENERATE_FIELDS = [f.name for f in attrs.fields(m.Generate) if f.name != "id"]


def _bounded(msg: dict) -> dict:
    """A generation asks for at most 4 tokens (the default is 256)."""
    if msg.get("type") == "generate":
        mt = msg.get("max_tokens", 256)
        if type(mt) is int and mt > 4:
            msg["max_tokens"] = 4
    return msg


EXTREME_INT = st.one_of(st.integers(-3, 70), st.sampled_from([-1, 0, 2**31 - 1, 2**31, 2**32, 2**63, 2**64, -2**63]),
                        st.integers(-2**70, 2**70))
EXTREME_FLOAT = st.one_of(st.floats(-3, 3), st.sampled_from([0.0, -0.0, 1e-300, 1e300, -1e300, float("inf"),
                                                             float("-inf")]))
SAMPLING_FIELDS = {"temperature": EXTREME_FLOAT, "top_k": EXTREME_INT, "top_p": EXTREME_FLOAT, "min_p": EXTREME_FLOAT,
                   "seed": st.one_of(st.none(), EXTREME_INT), "repeat_penalty": EXTREME_FLOAT,
                   "presence_penalty": EXTREME_FLOAT, "frequency_penalty": EXTREME_FLOAT,
                   "max_tokens": EXTREME_INT,
                   "stop": st.lists(st.one_of(st.just(""), st.text(max_size=6), st.text(min_size=500, max_size=600)),
                                    max_size=20),
                   "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant",
                                                                                        "tool", "", "x" * 100]),
                                                               "content": st.text(max_size=40)}), max_size=4),
                   "system": st.one_of(st.none(), st.text(max_size=40))}


@st.composite
def control_requests(draw) -> str:
    kind = draw(st.sampled_from(["garbled", "json", "typed", "generate", "extreme"]))
    if kind == "garbled":
        good = json.dumps({"type": "generate", "id": "x", "prompt": "hi", "max_tokens": 2})
        cut = draw(st.integers(0, len(good)))
        return draw(st.sampled_from([good[:cut], good[cut:], draw(st.text(max_size=200))]))
    if kind == "json":
        return json.dumps(draw(JSON))
    if kind == "extreme":  # every type right, values at and past the edges
        msg = {"type": "generate", "id": "e", "prompt": draw(st.text(max_size=40)), "raw": draw(st.booleans())}
        for name in draw(st.lists(st.sampled_from(sorted(SAMPLING_FIELDS)), max_size=5, unique=True)):
            msg[name] = draw(SAMPLING_FIELDS[name])
        return json.dumps(_bounded(msg), allow_nan=True)
    msg = {"type": draw(st.sampled_from(REQUEST_TYPES)) if kind == "typed" else "generate",
           "id": draw(st.one_of(st.text(max_size=8), JSON))}
    fields = GENERATE_FIELDS + ["session_id", "limit", "wait", "bogus"]
    for name in draw(st.lists(st.sampled_from(fields), max_size=4, unique=True)):
        msg[name] = draw(JSON)
    if kind == "generate":
        msg.setdefault("prompt", draw(st.text(max_size=40)))
        msg.setdefault("raw", draw(st.booleans()))
    return json.dumps(_bounded(msg), allow_nan=True)


async def _control_case(live: Live, text: str) -> list[m.Reply]:
    head = live.pipe.head
    async with open_control(head.url, head.token_file) as client:
        await client.ws.send_message(text)
        replies = []
        with trio.move_on_after(REPLY_S):
            while True:
                reply = m.parse_reply(await client.ws.get_message())
                replies.append(reply)
                if not isinstance(reply, m.Piece):
                    break
        # the connection still serves requests
        status = await client.call(m.Status(id="after"))
        assert status["role"] == "head"
        return replies


@settings(max_examples=250, **SETTINGS)
@given(text=control_requests())
def test_control_channel_garbage(live, canary, text):
    TALLY["control cases"] += 1
    replies = trio.run(_control_case, live, text)
    if not replies or isinstance(replies[-1], m.Piece):
        _hang(f"no final reply within {REPLY_S} s to {text[:200]!r}")
    final = replies[-1]
    if isinstance(final, m.Error):
        TALLY[f"control error {final.code}"] += 1
        assert final.code in ("bad_request", "not_found", "unavailable"), final
        assert "internal error" not in final.message, (text, final)
    else:
        TALLY[f"control {type(final).__name__.lower()}"] += 1


async def _huge(live: Live, payload) -> str:
    head = live.pipe.head
    try:
        async with open_control(head.url, head.token_file) as client:
            await client.ws.send_message(payload)
            with trio.fail_after(REPLY_S):
                while isinstance(reply := m.parse_reply(await client.ws.get_message()), m.Piece):
                    pass
            return f"{type(reply).__name__}: {getattr(reply, 'message', '')[:100]}"
    except ControlError as exc:
        return f"closed: {exc}"
    except Exception as exc:  # trio-websocket: the server closed the connection (message too big)
        return f"closed: {type(exc).__name__} {exc}"


def test_control_channel_huge_and_binary_messages(live, canary):
    cases = {
        "2 MiB of text": "x" * (2 << 20),
        "900 KiB prompt": json.dumps({"type": "generate", "id": "h", "prompt": "word " * 180_000,
                                      "raw": True, "max_tokens": 2}),
        "deep nesting": "[" * 100_000 + "]" * 100_000,
        "10k stop strings": json.dumps({"type": "generate", "id": "s", "prompt": "hi", "max_tokens": 2,
                                        "stop": ["x"] * 10_000}),
        "binary, not UTF-8": b"\xff\xfe" * 1000,
        "binary JSON": json.dumps({"type": "status", "id": "b"}).encode(),
    }
    got = {}
    for name, payload in cases.items():
        TALLY["control cases"] += 1
        got[name] = trio.run(_huge, live, payload)
    print(json.dumps(got, indent=1))
    assert got["2 MiB of text"].startswith("closed")  # over trio-websocket's 1 MiB message limit
    assert got["900 KiB prompt"].startswith("Error: the prompt has"), got
    assert got["deep nesting"].startswith("Error"), got
    assert got["binary, not UTF-8"].startswith("Error"), got
    assert got["binary JSON"].startswith("Data"), got
    assert got["10k stop strings"].startswith("Result"), got
    assert not any("internal error" in v for v in got.values()), got


# ---------------------------------------------------------------------------- the HTTP endpoint
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": st.one_of(st.text(max_size=40),
                                                      st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                      "text": st.text(max_size=20)}),
                                                               max_size=3))})
PARAMS = {  # right types; values in range, at the edges and past them
    "temperature": st.floats(-0.5, 2.5), "top_p": st.floats(-0.5, 1.5), "max_tokens": EXTREME_INT,
    "seed": EXTREME_INT, "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20)),
    "logit_bias": st.dictionaries(st.integers(-5, 60000).map(str), st.floats(-150, 150), max_size=3),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "n": st.integers(-1, 3), "top_k": EXTREME_INT, "min_p": st.floats(-1, 2), "repeat_penalty": st.floats(-1, 3),
    "user": st.text(max_size=10),
}
SCHEMA = st.one_of(  # good and bad schemas: the bad ones are 400s naming response_format.json_schema.schema
    st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    st.fixed_dictionaries({"type": st.sampled_from(["object", "array", "string", "integer", "boolean", "nope"])}),
    st.just({"enum": ["x", "y"]}), st.just({"type": "object", "if": {}}), JSON)
RESPONSE_FORMAT = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"),
                           "json_schema": st.fixed_dictionaries({"name": st.text(max_size=8), "schema": SCHEMA},
                                                                optional={"strict": st.booleans()})}))
CHAT_GOOD = st.fixed_dictionaries({"model": st.just(MODEL_ID), "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
                                  optional={**PARAMS, "max_completion_tokens": EXTREME_INT,
                                            "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 22),
                                            "response_format": RESPONSE_FORMAT})
COMPLETION_GOOD = st.fixed_dictionaries({"model": st.just(MODEL_ID),
                                         "prompt": st.one_of(st.text(max_size=60),
                                                             st.lists(st.integers(-10, 60000), max_size=20),
                                                             st.lists(st.text(max_size=10), min_size=1, max_size=2))},
                                        optional={**PARAMS, "echo": st.booleans(), "best_of": st.integers(0, 3),
                                                  "suffix": st.text(max_size=5), "logprobs": st.integers(-1, 22),
                                                  "response_format": RESPONSE_FORMAT})


@st.composite
def broken(draw, good):
    """A good body with one field replaced by any JSON value, or one unknown key added."""
    body = draw(good)
    key = draw(st.one_of(st.sampled_from(sorted(body)), st.text(max_size=12)))
    body[key] = draw(JSON)
    return body


CHAT = st.one_of(CHAT_GOOD, CHAT_GOOD, broken(CHAT_GOOD))
COMPLETION = st.one_of(COMPLETION_GOOD, COMPLETION_GOOD, broken(COMPLETION_GOOD))


def _bounded_http(body, chat: bool):
    """At most 4 tokens: a small max_tokens where it is absent or larger (chat's default is the context)."""
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        if type(body.get(key)) is int and body[key] > 4:
            body[key] = 4
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:  # absent or null: no limit
        body["max_tokens"] = 3
    return body


def _check_http(client: httpx2.Client, path: str, body) -> None:
    data = json.dumps(body).encode() if not isinstance(body, bytes) else body
    started = time.monotonic()
    try:
        with client.stream("POST", path, content=data, headers={"content-type": "application/json"}) as r:
            raw = b"".join(r.iter_bytes())
    except httpx2.TimeoutException:
        _hang(f"POST {path} {data[:300]!r}")
    took = time.monotonic() - started
    TALLY[f"http {r.status_code}"] += 1
    assert r.status_code != 500 and r.status_code < 502, (r.status_code, data[:400], raw[:400])
    assert took < REPLY_S
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
    elif r.status_code == 200:
        assert json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err


@pytest.fixture(scope="module")
def http(live):
    with httpx2.Client(base_url=live.http, timeout=REPLY_S) as client:
        yield client


@settings(max_examples=150, **SETTINGS)
@given(body=st.one_of(CHAT, JSON, st.binary(max_size=100)))
def test_http_chat_completions_fuzz(live, canary, http, body):
    TALLY["http cases"] += 1
    _check_http(http, "/v1/chat/completions", _bounded_http(body, True))


@settings(max_examples=150, **SETTINGS)
@given(body=st.one_of(COMPLETION, JSON, st.binary(max_size=100)))
def test_http_completions_fuzz(live, canary, http, body):
    TALLY["http cases"] += 1
    _check_http(http, "/v1/completions", _bounded_http(body, False))


def test_http_odd_bodies(live, canary, http):
    """Bodies no generator writes: too deep, too big, not UTF-8, empty; each a 4xx in OpenAI's error shape."""
    cases = {
        "deep nesting": (b"[" * 100_000 + b"]" * 100_000, 400),
        "deep nesting in a field": (json.dumps({"model": MODEL_ID, "prompt": "hi"})[:-1].encode()
                                    + b', "user": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400),
        "5 MiB": (b'{"model": "' + b"x" * (5 << 20) + b'"}', 413),
        "not UTF-8": (b'{"model": "\xff\xfe"}', 400),
        "empty": (b"", 400),
        "NaN": (json.dumps({"model": MODEL_ID, "prompt": "hi", "temperature": float("nan")}).encode(), 400),
    }
    got = {}
    for name, (body, _want) in cases.items():  # on one keep-alive client: "5 MiB" must not break the next one
        TALLY["http cases"] += 1
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        got[name] = (r.status_code, r.json()["error"]["message"][:80], r.headers.get("connection"))
        TALLY[f"http {r.status_code}"] += 1
    assert {k: v[0] for k, v in got.items()} == {k: v[1] for k, v in cases.items()}, got
    assert got["5 MiB"][2] == "close", got
