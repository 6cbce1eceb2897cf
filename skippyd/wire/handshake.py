"""The handshake: both ends say who they are; either end may refuse (fail closed).

Sequence on every new connection (dialer = the side that connected)::

    dialer   → Hello                       (who I am, what I want: role)
    acceptor checks it; refuses with       HelloReply(accepted=0, reason)
             or accepts by sending its own Hello
    dialer   checks the acceptor's Hello → HelloReply(accepted=1) or (0, reason)

The acceptor never reveals its own Hello to a peer it refused. Both Hellos
name the activation encodings their end offers; an end that offers only f32 is
no refusal. Unless the dialer's Hello says TIMED, a lane's encoding follows from
the two (``messages.negotiate_wire``: f16 if both offer it) and nothing more is
exchanged. A *timed* link (``messages.link_timed``: the dialer says TIMED, the
acceptor offers f16) is timed right after the accepting HelloReply::

    dialer   → LinkProbe(padding=N)       (also opens TCP's window to N)
    acceptor → LinkProbe()                once all N bytes are in
    dialer   → LinkProbe(padding=0)       answered likewise; on a fast link, pairs of (0, N) follow
    dialer   → LinkProbe(RESULT, wire, rate_kbps)   not answered

(:func:`time_link` and :func:`report_link` on the dialer, :func:`serve_link_probes`
on the acceptor, inside :func:`handshake_server`). The rate is N over the
difference of the quickest answers to an N-byte and an empty probe, so the
link's latency drops out; the dialer chooses the encoding from it
(skippyd/stage/link_choice.py) and says which, with the rate, in its RESULT.
The dialer may send its first message right after its accepting HelloReply
(after its RESULT on a timed link); the acceptor reads it after that, through
the same ReceiveBuffer.

:func:`check_hello` is the pure validation both sides use. Each refusal
reason starts with the name of the check that failed:

* ``protocol version mismatch: peer 2, ours 1``
* ``authentication failed``
* ``model fingerprint mismatch: peer 1a2b…, ours 3c4d…``
* ``model shape mismatch: …`` (n_layer or n_embd differ)
* ``role mismatch: …``
* ``invalid layer range: …``
* ``non-adjacent stage: …``

A stage refuses a dialer whose address its allow-list does not name with
``upstream address not allowed: …`` (:func:`refuse_handshake`, before
looking at the Hello).

A middle stage may also refuse an otherwise valid upstream with
``downstream unavailable: stage K+1 at HOST:PORT: …`` when it cannot open its
own connection to the next stage (see the ``admit`` hook of
:func:`handshake_server`).
"""

from __future__ import annotations

import hmac
import math
import time
from collections.abc import Awaitable, Callable

import attrs
import trio

from skippyd.wire.errors import HandshakeRefused, ProtocolError, WireError
from skippyd.wire.messages import (
    DEFAULT_LIMITS,
    ErrorCode,
    HandshakeKind,
    Hello,
    HelloReply,
    Limits,
    LinkProbe,
    ProbeStep,
    Role,
    WireFormat,
    link_timed,
)
from skippyd.wire.stream import ReceiveBuffer, read_frame, write_frame

__all__ = ["LinkTiming", "check_hello", "handshake_client", "handshake_server", "refuse_handshake", "report_link",
           "serve_link_probes", "time_link"]

PROBE_PADDING = 32 * 1024  # bytes of a timed probe: 0.26 s at 1 Mbit/s, microseconds on a LAN
TIMED_BUDGET_S = 0.05  # a link whose full probe took this much longer than an empty one needs no second look
TIMED_ROUNDS = 3  # ... else pairs of (empty, full) probes at most, the quickest of each taken (scheduling noise)
MAX_PROBES = 2 + 2 * TIMED_ROUNDS  # what an acceptor answers at most before the RESULT

_ROLE_NAMES = {Role.LANE: "lane", Role.TOKEN_RETURN: "token-return"}


def _describe(h: Hello) -> str:
    return f"stage {h.stage_index} with layers [{h.layer_start}, {h.layer_end}) of {h.n_layer}"


