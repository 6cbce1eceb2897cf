"""The stage protocol's pure codec: round trips, layout, limits, validation, check_hello."""

from __future__ import annotations

import math
import struct

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from skippyd.sampling import CONSTRAINT_KINDS, MAX_TOP_LOGPROBS, Constraint
from skippyd.wire import codec
from skippyd.wire.codec import (
    MESSAGE_HEADER_SIZE,
    PREFIX_SIZE,
    REPLY_HEADER_SIZE,
    decode_body,
    decode_frame,
    decode_step_head,
    encode_frame,
    encode_message,
    error_reply_for,
    frame_bytes,
    hello_version,
    parse_message_header,
    parse_prefix,
)
from skippyd.wire.errors import ProtocolError
from skippyd.wire.handshake import check_hello
from skippyd.wire.messages import (
    DEFAULT_LIMITS,
    MAX_ACTIVATION_BYTES,
    MAX_CACHE_REPORT_STAGES,
    MAX_LOGIT_BIAS,
    MAX_TOKENS,
    NO_TOKEN,
    PROTOCOL_VERSION,
    Ack,
    CacheQuery,
    CacheReport,
    CacheStats,
    ConfigureGeneration,
    DecodeStep,
    ErrorCode,
    ErrorReply,
    Flags,
    Hello,
    HelloReply,
    Limits,
    MediaRows,
    MessageKind,
    Ping,
    PredictedToken,
    PredictedTokenLogprobs,
    PredictedTokens,
    PrefillChunk,
    PrefixRestored,
    ReplyKind,
    RestorePrefix,
    Role,
    SamplingParams,
    StageLoad,
    StageQuery,
    StageReport,
    StageStats,
    StatsTotal,
    Stop,
    Stopped,
    TrimSession,
    VerifyWindow,
    merge,
    merge_all,
    with_stats,
)

FP = bytes(range(32))
OTHER_FP = bytes(32)
U64 = 2**64 - 1

# --------------------------------------------------------------------------
# strategies

ids = st.integers(0, U64)
positions = st.integers(0, 2**24)
token_ids = st.integers(-(2**31), 2**31 - 1)
f32s = st.floats(width=32, allow_nan=False, allow_infinity=False)


def token_arrays(min_size: int, max_size: int):
    return st.lists(token_ids, min_size=min_size, max_size=max_size).map(lambda t: np.array(t, dtype="<i4"))


def activations(n: int, n_embd: int):
    # every bit pattern, NaN payloads included: the wire must be bit-exact
    return hnp.arrays(np.uint32, (n, n_embd)).map(lambda a: a.view("<f4"))


sampling_params = st.builds(
    SamplingParams,
    temperature=f32s,
    top_k=token_ids,
    top_p=f32s,
    min_p=f32s,
    repeat_penalty=f32s,
    presence_penalty=f32s,
    frequency_penalty=f32s,
    penalty_last_n=token_ids,
    seed=st.integers(0, 2**32 - 1),
    logit_bias=st.lists(
        st.tuples(token_ids, st.floats(width=32, allow_nan=False)), max_size=12
    ),
    # the generation extension: its text is not compiled on the wire (the final stage does), so any text
    constraint=st.one_of(st.none(), st.builds(Constraint, st.sampled_from(CONSTRAINT_KINDS), st.text(max_size=40))),
    logprobs=st.one_of(st.none(), st.integers(0, MAX_TOP_LOGPROBS)),
)


@st.composite
def token_messages(draw, n_embd: int):
    cls = draw(st.sampled_from([PrefillChunk, DecodeStep, VerifyWindow]))
    tokens = draw(token_arrays(1, 1 if cls is DecodeStep else 16))
    act = draw(st.none() | activations(len(tokens), n_embd))
    kwargs = {"final": draw(st.booleans())} if cls is PrefillChunk else {}
    if cls is DecodeStep:
        kwargs = {"direct_return": draw(st.booleans())}
    if cls is VerifyWindow:
        kwargs = {"chained": draw(st.booleans())}
    return cls(draw(ids), draw(ids), draw(positions), tokens, act, **kwargs)


@st.composite
def media_chunks(draw, n_embd: int):
    """A PrefillChunk of media rows: explicit positions (1 or 4 sections) from pos_start, the keys of the
    positions it takes, causal or not."""
    n = draw(st.integers(1, 12))
    start = draw(positions)
    sections = draw(st.sampled_from([1, 4]))
    pos = draw(hnp.arrays(np.int32, (sections, n), elements=st.integers(start, start + 40)))
    if sections == 4:
        pos[3] = draw(st.integers(0, 3))
    end = draw(st.integers(start, start + n))
    keys = draw(token_arrays(end - start, end - start))
    act = draw(st.none() | activations(n, n_embd))
    media = MediaRows(pos, end, keys, causal=draw(st.booleans()))
    return PrefillChunk(draw(ids), draw(ids), start, [NO_TOKEN] * n, act, final=draw(st.booleans()), media=media)


@st.composite
def restore_chunks(draw, n_embd: int):
    """A prompt's first chunk (position 0, text) carrying a restore block: the keys to look up first."""
    tokens = draw(token_arrays(1, 16))
    act = draw(st.none() | activations(len(tokens), n_embd))
    restore = draw(hnp.arrays(np.int32, st.integers(1, 40), elements=st.integers(-2**31, 2**31 - 1)))
    return PrefillChunk(draw(ids), draw(ids), 0, tokens, act, final=draw(st.booleans()), restore=restore)


def messages(n_embd: int):
    return st.one_of(
        token_messages(n_embd),
        media_chunks(n_embd),
        restore_chunks(n_embd),
        st.builds(ConfigureGeneration, ids, ids, sampling_params, st.booleans()),
        st.builds(TrimSession, ids, ids, positions),
        st.builds(Stop, ids, ids),
        st.builds(Ping, ids),
        st.builds(RestorePrefix, ids, ids, token_arrays(1, 16)),
        st.builds(CacheQuery, ids, st.booleans()),
        st.builds(StageQuery, ids),
    )


stage_stats = st.builds(
    StageStats,
    *[ids] * 6,
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
)

cache_stats = st.builds(CacheStats, st.integers(0, 2**32 - 1), *[ids] * 9, st.booleans(), *[ids] * 6)
stage_loads = st.builds(StageLoad, *[st.integers(0, 2**32 - 1)] * 4, *[ids] * 11)

replies = st.one_of(
    st.builds(Ack, ids, ids, stage_stats),
    st.builds(PredictedToken, ids, ids, token_ids, stage_stats),
    st.builds(PredictedTokens, ids, ids, token_arrays(0, 32), stage_stats),
    st.builds(PredictedTokenLogprobs, ids, ids, token_ids, stage_stats, st.floats(width=32, allow_nan=False),
              st.lists(st.tuples(token_ids, st.floats(width=32, allow_nan=False)), max_size=MAX_TOP_LOGPROBS)),
    st.builds(ErrorReply, ids, ids, st.sampled_from(ErrorCode), st.text(max_size=100), stage_stats),
    st.builds(PrefixRestored, ids, ids, st.integers(0, 2**32 - 1), stage_stats),
    st.builds(CacheReport, ids, ids, st.lists(cache_stats, max_size=6), stage_stats),
    st.builds(StageReport, ids, ids, st.lists(stage_loads, max_size=6), stage_stats),
    st.builds(Stopped, ids, ids, st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=6), stage_stats),
)

