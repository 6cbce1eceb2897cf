"""Byte layout of the stage protocol: pure encode/decode functions, no I/O.

Every frame is an 8-byte prefix followed by a body of ``body_len`` bytes::

    prefix   0  2s  magic b"SK"
             2  u8  kind      (HandshakeKind | MessageKind | ReplyKind)
             3  u8  flags     (Flags)
             4  u32 body_len

All integers little-endian. The reader needs the prefix only to know how
much to read; :func:`parse_prefix` checks magic, kind, flags and ``body_len``
against the limits *before* anything is allocated.

Message body (kinds 0x10–0x18, 0x1F)::

    header   0  u64 request_id
             8  u64 session_id
            16  i32 pos_start        (authoritative position of tokens[0])
            20  u32 token_count
            24  u32 activation_bytes (0, or token_count * n_embd * 4; * 2 with Flags.F16)
            28  u16 bias_count       (logit-bias entries; 0 without SAMPLING)
            30  u16 ext_len          (CONFIGURE_GENERATION: the generation extension's bytes; else 0)
    32      sampling block (36 bytes, iff Flags.SAMPLING)
            bias_count * (i32 token, f32 bias)
            ext_len bytes: u8 constraint kind (0 none, 1 json_schema, 2 json_object, 3 grammar),
                           u8 logprobs (alternatives per token, 0..20; 0xFF: none), u16 reserved = 0,
                           the constraint's text (UTF-8, the rest); absent (ext_len 0) when neither
            PREFILL with Flags.POSITIONS: the positions block, 4 * ext_len bytes (ext_len counts 32-bit
                           words here): u8 sections (1 or 4), u8 reserved = 0, u16 reserved = 0, u32 pos_end,
                           (pos_end - pos_start) * i32 keys, sections * token_count * i32 positions
                           (section-major)
            PREFILL with Flags.RESTORE: the restore block, ext_len * i32 keys (1..MAX_TOKENS; pos_start 0, never
                           with POSITIONS)
            token_count * i32 tokens
            activation_bytes of f32 (f16 with Flags.F16), row-major (token_count, n_embd)

Reply body (kinds 0x20–0x27, 0x2F)::

     0  u64 request_id
     8  u64 session_id
    16  u32 count        (tokens that follow; ERROR: message bytes; PREFIX_RESTORED: 1;
                          CACHE_REPORT, STAGE_REPORT: records; PREDICTED_TOKEN_LOGPROBS: 1 + alternatives;
                          STOPPED: stages)
    20  u16 code         (ErrorCode for ERROR, else 0)
    22  u16 reserved = 0
    24  stats: u64 compute_us, compute_us_max, queue_us, forward_write_us,
               downstream_wait_us, bytes_sent; u32 stage_count, slowest_stage
    80  count * i32 tokens | count bytes of UTF-8 | u32 restored | count * u32 cached (STOPPED)
        | count * (i32 token, f32 logprob): the sampled token, then its alternatives
        | count * 80-byte cache records (u32 stage_index, u32 reserved = 0,
          u64 budget_bytes, bytes_held, entries, tokens_held, lookups, hits,
          restored_tokens, recorded_tokens, evictions)
        | count * 104-byte load records (u32 stage_index, layer_start, layer_end,
          n_seq_max; u64 clock_us, compute_us, batches, tokens, sessions,
          kv_tokens, kv_capacity, cache_bytes, cache_budget, downstream_rtt_us,
          answer_us)

Hello and HelloReply layouts are in :func:`encode_hello` /
:func:`encode_hello_reply`. For a message, the reader parses the 32-byte header
first (:func:`parse_message_header`), which gives the exact size of the
sampling+tokens part (the *tail*) and of the activation, so the activation
is received into its own buffer and decoded with ``np.frombuffer`` (no copy; an
F16 activation is widened to float32 there, one copy).

The sender picks the activation's encoding (``wire``, the lane's negotiated
:class:`WireFormat`): with F16 each frame whose values all fit half's range
(|x| <= 65504) goes as half floats, flag F16; a frame with a larger value (the
first token's row of some models) goes as float32, so no value saturates.

Encoding returns a list of buffers for ``send_all``: one ``bytes`` for
everything except a large activation (> COALESCE_BYTES), which follows as a
second, zero-copy ``memoryview`` of the array.
"""

from __future__ import annotations

import struct
from collections.abc import Container
from typing import NamedTuple, TypeAlias

import attrs
import numpy as np

from skippyd.sampling import CONSTRAINT_KINDS, Constraint
from skippyd.wire.errors import ProtocolError
from skippyd.wire.messages import (
    DEFAULT_LIMITS,
    DEFAULT_SEED,
    MAX_AUTH_BYTES,
    MAX_CACHE_REPORT_STAGES,
    MAX_HELLO_BODY_BYTES,
    MAX_NODE_NAME_BYTES,
    MAX_POSITION,
    MAX_POSITION_SECTIONS,
    MAX_PROBE_PADDING,
    MAX_REASON_BYTES,
    MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    PROTOCOL_VERSION,
    TRUSTED,
    Ack,
    CacheQuery,
    CacheReport,
    CacheStats,
    ConfigureGeneration,
    DecodeStep,
    ErrorCode,
    ErrorReply,
    Flags,
    Frame,
    HandshakeKind,
    Hello,
    HelloReply,
    Limits,
    LinkProbe,
    MediaRows,
    Message,
    MessageKind,
    Ping,
    PredictedToken,
    PredictedTokenLogprobs,
    PredictedTokens,
    PrefillChunk,
    PrefixRestored,
    Reply,
    ReplyKind,
    RestorePrefix,
    Role,
    SamplingParams,
    StageLoad,
    StageQuery,
    StageReport,
    StageStats,
    Stop,
    Stopped,
    TrimSession,
    VerifyWindow,
    WireFormat,
    check_media_rows,
    trusted,
)

__all__ = [
    "CACHE_RECORD_SIZE",
    "COALESCE_BYTES",
    "FRAME_MAGIC",
    "HELLO_MAGIC",
    "HALF_MAX",
    "HELLO_SIZE",
    "LOAD_RECORD_SIZE",
    "MESSAGE_HEADER_SIZE",
    "MESSAGE_KINDS",
    "PREFIX_SIZE",
    "REPLY_HEADER_SIZE",
    "REPLY_KINDS",
    "SAMPLING_SIZE",
    "Buffer",
    "FramePrefix",
    "MessageHeader",
    "decode_body",
    "decode_frame",
    "decode_hello",
    "decode_hello_reply",
    "decode_message",
    "decode_reply",
    "encode_frame",
    "encode_hello",
    "encode_hello_reply",
    "encode_message",
    "encode_reply",
    "error_reply_for",
    "frame_bytes",
    "hello_version",
    "parse_message_header",
    "parse_prefix",
]

Buffer: TypeAlias = bytes | bytearray | memoryview

FRAME_MAGIC = b"SK"
HELLO_MAGIC = b"SKPY"
COALESCE_BYTES = 64 * 1024  # activations up to this size are copied into the header buffer

