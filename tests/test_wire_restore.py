"""The frames of version 11: a prompt's first chunk carrying its prefix cache lookup (flag RESTORE, a restore
block), and the Stop's answer, Stopped, with each stage's prompt positions held rather than computed. Their
layout is pinned here as skippy-protocol(7) documents it; what is malformed is refused with its code."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from skippyd.wire import codec
from skippyd.wire.codec import decode_frame, frame_bytes, parse_message_header
from skippyd.wire.errors import ProtocolError
from skippyd.wire.messages import (
    MAX_CACHE_REPORT_STAGES,
    MAX_TOKENS,
    PROTOCOL_VERSION,
    CacheQuery,
    ErrorCode,
    Flags,
    Limits,
    MediaRows,
    MessageKind,
    PrefillChunk,
    ReplyKind,
    StageStats,
    Stopped,
    with_stats,
)


def header(request_id=1, session_id=2, pos=0, n_tokens=1, act_bytes=0, bias=0, ext=0) -> bytes:
    return struct.pack("<QQiIIHH", request_id, session_id, pos, n_tokens, act_bytes, bias, ext)


def prefix(kind: int, body_len: int, flags: int = 0) -> bytes:
    return struct.pack("<2sBBI", b"SK", kind, flags, body_len)


def code_of(fn, *args, **kwargs) -> ErrorCode:
    with pytest.raises(ProtocolError) as info:
        fn(*args, **kwargs)
    return info.value.code


def test_version_11():
    assert PROTOCOL_VERSION == 11


def test_restore_block_layout():
    """Flag RESTORE (0x08) on a PREFILL; ext_len counts the keys, which come before the tokens."""
    act = np.arange(8, dtype=np.float32).reshape(2, 4)
    msg = PrefillChunk(7, 9, 0, [5, 6], act, restore=[5, 6, 7, -8])
    wire = frame_bytes(msg)
    assert wire == (prefix(MessageKind.PREFILL, 32 + 16 + 8 + 32, Flags.RESTORE)
                    + header(7, 9, 0, 2, 32, 0, 4) + struct.pack("<iiii", 5, 6, 7, -8) + struct.pack("<ii", 5, 6)
                    + act.tobytes())
    got = decode_frame(bytearray(wire), n_embd=4)
    assert got == msg and list(got.restore) == [5, 6, 7, -8] and got.restore.dtype == np.dtype("<i4")
    final = decode_frame(frame_bytes(PrefillChunk(1, 2, 0, [3], None, final=True, restore=[3, 4])), n_embd=4)
    assert final.final and list(final.restore) == [3, 4]
    assert decode_frame(frame_bytes(PrefillChunk(1, 2, 0, [3])), n_embd=4).restore is None
    assert Flags.RESTORE == Flags.CLEAR  # the same bit, read per kind
    assert decode_frame(frame_bytes(CacheQuery(3, clear=True)), n_embd=4) == CacheQuery(3, True)


def test_a_restore_block_of_the_protocols_most_keys_passes_a_tight_token_limit():
    """The keys are looked up, never computed: the receiver's token limit (its batch) is not theirs."""
    msg = PrefillChunk(1, 2, 0, [1], restore=np.arange(MAX_TOKENS))
    got = decode_frame(frame_bytes(msg), n_embd=4, limits=Limits(max_tokens=16))
    assert len(got.restore) == MAX_TOKENS