hellos = st.builds(
    Hello,
    fingerprint=st.binary(min_size=32, max_size=32),
    stage_index=st.integers(0, 2**32 - 1),
    layer_start=st.integers(0, 2**32 - 1),
    layer_end=st.integers(0, 2**32 - 1),
    n_layer=st.integers(0, 2**32 - 1),
    n_embd=st.integers(1, 65536),
    role=st.sampled_from(Role),
    auth=st.binary(max_size=64),
    node=st.text(max_size=60),
)

hello_replies = st.builds(HelloReply, st.booleans(), st.text(max_size=200))


# --------------------------------------------------------------------------
# round trips


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(n_embd=st.integers(1, 24), data=st.data())
def test_message_round_trip(n_embd, data):
    msg = data.draw(messages(n_embd))
    wire = frame_bytes(msg)
    decoded = decode_frame(bytearray(wire), n_embd=n_embd)
    assert decoded == msg
    assert type(decoded) is type(msg)
    assert frame_bytes(decoded) == wire


@settings(max_examples=100)
@given(n_embd=st.integers(1, 24), direct_return=st.booleans(), ids=st.tuples(*[st.integers(0, 2**64 - 1)] * 2),
       pos=st.integers(0, 2**31 - 2), token=st.integers(0, 2**31 - 1))
def test_decode_step_head_is_the_frame_before_its_activation(n_embd, direct_return, ids, pos, token):
    """The head a stage prepares before its compute, with the activation after it, is the frame the general
    encoder makes of that decode step."""
    act = np.arange(n_embd, dtype=np.float32).reshape(1, n_embd)
    step = DecodeStep(*ids, pos, np.array([token], dtype=np.int32), act, direct_return)
    wire = decode_step_head(*ids, pos, token, direct_return, act.nbytes) + act.tobytes()
    assert wire == b"".join(bytes(part) for part in encode_message(step))
    assert decode_frame(bytearray(wire), n_embd=n_embd) == step


@settings(max_examples=200)
@given(replies)
def test_reply_round_trip(reply):
    wire = frame_bytes(reply)
    decoded = decode_frame(wire)
    assert decoded == reply
    assert frame_bytes(decoded) == wire


@settings(max_examples=200)
@given(hellos)
def test_hello_round_trip(hello):
    assert decode_frame(frame_bytes(hello)) == hello


@settings(max_examples=100)
@given(hello_replies)
def test_hello_reply_round_trip(reply):
    assert decode_frame(frame_bytes(reply)) == reply


def test_activation_decodes_without_copy():
    act = np.arange(3 * 8, dtype="<f4").reshape(3, 8)
    wire = bytearray(frame_bytes(PrefillChunk(1, 2, 10, [1, 2, 3], act)))
    msg = decode_frame(wire, n_embd=8)
    assert np.shares_memory(msg.activation, np.frombuffer(wire, dtype=np.uint8))
    assert msg.activation.flags.writeable and msg.activation.shape == (3, 8)
    assert msg.activation.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(msg.activation, act)


def test_large_activation_is_sent_as_a_separate_view():
    n_embd = 576
    act = np.ones((64, n_embd), dtype="<f4")  # 147 KiB > COALESCE_BYTES
    parts = encode_frame(PrefillChunk(1, 2, 0, np.zeros(64, "<i4"), act))
    assert len(parts) == 2
    assert isinstance(parts[1], memoryview) and np.shares_memory(np.asarray(parts[1]), act)
    assert len(parts[0]) == PREFIX_SIZE + MESSAGE_HEADER_SIZE + 64 * 4
    small = encode_frame(DecodeStep(1, 2, 0, [5], np.ones((1, n_embd), "<f4")))
    assert len(small) == 1 and len(small[0]) == 8 + 32 + 4 + n_embd * 4  # 2348 B per decoded token


def test_golden_layout():
    """Pin the byte layout that skippy-protocol(7) documents."""
    msg = DecodeStep(0x0102030405060708, 9, 17, [-1], np.array([[1.0, -2.0]], dtype="<f4"))
    wire = frame_bytes(msg)
    assert wire == (
        b"SK\x12\x00" + struct.pack("<I", 32 + 4 + 8)
        + struct.pack("<QQiIIHH", 0x0102030405060708, 9, 17, 1, 8, 0, 0)
        + struct.pack("<i", -1)
        + struct.pack("<ff", 1.0, -2.0)
    )
    conf = frame_bytes(ConfigureGeneration(1, 2, SamplingParams(temperature=0.5, seed=7, logit_bias=[(3, -1.5)])))
    assert conf[:8] == b"SK\x10\x02" + struct.pack("<I", 32 + 36 + 8)
    assert conf[8 + 28 : 8 + 30] == struct.pack("<H", 1)  # bias_count
    assert struct.unpack_from("<f", conf, 40)[0] == 0.5 and struct.unpack_from("<I", conf, 72)[0] == 7
    assert conf[76:84] == struct.pack("<if", 3, -1.5)
    direct = frame_bytes(ConfigureGeneration(1, 2, SamplingParams(), direct_return=True))
    assert direct[3] == Flags.SAMPLING | Flags.DIRECT_RETURN
    ack = frame_bytes(Ack(5, 6, StageStats(1, 2, 3, 4, 5, 6, 7, 8)))
    stats = struct.pack("<QQQQQQII", 1, 2, 3, 4, 5, 6, 7, 8)
    assert ack == b"SK\x20\x00" + struct.pack("<I", 80) + struct.pack("<QQIHH", 5, 6, 0, 0, 0) + stats
    hello = frame_bytes(Hello(FP, 1, 10, 20, 30, 576, node="n"))
    assert hello[:4] == b"SK\x01\x00" and hello[8:14] == b"SKPY" + struct.pack("<H", PROTOCOL_VERSION)
    assert len(hello) == 8 + 64 + 1


def test_final_is_a_flag_on_prefill():
    wire = frame_bytes(PrefillChunk(1, 2, 0, [1], final=True))
    assert wire[2] == MessageKind.PREFILL and wire[3] == Flags.FINAL
    assert decode_frame(wire, n_embd=4).final


def test_tokens_only_messages_are_allowed():
    msg = decode_frame(frame_bytes(PrefillChunk(1, 2, 0, [1, 2])), n_embd=576)
    assert msg.activation is None and list(msg.tokens) == [1, 2]


