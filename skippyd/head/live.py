"""What the control plane sees of a running generation, and how it kills one."""

from __future__ import annotations

import time

import attrs
import trio

from skippyd.head.states import GenerationState


@attrs.define(eq=False)
class LiveGeneration:
    """What the control plane sees of a running generation (and how it kills one)."""

    request_id: int
    session_id: int
    prompt_tokens: int
    started: float
    cancel_scope: trio.CancelScope
    seq: int = -1
    lane_id: int | None = None
    generated: int = 0
    position: int = 0
    state: GenerationState = GenerationState.QUEUED
    killed: str | None = None  # why it was killed (see HeadEngine.kill)
    resumes: int = 0  # replays after a stage failure
    first_token_at: float | None = None  # perf_counter: the first token in hand ...
    last_token_at: float | None = None  # ... and the latest (the decode rate so far)
    speculation: object | None = None  # its drafting state (head.speculation.Speculation), once it drafts
    origin: str = "control"  # who asked: "control" (skippyctl, the control channel) or "openai"
    ttft_ms: float | None = None  # from the request to the first token (None before it)
    cached_tokens: int = 0  # prompt tokens (and image rows) no stage computed: every stage's prefix cache held them

    def describe(self) -> dict:
        return {"session_id": self.session_id, "request_id": self.request_id, "state": self.state,
                "prompt_tokens": self.prompt_tokens, "generated": self.generated, "position": self.position,
                "age_s": round(time.monotonic() - self.started, 3), "lane": self.lane_id, "resumes": self.resumes,
                "decode_tokens_per_s": None if (rate := self.decode_rate()) is None else round(rate, 2),
                "speculation": None if self.speculation is None else self.speculation.describe(),
                "stages": {"0": {"seq": self.seq}}}

    def decode_rate(self) -> float | None:
        """Tokens after the first over the time from the first to the latest (to the last, once it ended:
        not to now, as the session's Stop, a round trip through every stage, is no token's time); None before
        the second token."""
        if self.first_token_at is None or self.last_token_at is None or self.last_token_at <= self.first_token_at:
            return None
        return (self.generated - 1) / (self.last_token_at - self.first_token_at)