_PREFIX = struct.Struct("<2sBBI")
_MSG_HEADER = struct.Struct("<QQiIIHH")
_SAMPLING = struct.Struct("<fifffffiI")  # ..., penalty_last_n i32, seed u32
_BIAS = struct.Struct("<if")
_EXT_HEAD = struct.Struct("<BBH")  # constraint kind, logprobs (0xFF: none), reserved
_POSITIONS_HEAD = struct.Struct("<BBHI")  # sections, reserved, reserved, pos_end
_LOGPROB = struct.Struct("<if")  # token, logprob
_CONSTRAINT_CODES = {kind: i + 1 for i, kind in enumerate(CONSTRAINT_KINDS)}  # 0: no constraint
_CONSTRAINT_KINDS = {i: kind for kind, i in _CONSTRAINT_CODES.items()}
_NO_LOGPROBS = 0xFF
MAX_EXT_BYTES = 0xFFFF
_REPLY_HEADER = struct.Struct("<QQIHH" "QQQQQQII")
_HELLO = struct.Struct("<4sHBB32sIIIIIHH")
_HELLO_VERSION = struct.Struct("<4sH")
_HELLO_REPLY = struct.Struct("<BBH")
_LINK_PROBE = struct.Struct("<BBHI")  # step, wire, reserved, rate_kbps; then the padding
# stage_index, flags (bit 0: disk_on; the rest zero), then CacheStats' u64 fields in order
_CACHE_RECORD = struct.Struct("<IIQQQQQQQQQQQQQQQ")
_LOAD_RECORD = struct.Struct("<IIIIQQQQQQQQQQQ")  # StageLoad's fields in order

PREFIX_SIZE = _PREFIX.size  # 8
MESSAGE_HEADER_SIZE = _MSG_HEADER.size  # 32
SAMPLING_SIZE = _SAMPLING.size  # 36
REPLY_HEADER_SIZE = _REPLY_HEADER.size  # 80
REPLY_COMPUTE_US_AT = PREFIX_SIZE + 24  # a reply frame's stats.compute_us (u64), compute_us_max after it
HELLO_SIZE = _HELLO.size  # 64 (fixed part)
HELLO_REPLY_SIZE = _HELLO_REPLY.size  # 4 (fixed part)
CACHE_RECORD_SIZE = _CACHE_RECORD.size  # 128
LOAD_RECORD_SIZE = _LOAD_RECORD.size  # 104

assert (PREFIX_SIZE, MESSAGE_HEADER_SIZE, SAMPLING_SIZE, REPLY_HEADER_SIZE, HELLO_SIZE, CACHE_RECORD_SIZE,
        LOAD_RECORD_SIZE) == (8, 32, 36, 80, 64, 128, 104)

MESSAGE_KINDS = frozenset(int(k) for k in MessageKind)
REPLY_KINDS = frozenset(int(k) for k in ReplyKind)
HANDSHAKE_KINDS = frozenset(int(k) for k in HandshakeKind)
_ALL_KINDS = MESSAGE_KINDS | REPLY_KINDS | HANDSHAKE_KINDS

# flags each kind may carry / must carry
_ALLOWED_FLAGS = {int(k): 0 for k in _ALL_KINDS}
_ALLOWED_FLAGS[MessageKind.PREFILL] = int(Flags.FINAL | Flags.POSITIONS | Flags.NON_CAUSAL | Flags.F16  # ints
                                           | Flags.RESTORE)
_ALLOWED_FLAGS[MessageKind.CONFIGURE_GENERATION] = int(Flags.SAMPLING | Flags.DIRECT_RETURN)
_ALLOWED_FLAGS[MessageKind.DECODE] = int(Flags.DIRECT_RETURN | Flags.F16)
_ALLOWED_FLAGS[MessageKind.VERIFY_WINDOW] = int(Flags.F16 | Flags.CHAINED)
_ALLOWED_FLAGS[MessageKind.CACHE_QUERY] = int(Flags.CLEAR | Flags.CLEAR_DISK)
_REQUIRED_FLAGS = {int(k): 0 for k in _ALL_KINDS}
_REQUIRED_FLAGS[MessageKind.CONFIGURE_GENERATION] = int(Flags.SAMPLING)

# (min, max) token_count per message kind; None: tokens forbidden
_TOKEN_RANGE = {
    MessageKind.CONFIGURE_GENERATION: (0, 0),
    MessageKind.PREFILL: (1, None),
    MessageKind.DECODE: (1, 1),
    MessageKind.VERIFY_WINDOW: (1, None),
    MessageKind.TRIM_SESSION: (0, 0),
    MessageKind.STOP: (0, 0),
    MessageKind.PING: (0, 0),
    MessageKind.RESTORE_PREFIX: (1, None),
    MessageKind.CACHE_QUERY: (0, 0),
    MessageKind.STAGE_QUERY: (0, 0),
}
# kinds whose pos_start must be 0, and those whose session_id must be 0 too
_NO_POSITION = frozenset({MessageKind.STOP, MessageKind.PING, MessageKind.CONFIGURE_GENERATION,
                          MessageKind.RESTORE_PREFIX, MessageKind.CACHE_QUERY, MessageKind.STAGE_QUERY})
_NO_SESSION = frozenset({MessageKind.PING, MessageKind.CACHE_QUERY, MessageKind.STAGE_QUERY})


_MESSAGE_KIND = {int(k): k for k in MessageKind}
_REPLY_KIND = {int(k): k for k in ReplyKind}
_TOKEN = struct.Struct("<i")
_U32 = struct.Struct("<I")
_F4 = np.dtype("<f4")
_F2 = np.dtype("<f2")
HALF_MAX = 65504.0  # the largest finite half float: a frame with a larger value goes as float32
_F16_WIRE = WireFormat.F16


# plain ints: an IntFlag operand makes every ``&`` a call into the enum module, and these run for every frame
_FINAL_FLAG, _SAMPLING_FLAG, _DIRECT_RETURN_FLAG = int(Flags.FINAL), int(Flags.SAMPLING), int(Flags.DIRECT_RETURN)
_CLEAR_FLAG = int(Flags.CLEAR)
_CLEAR_DISK_FLAG = int(Flags.CLEAR_DISK)
_POSITIONS_FLAG, _NON_CAUSAL_FLAG = int(Flags.POSITIONS), int(Flags.NON_CAUSAL)
_F16_FLAG = int(Flags.F16)
_CHAINED_FLAG = int(Flags.CHAINED)
_RESTORE_FLAG = int(Flags.RESTORE)


class FramePrefix(NamedTuple):
    kind: int
    flags: int
    body_len: int


class MessageHeader(NamedTuple):
    """A parsed, validated message header; sizes of the remaining parts."""

    kind: MessageKind
    flags: int
    request_id: int
    session_id: int
    pos_start: int
    token_count: int
    activation_bytes: int
    bias_count: int
    tail_len: int  # sampling block + logit bias + generation extension, positions or restore block + tokens
    ext_len: int = 0  # bytes of CONFIGURE_GENERATION's generation extension, or of PREFILL's positions block
    # (0 with a restore block, whose keys are ``restore_len``)
    restore_len: int = 0


def _kind_name(kind: int) -> str:
    for enum_cls in (MessageKind, ReplyKind, HandshakeKind):
        try:
            return enum_cls(kind).name
        except ValueError:
            pass
    return f"0x{kind:02x}"


# --------------------------------------------------------------------------
# encoding


def _prefix(kind: int, flags: int, body_len: int) -> bytes:
    return _PREFIX.pack(FRAME_MAGIC, kind, flags, body_len)


def wire_activation(activation: np.ndarray, wire: WireFormat) -> np.ndarray:
    """``activation`` as it travels on a lane of encoding ``wire``: half floats if the lane takes them and every
    value fits (a NaN, an infinity or a value beyond HALF_MAX keeps the frame float32), else float32."""
    act = np.ascontiguousarray(activation, dtype=_F4)
    if wire & _F16_WIRE and act.size and float(np.abs(act).max()) <= HALF_MAX:
        return act.astype(_F2)
    return act