def test_prefix_cache_frames_layout():
    """Pin the layout of the prefix cache's frames that skippy-protocol(7) documents."""
    restore = frame_bytes(RestorePrefix(7, 9, [5, -6]))
    assert restore == b"SK\x17\x00" + struct.pack("<I", 32 + 8) + header(7, 9, 0, 2) + struct.pack("<ii", 5, -6)
    assert frame_bytes(CacheQuery(3)) == b"SK\x18\x00" + struct.pack("<I", 32) + header(3, 0, 0, 0)
    assert frame_bytes(CacheQuery(3, clear=True))[:4] == b"SK\x18" + bytes([Flags.CLEAR])
    assert frame_bytes(CacheQuery(3, clear=True, clear_disk=True))[:4] == b"SK\x18" + bytes([Flags.CLEAR | 0x80])
    stats = StageStats(1, 2, 3, 4, 5, 6, 7, 8)
    packed_stats = struct.pack("<QQQQQQII", 1, 2, 3, 4, 5, 6, 7, 8)
    restored = frame_bytes(PrefixRestored(5, 6, 2**32 - 1, stats))
    assert restored == (b"SK\x24\x00" + struct.pack("<I", 84) + struct.pack("<QQIHH", 5, 6, 1, 0, 0) + packed_stats
                        + struct.pack("<I", 2**32 - 1))
    record = CacheStats(2, 512 << 20, 1000, 3, 250, 10, 4, 200, 300, 1, True, 4 << 30, 9000, 5, 700, 2, 6)
    report = frame_bytes(CacheReport(5, 0, [record, CacheStats(3)], stats))
    assert report == (b"SK\x25\x00" + struct.pack("<I", 80 + 256) + struct.pack("<QQIHH", 5, 0, 2, 0, 0)
                      + packed_stats + struct.pack("<IIQQQQQQQQQ", 2, 1, 512 << 20, 1000, 3, 250, 10, 4, 200, 300, 1)
                      + struct.pack("<QQQQQQ", 4 << 30, 9000, 5, 700, 2, 6)
                      + struct.pack("<IIQQQQQQQQQQQQQQQ", 3, 0, *[0] * 15))
    assert decode_frame(report).stages == (record, CacheStats(3))
    assert codec.CACHE_RECORD_SIZE == 128


def test_stage_query_and_report_layout():
    assert frame_bytes(StageQuery(3)) == b"SK\x1f\x00" + struct.pack("<I", 32) + header(3, 0, 0, 0)
    assert decode_frame(frame_bytes(StageQuery(3)), n_embd=8) == StageQuery(3)
    load = StageLoad(1, 15, 30, 4, 10**9, 5000, 40, 400, 2, 90, 2048, 1 << 20, 512 << 20, 300, 1200)
    report = frame_bytes(StageReport(7, 0, [load, StageLoad(2)]))
    assert report == (b"SK\x2f\x00" + struct.pack("<I", 80 + 208) + struct.pack("<QQIHH", 7, 0, 2, 0, 0)
                      + struct.pack("<QQQQQQII", *[0] * 8)
                      + struct.pack("<IIIIQQQQQQQQQQQ", 1, 15, 30, 4, 10**9, 5000, 40, 400, 2, 90, 2048, 1 << 20,
                                    512 << 20, 300, 1200)
                      + struct.pack("<IIIIQQQQQQQQQQQ", 2, *[0] * 14))
    assert decode_frame(report).stages == (load, StageLoad(2))
    assert codec.LOAD_RECORD_SIZE == 104
    with pytest.raises(ValueError):
        StageReport(1, 0, [StageLoad(0)] * (MAX_CACHE_REPORT_STAGES + 1))


def test_prefix_cache_messages_decode():
    msg = decode_frame(frame_bytes(RestorePrefix(1, 2, range(100))), n_embd=8)
    assert type(msg) is RestorePrefix and list(msg.tokens) == list(range(100)) and msg.tokens.dtype == np.dtype("<i4")
    assert decode_frame(frame_bytes(CacheQuery(4, clear=True)), n_embd=8) == CacheQuery(4, True)
    assert decode_frame(frame_bytes(CacheQuery(4)), n_embd=8) == CacheQuery(4, False)
    assert decode_frame(frame_bytes(CacheQuery(4, True, True)), n_embd=8) == CacheQuery(4, True, True)
    assert not hasattr(CacheQuery(4), "session_id")  # like Ping: the pipeline, not a session