@pytest.mark.parametrize(("wire", "code"), [
    # no keys, too many keys
    (prefix(MessageKind.PREFILL, 36, Flags.RESTORE) + header() + b"\0" * 4, ErrorCode.BAD_VALUE),
    (prefix(MessageKind.PREFILL, 36 + 4 * (MAX_TOKENS + 1), Flags.RESTORE) + header(ext=MAX_TOKENS + 1)
     + b"\0" * (4 * (MAX_TOKENS + 2)), ErrorCode.BAD_VALUE),
    # only at position 0
    (prefix(MessageKind.PREFILL, 40, Flags.RESTORE) + header(pos=3, ext=1) + b"\0" * 8, ErrorCode.BAD_VALUE),
    # never with media rows
    (prefix(MessageKind.PREFILL, 40, Flags.RESTORE | Flags.POSITIONS) + header(ext=1) + b"\0" * 8,
     ErrorCode.BAD_FLAGS),
    # the body disagrees with the keys' count
    (prefix(MessageKind.PREFILL, 40, Flags.RESTORE) + header(ext=2) + b"\0" * 8, ErrorCode.LENGTH_MISMATCH),
    # still not on a RestorePrefix
    (prefix(MessageKind.RESTORE_PREFIX, 36, Flags.RESTORE) + header() + b"\0" * 4, ErrorCode.BAD_FLAGS),
])
def test_malformed_restore_blocks_are_refused(wire, code):
    assert code_of(decode_frame, wire, n_embd=8) == code


def test_restore_block_constructor_checks():
    with pytest.raises(ValueError):
        PrefillChunk(1, 2, 4, [1], restore=[1, 2])  # not the first chunk
    with pytest.raises(ValueError):
        PrefillChunk(1, 2, 0, [1], restore=[])
    with pytest.raises(ValueError):
        PrefillChunk(1, 2, 0, [1], restore=range(MAX_TOKENS + 1))
    media = MediaRows([[0]], 1, [-5])
    with pytest.raises(ValueError):
        PrefillChunk(1, 2, 0, [-1], np.zeros((1, 4), np.float32), media=media, restore=[1])


def test_stopped_layout():
    stats = StageStats(1, 2, 3, 4, 5, 6, 7, 8)
    wire = frame_bytes(Stopped(5, 6, (120, 0, 2**32 - 1), stats))
    assert wire == (prefix(ReplyKind.STOPPED, 80 + 12) + struct.pack("<QQIHH", 5, 6, 3, 0, 0)
                    + struct.pack("<QQQQQQII", 1, 2, 3, 4, 5, 6, 7, 8) + struct.pack("<III", 120, 0, 2**32 - 1))
    got = decode_frame(wire)
    assert got == Stopped(5, 6, (120, 0, 2**32 - 1), stats) and got.cached == (120, 0, 2**32 - 1)
    assert with_stats(got, StageStats()).cached == got.cached
    most = Stopped(1, 2, range(MAX_CACHE_REPORT_STAGES))
    assert decode_frame(frame_bytes(most)) == most


def test_bad_stopped_replies():
    empty = struct.pack("<QQIHH", 1, 2, 0, 0, 0) + bytes(56)  # no stage
    assert code_of(decode_frame, prefix(ReplyKind.STOPPED, 80) + empty) == ErrorCode.LENGTH_MISMATCH
    assert code_of(codec.decode_reply, codec.FramePrefix(ReplyKind.STOPPED, 0, 80), empty) == ErrorCode.BAD_VALUE
    wire = bytearray(frame_bytes(Stopped(1, 2, (4, 5))))
    struct.pack_into("<I", wire, 8 + 16, 3)  # the count disagrees with the body
    assert code_of(decode_frame, wire) == ErrorCode.LENGTH_MISMATCH
    n = MAX_CACHE_REPORT_STAGES + 1
    assert code_of(codec.parse_prefix, prefix(ReplyKind.STOPPED, 80 + 4 * n)) == ErrorCode.FRAME_TOO_LARGE
    for bad in ((), (-1,), (2**32,), range(n)):
        with pytest.raises(ValueError):
            Stopped(1, 2, bad)


def test_restore_len_is_the_headers_word_count():
    p = codec.FramePrefix(MessageKind.PREFILL, int(Flags.RESTORE), 32 + 12 + 4)
    parsed = parse_message_header(p, header(ext=3), Limits(), 4)
    assert parsed.restore_len == 3 and parsed.ext_len == 0 and parsed.tail_len == 16