def encode_message(msg: Message, wire: WireFormat = WireFormat.F32) -> list[Buffer]:
    """Frame a message as buffers to write in order (1 or 2 of them); its activation encoded for ``wire``
    (see :func:`wire_activation`).

    A large float32 activation is returned as a separate zero-copy memoryview;
    the caller must not mutate the array until the write has finished.
    """
    flags = 0
    pos_start = 0
    session_id = 0
    tokens = None
    activation = None
    sampling = b""
    bias_count = ext_len = 0
    match msg:
        case PrefillChunk():
            flags = _FINAL_FLAG if msg.final else 0
            pos_start, tokens, activation = msg.pos_start, msg.tokens, msg.activation
            if msg.media is not None:
                flags |= _POSITIONS_FLAG | (0 if msg.media.causal else _NON_CAUSAL_FLAG)
                sampling = _encode_positions(msg.media)
                ext_len = len(sampling) // 4
            elif msg.restore is not None:
                flags |= _RESTORE_FLAG
                sampling = msg.restore.astype("<i4", copy=False).tobytes()
                ext_len = len(msg.restore)
        case DecodeStep():
            flags = _DIRECT_RETURN_FLAG if msg.direct_return else 0
            pos_start, tokens, activation = msg.pos_start, msg.tokens, msg.activation
        case VerifyWindow():
            flags = _CHAINED_FLAG if msg.chained else 0
            pos_start, tokens, activation = msg.pos_start, msg.tokens, msg.activation
        case ConfigureGeneration():
            flags = Flags.SAMPLING | (Flags.DIRECT_RETURN if msg.direct_return else 0)
            sampling = _encode_sampling(msg.sampling)
            ext = _encode_extension(msg.sampling)
            sampling += ext
            bias_count, ext_len = len(msg.sampling.logit_bias), len(ext)
        case TrimSession():
            pos_start = msg.pos_start
        case RestorePrefix():
            tokens = msg.tokens
        case CacheQuery():
            flags = (_CLEAR_FLAG if msg.clear else 0) | (_CLEAR_DISK_FLAG if msg.clear_disk else 0)
        case Stop() | Ping() | StageQuery():
            pass
        case _:
            raise TypeError(f"not a message: {msg!r}")
    if not isinstance(msg, (Ping, CacheQuery, StageQuery)):
        session_id = msg.session_id

    token_bytes = b"" if tokens is None else tokens.astype("<i4", copy=False).tobytes()
    n_tokens = 0 if tokens is None else len(tokens)
    act_view = None
    act_len = 0
    if activation is not None:
        act = wire_activation(activation, wire)
        if act.dtype == _F2:
            flags |= _F16_FLAG
        act_view = memoryview(act).cast("B")
        act_len = act.nbytes
    body_len = MESSAGE_HEADER_SIZE + len(sampling) + len(token_bytes) + act_len
    head = _prefix(msg.kind, flags, body_len) + _MSG_HEADER.pack(
        msg.request_id, session_id, pos_start, n_tokens, act_len, bias_count, ext_len
    )
    if act_view is None:
        return [head + sampling + token_bytes]
    if act_len <= COALESCE_BYTES:
        return [b"".join((head, sampling, token_bytes, act_view))]
    return [head + sampling + token_bytes, act_view]


def _encode_sampling(p: SamplingParams) -> bytes:
    block = _SAMPLING.pack(
        p.temperature,
        p.top_k,
        p.top_p,
        p.min_p,
        p.repeat_penalty,
        p.presence_penalty,
        p.frequency_penalty,
        p.penalty_last_n,
        DEFAULT_SEED if p.seed is None else p.seed,
    )
    return block + b"".join(_BIAS.pack(t, b) for t, b in p.logit_bias)


def _encode_positions(media: MediaRows) -> bytes:
    """A prefill chunk's positions block (its media rows): the header, the keys, the positions."""
    positions = np.ascontiguousarray(media.positions, dtype="<i4")
    return (_POSITIONS_HEAD.pack(media.sections, 0, 0, media.pos_end)
            + media.keys.astype("<i4", copy=False).tobytes() + positions.tobytes())


def _encode_extension(p: SamplingParams) -> bytes:
    """The generation extension: empty for a session with neither a constraint nor logprobs."""
    if p.constraint is None and p.logprobs is None:
        return b""
    kind = 0 if p.constraint is None else _CONSTRAINT_CODES[p.constraint.kind]
    text = b"" if p.constraint is None else p.constraint.text.encode("utf-8")
    ext = _EXT_HEAD.pack(kind, _NO_LOGPROBS if p.logprobs is None else p.logprobs, 0) + text
    if len(ext) > MAX_EXT_BYTES:
        raise ValueError(f"the constraint's text is {len(text)} bytes, at most {MAX_EXT_BYTES - _EXT_HEAD.size}")
    return ext


def encode_reply(reply: Reply) -> list[Buffer]:
    """Frame a reply as one buffer (in a list, like :func:`encode_message`)."""
    code = 0
    match reply:
        case Ack():
            tail = b""
            count = 0
        case PredictedTokenLogprobs():
            tail = _LOGPROB.pack(reply.token, reply.logprob) + b"".join(_LOGPROB.pack(t, lp) for t, lp in reply.top)
            count = 1 + len(reply.top)
        case PredictedToken():
            tail = struct.pack("<i", reply.token)
            count = 1
        case PredictedTokens():
            tail = reply.tokens.astype("<i4", copy=False).tobytes()
            count = len(reply.tokens)
        case ErrorReply():
            tail = reply.message.encode("utf-8")
            count = len(tail)
            code = reply.code
        case PrefixRestored():
            tail = _U32.pack(reply.restored)
            count = 1
        case Stopped():
            tail = struct.pack(f"<{len(reply.cached)}I", *reply.cached)
            count = len(reply.cached)
        case CacheReport():
            tail = b"".join(_encode_cache_record(r) for r in reply.stages)
            count = len(reply.stages)
        case StageReport():
            tail = b"".join(_LOAD_RECORD.pack(*attrs.astuple(r)) for r in reply.stages)
            count = len(reply.stages)
        case _:
            raise TypeError(f"not a reply: {reply!r}")
    s = reply.stats
    try:
        body = _REPLY_HEADER.pack(
            reply.request_id,
            reply.session_id,
            count,
            code,
            0,
            s.compute_us,
            s.compute_us_max,
            s.queue_us,
            s.forward_write_us,
            s.downstream_wait_us,
            s.bytes_sent,
            s.stage_count,
            s.slowest_stage,
        )
    except struct.error as exc:
        raise ValueError(f"stats out of range: {s!r}") from exc
    return [_prefix(reply.kind, 0, len(body) + len(tail)) + body + tail]


def _encode_cache_record(r: CacheStats) -> bytes:
    return _CACHE_RECORD.pack(r.stage_index, int(r.disk_on), r.budget_bytes, r.bytes_held, r.entries, r.tokens_held,
                              r.lookups, r.hits, r.restored_tokens, r.recorded_tokens, r.evictions,
                              r.disk_budget_bytes, r.disk_bytes, r.disk_entries, r.disk_tokens, r.disk_hits,
                              r.disk_writes)


def encode_hello(hello: Hello) -> bytes:
    """Hello body layout::

        0  4s   magic b"SKPY"
        4  u16  version        (offsets 0-5 are the same in every version)
        6  u8   role           (Role)
        7  u8   wire_formats   (WireFormat: the activation encodings offered; F32 always; reserved = 0
                                before version 9)
        8  32s  model fingerprint (sha256)
       40  u32  stage_index
       44  u32  layer_start
       48  u32  layer_end      (half-open range)
       52  u32  n_layer        (layers of the whole model)
       56  u32  n_embd
       60  u16  auth_len       (<= 64)
       62  u16  node_len       (<= 255)
       64  auth bytes, node UTF-8
    """
    node = hello.node.encode("utf-8")
    body = (
        _HELLO.pack(
            HELLO_MAGIC,
            hello.version,
            hello.role,
            hello.wire_formats,
            hello.fingerprint,
            hello.stage_index,
            hello.layer_start,
            hello.layer_end,
            hello.n_layer,
            hello.n_embd,
            len(hello.auth),
            len(node),
        )
        + hello.auth
        + node
    )
    return _prefix(HandshakeKind.HELLO, 0, len(body)) + body