def check_hello(local: Hello, peer: Hello, *, dialer: bool) -> str | None:
    """Why ``peer`` may not talk to us, or None if it may.

    ``local`` is our own Hello (our version, model, range and the role of this
    connection) and ``dialer`` says which side we are: together they are the
    expectation. A lane's dialer is stage k and its acceptor stage k+1
    (``layer_end`` of the one == ``layer_start`` of the other). A token-return
    connection is dialed by the final stage to stage 0.
    """
    if peer.version != local.version:
        return f"protocol version mismatch: peer {peer.version}, ours {local.version}"
    if local.auth and not hmac.compare_digest(peer.auth, local.auth):
        return "authentication failed"
    if peer.fingerprint != local.fingerprint:
        theirs, ours = peer.fingerprint.hex()[:16], local.fingerprint.hex()[:16]
        return f"model fingerprint mismatch: peer {theirs}…, ours {ours}…"
    if (peer.n_layer, peer.n_embd) != (local.n_layer, local.n_embd):
        return (
            f"model shape mismatch: peer n_layer {peer.n_layer} n_embd {peer.n_embd}, "
            f"ours n_layer {local.n_layer} n_embd {local.n_embd}"
        )
    if peer.role != local.role:
        return f"role mismatch: peer speaks {_ROLE_NAMES[peer.role]}, this connection is {_ROLE_NAMES[local.role]}"
    if not peer.layer_start < peer.layer_end <= peer.n_layer:
        return f"invalid layer range: peer {_describe(peer)}"

    if local.role == Role.LANE:
        upstream, downstream = (local, peer) if dialer else (peer, local)
        if upstream.stage_index + 1 != downstream.stage_index or upstream.layer_end != downstream.layer_start:
            if dialer:
                want = f"stage {local.stage_index + 1} starting at layer {local.layer_end}"
            else:
                want = f"stage {local.stage_index - 1} ending at layer {local.layer_start}"
            return f"non-adjacent stage: peer is {_describe(peer)}, expected {want}"
    elif dialer:  # we are the final stage, the peer must be stage 0
        if peer.stage_index != 0 or peer.layer_start != 0:
            return f"non-adjacent stage: token-return goes to stage 0, peer is {_describe(peer)}"
    else:  # we are stage 0, the peer must be the final stage
        if not peer.is_final or peer.stage_index <= local.stage_index:
            return f"non-adjacent stage: token-return must come from the final stage, peer is {_describe(peer)}"
    return None


async def _refuse(stream: trio.abc.SendStream, reason: str, timeout: float) -> None:
    """Best effort: tell the peer why, then let the caller raise."""
    try:
        await write_frame(stream, HelloReply(accepted=False, reason=reason), timeout=timeout)
    except WireError:
        pass


async def _read_peer_hello(
    stream: trio.abc.Stream, receive: ReceiveBuffer, limits: Limits, timeout: float, accept: set[int]
) -> Hello | HelloReply:
    """Read the peer's handshake frame; a malformed Hello is refused."""
    try:
        return await read_frame(receive, limits, timeout=timeout, accept=accept)  # type: ignore[return-value]
    except ProtocolError as exc:
        await _refuse(stream, exc.message, timeout)
        raise HandshakeRefused(exc.message, by_peer=False) from exc


