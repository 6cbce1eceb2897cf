"""Activations on the wire as half floats: the codec, the native forward, the handshake's choice, the tokens.

With ``runtime.activation_wire = "f16"`` a lane carries f16 when both Hellos offer it and f32 otherwise
(the default, "auto", times each link and keeps f32 unless it is slow: tests/test_link_choice.py); a frame
with a value beyond half's range goes as f32 whatever the lane. The receiver widens
half floats back to float32 before its layers, so a stage computes what it always did, on inputs rounded
to half precision: greedy tokens then equal the f32 pipeline's except at a near-tie.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from skippyd.runtime.llama import Context, ContextParams, Model
from skippyd.wire.codec import (
    HALF_MAX,
    MESSAGE_HEADER_SIZE,
    PREFIX_SIZE,
    decode_frame,
    decode_hello,
    decode_step_head,
    encode_frame,
    encode_hello,
    frame_bytes,
)
from skippyd.wire.errors import ProtocolError
from skippyd.wire.messages import (
    DEFAULT_LIMITS,
    NO_TOKEN,
    Ack,
    DecodeStep,
    ErrorCode,
    Flags,
    Hello,
    MediaRows,
    PredictedToken,
    PrefillChunk,
    Stop,
    VerifyWindow,
    WireFormat,
    negotiate_wire,
    wire_formats,
)
from skippyd.wire.stream import ReceiveBuffer
from tests.procs import Pipeline, Stage0Driver, retarget, split_for_test
from tests.test_pipeline_processes import sent_at_compute_end

N_EMBD = 8
BOTH = WireFormat.F32 | WireFormat.F16


def rows(n: int, scale: float = 3.0, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, N_EMBD)) * scale).astype(np.float32)


def hello(**kw) -> Hello:
    return Hello(**{"fingerprint": bytes(32), "stage_index": 0, "layer_start": 0, "layer_end": 2, "n_layer": 4,
                    "n_embd": N_EMBD, **kw})


# ---------------------------------------------------------------------------------------------- the codec

MESSAGES = {
    "prefill": lambda act: PrefillChunk(1, 2, 0, np.arange(len(act)), act, final=True),
    "decode": lambda act: DecodeStep(1, 2, 7, [5], act[:1]),
    "decode-direct": lambda act: DecodeStep(1, 2, 7, [5], act[:1], direct_return=True),
    "verify": lambda act: VerifyWindow(1, 2, 7, np.arange(len(act)), act),
}


@pytest.mark.parametrize("kind", MESSAGES)
def test_half_frames_round_trip_at_half_the_bytes(kind):
    msg = MESSAGES[kind](rows(5))
    n_rows = len(msg.tokens)
    wide, half = frame_bytes(msg), b"".join(bytes(p) for p in encode_frame(msg, WireFormat.F16))
    assert len(wide) - len(half) == n_rows * N_EMBD * 2  # each value 2 bytes, not 4
    assert half[3] & Flags.F16 and not wide[3] & Flags.F16
    got = decode_frame(half, n_embd=N_EMBD)
    assert type(got) is type(msg) and np.array_equal(got.tokens, msg.tokens)
    assert got.activation.dtype == np.float32  # widened before anyone computes with it
    assert np.array_equal(got.activation, msg.activation.astype(np.float16).astype(np.float32))
    assert decode_frame(wide, n_embd=N_EMBD) == msg  # a float32 lane is unchanged, bit for bit


def test_an_images_rows_travel_as_half_floats_with_their_positions():
    pos = np.array([[10] * 6, [10, 10, 10, 11, 11, 11], [10, 11, 12, 10, 11, 12], [0] * 6])
    act = rows(6)
    msg = PrefillChunk(1, 2, 10, [NO_TOKEN] * 6, act, media=MediaRows(pos, 13, [-1, -2, -3], causal=False))
    data = b"".join(bytes(p) for p in encode_frame(msg, WireFormat.F16))
    assert data[3] == Flags.POSITIONS | Flags.NON_CAUSAL | Flags.F16
    got = decode_frame(data, n_embd=N_EMBD)
    assert np.array_equal(got.media.positions, pos) and got.keys.tolist() == [-1, -2, -3] and not got.media.causal
    assert np.array_equal(got.activation, act.astype(np.float16).astype(np.float32))


async def test_a_half_decode_step_read_from_the_buffer_is_the_general_paths():
    msg = DecodeStep(3, 4, 9, [11], rows(1), direct_return=True)
    data = b"".join(bytes(p) for p in encode_frame(msg, WireFormat.F16))
    send, receive = trio.testing.memory_stream_pair()
    await send.send_all(data)
    buf = ReceiveBuffer(receive)
    await buf.wait_first_byte()
    assert buf.buffered == len(data)
    fast = buf.take_frame(DEFAULT_LIMITS, N_EMBD, None)  # decode_step_at's one unpack
    assert fast == decode_frame(data, n_embd=N_EMBD) and fast.direct_return
    assert np.array_equal(fast.activation, msg.activation.astype(np.float16).astype(np.float32))


def test_a_frame_with_a_value_beyond_half_range_goes_as_float32():
    act = rows(3)
    act[0, 2] = HALF_MAX * 1.5  # a first token's row of some models (Gemma 3: 8e4)
    msg = MESSAGES["prefill"](act)
    data = b"".join(bytes(p) for p in encode_frame(msg, WireFormat.F16))
    assert not data[3] & Flags.F16
    assert decode_frame(data, n_embd=N_EMBD) == msg  # bit for bit
    act[0, 2] = math.nan
    assert not b"".join(bytes(p) for p in encode_frame(MESSAGES["prefill"](act), WireFormat.F16))[3] & Flags.F16
    act[0, 2] = HALF_MAX  # the largest half float itself fits
    assert b"".join(bytes(p) for p in encode_frame(MESSAGES["prefill"](act), WireFormat.F16))[3] & Flags.F16


def test_the_prepared_decode_head_is_the_encoders():
    msg = DecodeStep(3, 4, 9, [11], rows(1))
    half = b"".join(bytes(p) for p in encode_frame(msg, WireFormat.F16))
    head = decode_step_head(3, 4, 9, 11, False, N_EMBD * 2, f16=True)
    assert half.startswith(head) and len(half) == len(head) + N_EMBD * 2


def _set_flags(data: bytes, flags: int) -> bytes:
    return data[:3] + bytes([flags]) + data[4:]


def test_half_frames_that_do_not_add_up_are_refused():
    msg = MESSAGES["prefill"](rows(2))
    wide = frame_bytes(msg)
    with pytest.raises(ProtocolError) as err:  # F16 claimed over float32 bytes
        decode_frame(_set_flags(wide, wide[3] | Flags.F16), n_embd=N_EMBD)
    assert err.value.code == ErrorCode.LENGTH_MISMATCH
    bare = frame_bytes(PrefillChunk(1, 2, 0, [1, 2], None))
    with pytest.raises(ProtocolError) as err:  # F16 on a chunk without an activation
        decode_frame(_set_flags(bare, bare[3] | Flags.F16), n_embd=N_EMBD)
    assert err.value.code == ErrorCode.BAD_FLAGS
    stop = frame_bytes(Stop(1, 2))
    with pytest.raises(ProtocolError) as err:  # F16 where no activation may travel
        decode_frame(_set_flags(stop, Flags.F16), n_embd=N_EMBD)
    assert err.value.code == ErrorCode.BAD_FLAGS


# ---------------------------------------------------------------------------------------------- the Hello


@pytest.mark.parametrize("formats", [WireFormat.F32, BOTH])
def test_the_hello_carries_the_encodings_offered(formats):
    h = hello(wire_formats=formats)
    assert decode_hello(encode_hello(h)[PREFIX_SIZE:]) == h


@pytest.mark.parametrize("byte", [0x00, 0x02, 0x04, 0x06, 0x08, 0x0F])
def test_a_hello_without_float32_or_with_an_unknown_encoding_is_refused(byte):
    body = bytearray(encode_hello(hello())[PREFIX_SIZE:])
    body[7] = byte
    with pytest.raises(ProtocolError) as err:
        decode_hello(bytes(body))
    assert err.value.code == ErrorCode.BAD_VALUE and "wire formats" in err.value.message


def test_the_lane_takes_half_floats_only_when_both_ends_offer_them():
    f32, f16 = hello(wire_formats=wire_formats("f32")), hello(wire_formats=wire_formats("f16"))
    assert negotiate_wire(f16, f16) == WireFormat.F16
    assert negotiate_wire(f16, f32) == negotiate_wire(f32, f16) == negotiate_wire(f32, f32) == WireFormat.F32
    with pytest.raises(ValueError, match="activation_wire"):
        wire_formats("q8")


# ---------------------------------------------------------------------------------------------- native


def test_the_native_forward_writes_the_row_as_numpy_rounds_it(tiny_model_path, tmp_path):
    """A decode step's frame filled by the compute itself (half floats) holds the row's values as
    numpy's conversion rounds them: the general path's frame, byte for byte."""
    topo = split_for_test(tiny_model_path, 2, tmp_path)
    with Model(topo.stage(0).file) as model:
        ctx = Context(model, ContextParams(n_ctx_per_seq=64, n_seq_max=1, n_threads=1))
        try:
            n = ctx.n_embd
            for pos, token in enumerate((1, 42, 7)):
                head = decode_step_head(1, 2, pos, token, False, 2 * n, f16=True)
                frame = bytearray(len(head) + 2 * n)
                frame[:len(head)] = head
                _sent, done_ns = ctx.decode_row_send(pos, 0, frame, len(head), token=token)
                assert done_ns  # filled (a random model's rows are well inside half's range)
                row = ctx.hidden()
                msg = DecodeStep(1, 2, pos, [token], row)
                assert bytes(frame) == b"".join(bytes(p) for p in encode_frame(msg, WireFormat.F16))
        finally:
            ctx.close()


# ---------------------------------------------------------------------------------------------- live

NEAR_TIE = 0.25  # the rounding band of tests/test_speculative.py: batch against single rows
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):\n    if n < 2:\n        return n\n"]


@pytest.fixture(scope="module")
def split2(default_model_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("wire2")
    split_for_test(default_model_path, 2, work)
    return work


def _final_stage(split2, tmp_path_factory, wire: str) -> Pipeline:
    work = tmp_path_factory.mktemp(f"final-{wire}")
    pipe = Pipeline(retarget(split2 / "topology.toml", work), work, config={"runtime.activation_wire": wire})
    pipe.start_stage(1)
    return pipe


@pytest.fixture(scope="module")
def final_f16(split2, tmp_path_factory):
    pipe = _final_stage(split2, tmp_path_factory, "f16")
    yield pipe
    pipe.stop()


@pytest.fixture(scope="module")
def final_f32(split2, tmp_path_factory):
    pipe = _final_stage(split2, tmp_path_factory, "f32")
    yield pipe
    pipe.stop()


async def _step_bytes(pipe: Pipeline, offered: WireFormat) -> tuple[WireFormat, int, list[int]]:
    """Dial stage 1 offering ``offered``: (the lane's encoding, a decode step's frame bytes, 6 greedy tokens)."""
    driver = Stage0Driver(pipe.topology)
    try:
        link = await driver.connect(attrs.evolve(driver.hello, wire_formats=offered))
        try:
            assert isinstance(await driver.configure(link, 5), Ack)
            prompt = driver.tokenize(PROMPTS[0])
            reply = await driver.send_prefill(link, 5, prompt, chunk=4)
            assert isinstance(reply, PredictedToken), reply
            tokens, pos = [int(reply.token)], len(prompt)
            step_bytes = 0
            for _ in range(5):
                reply, step_bytes, *_ = await link.request(driver.decode_msg(5, tokens[-1], pos))
                assert isinstance(reply, PredictedToken), reply
                tokens.append(int(reply.token))
                pos += 1
            await driver.stop(link, 5)
            return link.wire, step_bytes, tokens
        finally:
            await link.aclose()
    finally:
        driver.close()


@pytest.mark.slow
async def test_the_handshake_picks_half_floats_only_when_both_offer_them(final_f16, final_f32):
    n_embd = final_f16.topology.n_embd
    wide = PREFIX_SIZE + MESSAGE_HEADER_SIZE + 4 + 4 * n_embd  # a decode step: prefix, header, token, row
    half = wide - 2 * n_embd
    wire, step, f16_tokens = await _step_bytes(final_f16, BOTH)
    assert (wire, step) == (WireFormat.F16, half)
    # a dialer that keeps to float32 (activation_wire = "f32"), and an acceptor that does: float32, cleanly
    wire, step, f32_tokens = await _step_bytes(final_f16, WireFormat.F32)
    assert (wire, step) == (WireFormat.F32, wide)
    wire, step, tokens = await _step_bytes(final_f32, BOTH)
    assert (wire, step, tokens) == (WireFormat.F32, wide, f32_tokens)
    assert f16_tokens == f32_tokens  # this prompt has no near-tie in its first tokens


def f32_and_f16(topology: Path, tmp_path_factory, tag: str):
    """The split at `topology` started twice: activations as f32, and as f16 (forced); stopped after."""
    pipes = {}
    try:
        for wire in ("f32", "f16"):
            work = tmp_path_factory.mktemp(f"{tag}-{wire}")
            pipes[wire] = Pipeline(retarget(topology, work), work, config={"runtime.activation_wire": wire}).start()
        yield pipes
    finally:
        for p in pipes.values():
            p.stop_cleanly()


@pytest.fixture(scope="module")
def pipelines(split2, tmp_path_factory):
    """The same 2-stage split run twice: activations as f32, and as f16."""
    yield from f32_and_f16(split2 / "topology.toml", tmp_path_factory, "pipe")


@pytest.fixture(scope="module")
def pipelines3(default_model_path, tmp_path_factory):
    """3 stages (a middle stage forwards, predictions return directly): f32 and f16."""
    split = tmp_path_factory.mktemp("wire3")
    split_for_test(default_model_path, 3, split)
    yield from f32_and_f16(split / "topology.toml", tmp_path_factory, "pipe3")


async def assert_same_but_near_ties(pipes: dict[str, Pipeline], prompt: str) -> None:
    kw = dict(prompt=prompt, raw=True, max_tokens=32, logprobs=2)
    want = await pipes["f32"].generate(**kw)
    got = await pipes["f16"].generate(**kw)
    for i, (a, b) in enumerate(zip(got["tokens"], want["tokens"])):
        if a != b:
            top = want["logprobs"][i]["top"]
            margin = top[0][1] - top[1][1]
            assert margin <= NEAR_TIE, (prompt, i, a, b, margin)
            return
    assert got["tokens"] == want["tokens"], prompt


@pytest.mark.slow
async def test_greedy_tokens_on_half_floats_equal_float32s_but_at_near_ties(pipelines):
    for prompt in PROMPTS:
        await assert_same_but_near_ties(pipelines, prompt)


@pytest.mark.slow
async def test_three_stages_forward_half_floats_from_the_middle(pipelines3):
    """The middle stage's forward is half floats too, written by its compute; the tokens as on two stages."""
    before = await sent_at_compute_end(pipelines3["f16"])
    await assert_same_but_near_ties(pipelines3, PROMPTS[1])
    got = {wire: await pipe.generate(prompt=PROMPTS[2], raw=True, max_tokens=16)
           for wire, pipe in pipelines3.items()}
    sent = {wire: r["stage_stats"]["bytes_sent"] for wire, r in got.items()}
    assert 0.45 < sent["f16"] / sent["f32"] < 0.55, sent  # both links' rows
    grown = [a - b for a, b in zip(await sent_at_compute_end(pipelines3["f16"]), before)]
    # the head's and the middle stage's forwards: at least the steps of the last generation (the final stage's
    # own answers, logits and no activation, leave natively only without logprobs)
    assert all(g >= 15 for g in grown[:2]), grown


@pytest.mark.slow
async def test_half_floats_halve_the_bytes_of_a_generation(pipelines):
    kw = dict(prompt=PROMPTS[1] * 4, raw=True, max_tokens=16)
    before = await sent_at_compute_end(pipelines["f16"])
    got = {wire: await pipe.generate(**kw) for wire, pipe in pipelines.items()}
    # the half-float rows still leave from native code as each step's compute ends, on both stages
    steps = got["f16"]["usage"]["completion_tokens"] - 1
    grown = [a - b for a, b in zip(await sent_at_compute_end(pipelines["f16"]), before)]
    assert all(steps // 2 <= g <= steps for g in grown), (grown, steps)
    sent = {wire: r["stage_stats"]["bytes_sent"] for wire, r in got.items()}
    rows = got["f32"]["usage"]["prompt_tokens"] + got["f32"]["usage"]["completion_tokens"] - 1
    assert sent["f32"] >= 4 * pipelines["f32"].topology.n_embd * rows  # each row crossed once, as float32
    assert 0.45 < sent["f16"] / sent["f32"] < 0.55, sent  # and as half floats: the rows are nearly all of it