def encode_hello_reply(reply: HelloReply) -> bytes:
    """HelloReply body: ``u8 accepted, u8 reserved = 0, u16 reason_len, reason UTF-8``
    (the same in every version)."""
    reason = reply.reason.encode("utf-8")
    body = _HELLO_REPLY.pack(1 if reply.accepted else 0, 0, len(reason)) + reason
    return _prefix(HandshakeKind.HELLO_REPLY, 0, len(body)) + body


def encode_link_probe(probe: LinkProbe) -> list[Buffer]:
    """LinkProbe body: ``u8 step (0 probe, 1 result), u8 wire (a result's F32 or F16, else 0), u16 reserved = 0,
    u32 rate_kbps (a result's, else 0)``, then ``padding`` bytes of zeros (version 11)."""
    result = probe.step == 1
    head = _LINK_PROBE.pack(int(probe.step), int(probe.wire) if result else 0, 0, probe.rate_kbps if result else 0)
    return [_prefix(HandshakeKind.LINK_PROBE, 0, len(head) + probe.padding) + head, bytes(probe.padding)]


def decode_link_probe(body: Buffer) -> LinkProbe:
    _need(body, _LINK_PROBE.size, "link probe")
    step, wire, reserved, rate_kbps = _LINK_PROBE.unpack_from(body)
    if step > 1 or reserved or (step == 0 and (wire or rate_kbps)):
        raise ProtocolError(ErrorCode.BAD_VALUE, "link probe: bad step, wire or reserved field")
    try:
        return LinkProbe(step, len(body) - _LINK_PROBE.size, wire if step else 1, rate_kbps)
    except ValueError as exc:
        raise ProtocolError(ErrorCode.BAD_VALUE, f"link probe: {exc}") from exc


def encode_frame(obj: Frame, wire: WireFormat = WireFormat.F32) -> list[Buffer]:
    """Frame anything: the buffers to write, in order. ``wire``: how an activation travels (the lane's
    negotiated encoding, see :func:`wire_activation`)."""
    kind = type(obj)
    if kind is DecodeStep:  # the per-token frames first: a decode step in one pack
        act = obj.activation
        if act is not None and len(obj.tokens) == 1 and act.dtype == _F4 and act.flags.c_contiguous:
            if wire & _F16_WIRE:
                act = wire_activation(act, wire)
            return [decode_step_head(obj.request_id, obj.session_id, obj.pos_start, int(obj.tokens[0]),
                                     obj.direct_return, act.nbytes, f16=act.dtype == _F2) + act.data]
    elif kind is PredictedToken or kind is Ack:
        return encode_reply(obj)
    match obj:
        case Hello():
            return [encode_hello(obj)]
        case HelloReply():
            return [encode_hello_reply(obj)]
        case LinkProbe():
            return encode_link_probe(obj)
        case (Ack() | PredictedToken() | PredictedTokens() | ErrorReply() | PrefixRestored() | CacheReport()
              | StageReport() | Stopped()):
            return encode_reply(obj)
        case _:
            return encode_message(obj, wire)


def decode_step_head(request_id: int, session_id: int, pos_start: int, token: int, direct_return: bool,
                     activation_bytes: int, *, f16: bool = False) -> bytes:
    """A one-token DecodeStep's frame up to its activation, which follows it (``activation_bytes`` of float32,
    or of half floats with ``f16``): what a stage prepares before the compute that makes the activation (see
    Context.decode_row_send)."""
    flags = (_DIRECT_RETURN_FLAG if direct_return else 0) | (_F16_FLAG if f16 else 0)
    return _DECODE_STEP.pack(FRAME_MAGIC, DECODE_KIND, flags,
                             MESSAGE_HEADER_SIZE + 4 + activation_bytes, request_id, session_id, pos_start, 1,
                             activation_bytes, 0, 0, token)


def frame_bytes(obj: Frame) -> bytes:
    """The whole frame as one bytes object (tests, logs; copies)."""
    return b"".join(bytes(part) for part in encode_frame(obj))


def error_reply_for(exc: ProtocolError, stats: StageStats | None = None) -> ErrorReply:
    """The ErrorReply a server sends before closing on a protocol error."""
    return ErrorReply(exc.request_id, exc.session_id, exc.code, exc.message, stats or StageStats())


# --------------------------------------------------------------------------
# decoding


def _max_message_body(kind: int, limits: Limits, n_embd: int, flags: int = 0) -> int:
    row = (2 if flags & _F16_FLAG else 4) * n_embd
    if kind == MessageKind.CONFIGURE_GENERATION:
        return MESSAGE_HEADER_SIZE + SAMPLING_SIZE + _BIAS.size * limits.max_logit_bias + MAX_EXT_BYTES
    if kind == MessageKind.DECODE:
        return MESSAGE_HEADER_SIZE + 4 + min(row, limits.max_activation_bytes)
    if kind in (MessageKind.PREFILL, MessageKind.VERIFY_WINDOW):
        act = min(limits.max_tokens * row, limits.max_activation_bytes)
        body = MESSAGE_HEADER_SIZE + 4 * limits.max_tokens + act
        if kind == MessageKind.PREFILL:  # a positions block: ext_len (u16) words at most
            body += 4 * 0xFFFF
        return body
    if kind == MessageKind.RESTORE_PREFIX:  # tokens only, looked up and never computed: the protocol's cap
        return MESSAGE_HEADER_SIZE + 4 * MAX_TOKENS
    return MESSAGE_HEADER_SIZE  # trim, stop, ping, cache query


def _body_bounds(kind: int, limits: Limits, n_embd: int | None, flags: int = 0) -> tuple[int, int]:
    if kind in MESSAGE_KINDS:
        assert n_embd is not None
        lo = MESSAGE_HEADER_SIZE
        if kind == MessageKind.CONFIGURE_GENERATION:
            lo += SAMPLING_SIZE
        return lo, _max_message_body(kind, limits, n_embd, flags)
    if kind == ReplyKind.ACK:
        return REPLY_HEADER_SIZE, REPLY_HEADER_SIZE
    if kind == ReplyKind.PREDICTED_TOKEN:
        return REPLY_HEADER_SIZE + 4, REPLY_HEADER_SIZE + 4
    if kind == ReplyKind.PREDICTED_TOKENS:
        return REPLY_HEADER_SIZE, REPLY_HEADER_SIZE + 4 * limits.max_tokens
    if kind == ReplyKind.PREDICTED_TOKEN_LOGPROBS:
        return REPLY_HEADER_SIZE + _LOGPROB.size, REPLY_HEADER_SIZE + _LOGPROB.size * (1 + MAX_TOP_LOGPROBS)
    if kind == ReplyKind.ERROR:
        return REPLY_HEADER_SIZE, REPLY_HEADER_SIZE + limits.max_error_message
    if kind == ReplyKind.PREFIX_RESTORED:
        return REPLY_HEADER_SIZE + 4, REPLY_HEADER_SIZE + 4
    if kind == ReplyKind.STOPPED:
        return REPLY_HEADER_SIZE + 4, REPLY_HEADER_SIZE + 4 * MAX_CACHE_REPORT_STAGES
    if kind == ReplyKind.CACHE_REPORT:
        return REPLY_HEADER_SIZE, REPLY_HEADER_SIZE + CACHE_RECORD_SIZE * MAX_CACHE_REPORT_STAGES
    if kind == ReplyKind.STAGE_REPORT:
        return REPLY_HEADER_SIZE, REPLY_HEADER_SIZE + LOAD_RECORD_SIZE * MAX_CACHE_REPORT_STAGES
    if kind == HandshakeKind.HELLO:
        # generous and version-independent, so a newer peer's Hello can still
        # be read far enough to refuse it with a version message
        return _HELLO_VERSION.size, MAX_HELLO_BODY_BYTES
    if kind == HandshakeKind.HELLO_REPLY:
        return HELLO_REPLY_SIZE, HELLO_REPLY_SIZE + MAX_REASON_BYTES
    if kind == HandshakeKind.LINK_PROBE:
        return _LINK_PROBE.size, _LINK_PROBE.size + MAX_PROBE_PADDING
    raise AssertionError(kind)