async def refuse_handshake(
    stream: trio.abc.Stream,
    reason: str,
    *,
    timeout: float,
    receive: ReceiveBuffer | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> None:
    """Acceptor side: refuse a dialer whatever its Hello says (a peer address not allowed, say).

    Reads the dialer's first frame (bounded by ``timeout``; a malformed one
    is refused too) so that our refusal is not lost to a connection reset,
    then answers ``HelloReply(accepted=0, reason)``. Always raises
    HandshakeRefused(by_peer=False); the caller closes the stream.
    """
    receive = receive if receive is not None else ReceiveBuffer(stream, read_size=0)
    try:
        await read_frame(receive, limits, timeout=timeout, accept={HandshakeKind.HELLO})
    except ProtocolError:
        pass  # not a Hello: refused all the same
    except WireError:  # gone or silent: nobody to tell
        raise HandshakeRefused(reason, by_peer=False) from None
    await _refuse(stream, reason, timeout)
    raise HandshakeRefused(reason, by_peer=False)


async def handshake_client(
    stream: trio.abc.Stream,
    my_hello: Hello,
    *,
    timeout: float,
    receive: ReceiveBuffer | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> Hello:
    """Dialer side: send our Hello, check the acceptor's, confirm. Returns the peer's Hello.

    Raises HandshakeRefused (by either side), PeerClosed or a timeout. Each
    read and write has its own ``timeout``. The caller closes the stream on
    failure. Pass the connection's ReceiveBuffer as ``receive`` if it will
    be used for later frames.
    """
    receive = receive if receive is not None else ReceiveBuffer(stream, read_size=0)
    await write_frame(stream, my_hello, timeout=timeout)
    frame = await _read_peer_hello(stream, receive, limits, timeout, {HandshakeKind.HELLO, HandshakeKind.HELLO_REPLY})
    if isinstance(frame, HelloReply):
        if frame.accepted:
            reason = "peer accepted without sending its hello"
            await _refuse(stream, reason, timeout)
            raise HandshakeRefused(reason, by_peer=False)
        raise HandshakeRefused(frame.reason, by_peer=True)
    reason = check_hello(my_hello, frame, dialer=True)
    await write_frame(stream, HelloReply(accepted=reason is None, reason=reason or ""), timeout=timeout)
    if reason is not None:
        raise HandshakeRefused(reason, by_peer=False)
    return frame


async def handshake_server(
    stream: trio.abc.Stream,
    my_hello: Hello,
    *,
    timeout: float,
    receive: ReceiveBuffer | None = None,
    limits: Limits = DEFAULT_LIMITS,
    admit: Callable[[Hello], Awaitable[str | None]] | None = None,
    probe_out: trio.abc.SendStream | None = None,
    timed: Callable[[LinkProbe], None] | None = None,
) -> Hello:
    """Acceptor side: check the dialer's Hello, answer with ours, await its verdict.

    Returns the peer's Hello. On refusal (by us) the peer gets a HelloReply
    with the reason and HandshakeRefused is raised; the caller closes the
    stream and logs ``exc.reason``.

    ``admit`` (optional) runs once the peer's Hello passed the checks and
    before we answer: it returns a refusal reason, or None to accept. A
    middle stage uses it to open its own downstream connection first, so that
    an upstream is refused (with the reason) rather than accepted onto a lane
    that leads nowhere.

    A timed link (see the module's docstring) is timed before this returns: the
    answers to the dialer's probes go through ``probe_out`` (default: ``stream``;
    a conditioned link's wrapper, so that its timing sees the conditioning), and
    ``timed`` is called with the dialer's RESULT.
    """
    receive = receive if receive is not None else ReceiveBuffer(stream, read_size=0)
    peer = await _read_peer_hello(stream, receive, limits, timeout, {HandshakeKind.HELLO})
    assert isinstance(peer, Hello)
    reason = check_hello(my_hello, peer, dialer=False)
    if reason is None and admit is not None:
        reason = await admit(peer)
    if reason is not None:
        await _refuse(stream, reason, timeout)
        raise HandshakeRefused(reason, by_peer=False)
    await write_frame(stream, my_hello, timeout=timeout)
    try:
        verdict = await read_frame(receive, limits, timeout=timeout, accept={HandshakeKind.HELLO_REPLY})
    except ProtocolError as exc:
        raise HandshakeRefused(f"bad hello reply: {exc.message}", by_peer=False) from exc
    assert isinstance(verdict, HelloReply)
    if not verdict.accepted:
        raise HandshakeRefused(verdict.reason, by_peer=True)
    if link_timed(peer, my_hello):
        result = await serve_link_probes(probe_out if probe_out is not None else stream, receive, timeout=timeout,
                                         limits=limits)
        if timed is not None:
            timed(result)
    return peer


# ---------------------------------------------------------------------------------------------- timing a link


@attrs.frozen
class LinkTiming:
    """What the dialer measured of a timed link: the quickest empty round trip (s), and the rate (bytes/s) at
    which an N-byte probe arrived beyond it."""

    rtt_s: float
    rate_Bps: float
    probes: int

    @property
    def rate_kbps(self) -> int:
        """The rate as a RESULT carries it (kbit/s, at most u32)."""
        return min(2**32 - 1, int(self.rate_Bps * 8 / 1e3))


async def _probe(out: trio.abc.SendStream, receive: ReceiveBuffer, padding: int, timeout: float,
                 limits: Limits) -> float:
    """One probe and its answer: the seconds it took."""
    started = time.perf_counter()
    await write_frame(out, LinkProbe(padding=padding), timeout=timeout)
    answer = await read_frame(receive, limits, timeout=timeout, accept={HandshakeKind.LINK_PROBE})
    if answer.step != ProbeStep.PROBE or answer.padding:
        raise ProtocolError(ErrorCode.BAD_VALUE, "link probe: the answer must be an empty probe")
    return time.perf_counter() - started


async def time_link(out: trio.abc.SendStream, receive: ReceiveBuffer, *, timeout: float,
                    padding: int = PROBE_PADDING, limits: Limits = DEFAULT_LIMITS) -> LinkTiming:
    """The dialer's side of a timed link, right after its accepting HelloReply (then :func:`report_link`).
    ``out``: what the link's frames go through (a conditioned link's wrapper). Each probe's answer must come
    within ``timeout``. Raises WireError.

    A first full probe (it also opens TCP's window to its size) and an empty one: where the first took
    TIMED_BUDGET_S longer than the empty one, the link is slow and that difference is the measure (the
    probe's own transfer dwarfs the rest). Otherwise pairs of (empty, full) probes follow, the quickest of
    each taken, so that scheduling noise on a fast link does not pass for a slow one."""
    full = await _probe(out, receive, padding, timeout, limits)
    empty = await _probe(out, receive, 0, timeout, limits)
    probes = 2
    if full - empty <= TIMED_BUDGET_S:
        full = math.inf
        started = time.perf_counter()
        for _ in range(TIMED_ROUNDS):
            empty = min(empty, await _probe(out, receive, 0, timeout, limits))
            full = min(full, await _probe(out, receive, padding, timeout, limits))
            probes += 2
            if time.perf_counter() - started > TIMED_BUDGET_S:
                break
    # (a full probe answered as fast as an empty one: faster than the clock can tell, a microsecond taken)
    return LinkTiming(rtt_s=empty, rate_Bps=padding / max(full - empty, 1e-6), probes=probes)


async def report_link(out: trio.abc.SendStream, wire: WireFormat, timing: LinkTiming, *, timeout: float) -> None:
    """The dialer's RESULT: the encoding it chose for the link's activations, and the rate it measured."""
    await write_frame(out, LinkProbe(ProbeStep.RESULT, wire=wire, rate_kbps=timing.rate_kbps), timeout=timeout)


async def serve_link_probes(out: trio.abc.SendStream, receive: ReceiveBuffer, *, timeout: float,
                            limits: Limits = DEFAULT_LIMITS) -> LinkProbe:
    """The acceptor's side of a timed link: answer each probe once it is all here, until the dialer's RESULT
    (returned). More than MAX_PROBES probes, or anything else, is a protocol error."""
    for _ in range(MAX_PROBES + 1):
        probe = await read_frame(receive, limits, timeout=timeout, accept={HandshakeKind.LINK_PROBE})
        if probe.step == ProbeStep.RESULT:
            return probe
        await write_frame(out, LinkProbe(), timeout=timeout)
    raise ProtocolError(ErrorCode.LIMIT_EXCEEDED, f"link probe: more than {MAX_PROBES} probes")
