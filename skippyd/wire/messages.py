"""Frames of the stage-to-stage protocol: kinds, limits and the message classes.

Pure data, no I/O. The byte layout lives in :mod:`skippyd.wire.codec` and in
``skippy-protocol(7)``; this module says *what* travels:

* upstream → downstream **messages**: :class:`ConfigureGeneration`,
  :class:`PrefillChunk` (``final`` flag), :class:`DecodeStep`,
  :class:`VerifyWindow`, :class:`TrimSession`, :class:`Stop`, :class:`Ping`,
  :class:`RestorePrefix`, :class:`CacheQuery`, :class:`StageQuery`;
* downstream → upstream **replies**: :class:`Ack`, :class:`PredictedToken`,
  :class:`PredictedTokens`, :class:`ErrorReply`, :class:`PrefixRestored`,
  :class:`CacheReport` (of :class:`CacheStats` records), :class:`StageReport` (of
  :class:`StageLoad` records), :class:`Stopped`, each with :class:`StageStats`;
* the **handshake**: :class:`Hello` and :class:`HelloReply`, then (a timed link) :class:`LinkProbe`.

Tokens are 1-D ``int32`` numpy arrays, activations 2-D ``float32`` arrays of
shape ``(len(tokens), n_embd)`` or ``None``. Constructors accept anything
``numpy.asarray`` does and validate against the protocol's hard limits, so a
message that exists can be encoded.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import ClassVar, TypeAlias, TypeVar

import attrs
import numpy as np

from skippyd.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, RANDOM_SEED, SamplingParams

__all__ = [
    "ACTIVATION_WIRES",
    "DEFAULT_LIMITS",
    "DEFAULT_SEED",
    "MAX_ACTIVATION_BYTES",
    "MAX_AUTH_BYTES",
    "MAX_CACHE_REPORT_STAGES",
    "MAX_ERROR_MESSAGE_BYTES",
    "MAX_FRAME_BYTES",
    "MAX_HELLO_BODY_BYTES",
    "MAX_LOGIT_BIAS",
    "MAX_NODE_NAME_BYTES",
    "MAX_N_EMBD",
    "MAX_POSITION",
    "MAX_PROBE_PADDING",
    "MAX_REASON_BYTES",
    "MAX_TOKENS",
    "NO_STATS",
    "PROTOCOL_VERSION",
    "ProbeStep",
    "Ack",
    "CacheQuery",
    "CacheReport",
    "CacheStats",
    "ConfigureGeneration",
    "DecodeStep",
    "ErrorCode",
    "ErrorReply",
    "F16_RATIO",
    "Flags",
    "Frame",
    "HandshakeKind",
    "Hello",
    "LinkProbe",
    "HelloReply",
    "Limits",
    "Message",
    "MediaRows",
    "check_media_rows",
    "MessageKind",
    "Ping",
    "PredictedToken",
    "PredictedTokenLogprobs",
    "PredictedTokens",
    "PrefillChunk",
    "PrefixRestored",
    "Reply",
    "ReplyKind",
    "RestorePrefix",
    "Role",
    "SamplingParams",
    "StageLoad",
    "StageQuery",
    "StageReport",
    "StageStats",
    "StatsTotal",
    "Stop",
    "Stopped",
    "TrimSession",
    "VerifyWindow",
    "WireFormat",
    "merge",
    "f16_threshold_Bps",
    "link_timed",
    "negotiate_wire",
    "wire_formats",
]

# 2: DIRECT_RETURN on DecodeStep (no lane reply from the final stage); 3: on a DecodeStep to a middle stage
# too (no lane reply on success, an Error on the lane on failure); 4: the prefix cache's RestorePrefix and
# CacheQuery (flag CLEAR), answered by PrefixRestored and CacheReport; 5: ConfigureGeneration's generation
# extension (a constraint on the output, the logprobs wanted), answered per token by PredictedTokenLogprobs;
# 6: StageQuery, answered by StageReport (each stage's load, for the console); 7: PrefillChunk's media rows (flag
# POSITIONS: rows that are no tokens, such as an image's, with explicit positions, one or four per row, and the
# keys of the positions they take; NON_CAUSAL); 8: cache records carry the disk tier (128 bytes), CacheQuery's
# CLEAR_DISK; 9: the Hello's activation encodings (byte 7, was reserved) and flag F16 on PREFILL, DECODE and
# VERIFY_WINDOW (an activation of half floats); 11: PREFILL's flag RESTORE (a restore block: the first chunk of a
# prompt carries the prefix cache lookup that RestorePrefix made a trip of its own), Stop answered by STOPPED
# (each stage's prompt positions held rather than computed), the Hello's TIMED bit and LINK_PROBE (a link timed
# after the handshake, its activations' encoding chosen from its rate)
PROTOCOL_VERSION = 11

# Hard limits of the protocol (the same in every version). A receiver may be configured tighter
# (see Limits), never looser.
MAX_TOKENS = 8192  # tokens (positions) in one message or reply
MAX_N_EMBD = 65536  # activation width
MAX_ACTIVATION_BYTES = 256 * 1024 * 1024  # activation payload of one message
MAX_ERROR_MESSAGE_BYTES = 4096  # UTF-8 bytes of an ErrorReply message
MAX_REASON_BYTES = 1024  # UTF-8 bytes of a HelloReply refusal reason
MAX_AUTH_BYTES = 64  # Hello auth field
MAX_NODE_NAME_BYTES = 255  # Hello node name (UTF-8)
MAX_HELLO_BODY_BYTES = 4096  # any Hello body, in every protocol version
MAX_FRAME_BYTES = MAX_ACTIVATION_BYTES + 64 * 1024  # prefix + body of any frame
MAX_POSITION = 2**31 - 1  # positions are llama_pos (int32)
MAX_POSITION_SECTIONS = 4  # positions per row at most (M-RoPE: time, row, column and a fourth)
NO_TOKEN = -1  # the token of a row that is not a token (a media row): llama.cpp's LLAMA_TOKEN_NULL
MAX_CACHE_REPORT_STAGES = 256  # CacheStats records in one CacheReport (one per stage)
DEFAULT_SEED = RANDOM_SEED  # a seed of None on the wire

_U32 = 2**32 - 1
_U64 = 2**64 - 1


class HandshakeKind(enum.IntEnum):
    """Frame kinds exchanged before any message."""

    HELLO = 0x01
    HELLO_REPLY = 0x02
    LINK_PROBE = 0x03


class MessageKind(enum.IntEnum):
    """Upstream → downstream frame kinds."""

    CONFIGURE_GENERATION = 0x10
    PREFILL = 0x11
    DECODE = 0x12
    VERIFY_WINDOW = 0x13
    TRIM_SESSION = 0x14
    STOP = 0x15
    PING = 0x16
    RESTORE_PREFIX = 0x17
    CACHE_QUERY = 0x18
    STAGE_QUERY = 0x1F  # the end of the range: an operator's query, apart from the data path's kinds


class ReplyKind(enum.IntEnum):
    """Downstream → upstream frame kinds."""

    ACK = 0x20
    PREDICTED_TOKEN = 0x21
    PREDICTED_TOKENS = 0x22
    ERROR = 0x23
    PREFIX_RESTORED = 0x24
    CACHE_REPORT = 0x25
    PREDICTED_TOKEN_LOGPROBS = 0x26
    STOPPED = 0x27
    STAGE_REPORT = 0x2F


class Flags(enum.IntFlag):
    """The flags byte of the frame prefix.

    ``FINAL`` is only valid on ``PREFILL`` (the last chunk of a prompt: the
    final stage answers it with a prediction). ``POSITIONS``, only on
    ``PREFILL``: its rows are media rows with explicit positions (the
    positions block, see skippy-protocol(7)); ``NON_CAUSAL``, only with
    ``POSITIONS``: its rows attend to each other both ways (one batch, causal
    attention off). ``F16``, only on ``PREFILL``, ``DECODE`` and
    ``VERIFY_WINDOW`` with an activation: it travels as IEEE half floats
    (2 bytes a value, see :class:`WireFormat`). ``SAMPLING`` marks a sampling
    block; it is required on ``CONFIGURE_GENERATION`` and invalid elsewhere
    in version 2. ``DIRECT_RETURN`` on ``CONFIGURE_GENERATION``: the final
    stage sends this session's predictions on the token-return connection
    and answers those messages on the lane with an ``Ack``. On ``DECODE``
    (set by the stage just before the final stage, for such a session): the
    final stage sends the prediction, or the error, on the token-return
    connection only, and no reply on the lane. ``CLEAR``, only on
    ``CACHE_QUERY``: each stage empties its prefix cache before it reports; ``CLEAR_DISK``, only there
    too: its disk tier as well. ``CHAINED`` (FINAL's bit), only on ``VERIFY_WINDOW``: the window was sent
    before the one ahead of it was answered, drafted as if that one were accepted in full and its next
    token were this window's first; the final stage drops it, unsampled, when that is not so.
    ``RESTORE`` (CLEAR's bit), only on ``PREFILL`` at position 0 without ``POSITIONS``: the chunk carries a
    restore block (keys), and each stage restores the longest prefix of them it has cached, as for a
    ``RESTORE_PREFIX``, before it computes the chunk.
    Every other bit must be zero.
    """

    NONE = 0
    FINAL = 0x01
    SAMPLING = 0x02
    DIRECT_RETURN = 0x04
    CLEAR = 0x08
    POSITIONS = 0x10
    NON_CAUSAL = 0x20
    F16 = 0x40
    CLEAR_DISK = 0x80
    CHAINED = 0x01  # FINAL's bit, on VERIFY_WINDOW (an alias: flags are read per kind)
    RESTORE = 0x08  # CLEAR's bit, on PREFILL


class WireFormat(enum.IntFlag):
    """How activations travel on a lane: the encodings a Hello offers (its byte 7), one bit each.

    Every end takes ``F32``. ``TIMED``, on a dialer's Hello only: the dialer chooses the lane's encoding from
    the link's rate (``runtime.activation_wire = "auto"``), timed right after the handshake
    (:class:`LinkProbe`) when the acceptor offers ``F16``. A lane carries ``F16`` (half the bytes; the
    receiver widens each value back to float32 before its layers) when both Hellos offer it and the dialer
    chose it: always without ``TIMED`` (:func:`negotiate_wire`), on a timed link when the link is slow
    (skippyd/stage/link_choice.py); else ``F32``.
    """

    F32 = 0x01
    F16 = 0x02
    TIMED = 0x04


# runtime.activation_wire: "auto" offers both and lets the dialer of each link choose from its measured rate
# (f32 unless the link is slow); "f16" offers both and takes f16 wherever the peer does; "f32" offers float32 only
ACTIVATION_WIRES = ("auto", "f32", "f16")


def wire_formats(activation_wire: str) -> WireFormat:
    """The encodings a Hello offers for ``runtime.activation_wire`` ("auto": both, timed; "f16": both; "f32":
    float32 only)."""
    if activation_wire not in ACTIVATION_WIRES:
        raise ValueError(f"activation_wire must be one of {', '.join(ACTIVATION_WIRES)}, got {activation_wire!r}")
    return {"auto": WireFormat.F32 | WireFormat.F16 | WireFormat.TIMED, "f16": WireFormat.F32 | WireFormat.F16,
            "f32": WireFormat.F32}[activation_wire]


# "auto": a link takes f16 once an f32 row takes this many times a row's compute on it (f16 then saves at least
# a fifth of each prompt row's time; the reasoning is in skippyd/stage/link_choice.py)
F16_RATIO = 1.25


def f16_threshold_Bps(n_embd: int, row_compute_s: float) -> float | None:
    """The link rate (bytes/s) at or below which "auto" takes f16: an f32 row (4 × n_embd bytes) takes
    F16_RATIO times the sending stage's compute of a row there. None while the compute is unknown."""
    if row_compute_s <= 0 or n_embd <= 0:
        return None
    return 4 * n_embd / (F16_RATIO * row_compute_s)


def negotiate_wire(ours: Hello, theirs: Hello) -> WireFormat:
    """The encoding of an untimed lane's activations, the same at both ends: the most compact one both Hellos
    offer (a timed lane's dialer chooses, see :func:`link_timed`)."""
    return WireFormat.F16 if ours.wire_formats & theirs.wire_formats & WireFormat.F16 else WireFormat.F32


def link_timed(dialer: Hello, acceptor: Hello) -> bool:
    """Whether a lane is timed after its handshake (LinkProbe frames): its dialer asks (TIMED) and its acceptor
    would take half floats. Both ends know both Hellos, so both decide alike. A token-return connection
    carries no activations and is never timed."""
    return bool(dialer.role == Role.LANE and dialer.wire_formats & WireFormat.TIMED
                and acceptor.wire_formats & WireFormat.F16)


class ErrorCode(enum.IntEnum):
    """Codes of ErrorReply and ProtocolError.

    1–31: protocol errors; the connection is closed after the reply.
    32 and up: request errors; the connection stays usable.
    """

    # protocol errors (connection closes)
    BAD_MAGIC = 1
    UNKNOWN_KIND = 2
    UNEXPECTED_KIND = 3
    BAD_FLAGS = 4
    FRAME_TOO_LARGE = 5
    LIMIT_EXCEEDED = 6
    LENGTH_MISMATCH = 7
    BAD_VALUE = 8
    VERSION_MISMATCH = 9
    # request errors (connection stays open)
    UNKNOWN_SESSION = 32
    SESSION_BUSY = 33  # reserved, never sent: a Configure of a session already open configures it again
    NO_CAPACITY = 34
    POSITION_GAP = 35
    CONTEXT_FULL = 36
    MISSING_ACTIVATION = 37
    COMPUTE_FAILED = 38
    DOWNSTREAM_FAILED = 39
    SHUTTING_DOWN = 40
    INTERNAL = 41
    DIRECT_RETURN_UNAVAILABLE = 42
    UNSUPPORTED_REQUEST = 43  # well formed, but not servable as asked (a constraint that does not compile, ...)

    @property
    def closes_connection(self) -> bool:
        return self.value < 32


class Role(enum.IntEnum):
    """What a connection is for, stated in both Hellos.

    ``LANE``: dialed by stage k to stage k+1; carries messages down and replies
    up. ``TOKEN_RETURN``: dialed by the final stage to stage 0; carries only
    replies, from dialer to acceptor: the predictions (or errors) of
    DIRECT_RETURN sessions, and ``Ack(0, 0)`` keepalives.
    """

    LANE = 1
    TOKEN_RETURN = 2


# --------------------------------------------------------------------------
# converters and validators


def _as_tokens(value: object) -> np.ndarray:
    arr = np.asarray(value, dtype="<i4")
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    return arr


def _as_activation(value: object) -> np.ndarray | None:
    if value is None:
        return None
    arr = np.asarray(value, dtype="<f4")
    if arr.ndim != 2:
        raise ValueError(f"activation must be (tokens, n_embd), got shape {arr.shape}")
    return arr


def _tokens_eq(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))


def _restore_eq(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return _tokens_eq(a, b)


def _activation_eq(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    # bitwise: NaN payloads and signed zeros must survive the wire unchanged
    return a.shape == b.shape and bool(np.array_equal(a.view("<u4"), b.view("<u4")))




def _int_range(lo: int, hi: int):
    def check(_inst: object, attribute: attrs.Attribute, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ValueError(f"{attribute.name} must be an integer in [{lo}, {hi}], got {value!r}")

    return check


_u64 = _int_range(0, _U64)
_u32 = _int_range(0, _U32)
_i32 = _int_range(-(2**31), 2**31 - 1)
_position = _int_range(0, MAX_POSITION)


def _check_tokens(tokens: np.ndarray, *, lo: int, hi: int, what: str) -> None:
    if not lo <= len(tokens) <= hi:
        raise ValueError(f"{what} needs {lo}..{hi} tokens, got {len(tokens)}")


def _check_positions(pos_start: int, n_tokens: int) -> None:
    if pos_start + n_tokens > MAX_POSITION:
        raise ValueError(f"positions {pos_start}+{n_tokens} overflow int32")


def _check_activation(activation: np.ndarray | None, n_tokens: int) -> None:
    if activation is None:
        return
    rows, n_embd = activation.shape
    if rows != n_tokens:
        raise ValueError(f"activation has {rows} rows for {n_tokens} tokens")
    if not 1 <= n_embd <= MAX_N_EMBD:
        raise ValueError(f"activation width {n_embd} outside 1..{MAX_N_EMBD}")
    if activation.nbytes > MAX_ACTIVATION_BYTES:
        raise ValueError(f"activation is {activation.nbytes} bytes, at most {MAX_ACTIVATION_BYTES}")


def _truncate_utf8(limit: int):
    def convert(value: str) -> str:
        data = value.encode("utf-8")
        if len(data) <= limit:
            return value
        return data[:limit].decode("utf-8", errors="ignore")

    return convert


def _utf8_len(limit: int):
    def check(_inst: object, attribute: attrs.Attribute, value: str) -> None:
        if len(value.encode("utf-8")) > limit:
            raise ValueError(f"{attribute.name} longer than {limit} UTF-8 bytes")

    return check


# --------------------------------------------------------------------------
# limits


@attrs.frozen
class Limits:
    """Receiver-side limits, checked before anything is allocated.

    Each may only tighten the protocol's hard limit of the same name (for
    example ``max_tokens`` = the stage's ``n_batch``).
    """

    max_tokens: int = attrs.field(default=MAX_TOKENS, validator=_int_range(1, MAX_TOKENS))
    max_n_embd: int = attrs.field(default=MAX_N_EMBD, validator=_int_range(1, MAX_N_EMBD))
    max_activation_bytes: int = attrs.field(
        default=MAX_ACTIVATION_BYTES, validator=_int_range(0, MAX_ACTIVATION_BYTES)
    )
    max_logit_bias: int = attrs.field(default=MAX_LOGIT_BIAS, validator=_int_range(0, MAX_LOGIT_BIAS))
    max_error_message: int = attrs.field(
        default=MAX_ERROR_MESSAGE_BYTES, validator=_int_range(0, MAX_ERROR_MESSAGE_BYTES)
    )
    max_frame_bytes: int = attrs.field(default=MAX_FRAME_BYTES, validator=_int_range(64, MAX_FRAME_BYTES))


DEFAULT_LIMITS = Limits()


# --------------------------------------------------------------------------
# sampling and stats


@attrs.frozen
class StageStats:
    """Per-stage timings carried by every reply, merged on the way up.

    All times are microseconds. See :func:`merge` for how two reports combine.

    ``compute_us``          time in llama_decode for this message (sum)
    ``compute_us_max``      slowest single stage's compute (max)
    ``queue_us``            time waiting for the stage's scheduler (sum)
    ``forward_write_us``    time writing the frame downstream (sum)
    ``downstream_wait_us``  time from forward write to downstream reply (max:
                            the outermost stage's wait already contains every
                            inner one)
    ``bytes_sent``          frame bytes written downstream (sum)
    ``stage_count``         per-stage reports folded in (sum): n for one
                            message through n stages; more when deferred acks
                            were folded into a later reply
    ``slowest_stage``       stage index that reported ``compute_us_max``
    """

    compute_us: int = 0
    compute_us_max: int = 0
    queue_us: int = 0
    forward_write_us: int = 0
    downstream_wait_us: int = 0
    bytes_sent: int = 0
    stage_count: int = 0
    slowest_stage: int = 0

    @classmethod
    def single(
        cls,
        stage_index: int,
        *,
        compute_us: int = 0,
        queue_us: int = 0,
        forward_write_us: int = 0,
        downstream_wait_us: int = 0,
        bytes_sent: int = 0,
    ) -> StageStats:
        """One stage's own report for one message."""
        # every stage reports for every token: built without attrs' keyword __init__ (nothing to check)
        return TRUSTED[cls](compute_us, compute_us, queue_us, forward_write_us, downstream_wait_us, bytes_sent, 1,
                            stage_index)


def merge(a: StageStats, b: StageStats) -> StageStats:
    """Combine two reports: sums for work and bytes, max for waits and maxima.

    Used both when a stage adds its own report to its downstream's reply and
    when deferred acks are folded into a later reply. ``StageStats()`` is the
    identity; sums saturate at 2**64-1 (``stage_count`` at 2**32-1).
    ``slowest_stage`` follows the larger ``compute_us_max`` (``a`` on ties).
    """
    slowest = a if a.compute_us_max >= b.compute_us_max else b
    # the fields in order (compute_us, compute_us_max, queue_us, forward_write_us, downstream_wait_us,
    # bytes_sent, stage_count, slowest_stage), without attrs' keyword __init__: stages merge every token
    return TRUSTED[StageStats](
        min(a.compute_us + b.compute_us, _U64),
        slowest.compute_us_max,
        min(a.queue_us + b.queue_us, _U64),
        min(a.forward_write_us + b.forward_write_us, _U64),
        max(a.downstream_wait_us, b.downstream_wait_us),
        min(a.bytes_sent + b.bytes_sent, _U64),
        min(a.stage_count + b.stage_count, _U32),
        slowest.slowest_stage,
    )


def merge_all(reports: list[StageStats]) -> StageStats:
    """``merge`` of every report, left to right."""
    total = StageStats()
    for report in reports:
        total = merge(total, report)
    return total


@attrs.define
class StatsTotal:
    """A running :func:`merge` of reports, kept in place: the head folds two or three into it per token, and
    a new StageStats per report (as merge makes) would cost every token. :meth:`total` is what merge_all of
    the same reports, in the same order, gives."""

    compute_us: int = 0
    compute_us_max: int = 0
    queue_us: int = 0
    forward_write_us: int = 0
    downstream_wait_us: int = 0
    bytes_sent: int = 0
    stage_count: int = 0
    slowest_stage: int = 0

    def add(self, s: StageStats) -> None:
        """Fold in one report."""
        if s.compute_us_max > self.compute_us_max:  # merge keeps the left one on ties: the total so far
            self.compute_us_max, self.slowest_stage = s.compute_us_max, s.slowest_stage
        self.compute_us = min(self.compute_us + s.compute_us, _U64)
        self.queue_us = min(self.queue_us + s.queue_us, _U64)
        self.forward_write_us = min(self.forward_write_us + s.forward_write_us, _U64)
        self.downstream_wait_us = max(self.downstream_wait_us, s.downstream_wait_us)
        self.bytes_sent = min(self.bytes_sent + s.bytes_sent, _U64)
        self.stage_count = min(self.stage_count + s.stage_count, _U32)

    def add_compute(self, stage_index: int, compute_us: int, queue_us: int) -> None:
        """Fold in ``StageStats.single(stage_index, compute_us=..., queue_us=...)`` without building it."""
        if compute_us > self.compute_us_max:
            self.compute_us_max, self.slowest_stage = compute_us, stage_index
        self.compute_us = min(self.compute_us + compute_us, _U64)
        self.queue_us = min(self.queue_us + queue_us, _U64)
        self.stage_count = min(self.stage_count + 1, _U32)

    def add_hop(self, forward_write_us: int, downstream_wait_us: int, bytes_sent: int) -> None:
        """Fold in a hop's report (``StageStats(forward_write_us=..., downstream_wait_us=..., bytes_sent=...)``)."""
        self.forward_write_us = min(self.forward_write_us + forward_write_us, _U64)
        self.downstream_wait_us = max(self.downstream_wait_us, downstream_wait_us)
        self.bytes_sent = min(self.bytes_sent + bytes_sent, _U64)

    def total(self) -> StageStats:
        return StageStats(self.compute_us, self.compute_us_max, self.queue_us, self.forward_write_us,
                          self.downstream_wait_us, self.bytes_sent, self.stage_count, self.slowest_stage)


NO_STATS = StageStats()  # the empty report, merge's identity (a frozen instance, shared)
_NO_TOKENS = np.zeros(0, dtype="<i4")
_NO_TOKENS.flags.writeable = False


# --------------------------------------------------------------------------
# messages (upstream → downstream)


def _tokens_field():
    return attrs.field(converter=_as_tokens, eq=attrs.cmp_using(eq=_tokens_eq), hash=False)


def _activation_field():
    return attrs.field(
        default=None, converter=_as_activation, eq=attrs.cmp_using(eq=_activation_eq), hash=False
    )


@attrs.frozen
class ConfigureGeneration:
    """Opens a session on every stage: sampler settings for the final stage.

    ``direct_return``: predictions of this session travel on the final
    stage's token-return connection (the lane still gets one Ack per
    message). Reply: ``Ack``, or ``ErrorReply`` DIRECT_RETURN_UNAVAILABLE
    when the final stage has no token-return connection (configure again
    without it). Middle stages forward it unchanged.
    """

    kind: ClassVar[MessageKind] = MessageKind.CONFIGURE_GENERATION
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    sampling: SamplingParams = attrs.field(validator=attrs.validators.instance_of(SamplingParams))
    direct_return: bool = attrs.field(default=False, converter=bool)


def _as_positions(value: object) -> np.ndarray:
    arr = np.asarray(value, dtype="<i4")
    if arr.ndim == 1:
        arr = arr.reshape(1, -1)
    if arr.ndim != 2 or arr.shape[0] not in (1, MAX_POSITION_SECTIONS):
        raise ValueError(f"positions must be (sections, rows) with 1 or {MAX_POSITION_SECTIONS} sections, got "
                         f"shape {arr.shape}")
    return arr


@attrs.frozen
class MediaRows:
    """What makes a prefill chunk's rows media rows (an image's: rows that are no tokens, computed from the
    input embeddings a projector made): their positions, given rather than counted, and what they take.

    ``positions``: int32 ``(sections, rows)``, section-major: one per row, or the four an M-RoPE model takes
    (time, image row, image column, 0); a text row's are (p, p, p, 0) there. ``pos_end``: the position the
    session is at after the chunk (the next message starts there), which is not the count of its rows (an
    M-RoPE image takes max(width, height) positions; a chunk that ends inside such an image takes none until
    its last part). ``keys``: one int32 per position of ``[pos_start, pos_end)``, what a prefix cache keys
    them by in place of token ids (negative: derived from the image's content and place). ``causal`` False:
    the rows attend to each other both ways (computed in one batch with causal attention off)."""

    positions: np.ndarray = attrs.field(converter=_as_positions, eq=attrs.cmp_using(eq=_tokens_eq), hash=False)
    pos_end: int = attrs.field(validator=_position)
    keys: np.ndarray = _tokens_field()
    causal: bool = attrs.field(default=True, converter=bool)

    @property
    def sections(self) -> int:
        return int(self.positions.shape[0])


def check_media_rows(media: MediaRows, pos_start: int, tokens: np.ndarray) -> None:
    n = len(tokens)
    if media.positions.shape[1] != n:
        raise ValueError(f"media rows: {media.positions.shape[1]} positions per section for {n} rows")
    if media.pos_end < pos_start:
        raise ValueError(f"media rows: pos_end {media.pos_end} before pos_start {pos_start}")
    if len(media.keys) != media.pos_end - pos_start:
        raise ValueError(f"media rows: {len(media.keys)} keys for positions [{pos_start}, {media.pos_end})")
    counted = media.positions[:3]  # the fourth section of an M-RoPE row is no position along the sequence
    if n and (int(counted.min()) < pos_start or int(media.positions.max()) >= MAX_POSITION):
        raise ValueError(f"media rows: positions outside [{pos_start}, {MAX_POSITION})")
    if n and int(media.positions.min()) < 0:
        raise ValueError("media rows: a negative position")
    if not np.all(tokens == NO_TOKEN):
        raise ValueError(f"media rows: their tokens must be {NO_TOKEN} (no token)")


@attrs.frozen
class PrefillChunk:
    """Prompt tokens ``[pos_start, pos_start + len(tokens))`` and their hidden states, or (``media``) media
    rows, whose tokens are NO_TOKEN, with their positions (see :class:`MediaRows`).

    Reply: ``Ack`` (sent before compute) unless ``final``; the final chunk is
    answered with ``PredictedToken`` (the first generated token).
    ``activation`` is None only when the receiver embeds tokens itself.
    ``restore``: the first chunk of a prompt (``pos_start`` 0, text) may carry the keys of the prompt's
    positions to look up: each stage first restores the longest prefix of them its prefix cache holds (as
    for a RestorePrefix, whose trip this spares), then holds what it restored of the chunk's positions as
    it holds a restored prefix past where a prefill starts (see skippyd/stage/boundary.py).
    """

    kind: ClassVar[MessageKind] = MessageKind.PREFILL
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    pos_start: int = attrs.field(validator=_position)
    tokens: np.ndarray = _tokens_field()
    activation: np.ndarray | None = _activation_field()
    final: bool = attrs.field(default=False, converter=bool)
    media: MediaRows | None = None
    restore: np.ndarray | None = attrs.field(default=None, converter=attrs.converters.optional(_as_tokens),
                                             eq=attrs.cmp_using(eq=_restore_eq), hash=False)

    def __attrs_post_init__(self) -> None:
        _check_tokens(self.tokens, lo=1, hi=MAX_TOKENS, what="PrefillChunk")
        _check_positions(self.pos_start, len(self.tokens))
        _check_activation(self.activation, len(self.tokens))
        if self.media is not None:
            check_media_rows(self.media, self.pos_start, self.tokens)
        if self.restore is not None:
            _check_tokens(self.restore, lo=1, hi=MAX_TOKENS, what="PrefillChunk restore block")
            if self.pos_start or self.media is not None:
                raise ValueError("a restore block rides only on a prompt's first chunk: position 0, text")

    @property
    def pos_end(self) -> int:
        """Where the session is once the chunk is computed (the next message's ``pos_start``)."""
        return self.pos_start + len(self.tokens) if self.media is None else self.media.pos_end

    @property
    def keys(self) -> np.ndarray:
        """What the positions ``[pos_start, pos_end)`` hold, as a prefix cache keys them: the tokens, or the
        media rows' keys."""
        return self.tokens if self.media is None else self.media.keys


@attrs.frozen
class DecodeStep:
    """One generated token at ``pos_start`` (authoritative: a stage that is
    ahead trims to ``pos_start`` first). Reply: ``PredictedToken``; with
    ``direct_return`` the prediction goes on the token-return connection and
    nothing comes back on the lane unless a middle stage fails (an Error)."""

    kind: ClassVar[MessageKind] = MessageKind.DECODE
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    pos_start: int = attrs.field(validator=_position)
    tokens: np.ndarray = _tokens_field()
    activation: np.ndarray | None = _activation_field()
    direct_return: bool = attrs.field(default=False, converter=bool)

    def __attrs_post_init__(self) -> None:
        _check_tokens(self.tokens, lo=1, hi=1, what="DecodeStep")
        _check_positions(self.pos_start, 1)
        _check_activation(self.activation, 1)

    @property
    def token(self) -> int:
        return int(self.tokens[0])


@attrs.frozen
class VerifyWindow:
    """Several tokens (current + drafts) decoded at once for speculative
    decoding; ``pos_start`` is authoritative. Reply: ``PredictedTokens``, the
    drafts accepted and the next token. ``chained``: sent behind a window not
    yet answered, valid only if that one's answer ends at ``pos_start`` with
    ``tokens[0]``; the final stage answers one that is not with no tokens
    (dropped, never computed there)."""

    kind: ClassVar[MessageKind] = MessageKind.VERIFY_WINDOW
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    pos_start: int = attrs.field(validator=_position)
    tokens: np.ndarray = _tokens_field()
    activation: np.ndarray | None = _activation_field()
    chained: bool = False

    def __attrs_post_init__(self) -> None:
        _check_tokens(self.tokens, lo=1, hi=MAX_TOKENS, what="VerifyWindow")
        _check_positions(self.pos_start, len(self.tokens))
        _check_activation(self.activation, len(self.tokens))


@attrs.frozen
class TrimSession:
    """Keep positions ``[0, pos_start)`` of the session, drop the rest. Reply: ``Ack``. The head sends none (a
    message's ``pos_start`` trims a stage that is ahead); a stage still answers one."""

    kind: ClassVar[MessageKind] = MessageKind.TRIM_SESSION
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    pos_start: int = attrs.field(validator=_position)


@attrs.frozen
class Stop:
    """End the session (release its KV sequence); the lane stays open. Reply: ``Stopped``."""

    kind: ClassVar[MessageKind] = MessageKind.STOP
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)


@attrs.frozen
class Ping:
    """Liveness check (the head's watch lane). Reply: ``Ack`` with the same ``request_id``
    from the final stage; a middle stage relays it, and answers DOWNSTREAM_FAILED
    naming the next stage if that one does not answer in time."""

    kind: ClassVar[MessageKind] = MessageKind.PING
    request_id: int = attrs.field(validator=_u64)


@attrs.frozen
class RestorePrefix:
    """Restore into the session (opened if need be, as by a ConfigureGeneration) the longest prefix of
    ``tokens`` (positions 0..) that this stage's prefix cache holds; a hit under the cache's minimum counts
    as none. A middle stage forwards it unchanged, whatever it holds (a later stage may hold more, and what it
    holds past where the prefill starts it need not compute), and answers the smaller of its own hit and the
    next stage's answer. Reply: ``PrefixRestored``."""

    kind: ClassVar[MessageKind] = MessageKind.RESTORE_PREFIX
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    tokens: np.ndarray = _tokens_field()

    def __attrs_post_init__(self) -> None:
        _check_tokens(self.tokens, lo=1, hi=MAX_TOKENS, what="RestorePrefix")


@attrs.frozen
class CacheQuery:
    """Report this stage's prefix cache and every later stage's (with ``clear``: empty each first).
    Reply: ``CacheReport``, one record per stage from this one to the final stage."""

    kind: ClassVar[MessageKind] = MessageKind.CACHE_QUERY
    request_id: int = attrs.field(validator=_u64)
    clear: bool = attrs.field(default=False, converter=bool)
    clear_disk: bool = attrs.field(default=False, converter=bool)  # empty the disk tier too


@attrs.frozen
class StageQuery:
    """Report this stage's load and every later stage's. Reply: ``StageReport``, one record per stage from
    this one to the final stage."""

    kind: ClassVar[MessageKind] = MessageKind.STAGE_QUERY
    request_id: int = attrs.field(validator=_u64)


Message: TypeAlias = (ConfigureGeneration | PrefillChunk | DecodeStep | VerifyWindow | TrimSession | Stop | Ping
                      | RestorePrefix | CacheQuery | StageQuery)


# --------------------------------------------------------------------------
# replies (downstream → upstream)


@attrs.frozen
class Ack:
    kind: ClassVar[ReplyKind] = ReplyKind.ACK
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    stats: StageStats = NO_STATS


@attrs.frozen
class PredictedToken:
    kind: ClassVar[ReplyKind] = ReplyKind.PREDICTED_TOKEN
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    token: int = attrs.field(validator=_i32)
    stats: StageStats = NO_STATS


def _top_logprobs(inst, attribute, value) -> None:
    if len(value) > MAX_TOP_LOGPROBS:
        raise ValueError(f"{len(value)} alternatives, at most {MAX_TOP_LOGPROBS}")
    for token, _ in value:
        _i32(inst, attribute, token)


@attrs.frozen
class PredictedTokenLogprobs(PredictedToken):
    """A PredictedToken of a session configured with logprobs: the token's log-probability under the
    distribution the final stage sampled it from, and its most likely alternatives ``(token, logprob)``,
    most likely first (as many as the session asked for; fewer where fewer tokens could be sampled)."""

    kind: ClassVar[ReplyKind] = ReplyKind.PREDICTED_TOKEN_LOGPROBS
    logprob: float = attrs.field(default=0.0, converter=float)
    top: tuple[tuple[int, float], ...] = attrs.field(
        default=(), converter=lambda v: tuple((int(t), float(lp)) for t, lp in v), validator=_top_logprobs)


@attrs.frozen
class PredictedTokens:
    kind: ClassVar[ReplyKind] = ReplyKind.PREDICTED_TOKENS
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    tokens: np.ndarray = _tokens_field()
    stats: StageStats = NO_STATS

    def __attrs_post_init__(self) -> None:
        _check_tokens(self.tokens, lo=0, hi=MAX_TOKENS, what="PredictedTokens")


@attrs.frozen
class ErrorReply:
    """A failed request (code >= 32) or a protocol error (code < 32, after
    which the sender closes the connection). ``message`` is cut to
    MAX_ERROR_MESSAGE_BYTES of UTF-8 on construction."""

    kind: ClassVar[ReplyKind] = ReplyKind.ERROR
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    code: ErrorCode = attrs.field(converter=ErrorCode)
    message: str = attrs.field(converter=_truncate_utf8(MAX_ERROR_MESSAGE_BYTES))
    stats: StageStats = NO_STATS


@attrs.frozen
class PrefixRestored:
    """The answer to a RestorePrefix: ``restored`` positions, from 0, that this stage and every later
    one now hold for the session (0: a miss)."""

    kind: ClassVar[ReplyKind] = ReplyKind.PREFIX_RESTORED
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    restored: int = attrs.field(validator=_u32)
    stats: StageStats = NO_STATS


def _cached_counts(_inst: object, attribute: attrs.Attribute, value: tuple) -> None:
    if not 1 <= len(value) <= MAX_CACHE_REPORT_STAGES:
        raise ValueError(f"{attribute.name}: {len(value)} counts, 1..{MAX_CACHE_REPORT_STAGES}")
    for n in value:
        if not 0 <= n <= _U32:
            raise ValueError(f"{attribute.name}: {n} is not a u32")


@attrs.frozen
class Stopped:
    """The answer to a Stop: ``cached``, one count per stage from the one asked to the final stage, the
    leading positions of the session's prompt that stage held (restored from its prefix cache) rather than
    computed (0: it computed the whole prompt, or did not know the session)."""

    kind: ClassVar[ReplyKind] = ReplyKind.STOPPED
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    cached: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(n) for n in v), validator=_cached_counts)
    stats: StageStats = NO_STATS


@attrs.frozen
class CacheStats:
    """One stage's prefix cache, as a CacheReport carries it (pure data; the counters count from the
    stage's start).

    ``budget_bytes``     most bytes the cache may hold (0: off)
    ``bytes_held``       bytes it holds (KV state, token ids and, before the final stage, the hidden states
                         recorded with each entry)
    ``entries``          prefixes it holds
    ``tokens_held``      tokens of those prefixes, summed
    ``lookups``, ``hits``  restores asked for, and those that restored something
    ``restored_tokens``  positions restored, summed
    ``recorded_tokens``  tokens of the prefixes recorded, summed
    ``evictions``        entries dropped to stay within the budget
    ``disk_on``          whether the disk tier is in use (see skippyd/stage/prefix_disk.py)
    ``disk_*``           the disk tier: its budget, bytes, entries and their tokens, the hits it served
                         (``hits`` counts them too; ``memory_hits`` in to_json is the rest) and the entries
                         written to it
    """

    stage_index: int = attrs.field(validator=_u32)
    budget_bytes: int = attrs.field(default=0, validator=_u64)
    bytes_held: int = attrs.field(default=0, validator=_u64)
    entries: int = attrs.field(default=0, validator=_u64)
    tokens_held: int = attrs.field(default=0, validator=_u64)
    lookups: int = attrs.field(default=0, validator=_u64)
    hits: int = attrs.field(default=0, validator=_u64)
    restored_tokens: int = attrs.field(default=0, validator=_u64)
    recorded_tokens: int = attrs.field(default=0, validator=_u64)
    evictions: int = attrs.field(default=0, validator=_u64)
    disk_on: bool = attrs.field(default=False, converter=bool)
    disk_budget_bytes: int = attrs.field(default=0, validator=_u64)
    disk_bytes: int = attrs.field(default=0, validator=_u64)
    disk_entries: int = attrs.field(default=0, validator=_u64)
    disk_tokens: int = attrs.field(default=0, validator=_u64)
    disk_hits: int = attrs.field(default=0, validator=_u64)
    disk_writes: int = attrs.field(default=0, validator=_u64)

    @property
    def hit_rate(self) -> float:
        """``hits / lookups``; 0.0 before any lookup."""
        return self.hits / self.lookups if self.lookups else 0.0

    def to_json(self) -> dict[str, int | float]:
        """The fields by name, ``hit_rate`` and ``memory_hits`` (the hits memory served)."""
        return {**attrs.asdict(self), "hit_rate": self.hit_rate, "memory_hits": self.hits - self.disk_hits}


def _records_of(cls: type):
    """The check of a report's records: at most one per stage (MAX_CACHE_REPORT_STAGES), each a ``cls``."""

    def check(_inst: object, attribute: attrs.Attribute, value: tuple) -> None:
        if len(value) > MAX_CACHE_REPORT_STAGES:
            raise ValueError(f"{attribute.name}: {len(value)} records, at most {MAX_CACHE_REPORT_STAGES}")
        for record in value:
            if not isinstance(record, cls):
                raise TypeError(f"{attribute.name} holds {type(record).__name__}, not {cls.__name__}")

    return check


@attrs.frozen
class CacheReport:
    """The answer to a CacheQuery: one :class:`CacheStats` per stage, from the one asked to the final
    stage, in stage order."""

    kind: ClassVar[ReplyKind] = ReplyKind.CACHE_REPORT
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    stages: tuple[CacheStats, ...] = attrs.field(converter=tuple, validator=_records_of(CacheStats))
    stats: StageStats = NO_STATS


@attrs.frozen
class StageLoad:
    """One stage's load, as a StageReport carries it (pure data). The counters count from the stage's start;
    whoever reads two reports divides their differences (``compute_us`` over ``clock_us``: the share of the
    time the stage computed).

    ``clock_us``          the stage's monotonic clock
    ``compute_us``        time in llama_decode, summed
    ``batches``           llama_decode calls; ``tokens``: the rows they computed
    ``sessions``          live sessions (KV sequences); ``n_seq_max``: its slots
    ``kv_tokens``         positions those sessions hold; ``kv_capacity``: the context's cells
    ``cache_bytes``       bytes its prefix cache holds; ``cache_budget``: the most it may hold (0: off)
    ``downstream_rtt_us`` the round trip of this query to the next stage, less that stage's own time
                          answering it (0: the final stage, or the next one did not answer)
    ``answer_us``         this stage's time from the query to its report (the stages after it included)
    """

    stage_index: int = attrs.field(validator=_u32)
    layer_start: int = attrs.field(default=0, validator=_u32)
    layer_end: int = attrs.field(default=0, validator=_u32)
    n_seq_max: int = attrs.field(default=0, validator=_u32)
    clock_us: int = attrs.field(default=0, validator=_u64)
    compute_us: int = attrs.field(default=0, validator=_u64)
    batches: int = attrs.field(default=0, validator=_u64)
    tokens: int = attrs.field(default=0, validator=_u64)
    sessions: int = attrs.field(default=0, validator=_u64)
    kv_tokens: int = attrs.field(default=0, validator=_u64)
    kv_capacity: int = attrs.field(default=0, validator=_u64)
    cache_bytes: int = attrs.field(default=0, validator=_u64)
    cache_budget: int = attrs.field(default=0, validator=_u64)
    downstream_rtt_us: int = attrs.field(default=0, validator=_u64)
    answer_us: int = attrs.field(default=0, validator=_u64)


@attrs.frozen
class StageReport:
    """The answer to a StageQuery: one :class:`StageLoad` per stage, from the one asked to the final stage,
    in stage order (as many records at most as a CacheReport)."""

    kind: ClassVar[ReplyKind] = ReplyKind.STAGE_REPORT
    request_id: int = attrs.field(validator=_u64)
    session_id: int = attrs.field(validator=_u64)
    stages: tuple[StageLoad, ...] = attrs.field(converter=tuple, validator=_records_of(StageLoad))
    stats: StageStats = NO_STATS


Reply: TypeAlias = (Ack | PredictedToken | PredictedTokenLogprobs | PredictedTokens | ErrorReply | PrefixRestored
                    | CacheReport | StageReport | Stopped)


def with_stats(reply: Reply, stats: StageStats) -> Reply:
    """`reply` carrying `stats` instead. Every decode step's reply is rebuilt so on each stage on its way
    up: the two kinds it can be are built directly, which is several times cheaper than ``attrs.evolve``."""
    if type(reply) is PredictedToken:  # its fields were checked when it was made: not again
        return TRUSTED[PredictedToken](reply.request_id, reply.session_id, reply.token, stats)
    if type(reply) is Ack:
        return TRUSTED[Ack](reply.request_id, reply.session_id, stats)
    return attrs.evolve(reply, stats=stats)


T = TypeVar("T")


def _trusted_builder(cls: type[T]) -> Callable[..., T]:
    """A function of one value per field of `cls`, in order, that makes an instance with them neither
    converted nor validated. Generated as straight-line code, as attrs generates ``__init__``: a loop over
    the fields costs as much again for the per-token replies."""
    names = [f.name for f in attrs.fields(cls)]
    params = ", ".join(f"v{i}" for i in range(len(names)))
    lines = [f"def trusted_{cls.__name__}({params}):", "    inst = new(cls)"]
    # object.__setattr__ is how attrs' own __init__ sets a frozen class's fields
    lines += [f"    set_field(inst, {name!r}, v{i})" for i, name in enumerate(names)]
    lines.append("    return inst")
    namespace = {"new": object.__new__, "set_field": object.__setattr__, "cls": cls}
    exec("\n".join(lines), namespace)  # the source is made above from the class's field names
    return namespace[f"trusted_{cls.__name__}"]


def trusted(cls: type[T], *values: object) -> T:
    """An instance of the message or reply class `cls` from `values`, one per field in order, neither
    converted nor validated: for values whose range is certain already, such as the codec's (its decode
    checked every field of the frame; the per-token frames are decoded on every stage for every token, and
    the class's checks would repeat its own). Hot paths hold :data:`TRUSTED` ``[cls]`` instead."""
    return TRUSTED[cls](*values)


# --------------------------------------------------------------------------
# handshake


def _as_fingerprint(value: bytes | str) -> bytes:
    if isinstance(value, str):
        value = bytes.fromhex(value)
    value = bytes(value)
    if len(value) != 32:
        raise ValueError(f"model fingerprint must be 32 bytes (sha256), got {len(value)}")
    return value


_KNOWN_WIRE_FORMATS = int(WireFormat.F32 | WireFormat.F16 | WireFormat.TIMED)


def _wire_formats(_inst: object, _attribute: attrs.Attribute, value: WireFormat) -> None:
    if not value & WireFormat.F32 or int(value) & ~_KNOWN_WIRE_FORMATS:
        raise ValueError(f"wire formats 0x{int(value):02x}: F32 (0x01) must be offered, F16 (0x02) and "
                         f"TIMED (0x04) may be")


def _auth_len(_inst: object, _attribute: attrs.Attribute, value: bytes) -> None:
    if len(value) > MAX_AUTH_BYTES:
        raise ValueError(f"auth longer than {MAX_AUTH_BYTES} bytes")


@attrs.frozen
class Hello:
    """Who is on this end of a connection; both ends send one.

    ``fingerprint``: sha256 of the whole source model (32 raw bytes; a hex
    string is accepted). ``layer_start``/``layer_end``: this stage's half-open
    layer range out of ``n_layer``. ``auth``: opaque shared token (empty =
    none), compared in constant time. ``node``: free text for logs.
    """

    kind: ClassVar[HandshakeKind] = HandshakeKind.HELLO
    fingerprint: bytes = attrs.field(converter=_as_fingerprint, repr=lambda v: v.hex())
    stage_index: int = attrs.field(validator=_u32)
    layer_start: int = attrs.field(validator=_u32)
    layer_end: int = attrs.field(validator=_u32)
    n_layer: int = attrs.field(validator=_u32)
    n_embd: int = attrs.field(validator=_int_range(1, MAX_N_EMBD))
    role: Role = attrs.field(default=Role.LANE, converter=Role)
    version: int = attrs.field(default=PROTOCOL_VERSION, validator=_int_range(0, 0xFFFF))
    auth: bytes = attrs.field(default=b"", converter=bytes, validator=_auth_len, repr=False)
    node: str = attrs.field(default="", validator=_utf8_len(MAX_NODE_NAME_BYTES))
    wire_formats: WireFormat = attrs.field(default=WireFormat.F32 | WireFormat.F16, converter=WireFormat,
                                           validator=_wire_formats)

    @property
    def is_final(self) -> bool:
        return self.layer_end == self.n_layer


@attrs.frozen
class HelloReply:
    """The dialer's verdict on the acceptor's Hello, or the acceptor's refusal.

    ``reason`` is empty when accepted; it is cut to MAX_REASON_BYTES.
    """

    kind: ClassVar[HandshakeKind] = HandshakeKind.HELLO_REPLY
    accepted: bool = attrs.field(converter=bool)
    reason: str = attrs.field(default="", converter=_truncate_utf8(MAX_REASON_BYTES))


MAX_PROBE_PADDING = 256 * 1024  # bytes of padding in one LinkProbe


class ProbeStep(enum.IntEnum):
    """What a LinkProbe is: a timed exchange (answered by an empty PROBE), or the dialer's last word (the
    encoding it chose and the rate it measured; not answered)."""

    PROBE = 0
    RESULT = 1


@attrs.frozen
class LinkProbe:
    """Timing a lane after its handshake (see :func:`link_timed`). The dialer sends PROBEs of ``padding``
    bytes, each answered by the acceptor with an empty PROBE once all of it has arrived, then a RESULT:
    ``wire`` (F32 or F16) is the encoding its activations will travel in, ``rate_kbps`` the link's rate it
    measured (kbit/s; 0: none)."""

    kind: ClassVar[HandshakeKind] = HandshakeKind.LINK_PROBE
    step: ProbeStep = attrs.field(default=ProbeStep.PROBE, converter=ProbeStep)
    padding: int = attrs.field(default=0, validator=_int_range(0, MAX_PROBE_PADDING))
    wire: WireFormat = attrs.field(default=WireFormat.F32, converter=WireFormat)
    rate_kbps: int = attrs.field(default=0, validator=_u32)

    @wire.validator
    def _check_wire(self, _attribute, value) -> None:
        if self.step == ProbeStep.RESULT and value not in (WireFormat.F32, WireFormat.F16):
            raise ValueError(f"a probe result names F32 or F16, not 0x{int(value):02x}")


Frame: TypeAlias = Message | Reply | Hello | HelloReply | LinkProbe


TRUSTED = {cls: _trusted_builder(cls) for cls in (PrefillChunk, DecodeStep, VerifyWindow, Ack, PredictedToken,
                                                   StageStats)}