def parse_prefix(
    data: Buffer,
    limits: Limits = DEFAULT_LIMITS,
    *,
    n_embd: int | None = None,
    accept: Container[int] | None = None,
) -> FramePrefix:
    """Validate the 8-byte frame prefix; nothing is allocated before this passes.

    ``n_embd`` is the activation width agreed in the handshake; while it is
    None (before the handshake) message frames are refused. ``accept``
    restricts the kinds expected on this connection.
    """
    _need(data, PREFIX_SIZE, "frame prefix")
    magic, kind, flags, body_len = _PREFIX.unpack_from(data)
    if magic != FRAME_MAGIC:
        raise ProtocolError(ErrorCode.BAD_MAGIC, f"bad frame magic {bytes(magic)!r}")
    if kind not in _ALL_KINDS:
        raise ProtocolError(ErrorCode.UNKNOWN_KIND, f"unknown frame kind 0x{kind:02x}")
    if accept is not None and kind not in accept:
        raise ProtocolError(ErrorCode.UNEXPECTED_KIND, f"unexpected {_kind_name(kind)} frame here")
    if kind in MESSAGE_KINDS and n_embd is None:
        raise ProtocolError(ErrorCode.UNEXPECTED_KIND, f"{_kind_name(kind)} before the handshake")
    allowed, required = _ALLOWED_FLAGS[kind], _REQUIRED_FLAGS[kind]
    if flags & ~allowed or flags & required != required:
        raise ProtocolError(ErrorCode.BAD_FLAGS, f"flags 0x{flags:02x} invalid on {_kind_name(kind)}")
    if PREFIX_SIZE + body_len > limits.max_frame_bytes:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"{_kind_name(kind)} body of {body_len} bytes exceeds the frame limit"
        )
    lo, hi = _body_bounds(kind, limits, n_embd, flags)
    if body_len > hi:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"{_kind_name(kind)} body of {body_len} bytes, at most {hi}"
        )
    if body_len < lo:
        raise ProtocolError(
            ErrorCode.LENGTH_MISMATCH, f"{_kind_name(kind)} body of {body_len} bytes, at least {lo}"
        )
    return FramePrefix(kind, flags, body_len)


def parse_message_header(prefix: FramePrefix, data: Buffer, limits: Limits, n_embd: int) -> MessageHeader:
    """Validate a message's fixed 32-byte header against the prefix and limits."""
    _need(data, MESSAGE_HEADER_SIZE, "message header")
    request_id, session_id, pos_start, n_tokens, act_bytes, bias_count, ext_len = _MSG_HEADER.unpack_from(data)
    kind = _MESSAGE_KIND[prefix.kind]  # a dict, not MessageKind(...): this runs for every frame

    def fail(code: ErrorCode, text: str) -> ProtocolError:
        return ProtocolError(code, f"{kind.name}: {text}", request_id=request_id, session_id=session_id)

    positions = bool(prefix.flags & _POSITIONS_FLAG)  # (only PREFILL may carry the flag: parse_prefix)
    restore_len = 0
    if prefix.flags & _RESTORE_FLAG and kind == MessageKind.PREFILL:  # (CLEAR's bit: a CacheQuery's too)
        if positions:
            raise fail(ErrorCode.BAD_FLAGS, "RESTORE with POSITIONS")
        if pos_start:
            raise fail(ErrorCode.BAD_VALUE, f"a restore block at pos_start {pos_start}: only at 0")
        if not 1 <= ext_len <= MAX_TOKENS:
            raise fail(ErrorCode.BAD_VALUE, f"a restore block of {ext_len} keys, expected 1..{MAX_TOKENS}")
        restore_len = ext_len
        ext_bytes = 4 * restore_len
    elif positions:
        if 4 * ext_len < _POSITIONS_HEAD.size:
            raise fail(ErrorCode.LENGTH_MISMATCH, f"positions block of {4 * ext_len} bytes, at least "
                                                  f"{_POSITIONS_HEAD.size}")
        ext_bytes = 4 * ext_len
    else:
        if prefix.flags & _NON_CAUSAL_FLAG:
            raise fail(ErrorCode.BAD_FLAGS, "NON_CAUSAL without POSITIONS")
        if ext_len and kind != MessageKind.CONFIGURE_GENERATION:
            raise fail(ErrorCode.BAD_VALUE, "reserved header field is not zero")
        if 0 < ext_len < _EXT_HEAD.size:
            raise fail(ErrorCode.LENGTH_MISMATCH, f"generation extension of {ext_len} bytes, at least "
                                                  f"{_EXT_HEAD.size}")
        ext_bytes = ext_len
    max_tokens = MAX_TOKENS if kind == MessageKind.RESTORE_PREFIX else limits.max_tokens
    if n_tokens > max_tokens:
        raise fail(ErrorCode.LIMIT_EXCEEDED, f"{n_tokens} tokens, at most {max_tokens}")
    lo, hi = _TOKEN_RANGE[kind]
    if n_tokens < lo or (hi is not None and n_tokens > hi):
        raise fail(ErrorCode.BAD_VALUE, f"{n_tokens} tokens, expected {lo}..{hi if hi is not None else 'max'}")
    if act_bytes > limits.max_activation_bytes:
        raise fail(
            ErrorCode.LIMIT_EXCEEDED, f"activation of {act_bytes} bytes, at most {limits.max_activation_bytes}"
        )
    width = 2 if prefix.flags & _F16_FLAG else 4  # bytes a value
    if width == 2 and not act_bytes:
        raise fail(ErrorCode.BAD_FLAGS, "F16 without an activation")
    if act_bytes and act_bytes != n_tokens * n_embd * width:
        raise fail(
            ErrorCode.LENGTH_MISMATCH,
            f"activation of {act_bytes} bytes, expected {n_tokens} x {n_embd} x {width} = "
            f"{n_tokens * n_embd * width}",
        )
    if bias_count > limits.max_logit_bias:
        raise fail(ErrorCode.LIMIT_EXCEEDED, f"{bias_count} logit-bias entries, at most {limits.max_logit_bias}")
    sampling = bool(prefix.flags & _SAMPLING_FLAG)
    if bias_count and not sampling:
        raise fail(ErrorCode.BAD_VALUE, "logit-bias entries without a sampling block")
    if act_bytes and kind == MessageKind.RESTORE_PREFIX:
        raise fail(ErrorCode.BAD_VALUE, "an activation on a message that carries none")
    if pos_start < 0 or (kind in _NO_POSITION and pos_start):
        raise fail(ErrorCode.BAD_VALUE, f"pos_start {pos_start} invalid")
    if pos_start + n_tokens > MAX_POSITION:
        raise fail(ErrorCode.BAD_VALUE, f"positions {pos_start}+{n_tokens} overflow int32")
    if kind in _NO_SESSION and session_id:
        raise fail(ErrorCode.BAD_VALUE, "session_id must be 0")
    tail_len = (SAMPLING_SIZE + _BIAS.size * bias_count if sampling else 0) + ext_bytes + 4 * n_tokens
    expected = MESSAGE_HEADER_SIZE + tail_len + act_bytes
    if expected != prefix.body_len:
        raise fail(ErrorCode.LENGTH_MISMATCH, f"body of {prefix.body_len} bytes, header says {expected}")
    if restore_len:
        ext_bytes = 0  # the restore block's keys: restore_len
    return MessageHeader(
        kind, prefix.flags, request_id, session_id, pos_start, n_tokens, act_bytes, bias_count, tail_len, ext_bytes,
        restore_len
    )