def test_cache_report_of_the_most_records_round_trips():
    report = CacheReport(1, 0, [CacheStats(i, lookups=i, hits=i // 2) for i in range(MAX_CACHE_REPORT_STAGES)])
    wire = frame_bytes(report)
    assert len(wire) == 8 + 80 + 128 * MAX_CACHE_REPORT_STAGES
    assert decode_frame(wire) == report
    assert decode_frame(wire, accept=codec.REPLY_KINDS).stages[-1].stage_index == MAX_CACHE_REPORT_STAGES - 1


@given(stats=stage_stats, restored=st.integers(0, 2**32 - 1), records=st.lists(cache_stats, max_size=4))
def test_with_stats_rebuilds_the_prefix_cache_replies(stats, restored, records):
    for reply in (PrefixRestored(1, 2, restored), CacheReport(1, 0, records)):
        got = with_stats(reply, stats)
        assert type(got) is type(reply) and got.stats == stats
        assert attrs.evolve(got, stats=reply.stats) == reply
        assert decode_frame(frame_bytes(got)) == got


def test_cache_stats():
    s = CacheStats(1, budget_bytes=100, bytes_held=50, entries=2, tokens_held=40, lookups=8, hits=2,
                   restored_tokens=64, recorded_tokens=80, evictions=1)
    assert s.hit_rate == 0.25 and CacheStats(0).hit_rate == 0.0
    assert s.to_json() == {"stage_index": 1, "budget_bytes": 100, "bytes_held": 50, "entries": 2, "tokens_held": 40,
                           "lookups": 8, "hits": 2, "restored_tokens": 64, "recorded_tokens": 80, "evictions": 1,
                           "disk_on": False, "disk_budget_bytes": 0, "disk_bytes": 0, "disk_entries": 0,
                           "disk_tokens": 0, "disk_hits": 0, "disk_writes": 0, "hit_rate": 0.25, "memory_hits": 2}
    assert [f.name for f in attrs.fields(CacheStats)] == [
        "stage_index", "budget_bytes", "bytes_held", "entries", "tokens_held", "lookups", "hits", "restored_tokens",
        "recorded_tokens", "evictions", "disk_on", "disk_budget_bytes", "disk_bytes", "disk_entries", "disk_tokens",
        "disk_hits", "disk_writes"]
    for bad in (dict(stage_index=2**32), dict(stage_index=-1), dict(stage_index=0, evictions=2**64),
                dict(stage_index=0, hits=-1), dict(stage_index=0, lookups=1.0), dict(stage_index=True)):
        with pytest.raises(ValueError):
            CacheStats(**bad)


# --------------------------------------------------------------------------
# decoding garbage only ever raises ProtocolError


@settings(max_examples=1000)
@given(st.binary(max_size=200), st.sampled_from([None, 4]))
def test_random_bytes_raise_protocol_error(data, n_embd):
    try:
        decode_frame(data, n_embd=n_embd)
    except ProtocolError:
        pass


@settings(max_examples=500)
@given(data=st.data())
def test_mutated_frames_raise_protocol_error_or_decode(data):
    n_embd = 4
    frame = bytearray(frame_bytes(data.draw(st.one_of(messages(n_embd), replies, hellos, hello_replies))))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    try:
        decode_frame(frame[:cut], n_embd=n_embd)
    except ProtocolError:
        pass


# --------------------------------------------------------------------------
# the one-unpack decode of a decode step (every stage after the head, every token)


def mangled(data, wire: bytes) -> tuple[bytearray, int, bytes, int, bytes]:
    """`wire` with up to 4 bytes changed, cut short (or followed by more bytes), after a few bytes that came
    before it in a receive buffer: (the frame, how many changes, the lead, where it is cut, the buffer)."""
    frame = bytearray(wire)
    mutations = data.draw(st.integers(0, 4))
    for _ in range(mutations):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    lead, rest = data.draw(st.binary(max_size=3)), data.draw(st.binary(max_size=8))
    cut = data.draw(st.integers(0, len(frame)))
    return frame, mutations, lead, cut, lead + bytes(frame[:cut]) + (rest if cut == len(frame) else b"")


@settings(max_examples=1000, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_one_unpack_decode_step_is_the_general_decode_or_declines(data):
    """decode_step_at either declines (None) or returns exactly what decode_frame makes of the frame."""
    n_embd = data.draw(st.integers(1, 8))
    limits = data.draw(st.sampled_from([DEFAULT_LIMITS, Limits(max_tokens=1), Limits(max_activation_bytes=16),
                                        Limits(max_frame_bytes=64)]))
    step = DecodeStep(data.draw(ids), data.draw(ids), data.draw(positions), data.draw(token_arrays(1, 1)),
                      data.draw(activations(1, n_embd)), data.draw(st.booleans()))
    frame, mutations, lead, cut, buf = mangled(data, frame_bytes(data.draw(st.one_of(st.just(step),
                                                                                     messages(n_embd)))))
    fast = codec.decode_step_at(buf, len(lead), n_embd, limits)
    if fast is None:
        # it declines only what it may: a valid, whole decode step within the limits is always its own
        assert mutations or cut < len(frame) or frame != frame_bytes(step) or limits is not DEFAULT_LIMITS
        return
    got, end = fast
    assert end == len(lead) + len(frame) and cut == len(frame)
    want = decode_frame(buf[len(lead):end], n_embd=n_embd, limits=limits)
    assert type(got) is type(want) is DecodeStep
    assert ((got.request_id, got.session_id, got.pos_start, got.direct_return)
            == (want.request_id, want.session_id, want.pos_start, want.direct_return))
    for a, b in ((got.tokens, want.tokens), (got.activation, want.activation)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        assert a.flags.writeable


@settings(max_examples=1000, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_one_unpack_reply_is_the_general_decode_or_declines(data):
    """decode_reply_at either declines (None) or returns exactly what decode_frame makes of the frame."""
    limits = data.draw(st.sampled_from([DEFAULT_LIMITS, Limits(max_frame_bytes=64)]))
    accept = data.draw(st.sampled_from([None, codec.REPLY_KINDS, frozenset({ReplyKind.ACK}),
                                        frozenset({ReplyKind.PREDICTED_TOKEN})]))
    reply = data.draw(st.one_of(st.builds(Ack, ids, ids, stage_stats),
                                st.builds(PredictedToken, ids, ids, token_ids, stage_stats), replies))
    frame, mutations, lead, cut, buf = mangled(data, frame_bytes(reply))
    fast = codec.decode_reply_at(buf, len(lead), limits, accept)
    if fast is None:
        # it declines only what it may: a whole, valid ack or prediction that is accepted is always its own
        assert (mutations or cut < len(frame) or type(reply) not in (Ack, PredictedToken)
                or limits is not DEFAULT_LIMITS or accept is not None and reply.kind not in accept)
        return
    got, end = fast
    assert end == len(lead) + len(frame) and cut == len(frame)
    want = decode_frame(buf[len(lead):end], limits=limits, accept=accept)
    assert type(got) is type(want) and type(got) in (Ack, PredictedToken)
    assert got == want


@given(stats=stage_stats, token=token_ids, first=ids, second=ids, pos=positions, data=st.data())
def test_trusted_builders_make_what_the_constructors_make(stats, token, first, second, pos, data):
    """Each TRUSTED builder takes the class's fields in the constructor's order and makes an equal instance
    (frozen as the constructor's are)."""
    tokens, act = data.draw(token_arrays(1, 1)), data.draw(activations(1, 4))
    cases = [(StageStats, attrs.astuple(stats)), (Ack, (first, second, stats)),
             (PredictedToken, (first, second, token, stats)),
             (DecodeStep, (first, second, pos, tokens, act, data.draw(st.booleans()))),
             (PrefillChunk, (first, second, pos, tokens, act, True, None, None)),
             (VerifyWindow, (first, second, pos, tokens, act, True))]
    assert {cls for cls, _ in cases} == set(codec.TRUSTED)
    for cls, values in cases:
        built = codec.TRUSTED[cls](*values)
        assert type(built) is cls and built == cls(*values)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(built, attrs.fields(cls)[0].name, 1)


@given(data=st.data())
def test_one_pack_encoding_of_the_per_token_frames_is_the_general_encoding(data):
    """encode_frame packs a one-token decode step, an ack and a prediction in one go: byte for byte what
    encode_message / encode_reply make of them."""
    n_embd = data.draw(st.integers(1, 8))
    step = DecodeStep(data.draw(ids), data.draw(ids), data.draw(positions), data.draw(token_arrays(1, 1)),
                      data.draw(activations(1, n_embd)), data.draw(st.booleans()))
    for obj, general in ((step, codec.encode_message), (data.draw(replies), codec.encode_reply)):
        assert b"".join(bytes(p) for p in encode_frame(obj)) == b"".join(bytes(p) for p in general(obj))


# --------------------------------------------------------------------------
# limits, checked on the prefix / header before anything is allocated


def prefix(kind: int, body_len: int, flags: int = 0) -> bytes:
    return b"SK" + bytes([kind, flags]) + struct.pack("<I", body_len)


def header(request_id=1, session_id=2, pos=0, n_tokens=1, act_bytes=0, bias=0, reserved=0) -> bytes:
    return struct.pack("<QQiIIHH", request_id, session_id, pos, n_tokens, act_bytes, bias, reserved)


def code_of(fn, *args, **kwargs) -> ErrorCode:
    with pytest.raises(ProtocolError) as info:
        fn(*args, **kwargs)
    return info.value.code


def test_frame_too_large_from_prefix_alone():
    assert code_of(parse_prefix, prefix(MessageKind.PREFILL, 2**32 - 1), n_embd=576) == ErrorCode.FRAME_TOO_LARGE
    assert code_of(parse_prefix, prefix(ReplyKind.ERROR, 80 + 4097)) == ErrorCode.FRAME_TOO_LARGE
    assert code_of(parse_prefix, prefix(ReplyKind.ACK, 81)) == ErrorCode.FRAME_TOO_LARGE
    too_many = prefix(ReplyKind.PREDICTED_TOKENS, REPLY_HEADER_SIZE + 4 * MAX_TOKENS + 4)
    assert code_of(parse_prefix, too_many) == ErrorCode.FRAME_TOO_LARGE
    too_wide = prefix(MessageKind.DECODE, 32 + 4 + 4 * 576 + 1)
    assert code_of(parse_prefix, too_wide, n_embd=576) == ErrorCode.FRAME_TOO_LARGE
    assert code_of(parse_prefix, prefix(MessageKind.STOP, 33), n_embd=576) == ErrorCode.FRAME_TOO_LARGE
    assert code_of(parse_prefix, prefix(0x01, 5000)) == ErrorCode.FRAME_TOO_LARGE  # hello
    assert code_of(parse_prefix, prefix(ReplyKind.ACK, 79)) == ErrorCode.LENGTH_MISMATCH
    tight = Limits(max_frame_bytes=1000)
    assert code_of(parse_prefix, prefix(MessageKind.PREFILL, 1000), tight, n_embd=4) == ErrorCode.FRAME_TOO_LARGE


def test_counts_over_limits_rejected_from_header_alone():
    n_embd = 576
    huge = MAX_TOKENS + 1
    p = codec.FramePrefix(MessageKind.PREFILL, 0, 32 + 4 * huge)
    assert code_of(parse_message_header, p, header(n_tokens=huge), DEFAULT_LIMITS, n_embd) == ErrorCode.LIMIT_EXCEEDED
    p = codec.FramePrefix(MessageKind.PREFILL, 0, 1000)
    act = MAX_ACTIVATION_BYTES + 4
    assert code_of(parse_message_header, p, header(act_bytes=act), DEFAULT_LIMITS, n_embd) == ErrorCode.LIMIT_EXCEEDED
    p = codec.FramePrefix(MessageKind.CONFIGURE_GENERATION, Flags.SAMPLING, 1000)
    bias = MAX_LOGIT_BIAS + 1
    h = header(n_tokens=0, bias=bias)
    assert code_of(parse_message_header, p, h, DEFAULT_LIMITS, n_embd) == ErrorCode.LIMIT_EXCEEDED
    tight = Limits(max_tokens=16)
    p = codec.FramePrefix(MessageKind.PREFILL, 0, 32 + 4 * 17)
    assert code_of(parse_message_header, p, header(n_tokens=17), tight, n_embd) == ErrorCode.LIMIT_EXCEEDED
    assert code_of(decode_frame, frame_bytes(PrefillChunk(1, 2, 0, range(17))), n_embd=4, limits=tight) in (
        ErrorCode.FRAME_TOO_LARGE,
        ErrorCode.LIMIT_EXCEEDED,
    )


def test_limits_only_tighten():
    with pytest.raises(ValueError):
        Limits(max_tokens=MAX_TOKENS + 1)
    with pytest.raises(ValueError):
        Limits(max_activation_bytes=MAX_ACTIVATION_BYTES + 1)
    Limits(max_tokens=512, max_n_embd=4096)


def test_oversized_hello_fields_rejected():
    body = bytearray(frame_bytes(Hello(FP, 0, 0, 1, 2, 8))[8:])
    struct.pack_into("<H", body, 60, 65)  # auth_len > 64
    assert code_of(decode_frame, prefix(0x01, len(body)) + body) == ErrorCode.LIMIT_EXCEEDED
    assert code_of(decode_frame, frame_bytes(Hello(FP, 0, 0, 1, 2, 8192)), limits=Limits(max_n_embd=4096)) == (
        ErrorCode.LIMIT_EXCEEDED
    )


# --------------------------------------------------------------------------
# length and value checks


def test_activation_length_must_match_tokens_times_n_embd():
    good = bytearray(frame_bytes(PrefillChunk(1, 2, 0, [1, 2], np.zeros((2, 8), "<f4"))))
    # same frame read with a different n_embd
    assert code_of(decode_frame, good, n_embd=16) == ErrorCode.LENGTH_MISMATCH
    assert code_of(decode_frame, good, n_embd=4) == ErrorCode.LENGTH_MISMATCH
    # activation_bytes off by 4 (and body_len adjusted to match)
    bad = bytearray(good)
    struct.pack_into("<I", bad, 8 + 24, 2 * 8 * 4 - 4)
    struct.pack_into("<I", bad, 4, len(bad) - 8 - 4)
    with pytest.raises(ProtocolError) as info:
        decode_frame(bad[:-4], n_embd=8)
    assert info.value.code == ErrorCode.LENGTH_MISMATCH
    assert "expected 2 x 8 x 4 = 64" in info.value.message
    assert (info.value.request_id, info.value.session_id) == (1, 2)


def test_body_length_must_match_header():
    wire = bytearray(frame_bytes(PrefillChunk(1, 2, 0, [1, 2])))
    struct.pack_into("<I", wire, 4, len(wire) - 8 + 4)
    assert code_of(decode_frame, wire + b"\0" * 4, n_embd=8) == ErrorCode.LENGTH_MISMATCH
    assert code_of(decode_frame, wire, n_embd=8) == ErrorCode.LENGTH_MISMATCH  # frame shorter than prefix says


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        (b"XX" + frame_bytes(Stop(1, 2))[2:], ErrorCode.BAD_MAGIC),
        (prefix(0x7F, 32) + header(), ErrorCode.UNKNOWN_KIND),
        (prefix(MessageKind.STOP, 32, flags=0x80) + header(n_tokens=0), ErrorCode.BAD_FLAGS),
        (prefix(MessageKind.DECODE, 36, flags=Flags.FINAL) + header() + b"\0" * 4, ErrorCode.BAD_FLAGS),
        (prefix(MessageKind.CONFIGURE_GENERATION, 68) + header(n_tokens=0) + b"\0" * 36, ErrorCode.BAD_FLAGS),
        (prefix(MessageKind.DECODE, 36, flags=Flags.SAMPLING) + header() + b"\0" * 4, ErrorCode.BAD_FLAGS),
        (prefix(MessageKind.PREFILL, 36, flags=Flags.DIRECT_RETURN) + header() + b"\0" * 4, ErrorCode.BAD_FLAGS),
        (prefix(MessageKind.DECODE, 40) + header(n_tokens=2) + b"\0" * 8, ErrorCode.BAD_VALUE),
        (prefix(MessageKind.PREFILL, 32) + header(n_tokens=0), ErrorCode.BAD_VALUE),
        (prefix(MessageKind.STOP, 36) + header(n_tokens=1) + b"\0" * 4, ErrorCode.FRAME_TOO_LARGE),
        (prefix(MessageKind.STOP, 32) + header(n_tokens=0, reserved=1), ErrorCode.BAD_VALUE),
        (prefix(MessageKind.PING, 32) + header(n_tokens=0, session_id=5), ErrorCode.BAD_VALUE),
        (prefix(MessageKind.DECODE, 36) + header(pos=-1) + b"\0" * 4, ErrorCode.BAD_VALUE),
        (prefix(MessageKind.DECODE, 36) + header(pos=2**31 - 1) + b"\0" * 4, ErrorCode.BAD_VALUE),
        (prefix(MessageKind.PREFILL, 44) + header(n_tokens=1, bias=1) + b"\0" * 12, ErrorCode.BAD_VALUE),
    ],
)
def test_malformed_messages(wire, code):
    assert code_of(decode_frame, wire, n_embd=8) == code


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        # tokens on a cache query
        (prefix(MessageKind.CACHE_QUERY, 36) + header(session_id=0, n_tokens=1) + b"\0" * 4, ErrorCode.FRAME_TOO_LARGE),
        (prefix(MessageKind.CACHE_QUERY, 32) + header(session_id=0, n_tokens=1), ErrorCode.BAD_VALUE),
        # CLEAR on another kind, another flag on a cache query
        (prefix(MessageKind.PING, 32, flags=Flags.CLEAR) + header(session_id=0, n_tokens=0), ErrorCode.BAD_FLAGS),
        (prefix(MessageKind.RESTORE_PREFIX, 36, flags=Flags.CLEAR) + header() + b"\0" * 4, ErrorCode.BAD_FLAGS),
        # (CLEAR's bit is RESTORE on a PrefillChunk: a restore block of no keys)
        (prefix(MessageKind.PREFILL, 36, flags=Flags.CLEAR) + header() + b"\0" * 4, ErrorCode.BAD_VALUE),
        (prefix(MessageKind.CACHE_QUERY, 32, flags=Flags.FINAL) + header(session_id=0, n_tokens=0),
         ErrorCode.BAD_FLAGS),
        (prefix(MessageKind.CACHE_QUERY, 32, flags=0x10) + header(session_id=0, n_tokens=0), ErrorCode.BAD_FLAGS),
        (prefix(MessageKind.RESTORE_PREFIX, 36, flags=Flags.SAMPLING) + header() + b"\0" * 4, ErrorCode.BAD_FLAGS),
        # positions and sessions
        (prefix(MessageKind.RESTORE_PREFIX, 36) + header(pos=1) + b"\0" * 4, ErrorCode.BAD_VALUE),
        (prefix(MessageKind.CACHE_QUERY, 32) + header(session_id=0, pos=1, n_tokens=0), ErrorCode.BAD_VALUE),
        (prefix(MessageKind.CACHE_QUERY, 32) + header(session_id=5, n_tokens=0), ErrorCode.BAD_VALUE),
        # a restore needs tokens and carries no activation
        (prefix(MessageKind.RESTORE_PREFIX, 32) + header(n_tokens=0), ErrorCode.BAD_VALUE),
        (prefix(MessageKind.RESTORE_PREFIX, 36 + 32) + header(act_bytes=32) + b"\0" * 36, ErrorCode.BAD_VALUE),
        (prefix(MessageKind.RESTORE_PREFIX, 40) + header(n_tokens=1) + b"\0" * 8, ErrorCode.LENGTH_MISMATCH),
    ],
)
def test_malformed_prefix_cache_messages(wire, code):
    assert code_of(decode_frame, wire, n_embd=8) == code


def test_restore_prefix_limits():
    """A RestorePrefix is looked up, never computed: a receiver's tighter token limit (its batch) does not apply,
    only the protocol's."""
    tight = Limits(max_tokens=16)
    assert len(decode_frame(frame_bytes(RestorePrefix(1, 2, range(17))), n_embd=4, limits=tight).tokens) == 17
    p = codec.FramePrefix(MessageKind.RESTORE_PREFIX, 0, 32 + 4 * (MAX_TOKENS + 1))
    assert code_of(parse_message_header, p, header(n_tokens=MAX_TOKENS + 1), tight, 4) == ErrorCode.LIMIT_EXCEEDED
    assert code_of(parse_prefix, prefix(MessageKind.RESTORE_PREFIX, 32 + 4 * MAX_TOKENS + 4), tight, n_embd=4) == (
        ErrorCode.FRAME_TOO_LARGE
    )
    assert code_of(parse_prefix, prefix(MessageKind.CACHE_QUERY, 33), n_embd=4) == ErrorCode.FRAME_TOO_LARGE
    with pytest.raises(ValueError):
        RestorePrefix(1, 2, [])
    with pytest.raises(ValueError):
        RestorePrefix(1, 2, range(MAX_TOKENS + 1))
    with pytest.raises(ValueError):
        RestorePrefix(1, 2, [[1, 2]])


def reply_body(kind: int, count: int, payload: bytes, request_id=1, session_id=2, code=0, reserved=0) -> bytes:
    return struct.pack("<QQIHH", request_id, session_id, count, code, reserved) + bytes(56) + payload


def test_bad_prefix_cache_replies():
    record = struct.pack("<IIQQQQQQQQQQQQQQQ", 1, 0, *range(15))
    # PrefixRestored: exactly one u32
    for count in (0, 2):
        wire = bytearray(frame_bytes(PrefixRestored(1, 2, 5)))
        struct.pack_into("<I", wire, 8 + 16, count)
        assert code_of(decode_frame, wire) == ErrorCode.BAD_VALUE
    assert code_of(parse_prefix, prefix(ReplyKind.PREFIX_RESTORED, 88)) == ErrorCode.FRAME_TOO_LARGE
    assert code_of(parse_prefix, prefix(ReplyKind.PREFIX_RESTORED, 80)) == ErrorCode.LENGTH_MISMATCH
    wire = bytearray(frame_bytes(PrefixRestored(1, 2, 5)))
    struct.pack_into("<H", wire, 8 + 20, ErrorCode.INTERNAL)  # a code on a non-error
    assert code_of(decode_frame, wire) == ErrorCode.BAD_VALUE
    # CacheReport: the body is count records, no more, no fewer
    for count, records in ((2, 1), (1, 2), (0, 1), (1, 0)):
        body = reply_body(ReplyKind.CACHE_REPORT, count, record * records)
        assert code_of(decode_frame, prefix(ReplyKind.CACHE_REPORT, len(body)) + body) == ErrorCode.LENGTH_MISMATCH
    body = reply_body(ReplyKind.CACHE_REPORT, 1, record[:-1])
    assert code_of(decode_frame, prefix(ReplyKind.CACHE_REPORT, len(body)) + body) == ErrorCode.LENGTH_MISMATCH
    # at most MAX_CACHE_REPORT_STAGES records: refused from the prefix, or from the count
    n = MAX_CACHE_REPORT_STAGES + 1
    body = reply_body(ReplyKind.CACHE_REPORT, n, record * n)
    assert code_of(decode_frame, prefix(ReplyKind.CACHE_REPORT, len(body)) + body) == ErrorCode.FRAME_TOO_LARGE
    body = reply_body(ReplyKind.CACHE_REPORT, n, record * (n - 1))
    assert code_of(decode_frame, prefix(ReplyKind.CACHE_REPORT, len(body)) + body) == ErrorCode.LIMIT_EXCEEDED
    assert code_of(decode_body, codec.FramePrefix(ReplyKind.CACHE_REPORT, 0, len(body)), body) == (
        ErrorCode.LIMIT_EXCEEDED
    )
    with pytest.raises(ValueError):
        CacheReport(1, 0, [CacheStats(0)] * n)
    with pytest.raises(TypeError):
        CacheReport(1, 0, [{"stage_index": 0}])
    # a record's flags: only bit 0 (disk_on)
    body = reply_body(ReplyKind.CACHE_REPORT, 1, struct.pack("<IIQQQQQQQQQQQQQQQ", 1, 6, *range(15)))
    with pytest.raises(ProtocolError) as info:
        decode_frame(prefix(ReplyKind.CACHE_REPORT, len(body)) + body)
    assert info.value.code == ErrorCode.BAD_VALUE and (info.value.request_id, info.value.session_id) == (1, 2)
    # a good one, built by hand
    body = reply_body(ReplyKind.CACHE_REPORT, 1, record)
    assert decode_frame(prefix(ReplyKind.CACHE_REPORT, len(body)) + body).stages == (
        CacheStats(1, *range(9), False, *range(9, 15)),)


def test_restored_is_a_u32():
    for bad in (-1, 2**32, 1.5, True):
        with pytest.raises(ValueError):
            PrefixRestored(1, 2, bad)
    assert PrefixRestored(1, 2, 0).stats == StageStats()


def test_nan_sampling_rejected():
    wire = bytearray(frame_bytes(ConfigureGeneration(1, 2, SamplingParams())))
    struct.pack_into("<f", wire, 40, math.nan)  # temperature
    assert code_of(decode_frame, wire, n_embd=8) == ErrorCode.BAD_VALUE


def test_bad_replies():
    err = bytearray(frame_bytes(ErrorReply(1, 2, ErrorCode.INTERNAL, "ab")))
    err[-1] = 0xFF  # invalid UTF-8
    assert code_of(decode_frame, err) == ErrorCode.BAD_VALUE
    err = bytearray(frame_bytes(ErrorReply(1, 2, ErrorCode.INTERNAL, "ab")))
    struct.pack_into("<H", err, 8 + 20, 999)  # unknown error code
    assert code_of(decode_frame, err) == ErrorCode.BAD_VALUE
    ack = bytearray(frame_bytes(Ack(1, 2)))
    struct.pack_into("<H", ack, 8 + 20, 41)  # code on a non-error
    assert code_of(decode_frame, ack) == ErrorCode.BAD_VALUE
    toks = bytearray(frame_bytes(PredictedTokens(1, 2, [1, 2])))
    struct.pack_into("<I", toks, 8 + 16, 3)  # count disagrees with length
    assert code_of(decode_frame, toks) == ErrorCode.LENGTH_MISMATCH


def test_messages_need_the_handshake_and_kinds_can_be_restricted():
    assert code_of(decode_frame, frame_bytes(Stop(1, 2))) == ErrorCode.UNEXPECTED_KIND
    assert code_of(decode_frame, frame_bytes(Ack(1, 2)), accept=codec.MESSAGE_KINDS) == ErrorCode.UNEXPECTED_KIND


def test_hello_of_another_version_names_both_versions():
    other = PROTOCOL_VERSION + 1
    wire = frame_bytes(Hello(FP, 0, 0, 1, 2, 8, version=other))
    with pytest.raises(ProtocolError) as info:
        decode_frame(wire)
    assert info.value.code == ErrorCode.VERSION_MISMATCH
    assert info.value.message == f"protocol version mismatch: peer {other}, ours {PROTOCOL_VERSION}"
    # a future version's hello may be longer; its version is still readable
    future = b"SKPY" + struct.pack("<H", other) + b"\0" * 500
    assert hello_version(future) == other
    assert code_of(decode_frame, prefix(0x01, len(future)) + future) == ErrorCode.VERSION_MISMATCH


def test_constructors_validate():
    with pytest.raises(ValueError):
        DecodeStep(1, 2, 0, [1, 2])
    with pytest.raises(ValueError):
        PrefillChunk(1, 2, 0, [1, 2], np.zeros((3, 4)))
    with pytest.raises(ValueError):
        PrefillChunk(1, 2, 0, [])
    with pytest.raises(ValueError):
        PrefillChunk(1, 2, -1, [1])
    with pytest.raises(ValueError):
        SamplingParams(temperature=math.nan)
    with pytest.raises(ValueError):
        SamplingParams(logit_bias=[(1, 0.0)] * (MAX_LOGIT_BIAS + 1))
    with pytest.raises(ValueError):
        Hello("ab", 0, 0, 1, 2, 8)
    assert len(ErrorReply(1, 2, ErrorCode.INTERNAL, "é" * 4000).message.encode()) == 4096  # cut, not refused
    with pytest.raises(ValueError):
        Ack(-1, 0)
    assert SamplingParams(temperature=0.8).temperature == struct.unpack("<f", struct.pack("<f", 0.8))[0]
    assert Hello(FP.hex(), 0, 0, 1, 2, 8).fingerprint == FP
    assert len(HelloReply(False, "é" * 1000).reason.encode()) <= 1024


def test_error_reply_for_protocol_error():
    exc = ProtocolError(ErrorCode.LIMIT_EXCEEDED, "too many", request_id=4, session_id=5)
    reply = error_reply_for(exc)
    assert (reply.request_id, reply.session_id) == (4, 5)
    assert (reply.code, reply.message) == (ErrorCode.LIMIT_EXCEEDED, "too many")
    assert reply.code.closes_connection and not ErrorCode.UNKNOWN_SESSION.closes_connection


# --------------------------------------------------------------------------
# stats


def test_merge_example():
    final = StageStats.single(2, compute_us=900, bytes_sent=0)
    middle = StageStats.single(1, compute_us=1200, forward_write_us=30, downstream_wait_us=1500, bytes_sent=2348)
    head_view = merge(middle, final)
    assert head_view == StageStats(
        compute_us=2100,
        compute_us_max=1200,
        queue_us=0,
        forward_write_us=30,
        downstream_wait_us=1500,
        bytes_sent=2348,
        stage_count=2,
        slowest_stage=1,
    )


@given(stage_stats, stage_stats, stage_stats)
def test_merge_properties(a, b, c):
    assert merge(a, StageStats()) == a
    left, right = merge(merge(a, b), c), merge(a, merge(b, c))
    assert left == right
    ab, ba = merge(a, b), merge(b, a)
    assert attrs_without_slowest(ab) == attrs_without_slowest(ba)
    assert ab.compute_us_max == max(a.compute_us_max, b.compute_us_max)
    assert ab.downstream_wait_us == max(a.downstream_wait_us, b.downstream_wait_us)
    assert ab.compute_us == min(a.compute_us + b.compute_us, U64)


@given(st.lists(stage_stats, max_size=8), st.integers(0, 7), st.integers(0, 2**40), st.integers(0, 2**40),
       st.integers(0, 2**40), st.integers(0, 2**40), st.integers(0, 2**40))
def test_a_running_total_equals_merging_the_reports(reports, stage, compute, queue, write, wait, sent):
    # the head's running total: the same as merge_all of the same reports (the ones it builds itself too)
    total = StatsTotal()
    for report in reports:
        total.add(report)
    total.add_compute(stage, compute, queue)
    total.add_hop(write, wait, sent)
    own = [StageStats.single(stage, compute_us=compute, queue_us=queue),
           StageStats(forward_write_us=write, downstream_wait_us=wait, bytes_sent=sent)]
    assert total.total() == merge_all([*reports, *own])


def attrs_without_slowest(s: StageStats) -> tuple:
    return attrs.astuple(attrs.evolve(s, slowest_stage=0))


# --------------------------------------------------------------------------
# check_hello


def lane(stage: int, start: int, end: int, **kw) -> Hello:
    return Hello(kw.pop("fingerprint", FP), stage, start, end, 30, 576, **kw)


def test_adjacent_lane_accepted_both_ways():
    up, down = lane(0, 0, 10), lane(1, 10, 30)
    assert check_hello(down, up, dialer=False) is None
    assert check_hello(up, down, dialer=True) is None


@pytest.mark.parametrize(
    ("peer", "reason"),
    [
        (lane(0, 0, 10, version=2), f"protocol version mismatch: peer 2, ours {PROTOCOL_VERSION}"),
        (lane(0, 0, 10, fingerprint=OTHER_FP), "model fingerprint mismatch: peer 0000000000000000…, ours 00010203"),
        (Hello(FP, 0, 0, 10, 30, 1024), "model shape mismatch"),
        (lane(0, 0, 10, role=Role.TOKEN_RETURN), "role mismatch"),
        (lane(0, 0, 9), "non-adjacent stage: peer is stage 0 with layers [0, 9) of 30, expected stage 0 ending at"),
        (lane(2, 0, 10), "non-adjacent stage"),
        (lane(0, 10, 10), "invalid layer range"),
        (lane(0, 0, 31), "invalid layer range"),
    ],
)
def test_refusals_say_which_check_failed(peer, reason):
    me = lane(1, 10, 20)
    got = check_hello(me, peer, dialer=False)
    assert got is not None and got.startswith(reason)


def test_dialer_refuses_wrong_downstream():
    me = lane(0, 0, 10)
    assert check_hello(me, lane(1, 12, 30), dialer=True).startswith(
        "non-adjacent stage: peer is stage 1 with layers [12, 30) of 30, expected stage 1 starting at layer 10"
    )
    assert check_hello(me, lane(2, 10, 30), dialer=True).startswith("non-adjacent stage")


def test_auth():
    me = lane(1, 10, 30, auth=b"secret")
    assert check_hello(me, lane(0, 0, 10, auth=b"secret"), dialer=False) is None
    assert check_hello(me, lane(0, 0, 10, auth=b"wrong"), dialer=False) == "authentication failed"
    assert check_hello(me, lane(0, 0, 10), dialer=False) == "authentication failed"


def test_token_return_role():
    head = lane(0, 0, 10, role=Role.TOKEN_RETURN)
    final = lane(2, 20, 30, role=Role.TOKEN_RETURN)
    middle = lane(1, 10, 20, role=Role.TOKEN_RETURN)
    assert check_hello(head, final, dialer=False) is None
    assert check_hello(final, head, dialer=True) is None
    refusal = check_hello(head, middle, dialer=False)
    assert refusal.startswith("non-adjacent stage: token-return must come from the final")
    assert check_hello(final, middle, dialer=True).startswith("non-adjacent stage: token-return goes to stage 0")


# --------------------------------------------------------------------------
# media rows


def _media_chunk(sections: int = 4, *, end: int = 13, causal: bool = True) -> PrefillChunk:
    """An M-RoPE image of 3x2 rows at position 10 (it takes 3 positions), or its rows counted (1 section)."""
    if sections == 4:
        pos = np.array([[10] * 6, [10, 10, 10, 11, 11, 11], [10, 11, 12, 10, 11, 12], [0] * 6])
    else:
        pos, end = np.arange(10, 16).reshape(1, 6), 16
    keys = np.arange(-1, -1 - (end - 10), -1)
    return PrefillChunk(1, 2, 10, [NO_TOKEN] * 6, np.ones((6, 4), np.float32),
                        media=MediaRows(pos, end, keys, causal=causal))


def test_media_rows_travel_with_their_positions_keys_and_flags():
    msg = _media_chunk(causal=False)
    wire = frame_bytes(msg)
    assert wire[3] == Flags.POSITIONS | Flags.NON_CAUSAL
    got = decode_frame(bytearray(wire), n_embd=4)
    assert got == msg and got.pos_end == 13 and got.keys.tolist() == [-1, -2, -3] and not got.media.causal
    assert got.media.positions.shape == (4, 6)
    # counted rows: a chunk of text tokens is where it always was, its keys are its tokens
    text = PrefillChunk(1, 2, 10, [7, 8], np.ones((2, 4), np.float32))
    assert text.pos_end == 12 and text.keys.tolist() == [7, 8] and frame_bytes(text)[3] == 0


@pytest.mark.parametrize("sections", [1, 4])
def test_a_positions_block_whose_length_disagrees_is_refused(sections):
    wire = bytearray(frame_bytes(_media_chunk(sections)))
    header = PREFIX_SIZE
    ext_words = struct.unpack_from("<H", wire, header + 30)[0]
    struct.pack_into("<H", wire, header + 30, ext_words - 1)  # a word short: the body no longer adds up
    with pytest.raises(ProtocolError) as err:
        decode_frame(wire, n_embd=4)
    assert err.value.code == ErrorCode.LENGTH_MISMATCH


@pytest.mark.parametrize(("change", "why"), [
    (lambda w, at: struct.pack_into("<B", w, at, 3), "sections"),  # 3 sections: neither 1 nor M-RoPE's 4
    (lambda w, at: struct.pack_into("<I", w, at + 4, 9), "pos_end"),  # before pos_start
    (lambda w, at: struct.pack_into("<i", w, at + 8 + 12, 9), "positions outside"),  # a row before pos_start
])
def test_media_rows_that_make_no_sense_are_refused(change, why):
    wire = bytearray(frame_bytes(_media_chunk()))
    change(wire, PREFIX_SIZE + MESSAGE_HEADER_SIZE)
    with pytest.raises(ProtocolError, match=why) as err:
        decode_frame(wire, n_embd=4)
    assert err.value.code in (ErrorCode.BAD_VALUE, ErrorCode.LENGTH_MISMATCH)


def test_media_rows_carry_no_token_and_non_causal_needs_them():
    with pytest.raises(ValueError, match="no token"):
        PrefillChunk(1, 2, 10, [5] * 6, None, media=_media_chunk().media)
    wire = bytearray(frame_bytes(PrefillChunk(1, 2, 0, [5], None)))
    wire[3] = Flags.NON_CAUSAL
    with pytest.raises(ProtocolError) as err:
        decode_frame(wire, n_embd=4)
    assert err.value.code == ErrorCode.BAD_FLAGS
    for other in (DecodeStep(1, 2, 0, [5], None), VerifyWindow(1, 2, 0, [5], None)):
        wire = bytearray(frame_bytes(other))
        wire[3] |= Flags.POSITIONS
        with pytest.raises(ProtocolError) as err:
            decode_frame(wire, n_embd=4)
        assert err.value.code == ErrorCode.BAD_FLAGS
