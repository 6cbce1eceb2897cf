"""The stage-to-stage wire protocol (see skippy-protocol(7)).

``messages``  what travels: kinds, limits, message/reply/hello classes, stats
``codec``     the byte layout: pure encode/decode
``stream``    reading and writing frames on trio streams (deadlines, EOF)
``handshake`` hello exchange and its pure check
``errors``    the exceptions (all subclasses of WireError)
"""

from skippyd.wire.codec import decode_frame, encode_frame, error_reply_for, frame_bytes
from skippyd.wire.errors import (
    HandshakeRefused,
    PeerClosed,
    ProtocolError,
    ReadTimeout,
    WireError,
    WireTimeout,
    WriteTimeout,
)
from skippyd.wire.handshake import check_hello, handshake_client, handshake_server
from skippyd.wire.messages import *  # noqa: F403
from skippyd.wire.messages import __all__ as _messages_all
from skippyd.wire.stream import ReceiveBuffer, read_frame, read_message, read_reply, write_frame

__all__ = [
    *_messages_all,
    "HandshakeRefused",
    "PeerClosed",
    "ProtocolError",
    "ReadTimeout",
    "ReceiveBuffer",
    "WireError",
    "WireTimeout",
    "WriteTimeout",
    "check_hello",
    "decode_frame",
    "encode_frame",
    "error_reply_for",
    "frame_bytes",
    "handshake_client",
    "handshake_server",
    "read_frame",
    "read_message",
    "read_reply",
    "write_frame",
]