def decode_message(header: MessageHeader, tail: Buffer, activation: Buffer | None, n_embd: int) -> Message:
    """Build the message from its parsed header, its tail and its activation bytes.

    The tokens and a float32 activation are numpy views of ``tail`` and
    ``activation`` (no copy; writable if those are bytearrays); a half-float
    activation (flag F16) is widened to a new float32 array.
    """
    kind = header.kind
    try:
        if len(tail) != header.tail_len:
            raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"tail of {len(tail)} bytes, expected {header.tail_len}")
        act_len = 0 if activation is None else len(activation)
        if act_len != header.activation_bytes:
            raise ProtocolError(
                ErrorCode.LENGTH_MISMATCH, f"activation of {act_len} bytes, expected {header.activation_bytes}"
            )
        if kind == MessageKind.CONFIGURE_GENERATION:
            return ConfigureGeneration(
                header.request_id,
                header.session_id,
                _decode_sampling(tail, header.bias_count, header.ext_len),
                direct_return=bool(header.flags & _DIRECT_RETURN_FLAG),
            )
        if kind == MessageKind.TRIM_SESSION:
            return TrimSession(header.request_id, header.session_id, header.pos_start)
        if kind == MessageKind.STOP:
            return Stop(header.request_id, header.session_id)
        if kind == MessageKind.PING:
            return Ping(header.request_id)
        if kind == MessageKind.CACHE_QUERY:
            return CacheQuery(header.request_id, bool(header.flags & _CLEAR_FLAG),
                              bool(header.flags & _CLEAR_DISK_FLAG))
        if kind == MessageKind.STAGE_QUERY:
            return StageQuery(header.request_id)
        offset = header.tail_len - 4 * header.token_count
        tokens = np.frombuffer(tail, dtype="<i4", count=header.token_count, offset=offset)
        act = None
        if header.activation_bytes:
            if header.flags & _F16_FLAG:
                act = np.frombuffer(activation, dtype=_F2).reshape(header.token_count, n_embd).astype(_F4)
            else:
                act = np.frombuffer(activation, dtype=_F4).reshape(header.token_count, n_embd)
        if kind == MessageKind.RESTORE_PREFIX:
            return RestorePrefix(header.request_id, header.session_id, tokens)
        # parse_message_header checked the ids, positions, token count and activation size: built as trusted
        if kind == MessageKind.PREFILL:
            media = _decode_positions(header, tail, tokens) if header.flags & _POSITIONS_FLAG else None
            restore = (np.frombuffer(tail, dtype="<i4", count=header.restore_len) if header.restore_len
                       else None)
            return trusted(PrefillChunk, header.request_id, header.session_id, header.pos_start, tokens, act,
                           bool(header.flags & _FINAL_FLAG), media, restore)
        if kind == MessageKind.DECODE:
            return trusted(DecodeStep, header.request_id, header.session_id, header.pos_start, tokens, act,
                           bool(header.flags & _DIRECT_RETURN_FLAG))
        return trusted(VerifyWindow, header.request_id, header.session_id, header.pos_start, tokens, act,
                       bool(header.flags & _CHAINED_FLAG))
    except ProtocolError as exc:
        exc.request_id, exc.session_id = header.request_id, header.session_id
        raise
    except (ValueError, TypeError, OverflowError) as exc:
        raise ProtocolError(
            ErrorCode.BAD_VALUE,
            f"{kind.name}: {exc}",
            request_id=header.request_id,
            session_id=header.session_id,
        ) from exc


def _decode_sampling(tail: Buffer, bias_count: int, ext_len: int = 0) -> SamplingParams:
    (temperature, top_k, top_p, min_p, repeat, presence, frequency, last_n, seed) = _SAMPLING.unpack_from(tail)
    ext_at = SAMPLING_SIZE + _BIAS.size * bias_count
    bias = tuple(_BIAS.iter_unpack(memoryview(tail)[SAMPLING_SIZE:ext_at]))
    constraint, logprobs = _decode_extension(memoryview(tail)[ext_at : ext_at + ext_len])
    return SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repeat_penalty=repeat,
        presence_penalty=presence,
        frequency_penalty=frequency,
        penalty_last_n=last_n,
        seed=seed,
        logit_bias=bias,
        constraint=constraint,
        logprobs=logprobs,
    )


def _decode_extension(ext: memoryview) -> tuple[Constraint | None, int | None]:
    if not len(ext):
        return None, None
    code, logprobs, reserved = _EXT_HEAD.unpack_from(ext)
    if reserved:
        raise ProtocolError(ErrorCode.BAD_VALUE, "generation extension: reserved field is not zero")
    if logprobs != _NO_LOGPROBS and logprobs > MAX_TOP_LOGPROBS:
        raise ProtocolError(ErrorCode.BAD_VALUE, f"generation extension: {logprobs} logprobs, at most "
                            f"{MAX_TOP_LOGPROBS}")
    text = bytes(ext[_EXT_HEAD.size:]).decode("utf-8")  # a UnicodeDecodeError is a ValueError: BAD_VALUE
    if code == 0:
        if text:
            raise ProtocolError(ErrorCode.BAD_VALUE, "generation extension: text without a constraint")
        constraint = None
    elif code in _CONSTRAINT_KINDS:
        constraint = Constraint(_CONSTRAINT_KINDS[code], text)  # compiled where it is used: the final stage
    else:
        raise ProtocolError(ErrorCode.BAD_VALUE, f"generation extension: unknown constraint kind {code}")
    return constraint, None if logprobs == _NO_LOGPROBS else logprobs


def _decode_positions(header: MessageHeader, tail: Buffer, tokens: np.ndarray) -> MediaRows:
    """A prefill chunk's positions block (its media rows), checked as MediaRows checks them (ProtocolError
    BAD_VALUE) and against the block's length (LENGTH_MISMATCH)."""
    sections, reserved, reserved2, pos_end = _POSITIONS_HEAD.unpack_from(tail)
    n, start = header.token_count, header.pos_start
    if reserved or reserved2 or sections not in (1, MAX_POSITION_SECTIONS):
        raise ProtocolError(ErrorCode.BAD_VALUE, f"PREFILL: positions block of {sections} sections (1 or "
                                                 f"{MAX_POSITION_SECTIONS}), or a reserved field set")
    if not start <= pos_end <= MAX_POSITION:
        raise ProtocolError(ErrorCode.BAD_VALUE, f"PREFILL: pos_end {pos_end} outside [{start}, {MAX_POSITION}]")
    n_keys = pos_end - start
    if _POSITIONS_HEAD.size + 4 * (n_keys + sections * n) != header.ext_len:
        raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"PREFILL: positions block of {header.ext_len} bytes for "
                                                       f"{n_keys} keys and {sections} x {n} positions")
    at = _POSITIONS_HEAD.size
    keys = np.frombuffer(tail, dtype="<i4", count=n_keys, offset=at)
    positions = np.frombuffer(tail, dtype="<i4", count=sections * n, offset=at + 4 * n_keys).reshape(sections, n)
    media = MediaRows(positions, pos_end, keys, causal=not header.flags & _NON_CAUSAL_FLAG)
    check_media_rows(media, start, tokens)  # ValueError: BAD_VALUE (decode_message)
    return media


