"""How a link's activations travel (``runtime.activation_wire``), chosen once per link, when it opens.

Half floats (f16) halve the bytes of every hidden state a link carries, but
round each value: a split's greedy tokens then differ from the unsplit
model's at a near-tie, and a re-planned deployment that replays a request
over other split points may continue it differently. Float32 keeps a split
exact. So "auto" (the default) keeps f32 unless the link is slow enough
that f16 saves a real share of the time:

A prompt row costs the link ``4 × n_embd`` bytes as f32 (``2 × n_embd`` as
f16) and the sending stage ``c`` seconds of compute. Prompt chunks are
pipelined (a stage computes the next chunk while the last one travels,
skippyd/stage/downstream.py), so each row costs about ``max(c, bytes / rate)``:
while the link sends a row faster than the stage computes one, f16 saves
nothing but the last chunk's trip. Once ``4 × n_embd / rate`` exceeds ``c`` the
link is what a prompt waits for, and f16 gives back ``1 − max(c, l/2) / l`` of
each row's time (``l``: the f32 row's time on the link): nothing at ``l = c``,
half from ``l = 2c`` on. Auto takes f16 from ``l ≥ RATIO × c``, where that is
at least a fifth of every prompt row's time (decode steps gain ``l / 2`` each
per hop too):

    f16  ⇔  rate ≤ 4 × n_embd / (RATIO × c)        (bytes/s; :attr:`WirePolicy.threshold_Bps`)

``c`` is the stage's own compute per prompt row, timed when it loads
(:func:`time_prompt_rows`); the rate is measured over the link itself when it
opens (skippyd/wire/handshake.py, ``time_link``). A link keeps what it chose
for its life, so a session's numerics never change in the middle of a reply.
The default model (n_embd 576) at 0.3 ms a row takes f16 below about 50
Mbit/s: never on loopback or a gigabit LAN, always at 1 Mbit/s.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

import attrs
import numpy as np

from skippyd.wire.handshake import LinkTiming
from skippyd.wire.messages import F16_RATIO, Hello, WireFormat, f16_threshold_Bps

__all__ = ["RATIO", "LinkChoice", "WirePolicy", "describe_links", "describe_upstream", "time_prompt_rows",
           "untimed"]

RATIO = F16_RATIO  # f16 once an f32 row takes this many times a row's compute on the link: f16 then saves >= 20%
TIMED_ROWS = 16  # the batch a stage times at load (after one row that warms its weights)


def time_prompt_rows(context, rows: int = TIMED_ROWS) -> float:
    """Seconds per row of a prompt batch through this stage's layers (blocking). One row first (its weights
    paged in, its caches warm), then ``rows`` in one batch, timed; sequence 0 is left empty."""
    n = max(1, min(rows, context.n_batch, context.n_ctx_seq - 1))
    pos = np.arange(1, n + 1, dtype=np.int32)
    seq = np.zeros(n, dtype=np.int32)
    try:
        if context.token_input:
            context.decode_row(0, 0, token=0)
            started = time.perf_counter()
            context.decode(pos, seq, tokens=np.zeros(n, dtype=np.int32))
        else:
            embd = np.random.default_rng(0).standard_normal((n + 1, context.n_embd_inp)).astype(np.float32)
            context.decode_row(0, 0, embd=embd[:1])
            started = time.perf_counter()
            context.decode(pos, seq, embd=embd[1:])
        return (time.perf_counter() - started) / n
    finally:
        context.kv_clear_seq(0)


@attrs.frozen
class LinkChoice:
    """What one link (a lane's hop) carries its activations as, and why."""

    wire: WireFormat  # F32 or F16
    mode: str  # runtime.activation_wire of the dialer: auto | f16 | f32
    timing: LinkTiming | None = None  # the link's timing (auto, when the next stage takes f16)
    threshold_Bps: float | None = None  # auto: the rate at or below which the link takes f16
    why: str = ""

    @property
    def name(self) -> str:
        return "f16" if self.wire & WireFormat.F16 else "f32"

    @property
    def rate_Bps(self) -> float | None:
        return None if self.timing is None else self.timing.rate_Bps

    def describe(self) -> dict:
        return {"wire": self.name, "mode": self.mode, "rate_mbps": _mbps(self.rate_Bps),
                "rtt_ms": None if self.timing is None else round(self.timing.rtt_s * 1e3, 3),
                "threshold_mbps": _mbps(self.threshold_Bps), "why": self.why}


def _mbps(rate_Bps: float | None) -> float | None:
    return None if rate_Bps is None else round(rate_Bps * 8 / 1e6, 3)


@attrs.frozen
class WirePolicy:
    """How a stage that dials a link chooses its encoding: its ``mode`` (runtime.activation_wire), the model's
    width, and its own compute per prompt row (s; 0: not timed, and auto keeps f32)."""

    mode: str = "auto"
    n_embd: int = 0
    row_compute_s: float = 0.0

    @property
    def threshold_Bps(self) -> float | None:
        """The rate (bytes/s) at or below which auto takes f16; None while the compute is not timed."""
        return f16_threshold_Bps(self.n_embd, self.row_compute_s)

    def untimed(self, negotiated: WireFormat) -> LinkChoice:
        """A link not timed: f32/f16 forced, a peer that takes only f32, or a connection for a query."""
        if self.mode == "auto":
            return LinkChoice(WireFormat.F32, self.mode, why="not timed: f32 keeps the split exact")
        why = "forced (runtime.activation_wire)" if negotiated & WireFormat.F16 or self.mode == "f32" \
            else "the next stage takes f32 only"
        return LinkChoice(negotiated, self.mode, why=why)

    def choose(self, timing: LinkTiming) -> LinkChoice:
        """Auto on a timed link: f16 when the link is slow enough that f16 saves a real share of the time."""
        threshold = self.threshold_Bps
        if threshold is None:
            return LinkChoice(WireFormat.F32, self.mode, timing, None, "this stage's compute is not timed")
        if timing.rate_Bps <= threshold:
            return LinkChoice(WireFormat.F16, self.mode, timing, threshold,
                              "the link is slower than the stage computes: f16 halves each row's time on it")
        return LinkChoice(WireFormat.F32, self.mode, timing, threshold,
                          "the link keeps up with the compute: f32 keeps the split exact")


def untimed(hello: Hello) -> Hello:
    """``hello`` for a connection that carries no activations (a query's, a liveness watch's): not timed."""
    return attrs.evolve(hello, wire_formats=hello.wire_formats & ~WireFormat.TIMED)


def describe_links(choices: Iterable[LinkChoice], to: int | None = None) -> dict | None:
    """What a stage's connections to the next stage carry: the newest timed one's choice (its rate, threshold
    and why; else the newest one's) and how many carry each encoding. None: none is open."""
    choices = list(choices)
    if not choices:
        return None
    shown = next((c for c in reversed(choices) if c.timing is not None), choices[-1])
    return {"to": to, **shown.describe(), "lanes": dict(Counter(c.name for c in choices))}


def describe_upstream(results: Iterable[tuple[WireFormat, int]], origin: int | None = None) -> dict | None:
    """What a stage's timed upstream connections carry, as their dialers said (encoding, kbit/s)."""
    results = list(results)
    if not results:
        return None
    wire, kbps = results[-1]
    name = "f16" if wire & WireFormat.F16 else "f32"
    return {"from": origin, "wire": name, "rate_mbps": round(kbps / 1e3, 3),
            "lanes": dict(Counter("f16" if w & WireFormat.F16 else "f32" for w, _ in results))}