def _need(body: Buffer, size: int, what: str) -> None:
    if len(body) < size:
        raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"{what} of {len(body)} bytes, at least {size}")


_RECORD_KINDS = (ReplyKind.CACHE_REPORT, ReplyKind.STAGE_REPORT, ReplyKind.STOPPED)  # one record per stage


def decode_reply(prefix: FramePrefix, body: Buffer) -> Reply:
    """Decode a reply body (its size was bounded by :func:`parse_prefix`)."""
    _need(body, REPLY_HEADER_SIZE, "reply")
    (request_id, session_id, count, code, reserved, *stats) = _REPLY_HEADER.unpack_from(body)
    kind = _REPLY_KIND[prefix.kind]  # a dict, not ReplyKind(...): this runs for every reply
    ids = {"request_id": request_id, "session_id": session_id}
    if reserved or (code and kind != ReplyKind.ERROR):
        raise ProtocolError(ErrorCode.BAD_VALUE, f"{kind.name}: reserved field or code set", **ids)
    unit = (1 if kind == ReplyKind.ERROR else CACHE_RECORD_SIZE if kind == ReplyKind.CACHE_REPORT
            else LOAD_RECORD_SIZE if kind == ReplyKind.STAGE_REPORT
            else _LOGPROB.size if kind == ReplyKind.PREDICTED_TOKEN_LOGPROBS else 4)
    if (kind == ReplyKind.ACK and count != 0 or kind == ReplyKind.PREDICTED_TOKEN and count != 1
            or kind == ReplyKind.PREFIX_RESTORED and count != 1 or kind == ReplyKind.STOPPED and count == 0
            or kind == ReplyKind.PREDICTED_TOKEN_LOGPROBS and not 1 <= count <= 1 + MAX_TOP_LOGPROBS):
        raise ProtocolError(ErrorCode.BAD_VALUE, f"{kind.name}: count {count}", **ids)
    if kind in _RECORD_KINDS and count > MAX_CACHE_REPORT_STAGES:
        raise ProtocolError(ErrorCode.LIMIT_EXCEEDED, f"{kind.name}: {count} records, at most "
                            f"{MAX_CACHE_REPORT_STAGES}", **ids)
    if REPLY_HEADER_SIZE + unit * count != len(body):
        raise ProtocolError(
            ErrorCode.LENGTH_MISMATCH, f"{kind.name}: body of {len(body)} bytes, count says {count}", **ids
        )
    stage_stats = TRUSTED[StageStats](*stats)  # u64s and u32s by the struct format
    try:
        # the ids are u64 and the token an i32 by their struct formats: built as trusted
        if kind == ReplyKind.ACK:
            return trusted(Ack, request_id, session_id, stage_stats)
        if kind == ReplyKind.PREDICTED_TOKEN:
            (token,) = _TOKEN.unpack_from(body, REPLY_HEADER_SIZE)
            return trusted(PredictedToken, request_id, session_id, token, stage_stats)
        if kind == ReplyKind.PREDICTED_TOKEN_LOGPROBS:
            entries = list(_LOGPROB.iter_unpack(memoryview(body)[REPLY_HEADER_SIZE:]))
            (token, logprob), top = entries[0], tuple(entries[1:])
            return PredictedTokenLogprobs(request_id, session_id, token, stage_stats, logprob, top)
        if kind == ReplyKind.PREDICTED_TOKENS:
            tokens = np.frombuffer(body, dtype="<i4", count=count, offset=REPLY_HEADER_SIZE)
            return PredictedTokens(request_id, session_id, tokens, stage_stats)
        if kind == ReplyKind.PREFIX_RESTORED:
            (restored,) = _U32.unpack_from(body, REPLY_HEADER_SIZE)
            return PrefixRestored(request_id, session_id, restored, stage_stats)
        if kind == ReplyKind.CACHE_REPORT:
            return CacheReport(request_id, session_id, _decode_cache_records(body, count), stage_stats)
        if kind == ReplyKind.STOPPED:
            cached = struct.unpack_from(f"<{count}I", body, REPLY_HEADER_SIZE)
            return Stopped(request_id, session_id, cached, stage_stats)
        if kind == ReplyKind.STAGE_REPORT:
            records = _LOAD_RECORD.iter_unpack(memoryview(body)[REPLY_HEADER_SIZE:REPLY_HEADER_SIZE
                                                                 + LOAD_RECORD_SIZE * count])
            return StageReport(request_id, session_id, tuple(StageLoad(*r) for r in records), stage_stats)
        message = bytes(memoryview(body)[REPLY_HEADER_SIZE:]).decode("utf-8")
        return ErrorReply(request_id, session_id, code, message, stage_stats)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ProtocolError(ErrorCode.BAD_VALUE, f"{kind.name}: {exc}", **ids) from exc


def _decode_cache_records(body: Buffer, count: int) -> tuple[CacheStats, ...]:
    records = []
    for stage_index, flags, *counters in _CACHE_RECORD.iter_unpack(
        memoryview(body)[REPLY_HEADER_SIZE : REPLY_HEADER_SIZE + CACHE_RECORD_SIZE * count]
    ):
        if flags & ~1:
            raise ValueError(f"cache record of stage {stage_index}: unknown flags 0x{flags:x}")
        memory, disk = counters[:9], counters[9:]
        records.append(CacheStats(stage_index, *memory, bool(flags & 1), *disk))
    return tuple(records)


def hello_version(body: Buffer) -> int:
    """The protocol version of a Hello body (readable in every version)."""
    _need(body, _HELLO_VERSION.size, "hello")
    magic, version = _HELLO_VERSION.unpack_from(body)
    if magic != HELLO_MAGIC:
        raise ProtocolError(ErrorCode.BAD_MAGIC, f"bad hello magic {bytes(magic)!r}")
    return version


def decode_hello(body: Buffer, limits: Limits = DEFAULT_LIMITS) -> Hello:
    """Decode a Hello body; a different protocol version raises
    ``ProtocolError(VERSION_MISMATCH, "protocol version mismatch: peer X, ours Y")``."""
    version = hello_version(body)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.VERSION_MISMATCH, f"protocol version mismatch: peer {version}, ours {PROTOCOL_VERSION}"
        )
    if len(body) < HELLO_SIZE:
        raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"hello of {len(body)} bytes, at least {HELLO_SIZE}")
    (_, _, role, formats, fingerprint, stage_index, layer_start, layer_end, n_layer, n_embd, auth_len, node_len) = (
        _HELLO.unpack_from(body)
    )
    if auth_len > MAX_AUTH_BYTES or node_len > MAX_NODE_NAME_BYTES:
        raise ProtocolError(ErrorCode.LIMIT_EXCEEDED, f"hello auth of {auth_len} or node name of {node_len} bytes")
    if len(body) != HELLO_SIZE + auth_len + node_len:
        raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"hello of {len(body)} bytes, fields say otherwise")
    if not 1 <= n_embd <= limits.max_n_embd:
        raise ProtocolError(ErrorCode.LIMIT_EXCEEDED, f"hello n_embd {n_embd}, at most {limits.max_n_embd}")
    if role not in Role._value2member_map_:
        raise ProtocolError(ErrorCode.BAD_VALUE, f"hello role {role} invalid")
    view = memoryview(body)
    try:
        return Hello(
            fingerprint=bytes(fingerprint),
            stage_index=stage_index,
            layer_start=layer_start,
            layer_end=layer_end,
            n_layer=n_layer,
            n_embd=n_embd,
            role=Role(role),
            version=version,
            auth=bytes(view[HELLO_SIZE : HELLO_SIZE + auth_len]),
            node=bytes(view[HELLO_SIZE + auth_len :]).decode("utf-8"),
            wire_formats=formats,  # checked by Hello: F32 set, no unknown bit (BAD_VALUE below)
        )
    except (ValueError, TypeError) as exc:
        raise ProtocolError(ErrorCode.BAD_VALUE, f"hello: {exc}") from exc


def decode_hello_reply(body: Buffer) -> HelloReply:
    _need(body, HELLO_REPLY_SIZE, "hello reply")
    accepted, reserved, reason_len = _HELLO_REPLY.unpack_from(body)
    if accepted > 1 or reserved:
        raise ProtocolError(ErrorCode.BAD_VALUE, "hello reply: bad accepted/reserved byte")
    if len(body) != HELLO_REPLY_SIZE + reason_len:
        raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"hello reply of {len(body)} bytes, reason of {reason_len}")
    try:
        reason = bytes(memoryview(body)[HELLO_REPLY_SIZE:]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_VALUE, f"hello reply: {exc}") from exc
    return HelloReply(bool(accepted), reason)


def decode_body(prefix: FramePrefix, body: Buffer, limits: Limits = DEFAULT_LIMITS) -> Reply | Hello | HelloReply:
    """Decode the body of a reply or handshake frame (messages: see :func:`decode_message`)."""
    if prefix.kind in REPLY_KINDS:
        return decode_reply(prefix, body)
    if prefix.kind == HandshakeKind.HELLO:
        return decode_hello(body, limits)
    if prefix.kind == HandshakeKind.HELLO_REPLY:
        return decode_hello_reply(body)
    if prefix.kind == HandshakeKind.LINK_PROBE:
        return decode_link_probe(body)
    raise ProtocolError(ErrorCode.UNEXPECTED_KIND, f"{_kind_name(prefix.kind)} is a message frame")


def decode_frame(
    data: Buffer,
    *,
    n_embd: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
    accept: Container[int] | None = None,
) -> Frame:
    """Decode exactly one complete frame held in ``data`` (views into it, no copies)."""
    view = memoryview(data)
    if len(view) < PREFIX_SIZE:
        raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"frame of {len(view)} bytes is shorter than its prefix")
    prefix = parse_prefix(view, limits, n_embd=n_embd, accept=accept)
    if len(view) != PREFIX_SIZE + prefix.body_len:
        raise ProtocolError(
            ErrorCode.LENGTH_MISMATCH, f"frame of {len(view)} bytes, prefix says {PREFIX_SIZE + prefix.body_len}"
        )
    return decode_parsed(prefix, view[PREFIX_SIZE:], n_embd=n_embd, limits=limits)


# A one-token decode step with its activation: the frame every stage after the head reads for every token.
_DECODE_STEP = struct.Struct(_PREFIX.format + _MSG_HEADER.format[1:] + "i")  # prefix, message header, token
DECODE_KIND = int(MessageKind.DECODE)


def decode_step_at(data: Buffer, pos: int, n_embd: int, limits: Limits) -> tuple[DecodeStep, int] | None:
    """The frame starting at ``data[pos]``, decoded in one unpack if it is a valid one-token decode step
    with its activation, all of it in ``data``: (the step, where its frame ends). None for any other
    frame, which the general path (:func:`parse_prefix`, :func:`decode_parsed`) decodes or refuses with
    the reason. The step is the general path's (a property test checks it): the body is copied out, the
    token and the activation are views of the copy.
    """
    if len(data) - pos < _DECODE_STEP.size:
        return None
    (magic, kind, flags, body_len, request_id, session_id, pos_start, n_tokens, act_bytes, bias_count, reserved,
     _token) = _DECODE_STEP.unpack_from(data, pos)
    half = flags & _F16_FLAG
    act = (2 if half else 4) * n_embd
    end = pos + PREFIX_SIZE + body_len
    if (kind != DECODE_KIND or flags & ~(_DIRECT_RETURN_FLAG | _F16_FLAG) or n_tokens != 1 or act_bytes != act
            or not act
            or bias_count or reserved or body_len != MESSAGE_HEADER_SIZE + 4 + act or magic != FRAME_MAGIC
            or not 0 <= pos_start < MAX_POSITION or end > len(data)
            or PREFIX_SIZE + body_len > limits.max_frame_bytes or act > limits.max_activation_bytes
            or limits.max_tokens < 1):
        return None
    body = bytearray(memoryview(data)[pos + PREFIX_SIZE:end])
    tokens = np.frombuffer(body, dtype="<i4", count=1, offset=MESSAGE_HEADER_SIZE)
    if half:
        activation = np.frombuffer(body, dtype=_F2, offset=MESSAGE_HEADER_SIZE + 4).reshape(1, n_embd).astype(_F4)
    else:
        activation = np.frombuffer(body, dtype=_F4, offset=MESSAGE_HEADER_SIZE + 4).reshape(1, n_embd)
    return (_trusted_step(request_id, session_id, pos_start, tokens, activation, bool(flags & _DIRECT_RETURN_FLAG)),
            end)


_trusted_step = TRUSTED[DecodeStep]

# The replies every stage before the last reads for every token: an Ack, or a PredictedToken (its token after
# the reply header).
_ACK_FRAME = struct.Struct(_PREFIX.format + _REPLY_HEADER.format[1:])
_TOKEN_FRAME = struct.Struct(_ACK_FRAME.format + "i")
_ACK_KIND = int(ReplyKind.ACK)
_TOKEN_KIND = int(ReplyKind.PREDICTED_TOKEN)
_trusted_stats, _trusted_ack, _trusted_token = TRUSTED[StageStats], TRUSTED[Ack], TRUSTED[PredictedToken]


def decode_reply_at(data: Buffer, pos: int, limits: Limits,
                    accept: Container[int] | None) -> tuple[Ack | PredictedToken, int] | None:
    """The frame starting at ``data[pos]``, decoded in one unpack if it is a valid Ack or PredictedToken (of a
    kind in ``accept``), all of it in ``data``: (the reply, where its frame ends). None for any other frame,
    which the general path decodes or refuses with the reason; a property test checks that the two agree.
    """
    avail = len(data) - pos
    if avail < _ACK_FRAME.size:
        return None
    kind = data[pos + 2]
    if kind == _ACK_KIND:
        layout, count = _ACK_FRAME, 0
    elif kind == _TOKEN_KIND and avail >= _TOKEN_FRAME.size:
        layout, count = _TOKEN_FRAME, 1
    else:
        return None
    fields = layout.unpack_from(data, pos)
    magic, _kind, flags, body_len, request_id, session_id, n, code, reserved = fields[:9]
    if (magic != FRAME_MAGIC or flags or n != count or code or reserved or body_len != layout.size - PREFIX_SIZE
            or layout.size > limits.max_frame_bytes or accept is not None and kind not in accept):
        return None
    stats = _trusted_stats(*fields[9:17])
    if count:
        return _trusted_token(request_id, session_id, fields[17], stats), pos + layout.size
    return _trusted_ack(request_id, session_id, stats), pos + layout.size


def decode_parsed(prefix: FramePrefix, body: Buffer, *, n_embd: int | None, limits: Limits = DEFAULT_LIMITS) -> Frame:
    """Decode a frame whose prefix :func:`parse_prefix` accepted, from its whole body (views into it)."""
    body = memoryview(body)
    if prefix.kind not in MESSAGE_KINDS:
        return decode_body(prefix, body, limits)
    assert n_embd is not None
    header = parse_message_header(prefix, body, limits, n_embd)
    tail_end = MESSAGE_HEADER_SIZE + header.tail_len
    activation = body[tail_end:] if header.activation_bytes else None
    return decode_message(header, body[MESSAGE_HEADER_SIZE:tail_end], activation, n_embd)
